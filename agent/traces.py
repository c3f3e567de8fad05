"""The trace store: every session, turn, tool call and edit, in SQLite (WAL).

`$OPENCOMPOSER_HOME/traces.db` (default `~/.local/share/opencomposer`). The session
loop writes after every step, so a crash or a killed process loses at most the step
in flight. Everything textual passes through the `Redactor` first; a turn whose text
needed redaction keeps no token ids (they would spell the secret back out).

A session row names the process that writes it (`owner`: host, boot, pid
namespace, pid and that pid's start time). A process killed with SIGKILL never
ends its sessions, so whenever sessions are read, a `running` session whose
owner is gone (same host and boot, and no process with that pid and start time)
is marked `interrupted`, in the database too.

Everything stored as JSON is written strictly (`allow_nan=False`): NaN and
infinities (a -inf logprob, a NaN reward) become null, so exports are valid JSON.

Run `opencomposer traces list|show|export` to read it.
"""

from __future__ import annotations

import functools
import json
import math
import os
import socket
import sqlite3
import stat
import threading
import time
from pathlib import Path
from typing import Any

from opencomposer.agent.redact import Redactor, names_env_file
from opencomposer.tools.git import Git, GitError

SCHEMA_VERSION = 3
INTERRUPTED = "interrupted"  # the status of a session whose process died mid-run
UNTRACKED_MAX_FILES = 200
UNTRACKED_MAX_BYTES = 1_000_000
GIT_TIMEOUT_S = 10.0  # each git command at session start

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS sessions (
  id TEXT PRIMARY KEY, started REAL, ended REAL, status TEXT, workspace TEXT,
  git_head TEXT, git_diff TEXT, model TEXT, sampling TEXT, query TEXT, answer TEXT,
  turns INTEGER DEFAULT 0, tool_calls INTEGER DEFAULT 0, meta TEXT,
  pid INTEGER, owner TEXT
);
CREATE TABLE IF NOT EXISTS turns (
  session_id TEXT, turn INTEGER, messages TEXT, text TEXT, finish_reason TEXT,
  prompt_token_ids TEXT, completion_token_ids TEXT, completion_logprobs TEXT,
  prompt_tokens INTEGER, completion_tokens INTEGER, weight_version INTEGER,
  t_start REAL, t_end REAL, redacted INTEGER DEFAULT 0, meta TEXT,
  PRIMARY KEY (session_id, turn)
);
CREATE TABLE IF NOT EXISTS tool_calls (
  session_id TEXT, turn INTEGER, call_id TEXT, idx INTEGER, name TEXT, args TEXT,
  status TEXT, result TEXT, t_start REAL, t_end REAL,
  PRIMARY KEY (session_id, call_id)
);
CREATE TABLE IF NOT EXISTS edits (
  session_id TEXT, seq INTEGER, turn INTEGER, call_id TEXT, path TEXT,
  before TEXT, after TEXT, diff TEXT, decision TEXT, decided_at REAL,
  PRIMARY KEY (session_id, seq)
);
CREATE INDEX IF NOT EXISTS sessions_started ON sessions(started);
"""
# Columns added after version 1: (table, column, type), added to older files on open.
_ADDED = (("sessions", "pid", "INTEGER"), ("sessions", "owner", "TEXT"), ("turns", "meta", "TEXT"))


def home() -> Path:
    return Path(os.environ.get("OPENCOMPOSER_HOME") or Path.home() / ".local/share/opencomposer")


def git_state(root: Path) -> tuple[str | None, str]:
    """HEAD and the uncommitted diff (untracked files up to 1 MB included as new files).

    The workspace is untrusted: git runs through `tools.git`, so nothing the
    repository configures (fsmonitor, hooks, filters, external diff, …) runs.
    """
    git = Git.find(root, timeout=GIT_TIMEOUT_S)
    if git is None:
        return None, ""
    try:
        head = git.run("rev-parse", "--verify", "--quiet", "HEAD^{commit}", cwd=root)
        if head.returncode != 0:
            return None, ""
        diff = git.run("diff", "--binary", "HEAD", cwd=root).stdout
        listed = git.run("ls-files", "-z", "--others", "--exclude-standard", cwd=root).stdout
        new = [p for p in os.fsdecode(listed).split("\0") if p and _small_file(root / p)]
        # `diff --no-index` exits 1 when the files differ, as a new file always does.
        diff += git.run_each(
            ["diff", "--no-index", "--binary", "--", "/dev/null"],
            new[:UNTRACKED_MAX_FILES],
            cwd=root,
        )
    except GitError:
        return None, ""
    return head.stdout.decode().strip(), diff.decode(errors="replace")


def _small_file(path: Path) -> bool:
    """A regular file (or a link, shown as its target's name) that git can read at
    once: a FIFO would block the read, a device never end."""
    try:
        st = path.lstat()
    except OSError:
        return False
    kind_ok = stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)
    return kind_ok and st.st_size <= UNTRACKED_MAX_BYTES


# -- which process owns a running session ------------------------------------------


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22)."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


@functools.cache
def _machine() -> tuple[str, str, str]:
    """(host, boot id, pid namespace) of this process: where a pid means something."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return socket.gethostname(), _read("/proc/sys/kernel/random/boot_id") or "", ns


def _owner(pid: int) -> str | None:
    start = _start_time(pid)
    if start is None:
        return None
    return json.dumps([*_machine(), pid, start])


def _owner_gone(owner: str) -> bool:
    """True only when the owner is surely dead: same machine, and its pid is free or
    now belongs to a process started at another time. Another host: unknown."""
    try:
        host, boot, ns, pid, start = json.loads(owner)
    except (ValueError, TypeError):
        return False
    here_host, here_boot, here_ns = _machine()
    if host != here_host or not boot:
        return False
    if boot != here_boot:
        return True  # the machine rebooted since
    if ns != here_ns:
        return False
    return _start_time(int(pid)) != start


# -- strict JSON ----------------------------------------------------------------------


def finite(value: Any) -> Any:
    """`value` with every NaN or infinite float replaced by None (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def dumps(value: Any, **kw: Any) -> str:
    """Strict JSON: NaN and infinities written as null."""
    return json.dumps(finite(value), allow_nan=False, **kw)


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _strings(v)]
    return []


def _redact_json(value: Any, redactor: Redactor) -> Any:
    """Every string inside `value` redacted (before encoding: line rules see real lines)."""
    if isinstance(value, str):
        return redactor(value)
    if isinstance(value, dict):
        return {k: _redact_json(v, redactor) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redact_json(v, redactor) for v in value]
    return value


class TraceStore:
    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path else home() / "traces.db"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            self.path, check_same_thread=False, timeout=30, isolation_level=None
        )
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        for table, column, kind in _ADDED:
            have = {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                try:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
                except sqlite3.OperationalError:
                    pass  # another process added it first
        self._db.execute(
            "INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
        )
        self._redactors: dict[str, Redactor] = {}

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def ref(self, session_id: str) -> str:
        return f"{self.path}#{session_id}"

    def _exec(self, sql: str, args: tuple[Any, ...] = ()) -> None:
        with self._lock:
            self._db.execute(sql, args)

    def _redactor(self, session_id: str) -> Redactor:
        return self._redactors.get(session_id) or Redactor()

    def _redact(self, session_id: str, text: str | None) -> str | None:
        return self._redactor(session_id)(text)

    # -- writing (the session loop) -------------------------------------------

    def start_session(
        self, session_id: str, *, workspace: Path, model: str, sampling: dict[str, Any], query: str
    ) -> None:
        redactor = Redactor.for_workspace(workspace)
        self._redactors[session_id] = redactor
        head, diff = git_state(workspace)
        pid = os.getpid()
        self._exec(
            "INSERT OR REPLACE INTO sessions (id, started, status, workspace, git_head, git_diff,"
            " model, sampling, query, pid, owner) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (
                session_id,
                time.time(),
                "running",
                str(workspace),
                head,
                redactor(diff),
                redactor(model),
                dumps(sampling),
                redactor(query),
                pid,
                _owner(pid),
            ),
        )

    def continue_session(self, session_id: str, *, workspace: Path) -> None:
        """A follow-up request in a finished session: running again, owned by this
        process, its text redacted as at its start (the workspace's secrets)."""
        self._redactors[session_id] = Redactor.for_workspace(workspace)
        pid = os.getpid()
        self._exec(
            "UPDATE sessions SET status='running', ended=NULL, pid=?, owner=? WHERE id=?",
            (pid, _owner(pid), session_id),
        )

    def write_turn(
        self,
        session_id: str,
        turn: int,
        *,
        messages: list[dict[str, str]],
        output: Any,
        t_start: float,
        t_end: float,
    ) -> None:
        redactor = self._redactor(session_id)
        text = output.text
        clean = redactor(text) or ""
        clean_messages = [{**m, "content": redactor(m["content"])} for m in messages]
        redacted = clean != text or any(
            c["content"] != m["content"] for c, m in zip(clean_messages, messages, strict=True)
        )

        def ids(v: Any) -> str | None:
            return None if v is None or redacted else dumps(v)

        self._exec(
            "INSERT OR REPLACE INTO turns (session_id, turn, messages, text, finish_reason,"
            " prompt_token_ids, completion_token_ids, completion_logprobs, prompt_tokens,"
            " completion_tokens, weight_version, t_start, t_end, redacted, meta)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                session_id,
                turn,
                dumps(clean_messages),
                clean,
                output.finish_reason,
                ids(output.prompt_token_ids),
                ids(output.completion_token_ids),
                ids(output.completion_logprobs),
                output.prompt_tokens,
                output.completion_tokens,
                output.weight_version,
                t_start,
                t_end,
                int(redacted),
                dumps(_redacted(getattr(output, "meta", None) or {}, redactor), default=str),
            ),
        )

    def write_call(
        self,
        session_id: str,
        turn: int,
        *,
        call_id: str,
        index: int,
        name: str,
        args: dict[str, Any],
        status: str,
        result: str,
        t_start: float,
        t_end: float,
    ) -> None:
        redactor = self._redactor(session_id)
        if any(names_env_file(s) for s in _strings(args)):
            clean = redactor.env_file(result)  # every value of a .env file is a secret
        else:
            clean = redactor(result)
        self._exec(
            "INSERT OR REPLACE INTO tool_calls VALUES (?,?,?,?,?,?,?,?,?,?)",
            (
                session_id,
                turn,
                call_id,
                index,
                name,
                dumps(_redact_json(args, redactor)),
                status,
                clean,
                t_start,
                t_end,
            ),
        )

    def write_edit(
        self,
        session_id: str,
        seq: int,
        *,
        turn: int,
        call_id: str,
        path: str,
        before: str | None,
        after: str | None,
        diff: str,
    ) -> None:
        redactor = self._redactor(session_id)
        r = redactor.env_file if names_env_file(path) else redactor
        self._exec(
            "INSERT OR REPLACE INTO edits (session_id, seq, turn, call_id, path, before, after, diff)"
            " VALUES (?,?,?,?,?,?,?,?)",
            (session_id, seq, turn, call_id, path, r(before), r(after), r(diff)),
        )

    def end_session(
        self, session_id: str, *, status: str, answer: str, turns: int, tool_calls: int
    ) -> None:
        self._exec(
            "UPDATE sessions SET ended=?, status=?, answer=?, turns=?, tool_calls=? WHERE id=?",
            (time.time(), status, self._redact(session_id, answer), turns, tool_calls, session_id),
        )
        self._redactors.pop(session_id, None)

    def set_status(self, session_id: str, status: str) -> None:
        self._exec("UPDATE sessions SET status=? WHERE id=?", (status, session_id))

    def set_meta(self, session_id: str, **meta: Any) -> None:
        current = self.get(session_id) or {}
        merged = {**(current.get("meta") or {}), **_redact_json(meta, self._redactor(session_id))}
        self._exec("UPDATE sessions SET meta=? WHERE id=?", (dumps(merged), session_id))

    def record_decision(self, session_id: str, path: str, decision: str) -> int:
        """The user's accept / reject / undo of a session's edits to `path` (all files if "*")."""
        if decision not in ("accept", "reject", "undo"):
            raise ValueError(f"decision must be accept, reject or undo, not {decision!r}")
        with self._lock:
            cur = self._db.execute(
                "UPDATE edits SET decision=?, decided_at=? WHERE session_id=? AND (path=? OR ?='*')",
                (decision, time.time(), session_id, path, path),
            )
            return cur.rowcount

    # -- reading ---------------------------------------------------------------

    def reap(self) -> list[str]:
        """Mark `interrupted` every running session whose owning process is gone."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id, owner FROM sessions WHERE status='running' AND owner IS NOT NULL"
            ).fetchall()
            gone = [r for r in rows if _owner_gone(r["owner"])]
            for r in gone:
                self._db.execute(
                    "UPDATE sessions SET status=? WHERE id=? AND status='running' AND owner=?",
                    (INTERRUPTED, r["id"], r["owner"]),
                )
        return [r["id"] for r in gone]

    def resolve(self, prefix: str) -> str:
        """The full id of the one session whose id starts with `prefix`."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id FROM sessions WHERE id LIKE ? ORDER BY started DESC LIMIT 2",
                (prefix + "%",),
            ).fetchall()
        if not rows:
            raise KeyError(f"no session {prefix!r} in {self.path}")
        if len(rows) > 1 and rows[0]["id"] != prefix:
            raise KeyError(f"session id {prefix!r} is ambiguous; give more characters")
        return rows[0]["id"]

    def list_sessions(self, limit: int = 50) -> list[dict[str, Any]]:
        self.reap()
        with self._lock:
            rows = self._db.execute(
                "SELECT s.id, s.started, s.ended, s.status, s.workspace, s.model, s.query, s.turns,"
                " s.tool_calls, (SELECT COUNT(*) FROM edits e WHERE e.session_id = s.id) AS edits"
                " FROM sessions s ORDER BY s.started DESC LIMIT ?",
                (limit,),
            ).fetchall()
        return [
            finite({"session_id": r["id"], **{k: v for k, v in dict(r).items() if k != "id"}})
            for r in rows
        ]

    def get(self, session_id: str) -> dict[str, Any] | None:
        self.reap()
        with self._lock:
            row = self._db.execute("SELECT * FROM sessions WHERE id=?", (session_id,)).fetchone()
        if row is None:
            return None
        out = dict(row)
        out["session_id"] = out.pop("id")
        out.pop("owner", None)  # host and boot ids: for `reap`, not for exports
        out["sampling"] = json.loads(out["sampling"] or "{}")
        out["meta"] = json.loads(out["meta"] or "{}")
        return finite(out)

    def export(self, session_id: str) -> dict[str, Any]:
        """The whole trace as one JSON-ready dict (turns with token ids, calls, edits)."""
        session = self.get(session_id)
        if session is None:
            raise KeyError(f"no session {session_id!r} in {self.path}")
        with self._lock:
            turns = self._db.execute(
                "SELECT * FROM turns WHERE session_id=? ORDER BY turn", (session_id,)
            ).fetchall()
            calls = self._db.execute(
                "SELECT * FROM tool_calls WHERE session_id=? ORDER BY turn, idx", (session_id,)
            ).fetchall()
            edits = self._db.execute(
                "SELECT * FROM edits WHERE session_id=? ORDER BY seq", (session_id,)
            ).fetchall()
        session["turns"] = [
            {
                **{k: v for k, v in dict(t).items() if k != "session_id"},
                "messages": json.loads(t["messages"] or "[]"),
                "prompt_token_ids": _loads(t["prompt_token_ids"]),
                "completion_token_ids": _loads(t["completion_token_ids"]),
                "completion_logprobs": _loads(t["completion_logprobs"]),
                "meta": _loads(t["meta"]) or {},
            }
            for t in turns
        ]
        session["tool_calls"] = [
            {
                **{k: v for k, v in dict(c).items() if k != "session_id"},
                "args": json.loads(c["args"] or "{}"),
            }
            for c in calls
        ]
        session["edits"] = [{k: v for k, v in dict(e).items() if k != "session_id"} for e in edits]
        return finite(session)


def _redacted(value: Any, redactor: Redactor) -> Any:
    """`value` (a turn's `meta`: what the backend and the session noted of it) with
    every string in it redacted."""
    if isinstance(value, str):
        return redactor(value)
    if isinstance(value, dict):
        return {str(k): _redacted(v, redactor) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redacted(v, redactor) for v in value]
    return value


def _loads(v: str | None) -> Any:
    return None if v is None else json.loads(v)
