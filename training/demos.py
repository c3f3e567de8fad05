"""Demonstrations: accepted traces of the *training* tasks, played through the real agent.

The supervised warm start (``opencomposer train --sft`` and the warm-start phase
of RL, ``[sft] source = "demos"``) learns from accepted traces. On a fresh machine
there are none yet, so this module makes them the way a user's session would
produce them: for every training task that ships a ``solution.json`` (the starter
suite does), a ``scripted:`` model plays a short, plausible solution — look
first (``grep`` for the identifier the query names, or ``read_file`` of the files
the query names), then edit (``edit_file`` with the changed lines of each
solution edit, or one ``replace_all`` a file where the edits rename one
identifier across files) or answer — through the production ``Session``, the real tools in
the task's sandboxed workspace (``EnvironmentServer.run_episode``) and a real
``TraceStore``. The stored trace is therefore byte-for-byte what a live session
stores: the system prompt (in the style the sampler will be prompted with), the
tool results as the tools rendered them, the edits. A demonstration whose
episode is graded ``resolved`` is marked accepted (its edits ``accept``-ed, and
``meta.accepted``); the rest are kept but not accepted, and counted.

Held-out tasks are refused (``DemoError``): their solutions are never read.

    python -m opencomposer.training.demos --suite starter:train --db demos.db \\
        [--prompt-style compact]
"""

from __future__ import annotations

import asyncio
import difflib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opencomposer.tools.specs import EDIT_FILE, GREP, READ_FILE, render_call
from opencomposer.training.sessions import demo_session_config

SOLUTION = "solution.json"


class DemoError(ValueError):
    """A task that cannot be demonstrated (held-out, or no usable solution); one line."""


@dataclass(kw_only=True)
class DemoStats:
    recorded: int = 0
    accepted: int = 0
    skipped: int = 0  # training tasks without a solution.json
    failed: list[str] = field(default_factory=list)  # task ids whose demo did not resolve
    session_ids: list[str] = field(default_factory=list)  # the accepted ones


def load_solution(task: Any) -> dict[str, Any] | None:
    """The task's ``solution.json``; None if it has none. Refuses held-out tasks."""
    if getattr(task, "split", "") == "heldout":
        raise DemoError(f"task {task.id} is held out: its solution is never used")
    path = Path(task.dir) / SOLUTION
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise DemoError(f"{path}: not JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("edits", []), list):
        raise DemoError(f"{path}: expected {{answer, edits: [{{path, old, new}}]}}")
    return data


# ---------------------------------------------------------------- the scripted turns


def _edit_call(path: str, old: str, new: str, *, replace_all: bool = False) -> str:
    flag = {"replace_all": True} if replace_all else {}
    return render_call(EDIT_FILE, path=path, **flag, old=old, new=new)


def renamed_word(old: str, new: str) -> tuple[str, str] | None:
    """``(a, b)`` when ``new`` is ``old`` with every ``a`` replaced by ``b`` (one
    identifier renamed, several times); None otherwise."""
    words = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
    a, b = words.findall(old), words.findall(new)
    pairs = {(x, y) for x, y in zip(a, b, strict=False) if x != y}
    if len(a) != len(b) or len(pairs) != 1:
        return None
    ((x, y),) = pairs
    if old.replace(x, y) != new:
        return None
    return x, y


def line_edits(path: str, old: str, new: str) -> list[tuple[str, str]]:
    """The solution edit ``old -> new`` (often a whole file) as small search/replace
    pairs: each block of changed lines, widened with neighbours until it is unique
    in the file, so that ``edit_file`` accepts it and the model sees local edits."""
    if old not in new and "\n" not in old.strip("\n"):
        return [(old, new)]  # already a one-line edit
    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    pairs = []
    sm = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            continue
        lo, hi, blo, bhi = i1, i2, j1, j2
        while True:
            o = "".join(a[lo:hi]).rstrip("\n")
            if o and old.count(o) == 1:
                break
            if lo == 0 and hi == len(a):
                break
            if lo > 0:
                lo, blo = lo - 1, blo - 1
            if hi < len(a):
                hi, bhi = hi + 1, bhi + 1
        pairs.append(("".join(a[lo:hi]).rstrip("\n"), "".join(b[blo:bhi]).rstrip("\n")))
    return pairs


def demo_turns(task: Any, solution: dict[str, Any]) -> list[str]:
    """The assistant turns of a short demonstration: look, then edit, then answer."""
    query: str = task.query
    edits = [e for e in solution.get("edits", []) if isinstance(e, dict)]
    answer = str(solution.get("answer", "")).strip() or "Done."
    named = re.findall(r"`([A-Za-z_][A-Za-z0-9_.]*)`", query)
    turns: list[str] = []
    paths = list(dict.fromkeys(str(e["path"]) for e in edits))
    if edits and all(p in query for p in paths):
        calls = "\n".join(render_call(READ_FILE, path=p) for p in paths)
        turns.append(f"Let me read {', '.join(paths)}.\n{calls}")
    elif edits and named:
        turns.append(f"Let me find every use of {named[0]}.\n{render_call(GREP, pattern=named[0])}")
    elif edits:
        calls = "\n".join(render_call(READ_FILE, path=p) for p in paths)
        turns.append(f"Let me read the files.\n{calls}")
    else:  # an answer-only task: search for the word of the answer the query names
        words = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", answer)
        key = next((w for w in words if w in query and len(w) > 2), None)
        if key:
            turns.append(f"Let me search for {key}.\n{render_call(GREP, pattern=key)}")
    if edits:
        renames = {renamed_word(str(e["old"]), str(e["new"])) for e in edits}
        rename = renames.pop() if len(edits) > 1 and len(renames) == 1 else None
        calls = []
        for e in edits:
            path, old, new = str(e["path"]), str(e["old"]), str(e["new"])
            if rename:  # one identifier renamed across files: one replace_all a file
                calls.append(_edit_call(path, *rename, replace_all=True))
            else:
                calls += [_edit_call(path, o, n) for o, n in line_edits(path, old, new)]
        turns.append("\n".join(calls))
    turns.append(answer)
    return turns


# ---------------------------------------------------------------- recording


async def record_demos(
    tasks: Sequence[Any],
    *,
    env: Any,
    store: Any,
    session_config: Any,
    concurrency: int = 4,
    meta: dict[str, Any] | None = None,
) -> DemoStats:
    """Play a demonstration of every task with a solution through ``env.run_episode``
    (the production Session) into ``store`` (a ``TraceStore``); mark resolved ones
    accepted. ``meta`` is added to every demonstration's ``meta``. Refuses held-out
    tasks before running anything."""
    from opencomposer.agent.backends.scripted import ScriptedModel

    plans = []
    stats = DemoStats()
    for t in tasks:
        solution = load_solution(t)  # raises for held-out tasks, before anything runs
        if solution is None:
            stats.skipped += 1
            continue
        plans.append((t, demo_turns(t, solution)))
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(task: Any, turns: list[str]) -> None:
        model = ScriptedModel(turns, name=f"scripted:demo/{task.id}")
        async with gate:
            res = await env.run_episode(
                task, model_spec_or_factory=model, session_config=session_config, traces=store
            )
        stats.recorded += 1
        sid = res.session_id
        ok = res.resolved and res.status == "completed" and bool(sid)
        if sid:
            store.set_meta(
                sid, source="demo", task_id=task.id, accepted=ok, reward=res.reward, **(meta or {})
            )
        if ok:
            store.record_decision(sid, "*", "accept")
            stats.accepted += 1
            stats.session_ids.append(sid)
        else:
            stats.failed.append(task.id)

    await asyncio.gather(*(one(t, turns) for t, turns in plans))
    return stats


async def _main(suite: str, db: Path, prompt_style: str) -> DemoStats:
    from opencomposer.agent.traces import TraceStore
    from opencomposer.training.catalog import load_suite
    from opencomposer.training.env import EnvConfig, EnvironmentServer

    tasks = load_suite(suite)
    store = TraceStore(db)
    env = EnvironmentServer(EnvConfig(num_actors=2))
    try:
        await env.start()
        return await record_demos(
            tasks,
            env=env,
            store=store,
            session_config=demo_session_config(prompt_style=prompt_style),
        )
    finally:
        await env.close()
        store.close()


if __name__ == "__main__":
    import argparse
    import sys

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suite", default="starter:train")
    ap.add_argument("--db", type=Path, required=True, help="trace store to write (SQLite)")
    ap.add_argument("--prompt-style", default="compact", choices=["full", "compact"])
    ns = ap.parse_args()
    try:
        s = asyncio.run(_main(ns.suite, ns.db, ns.prompt_style))
    except (DemoError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"{s.accepted}/{s.recorded} demonstrations accepted ({s.skipped} without solution)")
    if s.failed:
        print("not resolved: " + ", ".join(sorted(s.failed)))
