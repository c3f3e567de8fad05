"""The session loop: user requests, answered by a model through tool calls.

    session = Session(model=make_model("smollm2"), workspace=LocalWorkspace(root))
    result = await session.run("fix the failing test")
    result = await session.run("now add a test for it")   # a follow-up, same session

A session is a conversation: every `run` after the first is a follow-up that keeps
the history (earlier requests, model turns, tool results and answers) and shrinks
it to fit the context window as any long session does (`_fit_context`). Turns
number on across requests, so the trace of a session holds all of them. Another
process (a restarted server) continues a session from its trace:
`Session(..., history=History.from_trace(store.export(id)))`.

Each turn streams the model's reply through the XML parser; every call starts the
moment its closing tag arrives (`Executor`), and the turn's results go back in one
message. A reply without calls is the answer. Recoverable problems (malformed
calls, failed tools, refused approvals) are results the model reads; terminal ones
(budgets, cancellation, a failing model) end the session with a status. The trace
is written from the session's events (`events.TraceRecorder`) as each step ends,
and always finished in a `finally`.

Training wraps this loop unchanged: a rollout is a session whose `TurnRecord`s
carry the token ids and logprobs the trainer needs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import re
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from opencomposer.agent import alternatives, localize, repair, reproduce, trials
from opencomposer.agent import events as ev
from opencomposer.agent.executor import Approval, CallRecord, Executor, Hooks, format_results
from opencomposer.agent.prompts import system_prompt, user_message
from opencomposer.agent.protocols import Message, Model, ModelError, Sampling, TurnOutput
from opencomposer.agent.text import valid_text
from opencomposer.agent.traces import TraceStore
from opencomposer.agent.xmlcalls import ParsedCall, StreamParser, parse_all, without_calls
from opencomposer.tools import specs
from opencomposer.tools.output import cap
from opencomposer.tools.protocols import (
    Edit,
    Index,
    SandboxConfig,
    ToolContext,
    ToolError,
    ToolResult,
    Workspace,
)
from opencomposer.tools.sandbox import CommandResult, run_sandboxed

log = logging.getLogger(__name__)

Policy = Literal["none", "safe", "all"]
Approver = Callable[[str, dict[str, Any]], Awaitable[Approval]]
POLICIES: tuple[str, ...] = ("none", "safe", "all")
_EVENT_OUTPUT_LIMIT = 4_000  # characters of a tool result that live views get in tool_end


DEFAULT_MAX_TURNS = 25
# A turn whose calls all failed, made again unchanged with the same results this many
# turns in a row, ends the session (status "repetition"): a model in that loop does
# not leave it, and every further turn spends time and tokens on the same error. A
# turn whose repair (`SessionConfig.repair`) ruled out candidates is not such a turn:
# the next one tries the candidates after them.
STUCK_TURNS = 3
# A trial run of a candidate change (`SessionConfig.verify_s`) may take this many times
# what the failing command took, and at least TRIAL_MIN_S seconds.
TRIAL_FACTOR = 3.0
TRIAL_MIN_S = 5.0
# Bytes of output kept from the test-suite run that reproduces a request's failure
# (`SessionConfig.reproduce_s`): every failure's section is read.
SUITE_OUTPUT = 4_000_000


@dataclass(frozen=True, kw_only=True)
class SessionConfig:
    approve: Policy = (
        "safe"  # which calls run without asking: none, safe (read-only + allowlist), all
    )
    # None: the model's own budget (`max_turns` of a trained policy's folder, the turns it
    # was trained to finish in), else DEFAULT_MAX_TURNS
    max_turns: int | None = None
    max_completion_tokens: int = 64_000
    sampling: Sampling = field(default_factory=Sampling)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    output_limit: int = 20_000  # characters of one tool result the model sees
    emit_deltas: bool = True  # model_delta events for live views
    prompt_style: str = "auto"  # full | compact | auto (the model's `prompt_style`, else full)
    # a client's own setting, not the policy's: under `safe`, file changes run without
    # a question because the client shows each as an edit to accept, reject or undo
    auto_apply_edits: bool = False
    # an answer given while the model's own last command after its last change failed
    # is sent back once per request, with that command's exit code (`unchecked_answer`)
    recheck: bool = True
    # replies sampled for a turn that changes files, the likeliest change kept
    # (`agent/alternatives.py`); None: the model's own `fix_samples`, else 1 (off). Only
    # a backend with `alternatives` and `logprob` (vLLM, llama.cpp) can; others keep one reply
    fix_samples: int | None = None
    fix_temperature: float = 0.8  # of the extra replies: they must differ to help
    # with fix_samples, while the model's last command failed, the candidates are tried
    # against that command, best-ranked first, each in a read-only trial run that sees
    # its changed files (`alternatives.first_passing`); the first that passes is kept.
    # The seconds those runs may take in one turn; 0: off. Only a command that would
    # run without a question is tried (the policy allows it, or the user said "always")
    verify_s: float = 60.0
    # trial runs made side by side (each sees its own files; the workspace is read-only
    # to them), the first in order that passes wins
    trials_at_once: int = 2
    # when the model's last command failed and the turn's change does not make it pass,
    # small edits the model itself proposes in the code around the change, the failing
    # run's traceback and what the session looked at are tried against that command in
    # trial runs, within `verify_s` of their own, and the first that passes is made instead
    # (`agent/repair.py`); None: the model's own `repair` setting. Needs a backend with
    # `top_tokens`, `greedy` and `logprob` (vLLM, llama.cpp)
    repair: bool | None = None
    # with repair, a change whose trial run still fails the model's last pytest check
    # (its run named failing tests), when no proposed edit passes either, is not made:
    # its calls fail with a note that says so. Made, a wrong change moves the code every
    # later repair starts from away from the one the failing run showed
    hold_failing: bool = True
    # with repair, a request that quotes how the code fails (pytest's `E` lines, an
    # exception's line) has the project's test suite run once before the first turn,
    # read-only, and the tests that fail that way become the failing check while the
    # model has run none of its own (`agent/reproduce.py`). The seconds that run may
    # take; 0: off
    reproduce_s: float = 120.0


@dataclass(frozen=True, kw_only=True)
class _Reproduced:
    """The failure a request quoted, as the session reproduced it (`_reproduce`)."""

    command: str  # the tests that fail as the request says, alone
    seconds: float  # what that run took
    output: str  # what it printed
    suite_s: float  # what the run of the whole suite that found them took


@dataclass(kw_only=True)
class TurnRecord:
    turn: int
    messages: list[Message]  # the prompt of this turn
    output: TurnOutput
    calls: list[CallRecord]
    t_start: float  # the session's clock (`events.Clock`)
    t_end: float


@dataclass(frozen=True, kw_only=True)
class History:
    """What a follow-up continues: the conversation so far and the session's counts.

    `messages` ends with the last request's answer (or wherever that request
    stopped); `turns` and `tool_calls` count the whole session, so a follow-up's
    turns and call ids number on; `started` is the wall-clock time of the session's
    t = 0, so all its requests share one time line."""

    messages: tuple[Message, ...]
    requests: int
    turns: int
    tool_calls: int
    edits: int
    started: float

    @classmethod
    def from_trace(cls, trace: dict[str, Any]) -> History:
        """A session's history as `TraceStore.export` kept it: the last turn's prompt
        and its reply (and that turn's tool results, when it stopped before answering)."""
        turns = trace.get("turns") or []
        messages: list[Message] = []
        if turns:
            last = turns[-1]
            for m in last["messages"]:
                results = m["role"] == "user" and m["content"].startswith("<tool_result")
                kind: Literal["text", "tool_results"] = "tool_results" if results else "text"
                messages.append(Message(role=m["role"], content=m["content"], kind=kind))
            messages.append(Message(role="assistant", content=last["text"] or ""))
            calls = [c for c in trace.get("tool_calls") or [] if c["turn"] == last["turn"]]
            if calls:
                records = [
                    CallRecord(
                        call_id=c["call_id"],
                        turn=c["turn"],
                        index=c["idx"],
                        name=c["name"],
                        args=c["args"],
                        result=ToolResult(status=c["status"], output=c["result"] or ""),
                    )
                    for c in calls
                ]
                messages.append(
                    Message(role="user", content=format_results(records), kind="tool_results")
                )
        else:
            style = (trace.get("meta") or {}).get("prompt_style") or "full"
            messages = [
                Message(role="system", content=system_prompt(style=style)),
                Message(role="user", content=trace.get("query") or ""),
            ]
        requests = (trace.get("meta") or {}).get("requests") or [{}]
        return cls(
            messages=tuple(messages),
            requests=len(requests),
            turns=max((t["turn"] for t in turns), default=0),
            tool_calls=len(trace.get("tool_calls") or []),
            edits=max((e["seq"] for e in trace.get("edits") or []), default=0),
            started=float(trace.get("started") or 0.0),
        )


@dataclass(kw_only=True)
class SessionResult:
    session_id: str
    status: (
        str  # completed | cancelled | error | max_turns | max_tokens | context_full | disconnected
    )
    answer: str
    edits: list[Edit]
    trace: str
    turns: list[TurnRecord]
    tool_calls: int
    duration_s: float
    error: str | None = None


# Timings in a command's output ("1 failed in 0.12s", "0:00:03"), which differ between
# two runs of the same failing test; masked when turns are compared for a loop.
_TIMING = re.compile(r"\b\d+(?:\.\d+)?s\b|\b\d+:\d\d:\d\d\b")


def _failing(turn: TurnRecord) -> list[tuple[str, str, str]] | None:
    """A turn's calls with their errors, when every call it made failed and its repair
    did not move on (`_searching`); else None."""
    if not turn.calls or any(c.result is None or c.result.status != "error" for c in turn.calls):
        return None
    if _searching(turn):
        return None
    return [(c.name, repr(c.args), c.result.output if c.result else "") for c in turn.calls]


def _searching(turn: TurnRecord) -> bool:
    """Whether the turn's repair ruled out candidates in trial runs: the next turn's
    repair leaves those aside and tries the ones after them (`repair.propose`'s
    `known`), so the turn, however alike its calls, is not a loop. Once no candidate
    is left, or none can be tried, a repair rules out nothing and the loop shows."""
    meta = turn.output.meta.get("repair")
    return isinstance(meta, dict) and int(meta.get("ruled_out") or 0) > 0


def _same(a: list[tuple[str, str, str]] | None, b: list[tuple[str, str, str]] | None) -> bool:
    """Whether two failing turns made the same calls with the same errors, timings aside."""
    if a is None or b is None or len(a) != len(b):
        return False
    return all(
        x[:2] == y[:2] and _TIMING.sub("#", x[2]) == _TIMING.sub("#", y[2])
        for x, y in zip(a, b, strict=True)
    )


def unchecked_answer(turns: list[TurnRecord]) -> str:
    """Why an answer after `turns` is not done yet, or "": a change applied in them, and
    the last command `run_terminal` ran after the last change exited non-zero (or was
    killed). Only the model's own command counts: it chose what shows the change works.
    A request without a change, or whose change was never run afterwards, gets "":
    nothing it ran says the answer is wrong. A command that exits non-zero and prints
    nothing (a `grep` that finds no line) is a search, not a check, and is passed over."""
    changed, failed = False, None
    for c in (c for t in turns for c in t.calls):
        spec, result = specs.BY_NAME.get(c.name), c.result
        if result is None:
            continue
        if spec is not None and spec.kind == "edit" and result.status == "ok":
            changed, failed = True, None
        elif changed and (meta := _check_meta(c)) is not None:
            code, killed = meta.get("exit_code"), meta.get("killed_reason")
            failed = (str(c.args.get("command", "")), code, killed) if code or killed else None
    if failed is None:
        return ""
    command, code, killed = failed
    how = f"was killed ({killed})" if killed else f"exited with code {code}"
    return (
        f"After your last change, `{_one_line(command)}` {how}, so the task is not done "
        "yet. Keep working on it; if it cannot pass, answer and say why."
    )


def _one_line(command: str, limit: int = 200) -> str:
    command = " ".join(command.split())
    return command if len(command) <= limit else command[: limit - 1] + "…"


def _check_meta(call: CallRecord) -> dict[str, Any] | None:
    """The meta of a `run_terminal` call that checked something: it started (not refused)
    and did not fail silently (exit non-zero with no output: a search that found
    nothing); None for any other call."""
    if call.name != specs.RUN_TERMINAL or call.result is None:
        return None
    meta = call.result.meta or {}
    code, killed = meta.get("exit_code"), meta.get("killed_reason")
    if code is None and not killed:
        return None  # refused or never started
    if code and not killed and meta.get("silent"):
        return None
    return meta


def _last_check(turns: list[TurnRecord]) -> tuple[CallRecord, dict[str, Any]] | None:
    """The model's last check and its meta, a pytest run of no test
    (`localize.ran_no_test`) passed over; None when it has run none."""
    last = None
    for c in (c for t in turns for c in t.calls):
        meta = _check_meta(c)
        if meta is not None and not localize.ran_no_test(
            str(c.args.get("command", "")), meta.get("exit_code")
        ):
            last = (c, meta)
    return last


def failing_check(turns: list[TurnRecord]) -> tuple[str, float] | None:
    """(command, seconds it ran) of the model's last check when that check failed, by
    its exit code, not by a kill; None when it passed, was killed, or there is none.
    What a change is tried against before it is made (`SessionConfig.verify_s`). A
    pytest run of no test (`localize.ran_no_test`: a wrong path, a `-k` matching none)
    is passed over: no change can make it pass, and the check before it still holds."""
    last = _last_check(turns)
    if last is None:
        return None
    call, meta = last
    if not meta.get("exit_code") or meta.get("killed_reason"):
        return None
    return str(call.args.get("command", "")), float(meta.get("duration_s") or 0.0)


def _failing_output(turns: list[TurnRecord], command: str) -> str:
    """The output of the last run of `command` in the session."""
    for c in reversed([c for t in turns for c in t.calls]):
        if c.name == specs.RUN_TERMINAL and str(c.args.get("command", "")) == command:
            return c.result.output if c.result else ""
    return ""


def _digest(*parts: str) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part.encode("utf-8", "surrogatepass") + b"\0")
    return h.digest()


def _changed_paths(turns: list[TurnRecord]) -> list[str]:
    """The files the session's changes applied to, each once, in order."""
    paths: dict[str, None] = {}
    for c in (c for t in turns for c in t.calls):
        spec, ok = specs.BY_NAME.get(c.name), c.result is not None and c.result.status == "ok"
        if spec is not None and spec.kind == "edit" and ok:
            paths[str(c.args.get("path", ""))] = None
    return list(paths)


def _repair_lines(
    ws: Workspace,
    turns: list[TurnRecord],
    held: list[ParsedCall],
    called: Sequence[tuple[str, int]] = (),
    installed: tuple[str, ...] = (),
    failing_output: str = "",
) -> list[tuple[str, int]]:
    """(path, 0-based line) where a repair looks for its edits, the likeliest first:
    what the turn's change targets, the frames of the failing run's traceback
    (`failing_output`, innermost first), the functions the failing test called (`called`, the last
    called first: `agent/localize.py`), then the lines the session's greps found and
    its reads showed, the latest first. None in the folders packages were installed
    into (`installed`, `localize.installed_folders`): a dependency's code is not the
    project's to fix, though a traceback runs through it."""
    lines: list[tuple[str, int]] = []

    def rel(path: str) -> str | None:
        try:
            return ws.relative(ws.resolve(path))
        except (ToolError, OSError, ValueError):
            return None

    for call in held:
        if call.name == specs.EDIT_FILE and (path := rel(call.raw.get("path", ""))):
            old = call.raw.get("old", "")
            try:
                text = ws.read_text(path) if old and ws.exists(path) else ""
            except (ToolError, OSError, UnicodeDecodeError):
                text = ""
            if old and (at := text.find(old)) >= 0:
                lines.append((path, text.count("\n", 0, at)))
    root = str(ws.root)
    lines += repair.traceback_lines(failing_output, root)
    lines += called
    records = [c for t in turns for c in t.calls if c.result is not None]
    for c in reversed(records):
        out = c.result.output if c.result else ""
        if c.name == specs.GREP:
            lines += [(p, n) for p, n in repair.traceback_lines(out, root)[::-1]]
        elif c.name == specs.READ_FILE and c.result and c.result.status == "ok":
            path = rel(str(c.args.get("path", "")))
            # a read that ran has its arguments validated: the lines are ints or absent
            start = int(c.args.get("start_line") or 1)
            end = int(c.args.get("end_line") or start + out.count("\n"))
            if path:
                lines += [(path, n) for n in range(max(0, start - 1), max(start, end))]
    return [(p, n) for p, n in lines if not localize.is_installed(p, installed)]


def _first_error(calls: list[tuple[str, str, str]]) -> str:
    name, _, output = calls[0]
    lines = output.strip().splitlines() or [""]
    return f"{name}: {lines[0][:160]}"


def _stuck(turns: list[TurnRecord]) -> str:
    """Why the session is in a loop, or "": its last turns repeat one failing turn
    (`STUCK_TURNS` in a row) or alternate between two (two full cycles, as a model does
    that sends an edit that fails, reruns the failing test, and sends the edit again),
    each call failing with the same output as the last time it was made (`_same`)."""
    for period in (1, 2):
        span = max(STUCK_TURNS, 2 * period)
        keys = [_failing(t) for t in turns[-span:]]
        if len(keys) < span or any(k is None for k in keys):
            continue
        if not all(_same(keys[i], keys[i - period]) for i in range(period, span)):
            continue
        said = [_first_error(k) for k in keys[-period:] if k]
        if period == 1:
            calls = "call" if len(keys[-1] or ()) == 1 else "calls"
            return f"the model made the same failing {calls} {span} turns in a row ({said[0]})"
        return (
            f"the model alternated between the same two failing turns {span} turns in a row "
            f"({'; '.join(said)})"
        )
    return ""


class _End(Exception):
    def __init__(self, status: str, message: str = ""):
        super().__init__(message or status)
        self.status = status


class Session:
    def __init__(
        self,
        *,
        model: Model,
        workspace: Workspace,
        config: SessionConfig | None = None,
        on_event: ev.Subscriber | None = None,
        approver: Approver | None = None,
        traces: TraceStore | None = None,
        index: Index | None = None,
        index_factory: Callable[[], Awaitable[Index]] | None = None,
        on_file_changed: Callable[[str], None] | None = None,
        session_id: str | None = None,
        history: History | None = None,
    ):
        self.model = model
        self.workspace = workspace
        self.config = config or SessionConfig()
        # the backends read a folder's budget already checked (`read_turn_budget`)
        self.max_turns = (
            self.config.max_turns or getattr(model, "max_turns", None) or DEFAULT_MAX_TURNS
        )
        self.approver = approver
        self.traces = traces
        self.id = session_id or uuid.uuid4().hex[:12]
        self.ctx = ToolContext(
            workspace=workspace,
            index=index,
            index_factory=index_factory,
            sandbox=self.config.sandbox,
            on_file_changed=on_file_changed,
        )
        self.clock = ev.Clock()
        # everything the session outputs goes through `emit` to these, in this order
        self.subscribers: list[ev.Subscriber] = [ev.TraceRecorder(traces)] if traces else []
        self.subscribers += [on_event] if on_event else []
        self.messages: list[Message] = []
        self.turns: list[TurnRecord] = []
        self.edits: list[Edit] = []
        self.requests = 0  # requests run so far (the first, then follow-ups)
        self.turn_count = 0  # model turns over all requests: turn numbers go on across them
        self.tool_calls = 0
        self.edit_count = 0
        self.completion_tokens = 0
        self._request_index = 1  # where in `messages` the current request stands
        self._request_t = 0.0  # `t` at the current request's start
        if history is not None:
            self.messages = list(history.messages)
            self.requests, self.turn_count = history.requests, history.turns
            self.tool_calls, self.edit_count = history.tool_calls, history.edits
            self.clock.rewind(history.started)
        self._always: set[str] = set()
        self._approval_lock = asyncio.Lock()
        self._task: asyncio.Task[Any] | None = None
        self._cancel_reason: str | None = None
        self._running = False
        self._rechecked = False  # this request's answer was sent back once (`_recheck`)
        # digests of the candidate edits a trial run of a failing command failed
        # (`_repair`): a later repair against that command, even of the same code in the
        # same focus, takes others in their place
        self._failed_edits: set[bytes] = set()
        # the model's answers to the repairs' reads (`repair.Remembered`), made once
        self._repair_lm: repair.Remembered | None = None
        # this request's failure as the session reproduced it (`_reproduce`)
        self._reproduced: _Reproduced | None = None

    # -- public -----------------------------------------------------------------

    @property
    def prompt_style(self) -> str:
        """The system-prompt style this session uses (see `agent.prompts`)."""
        style = self.config.prompt_style
        if style == "auto":
            style = getattr(self.model, "prompt_style", None) or "full"
        return style

    @property
    def running(self) -> bool:
        """A request is in progress (a follow-up must wait for its end)."""
        return self._running

    def history(self) -> History:
        """The conversation so far, for a follow-up on another `Session` object."""
        return History(
            messages=tuple(self.messages),
            requests=self.requests,
            turns=self.turn_count,
            tool_calls=self.tool_calls,
            edits=self.edit_count,
            started=self.clock.wall,
        )

    async def run(self, query: str, context: str | None = None) -> SessionResult:
        """Answer `query`; called again once it returned, a follow-up in the same session."""
        if self.running:
            raise RuntimeError(f"session {self.id} is still running")
        query, context = valid_text(query), context and valid_text(context)
        self._task, self._cancel_reason, self._running = asyncio.current_task(), None, True
        self.requests += 1
        self._request_t = self.clock.now()
        self.turns, self.edits, self.completion_tokens = [], [], 0
        self._rechecked = False
        self._reproduced = None
        if not self.messages:
            self.messages = [Message(role="system", content=system_prompt(style=self.prompt_style))]
        self.messages.append(Message(role="user", content=user_message(query, context)))
        self._request_index = len(self.messages) - 1
        self.emit(
            ev.SessionStart,
            session_id=self.id,
            request=self.requests,
            first_turn=self.turn_count + 1,
            edits=self.edit_count,
            workspace=str(self.workspace.root),
            model=self.model.name,
            started=self.clock.wall,
            query=query,
            sampling=vars(self.config.sampling) | {"stop": list(self.config.sampling.stop)},
            prompt_style=self.prompt_style,
            tools=tuple(s.name for s in specs.SPECS),
        )
        status, answer, error = "completed", "", None
        try:
            await self._reproduce(query)
            answer = await self._loop()
        except _End as end:
            status, error = end.status, str(end)
        except ModelError as e:
            status, error = "error", f"model failed: {e}"
        except asyncio.CancelledError:
            status = self._cancel_reason or "cancelled"
            if (
                self._cancel_reason is None
            ):  # cancelled from outside: finish the trace, then propagate
                self._finish(status, answer, error)
                raise
            if self._task is not None:
                self._task.uncancel()
        except Exception as e:
            log.exception("session %s failed", self.id)
            status, error = "error", f"{type(e).__name__}: {e}"
        return self._finish(status, answer, error)

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop the model stream and the running tools; run() returns with `reason`."""
        if self._task is not None and not self._task.done() and self._cancel_reason is None:
            self._cancel_reason = reason
            self._task.cancel()

    # -- the loop ---------------------------------------------------------------

    async def _loop(self) -> str:
        for _ in range(self.max_turns):
            self.turn_count += 1
            record = await self._turn(self.turn_count)
            if record.output.finish_reason == "repetition":  # stopped by the stream's guard
                raise _End(
                    "repetition",
                    f"the model kept repeating itself; its reply was stopped after "
                    f"{len(record.output.text)} characters",
                )
            if not record.calls:
                self.messages.append(Message(role="assistant", content=record.output.text))
                why = self._recheck()
                if not why:
                    return record.output.text.strip()
                self.messages.append(Message(role="user", content=why))
                continue
            self.messages.append(Message(role="assistant", content=record.output.text))
            self.messages.append(
                Message(role="user", content=format_results(record.calls), kind="tool_results")
            )
            stuck = _stuck(self.turns)
            if stuck:
                raise _End("repetition", stuck)
            if self.completion_tokens >= self.config.max_completion_tokens:
                raise _End(
                    "max_tokens",
                    f"completion token budget of {self.config.max_completion_tokens} spent",
                )
        raise _End("max_turns", f"no answer within {self.max_turns} turns")

    def _recheck(self) -> str:
        """The note that sends an answer back (`unchecked_answer`), or "" to accept it:
        once a request, while it has a turn left."""
        if not self.config.recheck or self._rechecked or len(self.turns) >= self.max_turns:
            return ""
        why = unchecked_answer(self.turns) or self._still_failing()
        self._rechecked = bool(why)
        return why

    def _still_failing(self) -> str:
        """The note for an answer given while the failure the session reproduced
        (`_reproduce`) still shows, or "": the model ran no check of its own, and the
        answer's turn had the code as it is fail the reproducing tests in its repair's
        trial run (a repair that found an edit gives its turn a call: not an answer)."""
        found = self._reproducing()
        if found is None or not self.turns:
            return ""
        meta = self.turns[-1].output.meta.get("repair")
        if not isinstance(meta, dict) or meta.get("command") != found.command:
            return ""
        return (
            f"`{_one_line(found.command)}`, the tests that fail as the request shows, still "
            "fails, so the task is not done yet. Keep working on it; if it cannot pass, "
            "answer and say why."
        )

    async def _turn(self, turn: int) -> TurnRecord:
        sampling = self._fit_context()
        t_start = self.clock.now()
        self.emit(ev.ModelStart, turn=turn)
        parser = StreamParser(*specs.parser_rules())
        executor = Executor(
            self.ctx,
            turn=turn,
            gate=self._gate,
            hooks=Hooks(on_start=self._on_call_start, on_end=self._on_call_end),
            output_limit=self.config.output_limit,
        )
        prompt = list(self.messages)
        stream = self.model.stream(prompt, sampling)
        # with `fix_samples`, or `repair` while the last check failed, a change and every
        # call after it wait for the reply's end
        hold = self._fix_samples() > 1 or (self._repair_on() and self._trial() is not None)
        held: list[ParsedCall] = []

        def route(calls: list[ParsedCall]) -> None:
            for call in calls:
                if held or (hold and alternatives.changes(call)):
                    held.append(call)
                else:
                    executor.submit(call)

        try:
            async for delta in stream:
                parsed = parser.feed(delta)
                if self.config.emit_deltas and delta:
                    self.emit(ev.ModelDelta, turn=turn, text=delta, prose=parser.prose())
                route(parsed)
            route(parser.close())
            output = stream.output or TurnOutput(text=parser.text)
            all_calls = parser.calls
            if held:
                output, all_calls, held = await self._pick_change(output, all_calls, held)
            elif hold and self._repair_on() and (trial := self._trial()) is not None:
                # no change while the last check fails: the model's own edits may pass it
                repaired = await self._repair(output, all_calls, [], trial)
                if repaired is not None:
                    output, all_calls, held = repaired
            for call in held:
                executor.submit(call)
            self.completion_tokens += output.completion_tokens
            self.emit(
                ev.ModelEnd,
                turn=turn,
                prompt_tokens=output.prompt_tokens,
                completion_tokens=output.completion_tokens,
                prompt=tuple(prompt),
                output=output,
                t_start=t_start,
            )
            prose = without_calls(output.text, all_calls)
            self.emit(ev.Message, turn=turn, text=output.text, prose=prose)
            calls = await executor.wait()
        except BaseException:
            await stream.aclose()
            await executor.cancel()
            raise
        record = TurnRecord(
            turn=turn,
            messages=prompt,
            output=output,
            calls=calls,
            t_start=t_start,
            t_end=self.clock.now(),
        )
        self.turns.append(record)
        return record

    def _fix_samples(self) -> int:
        n = self.config.fix_samples
        n = getattr(self.model, "fix_samples", 1) if n is None else n
        able = hasattr(self.model, "alternatives") and hasattr(self.model, "logprob")
        return n if able and isinstance(n, int) else 1

    def _repair_on(self) -> bool:
        on = self.config.repair
        on = getattr(self.model, "repair", False) is True if on is None else on
        able = all(hasattr(self.model, m) for m in ("top_tokens", "greedy", "logprob"))
        return bool(on) and able and hasattr(self.model, "tokenizer")

    async def _pick_change(
        self, output: TurnOutput, calls: list[ParsedCall], held: list[ParsedCall]
    ) -> tuple[TurnOutput, list[ParsedCall], list[ParsedCall]]:
        """The reply to keep for a turn that changes files: with `fix_samples`, among
        `output` and more replies (`_sample_change`); with `repair`, a small edit of the
        model's own in place of its change when that change does not pass the failing
        command and the edit does, or its change not made when no edit does (`_repair`).
        Returns (the kept reply's output, all its calls, its calls from the first change
        on, which have not run yet)."""
        kept, passed = (output, calls, held), False
        if self._fix_samples() > 1:
            kept, passed = await self._sample_change(output, calls, held)
        if not passed and self._repair_on() and (trial := self._trial()) is not None:
            repaired = await self._repair(*kept, trial)
            if repaired is not None:
                kept = repaired
        return kept

    async def _sample_change(
        self, output: TurnOutput, calls: list[ParsedCall], held: list[ParsedCall]
    ) -> tuple[tuple[TurnOutput, list[ParsedCall], list[ParsedCall]], bool]:
        """The reply to keep among `output` and `fix_samples - 1` more that share its
        text up to the end of the last call before its first change, the calls that have
        run (`agent/alternatives.py`): each writes what it says about the change anew,
        so the candidates differ in more than the edit. While the last check failed, the
        first candidate that passes it is kept; the second value says whether one did."""
        first = held[0]
        ran = [c for c in calls if c.index < first.index]
        cut = max((c.end for c in ran), default=0)
        try:
            more = await self.model.alternatives(  # type: ignore[attr-defined]
                output,
                cut,
                self._fix_samples() - 1,
                Sampling(
                    temperature=self.config.fix_temperature,
                    top_p=self.config.sampling.top_p,
                    max_tokens=self.config.sampling.max_tokens,
                    stop=self.config.sampling.stop,
                ),
            )
        except ModelError as e:
            log.warning("session %s: no alternatives to rank: %s", self.id, e)
            return (output, calls, held), False
        replies = [(output, calls, held)]
        for alt in more:
            alt_calls = parse_all(alt.text, *specs.parser_rules())
            before = [(c.name, c.raw) for c in alt_calls if c.index < first.index]
            if before != [(c.name, c.raw) for c in ran]:
                continue  # it did not make the calls that ran as they ran
            replies.append((alt, alt_calls, [c for c in alt_calls if c.index >= first.index]))
        ranked = await alternatives.rank(
            self.workspace,
            [r[2] for r in replies],
            self.model.logprob,  # type: ignore[attr-defined]
        )
        index, checked = ranked.index, None
        if len(replies) > 1 and (trial := self._trial()) is not None:
            command, check, _ = trial
            tried = await alternatives.first_passing(
                self.workspace, ranked, check, self.config.trials_at_once
            )
            checked = {"command": command, "runs": tried.runs, "passed": tried.index}
            index = ranked.index if tried.index is None else tried.index
        chosen = replies[index]
        chosen[0].meta["fix_samples"] = {
            "chosen": index,
            "gains": [round(g, 3) if g > float("-inf") else None for g in ranked.gains],
            **({"checked": checked} if checked else {}),
        }
        return chosen, bool(checked and checked["passed"] is not None)

    async def _repair(
        self,
        output: TurnOutput,
        calls: list[ParsedCall],
        held: list[ParsedCall],
        trial: tuple[str, alternatives.Check, float],
    ) -> tuple[TurnOutput, list[ParsedCall], list[ParsedCall]] | None:
        """The reply with its change replaced by the first of the model's own small
        edits (`repair.propose`) that passes the failing command, when the change itself
        does not, or with that edit added when the reply changes nothing (`held` empty)
        and the code as it is still fails; when no edit passes in the time left, the
        reply with its failing change held back (`_held_back`, `_holds`); None when the
        change or the code passes, or nothing can be tried."""
        command, check, deadline = trial
        t0 = self.clock.now()
        runs = 0
        # the files as the change leaves them: a call of it that cannot apply fails alone
        own = alternatives.preview(self.workspace, held, skipping=True) or {}
        # the change, or the code as it is when the reply changes nothing or its change
        # cannot be tried (no call of it applies, it deletes or creates a file): code that
        # passes already has nothing to repair, whatever the change does on its own
        tried = bool(own) and all(self.workspace.exists(p) for p in own)
        passed = await check({p: after for p, (_, after) in own.items()} if tried else {})
        runs += passed is not None
        if passed is None or passed:
            return None  # it passes, or nothing more can be tried
        own_failed = tried

        def unrepaired() -> tuple[TurnOutput, list[ParsedCall], list[ParsedCall]] | None:
            if own_failed and self._holds(command):
                return self._held_back(output, calls, held, command)
            return None

        installed = localize.installed_folders(self.workspace.root)
        traced = await self._failing_run(command, installed)
        lines = _repair_lines(
            self.workspace, self.turns, held, traced.called, installed, self._output(command)
        )
        texts: dict[str, str] = {}
        for path, _ in lines:
            if path not in texts and self.workspace.exists(path):
                try:
                    texts[path] = self.workspace.read_text(path)
                except (ToolError, OSError, UnicodeDecodeError):
                    continue
        spans = repair.focus(texts, lines)
        if not spans:
            return unrepaired()
        # a candidate failed before when the command, its file's text after it and the
        # files the session changed are as they were then
        parts = [command]
        for path in _changed_paths(self.turns):
            try:
                parts += [path, self.workspace.read_text(path)]
            except (ToolError, OSError, UnicodeDecodeError):
                parts += [path, ""]
        state = _digest(*parts).hex()  # read once, not for every candidate
        skipped = 0

        def known(path: str, after: str) -> bool:
            nonlocal skipped
            failed = _digest(state, path, after) in self._failed_edits
            skipped += failed
            return failed

        ruled_out: set[bytes] = set()  # this turn's candidates that failed a trial

        def failed(path: str, after: str) -> None:
            key = _digest(state, path, after)
            self._failed_edits.add(key)
            ruled_out.add(key)

        live = repair.live_check(texts, traced.executed)
        # of the lines in focus, those the failing run reached (when its record tells)
        reached = None
        if live is not None:
            focus_lines = [(s.path, n) for s in spans for n in range(s.start, s.end)]
            reached = [sum(live(p, n) for p, n in focus_lines), len(focus_lines)]
        try:
            if self._repair_lm is None:
                self._repair_lm = repair.Remembered(self.model)  # type: ignore[arg-type]
            lm = self._repair_lm
            asked, reused = lm.asked, lm.reused
            proposals = await repair.propose(
                lm,
                self.model.tokenizer,  # type: ignore[attr-defined]
                texts,
                spans,
                known=known,
                live=live,
            )
        except ModelError as e:
            log.warning("session %s: no edits proposed: %s", self.id, e)
            return unrepaired()
        proposed_s = self.clock.now() - t0
        turned_down: dict[str, int] = {}
        index, tried_runs, forked = await self._first_passing(
            command, proposals, check, deadline, turned_down, failed
        )
        runs += tried_runs
        found = None if index is None else proposals[index]
        meta = {
            "command": command,
            "spans": [[s.path, s.start + 1, s.end] for s in spans],
            **({"reached": reached} if reached else {}),
            "proposals": len(proposals),
            **({"not_run": not_run} if (not_run := sum(not p.ran for p in proposals)) else {}),
            **({"known_failed": skipped} if skipped else {}),
            **({"forked": forked} if forked else {}),
            **({"turned_down": turned_down} if turned_down else {}),
            **self._reproduced_meta(command),
            "runs": runs,
            "ruled_out": len(ruled_out),
            "untried": max(0, len(proposals) - len(ruled_out)),
            "propose_s": round(proposed_s, 2),
            # the model's reads proposing made, and those answered from memory
            "reads": [lm.asked - asked, lm.reused - reused],
            "seconds": round(self.clock.now() - t0, 2),
        }
        if found is None:
            output.meta["repair"] = meta
            log.info("session %s: no proposed edit passed (%s)", self.id, meta)
            return unrepaired()
        return self._repaired(output, calls, held, found, meta)

    def _holds(self, command: str) -> bool:
        """Whether a change that fails `command`, the session's failing check, is held
        back (`SessionConfig.hold_failing`): only when that check's last run named the
        tests it failed. A command that fails for any other reason (a wrong path, a
        usage error) fails with every change, the right one too."""
        output = self._output(command)
        return self.config.hold_failing and bool(localize.failed_tests(output))

    def _held_back(
        self,
        output: TurnOutput,
        calls: list[ParsedCall],
        held: list[ParsedCall],
        command: str,
    ) -> tuple[TurnOutput, list[ParsedCall], list[ParsedCall]]:
        """The reply with its changes not made: each fails with a note saying that
        `command` still fails with them, and the calls after them run as sent (a rerun
        of the test shows the code as it is). The text stays the model's own."""
        note = (
            f"not made: `{_one_line(command)}` still fails with this reply's changes "
            "(tried on a copy of the workspace first); no file was changed"
        )
        refused = {
            c.index: dataclasses.replace(c, error=note) for c in held if alternatives.changes(c)
        }
        meta = output.meta.get("repair")
        output.meta["repair"] = {
            **(meta if isinstance(meta, dict) else {"command": command}),
            "held_back": len(refused),
        }
        log.info("session %s: %d change(s) failing `%s` held back", self.id, len(refused), command)
        return (
            output,
            [refused.get(c.index, c) for c in calls],
            [refused.get(c.index, c) for c in held],
        )

    def _repaired(
        self,
        output: TurnOutput,
        calls: list[ParsedCall],
        held: list[ParsedCall],
        found: repair.Proposal,
        meta: dict[str, Any],
    ) -> tuple[TurnOutput, list[ParsedCall], list[ParsedCall]]:
        """`output` with its first change made `found`'s edit, its other changes left
        out and the rest of its text (the calls after, a rerun of the test) kept; a
        reply that changes nothing (`held` empty) gets the edit after its calls."""
        text = output.text
        call = specs.render_call(specs.EDIT_FILE, path=found.path, old=found.old, new=found.new)
        if held:
            first = held[0]
            pieces = [text[: first.start], call]
            at = first.end
            for c in held[1:]:
                if alternatives.changes(c):
                    pieces.append(text[at : c.start])
                    at = c.end
            pieces.append(text[at:])
            new_text, start, replaced = "".join(pieces), first.index, text[first.start :]
        else:
            new_text, start, replaced = text.rstrip() + "\n" + call, len(calls), ""
        new_calls = parse_all(new_text, *specs.parser_rules())
        repaired = dataclasses.replace(
            output,
            text=new_text,
            # the text is no longer the model's tokens: not a sample to train on
            completion_token_ids=None,
            completion_logprobs=None,
            meta={
                **output.meta,
                "repair": {
                    **meta,
                    "gain": round(found.gain, 3),
                    "exact": found.exact,
                    "replaced": replaced,
                },
            },
        )
        log.info(
            "session %s: %s passes `%s` with a proposed edit", self.id, found.path, meta["command"]
        )
        return repaired, new_calls, [c for c in new_calls if c.index >= start]

    def _rerun_limit(self, command: str, times: float) -> float | None:
        """Seconds for another run of `command`, the session's failing check: `times`
        what a trial run of it gets; None when it is not that check."""
        found = self._check()
        if found is None or found[0] != command:
            return None
        return min(times * max(TRIAL_MIN_S, TRIAL_FACTOR * found[1]), self.ctx.sandbox.timeout_s)

    def _guarded(
        self, command: str, check: alternatives.Check, why: dict[str, int]
    ) -> alternatives.Check:
        """`check`, and for an edit that passes it, every test of the failing test's
        files passing (`localize.guard_command`): the failing test alone can be made to
        pass by breaking what it shares with the others, or by an edit that fixes it
        and leaves the bug, which the other tests it fails still catch. The files'
        tests run once as they are, when the first edit passes; if that run cannot
        finish in time, the command alone decides. `why` counts the edits turned down
        by the command ("failed"), by the guard for a test that passed before
        ("broke"), and for tests that failed before and still fail ("partial")."""

        async def counted(files: dict[str, str]) -> bool | None:
            passed = await check(files)
            if passed is False:
                why["failed"] = why.get("failed", 0) + 1
            return passed

        # more tests than the failing command's, each run given some time
        limit = self._rerun_limit(command, 4.0)
        guard = localize.guard_command(command, self._output(command))
        if limit is None or guard is None:
            return counted
        root = Path(self.workspace.root)
        before: list[frozenset[str] | None] = []
        lock = asyncio.Lock()

        async def failing(files: dict[str, str]) -> frozenset[str] | None:
            try:
                result = await run_sandboxed(
                    guard, root=root, config=self.ctx.sandbox, timeout_s=limit, files=files
                )
            except (ToolError, OSError):
                return None
            return None if result.killed_reason else localize.failed_tests(result.output)

        async def guarded(files: dict[str, str]) -> bool | None:
            passed = await counted(files)
            if not passed:
                return passed
            async with lock:
                if not before:
                    before.append(await failing({}))
            if before[0] is None:
                return True
            after = await failing(files)
            if after is None or not after <= before[0]:
                why["broke"] = why.get("broke", 0) + 1
                return False
            if after:
                why["partial"] = why.get("partial", 0) + 1
                return False
            return True

        return guarded

    async def _first_passing(
        self,
        command: str,
        proposals: Sequence[repair.Proposal],
        check: alternatives.Check,
        deadline: float,
        turned_down: dict[str, int],
        failed: Callable[[str, str], None],
    ) -> tuple[int | None, int, dict[str, Any]]:
        """(the index of the first of `proposals` that passes `check` and the guard, or
        None; the real trial runs made; what the forked runs found). `turned_down`
        counts the real runs that failed the command, broke other tests or left tests
        the bug fails failing (`_guarded`); `failed` is told (path, text) of each
        candidate a forked or real run failed, the guard's refusals included.

        A plain pytest command first has the candidates tried in a forked run
        (`agent/trials.py`) that stops at the first that passes there. That one, and
        any before it the run could not tell, then get real trial runs; if none passes,
        another forked run takes the candidates after it. A candidate is never taken on
        a forked run's word alone. Without a forked run, each gets a real run in turn."""
        counts: dict[str, Any] = {}
        guarded = self._guarded(command, check, turned_down)

        async def remembered(files: dict[str, str]) -> bool | None:
            passed = await guarded(files)
            if passed is False:
                for path, after in files.items():
                    failed(path, after)
            return passed

        todo = list(range(len(proposals)))
        runs = 0
        while todo:
            verdicts, seconds = await self._forked(command, [proposals[i] for i in todo], deadline)
            if verdicts is None:
                real = todo  # no forked run (any more): real runs for what is left
            else:
                for key, n in (
                    ("passed", sum(v is True for v in verdicts)),
                    ("failed", sum(v is False for v in verdicts)),
                    ("unknown", sum(v is None for v in verdicts)),
                    ("rounds", 1),
                ):
                    counts[key] = counts.get(key, 0) + n
                counts["seconds"] = round(counts.get("seconds", 0.0) + seconds, 2)
                for i, v in zip(todo, verdicts, strict=True):
                    if v is False:
                        failed(proposals[i].path, proposals[i].after)
                cut = next((k for k, v in enumerate(verdicts) if v), len(verdicts) - 1)
                real = [todo[k] for k in range(cut + 1) if verdicts[k] is not False]
            tried = await alternatives.first_that_passes(
                [{proposals[i].path: proposals[i].after} for i in real],
                remembered,
                self.config.trials_at_once,
            )
            runs += tried.runs
            if tried.index is not None:
                return real[tried.index], runs, counts
            if verdicts is None or not any(verdicts):
                break  # every candidate was tried, or the time is spent
            todo = todo[cut + 1 :]
        return None, runs, counts

    async def _forked(
        self, command: str, proposals: Sequence[repair.Proposal], deadline: float
    ) -> tuple[list[trials.Verdict] | None, float]:
        """A forked run of `proposals` against `command`, the session's failing check,
        up to the first that passes, within what is left of the turn's trial time less
        a real run; (None, seconds) when none can be made or it cannot be trusted. The
        run has only the tests the command failed collected and run
        (`localize.narrowed_command`): a `-k` over a whole folder otherwise imports
        every test file again for every candidate."""
        found = self._check()
        if not proposals or found is None or found[0] != command:
            return None, 0.0
        each = max(TRIAL_MIN_S, TRIAL_FACTOR * found[1])
        limit = min(deadline - self.clock.now() - each, self.ctx.sandbox.timeout_s)
        if limit < TRIAL_MIN_S:
            return None, 0.0
        root = Path(self.workspace.root)

        async def run(line: str, folder: Path) -> None:
            await run_sandboxed(
                line, root=root, config=self.ctx.sandbox, timeout_s=limit, files={}, scratch=folder
            )

        narrow = localize.narrowed_command(command, self._output(command))
        t0 = self.clock.now()
        try:
            verdicts = await trials.forked(
                narrow or command,
                str(root),
                [{p.path: p.after} for p in proposals],
                run,
                each_s=each,
                at_once=self.config.trials_at_once,
                stop_after=1,
            )
        except (ToolError, OSError) as e:
            log.info("session %s: no forked run of %r: %s", self.id, command, e)
            verdicts = None
        return verdicts, self.clock.now() - t0

    async def _failing_run(self, command: str, installed: tuple[str, ...] = ()) -> localize.Failing:
        """The workspace's functions the failing test called, the last called first, and
        the lines of its code the run ran, none in `installed` folders: the failing
        command run once more, read-only, with a tracer (`localize.failing_run`);
        nothing found when that cannot be done."""
        nothing = localize.Failing([], None)
        limit = self._rerun_limit(command, 3.0)  # a traced run is slower than a plain one
        if limit is None:
            return nothing
        root = Path(self.workspace.root)

        async def run(traced: str, folder: Path) -> None:
            await run_sandboxed(
                traced,
                root=root,
                config=self.ctx.sandbox,
                timeout_s=limit,
                files={},
                scratch=folder,
            )

        try:
            return await localize.failing_run(
                command, str(root), self._output(command), run, installed
            )
        except (ToolError, OSError) as e:
            log.info("session %s: no traced run of %r: %s", self.id, command, e)
            return nothing

    async def _reproduce(self, query: str) -> None:
        """With repair on, when `query` quotes how the code fails (`reproduce.quoted`):
        run the test suite once, read-only, find the tests that fail that way
        (`reproduce.matching`) and run them alone; when they fail, that command is the
        session's failing check until the model runs a check of its own (`_check`).
        Only commands the policy runs without a question are run, within `reproduce_s`."""
        if not (self._repair_on() and self.config.verify_s > 0 and self.config.reproduce_s > 0):
            return
        quotes = reproduce.quoted(query)
        run_spec = specs.BY_NAME[specs.RUN_TERMINAL]
        if not quotes or not self.runs_unasked(run_spec, {"command": reproduce.SUITE}):
            return
        t0 = self.clock.now()
        root = Path(self.workspace.root)
        # every failure's section is read, not only the head and tail a tool result keeps
        wide = dataclasses.replace(
            self.ctx.sandbox, output_limit=max(self.ctx.sandbox.output_limit, SUITE_OUTPUT)
        )

        async def run(command: str, config: SandboxConfig) -> CommandResult | None:
            left = min(self.config.reproduce_s - (self.clock.now() - t0), config.timeout_s)
            if left < TRIAL_MIN_S:
                return None
            try:
                result = await run_sandboxed(
                    command, root=root, config=config, timeout_s=left, files={}
                )
            except (ToolError, OSError) as e:
                log.info("session %s: no run of %r: %s", self.id, command, e)
                return None
            # pytest's exit code when tests failed (1) or could not be collected (2)
            return result if result.exit_code in (1, 2) and not result.killed_reason else None

        suite = await run(reproduce.SUITE, wide)
        ids = reproduce.matching(suite.output, quotes) if suite else []
        command = reproduce.command(ids) if ids else ""
        found = None
        if command and self.runs_unasked(run_spec, {"command": command}):
            found = await run(command, self.ctx.sandbox)
        if found is None or not localize.failed_tests(found.output):
            log.info("session %s: the quoted failure was not reproduced", self.id)
            return
        self._reproduced = _Reproduced(
            command=command,
            seconds=found.duration_s,
            output=found.output,
            suite_s=round(suite.duration_s if suite else 0.0, 2),
        )
        log.info("session %s: reproduced the quoted failure with `%s`", self.id, command)

    def _check(self) -> tuple[str, float] | None:
        """(command, seconds it ran) of the check a change is tried against: the
        model's last check when it failed (`failing_check`); while the model has run
        none, the tests the session found failing as the request says (`_reproduce`)."""
        found = self._reproducing()
        return (found.command, found.seconds) if found else failing_check(self.turns)

    def _reproducing(self) -> _Reproduced | None:
        """The failure the session reproduced, while the model has run no check."""
        return self._reproduced if _last_check(self.turns) is None else None

    def _reproduced_meta(self, command: str) -> dict[str, Any]:
        """A repair's meta on the check it ran against, when the session found it."""
        found = self._reproducing()
        if found is None or command != found.command:
            return {}
        return {"reproduced": {"suite_s": found.suite_s, "seconds": round(found.seconds, 2)}}

    def _output(self, command: str) -> str:
        """The output of the last run of `command`, the model's or the session's own."""
        output = _failing_output(self.turns, command)
        if not output and self._reproduced is not None and command == self._reproduced.command:
            return self._reproduced.output
        return output

    def _trial(self) -> tuple[str, alternatives.Check, float] | None:
        """(command, check, deadline) that tries a candidate's files against the
        session's failing check (`_check`), by the session's clock's `deadline`
        (`verify_s` seconds for the turn); None when there is no such command or the
        policy would ask before running it."""
        found = self._check() if self.config.verify_s > 0 else None
        if found is None:
            return None
        command, seconds = found
        if not self.runs_unasked(specs.BY_NAME[specs.RUN_TERMINAL], {"command": command}):
            return None
        deadline = self.clock.now() + self.config.verify_s
        # a run may take a few times what the failing one took (a fix can run more of
        # the test), never past the turn's budget
        each = max(TRIAL_MIN_S, TRIAL_FACTOR * seconds)

        async def check(files: dict[str, str]) -> bool | None:
            left = deadline - self.clock.now()
            if left < TRIAL_MIN_S:
                return None
            try:
                result = await run_sandboxed(
                    command,
                    root=Path(self.workspace.root),
                    config=self.ctx.sandbox,
                    timeout_s=min(each, left, self.ctx.sandbox.timeout_s),
                    files=files,
                )
            except (ToolError, OSError) as e:
                log.info("session %s: no trial run of %r: %s", self.id, command, e)
                return None
            return result.ok

        return command, check, deadline

    # -- tools ------------------------------------------------------------------

    def _on_call_start(self, rec: CallRecord) -> None:
        self.tool_calls += 1
        args = _event_args(rec.args)
        self.emit(ev.ToolStart, turn=rec.turn, call_id=rec.call_id, name=rec.name, args=args)

    def _on_call_end(self, rec: CallRecord) -> None:
        result = rec.result
        assert result is not None
        for e in result.edits:
            self.edits.append(e)
            self.edit_count += 1
            self.emit(ev.Edit, path=e.path, diff=e.diff, call_id=rec.call_id, turn=rec.turn, before=e.before, after=e.after)  # fmt: skip
        self.emit(
            ev.ToolEnd,
            turn=rec.turn,
            call_id=rec.call_id,
            name=rec.name,
            status=result.status,
            duration_s=rec.duration_s,
            output=cap(result.output, _EVENT_OUTPUT_LIMIT),
            index=rec.index,
            arguments=rec.args,
            result=result.output,
            t_start=self.clock.since(rec.t_start),
        )

    def needs_approval(self, spec: specs.ToolSpec, args: dict[str, Any]) -> bool:
        """The one approval policy of every front door: `all` runs every call, `none`
        asks about each, `safe` runs read-only tools and the calls their spec's `safe`
        check allows (read-only commands) and asks about the rest: file changes too,
        unless the client applies edits where the user reviews them (`auto_apply_edits`)."""
        policy = self.config.approve
        if policy == "all":
            return False
        if policy == "none":
            return True
        if spec.read_only:
            return False
        if spec.kind == "edit":
            return not self.config.auto_apply_edits
        return spec.safe is None or not spec.safe(args, self.workspace.root)

    @staticmethod
    def _always_key(spec: specs.ToolSpec, args: dict[str, Any]) -> str:
        """What an "always" answer covers: the tool, or for one with a safety check
        these exact arguments."""
        return spec.name + (json.dumps(args, sort_keys=True) if spec.safe else "")

    def runs_unasked(self, spec: specs.ToolSpec, args: dict[str, Any]) -> bool:
        """Whether this call would run now without a question: the policy allows it,
        or the user answered "always" for it earlier in the session."""
        return not self.needs_approval(spec, args) or self._always_key(spec, args) in self._always

    async def _gate(self, spec: specs.ToolSpec, args: dict[str, Any]) -> str | None:
        if not self.needs_approval(spec, args):
            return None
        key = self._always_key(spec, args)
        async with self._approval_lock:
            if key in self._always:
                return None
            if self.approver is None:
                return (
                    f"not run: {spec.name} needs the user's approval under the '{self.config.approve}' "
                    "policy and no one can approve here"
                )
            decision = await self.approver(spec.name, args)
        if decision == "always":
            self._always.add(key)
            return None
        if decision == "run":
            return None
        return f"not run: the user rejected this {spec.name} call"

    # -- context ----------------------------------------------------------------

    def _fit_context(self) -> Sampling:
        """Shrink older tool output (then older replies) until the prompt fits; the
        system prompt and the current request are never touched (earlier requests of
        the session may be shrunk like the replies around them)."""
        sampling = self.config.sampling
        window = self.model.context_window
        reserve = min(sampling.max_tokens, max(256, window // 4))
        budget = window - reserve - 32
        count = self.model.count_tokens
        sizes = [count(m.content) for m in self.messages]
        if sum(sizes) > budget:
            protected = {0, self._request_index}
            last = len(self.messages) - 1
            order = [
                i for i, m in enumerate(self.messages) if m.kind == "tool_results" and i != last
            ]
            order += [
                i for i, m in enumerate(self.messages) if m.role == "assistant" and i < last - 1
            ]
            order += [
                i
                for i, m in enumerate(self.messages)
                if m.role == "user" and m.kind == "text" and 0 < i < self._request_index
            ]
            order += [last] if last not in protected else []
            for limit in (2_000, 300):
                for i in order:
                    if sum(sizes) <= budget:
                        break
                    m = self.messages[i]
                    if len(m.content) > limit:
                        self.messages[i] = Message(
                            role=m.role, content=_shrink(m.content, limit), kind=m.kind
                        )
                        sizes[i] = count(self.messages[i].content)
            if sum(sizes) > budget and self._request_index > 1:
                sizes = self._drop_oldest(sizes, budget)
            if sum(sizes) > budget:
                raise _End(
                    "context_full", f"the request does not fit the {window}-token context window"
                )
        room = window - sum(sizes) - 16
        if room < sampling.max_tokens:
            sampling = Sampling(**(vars(sampling) | {"max_tokens": max(16, room)}))
        return sampling

    def _drop_oldest(self, sizes: list[int], budget: int) -> list[int]:
        """Still too long after shrinking: earlier requests' messages go, oldest first,
        replaced by one note, until the rest fits (the current request stays whole)."""
        count, start = self.model.count_tokens, self._request_index
        drop = 1
        while drop < start:
            dropped = self.messages[1:drop]
            note = f"[{len(dropped)} earlier messages of this session elided to fit the context window]"
            if sizes[0] + count(note) + sum(sizes[drop:]) <= budget:
                break
            drop += 1
        note = f"[{drop - 1} earlier messages of this session elided to fit the context window]"
        self.messages[1:drop] = [Message(role="user", content=note)]
        self._request_index = start - drop + 2
        return [count(m.content) for m in self.messages]

    # -- events and the end -------------------------------------------------------

    def emit(self, kind: type[ev.Event], **fields: Any) -> None:
        """The session's one output: an event stamped on its clock, to every subscriber
        (a failing subscriber is logged; it never stops the session or the others)."""
        event = kind(t=self.clock.now(), **fields)
        for subscriber in self.subscribers:
            try:
                subscriber(event)
            except Exception:
                log.exception("a subscriber of session %s failed on %s", self.id, kind.type)

    def _finish(self, status: str, answer: str, error: str | None) -> SessionResult:
        self._running = False
        trace = self.traces.ref(self.id) if self.traces else ""
        duration = round(self.clock.now() - self._request_t, 4)
        if error:
            note = f"[{status}] {error}"
            self.emit(ev.Message, turn=self.turn_count, text=note, prose=note)
        self.emit(
            ev.SessionEnd,
            request=self.requests,
            status=status,
            turns=self.turn_count,
            tool_calls=self.tool_calls,
            duration_s=duration,
            trace=trace,
            answer=answer,
            error=error,
        )
        return SessionResult(
            session_id=self.id,
            status=status,
            answer=answer,
            edits=list(self.edits),
            trace=trace,
            turns=list(self.turns),
            tool_calls=self.tool_calls,
            duration_s=duration,
            error=error,
        )


def _shrink(text: str, limit: int) -> str:
    head = limit * 2 // 3
    tail = limit - head
    cut = len(text) - head - tail
    return f"{text[:head]}\n[… {cut} characters elided to fit the context window …]\n{text[-tail:]}"


def _event_args(args: dict[str, Any], limit: int = 4_000) -> dict[str, Any]:
    return {
        k: (v[:limit] + "…" if isinstance(v, str) and len(v) > limit else v)
        for k, v in args.items()
    }
