"""Parallel tool execution with the observable result of running calls one by one.

Each call starts the moment the parser hands it over. It waits only for earlier
calls of the same message whose footprint conflicts with its own (a write against
a read or write of an overlapping path; run_terminal against anything that touches
files, though two run_terminal calls may overlap). So a message of independent
reads, searches and commands runs at once, and `read -> edit -> read` of one file
stays in order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from opencomposer.agent.xmlcalls import ParsedCall
from opencomposer.tools import specs
from opencomposer.tools.output import cap
from opencomposer.tools.protocols import ToolContext, ToolError, ToolResult

log = logging.getLogger(__name__)

Approval = Literal["run", "always", "reject"]
# (spec, args) -> None to go ahead, or the reason the call may not run.
Gate = Callable[[specs.ToolSpec, dict[str, Any]], Awaitable[str | None]]


@dataclass
class CallRecord:
    call_id: str
    turn: int
    index: int
    name: str
    args: dict[str, Any]
    result: ToolResult | None = None
    t_start: float = 0.0
    t_end: float = 0.0
    footprint: specs.Footprint = field(default_factory=specs.Footprint)

    @property
    def duration_s(self) -> float:
        return round(max(0.0, self.t_end - self.t_start), 4)


@dataclass(kw_only=True)
class Hooks:
    """What the executor reports to the session as calls start and end."""

    on_start: Callable[[CallRecord], None] = lambda rec: None
    on_end: Callable[[CallRecord], None] = lambda rec: None


class Executor:
    def __init__(
        self,
        ctx: ToolContext,
        *,
        turn: int,
        gate: Gate | None = None,
        hooks: Hooks | None = None,
        output_limit: int = 20_000,
    ):
        self.ctx = ctx
        self.turn = turn
        self.gate = gate
        self.hooks = hooks or Hooks()
        self.output_limit = output_limit
        self.records: list[CallRecord] = []
        self._tasks: list[asyncio.Task[None]] = []

    def submit(self, call: ParsedCall) -> CallRecord:
        """Start a call now; it runs once the earlier calls it conflicts with are done."""
        rec = CallRecord(
            call_id=f"t{self.turn}c{call.index}",
            turn=self.turn,
            index=call.index,
            name=call.name,
            args={},
        )
        error = call.error
        spec: specs.ToolSpec | None = None
        if error is None:
            try:
                spec = specs.get(call.name)
                rec.args = spec.validate(call.raw)
                rec.footprint = spec.footprint(rec.args)
            except ToolError as e:
                error = str(e)
        if error is not None:
            rec.args = dict(call.raw)
        deps = [
            t
            for r, t in zip(self.records, self._tasks, strict=True)
            if r.footprint.conflicts(rec.footprint)
        ]
        self.records.append(rec)
        self._tasks.append(asyncio.ensure_future(self._run(rec, spec, error, deps)))
        return rec

    async def _run(
        self,
        rec: CallRecord,
        spec: specs.ToolSpec | None,
        error: str | None,
        deps: list[asyncio.Task[None]],
    ) -> None:
        if deps:
            await asyncio.wait(deps)
        rec.t_start = time.monotonic()
        self.hooks.on_start(rec)
        try:
            if error is not None or spec is None:
                rec.result = ToolResult.error(error or "invalid call")
            else:
                refusal = await self.gate(spec, rec.args) if self.gate else None
                if refusal is not None:
                    rec.result = ToolResult.error(refusal)
                else:
                    rec.result = await spec.run(self.ctx, rec.args)
        except ToolError as e:
            rec.result = ToolResult.error(str(e))
        except asyncio.CancelledError:
            rec.result = ToolResult.error("cancelled")
            raise
        except Exception as e:  # a tool bug must not end the session
            log.exception("tool %s failed", rec.name)
            rec.result = ToolResult.error(f"internal error in {rec.name}: {type(e).__name__}: {e}")
        finally:
            if rec.result is None:
                rec.result = ToolResult.error("cancelled")
            rec.result.output = cap(rec.result.output, self.output_limit)
            rec.t_end = time.monotonic()
            self.hooks.on_end(rec)

    async def wait(self) -> list[CallRecord]:
        """Every submitted call's record, in message order, once all have finished."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        return self.records

    async def cancel(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def format_results(records: list[CallRecord]) -> str:
    """The one message that carries a turn's results back to the model."""
    parts = []
    for rec in records:
        status = rec.result.status if rec.result else "error"
        output = rec.result.output if rec.result else "no result"
        parts.append(
            f'<tool_result name="{rec.name}" index="{rec.index}" status="{status}">\n{output}\n</tool_result>'
        )
    return "\n".join(parts)
