"""Parallel tool execution with the observable result of running calls one by one.

Each call starts the moment the parser hands it over. It waits only for earlier
calls of the same message whose footprint conflicts with its own (a write against
a read or write of an overlapping path; run_terminal against anything that touches
files, though two run_terminal calls may overlap). So a message of independent
reads, searches and commands runs at once, and `read -> edit -> read` of one file
stays in order.

Paths in footprints are the workspace's keys (`./a.txt`, `a.txt`, `d/../a.txt`
and a symlink to it are one file), so aliases cannot reorder two edits of a file.

`_Schedule` finds the conflicting calls without comparing each call with every
earlier one (ten thousand calls in one message would be fifty million checks): a
trie of paths keeps, per path, the last write, the reads since it, and "barriers"
(one future each) over every call at or below it; a call waits on the few
barriers that cover exactly the earlier calls it conflicts with. That is the same
set the pairwise rule gives, so the same order, in time linear in the message.
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
        self._schedule = _Schedule()

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
        if spec is not None and error is None:
            rec.footprint = rec.footprint.keyed(self._key)
        deps = self._schedule.deps(rec.footprint)
        task = asyncio.ensure_future(self._run(rec, spec, error, deps))
        self._schedule.add(rec.footprint, task)
        self.records.append(rec)
        self._tasks.append(task)
        return rec

    def _key(self, path: str) -> str:
        """The workspace's one spelling of `path`; the path as given when it is refused
        (the call then fails on its own, ordered by its lexical form)."""
        try:
            return self.ctx.workspace.key(path)
        except ToolError:
            return path

    async def _run(
        self,
        rec: CallRecord,
        spec: specs.ToolSpec | None,
        error: str | None,
        deps: list[asyncio.Future[Any]],
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


class _Barrier:
    """One future that is done when every task added so far is done."""

    def __init__(self) -> None:
        self._done: asyncio.Future[Any] | None = None
        self._new: list[asyncio.Future[Any]] = []

    def add(self, task: asyncio.Future[Any]) -> None:
        self._new.append(task)

    def future(self) -> asyncio.Future[Any] | None:
        if self._new:
            older = [self._done] if self._done is not None else []
            self._done = asyncio.gather(*older, *self._new, return_exceptions=True)
            self._new = []
        return self._done


@dataclass
class _Node:
    """One path of the trie: calls on exactly this path, and barriers over its subtree."""

    children: dict[str, _Node] = field(default_factory=dict)
    writer: asyncio.Future[Any] | None = None  # last write here; it waited on the ones before
    readers: _Barrier = field(default_factory=_Barrier)  # reads here since that write
    below: _Barrier = field(default_factory=_Barrier)  # every call here or deeper
    below_writes: _Barrier = field(default_factory=_Barrier)  # every write here or deeper


class _Schedule:
    """The earlier calls a call must wait for, as a few futures (see the module docstring).

    A read waits on the writes at its path, above it and below it; a write also on
    the reads there. run_terminal calls stay out of the trie: one waits on every
    file call before it (`_files`), a file call on the last run of run_terminal
    calls (`_terminals`), which waited on everything before them in turn.
    """

    def __init__(self) -> None:
        self._root = _Node()
        self._files = _Barrier()
        self._terminals: _Barrier | None = None
        self._run_open = False  # whether the last call that touches anything was a run_terminal

    def deps(self, fp: specs.Footprint) -> list[asyncio.Future[Any]]:
        if fp.terminal:
            found = [self._files.future()]
        elif fp.reads or fp.writes:
            found = [self._terminals.future() if self._terminals else None]
            for path in fp.reads:
                *above, node = self._path(path)
                found += [n.writer for n in above] + [node.writer, node.below_writes.future()]
            for path in fp.writes:
                *above, node = self._path(path)
                found += [n.writer for n in above] + [n.readers.future() for n in above]
                found.append(node.below.future())
        else:
            found = []
        return [f for f in dict.fromkeys(found) if f is not None]

    def add(self, fp: specs.Footprint, task: asyncio.Future[Any]) -> None:
        if fp.terminal:
            if not self._run_open or self._terminals is None:
                self._terminals = _Barrier()
            self._terminals.add(task)
            self._run_open = True
            return
        if not (fp.reads or fp.writes):
            return
        self._files.add(task)
        self._run_open = False
        for path in fp.reads:
            nodes = self._path(path)
            nodes[-1].readers.add(task)
            for n in nodes:
                n.below.add(task)
        for path in fp.writes:
            nodes = self._path(path)
            nodes[-1].writer = task
            nodes[-1].readers = _Barrier()
            for n in nodes:
                n.below.add(task)
                n.below_writes.add(task)

    def _path(self, path: str) -> list[_Node]:
        """The nodes from the root (ALL) down to `path`, made as needed."""
        nodes = [self._root]
        for part in path.split("/") if path else ():
            child = nodes[-1].children.get(part)
            if child is None:
                child = nodes[-1].children[part] = _Node()
            nodes.append(child)
        return nodes


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
