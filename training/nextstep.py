"""Next-step accuracy: what a policy does at each step of an engineer's session.

A held-out resolve rate moves in steps of 1/N, costs tens of seconds an episode here,
and does not say *where* a policy goes wrong: one wrong grep in the first turn and
every later step happens in a state no demonstration showed. This measures each step
alone, on held-out projects:

1. an engineer's session (`demos.expert_plan`, without a wrong first edit) is played
   on each held-out task through the production Session, tools and a `TraceStore`:
   a *reference* session (`demos.record_demos(reference=True)`). It is never
   accepted, so no training reads it; only sessions that resolved their task are used;
2. at every assistant turn of it, the policy gets that turn's exact prompt (the
   request and the real tool results so far) and answers greedily;
3. its calls are compared with the engineer's: ``tool`` (a call of the same tool, or
   no call where the engineer answers), ``exact`` (the same call, attribute for
   attribute) and ``part`` (the step's point, by tool: `edit_file` the same ``<old>``
   in the same file, the right line whatever the change; `read_file` a range of the
   same file that holds the engineer's first line; `grep` the same pattern;
   `run_terminal` a pytest command; `codebase_search` any search); a turn without
   calls, the answer, matches a reply without calls.

    python benchmarks/next_step.py --model sft=vllm:runs/embedded/checkpoints/step_0
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opencomposer.agent.protocols import ModelError, TurnOutput
from opencomposer.tools.specs import EDIT_FILE, GREP, READ_FILE, RUN_TERMINAL

ANSWER = "answer"  # the step kind of a turn without calls


@dataclass(frozen=True)
class Step:
    """One assistant turn of a reference session: its prompt and the engineer's reply."""

    session_id: str
    task_id: str
    turn: int
    messages: list[dict[str, str]] = field(hash=False)
    text: str = field(hash=False)


@dataclass
class Tally:
    n: int = 0
    exact: int = 0
    part: int = 0
    tool: int = 0

    def add(self, exact: bool, part: bool, tool: bool) -> None:
        self.n += 1
        self.exact += int(exact)
        self.part += int(part)
        self.tool += int(tool)


def calls_of(text: str) -> list[tuple[str, dict[str, str]]]:
    """The well-formed tool calls of a reply, as the production parser reads them."""
    from opencomposer.agent.xmlcalls import parse_all
    from opencomposer.tools.specs import parser_rules

    return [(c.name, dict(c.raw)) for c in parse_all(text, *parser_rules()) if not c.error]


def _int(value: str | None, default: int) -> int:
    try:
        return int(str(value).strip())
    except (TypeError, ValueError):
        return default


def same_point(name: str, want: dict[str, str], got: dict[str, str]) -> bool:
    """Whether ``got``, a call of the same tool as ``want``, does what the step is for
    (see the module doc)."""
    if name == EDIT_FILE:
        return got.get("path") == want.get("path") and got.get("old") == want.get("old")
    if name == READ_FILE:
        if got.get("path") != want.get("path"):
            return False
        first = _int(want.get("start_line"), 1)
        lo, hi = _int(got.get("start_line"), 1), _int(got.get("end_line"), 1 << 30)
        return lo <= first <= hi
    if name == GREP:
        return got.get("pattern") == want.get("pattern")
    if name == RUN_TERMINAL:
        return "pytest" in got.get("command", "")
    return True


def score(want_text: str, got_text: str) -> list[tuple[str, bool, bool]]:
    """(step kind, exact, part) for each call of the engineer's reply ``want_text``
    (one ``answer`` step when it has none), judged against the policy's ``got_text``."""
    want, got = calls_of(want_text), calls_of(got_text)
    if not want:
        return [(ANSWER, not got, not got)]
    out = []
    for name, args in want:
        exact = (name, args) in got
        part = exact or any(g == name and same_point(name, args, a) for g, a in got)
        out.append((name, exact, part))
    return out


def reference_steps(traces: Sequence[dict[str, Any]], task_ids: Sequence[str] = ()) -> list[Step]:
    """The steps of the reference sessions (`TraceStore.export` dicts) that resolved
    their task, of ``task_ids`` only when given."""
    wanted = set(task_ids)
    steps = []
    for tr in traces:
        meta = tr.get("meta") or {}
        if meta.get("source") != "reference" or not meta.get("resolved"):
            continue
        if wanted and meta.get("task_id") not in wanted:
            continue
        for t in tr.get("turns", []):
            if t.get("messages"):
                steps.append(
                    Step(
                        session_id=str(tr.get("session_id", "")),
                        task_id=str(meta.get("task_id", "")),
                        turn=int(t.get("turn", 0)),
                        messages=list(t["messages"]),
                        text=str(t.get("text") or ""),
                    )
                )
    return steps


async def replies(
    model: Any, steps: Sequence[Step], *, concurrency: int = 6, max_tokens: int = 300
) -> list[str | ModelError]:
    """The model's greedy reply at each step (the backend batches concurrent ones), or
    the `ModelError` of a step it could not answer (a prompt over its context window)."""
    from opencomposer.agent.protocols import Sampling

    gate = asyncio.Semaphore(max(1, concurrency))
    sampling = Sampling(temperature=0.0, top_p=1.0, max_tokens=max_tokens)

    async def one(step: Step) -> str | ModelError:
        async with gate:
            out = await answer(model, step, sampling)
        return out if isinstance(out, ModelError) else out.text

    return list(await asyncio.gather(*(one(s) for s in steps)))


async def answer(model: Any, step: Step, sampling: Any) -> TurnOutput | ModelError:
    """``model``'s whole reply to ``step``'s prompt (an empty one when the backend gave
    no output), or the `ModelError` it raised."""
    from opencomposer.agent.protocols import Message

    msgs = [Message(role=m["role"], content=m["content"]) for m in step.messages]  # type: ignore[arg-type]
    stream = model.stream(msgs, sampling)
    try:
        async for _ in stream:
            pass
    except ModelError as e:
        return e
    return stream.output or TurnOutput(text="")


def kinds_of(text: str) -> set[str]:
    """The kinds of call a reply makes (``answer`` for none)."""
    return {name for name, _ in calls_of(text)} or {ANSWER}


def step_kinds(step: Step) -> set[str]:
    """The kinds of call the engineer makes at ``step``."""
    return kinds_of(step.text)


def tally(steps: Sequence[Step], got: Sequence[str | ModelError]) -> dict[str, Tally]:
    """Per step kind, how many of the engineer's calls the replies matched; a step the
    model could not answer is left out."""
    out: dict[str, Tally] = {}
    for step, text in zip(steps, got, strict=True):
        if isinstance(text, ModelError):
            continue
        made = kinds_of(text)
        for kind, exact, part in score(step.text, text):
            out.setdefault(kind, Tally()).add(exact, part, kind in made)
    return out


# The fix step, split by what the prompt shows: whether the failing run's traceback
# stops at a line the engineer's edit changes (read it there), or not (reason it out).
EDIT_IN_TRACEBACK = f"{EDIT_FILE}, its line in the traceback"
EDIT_NOT_IN_TRACEBACK = f"{EDIT_FILE}, not in the traceback"


def traceback_shows(step: Step, path: str, old: str) -> bool:
    """Whether the latest test run in ``step``'s prompt stops, in ``path``, at one of
    the lines of ``old`` (an edit's text)."""
    from opencomposer.training.demos import last_run_output, traceback_frame

    said = [m["content"] for m in step.messages if m.get("role") == "user"]
    frame = traceback_frame(last_run_output(said), {path})
    lines = {line.strip() for line in old.splitlines() if line.strip()}
    return frame is not None and frame[2] in lines


def edit_split(steps: Sequence[Step], got: Sequence[str | ModelError]) -> dict[str, Tally]:
    """The engineer's `edit_file` calls scored as `tally` does, split into those whose
    line the prompt's traceback shows (`EDIT_IN_TRACEBACK`) and the rest."""
    out: dict[str, Tally] = {}
    for step, text in zip(steps, got, strict=True):
        if isinstance(text, ModelError):
            continue
        want = [args for name, args in calls_of(step.text) if name == EDIT_FILE]
        for args, (_, exact, part) in zip(
            want, [s for s in score(step.text, text) if s[0] == EDIT_FILE], strict=True
        ):
            shown = traceback_shows(step, args.get("path", ""), args.get("old", ""))
            key = EDIT_IN_TRACEBACK if shown else EDIT_NOT_IN_TRACEBACK
            out.setdefault(key, Tally()).add(exact, part, EDIT_FILE in kinds_of(text))
    return out


def load_references(db: Path) -> list[dict[str, Any]]:
    """Every reference session of the trace store at ``db``."""
    from opencomposer.agent.traces import TraceStore

    store = TraceStore(db)
    try:
        traces = [store.export(s["session_id"]) for s in store.list_sessions(100_000)]
    finally:
        store.close()
    return [t for t in traces if t and (t.get("meta") or {}).get("source") == "reference"]


async def record_references(
    tasks: Sequence[Any], db: Path, *, prompt_style: str, env_config: Any = None
) -> Any:
    """Play the reference sessions of ``tasks`` not yet in the store at ``db``
    (``env_config``: the environment server's, default two sandboxed workers)."""
    from opencomposer.agent.traces import TraceStore
    from opencomposer.training.demos import play, playable, request_key

    done = {
        (m.get("task_id"), m.get("request"))
        for m in ((t.get("meta") or {}) for t in load_references(db))
        if m.get("prompt_style") == prompt_style
    }
    # A task whose request leads no session to the code has no reference to play: left
    # out here, so that a store holding every other one starts no environment server.
    todo = [t for t in tasks if (t.id, request_key(t)) not in done and playable(t)]
    store = TraceStore(db)
    try:
        return await play(
            todo, store, prompt_style=prompt_style, env_config=env_config, reference=True
        )
    finally:
        store.close()
