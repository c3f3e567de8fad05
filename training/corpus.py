"""A corpus of bug-injection tasks mined from many real projects.

    opencomposer tasks build-corpus --manifest configs/corpus.toml --out DIR [--jobs N] [--projects a,b]
        [--earlier docs/corpus/report.json]
    opencomposer tasks export DIR --out TASKS [--split heldout] [--query mixed]

The manifest (`configs/corpus.toml`) lists the projects, each a PyPI sdist pinned
as `name==version` or a git repository at a commit, each in one split (`train` or
`heldout`: the split is by project, so a held-out project is never trained on).

Building a project (`build_project`), in a scratch folder:

1. Fetch it (`pip download --no-binary :all: --no-deps`, or `git clone` + checkout).
2. Make its tests runnable the way its own CI would, inside the workspace, so the
   sandbox at bench time has everything without a network:
   - `src/` layout: `src` goes on PYTHONPATH;
   - the project is installed (`pip install --target .deps`, its test extras and the
     manifest's `deps` with it) so that its dependencies and its own metadata
     (`importlib.metadata.version(...)`) are there; the installed copy of the
     project's own code is then deleted (its dist-info stays), so the tests import
     the source the agent edits, and distributions this interpreter already has
     (pytest, …) are deleted too. `.deps` goes on PYTHONPATH after `src`;
   - `addopts` (pytest.ini, setup.cfg, tox.ini, pyproject) that need plugins that
     are not installed: when the suite cannot run as configured, it is run with
     `-o addopts= -o required_plugins=` instead.
   Every test command (the miner's, the verify command, the command the query
   quotes) carries the same PYTHONPATH and pytest options.
3. Mine it (`training/mining.py`): single-site bugs of every kind, at most
   `per_function` per function, then a harder tier of two-site bugs (two bugs that
   each fail a test on their own, in different functions, together).
4. Verify every task from what is stored: the snapshot is unpacked once, each
   task's patch applied (verify must fail) and removed (verify must pass).

A project that cannot be used is skipped with a one-line reason (no tests, tests
that need the network, install failed, nothing to mutate, …) in the build report.

On disk::

    DIR/report.json, DIR/report.md       the build report: per project yield, time or reason
    DIR/projects/NAME/project.json       the project: source, split, test environment, stats
    DIR/projects/NAME/snapshot.tar       its workspace, stored once (pack_dir: deterministic)
    DIR/projects/NAME/tasks.jsonl        its tasks: patches against the snapshot + queries

A finished project (its `project.json`, for the same manifest entry) is not built
again, so an interrupted build resumes where it stopped. `export` writes plain
task folders (`task.toml` + `repo.tar` + `solution.json`) that `bench --tasks`
and the RL loop read.

Each task has three requests (`queries`): `test` quotes the failing test and its
error, `issue` describes the misbehaviour without naming the test, `oneline` is a
one-sentence request naming the test and the function, like the demo's. Export
picks one per task (`--query mixed`, deterministic per task id) or one for all.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import ctypes
import hashlib
import io
import json
import multiprocessing
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from opencomposer.tools.protocols import SandboxConfig
from opencomposer.training import mining
from opencomposer.training.env import run_command
from opencomposer.training.tasks import TaskError, pack_dir, safe_extract, write_task

BUILDER_VERSION = 3  # bump when a rebuild would give different tasks for the same entry
# 3: the broken node keeps the source's own writing (mining.restyle); a project built by
#    version 2 is brought up to date in place (`restyle_project`), not rebuilt
RESTYLED_FROM = 2
EXPORT_VERSION = 2  # bump when `export` writes different task folders from the same build

# Part credit: an episode that changes every broken line (the file still parsing) earns
# TOUCHED_WEIGHT of its reward without fixing the bug; verify earns the rest. GRPO then
# ranks the rollouts of a group that edits the right lines above those that edit others
# before any of them resolves the task. `resolved` is still verify's alone.
TOUCHED_WEIGHT = 0.2
DEPS_DIR = ".deps"
SPLITS = ("train", "heldout")
QUERY_KINDS = ("test", "issue", "oneline")
NEUTRAL_ADDOPTS = ("-o", "addopts=", "-o", "required_plugins=")
# A marker that a missing plugin registers (`no_cover`, pytest-cov's), met by a project
# whose `filterwarnings = error` turns pytest's unknown-mark warning into a failure.
UNKNOWN_MARKS = ("-W", "ignore::pytest.PytestUnknownMarkWarning")
# pytest plugins (by entry-point name) that a project's test extras install and that
# never judge its behaviour: coverage (a task's verify runs a few test files, where a
# `--cov-fail-under` threshold fails the run with every test passed) and linters run as
# test items (types, style, docs: a mutant that keeps them passes, and each run spends
# seconds on them), with pytest-enabler, which turns those on. Their options then
# count as foreign addopts and are taken out of the project's config.
CHECK_PLUGINS = (
    "pytest_cov",
    "enabler",
    "mypy",
    "ruff",
    "flake8",
    "flakes",
    "black",
    "isort",
    "pylint",
    "checkdocs",
)
# Plugins that would break tracing or determinism when a project's venv has them, and
# the checks above.
ALWAYS_ARGS = (
    "-p",
    "no:xdist",
    "-p",
    "no:randomly",
    *(arg for name in CHECK_PLUGINS for arg in ("-p", f"no:{name}")),
)
MAX_DEPS_MB = 100
# pytest refusing its configuration (options of a plugin that is not there, a
# required plugin), as opposed to tests that fail or do not import.
_CONFIG_ERROR = re.compile(
    r"unrecognized arguments|required plugins|ERROR: usage|error: argument|"
    r"INTERNALERROR|Unknown config option|PluginValidationError|ImportError while loading conftest",
    re.IGNORECASE,
)
_NETWORK = re.compile(
    r"Temporary failure in name resolution|Name or service not known|Network is unreachable"
    r"|nodename nor servname|Failed to establish a new connection|getaddrinfo failed"
    r"|No address associated with hostname",
    re.IGNORECASE,
)

_PROJECT_KEYS = frozenset(
    {
        "name",
        "pypi",
        "git",
        "commit",
        "split",
        "tests",
        "sources",
        "deps",
        "extras",
        "install",
        "limit",
        "test_timeout_s",
    }
)
_CORPUS_KEYS = frozenset(
    {"limit", "per_function", "max_attempts", "two_site", "seed", "test_timeout_s"}
)


class CorpusError(TaskError):
    """A manifest or corpus that cannot be used; the message is one line."""


# ---------------------------------------------------------------- the manifest


@dataclass(frozen=True, kw_only=True)
class ProjectSpec:
    name: str
    split: str
    pypi: str = ""  # name==version
    git: str = ""  # url or local path
    commit: str = ""
    tests: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()
    deps: tuple[str, ...] = ()  # extra requirements for the tests
    extras: tuple[str, ...] = ("test", "tests", "testing")
    install: bool = True
    limit: int | None = None
    test_timeout_s: float | None = None

    def key(self, settings: CorpusSettings, *, version: int = BUILDER_VERSION) -> str:
        """A hash of everything that decides what this entry builds."""
        data = json.dumps([version, self.__dict__, settings.__dict__], sort_keys=True)
        return hashlib.sha256(data.encode()).hexdigest()[:16]


@dataclass(frozen=True, kw_only=True)
class CorpusSettings:
    limit: int = 40  # single-site tasks per project
    per_function: int = 2
    max_attempts: int = 0  # mutations to try per project; 0: 5 x limit
    two_site: float = 0.2  # two-site tasks, as a share of the project's single-site ones
    seed: int = 0
    test_timeout_s: float = 120.0


@dataclass(frozen=True, kw_only=True)
class Manifest:
    path: Path
    sha256: str
    settings: CorpusSettings
    projects: list[ProjectSpec]


def load_manifest(path: Path | str) -> Manifest:
    """Read a corpus manifest; CorpusError (one line, naming the entry and key) if malformed."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        data = tomllib.loads(raw.decode("utf-8"))
    except OSError as e:
        raise CorpusError(f"{path}: cannot read: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise CorpusError(f"{path}: malformed TOML: {' '.join(str(e).split())}") from None
    unknown = sorted(set(data) - {"corpus", "project"})
    if unknown:
        raise CorpusError(f"{path}: unknown section {', '.join(unknown)}")
    corpus = data.get("corpus", {})
    if not isinstance(corpus, dict):
        raise CorpusError(f"{path}: [corpus] must be a table")
    bad = sorted(set(corpus) - _CORPUS_KEYS)
    if bad:
        raise CorpusError(f"{path}: [corpus]: unknown key {', '.join(bad)}")
    settings_kw: dict[str, Any] = {}
    for key, value in corpus.items():
        kind = float if key in ("two_site", "test_timeout_s") else int
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise CorpusError(f"{path}: [corpus] {key} must be a non-negative number")
        settings_kw[key] = kind(value)
    projects_raw = data.get("project", [])
    if not isinstance(projects_raw, list) or not projects_raw:
        raise CorpusError(f"{path}: no [[project]] entries")
    projects: list[ProjectSpec] = []
    seen: set[str] = set()
    for i, entry in enumerate(projects_raw, 1):
        spec = _project(entry, f"{path}: project {i}")
        if spec.name in seen:
            raise CorpusError(f"{path}: project {i}: name {spec.name!r} appears twice")
        seen.add(spec.name)
        projects.append(spec)
    return Manifest(
        path=path,
        sha256=hashlib.sha256(raw).hexdigest(),
        settings=CorpusSettings(**settings_kw),
        projects=projects,
    )


def _project(entry: Any, where: str) -> ProjectSpec:
    if not isinstance(entry, dict):
        raise CorpusError(f"{where}: must be a table")
    label = entry.get("name") or entry.get("pypi") or entry.get("git")
    if isinstance(label, str):
        where = f"{where} ({label})"
    bad = sorted(set(entry) - _PROJECT_KEYS)
    if bad:
        raise CorpusError(f"{where}: unknown key {', '.join(bad)}")

    def string(key: str) -> str:
        value = entry.get(key, "")
        if not isinstance(value, str):
            raise CorpusError(f"{where}: {key} must be a string")
        return value.strip()

    def strings(key: str, default: tuple[str, ...] = ()) -> tuple[str, ...]:
        value = entry.get(key, list(default))
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise CorpusError(f"{where}: {key} must be a list of strings")
        return tuple(value)

    pypi, git, commit = string("pypi"), string("git"), string("commit")
    if bool(pypi) == bool(git):
        raise CorpusError(f"{where}: give exactly one of pypi and git")
    if pypi and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!_-]+", pypi):
        raise CorpusError(f"{where}: pypi must pin one version, as name==version, got {pypi!r}")
    if git and not commit:
        raise CorpusError(f"{where}: git needs commit (a pinned revision)")
    if commit and not git:
        raise CorpusError(f"{where}: commit is only for git projects")
    split = string("split")
    if split not in SPLITS:
        raise CorpusError(f"{where}: split must be train or heldout, got {split!r}")
    name = string("name") or (
        pypi.split("==")[0] if pypi else Path(git.rstrip("/")).name.removesuffix(".git")
    )
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise CorpusError(f"{where}: name {name!r} must be letters, digits, '.', '_' or '-'")
    for key in ("tests", "sources"):
        for rel in strings(key):
            if rel.startswith("/") or ".." in Path(rel).parts:
                raise CorpusError(f"{where}: {key} must be paths inside the project")
    install = entry.get("install", True)
    if not isinstance(install, bool):
        raise CorpusError(f"{where}: install must be true or false")
    limit = entry.get("limit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise CorpusError(f"{where}: limit must be a positive integer")
    timeout = entry.get("test_timeout_s")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0
    ):
        raise CorpusError(f"{where}: test_timeout_s must be a positive number")
    return ProjectSpec(
        name=name,
        split=split,
        pypi=pypi,
        git=git,
        commit=commit,
        tests=strings("tests"),
        sources=strings("sources"),
        deps=strings("deps"),
        extras=strings("extras", ProjectSpec.extras),
        install=install,
        limit=limit,
        test_timeout_s=None if timeout is None else float(timeout),
    )


# ---------------------------------------------------------------- fetching


class Skip(Exception):
    """The project cannot be used; the message is the build report's one-line reason,
    `output` pytest's output tail when the reason came from a test run."""

    def __init__(self, reason: str, output: str = ""):
        super().__init__(reason)
        self.output = output


def fetch(spec: ProjectSpec, dest: Path) -> Path:
    """The project's source tree, unpacked under `dest`."""
    if spec.pypi:
        try:
            return mining.fetch_sdist(spec.pypi, dest)
        except TaskError as e:
            raise Skip(f"download failed: {e}") from None
        except subprocess.TimeoutExpired:
            raise Skip("download failed: pip download timed out") from None
    root = dest / "git"
    source = spec.git
    if Path(source).expanduser().is_dir():
        source = str(Path(source).expanduser().resolve())
    for cmd in (
        ["git", "clone", "--quiet", "--no-checkout", source, str(root)],
        ["git", "-C", str(root), "checkout", "--quiet", spec.commit],
    ):
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise Skip(f"git failed: {e}") from None
        if proc.returncode != 0:
            raise Skip(f"git {cmd[1] if cmd[1] != '-C' else cmd[3]} failed: {_line(proc.stderr)}")
    shutil.rmtree(root / ".git", ignore_errors=True)
    return root


def sample_fingerprints() -> set[str]:
    """Hashes of the demo's sample repository's files: the corpus must not contain it."""
    sample = mining.project_root() / "examples" / "sample_repo"
    return {
        hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sample.rglob("*.py")
        if p.is_file() and p.stat().st_size > 0 and p.name != "__init__.py"
    }


def _check_not_sample(root: Path) -> None:
    prints = sample_fingerprints()
    if not prints:
        return
    for p in root.rglob("*.py"):
        if p.is_file() and hashlib.sha256(p.read_bytes()).hexdigest() in prints:
            raise Skip(
                f"{p.relative_to(root)} is the demo's sample repository's; "
                "the corpus must never contain it"
            )


# ---------------------------------------------------------------- the test environment


@dataclass(kw_only=True)
class TestEnv:
    """How the project's tests run, inside its workspace."""

    pythonpath: list[str] = field(default_factory=list)  # workspace-relative
    pytest_args: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def env_prefix(self) -> str:
        parts = ["PYTHONDONTWRITEBYTECODE=1"]
        if self.pythonpath:
            parts.append("PYTHONPATH=" + ":".join(self.pythonpath))
        return " ".join(parts)

    def config(self, spec: ProjectSpec, settings: CorpusSettings, **kw: Any) -> mining.MineConfig:
        return mining.MineConfig(
            tests=spec.tests,
            sources=spec.sources,
            env_prefix=self.env_prefix,
            pytest_args=tuple(self.pytest_args),
            test_timeout_s=spec.test_timeout_s or settings.test_timeout_s,
            per_function=settings.per_function,
            source=_source(spec),
            **kw,
        )

    def command(self, args: Iterable[str]) -> str:
        """The command a person would type to run these tests (no -q, no plugin guards;
        no PYTHONPATH: the root conftest.py puts the paths on sys.path, `path_shim`)."""
        needed = self.pytest_args[len(ALWAYS_ARGS) :]
        quoted = " ".join(shlex.quote(a) for a in [*needed, *args])
        return f"python -m pytest {quoted}".rstrip()


def _source(spec: ProjectSpec) -> str:
    return f"pypi:{spec.pypi}" if spec.pypi else f"git:{spec.git}@{spec.commit[:12]}"


def _src_layout(root: Path) -> bool:
    src = root / "src"
    return src.is_dir() and any(
        (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py" for p in src.iterdir()
    )


def pip_install_target(
    target: Path, requirements: list[str], flags: Iterable[str] = (), *, timeout: float
) -> subprocess.CompletedProcess[str]:
    """`pip install --target TARGET` of `requirements`, quietly, without bytecode."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "--no-compile",
        "--no-warn-script-location",
        *flags,
        "--target",
        str(target),
        *requirements,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def install_deps(root: Path, spec: ProjectSpec, env: TestEnv) -> None:
    """`pip install --target .deps` the project with its test extras and the manifest's
    deps, then delete the installed copy of the project's own code and anything this
    interpreter already provides. A failure is a note; the tests may still run."""
    buildable = any((root / f).is_file() for f in ("pyproject.toml", "setup.py", "setup.cfg"))
    if not spec.install or not buildable:
        return
    had_build = (root / "build").exists()
    try:
        _install(root, spec, env)
    finally:
        if not had_build:  # pip's in-tree build folder: a second copy of the sources
            shutil.rmtree(root / "build", ignore_errors=True)


def _install(root: Path, spec: ProjectSpec, env: TestEnv) -> None:
    target = root / DEPS_DIR
    extras = f"[{','.join(spec.extras)}]" if spec.extras else ""
    wanted = [f"{root}{extras}", *spec.deps]
    groups = _dependency_groups(root)
    error = ""
    # Without build isolation first (a setuptools project then needs no download of
    # its build backend); with it when the backend is not installed here. A test
    # dependency group that cannot be resolved is dropped on the last try.
    tries = [(["--no-build-isolation"], groups), ([], groups)] + ([([], [])] if groups else [])
    for flags, extra in tries:
        shutil.rmtree(target, ignore_errors=True)
        try:
            proc = pip_install_target(target, [*wanted, *extra], flags, timeout=900)
        except subprocess.TimeoutExpired:
            error = "install timed out"
            continue
        if proc.returncode == 0:
            error = ""
            break
        error = f"install failed: {_line(proc.stderr)[-200:]}"
    if error:
        env.notes.append(error)
        shutil.rmtree(target, ignore_errors=True)
        return
    _prune_deps(target, _own_dist_names(target, root))
    if sum(f.stat().st_size for f in target.rglob("*") if f.is_file()) > MAX_DEPS_MB << 20:
        raise Skip(f"its dependencies take more than {MAX_DEPS_MB} MB")
    (target / ".gitignore").write_text("*\n")  # installed code: not the agent's to search
    env.pythonpath.append(DEPS_DIR)
    env.notes.append("installed into .deps")


MAX_AUTO_DEPS = 4  # missing test dependencies installed by name before giving up
# Import names whose distribution is named otherwise.
_DIST_OF_MODULE = {
    "yaml": "PyYAML",
    "dateutil": "python-dateutil",
    "bs4": "beautifulsoup4",
    "PIL": "pillow",
    "attr": "attrs",
    "sklearn": "scikit-learn",
    "dotenv": "python-dotenv",
    "jwt": "PyJWT",
    "magic": "python-magic",
    "Crypto": "pycryptodome",
    "OpenSSL": "pyOpenSSL",
    "lxml_html_clean": "lxml-html-clean",
}


def missing_module(reason: str) -> str:
    """The top-level module a 'test dependency is missing' skip names; "" otherwise."""
    m = re.search(
        r"a test dependency is missing: ModuleNotFoundError: No module named '([^']+)'", reason
    )
    return m.group(1).split(".")[0] if m else ""


def install_missing(module: str, roots: list[Path], env: TestEnv) -> bool:
    """Install the distribution that provides `module` (by its import name, or the
    alias table) into each root's `.deps`, adding only what is not there yet; False
    when it cannot be installed or the project has no `.deps` on its path."""
    if DEPS_DIR not in env.pythonpath or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", module):
        return False
    dist = _DIST_OF_MODULE.get(module, module)
    with tempfile.TemporaryDirectory(prefix="oc-dep-") as tmp:
        target = Path(tmp) / "t"
        try:
            proc = pip_install_target(target, [dist], timeout=600)
        except subprocess.TimeoutExpired:
            return False
        if proc.returncode != 0:
            return False
        _prune_deps(target, set())
        for root in roots:
            deps = root / DEPS_DIR
            for entry in target.iterdir():
                if (deps / entry.name).exists():
                    continue
                if entry.is_dir():
                    shutil.copytree(entry, deps / entry.name, symlinks=True)
                else:
                    shutil.copy2(entry, deps / entry.name)
    env.notes.append(f"installed the missing {dist}")
    return True


_SHIM_MARK = "# opencomposer: test environment"
_SHIM = """{mark}: the project's source and its installed dependencies first
# on sys.path, as in a development install, so `python -m pytest` works as it is.
import os as _os
import sys as _sys

for _p in reversed({paths!r}):
    _p = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), _p)
    if _p not in _sys.path:
        _sys.path.insert(0, _p)
"""


def path_shim(root: Path, pythonpath: list[str]) -> None:
    """Put `pythonpath` (workspace-relative) on sys.path from the root conftest.py
    (prepended to the project's own), so the tests run without PYTHONPATH too: an
    agent that runs plain `python -m pytest` sees what verify sees."""
    if not pythonpath:
        return
    conftest = root / "conftest.py"
    existing = conftest.read_text(encoding="utf-8") if conftest.is_file() else ""
    if existing.startswith(_SHIM_MARK):
        return
    shim = _SHIM.format(mark=_SHIM_MARK, paths=list(pythonpath))
    conftest.write_text(shim + ("\n" + existing if existing else ""), encoding="utf-8")


def _dependency_groups(root: Path) -> list[str]:
    """Requirements of the pyproject's test dependency groups (PEP 735), plain strings only."""
    try:
        data = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return []
    groups = data.get("dependency-groups", {})
    if not isinstance(groups, dict):
        return []
    found: list[str] = []
    for name in ("test", "tests", "testing"):
        found += [r for r in groups.get(name, []) if isinstance(r, str)]
    return found


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _own_dist_names(target: Path, root: Path) -> set[str]:
    """The project's own distribution name(s) among what pip installed."""
    names = set()
    for meta in target.glob("*.dist-info/METADATA"):
        text = meta.read_text(encoding="utf-8", errors="replace")
        m = re.search(r"^Name:\s*(\S+)", text, re.MULTILINE)
        direct = meta.parent / "direct_url.json"
        if m and direct.exists() and str(root) in direct.read_text(errors="replace"):
            names.add(_norm(m.group(1)))  # installed from the project's own folder
    return names


def _prune_deps(target: Path, own: set[str]) -> None:
    """Delete the project's own installed code (keeping its dist-info, for its
    metadata) and distributions this interpreter already has."""
    import importlib.metadata as md

    have = {_norm(d.metadata["Name"] or "") for d in md.distributions()}
    for info in sorted(target.glob("*.dist-info")):
        meta = info / "METADATA"
        text = meta.read_text(encoding="utf-8", errors="replace") if meta.exists() else ""
        m = re.search(r"^Name:\s*(\S+)", text, re.MULTILINE)
        name = _norm(m.group(1)) if m else ""
        if name in own or name in have:
            record = info / "RECORD"
            for line in record.read_text(errors="replace").splitlines() if record.exists() else []:
                rel = line.split(",")[0]
                p = (target / rel).resolve()
                if rel and target.resolve() in p.parents and info.resolve() not in p.parents:
                    p.unlink(missing_ok=True)
            if name in have:
                shutil.rmtree(info, ignore_errors=True)
    for d in sorted(target.rglob("*"), key=lambda p: -len(p.parts)):
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()
    shutil.rmtree(target / "bin", ignore_errors=True)


# ---------------------------------------------------------------- building one project


@dataclass(kw_only=True)
class Progress:
    name: str
    say: Callable[[str], None]
    every_s: float = 30.0
    _last: float = 0.0

    def __call__(self, text: str, *, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last >= self.every_s:
            self._last = now
            self.say(f"  {self.name}: {text}")


def build_project(
    spec: ProjectSpec,
    settings: CorpusSettings,
    out: Path,
    *,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Build one project into `out/projects/NAME/` (atomically) and return its record."""
    if _ending.is_set():  # a build worker told to end takes no more work
        raise SystemExit(1)
    t0 = time.monotonic()
    final = out / "projects" / spec.name
    staging = out / "projects" / f".{spec.name}.building"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    progress = Progress(
        name=spec.name, say=say or (lambda s: print(s, file=sys.stderr, flush=True))
    )
    record: dict[str, Any] = {
        "name": spec.name,
        "split": spec.split,
        "source": _source(spec),
        "key": spec.key(settings),
        "builder_version": BUILDER_VERSION,
        "always_args": list(ALWAYS_ARGS),
    }
    try:
        with tempfile.TemporaryDirectory(prefix=f"oc-corpus-{spec.name}-") as tmp:
            stats = asyncio.run(_build(spec, settings, Path(tmp), staging, progress))
        record.update(status="built", **stats)
    except Skip as e:
        record.update(status="skipped", reason=str(e), tasks=0)
        if missing_module(str(e)):  # the build tried to install it (`_build`): no retry
            record["deps_tried"] = True
        if _import_failure(str(e)):  # and to leave out the modules that do not import
            record["leave_out_tried"] = True
    except Exception as e:  # a builder bug or an environment failure: reported, retried next run
        record.update(status="error", reason=_line(f"{type(e).__name__}: {e}"), tasks=0)
    if record["status"] != "built":  # nothing half-made stays behind
        for name in ("snapshot.tar", "tasks.jsonl"):
            (staging / name).unlink(missing_ok=True)
    record["seconds"] = round(time.monotonic() - t0, 1)
    (staging / "project.json").write_text(json.dumps(record, indent=1) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    return record


async def _build(
    spec: ProjectSpec, settings: CorpusSettings, tmp: Path, staging: Path, progress: Progress
) -> dict[str, Any]:
    root = fetch(spec, tmp / "fetch")
    work = tmp / "work"
    shutil.copytree(
        root, work, symlinks=True, ignore=shutil.ignore_patterns(*mining.SKIP_NAMES, "*.pyc")
    )
    _check_not_sample(work)
    if not (spec.tests or mining.discover_tests(work)):
        raise Skip("no tests in the source (no test_*.py or *_test.py)")
    env = TestEnv(pytest_args=list(ALWAYS_ARGS))
    if _src_layout(work):
        env.pythonpath.append("src")
        env.notes.append("src layout")
    progress("installing", force=True)
    await asyncio.to_thread(install_deps, work, spec, env)
    path_shim(work, env.pythonpath)

    limit = spec.limit or settings.limit
    max_attempts = settings.max_attempts or 5 * limit
    work_tmp = tmp / "mine"
    work_tmp.mkdir()
    cfg = env.config(spec, settings, limit=limit, max_attempts=max_attempts, seed=settings.seed)
    scratch, plugin_dir = mining.setup_scratch(work, work_tmp, cfg)
    progress("running its tests", force=True)
    tried: set[str] = set()
    left_out: list[str] = []
    while True:
        try:
            base = await _baseline(scratch, cfg, plugin_dir, spec, env, work)
            break
        except Skip as e:
            module = missing_module(str(e))
            if module and module not in tried and len(tried) < MAX_AUTO_DEPS:
                tried.add(module)
                progress(f"installing the missing test dependency {module}", force=True)
                if await asyncio.to_thread(install_missing, module, [work, scratch], env):
                    continue
            # Test modules that cannot be imported here (a dependency no install
            # provides, test data the sdist lacks) are left out, once, and the rest mined.
            broken = [] if left_out else uncollectable(e.output, scratch)
            if not broken or len(broken) >= len(mining.discover_tests(scratch)):
                raise
            for rel in broken:
                (scratch / rel).unlink()
                (work / rel).unlink(missing_ok=True)
            left_out = broken
            progress(f"leaving out {len(broken)} test file(s) that do not import", force=True)
    if left_out:
        env.notes.append(
            f"left out {len(left_out)} test file(s) that do not import: {', '.join(left_out)}"[:200]
        )
    cfg = env.config(spec, settings, limit=limit, max_attempts=max_attempts, seed=settings.seed)
    found = mining.candidates(scratch, cfg, base)
    if not found:
        raise Skip("no function covered by a passing test to mutate")
    ordered = mining._interleave(found, random.Random(settings.seed))
    trials: list[mining.Trial] = []
    per_function: dict[tuple[str, str], int] = {}
    attempts = 0
    for m in ordered:
        if len(trials) >= limit or attempts >= max_attempts:
            break
        key = (m.path, m.function)
        if per_function.get(key, 0) >= settings.per_function or not m.checked():
            continue
        attempts += 1
        t = await mining.trial(scratch, [m], cfg, plugin_dir, base)
        if t is not None:
            trials.append(t)
            per_function[key] = per_function.get(key, 0) + 1
        progress(f"{attempts} mutations tried, {len(trials)} bugs caught")
    pairs = _pairs(trials, round(len(trials) * settings.two_site), settings.seed)
    for a, b in pairs:
        t = await mining.trial(scratch, a.mutations + b.mutations, cfg, plugin_dir, base)
        if t is not None:
            # Verify runs both bugs' failing files: fixing one site leaves the code as
            # the other's single-site bug, which fails a test there, so both fixes are needed.
            t.files = sorted(set(t.files) | set(a.files) | set(b.files))
            trials.append(t)
    if not trials:
        raise Skip(f"no mutation made a test fail ({attempts} tried)")

    snapshot = pack_dir(work)
    (staging / "snapshot.tar").write_bytes(snapshot)
    progress(f"verifying {len(trials)} tasks", force=True)
    rows = [_task_row(spec, env, t, cfg) for t in trials]
    verified, failing = await _verify_rows(rows, staging / "snapshot.tar", tmp / "verify", cfg)
    with (staging / "tasks.jsonl").open("w") as fh:
        for row in verified:
            fh.write(json.dumps(row) + "\n")
    kinds: dict[str, int] = {}
    for row in verified:
        kinds[row["kind"]] = kinds.get(row["kind"], 0) + 1
    if not verified:
        why = f": the unchanged snapshot fails its verify command: {failing}" if failing else ""
        raise Skip(f"none of {len(rows)} caught bugs verified from the snapshot{why}")
    return {
        "tasks": len(verified),
        "single": sum(1 for r in verified if len(r["edits"]) == 1),
        "two_site": sum(1 for r in verified if len(r["edits"]) > 1),
        "candidates": len(found),
        "attempts": attempts + len(pairs),
        "unverified": len(rows) - len(verified),
        "passing_tests": len(base.passing),
        "kinds": dict(sorted(kinds.items())),
        "env": {
            "pythonpath": env.pythonpath,
            "pytest_args": env.pytest_args,
            "verify_prefix": env.env_prefix,
        },
        "notes": env.notes,
        "snapshot_bytes": len(snapshot),
    }


async def _baseline(
    scratch: Path,
    cfg: mining.MineConfig,
    plugin_dir: Path,
    spec: ProjectSpec,
    env: TestEnv,
    work: Path,
) -> mining.Baseline:
    """The suite's first run; again with foreign addopts neutralised when it cannot run
    as configured. Skip (with the reason) when nothing passes either way."""
    try:
        return await mining.baseline(scratch, cfg, plugin_dir, spec.name)
    except TaskError as e:
        first = getattr(e, "output", "") or str(e)
    if not _CONFIG_ERROR.search(first):  # not the configuration: once more as it is
        try:
            return await mining.baseline(scratch, cfg, plugin_dir, spec.name)
        except TaskError as e:
            first = getattr(e, "output", "") or str(e)
            if not _CONFIG_ERROR.search(first):
                raise Skip(_why_no_tests(first, first, env), first) from None
    # Options of plugins that are not installed: removed from the project's config
    # (the rest kept), so plain `python -m pytest` works in the task's workspace too.
    known = await asyncio.to_thread(known_pytest_options, scratch, env.pythonpath)
    dropped = strip_foreign_addopts([scratch, work], known)
    if dropped:
        try:
            base = await mining.baseline(scratch, cfg, plugin_dir, spec.name)
        except TaskError:
            pass
        else:
            env.notes.append(f"addopts without {' '.join(dropped)}"[:200])
            return base
    extra: tuple[str, ...] = ()
    while True:
        args = (*cfg.pytest_args, *NEUTRAL_ADDOPTS, *extra)
        neutral = mining.MineConfig(**{**cfg.__dict__, "pytest_args": args})
        try:
            base = await mining.baseline(scratch, neutral, plugin_dir, spec.name)
            break
        except TaskError as e:
            output = getattr(e, "output", "") or str(e)
            if extra or "PytestUnknownMarkWarning" not in output:
                raise Skip(_why_no_tests(first, output, env), output) from None
            extra = UNKNOWN_MARKS
    env.pytest_args += [*NEUTRAL_ADDOPTS, *extra]
    env.notes.append(
        "addopts neutralised" + (", marks of missing plugins allowed" if extra else "")
    )
    return base


# Where pytest reads its settings, in its own order: (file, section).
_PYTEST_CONFIGS = (
    ("pytest.ini", "pytest"),
    (".pytest.ini", "pytest"),
    ("pyproject.toml", "tool.pytest.ini_options"),
    ("tox.ini", "pytest"),
    ("setup.cfg", "tool:pytest"),
)


def known_pytest_options(root: Path, pythonpath: list[str]) -> set[str]:
    """The command-line options this pytest accepts, with the plugins the project's
    environment provides (its `.deps`)."""
    env = {**os.environ, "PYTHONPATH": ":".join(str(root / p) for p in pythonpath)}
    with tempfile.TemporaryDirectory(prefix="oc-pytest-help-") as tmp:
        try:
            out = subprocess.run(
                [sys.executable, "-m", "pytest", "--help", *ALWAYS_ARGS],
                cwd=tmp,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return set()
    found = set()
    for line in out.splitlines():
        spec = line.strip().split("  ")[0]  # "-x, --exitfirst", "--maxfail=num", "-k EXPR"
        if spec.startswith("-"):
            found |= set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", spec))
    return found


def strip_foreign_addopts(roots: list[Path], known: set[str]) -> list[str]:
    """Remove from the project's pytest `addopts` the options this pytest does not
    know (plugins that are not installed: `--cov=…`, `--benchmark-…`), in each of
    `roots` (copies of one project), keeping the rest (`--doctest-modules`, …).
    Returns the options removed; [] when there was nothing to remove."""
    if not known:
        return []
    for name, section in _PYTEST_CONFIGS:
        path = roots[0] / name
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        span = _addopts_span(text, section, toml=name.endswith(".toml"))
        if span is None:
            if _has_section(text, section, toml=name.endswith(".toml")):
                return []  # pytest reads this file, and it has no addopts
            continue
        start, end, tokens = span
        keep, dropped = _filter_options(tokens, known)
        if not dropped:
            return []
        value = " ".join(shlex.quote(t) for t in keep)
        line = (
            f"addopts = {json.dumps(value)}\n" if name.endswith(".toml") else f"addopts = {value}\n"
        )
        new = text[:start] + line + text[end:]
        for root in roots:
            (root / name).write_text(new, encoding="utf-8")
        return dropped
    return []


def _has_section(text: str, section: str, *, toml: bool) -> bool:
    return re.search(rf"(?m)^\[{re.escape(section)}\]\s*$", text) is not None


def _addopts_span(text: str, section: str, *, toml: bool) -> tuple[int, int, list[str]] | None:
    """(start, end, tokens) of the `addopts` entry in `[section]`."""
    head = re.search(rf"(?m)^\[{re.escape(section)}\]\s*$", text)
    if head is None:
        return None
    nxt = re.search(r"(?m)^\[", text[head.end() :])
    body_end = head.end() + nxt.start() if nxt else len(text)
    m = re.search(r"(?m)^addopts\s*=", text[head.end() : body_end])
    if m is None:
        return None
    start = head.end() + m.start()
    lines = text[start:body_end].splitlines(keepends=True)
    taken = [lines[0]]
    if toml:
        value = lines[0].split("=", 1)[1].strip()
        if value.startswith("[") and "]" not in value:
            for ln in lines[1:]:
                taken.append(ln)
                if "]" in ln:
                    break
        try:
            parsed = tomllib.loads("v = " + "".join(taken).split("=", 1)[1])["v"]
        except (tomllib.TOMLDecodeError, IndexError):
            return None
        tokens = shlex.split(parsed) if isinstance(parsed, str) else [str(t) for t in parsed]
    else:
        for ln in lines[1:]:  # ini continuation lines are indented
            if ln.strip() and not ln[0].isspace():
                break
            taken.append(ln)
        raw = "".join(taken).split("=", 1)[1]
        raw = "\n".join(ln for ln in raw.splitlines() if not ln.strip().startswith(("#", ";")))
        try:
            tokens = shlex.split(raw)
        except ValueError:
            return None
    return start, start + len("".join(taken)), tokens


def _filter_options(tokens: list[str], known: set[str]) -> tuple[list[str], list[str]]:
    keep: list[str] = []
    dropped: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        name = tok.split("=", 1)[0]
        if (
            tok.startswith("-")
            and name not in known
            and not (len(name) > 2 and not name.startswith("--") and name[:2] in known)
        ):
            dropped.append(tok)
            # its value, when given as the next word
            if "=" not in tok and i + 1 < len(tokens) and not tokens[i + 1].startswith("-"):
                dropped.append(tokens[i + 1])
                i += 1
        else:
            keep.append(tok)
        i += 1
    return keep, dropped


# pytest's lines for a test module that failed to import: "ERROR collecting PATH" in
# the report, "ERROR PATH - Error: ..." in the short summary.
_COLLECT_ERROR = re.compile(r"^(?:_+ )?ERROR collecting (\S+\.py)|^ERROR (\S+\.py)(?: - |$)", re.M)


def uncollectable(output: str, root: Path) -> list[str]:
    """The test modules (not conftest.py) under `root` that pytest's `output` says
    could not be collected, workspace-relative, sorted."""
    found = {a or b for a, b in _COLLECT_ERROR.findall(output)}
    return sorted(
        rel
        for rel in found
        if mining._is_test_file(rel)
        and Path(rel).name != "conftest.py"
        and not Path(rel).is_absolute()
        and ".." not in Path(rel).parts
        and (root / rel).is_file()
    )


def _why_no_tests(as_configured: str, neutralised: str, env: TestEnv) -> str:
    """The one-line reason a suite had no passing test, from pytest's output as
    configured and with foreign addopts neutralised."""
    both = f"{as_configured}\n{neutralised}"
    if _NETWORK.search(both):
        return "tests need the network"
    failed_install = next((n for n in env.notes if n.startswith("install failed")), "")
    if failed_install:
        return failed_install
    m = re.search(r"(ModuleNotFoundError: No module named '[^']+')", both)
    if m:
        return f"a test dependency is missing: {m.group(1)}"
    if "no test files found" in both:
        return "no tests in the source"
    if "SystemExit" in neutralised:
        return "a test module exits while pytest imports it (e.g. unittest.main() unguarded)"
    m = re.search(r"ERROR collecting (\S+)", neutralised)
    if m:
        errors = [ln[1:].strip() for ln in neutralised.splitlines() if ln.startswith("E ")]
        return f"tests do not collect ({m.group(1)}): {errors[-1] if errors else 'error'}"[:200]
    internal = [ln for ln in neutralised.splitlines() if ln.startswith("INTERNALERROR>")]
    if internal:
        return f"pytest internal error: {_line(internal[-1].removeprefix('INTERNALERROR>'))}"[:200]
    lines = [ln.strip() for ln in neutralised.splitlines() if ln.strip()]
    return f"no passing tests: {_line(lines[-1]) if lines else 'pytest printed nothing'}"[:200]


def _pairs(
    trials: list[mining.Trial], n: int, seed: int
) -> list[tuple[mining.Trial, mining.Trial]]:
    """Up to `n` pairs of caught bugs in different functions (same file first)."""
    if n <= 0:
        return []
    rng = random.Random(seed + 1)
    singles = [t for t in trials if len(t.mutations) == 1]
    options = [
        (a, b)
        for i, a in enumerate(singles)
        for b in singles[i + 1 :]
        if (a.mutations[0].path, a.mutations[0].function)
        != (b.mutations[0].path, b.mutations[0].function)
    ]
    rng.shuffle(options)
    options.sort(key=lambda p: p[0].mutations[0].path != p[1].mutations[0].path)
    used: set[int] = set()
    chosen = []
    for a, b in options:
        if id(a) in used or id(b) in used:
            continue
        used |= {id(a), id(b)}
        chosen.append((a, b))
        if len(chosen) >= n:
            break
    return chosen


# ---------------------------------------------------------------- tasks as patches


def _task_row(
    spec: ProjectSpec, env: TestEnv, t: mining.Trial, cfg: mining.MineConfig
) -> dict[str, Any]:
    ms = sorted(t.mutations, key=lambda m: (m.path, m.start))
    digest = hashlib.sha1(
        "|".join(f"{m.path}:{m.start}:{m.end}:{m.new}" for m in ms).encode()
    ).hexdigest()[:8]
    task_id = f"{spec.name}-{mining._slug(ms[0].function)}-{digest}"
    test, error = t.first
    kind = ms[0].kind if len(ms) == 1 else "two-site: " + " + ".join(m.kind for m in ms)
    return {
        "id": task_id,
        "kind": kind,
        "functions": [m.function for m in ms],
        "edits": [
            {"path": m.path, "offset": m.start, "old": m.old, "new": m.new, "line": m.line}
            for m in ms
        ],
        "verify": mining.verify_cmd(cfg, t.files),
        "protect": t.files,
        "failing": sorted(t.failed),
        "queries": queries(spec, env, ms, test, error, len(t.failed)),
        "command_timeout_s": cfg.test_timeout_s,
    }


def queries(
    spec: ProjectSpec,
    env: TestEnv,
    mutations: list[mining.Mutation],
    test: str,
    error: str,
    n_failed: int,
) -> dict[str, str]:
    """The three requests for one task (see the module doc)."""
    excerpt = _excerpt(error)
    more = f" ({n_failed} tests fail in all)" if n_failed > 1 else ""
    test_q = (
        f"`{test}` started failing{more}. `{env.command([test])}` gives:\n\n"
        f"```\n{excerpt}\n```\n\n"
        "The test is right; find the bug in the code and fix it."
    )
    file, _, name = test.partition("::")
    func = name.rsplit("::", 1)[-1].split("[")[0]
    scrubbed = "\n".join(  # an issue's reporter does not know the test suite
        ln for ln in excerpt.splitlines() if file not in ln and not (func and func in ln)
    )
    public = [  # names a user would call: no _private part (dunder methods are public)
        m.function
        for m in mutations
        if not any(p.startswith("_") and not p.endswith("__") for p in m.function.split("."))
    ]
    subject = f"`{public[0]}` in {spec.name}" if public else spec.name
    raised = not excerpt.lstrip("E ").startswith(("assert", "AssertionError"))
    symptom = "fails with an error" if raised else "gives wrong results"
    pick = int(hashlib.sha1(f"{test}|{mutations[0].start}".encode()).hexdigest(), 16)
    issue_q = _ISSUE[pick % len(_ISSUE)].format(
        subject=subject, symptom=symptom, excerpt=scrubbed or excerpt
    )
    where = " and ".join(f"{m.function} in {m.path}" for m in mutations)
    short = func or test
    oneline_q = _ONELINE[pick % len(_ONELINE)].format(test=short, where=where)
    return {"test": test_q, "issue": issue_q, "oneline": oneline_q}


# Several phrasings, picked per task, so a policy does not learn one template.
_ISSUE = (
    "{subject} {symptom} since a recent change. What I see:\n\n```\n{excerpt}\n```\n\n"
    "Please find the cause and fix it, so the project's own test suite passes again.",
    "Bug report: {subject} {symptom}.\n\n```\n{excerpt}\n```\n\n"
    "It used to work. Can you track down the bug and fix it?",
    "Something broke: {subject} {symptom}. The output:\n\n```\n{excerpt}\n```\n\n"
    "Fix the code (not the tests).",
)
_ONELINE = (
    "The test {test} fails. Fix {where} so that it passes.",
    "{test} is failing; the bug is in {where}. Please fix it.",
    "Fix {where}: the test {test} fails.",
)


def _excerpt(error: str) -> str:
    lines = [ln for ln in error.splitlines() if ln.startswith("E ")]
    if not lines:
        lines = [ln for ln in error.strip().splitlines() if ln.strip()][-3:]
    return "\n".join(ln if len(ln) <= 200 else ln[:200] + " …" for ln in lines[:6])


def apply_edits(data: bytes, edits: list[dict[str, Any]]) -> bytes:
    """Apply one file's edits (`offset` into the snapshot's bytes, `old` -> `new`), from
    the end so the offsets stay valid. CorpusError when the snapshot does not match."""
    for e in sorted(edits, key=lambda e: -e["offset"]):
        old, new, start = e["old"].encode(), e["new"].encode(), e["offset"]
        if data[start : start + len(old)] != old:
            raise CorpusError(f"{e['path']}: patch does not match the snapshot at byte {start}")
        data = data[:start] + new + data[start + len(old) :]
    return data


# What `pip install` of a setuptools project leaves in its source tree.
_PIP_BUILD = re.compile(r"build/(lib|bdist\.|temp\.|lib\.)")


def patched_tar(snapshot: Path, edits: list[dict[str, Any]]) -> bytes:
    """The snapshot's tar with the edits applied: a task's `repo.tar`, deterministic."""
    by_path: dict[str, list[dict[str, Any]]] = {}
    for e in edits:
        by_path.setdefault(e["path"], []).append(e)
    buf = io.BytesIO()
    with (
        tarfile.open(snapshot) as src,
        tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as dst,
    ):
        for member in src.getmembers():
            if _PIP_BUILD.match(member.name):
                continue  # pip's in-tree build of the project: a second copy to grep
            if member.isreg():
                data = src.extractfile(member).read()  # type: ignore[union-attr]
                if member.name in by_path:
                    data = apply_edits(data, by_path.pop(member.name))
                    member.size = len(data)
                dst.addfile(member, io.BytesIO(data))
            else:
                dst.addfile(member)
    if by_path:
        raise CorpusError(f"patch names files not in the snapshot: {', '.join(sorted(by_path))}")
    return buf.getvalue()


async def _verify_rows(
    rows: list[dict[str, Any]], snapshot: Path, dest: Path, cfg: mining.MineConfig
) -> tuple[list[dict[str, Any]], str]:
    """The rows whose verify fails with the patch applied to the snapshot and passes on
    the snapshot itself, and, in one line, how the first verify that failed on the
    snapshot itself failed ("" when none did): why the build could not use its rows."""
    safe_extract(snapshot, dest)
    sandbox = SandboxConfig(timeout_s=cfg.test_timeout_s + 30, memory_mb=4096, max_processes=256)
    clean: dict[str, bool] = {}
    failing = ""
    kept = []
    for row in rows:
        if row["verify"] not in clean:
            res = await run_command(row["verify"], cwd=dest, sandbox=sandbox)
            clean[row["verify"]] = res.exit_code == 0
            if res.exit_code != 0 and not failing:
                failing = f"{_failure_line(res.output)} (exit {res.exit_code})"
        if not clean[row["verify"]]:
            continue
        originals: dict[Path, bytes] = {}
        try:
            for e in row["edits"]:
                p = dest / e["path"]
                originals.setdefault(p, p.read_bytes())
            for p in originals:
                rel = p.relative_to(dest).as_posix()
                p.write_bytes(
                    apply_edits(originals[p], [e for e in row["edits"] if e["path"] == rel])
                )
            res = await run_command(row["verify"], cwd=dest, sandbox=sandbox)
        finally:
            for p, data in originals.items():
                p.write_bytes(data)
        if res.exit_code != 0 and not res.timed_out:
            kept.append(row)
    return kept, failing


# ---------------------------------------------------------------- one folder (`tasks mine`)


def mine_repo(repo: Path | str, *, out: Path | str, limit: int = 10, seed: int = 0) -> list[Path]:
    """`opencomposer tasks mine REPO`: task folders from one local project, its tests
    made runnable as the corpus builder does (src layout, installed into .deps,
    foreign addopts neutralised). TaskError (one line) when it cannot be mined."""
    repo = Path(repo).expanduser().resolve()
    if not repo.is_dir():
        raise TaskError(f"{repo}: not a folder")
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", repo.name).strip("-.") or "repo"
    spec = ProjectSpec(name=name, split="train", git=str(repo), commit="-")
    settings = CorpusSettings(per_function=1)
    with tempfile.TemporaryDirectory(prefix="oc-mine-repo-") as tmp:
        work = Path(tmp) / "work"
        shutil.copytree(
            repo, work, symlinks=True, ignore=shutil.ignore_patterns(*mining.SKIP_NAMES, "*.pyc")
        )
        env = TestEnv(pytest_args=list(ALWAYS_ARGS))
        if _src_layout(work):
            env.pythonpath.append("src")
        try:
            install_deps(work, spec, env)
            path_shim(work, env.pythonpath)
            return asyncio.run(
                _mine_repo(work, Path(tmp), Path(out), spec, settings, env, limit, seed)
            )
        except Skip as e:
            raise TaskError(f"{repo}: {e}") from None


async def _mine_repo(
    work: Path,
    tmp: Path,
    out: Path,
    spec: ProjectSpec,
    settings: CorpusSettings,
    env: TestEnv,
    limit: int,
    seed: int,
) -> list[Path]:
    (tmp / "mine").mkdir()
    cfg = env.config(spec, settings, limit=limit, max_attempts=max(60, 5 * limit), seed=seed)
    cfg = mining.MineConfig(**{**cfg.__dict__, "source": f"mined:{spec.name}"})
    scratch, plugin_dir = mining.setup_scratch(work, tmp / "mine", cfg)
    base = await _baseline(scratch, cfg, plugin_dir, spec, env, work)
    cfg = mining.MineConfig(**{**cfg.__dict__, "pytest_args": tuple(env.pytest_args)})
    return await mining.mine_from(scratch, plugin_dir, base, cfg, out, spec.name, label=spec.name)


# ---------------------------------------------------------------- the whole corpus


def build_corpus(
    manifest: Manifest,
    out: Path | str,
    *,
    jobs: int = 1,
    only: Iterable[str] = (),
    force: bool = False,
    limit: int | None = None,
    say: Callable[[str], None] | None = None,
    earlier: Path | None = None,
) -> dict[str, Any]:
    """Build every project of the manifest that is not built yet (in `jobs` processes),
    then write the build report. Returns the report. `limit` overrides the manifest's
    tasks per project (a quick trial build); `earlier` is another build's report.json
    whose rows fill in projects this folder lacks (`write_report`)."""
    out = Path(out).expanduser().resolve()
    say = say or (lambda s: print(s, file=sys.stderr, flush=True))
    only = [o for o in only if o]
    names = {p.name for p in manifest.projects}
    unknown = sorted(set(only) - names)
    if unknown:
        raise CorpusError(f"not in {manifest.path}: {', '.join(unknown)}")
    if jobs < 1:
        raise CorpusError(f"--jobs must be at least 1, got {jobs}")
    settings = manifest.settings
    if limit is not None:
        if limit < 1:
            raise CorpusError(f"--limit must be at least 1, got {limit}")
        settings = replace(settings, limit=limit)
    if earlier is not None:
        _earlier_rows(earlier, manifest)  # a bad report fails now, not after the build
    specs = [p for p in manifest.projects if not only or p.name in only]
    (out / "projects").mkdir(parents=True, exist_ok=True)
    todo = []
    for spec in specs:
        done = _read_record(out / "projects" / spec.name)
        key = spec.key(settings)
        if done and not force and done.get("key") == spec.key(settings, version=RESTYLED_FROM):
            done = restyle_project(out / "projects" / spec.name, key, say=say)
        if done and not force and done.get("key") == key and not _worth_retrying(done):
            continue
        todo.append(spec)
    todo = _interleave_splits(todo)
    t0 = time.monotonic()
    say(
        f"corpus: {len(specs) - len(todo)} of {len(specs)} projects already built; building {len(todo)} with {jobs} job(s)"
    )
    finished = 0

    def report_one(rec: dict[str, Any]) -> None:
        nonlocal finished
        finished += 1
        what = (
            f"{rec['tasks']} tasks ({rec.get('single', 0)} single, {rec.get('two_site', 0)} two-site)"
            if rec["status"] == "built"
            else f"{rec['status']}: {rec.get('reason', '')}"
        )
        say(f"[{finished}/{len(todo)}] {rec['name']}: {what} in {rec['seconds']:.0f} s")

    if jobs == 1 or len(todo) <= 1:
        for spec in todo:
            report_one(build_project(spec, settings, out, say=say))
    else:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(
            max_workers=jobs, mp_context=ctx, initializer=_end_with, initargs=(os.getpid(),)
        ) as pool:
            futures = {pool.submit(build_project, spec, settings, out): spec for spec in todo}
            for fut in concurrent.futures.as_completed(futures):
                spec = futures[fut]
                try:
                    rec = fut.result()
                except Exception as e:  # the worker process died
                    rec = {
                        "name": spec.name,
                        "status": "error",
                        "tasks": 0,
                        "seconds": 0.0,
                        "reason": _line(f"{type(e).__name__}: {e}"),
                    }
                report_one(rec)
    report = write_report(
        manifest, out, run_seconds=time.monotonic() - t0, earlier=earlier, settings=settings
    )
    say(
        f"corpus: {report['totals']['tasks']} tasks from {report['totals']['projects_built']} "
        f"projects ({report['totals']['heldout_tasks']} held out) → {out / 'report.md'}"
    )
    return report


def _end_with(parent: int) -> None:
    """A build worker's start: it ends when the build process does. Killed, the build
    would otherwise leave its workers building (and its sandboxes running) unseen."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (Linux)
    if os.getppid() != parent:  # the build ended before this worker started
        os._exit(1)
    signal.signal(signal.SIGTERM, _worker_ends)


_ending = threading.Event()


def _worker_ends(signum: int, frame: Any) -> None:
    # SystemExit unwinds the project being built (its scratch folder is removed); the
    # pool's worker loop then catches it and waits for more work, so a timer ends it,
    # and `build_project` refuses what the worker picks up meanwhile (it would leave
    # that project's scratch folder behind).
    # The build's death can signal more than once: the worker passes to each of its
    # threads in turn as they exit, and each exit sends the signal again. Only the
    # first unwinds (the rest are ignored); a second SystemExit would cut the first
    # one's cleanup short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _ending.set()
    threading.Timer(5.0, os._exit, (1,)).start()
    raise SystemExit(1)


def _interleave_splits(specs: list[ProjectSpec]) -> list[ProjectSpec]:
    """The build order: the splits taken in turn, in proportion to their sizes (each in
    manifest order), so a build that stops early has tasks of every split."""
    by_split: dict[str, list[ProjectSpec]] = {}
    for spec in specs:
        by_split.setdefault(spec.split, []).append(spec)
    total = len(specs)
    out: list[ProjectSpec] = []
    taken = dict.fromkeys(by_split, 0)
    while len(out) < total:
        # the split furthest behind its share of what is ordered so far goes next
        split = min(
            (s for s in by_split if taken[s] < len(by_split[s])),
            key=lambda s: (taken[s] + 1) / len(by_split[s]),
        )
        out.append(by_split[split][taken[split]])
        taken[split] += 1
    return out


def _worth_retrying(done: dict[str, Any]) -> bool:
    """Whether a finished project is built again: after an error, or after a skip for a
    missing test dependency that the build did not try to install (one recorded before
    builds installed those; the record says `deps_tried` since), or after a skip for test
    modules that do not import that did not try leaving them out (`leave_out_tried`), or
    after a skip for bugs that did not verify, recorded with other harness options
    (`always_args`: before coverage was turned off, say)."""
    if done.get("status") == "error":
        return True
    reason = done.get("reason") or ""
    if reason.startswith("none of") and done.get("always_args") != list(ALWAYS_ARGS):
        return True
    if _import_failure(reason) and not done.get("leave_out_tried"):
        return True
    return bool(missing_module(reason)) and not done.get("deps_tried")


def _import_failure(reason: str) -> bool:
    """Whether a skip's reason is test modules that do not import (`_why_no_tests`)."""
    return reason.startswith(("tests do not collect", "a test dependency is missing"))


def restyle_project(
    project_dir: Path, key: str, *, say: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Bring a project built by builder version 2 up to date without rebuilding it: each
    broken node is rewritten as the source writes its kept parts (`mining.restyle`; the
    module parses to the same tree, so its tests fail and pass as verified). Returns
    the updated record, with `key`."""
    rec = _read_record(project_dir) or {}
    changed = 0
    tasks_file = project_dir / "tasks.jsonl"
    if rec.get("status") == "built" and tasks_file.is_file():
        rows = [json.loads(line) for line in tasks_file.read_text().splitlines() if line.strip()]
        files: dict[str, bytes] = {}
        with tarfile.open(project_dir / "snapshot.tar") as tar:
            for row in rows:
                for e in row["edits"]:
                    if e["path"] not in files:
                        files[e["path"]] = tar.extractfile(e["path"]).read()  # type: ignore[union-attr]
                    start = e["offset"]
                    text = mining.restyle(
                        files[e["path"]], start, start + len(e["old"].encode()), e["new"]
                    )
                    if text != e["new"]:  # the requests quote pytest's `E` lines, not it
                        e["new"], changed = text, changed + 1
        tmp = tasks_file.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(tasks_file)
    rec.update(key=key, builder_version=BUILDER_VERSION)
    if changed:
        rec["notes"] = [*rec.get("notes", []), f"{changed} broken nodes restyled (builder 2 to 3)"]
    tmp = project_dir / "project.json.tmp"
    tmp.write_text(json.dumps(rec, indent=1) + "\n")
    tmp.replace(project_dir / "project.json")
    if say is not None and changed:
        say(f"{rec.get('name', project_dir.name)}: {changed} broken nodes restyled")
    return rec


def _read_record(project_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((project_dir / "project.json").read_text())
    except (OSError, ValueError):
        return None


def _earlier_rows(
    path: Path, manifest: Manifest, settings: CorpusSettings | None = None
) -> dict[str, dict[str, Any]]:
    """The rows of an earlier build's `report.json` that still describe what this
    manifest would build: same entry, same settings, same builder (the row's `key`)."""
    try:
        earlier = json.loads(path.read_text())
        rows = earlier["projects"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorpusError(f"{path}: not a corpus build report ({_line(str(e))})") from None
    keys = {spec.name: spec.key(settings or manifest.settings) for spec in manifest.projects}
    return {
        r["name"]: r
        for r in rows
        if isinstance(r, dict)
        and r.get("key")
        and r.get("key") == keys.get(r.get("name"))
        and r.get("status") in ("built", "skipped")
        and isinstance(r.get("tasks"), int)
        and r.get("split") in ("train", "heldout")
    }


def write_report(
    manifest: Manifest,
    out: Path,
    *,
    run_seconds: float = 0.0,
    earlier: Path | None = None,
    settings: CorpusSettings | None = None,
) -> dict[str, Any]:
    """Write `out/report.json` and `out/report.md` from the projects built in `out`.
    With `earlier` (another build's report.json, e.g. the one in docs/corpus/), a
    project that `out` lacks takes that build's row when its key still matches, marked
    `earlier`: a report that spans builds on several machines says which rows it saw."""
    settings = settings or manifest.settings
    before = _earlier_rows(earlier, manifest, settings) if earlier is not None else {}
    rows = []
    for spec in manifest.projects:
        rec = _read_record(out / "projects" / spec.name)
        if rec is not None and rec.get("key") != spec.key(settings):
            rec = None  # built for another version of this entry (or other settings)
        if rec is None and spec.name in before:
            rec = {**before[spec.name], "earlier": True}
        if rec is None:
            rec = {"name": spec.name, "split": spec.split, "status": "not built", "tasks": 0}
        rows.append(rec)
    built = [r for r in rows if r["status"] == "built"]
    report = {
        "manifest": str(manifest.path),
        "manifest_sha256": manifest.sha256,
        "builder_version": BUILDER_VERSION,
        "run_seconds": round(run_seconds, 1),
        "totals": {
            "tasks": sum(r["tasks"] for r in built),
            "train_tasks": sum(r["tasks"] for r in built if r["split"] == "train"),
            "heldout_tasks": sum(r["tasks"] for r in built if r["split"] == "heldout"),
            "projects": len(rows),
            "projects_built": len(built),
            "heldout_projects_built": sum(1 for r in built if r["split"] == "heldout"),
            "build_seconds": round(sum(r.get("seconds", 0.0) for r in rows), 1),
            "projects_from_earlier": sum(1 for r in rows if r.get("earlier")),
        },
        "projects": rows,
    }
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [
        f"# Corpus build: {manifest.path.name}",
        "",
        f"{report['totals']['tasks']} tasks from {len(built)} of {len(rows)} projects "
        f"({report['totals']['heldout_tasks']} held out); building took "
        f"{report['totals']['build_seconds']:.0f} s of project time"
        + (f"; this run took {run_seconds:.0f} s of wall-clock." if run_seconds else "."),
        *(
            [
                "",
                f"{report['totals']['projects_from_earlier']} rows marked *earlier* come from an "
                f"earlier build's report ({earlier.name}) for the same manifest entry, settings "
                "and builder; this build did not have them.",
            ]
            if earlier is not None and report["totals"]["projects_from_earlier"]
            else []
        ),
        "",
        "| project | split | status | tasks | two-site | tried | seconds | notes / reason |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        note = r.get("reason") or ", ".join(r.get("notes", []))
        lines.append(
            f"| {r['name']} | {r.get('split', '')} | {r['status']}{' (earlier)' if r.get('earlier') else ''} | {r['tasks']} | "
            f"{r.get('two_site', 0)} | {r.get('attempts', 0)} | {r.get('seconds', 0):.0f} | "
            f"{note.replace('|', '/')} |"
        )
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return report


def load_rows(corpus: Path | str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(project record, task row) for every task of a built corpus."""
    corpus = Path(corpus).expanduser()
    projects = corpus / "projects"
    if not projects.is_dir():
        raise CorpusError(f"{corpus}: not a corpus (no projects/ folder)")
    found = []
    for d in sorted(p for p in projects.iterdir() if p.is_dir() and not p.name.startswith(".")):
        rec = _read_record(d)
        if not rec or rec.get("status") != "built":
            continue
        with (d / "tasks.jsonl").open() as fh:
            for line in fh:
                if line.strip():
                    found.append((rec, json.loads(line)))
    return found


def export(
    corpus: Path | str,
    out: Path | str,
    *,
    split: str = "",
    query: str = "mixed",
    projects: Iterable[str] = (),
    limit: int | None = None,
) -> list[Path]:
    """Write the corpus's tasks as plain task folders under `out`; returns them."""
    if split and split not in SPLITS:
        raise CorpusError(f"unknown split {split!r}: use train or heldout")
    if query != "mixed" and query not in QUERY_KINDS:
        raise CorpusError(f"unknown query kind {query!r}: use mixed, {', '.join(QUERY_KINDS)}")
    corpus, out = Path(corpus).expanduser(), Path(out).expanduser()
    only = set(projects)
    made: list[Path] = []
    for rec, row in load_rows(corpus):
        if (split and rec["split"] != split) or (only and rec["name"] not in only):
            continue
        if limit is not None and len(made) >= limit:
            break
        kind = query
        if kind == "mixed":
            kind = QUERY_KINDS[int(hashlib.sha1(row["id"].encode()).hexdigest(), 16) % 3]
        snapshot = corpus / "projects" / rec["name"] / "snapshot.tar"
        fixes = _solution_edits(snapshot, row["edits"])
        dest = write_task(
            out / row["id"],
            query=row["queries"][kind],
            verify=row["verify"],
            repo_tar=patched_tar(snapshot, row["edits"]),
            timeout_s=900,
            command_timeout_s=row.get("command_timeout_s", 120.0),
            protect=row["protect"],
            split=rec["split"],
            source=f"corpus:{rec['source']}",
            reward={
                "verify": 1.0 - TOUCHED_WEIGHT,
                "checks": [{"command": touched_check(fixes), "weight": TOUCHED_WEIGHT}],
            },
        )
        where = " and ".join(
            f"`{f}` in {e['path']}" for f, e in zip(row["functions"], row["edits"], strict=False)
        )
        solution = {
            "answer": f"Fixed the bug in {where}; the failing tests pass again.",
            "kind": row["kind"],
            "query_kind": kind,
            "functions": row["functions"],
            "failing": row.get("failing", []),
            "edits": fixes,
        }
        (dest / "solution.json").write_text(json.dumps(solution, indent=1) + "\n")
        made.append(dest)
    return made


def touched_check(fixes: list[dict[str, Any]]) -> str:
    """A command that passes when every fix's broken lines are gone from their file
    (compared without whitespace, so re-indenting them is not a change) and each file
    still parses: the part-credit check (`TOUCHED_WEIGHT`). The lines travel base64
    encoded, so the command is one shell word whatever they contain."""
    pairs = json.dumps([[f["path"], f["old"]] for f in fixes])
    payload = base64.b64encode(pairs.encode()).decode()
    code = (
        "import ast,base64,json,sys;"
        f"e=json.loads(base64.b64decode('{payload}'));"
        "s=lambda x:''.join(x.split());"
        "t={p:open(p,encoding='utf-8').read() for p,_ in e};"
        "[ast.parse(v) for v in t.values()];"
        "sys.exit(any(s(b) in s(t[p]) for p,b in e))"
    )
    return f"python -c {shlex.quote(code)}"


def default_corpus() -> Path:
    """Where `opencomposer tasks build-corpus` output is looked for by suite name
    (``corpus``, ``corpus:train``, ``corpus:heldout``): ``$OPENCOMPOSER_CORPUS``,
    else ``~/.cache/opencomposer/corpus``."""
    env = os.environ.get("OPENCOMPOSER_CORPUS")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "opencomposer" / "corpus"


def ensure_export(corpus: Path | str | None = None, *, query: str = "mixed") -> list[Path]:
    """The built corpus as plain task folders (every split; requests of kind ``query``,
    as `export`), exported once into the cache under a name that changes whenever a
    project is rebuilt."""
    if query != "mixed" and query not in QUERY_KINDS:
        raise CorpusError(f"unknown query kind {query!r}: use mixed, {', '.join(QUERY_KINDS)}")
    src = Path(corpus).expanduser() if corpus else default_corpus()
    projects = src / "projects"
    if not projects.is_dir():
        raise CorpusError(
            f"no built corpus at {src}: run `opencomposer tasks build-corpus --out {src}` "
            "(or set OPENCOMPOSER_CORPUS)"
        )
    h = hashlib.sha256(f"{src.resolve()}:{EXPORT_VERSION}".encode())
    if query != "mixed":  # the mixed export keeps the name it always had
        h.update(f":{query}".encode())
    for d in sorted(p for p in projects.iterdir() if p.is_dir()):
        rec = _read_record(d)
        if rec and rec.get("status") == "built":
            h.update(f"{d.name}:{rec.get('key')}:{rec.get('tasks')}".encode())
    dest = Path.home() / ".cache" / "opencomposer" / "suites" / f"corpus-{h.hexdigest()[:12]}"
    marker = dest / ".complete"
    if not marker.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
        try:
            export(src, tmp, query=query)
            (tmp / ".complete").write_text(str(src))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(dest, ignore_errors=True)
        try:
            os.replace(tmp, dest)
        except OSError:  # another process put its export there first
            shutil.rmtree(tmp, ignore_errors=True)
    return sorted(p for p in dest.iterdir() if (p / "task.toml").is_file())


def _solution_edits(snapshot: Path, edits: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The reference fix as `edit_file` calls would make it, in order: whole lines,
    broken -> original, each widened by context lines until its `old` text occurs
    once in the file as it stands when that call runs."""
    with tarfile.open(snapshot) as tar:
        originals = {
            e["path"]: tar.extractfile(e["path"]).read()  # type: ignore[union-attr]
            for e in edits
        }
    fixes = []
    for path, original in originals.items():
        mine = sorted((e for e in edits if e["path"] == path), key=lambda e: e["offset"])
        state = apply_edits(original, mine)
        for i in reversed(range(len(mine))):  # from the end: earlier offsets stay valid
            e = mine[i]
            start = e["offset"] + sum(
                len(x["new"].encode()) - len(x["old"].encode()) for x in mine[:i]
            )
            end = start + len(e["new"].encode())
            lo = state.rfind(b"\n", 0, start) + 1
            hi = state.find(b"\n", end)
            hi = len(state) if hi < 0 else hi
            while state.count(state[lo:hi]) > 1 and (lo > 0 or hi < len(state)):
                lo = state.rfind(b"\n", 0, max(lo - 1, 0)) + 1 if lo > 0 else 0
                nxt = state.find(b"\n", hi + 1)
                hi = len(state) if hi >= len(state) or nxt < 0 else nxt
            old = state[lo:hi]
            new = state[lo:start] + e["old"].encode() + state[end:hi]
            fixes.append(
                {
                    "path": path,
                    "line": e["line"],
                    "old": old.decode("utf-8", errors="replace"),
                    "new": new.decode("utf-8", errors="replace"),
                }
            )
            state = state[:lo] + new + state[hi:]
        if state != original:
            raise CorpusError(f"{path}: the reference fix does not restore the snapshot")
    return fixes


def _line(text: str) -> str:
    return " ".join(str(text).split())[:300]


def _failure_line(output: str) -> str:
    """The line of a run's output that says why it failed: the last that names a
    failure or an error, else the last line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    named = [ln for ln in lines if re.search(r"\b(?:FAIL(?:ED)?|ERROR|\w*Error|killed)\b", ln)]
    return _line((named or lines or ["no output"])[-1])[:200]
