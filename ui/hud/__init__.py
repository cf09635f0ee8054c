"""The performance HUD shown in the main window's right-hand dock."""

from ui.hud.widget import HudWidget

__all__ = ["HudWidget"]
