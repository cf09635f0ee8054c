"""A saved chat, read back from the chat database, as the HUD's history (and its export)."""

from __future__ import annotations

from ui.hud.model import SavedChat, saved_reply
from ui.store import STREAMING, Message


def saved_chat(chat_id: str, title: str, messages: list[Message]) -> SavedChat:
    """The chat's saved replies, each numbered by its turn (the user messages so far, as the
    window numbers a live reply), with the metrics saved when it ran. A reply still being
    written is left out: the HUD has it live."""
    turns, turn = [], 0
    for message in messages:
        if message.role == "user":
            turn += 1
        elif message.role == "assistant" and message.status != STREAMING:  # running: live
            turns.append(saved_reply(message.id, turn, message.status, message.metrics,
                                     message.settings))
    return SavedChat(chat_id, title, turns)
