"""Small edits the model itself proposes, tried against the failing command
(`SessionConfig.repair`).

A small model rarely writes a fix whole, yet at the token where a bug sits it often
still gives the right token a fair share of its probability: after `if lo` it finds
`<=` plausible beside the `<` the code has, after `sum(item.price` it finds `*`
plausible beside `for`. This module turns that into candidate changes, the way
masked-language-model program repair does, with a causal model:

1. For the code in focus (the functions the session's change and the failing run's
   traceback point at, `focus`), one forward pass gives, at every token, the model's
   likeliest next tokens (`TokenLM.top_tokens`).
2. Each gives three kinds of edit at that token (comments, docstrings and the names
   the code defines left alone): put another token in its place, put one before it,
   or drop it. A first-order gain (log P(new token) - log P(token there)) orders them;
   the best are continued greedily by the model to the end of their line, which gives
   an edit up to where the continuation meets the code again (`*` then
   ` item.quantity`, then ` for`) and one that writes the rest of the line anew (`a`
   in place of `b` in `f(b, a)`, then `, b)`).
3. The candidates that still parse, keep the names the file defines and change what
   the code does (not its comments, layout or docstrings alone) are returned, `TAIL`
   at most, best first by first-order gain; with the lines the failing run reached
   (`live_lines`), every edit of one of those comes before any other. With
   `rescore`, the first of them are scored exactly instead: log P(the edit and the
   `RESCORE_TOKENS` tokens after it) against log P(the tokens it replaces and the
   same tokens after them), with all the code before as context (a backend with a
   prefix cache reads only the window). By default none is: an exact score costs
   about what a forked trial run does (`agent/trials.py`, 0.2-0.8 s a child on 2
   cores), and the trial run tells whether the edit passes. On 21 held-out single-site bugs (`benchmarks/repair_proposals.py`), 96
   exact scores put the fix within the first 20 in 7 and proposing took 16.2 s
   (median); first-order gain alone, in 6, in 5.1 s.

Nothing here knows a kind of bug: every token proposed is the model's. The session
tries the candidates against the model's own failing command in trial runs that change
nothing (`tools.sandbox.run_sandboxed(files=…)`), and keeps the first that passes. The
candidates it tried in vain are `known` to a later `propose`, which leaves them out and
returns the next ones by gain in their place.
"""

from __future__ import annotations

import ast
import asyncio
import bisect
import functools
import heapq
import io
import itertools
import math
import re
import tokenize
import warnings
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from opencomposer.agent.alternatives import CONTEXT_TOKENS
from opencomposer.agent.text import common_ends

# Tokens proposed at each position (the top of the model's distribution there).
TOP_K = 8
# Edits continued greedily (the best by first-order gain), and how far: to where the
# model meets the code again, or to the end of the edit's line.
EXPAND = 32
EXPAND_TOKENS = 16
# Candidates scored exactly, and kept, per call of `propose` (none by default: see
# the module's note), and the tokens of code after each edit that its exact score
# reads (the code before it is the same either way; what the edit changes shows
# within a few lines, and each token read adds noise: a bf16 model's
# log-probabilities of one text differ by about 0.5 nat over 64 tokens from one batch
# to another).
RESCORE = 0
RESCORE_TOKENS = 64
# Candidates after those, not scored exactly, returned after them by first-order gain.
TAIL = 224
# Lines of code in focus at most, summed over the spans.
FOCUS_LINES = 160
# Tokens at most that the model reads of one file's spans, one after another (`_sites`).
CHAIN_TOKENS = 3072

_TEST_FILE = re.compile(
    r"(^|/)(tests?|testing)/|(^|/)test_[^/]*\.py$|_tests?\.py$|(^|/)conftest\.py$"
)
_TRACE_LINE = re.compile(r'File "([^"]+)", line (\d+)|^([\w./-]+\.py):(\d+):', re.MULTILINE)


class Tokens(Protocol):
    """A model's tokenizer for plain text (`_local.ChatTokenizer`)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    @property
    def bos_id(self) -> int: ...

    @property
    def special_ids(self) -> frozenset[int]:
        """Tokens that are not text (the end of a text, chat markers)."""
        ...


class TokenLM(Protocol):
    """What proposing and scoring edits needs of a model: the top of its next-token
    distribution at every position of a text, greedy continuations, and log P(text |
    context) (`alternatives.Score`)."""

    async def top_tokens(
        self, ids: list[int], first: int, k: int
    ) -> list[tuple[float, list[tuple[int, float]]]]:
        """For each position i in [first, len(ids)): (log P(ids[i] | ids[:i]), the k
        likeliest tokens there as (id, log-probability), likeliest first; none for
        k = 0)."""
        ...

    async def greedy(
        self, prefixes: list[list[int]], max_tokens: int, until: list[int]
    ) -> list[list[int]]:
        """The greedy continuation of each prefix, `max_tokens` tokens at most, ending
        with the first `until[i]` it makes (kept)."""
        ...

    async def logprob(self, context: str, text: str) -> float: ...


class Remembered:
    """`lm` as a `TokenLM` that remembers its answers. A session's repairs of the same
    code, turn after turn, make the same reads: the same sites' top tokens and the same
    best edits continued (a repair leaves the candidates tried before out only after
    those reads, `propose(known=…)`). Asked again, it answers from memory, so a later
    repair of unchanged code costs the model nothing and its turn's time goes to trial
    runs. `limit` answers of each kind are kept, the least recently used dropped
    first. `asked` and `reused` count the reads asked of it (a site's top tokens, a
    batch of continuations) and those answered from memory."""

    def __init__(self, lm: TokenLM, limit: int = 32) -> None:
        self.lm = lm
        self.limit = limit
        self._tops: OrderedDict[tuple[Any, ...], list[tuple[float, list[tuple[int, float]]]]]
        self._tops = OrderedDict()
        self._grown: OrderedDict[tuple[Any, ...], list[list[int]]] = OrderedDict()
        self.asked = 0
        self.reused = 0

    def _keep(
        self, memory: OrderedDict[tuple[Any, ...], Any], key: tuple[Any, ...], got: Any
    ) -> None:
        memory[key] = got
        memory.move_to_end(key)
        while len(memory) > self.limit:
            memory.popitem(last=False)

    async def _answer(
        self,
        memory: OrderedDict[tuple[Any, ...], Any],
        key: tuple[Any, ...],
        ask: Callable[[], Awaitable[Any]],
    ) -> Any:
        self.asked += 1
        got = memory.get(key)
        if got is None:
            got = await ask()
        else:
            self.reused += 1
        self._keep(memory, key, got)
        return got

    async def top_tokens(
        self, ids: list[int], first: int, k: int
    ) -> list[tuple[float, list[tuple[int, float]]]]:
        key = (tuple(ids), first, k)
        got = await self._answer(self._tops, key, lambda: self.lm.top_tokens(ids, first, k))
        return list(got)

    async def greedy(
        self, prefixes: list[list[int]], max_tokens: int, until: list[int]
    ) -> list[list[int]]:
        # the whole batch is one answer: a backend's continuation of one prefix can
        # differ in its last digits with the batch beside it (llama.cpp shares cells)
        key = (tuple(map(tuple, prefixes)), max_tokens, tuple(until))
        got = await self._answer(
            self._grown, key, lambda: self.lm.greedy(prefixes, max_tokens, until)
        )
        return [list(c) for c in got]

    async def logprob(self, context: str, text: str) -> float:
        return await self.lm.logprob(context, text)


@dataclass(frozen=True)
class Span:
    """Lines [start, end) of a file (0-based), the code in focus."""

    path: str
    start: int
    end: int


@dataclass(frozen=True)
class FirstOrder:
    """Where an edit's first-order gain is read (`first_order_gain`): the site (the
    index into `site_prompts`), the token of its body the edit starts at, how it
    begins (`SUB` another token in its place, `INS` one before it, `DROP` it dropped)
    and the token it puts there (-1 for a drop). An edit continued greedily (`_grow`)
    keeps the one it grew from: the ranking reads only that."""

    site: int
    at: int
    how: str
    token: int


SUB, INS, DROP = "sub", "ins", "drop"


@dataclass(frozen=True)
class Proposal:
    path: str
    after: str  # the whole file with the edit made
    old: str  # the lines the edit changes, as they are
    new: str  # and as the edit makes them
    gain: float  # log P(code after the edit) - log P(code now), over the edit's window
    exact: bool = True  # False: `gain` is the first-order estimate (`TAIL`)
    first: FirstOrder | None = None  # where its first-order gain is read
    ran: bool = True  # False: the failing run did not reach its line (`propose(live=…)`)


def is_test_file(path: str) -> bool:
    return bool(_TEST_FILE.search(path.replace("\\", "/")))


def enclosing(text: str, line: int, path: str = "") -> tuple[int, int] | None:
    """The lines [start, end) of the innermost function around 0-based `line` of a Python
    file (decorators included), else of the statement that holds it (a class's field, a
    module's constant); None for a blank line, a comment or a line past the end. For a
    file that is not Python, or does not parse, 8 lines either side."""
    lines = text.splitlines()
    if not 0 <= line < len(lines) or not lines[line].strip() or lines[line].lstrip()[:1] == "#":
        return None
    if path.endswith(".py") or not path:
        try:
            tree: ast.AST | None = ast.parse(text)
        except (SyntaxError, ValueError):
            tree = None
        if tree is not None:
            inner: tuple[int, int, bool] | None = None
            for node in ast.walk(tree):
                if not isinstance(node, ast.stmt):
                    continue
                first, last = _lines_of(node)
                if not first <= line < last:
                    continue
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    if inner is None or not inner[2] or last - first < inner[1] - inner[0]:
                        inner = (first, last, True)
                elif isinstance(node, ast.ClassDef):
                    continue
                elif inner is None or (not inner[2] and last - first < inner[1] - inner[0]):
                    inner = (first, last, False)
            return (inner[0], inner[1]) if inner is not None else None
    return max(0, line - 8), min(len(lines), line + 9)


def traceback_lines(output: str, root: str) -> list[tuple[str, int]]:
    """(path relative to `root`, 0-based line) of each frame or `path:line` a command's
    output names inside the workspace, innermost (last printed) first."""
    found: list[tuple[str, int]] = []
    prefix = root.rstrip("/") + "/"
    for m in _TRACE_LINE.finditer(output):
        path, line = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        if path.startswith(prefix):
            path = path[len(prefix) :]
        elif path.startswith("/"):
            continue  # outside the workspace: the standard library, site-packages
        found.append((path, int(line) - 1))
    return found[::-1]


def focus(
    texts: dict[str, str], lines: Iterable[tuple[str, int]], limit: int = FOCUS_LINES
) -> list[Span]:
    """The spans to propose edits in: the enclosing function of each (path, line) in
    order, test files and files not in `texts` left out, each span once, until
    `limit` lines."""
    spans: list[Span] = []
    used = 0
    for path, line in lines:
        text = texts.get(path)
        if text is None or is_test_file(path) or line < 0:
            continue
        if any(s.path == path and s.start <= line < s.end for s in spans):
            continue
        around = enclosing(text, line, path)
        if around is None:
            continue
        start, end = around
        if any(s.path == path and s.start < end and start < s.end for s in spans):
            continue  # it overlaps a span taken (a function around one, a window)
        if used + (end - start) > limit:
            continue
        spans.append(Span(path, start, end))
        used += end - start
    return spans


@dataclass(frozen=True)
class _Edit:
    at: int  # token index in the span's body
    drop: int  # tokens of the body it replaces (0: an insertion)
    put: tuple[int, ...]  # tokens it puts there
    first_order: float
    how: str = SUB  # how the edit it grew from began (`FirstOrder.how`)
    lead: int = -1  # the token that edit put first (-1: a drop)


def _shape(path: str, text: str) -> tuple[list[str], str] | None:
    """(the names a Python file defines: functions, classes, their parameters, in order;
    what it does: its syntax tree without docstrings), None when it does not parse; for
    a file that is not Python ([], its text). An edit must parse and keep the names
    (renaming what callers use fixes nothing) and change what the file does (comments,
    layout and docstrings cannot fix a failing run)."""
    if not path.endswith(".py"):
        return [], text
    try:
        tree = ast.parse(text)
        with warnings.catch_warnings():  # `"a" "b"()`: a candidate's, not the code's
            warnings.simplefilter("ignore")
            compile(tree, path, "exec", dont_inherit=True)  # parses, yet cannot run: `*a`
    except (SyntaxError, ValueError):
        return None
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.append(node.name)
            _drop_docstring(node)
        elif isinstance(node, ast.Module):
            _drop_docstring(node)
        elif isinstance(node, ast.arg):
            names.append(node.arg)
    return names, ast.dump(tree)


def _drop_docstring(
    node: ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef,
) -> None:
    if node.body and _is_docstring(node.body[0]):
        node.body[0] = ast.Pass()


def _is_docstring(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Constant)
        and isinstance(stmt.value.value, str)
    )


def changed_lines(before: str, after: str) -> tuple[str, str]:
    """(old, new): the whole lines that differ between two texts of a file, with lines
    around them added until `old` occurs once in `before`, so an edit can name it."""
    a, b = before.splitlines(keepends=True), after.splitlines(keepends=True)
    lo, tail = common_ends(a, b)
    hi_a, hi_b = len(a) - tail, len(b) - tail
    while True:
        old = "".join(a[lo:hi_a])
        if (old.strip() and before.count(old) == 1) or (lo == 0 and hi_a == len(a)):
            return old, "".join(b[lo:hi_b])
        if lo > 0:
            lo -= 1
        if hi_a < len(a):
            hi_a, hi_b = hi_a + 1, hi_b + 1


async def propose(
    lm: TokenLM,
    tok: Tokens,
    texts: dict[str, str],
    spans: Sequence[Span],
    *,
    k: int = TOP_K,
    expand: int = EXPAND,
    rescore: int = RESCORE,
    tail: int = TAIL,
    known: Callable[[str, str], bool] | None = None,
    live: Callable[[str, int], bool] | None = None,
) -> list[Proposal]:
    """Candidate edits of `spans` (in the files `texts`), best first by exact gain, then
    up to `tail` more by first-order gain. The edits of all spans compete for the
    `expand` continuations and the `rescore` exact scores on their first-order gains.
    An edit `known(path, the file's text after it)` says was tried already is left
    out and not counted: the candidates after it take its place. With `live(path,
    0-based line)`, whether the failing run could have run what an edit at that line
    changes (`live_lines`), the edits at live lines come first, all of them before any
    other: an edit of code the failing run never reached leaves that run as it was."""
    sites = _sites(tok, texts, _merged(spans))
    edits: list[tuple[_Site, _Edit]] = []
    tops = await asyncio.gather(*(lm.top_tokens(s.prompt, s.offset, k) for s in sites))
    for site, rows in zip(sites, tops, strict=True):
        if len(rows) == len(site.ids):
            edits += [(site, e) for e in _edits(tok, site, rows)]
    ran = _ran(sites, live)

    def rank(se: tuple[_Site, _Edit]) -> tuple[bool, float]:
        return ran(se), se[1].first_order

    # about a third of the edits do not parse, or change a comment or a name the file
    # defines: the tail is drawn from twice its size
    top = max(expand, rescore)
    if known is None:
        best = heapq.nlargest(top + 2 * tail, edits, key=rank)
    else:  # the edits tried already may be many: the tail is drawn from all of them
        best = sorted(edits, key=rank, reverse=True)
    # in the order of the code, so a cache of the tokens before each edit serves the next
    order = {site: n for n, site in enumerate(sites)}
    grown = await _grow(lm, tok, sorted(best[:expand], key=lambda se: (order[se[0]], se[1].at)))
    seen: set[tuple[_Site, str]] = set()
    # best first by first-order gain, an edit's continuations before it
    first = iter(sorted([*grown, *best[:top]], key=rank, reverse=True))
    chosen = _kept(tok, first, rescore, seen, known)
    rest = _kept(tok, itertools.chain(first, best[top:]), tail, seen, known)
    # in the order of the code, so a cache of the tokens before each edit serves the next
    chosen.sort(key=lambda c: (sites.index(c[0]), c[1].at))
    rows_of = dict(zip(sites, tops, strict=True))  # a site is hashed by identity
    gains = await asyncio.gather(*(_gain(lm, site, e, rows_of[site]) for site, e, _ in chosen))

    def proposal(site: _Site, e: _Edit, new_body: str, gain: float, exact: bool) -> Proposal:
        after = site.head + new_body + site.tail
        old, new = changed_lines(site.text, after)
        first = FirstOrder(order[site], e.at, e.how, e.lead)
        return Proposal(site.span.path, after, old, new, gain, exact, first, ran((site, e)))

    out = [
        proposal(site, e, new_body, gain, True)
        for (site, e, new_body), gain in zip(chosen, gains, strict=True)
        if math.isfinite(gain)
    ]
    out.sort(key=lambda p: (not p.ran, -p.gain))
    out += [proposal(site, e, new_body, e.first_order, False) for site, e, new_body in rest]
    return out


def _ran(
    sites: Sequence[_Site], live: Callable[[str, int], bool] | None
) -> Callable[[tuple[_Site, _Edit]], bool]:
    """Whether `live` holds at the line an edit starts on (an insertion before a line
    break, at the end of the line it ends); always, without `live`."""
    if live is None:
        return lambda se: True
    by_site: dict[_Site, list[bool]] = {}
    for site in sites:
        line, flags = site.span.start, []
        for piece in site.pieces:
            flags.append(live(site.span.path, line))
            line += piece.count("\n")
        by_site[site] = flags
    return lambda se: by_site[se[0]][se[1].at]


def live_lines(text: str, ran: Iterable[int]) -> frozenset[int] | None:
    """The 0-based lines of a Python file where an edit can change what a run did that
    ran its lines `ran` (0-based, as a line tracer reports them): every line of a
    statement with a line that ran (a call whose arguments span lines reports one of
    them), and a compound statement's own lines (its header and decorators, `else:`,
    `except …:`, the lines between its statements) when a line of it ran. A function's
    body that never ran is not live, though its `def` ran when its module was
    imported. None for a file that does not parse."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    starts = sorted(set(ran))

    def touched(first: int, last: int) -> bool:  # a line of [first, last) ran
        i = bisect.bisect_left(starts, first)
        return i < len(starts) and starts[i] < last

    live: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt):
            continue
        first, last = _lines_of(node)
        if not touched(first, last):
            continue
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body[0].lineno - 1
            if not touched(body, last):
                live.update(range(first, body))  # it was defined, never run
                continue
        own = set(range(first, last))
        for child in _statements_in(node):
            lo, hi = _lines_of(child)
            own.difference_update(range(lo, hi))
        live |= own
    return frozenset(live)


def live_check(
    texts: dict[str, str], executed: dict[str, frozenset[int]] | None
) -> Callable[[str, int], bool] | None:
    """`propose`'s `live` for the files `texts`, from the 0-based lines of each file a
    failing run ran (`executed`, `localize.executed_lines`): no line of a Python file it
    never ran is live. Every line of a file the record cannot tell of (not Python, or
    it does not parse) is, and with no record (`executed` None), None."""
    if executed is None:
        return None
    live: dict[str, frozenset[int] | None] = {
        path: live_lines(text, executed.get(path, ())) if path.endswith(".py") else None
        for path, text in texts.items()
    }

    def check(path: str, line: int) -> bool:
        lines = live.get(path)
        return lines is None or line in lines

    return check


def _lines_of(node: ast.stmt) -> tuple[int, int]:
    """The 0-based lines [first, last) of a statement, its decorators included."""
    first = node.lineno - 1
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        first = min([first, *(d.lineno - 1 for d in node.decorator_list)])
    return first, node.end_lineno or node.lineno


def _statements_in(node: ast.stmt) -> list[ast.stmt]:
    """The statements a compound statement holds directly (those of its `except`
    clauses and `case`s included)."""
    out: list[ast.stmt] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.stmt):
            out.append(child)
        elif isinstance(child, ast.ExceptHandler | ast.match_case):
            out += child.body
    return out


def site_prompts(
    tok: Tokens, texts: dict[str, str], spans: Sequence[Span]
) -> list[tuple[list[int], int]]:
    """(what the model reads, where the code in focus starts in it) at each site
    `propose` makes of `spans`, in the order `FirstOrder.site` counts them."""
    return [(site.prompt, site.offset) for site in _sites(tok, texts, _merged(spans))]


def first_edit(
    tok: Tokens, texts: dict[str, str], spans: Sequence[Span], path: str, after: str
) -> FirstOrder | None:
    """Where an edit that leaves file `path` as `after` begins, as `FirstOrder` counts
    the sites `propose` makes of `spans`: the first token of a site's code it changes,
    and the token it puts there first (an insertion when the token there follows it,
    a drop when the edit only removes tokens). None when it changes no site alone (it reaches outside
    the code in focus) or only at the code's last token. `propose` makes the edits it
    ranks this way; an edit it does not propose (its first token is not among the
    model's top tokens there) can still be scored as one (`training/repairrl.py`)."""
    for n, site in enumerate(_sites(tok, texts, _merged(spans))):
        cut = len(after) - len(site.tail)
        if site.span.path != path or cut < len(site.head):
            continue
        if not (after.startswith(site.head) and after.endswith(site.tail)):
            continue
        body = after[len(site.head) : cut]
        if body == site.body:
            continue
        old, new = site.ids, tok.encode(body)
        i = 0
        while i < min(len(old), len(new)) and old[i] == new[i]:
            i += 1
        k = 0
        while k < min(len(old), len(new)) - i and old[-1 - k] == new[-1 - k]:
            k += 1
        put = new[i : len(new) - k]
        if i + 1 >= len(old):
            return None
        if not put:
            return FirstOrder(n, i, DROP, -1)
        # an insertion when the token there comes right after the first one put
        kept = len(old) - k == i or (i + 1 < len(new) and new[i + 1] == old[i])
        return FirstOrder(n, i, INS if kept else SUB, put[0])
    return None


def first_order_gain(first: FirstOrder, body: Sequence[int], lp: Callable[[int, int], Any]) -> Any:
    """An edit's first-order gain as `_edits` reads it, from `lp(j, t)`, log P(token t
    at the body's token j | the tokens before it): floats, or a differentiable
    tensor's entries (`training/repairrl.py`). A dropped token is scored with the
    odds of the one after it exactly, where `_edits` bounds them when they are not
    among its top tokens."""
    j = first.at
    here = lp(j, body[j])
    if first.how == DROP:
        return lp(j, body[j + 1]) - here - lp(j + 1, body[j + 1])
    gain = lp(j, first.token) - here
    return gain - 1.0 if first.how == INS else gain


def _kept(
    tok: Tokens,
    edits: Iterable[tuple[_Site, _Edit]],
    most: int,
    seen: set[tuple[_Site, str]],
    known: Callable[[str, str], bool] | None = None,
) -> list[tuple[_Site, _Edit, str]]:
    """The first `most` of `edits` that still parse, keep the names the file defines and
    change what the code does, each with its site's new text, none twice (`seen`) and
    none `known` to have been tried (`propose`)."""
    out: list[tuple[_Site, _Edit, str]] = []
    if most <= 0:
        return out
    for site, e in edits:
        new_body = tok.decode(site.ids[: e.at] + list(e.put) + site.ids[e.at + e.drop :])
        if new_body == site.body or (site, new_body) in seen:
            continue
        if known is not None and known(site.span.path, site.head + new_body + site.tail):
            seen.add((site, new_body))
            continue
        shape = _shape(site.span.path, site.checked(new_body))
        if shape is None or site.shape is None or shape[0] != site.shape[0]:
            continue  # it does not parse, or renames what the file defines
        if shape[1] == site.shape[1]:
            continue  # a comment, a docstring or the layout: the code does the same
        out.append((site, e, new_body))
        seen.add((site, new_body))
        if len(out) >= most:
            break  # what is left of `edits` is not read
    return out


async def _gain(
    lm: TokenLM, site: _Site, e: _Edit, rows: list[tuple[float, list[tuple[int, float]]]]
) -> float:
    """The exact gain of an edit: log P(its tokens and the `RESCORE_TOKENS` tokens of
    code after the ones it replaces) - log P(the tokens it replaces and those same
    tokens), after the same context. The second term is the first pass's (`rows`)."""
    end = min(len(site.ids), e.at + e.drop + RESCORE_TOKENS)
    start = site.offset + e.at
    new = await lm.top_tokens(
        [*site.prompt[:start], *e.put, *site.ids[e.at + e.drop : end]], start, 0
    )
    return sum(r[0] for r in new) - sum(r[0] for r in rows[e.at : end])


def _merged(spans: Sequence[Span], gap: int = 2) -> list[Span]:
    """The spans with those of a file at most `gap` lines apart made one (the methods of
    a class read together): one pass of the model reads them, after one context."""
    out: list[Span] = []
    for span in sorted(spans, key=lambda s: (s.path, s.start)):
        last = out[-1] if out else None
        if last is not None and last.path == span.path and span.start - last.end <= gap:
            out[-1] = Span(span.path, last.start, max(last.end, span.end))
        else:
            out.append(span)
    return out


@dataclass(frozen=True, eq=False)
class _Site:
    """A span's code as the model reads it: the text around it, its tokens, and the
    tokens that condition them (`_sites`)."""

    span: Span
    text: str
    head: str
    body: str
    tail: str
    ids: list[int]
    pieces: list[str]  # the text of each of `ids`
    kept: frozenset[int]  # the indices of `ids` no edit touches (`_kept_tokens`)
    prompt: list[int]  # what the model reads before `ids` (`_sites`), then `ids`
    offset: int  # where `ids` start in `prompt`
    shape: tuple[list[str], str] | None  # `_shape` of `_region(body)`, else of `text`
    whole: bool  # the region did not compile alone: candidates are checked in `text`

    def checked(self, body: str) -> str:
        """What `_shape` reads of a candidate's `body`: its region, or its whole file."""
        return self.head + body + self.tail if self.whole else _region(body)


def _region(body: str) -> str:
    """A span's code as a module of its own: one that starts indented (a method) is put
    under `if 1:`, one for each level its code steps back out to (the last method of a
    nested class, then the next method of the class around it, read as one span).
    Checking a candidate there costs a function's parse, not its file's; nothing outside
    the span changes."""
    levels: list[str] = []  # the indents of lines less indented than all before them
    for line in body.splitlines():
        if line.strip():
            indent = line[: len(line) - len(line.lstrip())]
            if not levels or len(indent) < len(levels[-1]):
                levels.append(indent)
    if not levels or not levels[0]:
        return body
    if levels[-1]:
        levels.append("")
    levels.reverse()  # outermost first: each `if 1:` holds the next level's lines
    return "".join(f"{indent}if 1:\n" for indent in levels[:-1]) + body


def _sites(tok: Tokens, texts: dict[str, str], spans: Sequence[Span]) -> list[_Site]:
    """The sites of `spans` (in the order of their files' code), each read by the model
    after the code above its file's first span (`CONTEXT_TOKENS` at most) and the spans
    of that file before it, not the code between them: the functions in focus read as
    one text, one after another. One pass then reads them all (a backend with a prefix
    cache reads each site's tokens once, and a continuation of an edit reads only what
    it adds), where a site after its own code above made the model read that code again
    for every site and every continuation: 10 methods of one class cost about 5,500
    tokens of reading that way, 930 this way. A file's text grows to `CHAIN_TOKENS` at
    most; the span after starts another, after its own code above."""
    sites: list[_Site] = []
    for span in spans:
        last = sites[-1] if sites else None
        chain = last.prompt if last is not None and last.span.path == span.path else None
        if (site := _site(tok, texts[span.path], span, chain)) is not None:
            sites.append(site)
    return sites


def _site(tok: Tokens, text: str, span: Span, chain: list[int] | None = None) -> _Site | None:
    """`span`'s site, read after `chain` (the file's text so far) while the two fit in
    `CHAIN_TOKENS`, else after the code above it."""
    lines = text.splitlines(keepends=True)
    head, body = "".join(lines[: span.start]), "".join(lines[span.start : span.end])
    if not body.strip():
        return None
    ids = tok.encode(body)
    if tok.decode(ids) != body:
        return None  # the tokens do not give the text back: edits could not be placed
    if chain is not None and len(chain) + len(ids) <= CHAIN_TOKENS:
        lead = chain
    else:
        lead = (tok.encode(head)[-CONTEXT_TOKENS:] if head else []) or [tok.bos_id]
    tail = "".join(lines[span.end :])
    pieces = [tok.decode([t]) for t in ids]
    kept = _kept_tokens(text, len(head), pieces) if span.path.endswith(".py") else frozenset()
    shape, whole = _shape(span.path, _region(body)), False
    if shape is None:  # e.g. a `nonlocal` whose binding lies outside the span
        shape, whole = _shape(span.path, text), True
    return _Site(
        span, text, head, body, tail, ids, pieces, kept, lead + ids, len(lead), shape, whole
    )


def _edits(
    tok: Tokens, site: _Site, rows: list[tuple[float, list[tuple[int, float]]]]
) -> list[_Edit]:
    """Every edit of one token the model's top tokens suggest: another token in its
    place, one before it, or none (it is dropped), with its first-order gain (log
    P(what the edit puts there) - log P(what it replaces), where the model's odds are
    known). The
    tokens of a name the code defines (a function's, a class's, a parameter's) are left
    as they are, since renaming what callers use fixes nothing, and so are comments and
    docstrings (`_kept_tokens`)."""
    ids, pieces = site.ids, site.pieces
    visible = [bool(p.strip()) for p in pieces]
    python = site.span.path.endswith(".py")
    special = tok.special_ids
    edits: list[_Edit] = []
    for j, (here, top) in enumerate(rows):
        if j in site.kept:
            continue
        probs = dict(top)
        for alt, lp in top:
            if alt == ids[j] or alt in special:
                continue
            piece = tok.decode([alt])
            if not piece.strip() or (python and "#" in piece):
                continue  # white space alone, or a comment that puts code out of play
            if visible[j]:
                edits.append(_Edit(j, 1, (alt,), lp - here, SUB, alt))
            # an insertion keeps the token there, whose odds after it are unknown: taken
            # as a substitution's, less a nat for the longer code
            edits.append(_Edit(j, 0, (alt,), lp - here - 1.0, INS, alt))
        if visible[j] and j + 1 < len(ids) and top:
            # the odds of the token after, were this one dropped: the model's own when
            # it is among its top tokens here, else at most the last of those, less a nat
            nxt = probs.get(ids[j + 1])
            if nxt is None:
                nxt = top[-1][1] - 1.0
            edits.append(_Edit(j, 1, (), nxt - here - rows[j + 1][0], DROP))
    return edits


_DEF_NAME = re.compile(r"\b(?:def|class)\s+(\w+)")


@functools.lru_cache(maxsize=4)
def _inert(text: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]]] | None:
    """(the offsets of the parameters a Python file's functions take, those of its
    comments and docstrings), None when it does not parse: read once for the sites of
    one file."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    line_starts = [0]
    for line in text.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))

    def at(line: int, col: int) -> int:
        return line_starts[line - 1] + col

    params: list[tuple[int, int]] = []
    inert: list[tuple[int, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.end_col_offset is not None:
            start = at(node.lineno, node.col_offset)
            params.append((start, start + len(node.arg)))
        elif isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            doc = node.body[0] if node.body else None
            if doc is not None and _is_docstring(doc) and doc.end_lineno is not None:
                inert.append((at(doc.lineno, doc.col_offset), at(doc.end_lineno, doc.end_col_offset or 0)))  # fmt: skip
    try:
        for t in tokenize.generate_tokens(io.StringIO(text).readline):
            if t.type == tokenize.COMMENT:
                inert.append((at(*t.start), at(*t.end)))
    except (tokenize.TokenError, SyntaxError):
        pass  # the comments already read are kept
    return params, inert


def _kept_tokens(text: str, lo: int, pieces: list[str]) -> frozenset[int]:
    """The indices of the tokens (`pieces`, the code of `text` from offset `lo`) no edit
    may touch: those that overlap a name the code defines (after `def` or `class`, or a
    parameter), and those whose text lies in a comment or a docstring, where an edit
    changes nothing the code does. Empty for a file that does not parse."""
    body = "".join(pieces)
    if text[lo : lo + len(body)] != body:
        return frozenset()
    found = _inert(text)
    if found is None:
        return frozenset()
    params, inert = found
    hi = lo + len(body)
    names = [(lo + m.start(1), lo + m.end(1)) for m in _DEF_NAME.finditer(body)]
    names += [(a, b) for a, b in params if lo <= a < hi]
    kept: set[int] = set()
    start = lo
    for j, piece in enumerate(pieces):
        end = start + len(piece)
        if any(a < end and start < b for a, b in names):
            kept.add(j)
        elif piece.strip():
            first = start + len(piece) - len(piece.lstrip())
            last = start + len(piece.rstrip())
            if any(a <= first and last <= b for a, b in inert):
                kept.add(j)
        start = end
    return frozenset(kept)


async def _grow(
    lm: TokenLM, tok: Tokens, edits: list[tuple[_Site, _Edit]]
) -> list[tuple[_Site, _Edit]]:
    """Each edit continued greedily to the end of its line (`EXPAND_TOKENS` at most),
    which gives up to two edits: the continuation up to where it meets the code again
    (it predicts the token the edit stopped before; one that meets it at once is
    already among the single-token edits), and the continuation in place of the rest
    of the line (`f(b, a)` for `f(a, b)`: the model goes on writing the line it began
    anew). One call of `greedy` continues them all."""
    todo = [(site, e) for site, e in edits if e.at + e.drop < len(site.ids)]
    if not todo:
        return []
    # where the code of each edit's line ends: its line break, or a comment after it
    eol = []
    for site, e in todo:
        ids, pieces = site.ids, site.pieces
        r = e.at + e.drop
        while r < len(ids) and "\n" not in pieces[r] and not _comment(site, r):
            r += 1
        ends_line = r < len(ids) and (pieces[r].startswith("\n") or _comment(site, r))
        eol.append(r if ends_line else -1)
    prefixes = [site.prompt[: site.offset + e.at] + list(e.put) for site, e in todo]
    ends = [
        site.ids[r] if r >= 0 else site.ids[e.at + e.drop]
        for (site, e), r in zip(todo, eol, strict=True)
    ]
    conts = await lm.greedy(prefixes, EXPAND_TOKENS + 1, ends)
    grown = []
    for (site, e), r, cont in zip(todo, eol, conts, strict=True):
        rejoin = site.ids[e.at + e.drop]
        met = False
        for n, t in enumerate(cont):
            piece = tok.decode([t])
            if t == rejoin and not met:
                met = True
                if n:
                    grown.append((site, replace(e, put=(*e.put, *cont[:n]))))
                if r < 0 or r == e.at + e.drop:
                    break
            elif piece.lstrip(" ").startswith(("\n", "#")):  # the line's code, written anew
                if r >= 0:
                    grown.append((site, replace(e, drop=r - e.at, put=(*e.put, *cont[:n]))))
                break
            elif "\n" in piece:
                break
    return grown


def _comment(site: _Site, j: int) -> bool:
    return j in site.kept and site.pieces[j].lstrip().startswith("#")
