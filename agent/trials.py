"""Many candidate edits tried against a pytest command in one sandboxed process.

A repair (`agent/repair.py`) proposes dozens of small edits, and a trial run of each
starts Python, imports pytest and its plugins and collects the tests anew: about a
second and a half here before the one test runs in a fifth of a second. This module
pays the start once. One Python process, in the sandbox like any trial run, imports
pytest and the plugins the environment declares, then forks a child per candidate.
The child sees the candidate's texts in place of its files through an import hook
(the workspace stays as it is, read-only) and runs `pytest.main` with the command's
own arguments; its exit status is the candidate's result.

A forked run is a filter, not a verdict. The first child runs the code as it is, and
it must fail as the command failed, or nothing the process says is used. A candidate
whose files no child imported (a test that runs the code in a subprocess, or reads
it as data) is marked unknown. The session makes a real trial run of each candidate
that passed here, or that is unknown, before it keeps one (`Session._repair`), so a
forked run can only make a repair try fewer candidates that fail, never keep one that
fails. Only a plain pytest command (no pipe, no `&&`, no variable but leading
assignments) is run this way (`plan`). A repair gives it the failing command narrowed
to the tests that failed (`localize.narrowed_command`), which a fix must pass first;
the real trial run has the command as the model wrote it.
"""

from __future__ import annotations

import json
import shlex
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from opencomposer.agent import localize

_DRIVER = """\
# Written by opencomposer for one run: candidate edits tried against a pytest command,
# each in a forked child that sees the candidate's texts in place of its files.
import importlib.machinery, importlib.metadata, json, os, signal, sys, time

_SPEC = json.load(open(sys.argv[1]))
_OUT = sys.argv[2]
_HERE = os.path.dirname(os.path.abspath(__file__))
# the module search path the command's own pytest would have
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
if _SPEC["module"]:
    sys.path.insert(0, os.getcwd())
# compiled modules (pytest's rewritten tests among them) are kept in the scratch
# folder for the children after the first: none of them is a candidate's file, which
# is compiled from its text every time
sys.dont_write_bytecode = False
sys.pycache_prefix = os.path.join(_OUT, "pycache")

import pytest  # noqa: E402

# what every child would otherwise read from disk again: the plugins' modules, and
# the list of installed distributions pluggy reads their entry points from
_dists = list(importlib.metadata.distributions())
for _d in _dists:
    for _ep in _d.entry_points:
        if _ep.group == "pytest11":
            try:
                __import__(_ep.module)
            except BaseException:
                pass
_scan = importlib.metadata.distributions
importlib.metadata.distributions = lambda **kw: iter(_dists) if not kw else _scan(**kw)


class _Overlay:
    def __init__(self, files):
        self.files = files
        self.loaded = set()

    def find_spec(self, name, path=None, target=None):
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or not spec.origin:
            return None
        origin = os.path.realpath(spec.origin)
        if origin not in self.files:
            return None
        spec.loader = _Loader(self, name, spec.origin, origin)
        return spec


class _Loader(importlib.machinery.SourceFileLoader):
    def __init__(self, overlay, name, path, real):
        super().__init__(name, path)
        self.overlay, self.real = overlay, real

    def get_code(self, fullname):
        self.overlay.loaded.add(self.real)
        return compile(self.overlay.files[self.real], self.path, "exec", dont_inherit=True)

    def get_source(self, fullname):
        return self.overlay.files[self.real]


def _child(files):
    os.setpgid(0, 0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    overlay = _Overlay(files)
    sys.meta_path.insert(0, overlay)
    try:
        # the plugins were imported before pytest could mark them for rewriting
        quiet = ["-W", "ignore::pytest.PytestAssertRewriteWarning"]
        code = int(pytest.main(quiet + list(_SPEC["args"])))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        code = 1
    if set(files) - overlay.loaded:
        code = 100  # the run never read the candidate's code: it says nothing of it
    os._exit(min(code, 100))


def _main():
    jobs = [None] + list(_SPEC["candidates"])  # None: the code as it is, first
    each, at_once, stop = _SPEC["each_s"], max(1, _SPEC["at_once"]), _SPEC["stop_after"]
    out = open(os.path.join(_OUT, "results.jsonl"), "w", buffering=1)
    running = {}  # pid -> (index, started)
    nxt, passed = 0, 0
    while nxt < len(jobs) or running:
        alone = nxt == 0 or any(i == 0 for i, _ in running.values())  # the control first
        while nxt < len(jobs) and len(running) < (1 if alone else at_once):
            files = jobs[nxt] or {}
            pid = os.fork()
            if pid == 0:
                _child(files)
            running[pid] = (nxt, time.monotonic())
            nxt += 1
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            for p, (i, t0) in list(running.items()):
                if now - t0 > each:
                    try:
                        os.killpg(p, signal.SIGKILL)
                    except OSError:
                        pass
            time.sleep(0.005)
            continue
        index, t0 = running.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        out.write(json.dumps([index - 1, code, round(time.monotonic() - t0, 3)]) + "\\n")
        if index == 0 and code not in (1, 2):
            break  # the code as it is must fail as tests fail: 1, or 2 (collection)
        passed += code == 0
        if passed >= stop:
            nxt = len(jobs)
    for p in running:
        try:
            os.killpg(p, signal.SIGKILL)
        except OSError:
            pass


_main()
"""


@dataclass(frozen=True)
class Plan:
    """How a plain pytest command is run forked: `env` (its leading assignments), the
    Python to start, whether it ran `python -m pytest` (the working folder comes first
    on the module search path), and pytest's arguments."""

    env: tuple[str, ...]
    python: str
    module: bool
    args: tuple[str, ...]


def plan(command: str) -> Plan | None:
    """`command` as a forked run, or None when it is not a plain pytest command:
    `[NAME=value ...] (python|python3) -m pytest ARGS` or `[NAME=value ...] pytest ARGS`,
    with no shell syntax beyond its words."""
    if localize._SHELL.search(command):
        return None
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    env: list[str] = []
    while words and "=" in words[0] and words[0].split("=", 1)[0].isidentifier():
        env.append(words.pop(0))
    if not words:
        return None
    name = words[0].rsplit("/", 1)[-1]
    if name in ("pytest", "py.test"):
        return Plan(tuple(env), "python", False, tuple(words[1:]))
    if name.startswith("python") and words[1:3] == ["-m", "pytest"]:
        return Plan(tuple(env), words[0], True, tuple(words[3:]))
    return None


# a candidate's result: True passed, False failed, None not known (not run, or its files
# were never imported)
Verdict = bool | None


async def forked(
    command: str,
    root: str,
    candidates: Sequence[dict[str, str]],
    run: Callable[[str, Path], Awaitable[object]],
    *,
    each_s: float,
    at_once: int = 2,
    stop_after: int = 4,
) -> list[Verdict] | None:
    """Each of `candidates` ({path in the workspace: text}) tried against `command`
    in one forked run (`run(shell command, scratch folder)`, which must let it write
    that folder and nothing else), in order, `at_once` side by side, each within
    `each_s` seconds, until `stop_after` have passed. None when the command is not a
    plain pytest run (`plan`), or the run did not fail on the code as it is."""
    p = plan(command)
    if p is None:
        return None
    folder = Path(tempfile.mkdtemp(prefix="opencomposer-trials-"))
    base = Path(root).resolve()
    try:
        spec = {
            "module": p.module,
            "args": list(p.args),
            "each_s": each_s,
            "at_once": at_once,
            "stop_after": stop_after,
            "candidates": [
                {str((base / path).resolve()): text for path, text in c.items()} for c in candidates
            ],
        }
        (folder / "driver.py").write_text(_DRIVER)
        (folder / "spec.json").write_text(json.dumps(spec))
        line = shlex.join(
            [*p.env, p.python, str(folder / "driver.py"), str(folder / "spec.json"), str(folder)]
        )
        await run(line, folder)
        return _read(folder / "results.jsonl", len(candidates))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _read(path: Path, n: int) -> list[Verdict] | None:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    out: list[Verdict] = [None] * n
    control = None
    for line in lines:
        try:
            index, code, _ = json.loads(line)
        except ValueError:
            continue  # the last line of a run cut short
        if index < 0:
            control = code
        elif 0 <= index < n:
            out[index] = True if code == 0 else None if code == 100 else False
    if control not in (1, 2):
        return None  # the code as it is did not fail here as a command's tests fail
    return out
