"""Where a failing test went: the workspace's functions the failing run called.

When a test fails on its own assertion (a wrong value came back), its traceback names
no function of the code, only the test's line. The repair (`agent/repair.py`) then has
nothing to look at but what the session happened to read. This module runs the failing
command once more, read-only, with a profiler that Python loads at start-up
(`sitecustomize`, put first on `PYTHONPATH`), and reads back which functions of the
workspace each test function called, in the order of their last call. The functions
the failing test called last are where its wrong value most likely came from.

Code that was installed into the workspace (an in-tree virtualenv's site-packages, a
`pip install --target` folder: `installed_folders`) is a dependency's, not the
project's: its calls are not recorded, so a test that runs through a library still
names the project's functions it called.

Only calls made while a test function runs count, and of those not the `__repr__`
(`__str__`, `__format__`) a test runner calls to show a value in an assertion's
message: the test's own code calls them only when it means to test them. A command
that sets `PYTHONPATH` itself (`PYTHONPATH=src pytest`) gets the tracer's folder put
first in the value it sets. A program that is not Python leaves no record: then
nothing is found, and the repair looks where it did before.

The same run records the lines of the workspace's code that ran (`executed_lines`):
an edit of a line the failing run never reached leaves that run as it was, so the
repair tries the edits of lines it reached first.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple

from opencomposer.agent import repair

# Functions of the code taken from a run, at most (the last called first). Run with
# `pytest -x` on 24 held-out corpus tasks, the failing test called the function with
# the bug in 22; it was among the 6 called last in 16, among the 10 called last in 22
# (called first: 16 and 18).
MOST = 10
# How deep `installed_folders` looks for install folders (an in-tree
# `.venv/lib/python3.X/site-packages` is 4 down), and how many folders it reads at most.
INSTALLED_DEPTH = 4
# Line events of the workspace's code a traced run follows, at most (each costs about
# what a call of a small Python function does); past them, a process stops following
# lines, and its record says so, so that no line counts as not run.
LINE_EVENTS = 5_000_000
INSTALLED_SCAN = 20_000
_NOT_SCANNED = frozenset({".git", ".hg", ".svn", "node_modules", "__pycache__"})

_TRACER = """\
# Written by opencomposer for one run: which functions of a workspace each test called,
# and which lines of its code ran.
import atexit, json, os, re, sys, threading

_ROOT = os.environ.get("OPENCOMPOSER_TRACE_ROOT", "")
_OUT = os.environ.get("OPENCOMPOSER_TRACE_OUT", "")
# the workspace's install folders (site-packages in it, a --target folder): not its code
_SKIP = tuple(_ROOT + p for p in json.loads(os.environ.get("OPENCOMPOSER_TRACE_SKIP") or "[]"))
_TEST = re.compile(__TEST_FILE__)
_tests = {}  # (file, first line, name) of a test function -> {(file, line, name): last call}
_all = {}  # every call of the workspace's code, in or out of a test
_stack = []  # (key, frame) of the test functions running
_n = [0]
_SHOW = ("__repr__", "__str__", "__format__")
_kind = {}  # file -> is it a test file
_lines = {}  # file of the workspace's code (not a test's) -> the lines it ran
_left = [__LINE_EVENTS__]  # line events still followed: a hot loop stops the following


def _is_test(path):
    k = _kind.get(path)
    if k is None:
        k = _kind[path] = bool(_TEST.search(path[len(_ROOT):]))
    return k


def _profile(frame, event, arg):
    if event == "call":
        code = frame.f_code
        path = code.co_filename
        if not path.startswith(_ROOT) or path.startswith(_SKIP) or code.co_name.startswith("<"):
            return
        if _is_test(path):
            if code.co_name.startswith("test"):
                key = (path, code.co_firstlineno, code.co_name)
                _tests[key] = {}  # its last run only
                _stack.append((key, frame))
            return
        if code.co_name in _SHOW:
            caller = frame.f_back
            if caller is None or not caller.f_code.co_filename.startswith(_ROOT):
                return  # a test runner showing a value (an assertion's message)
        _n[0] += 1
        where = (path, code.co_firstlineno, code.co_name)
        _all[where] = _n[0]
        if _stack:
            _tests[_stack[-1][0]][where] = _n[0]
    elif event == "return" and _stack and _stack[-1][1] is frame:
        _stack.pop()


def _trace(frame, event, arg):
    path = frame.f_code.co_filename
    if not path.startswith(_ROOT) or path.startswith(_SKIP) or _is_test(path):
        return None  # its lines are not followed
    if _left[0] <= 0:
        return None
    _lines.setdefault(path, set()).add(frame.f_lineno)
    return _line


def _line(frame, event, arg):
    if event == "line":
        _left[0] -= 1
        if _left[0] <= 0:  # too many to follow: the record will say so
            sys.settrace(None)
            threading.settrace(None)
            return None
        _lines[frame.f_code.co_filename].add(frame.f_lineno)
    return _line


def _dump():
    sys.setprofile(None)
    threading.setprofile(None)
    sys.settrace(None)
    threading.settrace(None)
    out = {
        "tests": [[*k, [[*w, s] for w, s in calls.items()]] for k, calls in _tests.items()],
        "all": [[*w, s] for w, s in _all.items()],
        "lines": {path: sorted(lines) for path, lines in _lines.items()},
        "lines_cut": _left[0] <= 0,
    }
    with open(os.path.join(_OUT, "%d.json" % os.getpid()), "w") as fh:
        json.dump(out, fh)


if _ROOT and _OUT and os.path.isdir(_OUT):
    atexit.register(_dump)
    threading.setprofile(_profile)
    sys.setprofile(_profile)
    threading.settrace(_trace)
    sys.settrace(_trace)
"""

# {"tests": [[file, first line, name, [[file, first line, name, last call], ...]], ...],
#  "all": [[file, first line, name, last call], ...],
#  "lines": {file: [line, ...]}}: what a traced run leaves (lines 1-based)
Trace = dict[str, Any]

_TEST_NAME = re.compile(r"(?:^|\s)([\w./-]+\.py)::(?:\w+::)*(\w+)", re.MULTILINE)


def tracer_source() -> str:
    """The `sitecustomize.py` a traced run loads (its test-file rule is the repair's),
    following `LINE_EVENTS` line events of the workspace's code at most."""
    return _TRACER.replace("__TEST_FILE__", repr(repair._TEST_FILE.pattern)).replace(
        "__LINE_EVENTS__", str(int(LINE_EVENTS))
    )


def trace_prefix(folder: str, root: str, skip: tuple[str, ...] = ()) -> str:
    """Shell lines that make the Python programs of a command put their calls in
    `folder`, which must hold `tracer_source()` as `sitecustomize.py`; calls of code
    under `skip` (folders relative to `root`, `installed_folders`) are not recorded."""
    root = root.rstrip("/") + "/"
    return (
        f"export OPENCOMPOSER_TRACE_ROOT={_quote(root)} OPENCOMPOSER_TRACE_OUT={_quote(folder)}"
        f" OPENCOMPOSER_TRACE_SKIP={_quote(json.dumps(list(skip)))}\n"
        f'export PYTHONPATH={_quote(folder)}"${{PYTHONPATH:+:$PYTHONPATH}}"\n'
    )


_SETS_PATH = re.compile(r"(^|[\s;&|(])((?:export\s+)?PYTHONPATH=)")


def with_tracer_path(command: str, folder: str) -> str:
    """`command` with `folder` put first in each value it gives `PYTHONPATH` itself
    (`PYTHONPATH=src pytest`, `export PYTHONPATH=…`), where it would drop the one
    `trace_prefix` exports."""
    return _SETS_PATH.sub(lambda m: f"{m.group(1)}{m.group(2)}{_quote(folder)}:", command)


def installed_folders(root: str | Path) -> tuple[str, ...]:
    """The folders in the workspace `root` that packages were installed into, relative,
    each ending in "/": a folder named site-packages or dist-packages (an in-tree
    virtualenv's), or one that holds a `NAME-VERSION.dist-info` folder, the record pip
    leaves of each package it installs (`pip install --target`). What is in them is a
    dependency's code, never the project's. Looks `INSTALLED_DEPTH` folders down, past
    version control and `node_modules`, at `INSTALLED_SCAN` folders at most."""
    base = str(root).rstrip("/") + "/"
    found: list[str] = []
    todo: list[tuple[str, int]] = [(base, 0)]
    scanned = 0
    while todo and scanned < INSTALLED_SCAN:
        folder, level = todo.pop()
        scanned += 1
        try:
            with os.scandir(folder) as it:
                subs = [e for e in it if e.is_dir(follow_symlinks=False)]
        except OSError:
            continue
        name = os.path.basename(folder.rstrip("/"))
        if level and (
            name in ("site-packages", "dist-packages")
            or any(e.name.endswith(".dist-info") for e in subs)
        ):
            found.append(folder[len(base) :].rstrip("/") + "/")
            continue
        if level < INSTALLED_DEPTH:
            todo += [(e.path, level + 1) for e in subs if e.name not in _NOT_SCANNED]
    return tuple(sorted(found))


def is_installed(path: str, folders: tuple[str, ...]) -> bool:
    """Whether the workspace path `path` lies in one of `installed_folders`."""
    return path.startswith(folders)


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


def read_trace(folder: Path) -> Trace:
    """The records of a traced run's Python processes, merged (the last to finish
    wins a test both ran); empty when none left one."""
    merged: Trace = {"tests": [], "all": []}
    lines: dict[str, set[int]] = {}
    files = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime)
    for f in files:
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            continue  # a process killed while it wrote
        if isinstance(data, dict):
            merged["tests"] += data.get("tests") or []
            merged["all"] += data.get("all") or []
            if data.get("lines_cut"):
                merged["lines_cut"] = True
            ran = data.get("lines")
            for path, got in ran.items() if isinstance(ran, dict) else ():
                lines.setdefault(str(path), set()).update(n for n in got if isinstance(n, int))
    if lines:
        merged["lines"] = {path: sorted(got) for path, got in lines.items()}
    return merged


def executed_lines(trace: Trace, root: str) -> dict[str, frozenset[int]] | None:
    """The 0-based lines of each workspace file (path relative to `root`) the traced
    run ran, tests left out; None when the record cannot tell: it holds no lines, a
    process stopped following them (`LINE_EVENTS`), or the file of a function the run
    called has none from its `def` on (another tracer, pytest-cov's or a debugger's,
    took the place of this one), so that code it shows as not run may have run."""
    ran = trace.get("lines")
    if not isinstance(ran, dict) or not ran or trace.get("lines_cut"):
        return None
    prefix = root.rstrip("/") + "/"
    last = {path: max(got, default=0) for path, got in ran.items()}
    for path, first, *_ in trace.get("all") or []:
        if last.get(path, 0) < int(first):  # no line of the function's file from its def on
            return None
    return {
        path[len(prefix) :]: frozenset(n - 1 for n in got if n > 0)
        for path, got in ran.items()
        if path.startswith(prefix)
    }


def called_lines(trace: Trace, output: str, root: str) -> list[tuple[str, int]]:
    """(path relative to `root`, 0-based line of the def) of the workspace functions
    the failing test called, the last called first, `MOST` at most.

    The failing test is the test function around the innermost test-file frame of the
    run's output (`path:line`), else the test a `path::name` in it names; failing both,
    the functions the whole run called last."""
    prefix = root.rstrip("/") + "/"
    tests = [t for t in trace.get("tests", []) if len(t) == 4]
    chosen = None
    frames = [(p, n) for p, n in repair.traceback_lines(output, root) if repair.is_test_file(p)]
    for path, line in frames:
        around = [t for t in tests if t[0] == prefix + path and int(t[1]) <= line + 1]
        if around:
            chosen = max(around, key=lambda t: int(t[1]))[3]
            break
    if chosen is None:
        for m in _TEST_NAME.finditer(output):
            path, name = m.group(1), m.group(2)
            named = [t for t in tests if t[0] == prefix + path and t[2] == name]
            if named:
                chosen = named[-1][3]
                break
    calls = chosen if chosen is not None else trace.get("all", [])
    out: list[tuple[str, int]] = []
    for path, line, _name, _seq in sorted(calls, key=lambda c: -int(c[3])):
        where = (str(path)[len(prefix) :], int(line) - 1)
        if str(path).startswith(prefix) and where not in out:
            out.append(where)
        if len(out) >= MOST:
            break
    return out


class Failing(NamedTuple):
    """What a traced run of the failing command shows (`failing_run`)."""

    called: list[tuple[str, int]]  # `called_lines`
    executed: dict[str, frozenset[int]] | None  # `executed_lines`


async def failing_run(
    command: str,
    root: str,
    output: str,
    run: Callable[[str, Path], Awaitable[object]],
    skip: tuple[str, ...] = (),
) -> Failing:
    """Run `command` once more with the tracer (`run(traced command, scratch folder)`,
    which must let the command write that folder and nothing else), recording nothing
    of code under `skip` (`installed_folders`), and read its record: nothing called and
    no lines known when the run left none."""
    folder = Path(tempfile.mkdtemp(prefix="opencomposer-trace-"))
    try:
        (folder / "sitecustomize.py").write_text(tracer_source())
        traced = trace_prefix(str(folder), root, skip) + with_tracer_path(command, str(folder))
        await run(traced, folder)
        trace = read_trace(folder)
        return Failing(called_lines(trace, output, root), executed_lines(trace, root))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# -- what else the failing test's files test -----------------------------------------

_SHELL = re.compile(r"[|&;<>()`$]")
_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)
# pytest options that choose or stop the tests run, with the value some of them take
_CHOOSE = {"-k": True, "-m": True, "--deselect": True, "-x": False, "--exitfirst": False}
_CHOOSE_PREFIX = ("-k", "--deselect=", "--maxfail", "--lf", "--last-failed", "--sw", "--stepwise")


def guard_command(command: str, output: str) -> str | None:
    """A pytest command that runs every test of the files the failing command ran
    tests from: `command` with its choice of tests (`-k`, `::name`, `-x`, …) taken
    out, and, when it names no path, the files of the tests its output says failed.
    An edit that makes the failing test pass must not fail another test of them (one
    that `return 0` in place of a result fixes in passing). None for a command that is
    not a plain pytest run (a pipe, `&&`, a variable)."""
    split = _pytest_words(command)
    if split is None:
        return None
    head, rest = split
    kept, paths = _unchosen(rest)
    if not paths:
        failed = [m.split("::", 1)[0] for m in _FAILED.findall(output)]
        if not failed:
            return None
        kept += list(dict.fromkeys(failed))
    extra = ["-p", "no:cacheprovider", "-rfE", "-q"]
    return shlex.join([*head, *kept, *extra])


def narrowed_command(command: str, output: str) -> str | None:
    """A pytest command that runs only the tests `command` failed, by the node ids its
    output's summary gives: `command` with its choice of tests (paths, `-k`, `-x`, …)
    taken out and those ids put in. Passing them is what a fix must do first; None when
    `command` is not a plain pytest run or its output names no failed test."""
    split = _pytest_words(command)
    failed = sorted(failed_tests(output))
    if split is None or not failed:
        return None
    head, rest = split
    kept, paths = _unchosen(rest)
    return shlex.join([*head, *(w for w in kept if w not in paths), *failed])


def ran_no_test(command: str, exit_code: object) -> bool:
    """Whether a run of `command` that exited with `exit_code` was a pytest run of no
    test at all: 4, a usage error (a path that is not there, an unknown option), or 5,
    no test collected (a `-k` that matches none). Such a run checks no code."""
    return exit_code in (4, 5) and _pytest_words(command) is not None


def _pytest_words(command: str) -> tuple[list[str], list[str]] | None:
    """(the words up to `pytest`, those after), for a command with no shell syntax."""
    if _SHELL.search(command):
        return None
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    at = next((i for i, w in enumerate(words) if w == "pytest" or w.endswith("/pytest")), None)
    if at is None:
        return None
    return words[: at + 1], words[at + 1 :]


def _unchosen(rest: list[str]) -> tuple[list[str], list[str]]:
    """(pytest's arguments `rest` without the options that choose or stop the tests
    run, the paths among them with any `::name` taken off; each path once)."""
    kept: list[str] = []
    paths: list[str] = []
    skip = False
    for w in rest:
        if skip:
            skip = False
            continue
        if w in _CHOOSE:
            skip = _CHOOSE[w]
            continue
        if w.startswith(_CHOOSE_PREFIX) or (w.startswith("-m") and len(w) > 2 and w[2] != "-"):
            continue
        if not w.startswith("-") and ("/" in w or "::" in w or w.endswith(".py") or w == "."):
            w = w.split("::", 1)[0]  # a path (an option's value is kept as it is)
            if w in paths:
                continue
            paths.append(w)
        kept.append(w)
    return kept, paths


def failed_tests(output: str) -> frozenset[str]:
    """The node ids a pytest run's summary says failed or erred."""
    return frozenset(_FAILED.findall(output))
