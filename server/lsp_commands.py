"""The `workspace/executeCommand` arguments of docs/lsp.md, checked.

Each command takes one JSON object. `parse(command, arguments)` returns its typed
form or raises `ArgError` with one line saying what is wrong, which the server
sends back as JSON-RPC -32602 (invalid params). Kept free of pygls so the rules
are readable (and testable) on their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from opencomposer.agent.session import Policy

ASK = "opencomposer.ask"
CANCEL = "opencomposer.cancel"
SEARCH = "opencomposer.search"
DECIDE = "opencomposer.decide"
UNDO = "opencomposer.undo"
SESSIONS = "opencomposer.sessions"
SUBMIT = "opencomposer.submit"
COMMANDS = (ASK, CANCEL, SEARCH, DECIDE, UNDO, SESSIONS, SUBMIT)

POLICIES: tuple[Policy, ...] = ("none", "safe", "all")
DECISIONS = ("accept", "reject")


_S = TypeVar("_S", bound=str)


class ArgError(ValueError):
    """Arguments that do not fit the command; the message is one line for the user."""


@dataclass(frozen=True, kw_only=True)
class Range:
    start_line: int
    start_character: int
    end_line: int
    end_character: int


@dataclass(frozen=True, kw_only=True)
class AskArgs:
    query: str
    uri: str | None = None
    selection: Range | None = None
    open_files: tuple[str, ...] = ()
    model: str | None = None
    approve: Policy = "safe"
    reveal: bool = False  # window/showDocument on every edited file
    # the client's own setting: file changes run without a question under `safe`,
    # since each lands as an editor edit the user can accept, reject or undo
    auto_apply_edits: bool = False
    session_id: str | None = None  # a finished session to continue (a follow-up)


@dataclass(frozen=True, kw_only=True)
class CancelArgs:
    session_id: str | None = None


@dataclass(frozen=True, kw_only=True)
class SearchArgs:
    query: str
    k: int = 10
    path: str | None = None


@dataclass(frozen=True, kw_only=True)
class DecideArgs:
    session_id: str
    path: str
    decision: str


@dataclass(frozen=True, kw_only=True)
class UndoArgs:
    session_id: str


@dataclass(frozen=True, kw_only=True)
class SessionsArgs:
    limit: int = 50


@dataclass(frozen=True, kw_only=True)
class SubmitArgs:
    session_id: str
    verify: str | None = None
    out: str | None = None


class _Obj:
    """Typed reads from one argument object, naming the command in every error."""

    def __init__(self, command: str, arguments: Any, known: tuple[str, ...]) -> None:
        self.command = command
        args = list(arguments or [])
        if len(args) != 1 and not (len(args) == 0 and not self._required(command)):
            raise ArgError(f"{command} takes one argument object, got {len(args)} arguments")
        self.data = args[0] if args else {}
        if not isinstance(self.data, dict):
            raise ArgError(f"{command} takes one argument object, got {type(self.data).__name__}")
        unknown = sorted(set(self.data) - set(known))
        if unknown:
            raise ArgError(f"{command}: unknown field {unknown[0]!r} (known: {', '.join(known)})")

    @staticmethod
    def _required(command: str) -> bool:
        return command not in (CANCEL, SESSIONS)

    def _fail(self, name: str, want: str) -> ArgError:
        return ArgError(f"{self.command}: {name!r} must be {want}, got {self.data[name]!r}")

    def text(self, name: str, *, required: bool = False, nonempty: bool = False) -> str | None:
        if name not in self.data or self.data[name] is None:
            if required:
                raise ArgError(f"{self.command} needs {name!r}")
            return None
        value = self.data[name]
        if not isinstance(value, str):
            raise self._fail(name, "a string")
        if nonempty and not value.strip():
            raise ArgError(f"{self.command}: {name!r} is empty")
        return value

    def integer(self, name: str, default: int, lo: int, hi: int) -> int:
        value = self.data.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise self._fail(name, f"an integer from {lo} to {hi}")
        return value

    def choice(self, name: str, options: tuple[_S, ...], default: _S | None) -> _S:
        value = self.data.get(name, default)
        if value not in options:
            if name not in self.data:
                raise ArgError(f"{self.command} needs {name!r}: one of {', '.join(options)}")
            raise self._fail(name, "one of " + ", ".join(options))
        return value

    def flag(self, name: str) -> bool:
        value = self.data.get(name, False)
        if not isinstance(value, bool):
            raise self._fail(name, "true or false")
        return value


def _range(command: str, value: Any) -> Range | None:
    if value is None:
        return None
    try:
        start, end = value["start"], value["end"]
        numbers = [start["line"], start["character"], end["line"], end["character"]]
    except (TypeError, KeyError):
        raise ArgError(f"{command}: 'selection' must be an LSP Range {{start, end}}") from None
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers):
        raise ArgError(f"{command}: 'selection' positions must be non-negative integers")
    return Range(
        start_line=numbers[0],
        start_character=numbers[1],
        end_line=numbers[2],
        end_character=numbers[3],
    )


def parse(command: str, arguments: Any) -> Any:
    """The typed arguments of `command`; ArgError if they do not fit."""
    if command == ASK:
        o = _Obj(
            command,
            arguments,
            (
                "query",
                "uri",
                "selection",
                "open_files",
                "model",
                "approve",
                "reveal",
                "prompt",
                "auto_apply_edits",
                "session_id",
            ),
        )
        files = o.data.get("open_files") or []
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            raise ArgError(f"{command}: 'open_files' must be a list of URIs")
        return AskArgs(
            query=o.text("query", required=True, nonempty=True) or "",
            uri=o.text("uri"),
            selection=_range(command, o.data.get("selection")),
            open_files=tuple(files),
            model=o.text("model", nonempty=True),
            approve=o.choice("approve", POLICIES, "safe"),
            reveal=o.flag("reveal"),
            auto_apply_edits=o.flag("auto_apply_edits"),
            session_id=o.text("session_id", nonempty=True),
        )
    if command == CANCEL:
        o = _Obj(command, arguments, ("session_id",))
        return CancelArgs(session_id=o.text("session_id", nonempty=True))
    if command == SEARCH:
        o = _Obj(command, arguments, ("query", "k", "path"))
        return SearchArgs(
            query=o.text("query", required=True, nonempty=True) or "",
            k=o.integer("k", 10, 1, 200),
            path=o.text("path"),
        )
    if command == DECIDE:
        o = _Obj(command, arguments, ("session_id", "path", "decision"))
        return DecideArgs(
            session_id=o.text("session_id", required=True, nonempty=True) or "",
            path=o.text("path", required=True, nonempty=True) or "",
            decision=o.choice("decision", DECISIONS, None),
        )
    if command == UNDO:
        o = _Obj(command, arguments, ("session_id",))
        return UndoArgs(session_id=o.text("session_id", required=True, nonempty=True) or "")
    if command == SESSIONS:
        o = _Obj(command, arguments, ("limit",))
        return SessionsArgs(limit=o.integer("limit", 50, 1, 10_000))
    if command == SUBMIT:
        o = _Obj(command, arguments, ("session_id", "verify", "out"))
        return SubmitArgs(
            session_id=o.text("session_id", required=True, nonempty=True) or "",
            verify=o.text("verify", nonempty=True),
            out=o.text("out", nonempty=True),
        )
    raise ArgError(f"unknown command {command!r}; known: {', '.join(COMMANDS)}")
