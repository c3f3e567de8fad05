"""A session's output: one stream of typed events.

A `Session` emits each event once (`Session.emit`) and everything else subscribes:
the trace store (`TraceRecorder`), the CLI printers (`server/ask.py`), the language
server's `opencomposer/event` notifications, the environment's episode metrics and,
through the turns it keeps, the rollout builder.

Every event has `t`, seconds since the session started, on the session's one
monotonic clock (`Clock`); the trace's times are the session's wall-clock start
plus `t`, so turns and tool calls share one time line.

`to_wire()` is the documented JSON form (DESIGN.md's `ask --json` stream and
docs/lsp.md's `opencomposer/event`): `type`, `t` and the event's wire fields.
Fields declared with `local()` are for subscribers in this process (the full tool
result, the turn's token ids, a file before and after an edit) and never leave it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from opencomposer.agent.protocols import Message as Prompt
    from opencomposer.agent.protocols import TurnOutput
    from opencomposer.agent.traces import TraceStore


def local(default: Any = MISSING, **kw: Any) -> Any:
    """A field that subscribers in this process read and the wire form leaves out."""
    if default is not MISSING:
        kw["default"] = default
    return field(metadata={"wire": False}, **kw)


@dataclass(frozen=True, kw_only=True)
class Event:
    type: ClassVar[str]
    t: float  # seconds since the session started

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"type": self.type, "t": self.t}
        for f in fields(self):
            if f.name != "t" and f.metadata.get("wire", True):
                wire[f.name] = getattr(self, f.name)
        return wire

    @classmethod
    def wire_fields(cls) -> tuple[str, ...]:
        """The fields the wire form carries beyond `type` and `t`."""
        return tuple(f.name for f in fields(cls) if f.name != "t" and f.metadata.get("wire", True))


@dataclass(frozen=True, kw_only=True)
class SessionStart(Event):
    """The start of a request: the session's first (`request` 1), or a follow-up that
    continues it (2, 3, …: same `session_id`, history kept, turns numbered on)."""

    type: ClassVar[str] = "session_start"
    session_id: str
    workspace: str
    model: str
    request: int = 1
    first_turn: int = local(1)  # the number of this request's first model turn
    edits: int = local(0)  # edits the session made before this request
    started: float = local(0.0)  # wall-clock time at t = 0
    query: str = local("")
    sampling: dict[str, Any] = local(default_factory=dict)
    tools: tuple[str, ...]  # the tools the session offers
    prompt_style: str = local("")


@dataclass(frozen=True, kw_only=True)
class ModelStart(Event):
    type: ClassVar[str] = "model_start"
    turn: int


@dataclass(frozen=True, kw_only=True)
class ModelDelta(Event):
    """Streamed text as it arrives (live views; other consumers ignore it). `prose` is
    the text outside tool calls that the parser has decided since the last delta: it
    lags `text` where a `<` may still open a call, and the pieces of a turn join to
    its `Message.prose` (the calls show in `tool_start`/`tool_end` instead)."""

    type: ClassVar[str] = "model_delta"
    turn: int
    text: str
    prose: str


@dataclass(frozen=True, kw_only=True)
class ToolStart(Event):
    type: ClassVar[str] = "tool_start"
    turn: int
    call_id: str
    name: str
    args: dict[str, Any]  # long strings cut for live views; ToolEnd.arguments is whole


@dataclass(frozen=True, kw_only=True)
class ToolEnd(Event):
    type: ClassVar[str] = "tool_end"
    turn: int
    call_id: str
    name: str
    status: str  # ok | error
    duration_s: float
    output: str  # the result, cut at head and tail for live views
    index: int = local(0)  # the call's place in its message
    arguments: dict[str, Any] = local(default_factory=dict)
    result: str = local("")  # the whole result the model read
    t_start: float = local(0.0)


@dataclass(frozen=True, kw_only=True)
class Edit(Event):
    type: ClassVar[str] = "edit"
    path: str
    diff: str
    call_id: str
    turn: int = local(0)
    before: str | None = local(None)  # None: the file did not exist
    after: str | None = local(None)  # None: the file was deleted


@dataclass(frozen=True, kw_only=True)
class ModelEnd(Event):
    type: ClassVar[str] = "model_end"
    turn: int
    prompt_tokens: int
    completion_tokens: int
    prompt: tuple[Prompt, ...] = local(())  # the messages the model was given
    output: TurnOutput | None = local(None)  # text, token ids, logprobs
    t_start: float = local(0.0)


@dataclass(frozen=True, kw_only=True)
class Message(Event):
    """A turn's whole reply; `prose` is it without its tool-call elements."""

    type: ClassVar[str] = "message"
    turn: int
    text: str
    prose: str


@dataclass(frozen=True, kw_only=True)
class SessionEnd(Event):
    type: ClassVar[str] = "session_end"
    request: int  # the request that ended (see SessionStart)
    status: str  # of this request
    turns: int  # model turns and tool calls of the whole session so far
    tool_calls: int
    duration_s: float  # of this request
    trace: str
    answer: str = local("")
    error: str | None = local(None)


EVENTS: tuple[type[Event], ...] = (
    SessionStart,
    ModelStart,
    ModelDelta,
    ToolStart,
    ToolEnd,
    Edit,
    ModelEnd,
    Message,
    SessionEnd,
)
Subscriber = Callable[[Event], None]


class Clock:
    """The session's one clock: monotonic seconds since start, and the wall time then."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.wall = time.time()

    def rewind(self, wall: float) -> None:
        """Put t = 0 at wall-clock time `wall` (a session continued in another process)."""
        self.start -= self.wall - wall
        self.wall = wall

    def now(self) -> float:
        return self.since(time.monotonic())

    def since(self, monotonic: float) -> float:
        """`t` of a `time.monotonic()` reading."""
        return round(monotonic - self.start, 4)


class TraceRecorder:
    """Writes a session's trace from its events: the trace store's only writer.

    Tool calls and edits are written as they end, a turn when its model output is
    complete, the session row at its start and end; times are the session's
    wall-clock start plus each event's `t`.
    """

    def __init__(self, store: TraceStore) -> None:
        self.store = store
        self.session_id = ""
        self.started = 0.0
        self.edits = 0

    def __call__(self, e: Event) -> None:
        store, sid = self.store, self.session_id
        match e:
            case SessionStart() if e.request > 1:  # a follow-up: the same trace goes on
                self.session_id, self.started, self.edits = e.session_id, e.started, e.edits
                store.continue_session(e.session_id, workspace=Path(e.workspace))
                meta = (store.get(e.session_id) or {}).get("meta") or {}
                requests = meta.get("requests") or []
                entry = {"request": e.request, "query": e.query, "turn": e.first_turn, "t": e.t}
                store.set_meta(e.session_id, requests=[*requests, entry])
            case SessionStart():
                self.session_id, self.started = e.session_id, e.started
                store.start_session(
                    e.session_id,
                    workspace=Path(e.workspace),
                    model=e.model,
                    sampling=e.sampling,
                    query=e.query,
                )
                first = {"request": 1, "query": e.query, "turn": 1, "t": e.t}
                store.set_meta(
                    e.session_id,
                    prompt_style=e.prompt_style,
                    tools=list(e.tools),
                    requests=[first],
                )
            case ModelEnd(output=output) if output is not None:
                store.write_turn(
                    sid,
                    e.turn,
                    messages=[m.as_dict() for m in e.prompt],
                    output=output,
                    t_start=self.started + e.t_start,
                    t_end=self.started + e.t,
                )
            case ToolEnd():
                store.write_call(
                    sid,
                    e.turn,
                    call_id=e.call_id,
                    index=e.index,
                    name=e.name,
                    args=e.arguments,
                    status=e.status,
                    result=e.result,
                    t_start=self.started + e.t_start,
                    t_end=self.started + e.t,
                )
            case Edit():
                self.edits += 1
                store.write_edit(
                    sid,
                    self.edits,
                    turn=e.turn,
                    call_id=e.call_id,
                    path=e.path,
                    before=e.before,
                    after=e.after,
                    diff=e.diff,
                )
            case SessionEnd():
                store.end_session(
                    sid,
                    status=e.status,
                    answer=e.answer or (e.error or ""),
                    turns=e.turns,
                    tool_calls=e.tool_calls,
                )
