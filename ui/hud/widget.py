"""HUD dock content. Interface used by the main window (keep it stable):

- on_engine_event(event): every engine event (engine.events dataclasses), on the GUI thread.
- on_token_painted(request_id, index, painted_ns): the view painted token `index`.
- mark_setting_change(name, value, t_ns): a slider changed (marker on time plots).
"""

from __future__ import annotations

from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from engine.events import EngineEvent, RequestFinished


class HudWidget(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._label = QLabel("No reply yet.")
        self._label.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.addWidget(self._label)
        layout.addStretch(1)

    def on_engine_event(self, event: EngineEvent) -> None:
        if isinstance(event, RequestFinished):
            m = event.result.metrics
            self._label.setText(
                f"TTFT {m.ttft_s * 1000:.0f} ms (queue {m.queue_s * 1000:.0f} ms, prefill "
                f"{m.prefill_s * 1000:.0f} ms)\nDecode {m.decode_tok_s:.1f} tok/s, ITL p50 "
                f"{m.itl_p50_s * 1000:.1f} ms\nPrompt {m.prompt_tokens} tokens, "
                f"{m.cached_tokens} cached"
            )

    def on_token_painted(self, request_id: str, index: int, painted_ns: int) -> None:
        """Render-lag input; the full HUD plots it."""

    def mark_setting_change(self, name: str, value: object, t_ns: int) -> None:
        """Slider-change marker; the full HUD draws it."""
