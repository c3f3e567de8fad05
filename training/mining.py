"""Tasks mined from real repositories by bug injection (`opencomposer tasks mine REPO --out DIR`).

How a repository becomes tasks:

1. A scratch copy is made (the repository itself is never changed) and its test
   suite runs once in the sandbox under a small pytest plugin that records, per
   test, its outcome and the functions it calls (`sys.settrace` on call events
   only, so the overhead is one Python callback per call). Only tests that pass
   are used.
2. Every function that a passing test covers is a mutation site. Mutations are
   made on the `ast` and written back as a replacement of that one node's source
   span, so the rest of the file keeps its formatting and comments: flipped
   comparisons (`<` → `>=`), off-by-one bounds (`n - 1` → `n`, `k` → `k + 1`),
   dropped branches (an `if` without `else` becomes `pass`), swapped arguments,
   wrong variables (a parameter read where another was meant), `and`/`or`,
   `True`/`False` returns.
3. Each mutation runs only the tests that cover its function. A mutation is kept
   when specific tests fail (an assertion or an exception in the test, not a
   collection error); at most one per function, kinds interleaved.
4. The task: `repo.tar` holds the broken code with the tests; the query quotes
   the failing test and its error as a user would; `verify` runs the test files
   involved (protected, so editing the tests does not help).
5. Every task is verified before it is kept: in the sandbox, verify fails on the
   broken code and passes with the original code restored.

`mine_pypi(name)` does the same for a pure-Python library's sdist from PyPI
(`pip download --no-binary :all: --no-deps`), and `ensure_own_suite()` mines the
built-in `own` suite from this repository (fast, pure test files only) into the
cache on first use.

    python -m opencomposer.training.mining REPO --out DIR [--limit 10]
    python -m opencomposer.training.mining --pypi inflection --out DIR
"""

from __future__ import annotations

import ast
import asyncio
import copy
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from opencomposer.tools.git import Git, GitError
from opencomposer.tools.protocols import SandboxConfig
from opencomposer.training.env import run_command
from opencomposer.training.tasks import (
    SKIP_NAMES,
    TaskError,
    load_task,
    pack_dir,
    safe_extract,
    write_task,
)

STATE_DIR = ".opencomposer"  # inside the scratch copy; never packed into repo.tar
TEST_TIMEOUT_S = 300.0
SUITE_TIMEOUT_S = 1800.0  # the traced run of a whole suite
# A mutant's run gets this many times its tests' (traced) time on the unchanged code,
# plus the start-up floor, and never more than one test's budget: a mutant that loops
# forever is given up on after about half a minute, not after the whole budget.
TRIAL_SLACK = 5.0
TRIAL_FLOOR_S = 30.0

_PLUGIN = r"""
import json, os, sys, threading
import pytest

_ROOT = os.path.realpath(os.environ["OC_MINE_ROOT"]) + os.sep
_TRACE = os.environ.get("OC_MINE_TRACE") == "1"
_cur = None
_hits = {}
_outcomes = {}
_durations = {}


_rel = {}


def _relpath(f):
    # through symlinks (a shim package): the real file is the one to mutate
    if f not in _rel:
        real = os.path.realpath(f)
        _rel[f] = real[len(_ROOT):] if real.startswith(_ROOT) else None
    return _rel[f]


def _tracer(frame, event, arg):
    if event == "call" and _cur is not None:
        rel = _relpath(frame.f_code.co_filename)
        if rel is not None:
            _hits.setdefault(_cur, set()).add((rel, frame.f_code.co_firstlineno))
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _cur
    _cur = item.nodeid
    if _TRACE:
        sys.settrace(_tracer)
        threading.settrace(_tracer)
    try:
        yield
    finally:
        if _TRACE:
            sys.settrace(None)
            threading.settrace(None)
        _cur = None


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration
    prev = _outcomes.get(report.nodeid)
    if report.failed:
        _outcomes[report.nodeid] = {"outcome": "failed", "when": report.when,
                                   "error": report.longreprtext[-4000:]}
    elif report.when == "call" and prev is None:
        _outcomes[report.nodeid] = {"outcome": report.outcome}


def pytest_sessionfinish(session, exitstatus):
    with open(os.environ["OC_MINE_OUT"], "w") as fh:
        json.dump({"outcomes": _outcomes,
                   "hits": {k: sorted(v) for k, v in _hits.items()},
                   "durations": _durations,
                   "exitstatus": int(exitstatus)}, fh)
"""


@dataclass(frozen=True, kw_only=True)
class MineConfig:
    limit: int = 10  # tasks to keep
    max_attempts: int = 60  # mutations to try
    seed: int = 0
    tests: tuple[str, ...] = ()  # test files or folders; default: discovered
    sources: tuple[str, ...] = ()  # source files or folders to mutate; default: all non-test .py
    test_timeout_s: float = TEST_TIMEOUT_S
    per_function: int = 1
    source: str = ""  # recorded in task.toml
    env_prefix: str = ""  # put before `python -m pytest` (e.g. "PYTHONPATH=src")
    pytest_args: tuple[str, ...] = ()  # put after it (e.g. `-o addopts=` for foreign addopts)
    prepare: Callable[[Path], None] | None = None  # applied to the scratch copy first


@dataclass(kw_only=True)
class Mutation:
    path: str  # workspace-relative
    function: str
    kind: str
    line: int
    start: int  # byte offsets into the file
    end: int
    old: str
    new: str
    tests: list[str] = field(default_factory=list)  # covering tests
    # (source, tree, node, replacement) of a mutation made without the parse check,
    # which `checked()` runs when the mutation is about to be tried.
    pending: tuple[bytes, ast.Module, ast.AST, ast.AST, ast.AST | None] | None = field(
        default=None, repr=False, compare=False
    )
    valid: bool = True

    def apply(self, source: bytes) -> bytes:
        return source[: self.start] + self.new.encode() + source[self.end :]

    def checked(self) -> bool:
        """Whether the text parses back to the intended tree (parenthesised where
        precedence needs it). The check parses the whole file, so a miner runs it
        only for the mutations it tries, not for every candidate."""
        if self.pending is not None:
            source, tree, node, new, fn = self.pending
            self.pending = None
            text = _confirm(source, tree, node, new, self.start, self.end, self.new, fn)  # type: ignore[arg-type]
            self.valid = text is not None
            self.new = restyle(source, self.start, self.end, text) if text else self.new
        return self.valid


# ---------------------------------------------------------------- running tests


def _pytest_cmd(cfg: MineConfig, args: Iterable[str], *, plugin_dir: Path | None = None) -> str:
    """`[env] python -m pytest -q …`; with `plugin_dir`, that folder is put first on
    PYTHONPATH (merged with a PYTHONPATH that `cfg.env_prefix` sets: two assignments
    in one command line would leave only the last)."""
    words = shlex.split(cfg.env_prefix)
    paths = [w.split("=", 1)[1] for w in words if w.startswith("PYTHONPATH=")]
    words = [w for w in words if not w.startswith("PYTHONPATH=")]
    if plugin_dir is not None:
        paths.insert(0, str(plugin_dir))
    if paths:
        words.append("PYTHONPATH=" + ":".join(p for p in paths if p))
    prefix = "".join(f"{shlex.quote(w) if '=' not in w else _quote_assign(w)} " for w in words)
    quoted = " ".join(shlex.quote(a) for a in [*cfg.pytest_args, *args])
    return f"{prefix}python -m pytest -q -p no:cacheprovider {quoted}"


def verify_cmd(cfg: MineConfig, files: Iterable[str]) -> str:
    """A task's verify: the failing tests' files, stopped at the first failure (`-x`).
    Only its exit status counts, so a broken workspace need not run the rest: a bug
    that errors every test of a large file fails in a second, not at the time limit."""
    return _pytest_cmd(cfg, ["-x", *files])


def _quote_assign(word: str) -> str:
    name, _, value = word.partition("=")
    return f"{name}={shlex.quote(value)}"


async def _run_tests(
    root: Path,
    cfg: MineConfig,
    args: list[str],
    *,
    trace: bool,
    plugin_dir: Path,
    stop_first: bool = False,
    budget_s: float | None = None,
) -> dict:
    out = root / STATE_DIR / "mine.json"
    out.parent.mkdir(exist_ok=True)
    out.unlink(missing_ok=True)
    # No bytecode: a mutant of the same size written within the same second as the
    # original would otherwise run from the original's stale .pyc (and vice versa).
    env = (
        "PYTHONDONTWRITEBYTECODE=1 "
        f"OC_MINE_ROOT={shlex.quote(str(root))} OC_MINE_OUT={shlex.quote(str(out))} "
        f"OC_MINE_TRACE={int(trace)} "
    )
    extra = ["-p", "_oc_mine_plugin"]
    if _has_timeout_plugin():
        extra += ["--timeout", str(int(cfg.test_timeout_s))]
    if stop_first:
        extra.append("-x")
    cmd = env + _pytest_cmd(cfg, extra + args, plugin_dir=plugin_dir)
    budget = budget_s or cfg.test_timeout_s + 30
    sandbox = SandboxConfig(timeout_s=budget, memory_mb=4096, max_processes=256)
    res = await run_command(cmd, cwd=root, sandbox=sandbox)
    try:
        data = json.loads(out.read_text())
    except (OSError, ValueError):
        data = {"outcomes": {}, "hits": {}, "exitstatus": -1}
    data["output"] = res.output[-4000:]
    data["exit_code"] = res.exit_code
    return data


def _has_timeout_plugin() -> bool:
    try:
        import pytest_timeout  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------- finding mutations


def _is_test_file(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    parts = rel.split("/")
    return (
        name.startswith("test_")
        or name.endswith("_test.py")
        or name == "conftest.py"
        or any(p in ("tests", "test", "testing") for p in parts[:-1])
    )


def _py_files(root: Path, under: Iterable[str]) -> list[str]:
    found: set[str] = set()
    for base in under:
        p = root / base
        if p.is_file() and p.suffix == ".py":
            found.add(base)
        elif p.is_dir():
            for f in p.rglob("*.py"):
                rel = f.relative_to(root).as_posix()
                if not any(part in SKIP_NAMES or part.startswith(".") for part in rel.split("/")):
                    found.add(rel)
    return sorted(found)


def discover_tests(root: Path) -> list[str]:
    return [
        f
        for f in _py_files(root, ["."])
        if _is_test_file(f)
        and f.rsplit("/", 1)[-1] != "conftest.py"
        and (f.rsplit("/", 1)[-1].startswith("test_") or f.endswith("_test.py"))
    ]


class _Functions(ast.NodeVisitor):
    """(qualname, node) of every function in a module."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.found: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    def _fn(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.found.append((".".join([*self.stack, node.name]), node))
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_FunctionDef = _fn
    visit_AsyncFunctionDef = _fn


def _own_nodes(fn: ast.AST) -> Iterator[ast.AST]:
    """Nodes of a function's body, not of functions, classes or lambdas nested in it."""
    todo = list(ast.iter_child_nodes(fn))
    while todo:
        node = todo.pop(0)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            continue
        if isinstance(node, ast.arguments) or node in getattr(fn, "decorator_list", []):
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


_FLIP = {
    ast.Lt: ast.GtE,
    ast.GtE: ast.Lt,
    ast.Gt: ast.LtE,
    ast.LtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
_BOUND = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}


_OPERATOR = {  # a wrong arithmetic or bitwise operator
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Div,
    ast.Mod: ast.FloorDiv,
    ast.Pow: ast.Mult,
    ast.BitAnd: ast.BitOr,
    ast.BitOr: ast.BitAnd,
    ast.BitXor: ast.BitOr,
    ast.LShift: ast.RShift,
    ast.RShift: ast.LShift,
}
# Calls whose removal (`f(x)` -> `x`) is not a plausible slip, or that are covered
# by another kind (`range` bounds).
_KEEP_CALLS = frozenset({"range", "super", "isinstance", "issubclass", "print", "iter", "next"})

# The procedural bug kinds (SWE-smith's): each `_variants` kind is one of these.
KINDS = (
    "flipped comparison",
    "off-by-one bound",
    "off-by-one index",
    "wrong operator",
    "dropped factor",
    "changed constant",
    "dropped call",
    "dropped branch",
    "dropped return",
    "wrong return value",
    "and/or swapped",
    "dropped negation",
    "negated condition",
    "swapped arguments",
    "wrong variable",
)


def _variants(node: ast.AST, names: list[str]) -> Iterator[tuple[str, ast.AST]]:
    """(kind, replacement) for one node; `names` are the function's parameters and
    local variables, in order of appearance."""
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        op = type(node.ops[0])
        if op in _FLIP:
            yield (
                "flipped comparison",
                ast.Compare(left=node.left, ops=[_FLIP[op]()], comparators=node.comparators),
            )
        if op in _BOUND:
            yield (
                "off-by-one bound",
                ast.Compare(left=node.left, ops=[_BOUND[op]()], comparators=node.comparators),
            )
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATOR:
        if (
            isinstance(node.op, ast.Add | ast.Sub)
            and isinstance(node.right, ast.Constant)
            and node.right.value == 1
            and type(node.right.value) is int
        ):
            yield "off-by-one bound", node.left
        else:
            op = _OPERATOR[type(node.op)]()
            yield "wrong operator", ast.BinOp(left=node.left, op=op, right=node.right)
        if isinstance(node.op, ast.Mult):
            yield "dropped factor", node.left
            if isinstance(node.left, ast.Constant):
                yield "dropped factor", node.right
    elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        v = node.slice.value
        if type(v) is int:
            yield (
                "off-by-one index",
                ast.Subscript(
                    value=node.value, slice=ast.Constant(v + 1 if v >= 0 else v - 1), ctx=node.ctx
                ),
            )
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range":
        if node.args and not node.keywords:
            last = node.args[-1] if len(node.args) <= 2 else node.args[1]
            i = node.args.index(last)
            args = list(node.args)
            args[i] = ast.BinOp(left=last, op=ast.Sub(), right=ast.Constant(1))
            yield "off-by-one bound", ast.Call(func=node.func, args=args, keywords=[])
    elif isinstance(node, ast.If) and not node.orelse:
        yield "dropped branch", ast.Pass()
    elif isinstance(node, ast.BoolOp):
        other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield "and/or swapped", ast.BoolOp(op=other, values=node.values)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield "dropped negation", node.operand
    elif isinstance(node, ast.Return) and isinstance(node.value, ast.Constant):
        if isinstance(node.value.value, bool):
            yield "wrong return value", ast.Return(value=ast.Constant(not node.value.value))
    elif isinstance(node, ast.Return) and node.value is not None:
        yield "dropped return", ast.Return(value=ast.Constant(None))
    elif (
        isinstance(node, ast.Constant)
        and type(node.value) in (int, float)
        and not isinstance(node.value, bool)
    ):
        v = node.value
        yield "changed constant", ast.Constant(v + 1 if type(v) is int else v * 2 or 1.0)
    elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call | ast.Await):
        yield "dropped call", ast.Pass()
    if isinstance(node, ast.If | ast.While | ast.IfExp) and not (
        isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not)
    ):
        yield "negated condition", ("test", ast.UnaryOp(op=ast.Not(), operand=node.test))
    if (
        isinstance(node, ast.Call)
        and len(node.args) == 1
        and not node.keywords
        and not isinstance(node.args[0], ast.Starred)
        and not (isinstance(node.func, ast.Name) and node.func.id in _KEEP_CALLS)
    ):
        yield "dropped call", node.args[0]
    if (
        isinstance(node, ast.Call)
        and len(node.args) >= 2
        and not any(isinstance(a, ast.Starred) for a in node.args[:2])
    ) and ast.dump(node.args[0]) != ast.dump(node.args[1]):
        args = [node.args[1], node.args[0], *node.args[2:]]
        yield "swapped arguments", ast.Call(func=node.func, args=args, keywords=node.keywords)
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in names:
        others = [n for n in names if n != node.id and n not in ("self", "cls")]
        if others and node.id not in ("self", "cls"):
            # a neighbour in the function, not always the first: deterministic per site
            pick = others[(node.lineno + node.col_offset) % len(others)]
            yield "wrong variable", ast.Name(id=pick, ctx=ast.Load())


def _offsets(source: bytes) -> list[int]:
    starts = [0]
    for line in source.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return starts


def _replace_node(tree: ast.Module, target: ast.AST, new: ast.AST) -> ast.Module:
    """A copy of `tree` with `target` (found by identity in the original) replaced."""
    path: list[tuple[ast.AST, str, int | None]] = []

    def find(node: ast.AST, trail: list) -> bool:
        if node is target:
            path.extend(trail)
            return True
        for name, value in ast.iter_fields(node):
            if isinstance(value, ast.AST):
                if find(value, [*trail, (node, name, None)]):
                    return True
            elif isinstance(value, list):
                for i, item in enumerate(value):
                    if isinstance(item, ast.AST) and find(item, [*trail, (node, name, i)]):
                        return True
        return False

    find(tree, [])
    clone = copy.deepcopy(tree)
    node: ast.AST = clone
    for _, name, index in path[:-1]:
        value = getattr(node, name)
        node = value[index] if index is not None else value
    _, name, index = path[-1]
    if index is None:
        setattr(node, name, new)
    else:
        getattr(node, name)[index] = new
    return clone


def find_mutations(
    root: Path, rel: str, covered: dict[int, list[str]], *, check: bool = True
) -> list[Mutation]:
    """Mutations of the functions in `rel` whose first line is in `covered`
    (line -> covering tests). With `check=False` the parse check is left to
    `Mutation.checked()` (a big file has thousands of candidates)."""
    source = (root / rel).read_bytes()
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    offsets = _offsets(source)
    finder = _Functions()
    finder.visit(tree)
    found: list[Mutation] = []
    for qualname, fn in finder.found:
        lines = [fn.lineno] + [d.lineno for d in fn.decorator_list]
        tests = next((covered[n] for n in lines if n in covered), None)
        if not tests:
            continue
        params = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]
        own = list(_own_nodes(fn))
        local = [n.id for n in own if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
        names = list(dict.fromkeys(params + local))
        # Two mutations that give the same function (`x[1]` as an index or as a
        # constant) are one bug: keyed by the mutated function's text.
        fn_start = offsets[fn.lineno - 1] + fn.col_offset
        fn_end = offsets[fn.end_lineno - 1] + fn.end_col_offset  # type: ignore[operator]
        seen: set[bytes] = set()
        for node in own:
            if not hasattr(node, "end_lineno") or node.end_lineno is None:
                continue
            for kind, new in _variants(node, names):
                target = node
                if isinstance(new, tuple):  # (field, replacement): a child of the node
                    target, new = getattr(node, new[0]), new[1]
                m = _mutation(
                    source, offsets, tree, target, new, kind, rel, qualname, check=check, fn=fn
                )
                if m is None:
                    continue
                key = source[fn_start : m.start] + m.new.encode() + source[m.end : fn_end]
                if key not in seen:
                    seen.add(key)
                    m.tests = tests
                    found.append(m)
    return found


def _mutation(
    source: bytes,
    offsets: list[int],
    tree: ast.Module,
    node: ast.AST,
    new: ast.AST,
    kind: str,
    rel: str,
    qualname: str,
    *,
    check: bool = True,
    fn: ast.FunctionDef | ast.AsyncFunctionDef | None = None,
) -> Mutation | None:
    start = offsets[node.lineno - 1] + node.col_offset  # type: ignore[attr-defined]
    end = offsets[node.end_lineno - 1] + node.end_col_offset  # type: ignore[attr-defined]
    old = source[start:end].decode("utf-8", errors="replace")
    try:
        text = ast.unparse(ast.fix_missing_locations(new))
    except Exception:
        return None
    if text == old or "\n" in text and not isinstance(new, ast.Pass):
        return None
    m = Mutation(
        path=rel,
        function=qualname,
        kind=kind,
        line=node.lineno,  # type: ignore[attr-defined]
        start=start,
        end=end,
        old=old,
        new=text,
        pending=(source, tree, node, new, fn),
    )
    return m if not check or m.checked() else None


def _confirm(
    source: bytes,
    tree: ast.Module,
    node: ast.AST,
    new: ast.AST,
    start: int,
    end: int,
    text: str,
    fn: ast.FunctionDef | ast.AsyncFunctionDef | None = None,
) -> str | None:
    """`text` or `(text)`, whichever parses to `tree` with `node` replaced by `new`.

    With `fn` (the function holding `node`) only that function's lines are parsed,
    dedented: a fraction of the cost on a big module. Where they cannot be cut out
    cleanly (a string literal's lines less indented than the `def`), the whole file."""
    if fn is not None:
        found = _confirm_in_function(source, node, new, start, end, text, fn)
        if found is not False:
            return found  # type: ignore[return-value]
    expected = ast.dump(_replace_node(tree, node, new))
    for candidate in (text, f"({text})"):
        mutated = source[:start] + candidate.encode() + source[end:]
        try:
            if ast.dump(ast.parse(mutated)) == expected:
                return candidate
        except (SyntaxError, ValueError):
            continue
    return None


def _confirm_in_function(
    source: bytes,
    node: ast.AST,
    new: ast.AST,
    start: int,
    end: int,
    text: str,
    fn: ast.FunctionDef | ast.AsyncFunctionDef,
) -> str | None | bool:
    """`_confirm` on the function's own lines; False when they cannot be cut out."""
    offsets = _offsets(source)
    first = offsets[fn.lineno - 1]
    end_line = fn.end_lineno or fn.lineno
    last = offsets[end_line] if end_line < len(offsets) else len(source)
    expected_fn = _replace_node(fn, node, new)  # type: ignore[arg-type]
    expected_fn.decorator_list = []  # type: ignore[attr-defined]  # the cut starts at `def`
    expected = ast.dump(ast.Module(body=[expected_fn], type_ignores=[]))  # type: ignore[list-item]
    indent = b" " * fn.col_offset
    for candidate in (text, f"({text})"):
        lines = (source[first:start] + candidate.encode() + source[end:last]).splitlines(True)
        if any(ln.strip() and not ln.startswith(indent) for ln in lines):
            return False
        cut = b"".join(ln[fn.col_offset :] if ln.strip() else ln for ln in lines)
        try:
            if ast.dump(ast.parse(cut)) == expected:
                return candidate
        except (SyntaxError, ValueError):
            continue
    return None


# ---------------------------------------------------------------- the bug as written

# `ast.unparse` writes the mutated node in its own style: `'*'` for a source's `"*"`,
# `a * b` for `a*b`, one line for a call spread over several. A policy could learn to
# spot the broken line by its style, which real bugs never show, so the parts of the
# node a mutation keeps are copied from the source as it wrote them (`restyle`).
try:
    _Unparser: type | None = ast._Unparser  # type: ignore[attr-defined]
except AttributeError:  # not in every Python: then the text stays unparse's
    _Unparser = None


if _Unparser is not None:

    class _Restyler(_Unparser):  # type: ignore[misc, valid-type]
        """`ast.unparse` that writes a node found in `keep` (by identity) as that text,
        parenthesised where the unparser would parenthesise the node there."""

        def __init__(
            self, keep: dict[int, str] | None = None, quote: str = "'", **kw: object
        ) -> None:
            super().__init__(**kw)  # an f-string's parts: a nested one, no `keep`
            self._keep = keep or {}
            self._quote = quote  # for a new string: the quotes the source uses

        def _write_constant(self, value: object) -> None:
            text = repr(value)
            if (
                isinstance(value, str)
                and self._quote == '"'
                and text[0] == "'"
                and '"' not in value
            ):
                self.write(f'"{text[1:-1]}"')
            else:
                super()._write_constant(value)

        def traverse(self, node: object) -> None:
            text = None if isinstance(node, list) else self._keep.get(id(node))
            if text is None:
                super().traverse(node)
                return
            mark, keep, self._keep = len(self._source), self._keep, {}
            super().traverse(node)  # only to learn whether the place needs parentheses
            made = "".join(self._source[mark:])
            del self._source[mark:]
            self._keep = keep
            wrap = made.startswith("(") and made == f"({ast.unparse(node)})"  # type: ignore[arg-type]
            self.write(f"({text})" if wrap else text)


def _node_at(tree: ast.AST, offsets: list[int], start: int, end: int, kind: type) -> ast.AST | None:
    for node in ast.walk(tree):
        if isinstance(node, kind) and getattr(node, "end_lineno", None) is not None:
            a = offsets[node.lineno - 1] + node.col_offset  # type: ignore[attr-defined]
            b = offsets[node.end_lineno - 1] + node.end_col_offset  # type: ignore[attr-defined]
            if (a, b) == (start, end):
                return node
    return None


def restyle(source: bytes, start: int, end: int, new: str) -> str:
    """``new`` (the text replacing ``source[start:end]``, as `ast.unparse` wrote it)
    with every subexpression it shares with the replaced node written as the source
    writes it. Returns ``new`` itself unless the result parses to the same module."""
    if _Unparser is None:
        return new
    try:
        tree = ast.parse(source)
        offsets = _offsets(source)
        mutated = ast.dump(ast.parse(source[:start] + new.encode() + source[end:]))
    except (SyntaxError, ValueError):
        return new
    for kind, mode in ((ast.expr, "eval"), (ast.stmt, "exec")):
        old = _node_at(tree, offsets, start, end, kind)
        if old is None:
            continue
        try:
            parsed = ast.parse(new, mode=mode)
        except SyntaxError:
            continue
        body = parsed.body
        if isinstance(body, list):
            if len(body) != 1:
                continue
            body = body[0]
        written: dict[str, str] = {}  # a subtree's dump -> the source's text of it
        for n in ast.walk(old):
            if isinstance(n, ast.expr | ast.keyword) and getattr(n, "end_lineno", None):
                a = offsets[n.lineno - 1] + n.col_offset
                b = offsets[n.end_lineno - 1] + n.end_col_offset  # type: ignore[operator]
                written.setdefault(ast.dump(n), source[a:b].decode("utf-8", errors="replace"))
        keep = {id(n): written[d] for n in ast.walk(body) if (d := ast.dump(n)) in written}
        written_old = source[start:end]
        counted = written_old if b'"' in written_old or b"'" in written_old else source
        quote = '"' if counted.count(b'"') > counted.count(b"'") else "'"
        try:
            text = _Restyler(keep, quote).visit(body)
            same = ast.dump(ast.parse(source[:start] + text.encode() + source[end:])) == mutated
        except Exception:  # the unparser's private API: any surprise keeps `new`
            return new
        return text if same else new
    return new


# ---------------------------------------------------------------- mining


def mine(repo: Path, *, out: Path, limit: int = 10, config: MineConfig | None = None) -> list[Path]:
    """Mine up to `limit` verified tasks from `repo` into `out`; returns the task folders.

    TaskError (one line) when the repository has no passing tests or no covered code.
    """
    cfg = config or MineConfig()
    if limit != cfg.limit:
        cfg = MineConfig(**{**cfg.__dict__, "limit": limit})
    repo = Path(repo).resolve()
    if not repo.is_dir():
        raise TaskError(f"{repo}: not a folder")
    return asyncio.run(_mine(repo, Path(out), cfg))


@dataclass(kw_only=True)
class Baseline:
    """The test suite's run on the unchanged code, with what each passing test covers."""

    tests: list[str]  # the test files run
    passing: set[str]  # node ids
    failing_files: set[str]  # test files with a test that fails anyway
    covered: dict[str, dict[int, list[str]]]  # source file -> function line -> tests
    exitstatus: int
    output: str  # pytest's output tail
    durations: dict[str, float] = field(default_factory=dict)  # node id -> seconds, traced


async def baseline(scratch: Path, cfg: MineConfig, plugin_dir: Path, label: str) -> Baseline:
    """Run the suite once with call tracing; TaskError (one line) when nothing passes."""
    tests = list(cfg.tests) or discover_tests(scratch)
    if not tests:
        raise TaskError(f"{label}: no test files found (test_*.py or *_test.py)")
    # the whole suite, traced: far longer than one test's budget on a big suite
    base = await _run_tests(
        scratch, cfg, tests, trace=True, plugin_dir=plugin_dir, budget_s=SUITE_TIMEOUT_S
    )
    passing = {k for k, v in base["outcomes"].items() if v["outcome"] == "passed"}
    output = base.get("output", "")
    if not passing:
        error = TaskError(f"{label}: no passing tests to mine from (pytest: {output[-200:]!r})")
        error.output = output  # type: ignore[attr-defined]  # the whole tail, for a reason
        raise error
    covered: dict[str, dict[int, list[str]]] = {}
    for test, hits in base["hits"].items():
        if test not in passing:
            continue
        for rel, line in hits:
            if not _is_test_file(rel):
                covered.setdefault(rel, {}).setdefault(line, []).append(test)
    return Baseline(
        tests=tests,
        passing=passing,
        failing_files={
            k.split("::")[0] for k, v in base["outcomes"].items() if v["outcome"] == "failed"
        },
        covered=covered,
        exitstatus=int(base.get("exitstatus", -1)),
        output=output,
        durations={k: float(v) for k, v in base.get("durations", {}).items()},
    )


def candidates(scratch: Path, cfg: MineConfig, base: Baseline) -> list[Mutation]:
    """Every mutation of every function a passing test covers, in `cfg.sources`."""
    sources = set(_py_files(scratch, cfg.sources or ["."]))
    return [
        m
        for rel in sorted(base.covered)
        if rel in sources
        for m in find_mutations(scratch, rel, base.covered[rel], check=False)
    ]


def setup_scratch(repo: Path, tmpdir: Path, cfg: MineConfig) -> tuple[Path, Path]:
    """A scratch copy of `repo` under `tmpdir` with the tracing plugin; (scratch, plugin_dir)."""
    scratch = tmpdir / "repo"
    shutil.copytree(
        repo, scratch, symlinks=True, ignore=shutil.ignore_patterns(*SKIP_NAMES, "*.pyc")
    )
    plugin_dir = scratch / STATE_DIR / "plugin"  # inside: the sandbox sees only the workspace
    plugin_dir.mkdir(parents=True)
    (plugin_dir / "_oc_mine_plugin.py").write_text(_PLUGIN)
    if cfg.prepare is not None:
        cfg.prepare(scratch)
    return scratch, plugin_dir


async def _mine(repo: Path, out: Path, cfg: MineConfig) -> list[Path]:
    with tempfile.TemporaryDirectory(prefix="oc-mine-") as tmp:
        scratch, plugin_dir = setup_scratch(repo, Path(tmp), cfg)
        base = await baseline(scratch, cfg, plugin_dir, str(repo))
        return await mine_from(scratch, plugin_dir, base, cfg, out, repo.name, label=str(repo))


async def mine_from(
    scratch: Path,
    plugin_dir: Path,
    base: Baseline,
    cfg: MineConfig,
    out: Path,
    name: str,
    *,
    label: str,
) -> list[Path]:
    """Mutate, keep the bugs the tests catch, write and verify one task folder each."""
    found = candidates(scratch, cfg, base)
    if not found:
        raise TaskError(f"{label}: no function covered by a passing test to mutate")
    ordered = _interleave(found, random.Random(cfg.seed))
    kept: list[Path] = []
    per_function: dict[tuple[str, str], int] = {}
    attempts = 0
    for m in ordered:
        if len(kept) >= cfg.limit or attempts >= cfg.max_attempts:
            break
        key = (m.path, m.function)
        if per_function.get(key, 0) >= cfg.per_function or not m.checked():
            continue
        attempts += 1
        task = await _try(scratch, m, cfg, plugin_dir, base, out, name)
        if task is not None:
            kept.append(task)
            per_function[key] = per_function.get(key, 0) + 1
    return kept


def _interleave(candidates: list[Mutation], rng: random.Random) -> list[Mutation]:
    """Shuffled, with the kinds taking turns so a suite is not all one kind of bug."""
    by_kind: dict[str, list[Mutation]] = {}
    for m in candidates:
        by_kind.setdefault(m.kind, []).append(m)
    for ms in by_kind.values():
        rng.shuffle(ms)
    kinds = sorted(by_kind)
    rng.shuffle(kinds)
    ordered: list[Mutation] = []
    while any(by_kind.values()):
        for k in kinds:
            if by_kind[k]:
                ordered.append(by_kind[k].pop())
    return ordered


@dataclass(kw_only=True)
class Trial:
    """A bug that the tests catch: the failing tests (node id -> error) and their files."""

    mutations: list[Mutation]
    failed: dict[str, dict]
    files: list[str]

    @property
    def first(self) -> tuple[str, str]:
        test, error = next(iter(sorted(self.failed.items())))
        return test, error.get("error", "")


def apply_all(mutations: list[Mutation], scratch: Path) -> dict[Path, bytes]:
    """Write the mutations into `scratch`; returns the original bytes of each file.
    Mutations of one file are applied from its end, so their offsets stay valid."""
    originals: dict[Path, bytes] = {}
    for m in sorted(mutations, key=lambda m: (m.path, -m.start)):
        target = scratch / m.path
        if target not in originals:
            originals[target] = target.read_bytes()
        target.write_bytes(m.apply(target.read_bytes()))
    return originals


# Covering test ids beyond this many characters run as their files instead (a heavily
# parametrized suite's ids overflow the command line: "Argument list too long").
MAX_ARGV_CHARS = 64_000


def trial_budget(tests: list[str], cfg: MineConfig, durations: dict[str, float] | None) -> float:
    """Seconds a mutant's run of `tests` may take: `TRIAL_SLACK` times their time on the
    unchanged code plus `TRIAL_FLOOR_S`, capped at one test's budget; the cap when a
    test's time is unknown."""
    cap = cfg.test_timeout_s + 30
    if not durations or any(t not in durations for t in tests):
        return cap
    return min(cap, TRIAL_FLOOR_S + TRIAL_SLACK * sum(durations[t] for t in tests))


async def trial(
    scratch: Path,
    mutations: list[Mutation],
    cfg: MineConfig,
    plugin_dir: Path,
    base: Baseline,
) -> Trial | None:
    """Apply the mutations, run the tests that cover them, restore the files. A Trial
    when some test fails in its call (not collection, not an internal error) and no
    failing file is one whose tests fail anyway; else None. A run that takes far longer
    than the tests did on the unchanged code is cut short (`trial_budget`): None."""
    tests = sorted({t for m in mutations for t in m.tests})
    budget = trial_budget(tests, cfg, base.durations)
    if sum(len(t) + 1 for t in tests) > MAX_ARGV_CHARS:  # the kernel's argument limit
        tests = sorted({t.split("::")[0] for t in tests})  # their files: a superset
    originals = apply_all(mutations, scratch)
    try:
        result = await _run_tests(
            scratch, cfg, tests, trace=False, plugin_dir=plugin_dir, budget_s=budget
        )
    finally:
        for path, data in originals.items():
            path.write_bytes(data)
    failed = {
        k: v
        for k, v in result["outcomes"].items()
        if v["outcome"] == "failed" and v.get("when") == "call"
    }
    if not failed or result["exitstatus"] not in (1,):
        return None  # nothing failed, or pytest itself broke (collection, internal error)
    files = sorted({k.split("::")[0] for k in failed})
    if set(files) & base.failing_files:
        return None  # a file with tests that fail anyway is no verify command
    return Trial(mutations=list(mutations), failed=failed, files=files)


async def _try(
    scratch: Path,
    m: Mutation,
    cfg: MineConfig,
    plugin_dir: Path,
    base: Baseline,
    out: Path,
    name: str,
) -> Path | None:
    found = await trial(scratch, [m], cfg, plugin_dir, base)
    if found is None:
        return None
    target = scratch / m.path
    original = target.read_bytes()
    try:
        broken_file = m.apply(original)
        target.write_bytes(broken_file)
        digest = hashlib.sha1(f"{m.path}:{m.start}:{m.new}".encode()).hexdigest()[:8]
        task_id = f"{_slug(name)}-{_slug(m.function)}-{digest}"
        first, error = found.first
        verify = verify_cmd(cfg, found.files)
        query = _query(first, error, len(found.failed), cfg.env_prefix)
        broken = pack_dir(scratch)
        dest = write_task(
            out / task_id,
            query=query,
            verify=verify,
            repo_tar=broken,
            timeout_s=900,
            command_timeout_s=cfg.test_timeout_s,
            protect=found.files,
            source=cfg.source or f"mined:{name}",
        )
        solution = {
            "answer": "",
            "kind": m.kind,
            "line": m.line,
            "function": m.function,
            "edits": [
                {
                    "path": m.path,
                    "old": _lines_around(broken_file, m.start, m.start + len(m.new.encode())),
                    "new": _lines_around(original, m.start, m.end),
                }
            ],
        }
        (dest / "solution.json").write_text(json.dumps(solution, indent=1) + "\n")
    finally:
        target.write_bytes(original)
    if await _verified(dest, m, cfg):
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    return None


async def _verified(task_dir: Path, m: Mutation, cfg: MineConfig) -> bool:
    """In the sandbox: verify fails on the task as written, and passes once the
    original code is restored."""

    task = load_task(task_dir)
    sandbox = SandboxConfig(timeout_s=cfg.test_timeout_s + 30)
    with tempfile.TemporaryDirectory(prefix="oc-mine-verify-") as tmp:
        ws = Path(tmp) / "repo"
        safe_extract(task.repo_tar, ws)
        before = await run_command(task.verify, cwd=ws, sandbox=sandbox)
        if before.exit_code == 0:
            return False
        text = (ws / m.path).read_bytes()
        (ws / m.path).write_bytes(
            text[: m.start] + m.old.encode() + text[m.start + len(m.new.encode()) :]
        )
        after = await run_command(task.verify, cwd=ws, sandbox=sandbox)
        return after.exit_code == 0


def _query(test: str, error: str, n_failed: int, env_prefix: str) -> str:
    lines = [ln for ln in error.splitlines() if ln.startswith("E ")]
    if not lines:
        lines = [ln for ln in error.strip().splitlines() if ln.strip()][-3:]
    excerpt = "\n".join(ln if len(ln) <= 200 else ln[:200] + " …" for ln in lines[:6])
    more = f" ({n_failed} tests fail in all)" if n_failed > 1 else ""
    prefix = f"{env_prefix} " if env_prefix else ""
    return (
        f"`{test}` started failing{more}. `{prefix}python -m pytest {shlex.quote(test)}` gives:\n\n"
        f"```\n{excerpt}\n```\n\n"
        "The test is right; find the bug in the code and fix it."
    )


def _lines_around(source: bytes, start: int, end: int) -> str:
    """The whole lines of `source` that hold the byte range [start, end)."""
    first = source.rfind(b"\n", 0, start) + 1
    last = source.find(b"\n", end)
    return source[first : len(source) if last < 0 else last].decode("utf-8", errors="replace")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()[:40] or "x"


# ---------------------------------------------------------------- PyPI libraries


PYPI_LIBRARIES: dict[str, dict[str, str]] = {
    # name -> where its tests are and what they need; all pure Python, pytest only
    "inflection": {"tests": "test_inflection.py"},
    "toolz": {"tests": "toolz/tests/test_itertoolz.py toolz/tests/test_dicttoolz.py"},
    "more-itertools": {"tests": "tests/test_recipes.py"},
    "six": {"tests": "test_six.py"},
}


def fetch_sdist(name: str, dest: Path) -> Path:
    """Download and unpack `name`'s sdist (PyPI, `pip download --no-binary PROJECT
    --no-deps`: the project as source, its build backend as a wheel where one exists,
    since some backends, e.g. uv_build, cannot be built from source here)."""
    dest.mkdir(parents=True, exist_ok=True)
    dl = dest / "download"
    project = re.split(r"[\s\[=<>!~;]", name.strip(), maxsplit=1)[0]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-binary",
            project,
            "--no-deps",
            name,
            "-d",
            str(dl),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    archives = sorted(dl.glob("*.tar.gz")) if dl.is_dir() else []
    if proc.returncode != 0 or not archives:
        raise TaskError(f"pip download {name} failed: {' '.join(proc.stderr.split())[-300:]}")

    safe_extract(archives[0], dest / "src")
    roots = [p for p in (dest / "src").iterdir() if p.is_dir()]
    if len(roots) != 1:
        raise TaskError(f"{archives[0].name}: expected one top-level folder")
    return roots[0]


def mine_pypi(name: str, *, out: Path, limit: int = 5, seed: int = 0) -> list[Path]:
    """Mine tasks from a PyPI library's sdist and its own test suite."""
    info = PYPI_LIBRARIES.get(name, {})
    with tempfile.TemporaryDirectory(prefix="oc-pypi-") as tmp:
        root = fetch_sdist(name, Path(tmp))
        prefix = "PYTHONPATH=src" if (root / "src").is_dir() else ""
        cfg = MineConfig(
            limit=limit,
            seed=seed,
            tests=tuple(info.get("tests", "").split()),
            source=f"mined:pypi:{root.name}",
            env_prefix=prefix,
        )
        return mine(root, out=out, limit=limit, config=cfg)


# ---------------------------------------------------------------- this repository (`own`)

# Fast, pure test files of this repository and what they test (no engines, no servers).
OWN_TARGETS: tuple[tuple[str, str], ...] = (
    ("agent/xmlcalls.py", "tests/agent/test_xmlcalls.py"),
    ("tools/output.py", "tests/tools/test_tools_output.py"),
    ("tools/workspace.py", "tests/tools/test_tools_workspace.py"),
    ("tools/files.py", "tests/tools/test_tools_files.py"),
)
OWN_LIMIT = 8
OWN_VERSION = 1
_PACKAGES = ("agent", "tools", "index", "server", "clients", "training", "kernels")

_OWN_CONFTEST = """# Added by opencomposer's task miner: import `opencomposer.*` from this checkout,
# not from wherever the package is installed.
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "_oc_shim"))
"""


def project_root() -> Path:
    return Path(__file__).resolve().parent.parent


def prepare_own(scratch: Path) -> None:
    """Make `import opencomposer.X` resolve to the copy's folder X: a shim package of
    relative symlinks and a root conftest.py that puts it first on sys.path."""
    shim = scratch / "_oc_shim" / "opencomposer"
    shim.mkdir(parents=True, exist_ok=True)
    for pkg in _PACKAGES:
        if (scratch / pkg).is_dir():
            (shim / pkg).symlink_to(Path("..", "..", pkg))
    conftest = scratch / "conftest.py"
    existing = conftest.read_text() if conftest.exists() else ""
    conftest.write_text(_OWN_CONFTEST + ("\n" + existing if existing else ""))


def _own_files(root: Path) -> list[str]:
    """The checkout's files as git sees them: tracked plus untracked-but-not-ignored."""
    git = Git.find(root)
    try:
        out = git.run("ls-files", "--cached", "--others", "--exclude-standard") if git else None
    except GitError:
        out = None
    listed = out.stdout.decode().split() if out is not None and out.returncode == 0 else []
    keep = (*_PACKAGES, "tests")
    return sorted({f for f in listed if f.split("/")[0] in keep or f == "pyproject.toml"})


def own_suite_dir() -> Path:
    from opencomposer.agent.traces import home

    root = project_root()
    h = hashlib.sha1(f"v{OWN_VERSION}".encode())
    for src, test in OWN_TARGETS:
        for rel in (src, test):
            p = root / rel
            h.update(rel.encode() + (p.read_bytes() if p.exists() else b""))
    return home() / "suites" / f"own-{h.hexdigest()[:12]}"


def ensure_own_suite(limit: int = OWN_LIMIT, *, refresh: bool = False) -> list[Path]:
    """The `own` suite's task folders, mined from this checkout (git-visible files)
    on first use — about 15 minutes on a busy 2-core machine — and cached under a
    hash of the mined files. A suite mined from an older version of those files is
    still a valid suite (each task carries its own repo.tar), so the newest one is
    used unless `refresh` asks for the current code."""
    d = own_suite_dir()
    if not refresh and not (d / ".complete").exists():
        older = sorted(
            (p for p in d.parent.glob("own-*") if (p / ".complete").exists()),
            key=lambda p: (p / ".complete").stat().st_mtime,
        )
        if older:
            d = older[-1]
    if not (d / ".complete").exists():
        root = project_root()
        with tempfile.TemporaryDirectory(prefix="oc-own-") as tmp:
            snap = Path(tmp) / "opencomposer"
            files = _own_files(root)
            if not files:
                raise TaskError(
                    f"{root}: not a git checkout of opencomposer; cannot mine the own suite"
                )
            for rel in files:
                if (root / rel).is_file():
                    (snap / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(root / rel, snap / rel)
            targets = [
                (s, t) for s, t in OWN_TARGETS if (snap / s).exists() and (snap / t).exists()
            ]
            if not targets:
                raise TaskError("none of the own suite's target tests exist in this checkout")
            d.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=d.name + ".", dir=d.parent))
            cfg = MineConfig(
                limit=limit,
                sources=tuple(s for s, _ in targets),
                tests=tuple(t for _, t in targets),
                source="mined:own",
                prepare=prepare_own,
                test_timeout_s=120,
            )
            mine(snap, out=staging, limit=limit, config=cfg)
            (staging / ".complete").write_text("")
            shutil.rmtree(d, ignore_errors=True)
            try:
                os.replace(staging, d)
            except OSError:
                shutil.rmtree(staging, ignore_errors=True)
    return sorted(p for p in d.iterdir() if (p / "task.toml").is_file())


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Mine bug-injection tasks from a repository.")
    ap.add_argument("repo", nargs="?", type=Path)
    ap.add_argument("--pypi", help="mine a PyPI library's sdist instead")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=10)
    ns = ap.parse_args()
    try:
        made = (
            mine_pypi(ns.pypi, out=ns.out, limit=ns.limit)
            if ns.pypi
            else mine(ns.repo, out=ns.out, limit=ns.limit)
        )
    except TaskError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    for p in made:
        print(p)
