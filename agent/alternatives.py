"""Sample-and-rank for the turns that change files (`SessionConfig.fix_samples`).

A small model often knows which of two versions of a line is right long before it
can write the right one: scored as plain code, the original line of a bug is likelier
than the bug in most cases, while a sampled fix is right in a few percent of replies.
So when a reply changes files, the session asks the model for more replies that keep
its text up to the end of the calls that already ran and continue from there, each
saying the change anew (`Model.alternatives`),
applies each candidate's changes to the files in memory (`preview`), and keeps the
candidate whose changed code the model itself finds likeliest against the code as it
stands (`code_gain`: log P(after) - log P(before) over the changed lines and the
lines around them, with the code above as context). Only that candidate's calls run.

The ranking reads no test and runs nothing: it is the model's own judgment of code,
the same model that wrote the candidates. A candidate whose change cannot apply (an
`<old>` the file does not hold) or changes nothing ranks last, so the first reply is
kept when no other does better.

When the model's last command failed (it reproduced the bug, or ran the tests after a
change that did not fix it), the session can also try the candidates against that
command (`first_passing`), best-ranked first, each in a trial run that sees the
candidate's files and changes nothing (`tools.sandbox.run_sandboxed(files=…)`); the
first that makes it pass is kept, else the ranking's choice. The command is the
model's own: it chose what shows the change works.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from opencomposer.agent.text import common_ends
from opencomposer.agent.xmlcalls import ParsedCall
from opencomposer.tools import specs
from opencomposer.tools.files import apply_edit
from opencomposer.tools.protocols import ToolError, Workspace

# Characters of unchanged code kept on each side of a change in the scored window.
AROUND_CHARS = 400
# The tokens of code above the window that condition its score.
CONTEXT_TOKENS = 512

Score = Callable[[str, str], Awaitable[float]]  # (context, text) -> log P(text | context)
# {path: text after the change} -> whether the check passes with those files; None: it
# could not be tried (the trial run was refused, or the time left was too short)
Check = Callable[[dict[str, str]], Awaitable[bool | None]]


def changes(call: ParsedCall) -> bool:
    """Whether `call` is a well-formed call that changes files."""
    spec = specs.BY_NAME.get(call.name)
    return call.error is None and spec is not None and spec.kind == "edit"


def preview(
    ws: Workspace, calls: Sequence[ParsedCall], *, skipping: bool = False
) -> dict[str, tuple[str, str]] | None:
    """{path: (text now, text after)} for the files `calls` change, applied in order in
    memory; None when one of them cannot apply (a missing file or `<old>`, a path
    outside the workspace) or the calls change nothing. With `skipping`, a call that
    cannot apply is passed over, as the executor fails it and runs the others: the
    files as the calls would leave them. A deletion gives None either way (it leaves
    no text to score or to try)."""
    before: dict[str, str] = {}
    after: dict[str, str] = {}
    for call in calls:
        if not changes(call):
            continue
        if call.name not in (specs.EDIT_FILE, specs.WRITE_FILE):
            return None  # a deletion: no code to score
        try:
            path = ws.relative(ws.resolve(call.raw.get("path", "")))
            now = after[path] if path in after else ws.read_text(path) if ws.exists(path) else ""
            if call.name == specs.EDIT_FILE:
                old, new = call.raw.get("old", ""), call.raw.get("new", "")
                if not old or old == new or (path not in after and not ws.exists(path)):
                    raise ValueError("an edit that cannot apply")
                replace_all = call.raw.get("replace_all", "").strip().lower() == "true"
                text = apply_edit(now, old, new, replace_all)[0]
            else:
                text = call.raw.get("content", "")
        except (ToolError, OSError, ValueError, UnicodeDecodeError):
            if skipping:
                continue
            return None
        before.setdefault(path, now)  # the first call on a path sees the file as it is
        after[path] = text
    changed = {p: (before[p], after[p]) for p in after if after[p] != before[p]}
    return changed or None


def window(before: str, after: str) -> tuple[int, int]:
    """(start, tail): the scored window of both texts is `text[start:len(text) - tail]`:
    the changed span with `AROUND_CHARS` on either side, starting at a line."""
    lo, tail = common_ends(before, after)
    start = before.rfind("\n", 0, max(0, lo - AROUND_CHARS)) + 1
    return start, max(0, tail - AROUND_CHARS)


class _Scores:
    """`score` with each (context, text) asked once: candidates that change a file alike,
    and the file before the change, which every candidate compares against."""

    def __init__(self, score: Score) -> None:
        self.score = score
        self.asked: dict[tuple[str, str], asyncio.Task[float]] = {}

    def __call__(self, context: str, text: str) -> Awaitable[float]:
        key = (context, text)
        if key not in self.asked:
            self.asked[key] = asyncio.ensure_future(self.score(context, text))
        return self.asked[key]


async def code_gain(
    score: Score, changed: dict[str, tuple[str, str]], windows: dict[str, tuple[int, int]]
) -> float:
    """How much likelier the model finds the files after the change than before, summed
    over the changed files (log-probabilities of each file's window, `windows[path]`)."""
    total = 0.0
    for path, (before, after) in changed.items():
        start, tail = windows[path]
        context = before[:start]
        now, then = await asyncio.gather(
            score(context, after[start : len(after) - tail]),
            score(context, before[start : len(before) - tail]),
        )
        total += now - then
    return total


Changed = dict[str, tuple[str, str]]  # {path: (text now, text after)}, as `preview` gives


@dataclass(frozen=True)
class Ranked:
    index: int  # of the chosen candidate
    gains: tuple[float, ...]  # each candidate's `code_gain`; -inf where it cannot apply
    changed: tuple[Changed | None, ...] = ()  # each candidate's `preview`


async def rank(ws: Workspace, candidates: Sequence[Sequence[ParsedCall]], score: Score) -> Ranked:
    """The candidate (its calls from the first change on) to keep: the highest gain,
    the earliest on a tie; the first when none applies. Every candidate that changes a
    file is scored on one window of it, the union of theirs, so the file as it stands
    is scored once and candidates that leave it alike share a score."""
    previews = [preview(ws, calls) for calls in candidates]
    windows: dict[str, tuple[int, int]] = {}
    for p in previews:
        for path, (before, after) in (p or {}).items():
            start, tail = window(before, after)
            if path in windows:
                start, tail = min(start, windows[path][0]), min(tail, windows[path][1])
            windows[path] = (start, tail)
    once = _Scores(score)
    gains = await asyncio.gather(
        *(code_gain(once, p, windows) if p else _never() for p in previews)
    )
    best = max(range(len(gains)), key=lambda i: (gains[i], -i))
    index = best if math.isfinite(gains[best]) else 0
    return Ranked(index=index, gains=tuple(gains), changed=tuple(previews))


async def _never() -> float:
    return -math.inf


@dataclass(frozen=True)
class Tried:
    index: int | None  # of the first candidate that passed; None: none did
    runs: int  # trial runs made (candidates that change files alike share one)


async def first_passing(ws: Workspace, ranked: Ranked, check: Check, at_once: int = 1) -> Tried:
    """The first candidate of `rank`'s, in the order of its gains (highest first, the
    earliest on a tie), whose files pass `check`; candidates that cannot apply or that create a file
    (a trial run replaces files, it adds none) are not tried, and those that leave the
    files alike are tried once (`first_that_passes`)."""
    gains = ranked.gains
    order = sorted(
        (i for i in range(len(gains)) if math.isfinite(gains[i])), key=lambda i: (-gains[i], i)
    )
    seen: set[tuple[tuple[str, str], ...]] = set()
    tried: list[tuple[int, dict[str, str]]] = []
    for i in order:
        changed = ranked.changed[i]
        if not changed or not all(ws.exists(path) for path in changed):
            continue
        files = {path: after for path, (_, after) in changed.items()}
        key = tuple(sorted(files.items()))
        if key not in seen:
            seen.add(key)
            tried.append((i, files))
    got = await first_that_passes([files for _, files in tried], check, at_once)
    return Tried(index=None if got.index is None else tried[got.index][0], runs=got.runs)


async def first_that_passes(
    candidates: Sequence[dict[str, str]], check: Check, at_once: int = 1
) -> Tried:
    """The index of the first of `candidates` (the files each puts in place) that passes
    `check`, in order, and the runs made. `at_once` candidates are tried side by side
    (trial runs change nothing, so they cannot meet), the first in order that passes
    wins. Stops at the first `check` that could not be tried: later ones would fare no
    better."""
    runs = 0
    step = max(1, at_once)
    for first in range(0, len(candidates), step):
        got = await asyncio.gather(*(check(files) for files in candidates[first : first + step]))
        runs += sum(passed is not None for passed in got)
        for i, passed in enumerate(got):
            if passed:
                return Tried(index=first + i, runs=runs)
        if None in got:
            break
    return Tried(index=None, runs=runs)
