"""Chat persistence: conversations, messages, per-reply settings and metrics in SQLite (WAL).

Pure Python (stdlib sqlite3), no Qt, so it is testable on its own. Replies are written while
they stream; a reply still marked "streaming" when the store opens was cut off by a crash and
is re-marked "stopped" so the partial text is kept and labelled.

Each finished reply's headline numbers (TTFT, phases, tokens, rates, ITL percentiles, where it
ran and how it sampled) also live in typed columns, so they survive restarts, show under the
reply when its chat is reopened, and can be compared across models with plain SQL. Schema
versions are PRAGMA user_version; opening an older database migrates it in one transaction.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from platformdirs import user_data_dir

from engine.events import GenerationResult

DB_NAME = "chats.sqlite3"
SCHEMA = """
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
# Message status: done | streaming | stopped | length | error
STREAMING, DONE, STOPPED = "streaming", "done", "stopped"
# 0: before per-reply stats columns (the first released schema); 1: before prefilled_tokens
SCHEMA_VERSION = 2
# Per-reply stats columns of `messages` (schema 1): from the reply's metrics, and from its
# settings for the sampling ones. NULL where unknown (user messages, replies that failed).
METRIC_COLUMNS = (
    ("ttft_s", "REAL"), ("queue_s", "REAL"), ("prefill_s", "REAL"), ("decode_s", "REAL"),
    ("e2e_s", "REAL"), ("prompt_tokens", "INTEGER"), ("cached_tokens", "INTEGER"),
    ("output_tokens", "INTEGER"), ("decode_tok_s", "REAL"), ("itl_p50_s", "REAL"),
    ("itl_p90_s", "REAL"), ("itl_p99_s", "REAL"), ("model", "TEXT"), ("engine", "TEXT"),
    ("kernel", "TEXT"), ("device", "TEXT"), ("prefilled_tokens", "INTEGER"),
)
SETTING_COLUMNS = (("temperature", "REAL"), ("top_p", "REAL"), ("max_tokens", "INTEGER"),
                   ("seed", "INTEGER"))
STAT_COLUMNS = METRIC_COLUMNS + SETTING_COLUMNS
_MESSAGE_FIELDS = ("id, conversation_id, role, content, status, settings_json, metrics_json, "
                   + ", ".join(name for name, _ in STAT_COLUMNS))
BUSY_TIMEOUT_S = 5.0  # how long a write waits for another instance's transaction


DEFAULT_TITLE = "New chat"


def clean_title(title: str) -> str:
    """A title as one line: runs of whitespace (newlines included) become one space."""
    return " ".join(title.split())


def fmt_share(share: float) -> str:
    """A share as a whole percentage that never rounds some to none or most to all: 24 cached
    tokens of 6,007 read "<1%", not "0%"."""
    if 0 < share < 0.005:
        return "<1%"
    if 0.995 <= share < 1:
        return ">99%"
    return f"{share:.0%}"


class StoreError(Exception):
    """A chat could not be saved (disk full, read-only, locked). str() is one line."""


def data_dir() -> Path:
    """Where chats live: $PHASEWISE_DATA_DIR if set (tests), else the user data directory."""
    override = os.environ.get("PHASEWISE_DATA_DIR")
    return Path(override) if override else Path(user_data_dir("Phasewise", "Phasewise"))


@dataclass(frozen=True)
class Conversation:
    id: str
    title: str
    system_prompt: str
    updated: float


@dataclass(frozen=True)
class ReplyStats:
    """One reply's saved numbers (the stats columns); None where unknown."""

    ttft_s: float | None = None
    queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    decode_tok_s: float | None = None
    itl_p50_s: float | None = None
    itl_p90_s: float | None = None
    itl_p99_s: float | None = None
    model: str | None = None
    engine: str | None = None
    kernel: str | None = None
    device: str | None = None
    prefilled_tokens: int | None = None  # fewer than prompt - cached: Stop cut the prefill
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    seed: int | None = None

    @classmethod
    def from_record(cls, metrics: dict[str, Any], settings: dict[str, Any] | None) -> ReplyStats:
        """From a reply's metrics dict (RequestMetrics.to_dict() plus model fields) and the
        settings it was sent with; counts a remote server did not report stay None."""
        values = {name: metrics.get(name) for name, _ in METRIC_COLUMNS}
        values |= {name: (settings or {}).get(name) for name, _ in SETTING_COLUMNS}
        if metrics.get("prompt_tokens_known") is False:
            values["prompt_tokens"] = None
        if metrics.get("cached_tokens_known") is False:
            values["cached_tokens"] = None
        if values["prompt_tokens"] is None or values["cached_tokens"] is None:
            values["prefilled_tokens"] = None
        return cls(**values)

    def row(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name, _ in STAT_COLUMNS)

    @property
    def cached_share(self) -> float | None:
        if not self.prompt_tokens or self.cached_tokens is None:
            return None
        return self.cached_tokens / self.prompt_tokens

    @property
    def unread_tokens(self) -> int:
        """Prompt tokens a Stop inside the prefill left unread (0 when it read them all, or
        when the counts are not known)."""
        if self.prompt_tokens is None or self.cached_tokens is None \
                or self.prefilled_tokens is None:
            return 0
        return max(self.prompt_tokens - self.cached_tokens - self.prefilled_tokens, 0)

    def summary(self) -> str:
        """One quiet line: "0.14 s to first token · 24 tok/s · 98% cached"; for a reply
        stopped while its prompt was read, how much of it was: "82% of the prompt read before
        Stop · <1% cached" (read or found in the cache: what Regenerate can reuse)."""
        if self.unread_tokens and self.prompt_tokens:
            read = 1 - self.unread_tokens / self.prompt_tokens
            line = f"{fmt_share(read)} of the prompt read before Stop"
            return line + (f" · {fmt_share(self.cached_share)} cached"
                           if self.cached_share else "")
        parts = []
        if self.ttft_s:
            parts.append(f"{self.ttft_s:.2f} s to first token" if self.ttft_s < 10
                         else f"{self.ttft_s:.0f} s to first token")
        if self.decode_tok_s:
            parts.append(f"{self.decode_tok_s:.0f} tok/s" if self.decode_tok_s >= 10
                         else f"{self.decode_tok_s:.1f} tok/s")
        share = self.cached_share
        if share:
            parts.append(f"{fmt_share(share)} cached")
        return " · ".join(parts)

    def details(self) -> str:
        """The full breakdown, one fact a line (what a click on the summary shows)."""
        def sec(value: float | None) -> str:
            return "–" if value is None else f"{value:.3f} s"

        if self.output_tokens == 0:  # stopped before its first token: no TTFT, no decode
            cut = " (stopped while reading the prompt)" if self.unread_tokens else ""
            lines = [f"no first token: queue {sec(self.queue_s)} + prefill "
                     f"{sec(self.prefill_s)}{cut}; total {sec(self.e2e_s)}"]
        else:
            lines = [f"TTFT {sec(self.ttft_s)} = queue {sec(self.queue_s)} + prefill "
                     f"{sec(self.prefill_s)} + first sample",
                     f"decode {sec(self.decode_s)}, {self.decode_tok_s or 0:.1f} tok/s; total "
                     f"{sec(self.e2e_s)}"]
        if self.itl_p50_s is not None and self.output_tokens != 0:
            p90, p99 = (self.itl_p90_s or 0) * 1e3, (self.itl_p99_s or 0) * 1e3
            lines.append(f"ITL p50 / p90 / p99 {self.itl_p50_s * 1e3:.1f} / {p90:.1f} / "
                         f"{p99:.1f} ms")
        tokens = f"{self.output_tokens or 0:,} tokens out"
        if self.prompt_tokens is not None:
            tokens = f"prompt {self.prompt_tokens:,} tokens"
            if self.cached_tokens is not None:
                tokens += f" ({self.cached_tokens:,} cached)"
            if self.unread_tokens:
                new = self.prefilled_tokens or 0
                tokens += f", {new:,} of {new + self.unread_tokens:,} new ones read before Stop"
            tokens += f", {self.output_tokens or 0:,} out"
        lines.append(tokens)
        where = " · ".join(v for v in (self.model, self.engine, self.kernel, self.device) if v)
        if where:
            lines.append(where)
        if self.temperature is not None:
            sampling = f"temperature {self.temperature:g}"
            if self.top_p is not None:
                sampling += f", top-p {self.top_p:g}"
            if self.max_tokens is not None:
                sampling += f", max {self.max_tokens:,} tokens"
            if self.seed is not None:
                sampling += f", seed {self.seed}"
            lines.append(sampling)
        return "\n".join(lines)


@dataclass(frozen=True)
class Message:
    id: int
    conversation_id: str
    role: str
    content: str
    status: str
    settings: dict | None
    metrics: dict | None
    stats: ReplyStats | None = None  # a finished reply's saved numbers


def _message(row: tuple[Any, ...]) -> Message:
    """A Message from a row of _MESSAGE_FIELDS."""
    stats = row[7:]
    return Message(row[0], row[1], row[2], row[3], row[4], _loads(row[5]), _loads(row[6]),
                   ReplyStats(*stats) if any(v is not None for v in stats) else None)


class ChatStore:
    """One SQLite database of chats. All methods run on the caller's (GUI) thread."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or data_dir() / DB_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.recovered_from: Path | None = None  # backup of a corrupt DB, if one was found
        self.open_error: str | None = None  # set when chats live in memory only (see below)
        try:
            self._db = self._open(self.path)
        except sqlite3.OperationalError as exc:
            # Locked, read-only or unreadable is not corrupt: never move the file aside (another
            # instance may be using it). Keep this session's chats in memory and say so.
            self.open_error = f"cannot open {self.path} ({exc})"
            self._db = self._open(":memory:")
        except sqlite3.DatabaseError:
            self.recovered_from = self._back_up_corrupt()
            self._db = self._open(self.path)
        # read-only for now: interrupted replies stay "streaming" until a later start
        with contextlib.suppress(StoreError):
            self._mark_interrupted_replies()

    def _open(self, target: Path | str) -> sqlite3.Connection:
        db = sqlite3.connect(target, timeout=BUSY_TIMEOUT_S)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            # WAL + NORMAL: survives an app crash, skips an fsync per commit (GUI thread)
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA foreign_keys=ON")
            if db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                raise sqlite3.DatabaseError("integrity check failed")
            db.executescript(SCHEMA)
            _migrate(db)
        except sqlite3.DatabaseError:
            db.close()
            raise
        return db

    def _back_up_corrupt(self) -> Path:
        backup = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
        self.path.replace(backup)
        for suffix in ("-wal", "-shm"):  # stale journals would re-corrupt the fresh file
            Path(f"{self.path}{suffix}").unlink(missing_ok=True)
        return backup

    @contextmanager
    def _writing(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; a failure becomes a one-line StoreError (nothing is
        half-written: the transaction rolls back)."""
        try:
            with self._db:
                yield self._db
        except sqlite3.Error as exc:
            raise StoreError(f"could not save to the chat database: {exc}") from exc

    def _mark_interrupted_replies(self) -> None:
        with self._writing():
            self._db.execute("UPDATE messages SET status=? WHERE status=?", (STOPPED, STREAMING))

    def close(self) -> None:
        self._db.close()

    # ----- conversations ---------------------------------------------------------------
    def create_conversation(self, title: str = DEFAULT_TITLE, system_prompt: str = "") -> str:
        """A new chat; a blank title becomes "New chat" (a row never shows as empty)."""
        title = clean_title(title) or DEFAULT_TITLE
        conv_id = uuid.uuid4().hex
        now = time.time()
        with self._writing():
            self._db.execute(
                "INSERT INTO conversations VALUES (?, ?, ?, ?, ?)",
                (conv_id, title, system_prompt, now, now),
            )
        return conv_id

    def conversation(self, conv_id: str) -> Conversation | None:
        row = self._db.execute(
            "SELECT id, title, system_prompt, updated FROM conversations WHERE id=?", (conv_id,)
        ).fetchone()
        return Conversation(*row) if row else None

    def conversations(self, search: str = "") -> list[Conversation]:
        """Newest first; search matches the title or any message text (case-insensitive)."""
        query = "SELECT id, title, system_prompt, updated FROM conversations"
        args: tuple = ()
        if search.strip():
            pattern = f"%{_escape_like(search.strip())}%"
            query += (
                " WHERE title LIKE ? ESCAPE '\\' OR id IN (SELECT conversation_id FROM messages"
                " WHERE content LIKE ? ESCAPE '\\')"
            )
            args = (pattern, pattern)
        rows = self._db.execute(query + " ORDER BY updated DESC", args).fetchall()
        return [Conversation(*row) for row in rows]

    def rename(self, conv_id: str, title: str) -> None:
        """A new title, on one line; a blank one is refused (ValueError), the old one kept."""
        title = clean_title(title)
        if not title:
            raise ValueError("a chat's title cannot be blank")
        with self._writing():
            self._db.execute("UPDATE conversations SET title=? WHERE id=?", (title, conv_id))

    def set_system_prompt(self, conv_id: str, system_prompt: str) -> None:
        with self._writing():
            self._db.execute(
                "UPDATE conversations SET system_prompt=? WHERE id=?", (system_prompt, conv_id)
            )

    def delete_conversation(self, conv_id: str) -> None:
        with self._writing():
            self._db.execute("DELETE FROM conversations WHERE id=?", (conv_id,))

    # ----- messages ----------------------------------------------------------------------
    def add_message(
        self, conv_id: str, role: str, content: str, *, status: str = DONE,
        settings: dict | None = None,
    ) -> int:
        now = time.time()
        with self._writing():
            cur = self._db.execute(
                "INSERT INTO messages (conversation_id, role, content, status, settings_json,"
                " created) VALUES (?, ?, ?, ?, ?, ?)",
                (conv_id, role, content, status, _dumps(settings), now),
            )
            self._db.execute("UPDATE conversations SET updated=? WHERE id=?", (now, conv_id))
        assert cur.lastrowid is not None  # set by every INSERT
        return cur.lastrowid

    def save_partial(self, message_id: int, content: str) -> None:
        """Write a streaming reply's text so far (called in batches while it streams)."""
        with self._writing():
            self._db.execute("UPDATE messages SET content=? WHERE id=?", (content, message_id))

    def finish_message(
        self, message_id: int, content: str, status: str, metrics: dict | None = None
    ) -> None:
        """The reply's final text and status; its metrics (if any) also fill the stats
        columns, with the sampling settings it was sent with."""
        with self._writing():
            self._db.execute(
                "UPDATE messages SET content=?, status=?, metrics_json=? WHERE id=?",
                (content, status, _dumps(metrics), message_id),
            )
            if metrics is not None:
                _write_stats(self._db, message_id, metrics)

    def delete_message(self, message_id: int) -> None:
        with self._writing():
            self._db.execute("DELETE FROM messages WHERE id=?", (message_id,))

    def delete_from(self, conv_id: str, message_id: int) -> None:
        """Delete a message and everything after it (edit & resend, regenerate)."""
        with self._writing():
            self._db.execute(
                "DELETE FROM messages WHERE conversation_id=? AND id>=?", (conv_id, message_id)
            )

    def messages(self, conv_id: str) -> list[Message]:
        rows = self._db.execute(
            f"SELECT {_MESSAGE_FIELDS} FROM messages WHERE conversation_id=? ORDER BY id",
            (conv_id,),
        ).fetchall()
        return [_message(row) for row in rows]

    def message(self, message_id: int) -> Message | None:
        row = self._db.execute(
            f"SELECT {_MESSAGE_FIELDS} FROM messages WHERE id=?", (message_id,)
        ).fetchone()
        return _message(row) if row else None


def _migrate(db: sqlite3.Connection) -> None:
    """Bring a database of an older schema up to SCHEMA_VERSION in one transaction (a newer
    one is left alone). 0 -> 1: the stats columns, filled from each reply's saved metrics."""
    if db.execute("PRAGMA user_version").fetchone()[0] >= SCHEMA_VERSION:
        return
    db.execute("BEGIN IMMEDIATE")
    try:
        have = {row[1] for row in db.execute("PRAGMA table_info(messages)")}
        for name, kind in STAT_COLUMNS:
            if name not in have:
                db.execute(f"ALTER TABLE messages ADD COLUMN {name} {kind}")
        rows = db.execute("SELECT id, metrics_json FROM messages WHERE metrics_json IS NOT NULL")
        for message_id, metrics_json in rows.fetchall():
            metrics = _loads(metrics_json)
            if isinstance(metrics, dict):
                _write_stats(db, message_id, metrics)
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        db.commit()
    except BaseException:
        db.rollback()
        raise


def _write_stats(db: sqlite3.Connection, message_id: int, metrics: dict[str, Any]) -> None:
    row = db.execute("SELECT settings_json FROM messages WHERE id=?", (message_id,)).fetchone()
    settings = _loads(row[0]) if row else None
    stats = ReplyStats.from_record(metrics, settings if isinstance(settings, dict) else None)
    assignments = ", ".join(f"{name}=?" for name, _ in STAT_COLUMNS)
    db.execute(f"UPDATE messages SET {assignments} WHERE id=?", (*stats.row(), message_id))


def metrics_record(result: GenerationResult) -> dict[str, Any]:
    """What a saved reply records as its metrics: the engine's metrics plus where it ran."""
    metrics = result.metrics.to_dict()
    if result.model is not None:
        metrics.update(model=result.model.name, device=result.model.device,
                       dtype=result.model.dtype, context_length=result.model.context_length,
                       engine=result.model.engine, kernel=result.model.kernel)
    if result.speculative:
        metrics.update(speculative=result.speculative, spec_accept_rate=result.spec_accept_rate)
    return metrics


def _escape_like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _dumps(value: dict | None) -> str | None:
    return None if value is None else json.dumps(value)


def _loads(value: str | None) -> dict | None:
    return None if value is None else json.loads(value)
