"""Per-reply stats in the chat database: typed columns, the migration from the first schema,
and the one-line summary shown under each reply."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from engine.events import GenerationResult, ModelInfo
from engine.metrics import RequestTimeline, compute_metrics
from ui.store import SCHEMA_VERSION, STOPPED, STREAMING, ChatStore, ReplyStats, metrics_record

# The schema as released before per-reply stats (user_version 0), verbatim.
OLD_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY,
    title TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'done',
    settings_json TEXT,
    metrics_json TEXT,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""
OLD_METRICS = {  # what the window saved before: RequestMetrics.to_dict() plus model fields
    "queue_s": 0.01, "prefill_s": 0.12, "ttft_s": 0.14, "itl_s": [0.04, 0.05], "tpot_s": 0.045,
    "decode_s": 0.09, "decode_tok_s": 24.0, "e2e_s": 0.23, "prompt_tokens": 200,
    "cached_tokens": 196, "prefilled_tokens": 4, "output_tokens": 3, "parameters": 1,
    "weight_bytes_per_step": 1, "achieved_gb_s": 0.0, "prefill_tflop_s": 0.0,
    "itl_p50_s": 0.045, "itl_p90_s": 0.049, "itl_p99_s": 0.0499,
    "cache_miss_reason": "none", "model": "SmolLM2-135M-Instruct", "device": "cpu",
    "dtype": "float32", "context_length": 8192,
}
OLD_SETTINGS = {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0,
                "repetition_penalty": 1.0, "max_tokens": 256, "seed": None, "stop": [],
                "ignore_eos": False, "model": "SmolLM2-135M-Instruct"}


def old_database(path: Path) -> None:
    db = sqlite3.connect(path)
    db.executescript(OLD_SCHEMA)
    with db:
        db.execute("INSERT INTO conversations VALUES ('c1', 'Old chat', 'Be brief.', 1.0, 2.0)")
        rows = [("user", "Hello?", "done", None, None),
                ("assistant", "Hi there.", "done", json.dumps(OLD_SETTINGS),
                 json.dumps(OLD_METRICS)),
                ("user", "And then?", "done", None, None),
                ("assistant", "Cut off", STREAMING, json.dumps(OLD_SETTINGS), None)]
        for role, content, status, settings, metrics in rows:
            db.execute("INSERT INTO messages (conversation_id, role, content, status, "
                       "settings_json, metrics_json, created) VALUES ('c1', ?, ?, ?, ?, ?, 3.0)",
                       (role, content, status, settings, metrics))
    db.close()


def test_an_old_database_is_migrated_with_its_chats_kept(tmp_path: Path) -> None:
    path = tmp_path / "chats.sqlite3"
    old_database(path)

    store = ChatStore(path)

    assert store.open_error is None and store.recovered_from is None
    assert store._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    conv = store.conversation("c1")
    assert conv is not None and (conv.title, conv.system_prompt) == ("Old chat", "Be brief.")
    messages = store.messages("c1")
    assert [(m.role, m.content) for m in messages] == [
        ("user", "Hello?"), ("assistant", "Hi there."), ("user", "And then?"),
        ("assistant", "Cut off")]
    assert messages[1].metrics == OLD_METRICS and messages[1].settings == OLD_SETTINGS
    assert messages[3].status == STOPPED  # interrupted replies are still recovered
    # The stats columns were filled from each reply's saved metrics and settings.
    stats = messages[1].stats
    assert stats is not None
    assert (stats.ttft_s, stats.decode_tok_s, stats.prompt_tokens, stats.cached_tokens) == \
        (0.14, 24.0, 200, 196)
    assert (stats.model, stats.temperature, stats.top_p, stats.max_tokens) == \
        ("SmolLM2-135M-Instruct", 0.7, 0.9, 256)
    assert stats.engine is None  # the old window did not record it
    assert [m.stats for m in messages if m.role == "user"] == [None, None]
    assert messages[3].stats is None
    store.close()


def test_new_columns_take_new_replies_and_answer_sql(tmp_path: Path) -> None:
    path = tmp_path / "chats.sqlite3"
    old_database(path)
    store = ChatStore(path)
    reply = store.add_message("c1", "assistant", "", status=STREAMING,
                              settings=OLD_SETTINGS | {"temperature": 0.0})
    store.finish_message(reply, "Done.", "done", OLD_METRICS | {
        "model": "Other-1B", "engine": "llama.cpp", "kernel": "q4_1", "decode_tok_s": 70.0})
    store.close()

    again = ChatStore(path)  # opening a current database migrates nothing
    saved = again.message(reply)
    assert saved is not None and saved.stats is not None
    assert (saved.stats.engine, saved.stats.kernel, saved.stats.temperature) == \
        ("llama.cpp", "q4_1", 0.0)
    by_model = dict(again._db.execute(
        "SELECT model, AVG(decode_tok_s) FROM messages WHERE role='assistant' "
        "AND decode_tok_s IS NOT NULL GROUP BY model").fetchall())
    assert by_model == {"SmolLM2-135M-Instruct": 24.0, "Other-1B": 70.0}
    again.close()


def test_a_fresh_database_has_the_current_schema(tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.sqlite3")
    assert store._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    conv = store.create_conversation("new")
    reply = store.add_message(conv, "assistant", "x", settings={"temperature": 0.2})
    assert store.message(reply).stats is None  # no metrics yet
    store.finish_message(reply, "x", "done", {"ttft_s": 1.5, "decode_tok_s": 8.25})
    stats = store.message(reply).stats
    assert stats == ReplyStats(ttft_s=1.5, decode_tok_s=8.25, temperature=0.2)
    store.close()


def test_metrics_record_of_a_result_names_engine_and_kernel(tmp_path: Path) -> None:
    timeline = RequestTimeline(submitted_ns=0, prefill_start_ns=10_000_000,
                               first_logits_ns=130_000_000,
                               token_ns=[140_000_000 + i * 40_000_000 for i in range(5)],
                               done_ns=310_000_000)
    metrics = compute_metrics(timeline, prompt_tokens=100, cached_tokens=98, parameters=1,
                              weight_bytes_per_step=1, cache_miss_reason="none")
    info = ModelInfo("Tiny", "folder", "/m", "cpu", "float32", 256, 1, 1, "fp32-eager")
    result = GenerationResult("r", "text", "stop", [1] * 5, [1] * 100, metrics, model=info)
    store = ChatStore(tmp_path / "chats.sqlite3")
    conv = store.create_conversation("c")
    reply = store.add_message(conv, "assistant", "", settings={"temperature": 0.7})

    store.finish_message(reply, "text", "done", metrics_record(result))

    stats = store.message(reply).stats
    assert stats is not None
    assert (stats.engine, stats.kernel, stats.model) == ("torch", "fp32-eager", "Tiny")
    assert stats.summary() == "0.14 s to first token · 25 tok/s · 98% cached"
    store.close()


def test_cached_share_never_rounds_to_none_or_all() -> None:
    assert ReplyStats(prompt_tokens=6007, cached_tokens=24).summary() == "<1% cached"
    assert ReplyStats(prompt_tokens=6007, cached_tokens=6000).summary() == ">99% cached"
    assert ReplyStats(prompt_tokens=200, cached_tokens=200).summary() == "100% cached"
    assert ReplyStats(prompt_tokens=200, cached_tokens=100).summary() == "50% cached"
    assert ReplyStats(prompt_tokens=200, cached_tokens=0).summary() == ""


def test_summary_line_leaves_out_what_is_unknown() -> None:
    assert ReplyStats().summary() == ""
    assert ReplyStats(ttft_s=12.4, decode_tok_s=7.25).summary() == \
        "12 s to first token · 7.2 tok/s"
    remote = ReplyStats.from_record(
        {"ttft_s": 0.5, "decode_tok_s": 40.0, "prompt_tokens": 0, "cached_tokens": 0,
         "prompt_tokens_known": False, "cached_tokens_known": False}, None)
    assert (remote.prompt_tokens, remote.cached_tokens, remote.cached_share) == \
        (None, None, None)
    assert remote.summary() == "0.50 s to first token · 40 tok/s"
    assert ReplyStats(ttft_s=0.2, prompt_tokens=50, cached_tokens=0).summary() == \
        "0.20 s to first token"


# ----- the line under each reply ----------------------------------------------------------------
def test_reopened_chat_shows_each_reply_stats_line(qtbot, tmp_path: Path) -> None:
    from PySide6.QtCore import QUrl

    from ui.chat_view import ChatView

    path = tmp_path / "chats.sqlite3"
    old_database(path)  # a chat saved before stats had columns: its line comes back too
    store = ChatStore(path)
    view = ChatView()
    qtbot.addWidget(view)

    view.show_messages(store.messages("c1"))

    text = view.toPlainText()
    assert text.count("0.14 s to first token · 24 tok/s · 98% cached") == 1
    reply_id = store.messages("c1")[1].id
    with qtbot.waitSignal(view.sig_action) as blocker:
        view.anchorClicked.emit(QUrl(f"pw-action:stats/{reply_id}"))
    assert blocker.args == ["stats", reply_id]
    store.close()


# ----- a reply stopped while its prompt was read (issue 31 item 4) -------------------------------
def stopped_in_prefill_record(read: int, cached: int = 24) -> dict:
    """What the window saves for a reply Stop cut inside a 5,498-token prompt's prefill."""
    timeline = RequestTimeline(submitted_ns=0, prefill_start_ns=10_000_000,
                               done_ns=8_010_000_000)
    metrics = compute_metrics(timeline, prompt_tokens=5_498, cached_tokens=cached,
                              parameters=1, weight_bytes_per_step=1,
                              cache_miss_reason="none", prefilled_tokens=read)
    return metrics.to_dict()


def test_the_line_under_a_reply_stopped_in_its_prefill_says_how_much_was_read() -> None:
    """It said only "<1% cached" (the share cached before): now the share of the prompt read
    (or cached) before Stop; its details name no TTFT, decode or ITL of 0."""
    stats = ReplyStats.from_record(stopped_in_prefill_record(4_489), None)
    assert stats.prefilled_tokens == 4_489 and stats.unread_tokens == 5_474 - 4_489
    assert stats.summary() == "82% of the prompt read before Stop · <1% cached"
    details = stats.details()
    assert "TTFT" not in details and "ITL" not in details and "tok/s" not in details
    assert "queue 0.010 s + prefill 8.000 s (stopped while reading the prompt)" in details
    assert "4,489 of 5,474 new ones read before Stop" in details
    whole = ReplyStats.from_record(stopped_in_prefill_record(5_474), None)  # read it all
    assert whole.unread_tokens == 0 and whole.summary() == "<1% cached"


def test_a_version_1_database_gains_the_prefilled_column(tmp_path: Path) -> None:
    """Schema 1 had no prefilled_tokens: the migration adds it, filled from saved metrics."""
    path = tmp_path / "chats.sqlite3"
    old_database(path)
    ChatStore(path).close()  # now current: make it version 1 again, without the column
    db = sqlite3.connect(path)
    db.execute("ALTER TABLE messages DROP COLUMN prefilled_tokens")
    db.execute("UPDATE messages SET metrics_json=? WHERE id=2",
               (json.dumps(stopped_in_prefill_record(1_000)),))
    db.execute("PRAGMA user_version=1")
    db.commit()
    db.close()

    store = ChatStore(path)
    assert store._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    stats = store.messages("c1")[1].stats
    assert stats is not None and stats.prefilled_tokens == 1_000
    assert stats.summary().startswith("19% of the prompt read before Stop")
    store.close()
