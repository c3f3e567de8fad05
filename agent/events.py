"""The session event stream (DESIGN.md, `opencomposer ask --json`).

One event is a flat JSON object with `type` and `t` (seconds since the session
started). The CLI prints them as JSON lines or renders them for a person; the
language server forwards them as `opencomposer/event` notifications.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

Event = dict[str, Any]
EventSink = Callable[[Event], None]

SESSION_START = "session_start"
MODEL_START = "model_start"
MODEL_DELTA = "model_delta"
TOOL_START = "tool_start"
TOOL_END = "tool_end"
EDIT = "edit"
MODEL_END = "model_end"
MESSAGE = "message"
SESSION_END = "session_end"

# Fields each event carries beyond `type` and `t`. Extras for live views, which other
# consumers ignore: model_delta (streamed text as it arrives), tool_end's `output`
# (the result, cut at head and tail) and edit's `call_id`.
FIELDS: dict[str, tuple[str, ...]] = {
    SESSION_START: ("session_id", "workspace", "model"),
    MODEL_START: ("turn",),
    MODEL_DELTA: ("turn", "text"),
    TOOL_START: ("turn", "call_id", "name", "args"),
    TOOL_END: ("turn", "call_id", "name", "status", "duration_s"),
    EDIT: ("path", "diff"),
    MODEL_END: ("turn", "prompt_tokens", "completion_tokens"),
    MESSAGE: ("turn", "text"),
    SESSION_END: ("status", "turns", "tool_calls", "duration_s", "trace"),
}


class Clock:
    def __init__(self) -> None:
        self.start = time.monotonic()

    def now(self) -> float:
        return round(time.monotonic() - self.start, 4)


def make(clock: Clock, type_: str, **fields: Any) -> Event:
    missing = [f for f in FIELDS[type_] if f not in fields]
    if missing:
        raise ValueError(f"event {type_} lacks {missing}")
    return {"type": type_, "t": clock.now(), **fields}
