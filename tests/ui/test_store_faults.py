"""Chat database faults: two instances, a locked file, a writer killed mid-reply, disk full."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ui import store as store_module
from ui.store import STOPPED, STREAMING, ChatStore, StoreError

ROOT = Path(__file__).resolve().parents[2]
WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from ui.store import ChatStore, STREAMING
    store = ChatStore(Path(sys.argv[1]))
    conv = store.create_conversation("crash")
    store.add_message(conv, "user", "hello")
    reply = store.add_message(conv, "assistant", "", status=STREAMING)
    text = ""
    for i in range(10_000_000):
        text += f"tok{i} "
        store.save_partial(reply, text)  # as the window does every 500 ms
        if i == 50:
            print(conv, reply, flush=True)
""")


def test_two_instances_share_one_file_without_corruption(tmp_path: Path) -> None:
    path = tmp_path / "chats.sqlite3"
    first, second = ChatStore(path), ChatStore(path)
    ids = []
    for i in range(30):
        for store in (first, second):
            conv = store.create_conversation(f"chat {i}")
            store.add_message(conv, "user", f"message {i}")
            ids.append(conv)
    assert {c.id for c in first.conversations()} == {c.id for c in second.conversations()}
    assert len(first.conversations()) == 60
    assert first._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    first.close()
    second.close()


def test_a_locked_database_is_never_treated_as_corrupt(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "chats.sqlite3"
    first = ChatStore(path)
    conv = first.create_conversation("kept")
    holder = sqlite3.connect(path, isolation_level=None, timeout=0.05)
    holder.execute("BEGIN IMMEDIATE")  # another instance is mid-write
    monkeypatch.setattr(store_module, "BUSY_TIMEOUT_S", 0.05)

    second = ChatStore(path)
    assert second.recovered_from is None  # not moved aside as "corrupt"
    assert list(tmp_path.glob("*.corrupt-*")) == []
    if second.open_error is not None:  # could not read it: in memory for now, and says so
        assert "locked" in second.open_error
    holder.rollback()
    holder.close()
    assert first.conversation(conv).title == "kept"


def test_killed_writer_leaves_partial_reply_marked_stopped(tmp_path: Path) -> None:
    path = tmp_path / "chats.sqlite3"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE,
                            text=True, env=env, cwd=ROOT)
    try:
        conv, reply = proc.stdout.readline().split()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL

    again = ChatStore(path)
    message = again.message(int(reply))
    assert message.status == STOPPED
    assert message.content.startswith("tok0 tok1 ") and "tok50 " in message.content
    assert again.messages(conv)[0].content == "hello"
    again.close()


@pytest.mark.parametrize(("pragma", "reason"), [
    ("max_page_count={pages}", "database or disk is full"),
    ("query_only=ON", "readonly"),
])
def test_failed_writes_raise_one_line_and_lose_nothing(
    tmp_path: Path, pragma: str, reason: str
) -> None:
    store = ChatStore(tmp_path / "chats.sqlite3")
    conv = store.create_conversation("safe")
    reply = store.add_message(conv, "assistant", "", status=STREAMING)
    store.save_partial(reply, "saved part")
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA {pragma.format(pages=pages)}")

    with pytest.raises(StoreError, match=reason) as failure:
        store.save_partial(reply, "saved part" + " and much more" * 2000)
    assert "\n" not in str(failure.value)
    with pytest.raises(StoreError):
        store.add_message(conv, "user", "x" * 20_000)
    assert store.message(reply).content == "saved part"
    assert len(store.messages(conv)) == 1
    store.close()
    assert ChatStore(tmp_path / "chats.sqlite3").message(reply).content == "saved part"


def test_unopenable_database_keeps_chats_in_memory_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "chats.sqlite3"
    path.mkdir()  # not a file at all: "unable to open database file"
    store = ChatStore(path)
    assert store.open_error is not None and "unable to open" in store.open_error
    assert store.recovered_from is None and path.is_dir()  # nothing moved aside
    conv = store.create_conversation("this session only")
    assert [c.id for c in store.conversations()] == [conv]
    store.close()
