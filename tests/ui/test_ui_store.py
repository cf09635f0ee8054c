"""Chat store: round trip, crash recovery of streaming replies, corrupt files, data dir."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from app.gui import has_display, run_gui
from ui.store import DB_NAME, STOPPED, STREAMING, ChatStore, data_dir


def test_round_trip(tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "c.sqlite3")
    conv = store.create_conversation("Title", "Be brief.")
    user = store.add_message(conv, "user", "hi")
    reply = store.add_message(conv, "assistant", "", status=STREAMING, settings={"top_p": 0.5})
    store.save_partial(reply, "Hel")
    store.finish_message(reply, "Hello", "done", {"ttft_s": 0.1})
    store.close()

    again = ChatStore(tmp_path / "c.sqlite3")
    assert again.conversation(conv).system_prompt == "Be brief."
    messages = again.messages(conv)
    assert [(m.id, m.content) for m in messages] == [(user, "hi"), (reply, "Hello")]
    assert messages[1].settings == {"top_p": 0.5}
    assert messages[1].metrics == {"ttft_s": 0.1}
    assert again._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    again.delete_from(conv, reply)
    assert [m.id for m in again.messages(conv)] == [user]


def test_reply_cut_off_by_a_crash_is_kept_as_stopped(tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "c.sqlite3")
    conv = store.create_conversation()
    reply = store.add_message(conv, "assistant", "", status=STREAMING)
    store.save_partial(reply, "partial text")
    # no finish_message: the process died here

    again = ChatStore(tmp_path / "c.sqlite3")
    message = again.message(reply)
    assert (message.content, message.status) == ("partial text", STOPPED)


def test_corrupt_file_is_backed_up(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite3"
    path.write_bytes(b"\x00garbage" * 512)
    store = ChatStore(path)
    assert store.recovered_from is not None and store.recovered_from.exists()
    conv = store.create_conversation("fresh")
    assert [c.id for c in store.conversations()] == [conv]
    with pytest.raises(sqlite3.DatabaseError):
        sqlite3.connect(store.recovered_from).execute("SELECT * FROM conversations")


def test_data_dir_env_override(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PHASEWISE_DATA_DIR", str(tmp_path / "d"))
    assert data_dir() == tmp_path / "d"
    store = ChatStore()
    assert store.path == tmp_path / "d" / DB_NAME and store.path.exists()
    store.close()


def test_no_display_exits_with_one_line(monkeypatch, capsys) -> None:
    for var in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("sys.platform", "linux")
    assert not has_display()
    assert run_gui(smoke_test=True) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no display" in err


def test_a_title_is_never_blank_and_always_one_line(tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "c.sqlite3")
    conv = store.create_conversation("   \n ")
    assert store.conversation(conv).title == "New chat"
    store.rename(conv, "  Trip\nideas  ")
    assert store.conversation(conv).title == "Trip ideas"
    for blank in ("", "  ", "\n\t"):
        with pytest.raises(ValueError, match="blank"):
            store.rename(conv, blank)
    assert store.conversation(conv).title == "Trip ideas"
    store.close()
