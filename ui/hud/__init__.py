"""The performance HUD shown in the main window's right-hand dock: the widget (widget.py), its
panels (panels.py) and the Qt-free view-model that folds the engine's events (model.py)."""
