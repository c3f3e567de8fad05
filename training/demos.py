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
        [--prompt-style compact] [--max N]   # tops up to N, round-robin over projects

A training run (``[sft] source = "demos"``) records into ``<run>/demos.db`` the same
way, so demonstrations recorded ahead of it with the run's prompt style count there.
"""

from __future__ import annotations

import ast
import asyncio
import difflib
import hashlib
import json
import random
import re
import shlex
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opencomposer.tools.specs import (
    CODEBASE_SEARCH,
    EDIT_FILE,
    GREP,
    READ_FILE,
    RUN_TERMINAL,
    render_call,
)
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
    """The assistant turns of a short demonstration: look, then edit, then answer.
    A corpus task (its solution names the buggy ``functions``) gets an engineer's
    session instead: `expert_turns`."""
    if solution.get("functions"):
        return expert_turns(task, solution)
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


# ---------------------------------------------------------------- an engineer's session

# The pytest options the verify command adds for the harness; a person leaves them out.
_HARNESS_OPTS = ("-q", "-p", "no:cacheprovider", "no:xdist", "no:randomly")


def reproduce_command(task: Any, solution: dict[str, Any], *, whole_files: bool) -> str:
    """The command an engineer types to see the failure: plain ``python -m pytest``
    (the workspace's conftest puts its paths on sys.path) with the project's own
    options, short tracebacks and ``-x``, on the first failing test, or on the test
    files the task protects when ``whole_files`` (or when the failing ids are unknown)."""
    words = shlex.split(task.verify)
    try:
        at = words.index("pytest")
    except ValueError:
        return task.verify
    protect = set(getattr(task, "protect", ()) or ())
    own = [w for w in words[at + 1 :] if w not in protect]
    keep, skip = [], False
    for w in own:
        if skip:
            skip = False
            continue
        if w == "-p":
            skip = True  # with its plugin name
            continue
        if w not in _HARNESS_OPTS:
            keep.append(w)
    failing = [str(f) for f in solution.get("failing", []) if isinstance(f, str)]
    targets = sorted(protect) if whole_files or not failing else failing[:1]
    return " ".join(
        shlex.quote(w)
        for w in ["python", "-m", "pytest", "-x", "-q", "--tb=short", *keep, *targets]
    )


def function_lines(task: Any, path: str, line: int, *, most: int = 60) -> tuple[int, int]:
    """The lines of the innermost function around ``line`` in the task's (broken)
    workspace file, at most ``most`` of them centred on ``line``; a window of
    ``most`` lines when the file does not parse."""
    start, end = max(1, line - most // 2), line + most // 2
    try:
        with tarfile.open(task.repo_tar) as tar:
            member = tar.extractfile(path)
            text = member.read().decode("utf-8") if member else ""
        tree = ast.parse(text)
    except (OSError, KeyError, tarfile.TarError, SyntaxError, UnicodeDecodeError, ValueError):
        return start, end
    best: tuple[int, int] | None = None
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lo = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            hi = node.end_lineno or node.lineno
            if lo <= line <= hi and (best is None or hi - lo < best[1] - best[0]):
                best = (lo, hi)
    if best is None:
        return start, end
    lo, hi = best
    if hi - lo + 1 > most:
        lo, hi = max(lo, line - most // 2), min(hi, line + most // 2)
    return lo, hi


# The bug kinds of `training/mining.py`, as a reviewer would name them.
_KIND_PHRASES = {
    "flipped comparison": "a flipped comparison",
    "off-by-one bound": "an off-by-one bound",
    "off-by-one index": "an off-by-one index",
    "wrong operator": "a wrong operator",
    "dropped factor": "a dropped factor",
    "changed constant": "a changed constant",
    "dropped call": "a dropped call",
    "dropped branch": "a dropped branch",
    "dropped return": "a dropped return",
    "wrong return value": "a wrong return value",
    "and/or swapped": "an `and`/`or` mix-up",
    "dropped negation": "a dropped `not`",
    "negated condition": "a negated condition",
    "swapped arguments": "swapped arguments",
    "wrong variable": "a wrong variable",
}


def _kind_words(kind: str) -> str:
    parts = kind.removeprefix("two-site: ").split(" + ")
    return " and ".join(_KIND_PHRASES.get(p, f"a bug ({p})") for p in parts)


def _locate_pattern(function: str) -> str:
    """A grep pattern for a function's definition; a dunder method is found by its class."""
    parts = function.split(".")
    name = parts[-1]
    if name.startswith("__") and name.endswith("__") and len(parts) > 1:
        return rf"class {parts[-2]}\b"
    return rf"def {name}\b"


def expert_turns(task: Any, solution: dict[str, Any]) -> list[str]:
    """What a good engineer does with a failing test, as assistant turns: reproduce
    it with ``run_terminal``, locate the function (``grep`` for its definition,
    ``codebase_search``, or a direct read when the request names the file), read it,
    fix it with ``edit_file``, run the test again, and answer in a sentence or two.
    Independent calls share a message, so the policy learns to batch them; the
    order, the tools and the wording vary with the task's id (seeded), so it does
    not learn one fixed script."""
    rng = random.Random(hashlib.sha1(str(task.id).encode()).hexdigest())
    edits = [e for e in solution.get("edits", []) if isinstance(e, dict)]
    functions = [str(f) for f in solution.get("functions", [])]
    kind = str(solution.get("kind", "bug"))
    query: str = task.query
    repro = reproduce_command(task, solution, whole_files=rng.random() < 0.3)
    run = render_call(RUN_TERMINAL, command=repro)
    # The functions are in (path, offset) order, the edits in the order they apply.
    ordered = sorted(edits, key=lambda e: (str(e["path"]), int(e.get("line", 1))))
    names = functions if len(functions) == len(ordered) else functions[:1] * len(ordered)
    sites = [
        (str(e["path"]), f, int(e.get("line", 1))) for e, f in zip(ordered, names, strict=True)
    ]
    defs = list(dict.fromkeys(f.rsplit(".", 1)[-1] for _, f, _ in sites))
    patterns = list(dict.fromkeys(_locate_pattern(f) for _, f, _ in sites))
    reads = []
    for path, _, line in dict.fromkeys(sites):
        lo, hi = function_lines(task, path, line)
        reads.append(render_call(READ_FILE, path=path, start_line=lo, end_line=hi))
    reads = list(dict.fromkeys(reads))
    greps = [render_call(GREP, pattern=p, glob="*.py") for p in patterns]
    named = all(path in query for path, _, _ in sites)
    turns: list[str] = []
    style = rng.random()
    if named and style < 0.5:
        # The request names the file: reproduce and read it at once.
        turns.append(
            rng.choice(
                [
                    "Let me run the failing test and read the code.",
                    "Reproducing first, and reading the function meanwhile.",
                ]
            )
            + "\n"
            + "\n".join([run, *reads])
        )
    elif style < 0.75:
        turns.append(
            rng.choice(
                [
                    "First, reproduce the failure and find the function.",
                    "Let me run the test and locate the code.",
                ]
            )
            + "\n"
            + "\n".join([run, *greps])
        )
        turns.append(
            rng.choice(["Reading the function.", "Let me read it."]) + "\n" + "\n".join(reads)
        )
    elif style < 0.9:
        search = render_call(CODEBASE_SEARCH, query=" ".join(defs))
        turns.append(
            "Let me reproduce the failure and search for the code.\n" + "\n".join([run, search])
        )
        turns.append("Reading the function.\n" + "\n".join(reads))
    else:
        turns.append("Let me reproduce the failure first.\n" + run)
        turns.append("Now find where it is defined.\n" + "\n".join(greps))
        turns.append("\n".join(reads))
    calls = [_edit_call(str(e["path"]), str(e["old"]), str(e["new"])) for e in edits]
    lines = ", ".join(f"line {line}" for _, _, line in sites)
    turns.append(
        rng.choice(
            [
                f"{_kind_words(kind).capitalize()} at {lines}. Fixing it.",
                f"Found it: {_kind_words(kind)}. Fixing {lines}.",
            ]
        )
        + "\n"
        + "\n".join(calls)
    )
    turns.append(rng.choice(["Running the test again.", "Checking the fix."]) + "\n" + run)
    where = " and ".join(f"`{f}` ({p})" for p, f, _ in sites)
    turns.append(
        rng.choice(
            [
                f"Fixed {_kind_words(kind)} in {where}; the failing test passes now.",
                f"The bug was {_kind_words(kind)} in {where}. I fixed it and the test passes.",
                f"{where}: fixed {_kind_words(kind)}. The tests that failed pass again.",
            ]
        )
    )
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


def spread(tasks: Sequence[Any], n: int, seed: int) -> list[Any]:
    """Up to ``n`` of ``tasks``, taken round-robin over their projects (``source``) in
    a seeded order, so a capped warm start sees every project, not the first few."""
    import random

    rng = random.Random(seed)
    by_source: dict[str, list[Any]] = {}
    for t in sorted(tasks, key=lambda t: t.id):
        by_source.setdefault(str(getattr(t, "source", "")), []).append(t)
    queues = [by_source[k] for k in sorted(by_source)]
    for q in queues:
        rng.shuffle(q)
    out: list[Any] = []
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop())
    return out


def demo_metas(store: Any) -> list[dict[str, Any]]:
    """The ``meta`` of every demonstration recorded in ``store`` (a ``TraceStore``)."""
    metas = [
        (store.get(s["session_id"]) or {}).get("meta") or {} for s in store.list_sessions(100_000)
    ]
    return [m for m in metas if m.get("source") == "demo"]


def pending(store: Any, tasks: Sequence[Any], *, style: str, limit: int, seed: int) -> list[Any]:
    """The tasks to demonstrate next so that ``store`` holds up to ``limit``
    demonstrations in prompt ``style``: those not recorded there yet, taken round-robin
    over their projects (a store filled in several sittings tops up, never repeats)."""
    done = {m.get("task_id") for m in demo_metas(store) if m.get("prompt_style") == style}
    want = max(0, limit - len(done))
    return spread([t for t in tasks if t.id not in done], want, seed)


async def _main(suite: str, db: Path, prompt_style: str, limit: int, seed: int) -> DemoStats:
    from opencomposer.agent.traces import TraceStore
    from opencomposer.training.catalog import load_suite
    from opencomposer.training.env import EnvConfig, EnvironmentServer

    store = TraceStore(db)
    try:
        todo = pending(store, load_suite(suite), style=prompt_style, limit=limit, seed=seed)
        if not todo:
            return DemoStats()
        env = EnvironmentServer(EnvConfig(num_actors=2))
        try:
            await env.start()
            return await record_demos(
                todo,
                env=env,
                store=store,
                session_config=demo_session_config(prompt_style=prompt_style),
                meta={"prompt_style": prompt_style},
            )
        finally:
            await env.close()
    finally:
        store.close()


if __name__ == "__main__":
    import argparse
    import sys

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suite", default="starter:train")
    ap.add_argument("--db", type=Path, required=True, help="trace store to write (SQLite)")
    ap.add_argument("--prompt-style", default="compact", choices=["full", "compact"])
    ap.add_argument(
        "--max", type=int, default=100_000, help="demonstrations the store should hold in all"
    )
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args()
    try:
        s = asyncio.run(_main(ns.suite, ns.db, ns.prompt_style, ns.max, ns.seed))
    except (DemoError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"{s.accepted}/{s.recorded} demonstrations accepted ({s.skipped} without solution)")
    if s.failed:
        print("not resolved: " + ", ".join(sorted(s.failed)))
