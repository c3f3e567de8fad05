"""The corpus builder (`training/corpus.py`) on a tiny project made here: a git
repository with a `src/` layout, a package that reads its own installed metadata
(so its tests pass only once it is installed), and a pytest.ini whose `addopts`
needs a plugin that is not installed — the three layouts `tasks mine` gave up on.

Guards: each of those layouts is handled (not skipped); the snapshot is stored
once per project with tasks as patches; every exported task fails its verify as
written and passes with the reference fix (checked here, in the sandbox,
independently of the builder); a two-site task needs both fixes; export writes
folders the task loader reads, with the project's split; a built project is not
rebuilt; manifest mistakes are one line naming the entry and the key; a project
holding the demo's sample repository is refused.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
from opencomposer.tools.protocols import SandboxConfig
from opencomposer.training import corpus
from opencomposer.training.catalog import load_suite
from opencomposer.training.demos import DemoError, demo_turns, wrong_fix
from opencomposer.training.env import run_command
from opencomposer.training.tasks import TaskError, safe_extract

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")

PYPROJECT = """[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "tinylib"
version = "0.3.0"

[tool.setuptools.packages.find]
where = ["src"]
"""

INIT = '''"""tinylib: reads its own version from its installed metadata."""
from importlib.metadata import version

__version__ = version("tinylib")

from tinylib.core import clamp, scale, window  # noqa: E402
'''

CORE = """def clamp(x, lo, hi):
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x


def window(xs, n):
    return [xs[i : i + n] for i in range(len(xs) - n + 1)]


def scale(values, factor):
    total = 0
    out = []
    for v in values:
        out.append(v * factor)
        total += v
    return out
"""

TESTS = """import tinylib
from tinylib import clamp, scale, window


def test_version():
    assert tinylib.__version__ == "0.3.0"


def test_clamp():
    assert clamp(5, 0, 10) == 5
    assert clamp(-1, 0, 10) == 0
    assert clamp(11, 0, 10) == 10


def test_window():
    assert window([1, 2, 3], 2) == [[1, 2], [2, 3]]


def test_scale():
    assert scale([1, 2, 3], 3) == [3, 6, 9]
"""


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def _project(tmp_path: Path) -> tuple[Path, str]:
    repo = tmp_path / "tinylib"
    (repo / "src" / "tinylib").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "pyproject.toml").write_text(PYPROJECT)
    (repo / "pytest.ini").write_text("[pytest]\naddopts = -ra --benchmark-disable\n")
    (repo / "src" / "tinylib" / "__init__.py").write_text(INIT)
    (repo / "src" / "tinylib" / "core.py").write_text(CORE)
    (repo / "tests" / "test_core.py").write_text(TESTS)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "tinylib")
    return repo, _git(repo, "rev-parse", "HEAD")


def _manifest(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "corpus.toml"
    path.write_text(body)
    return path


async def _run(command: str, cwd: Path) -> int:
    return (await run_command(command, cwd=cwd, sandbox=SandboxConfig(timeout_s=120))).exit_code


def _fix(ws: Path, edits: list[dict]) -> None:
    for e in edits:
        p = ws / e["path"]
        text = p.read_text()
        assert e["old"] in text
        p.write_text(text.replace(e["old"], e["new"], 1))


def _expression(text: str) -> bool:
    import ast

    try:
        ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    return True


@needs_bwrap
def test_build_export_verify_resume(tmp_path: Path, monkeypatch) -> None:
    repo, commit = _project(tmp_path)
    manifest = corpus.load_manifest(
        _manifest(
            tmp_path,
            f"[corpus]\nlimit = 2\nper_function = 1\ntwo_site = 0.5\n\n"
            f'[[project]]\ngit = "{repo}"\ncommit = "{commit}"\nsplit = "heldout"\n',
        )
    )
    out = tmp_path / "corpus"
    said: list[str] = []
    report = corpus.build_corpus(manifest, out, say=said.append)
    rec = json.loads((out / "projects" / "tinylib" / "project.json").read_text())
    assert rec["status"] == "built", rec
    assert {"src layout", "installed into .deps", "addopts without --benchmark-disable"} <= set(
        rec["notes"]
    )
    assert rec["env"]["pythonpath"] == ["src", ".deps"]
    assert rec["two_site"] == 1 and rec["single"] == 2
    assert report["totals"]["tasks"] == rec["tasks"] == rec["single"] + rec["two_site"]
    assert report["totals"]["heldout_tasks"] == rec["tasks"]
    assert (out / "report.md").read_text().count("| tinylib | heldout | built |") == 1

    # One snapshot for the project; tasks are patches against it.
    files = sorted(p.name for p in (out / "projects" / "tinylib").iterdir())
    assert files == ["project.json", "snapshot.tar", "tasks.jsonl"]
    with tarfile.open(out / "projects" / "tinylib" / "snapshot.tar") as tar:
        names = tar.getnames()
        assert tar.extractfile("src/tinylib/core.py").read().decode() == CORE  # type: ignore[union-attr]
        assert tar.extractfile("pytest.ini").read() == b"[pytest]\naddopts = -ra\n"  # type: ignore[union-attr]
    assert "conftest.py" in names  # the sys.path shim (path_shim)
    assert not any(n.startswith(".deps/tinylib/") for n in names)  # the installed copy is gone
    assert any(n.startswith(".deps/tinylib-0.3.0.dist-info") for n in names)  # its metadata stays
    rows = [json.loads(line) for line in (out / "projects" / "tinylib" / "tasks.jsonl").open()]
    assert len(rows) == rec["tasks"]
    assert all(set(r["queries"]) == {"test", "issue", "oneline"} for r in rows)
    for r in rows:
        assert "test_" not in r["queries"]["issue"], r["queries"]["issue"]
        assert "PYTHONPATH=src:.deps" in r["verify"] and "addopts" not in r["verify"]
        assert " -x " in r["verify"]  # a broken workspace stops at its first failure
        assert "`python -m pytest tests/" in r["queries"]["test"]

    # Export: plain task folders the loader reads; each fails as written, passes fixed.
    tasks = corpus.export(out, tmp_path / "tasks")
    assert len(tasks) == len(rows)
    suite = load_suite(tmp_path / "tasks")
    assert {t.split for t in suite} == {"heldout"}
    assert len({t.query for t in suite}) == len(suite)
    # Checked again here, independently of the builder: the two-site task and one other.
    sols = {t.id: json.loads((t.dir / "solution.json").read_text()) for t in suite}
    assert sum(len(s["edits"]) > 1 for s in sols.values()) == 1
    assert all(s["answer"] and s["kind"] for s in sols.values())
    checked = sorted(suite, key=lambda t: -len(sols[t.id]["edits"]))[:2]
    for task in checked:
        sol = sols[task.id]
        ws = tmp_path / "ws" / task.id
        safe_extract(task.repo_tar, ws)
        assert asyncio.run(_run(task.verify, ws)) != 0, task.id
        if len(sol["edits"]) > 1:  # two-site: one fix alone is not enough
            _fix(ws, sol["edits"][:1])
            assert asyncio.run(_run(task.verify, ws)) != 0, task.id
            _fix(ws, sol["edits"][1:])
        else:
            _fix(ws, sol["edits"])
        assert asyncio.run(_run(task.verify, ws)) == 0, task.id
        # without PYTHONPATH too, as an agent would run it: the root conftest.py shim
        plain = "PYTHONDONTWRITEBYTECODE=1 python -m pytest -q tests/test_core.py"
        assert asyncio.run(_run(plain, ws)) == 0, task.id
    assert corpus.export(out, tmp_path / "none", split="train") == []

    # Part credit (a reward check): every broken line changed, each file still parsing.
    def credit(task, edits: list[dict]) -> bool:
        ws = tmp_path / "credit" / f"{task.id}-{len(list((tmp_path / 'credit').glob('*')))}"
        ws.parent.mkdir(exist_ok=True)
        safe_extract(task.repo_tar, ws)
        _fix(ws, edits)
        (check,) = task.reward["checks"]
        return asyncio.run(_run(check["command"], ws)) == 0

    for task in checked:
        assert task.reward["checks"][0]["weight"] == corpus.TOUCHED_WEIGHT
        assert task.reward["verify"] == 1 - corpus.TOUCHED_WEIGHT
        edits = sols[task.id]["edits"]
        assert not credit(task, [])  # nothing changed
        assert credit(task, edits)  # fixed
        assert not credit(task, [{**e, "new": e["old"] + "  # looked at"} for e in edits])
        spaced = [{**e, "new": e["old"].replace("\n", "   \n") + "   "} for e in edits]
        assert not credit(task, spaced)  # trailing whitespace
        assert not credit(task, [{**e, "new": e["new"] + " ("} for e in edits])  # no parse
        if len(edits) > 1:
            assert not credit(task, edits[:1])  # one of two sites
    # a wrong change of the right line earns it too
    task, wrong = next(
        (t, w)
        for t in suite
        if len(sols[t.id]["edits"]) == 1
        for w in [wrong_fix(t, sols[t.id]["edits"][0])]
        if w is not None
    )
    assert credit(task, [{**sols[task.id]["edits"][0], "new": wrong}])

    # The engineer's demonstration: the test command it runs (derived from the request
    # alone) fails before the fix and passes after it, run plainly in the workspace (as
    # run_terminal would).
    played = 0
    for task in suite:
        sol = sols[task.id]
        assert sol["failing"] and all("::" in f for f in sol["failing"])
        try:
            turns = demo_turns(task, sol)
        except DemoError:
            continue  # the request does not lead to the code; never played
        played += 1
        assert turns[-1] and "<" not in turns[-1]  # a plain answer ends it
        commands = set(re.findall(r"<command>(.*?)</command>", "\n".join(turns)))
        assert commands, turns
        for i, cmd in enumerate(sorted(commands)):
            assert "PYTHONPATH" not in cmd and cmd.startswith("python -m pytest -x")
            ws = tmp_path / "demo" / f"{task.id}-{i}"
            safe_extract(task.repo_tar, ws)
            assert asyncio.run(_run(cmd, ws)) != 0, cmd
            _fix(ws, sol["edits"])
            assert asyncio.run(_run(cmd, ws)) == 0, cmd
    assert played >= 2

    # By suite name: the corpus exported once into the cache, split as built.
    monkeypatch.setenv("OPENCOMPOSER_CORPUS", str(out))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    named = load_suite("corpus:heldout")
    assert sorted(t.id for t in named) == sorted(t.id for t in suite)
    assert load_suite("corpus:train") == []
    first = corpus.ensure_export()
    assert corpus.ensure_export() == first  # cached: not exported again
    # One request kind for every task, or every kind: the same bugs, other requests
    # (what `[sft] demo_suite = "corpus:train:all"` demonstrates).
    by_test = load_suite("corpus:heldout:test")
    assert [t.id for t in by_test] == [t.id for t in named]
    every = load_suite("corpus:heldout:all")
    assert sorted(t.id for t in every) == sorted(t.id for t in named for _ in range(3))
    assert len({(t.id, t.query) for t in every}) == 3 * len(named)
    assert {t.query for t in by_test} < {t.query for t in every}
    with pytest.raises(TaskError, match="unknown query kind 'often'"):
        load_suite("corpus:heldout:often")

    # Resume: a built project is not built again.
    stamp = (out / "projects" / "tinylib" / "project.json").stat().st_mtime_ns
    said.clear()
    corpus.build_corpus(manifest, out, say=said.append)
    assert (out / "projects" / "tinylib" / "project.json").stat().st_mtime_ns == stamp
    assert "1 of 1 projects already built" in said[0]

    # A project built by builder version 2 (unparse's style) is restyled in place, not
    # rebuilt: its snapshot stays, its broken nodes are written as the source writes them.
    pdir = out / "projects" / "tinylib"
    rows = [json.loads(line) for line in (pdir / "tasks.jsonl").open()]
    edit = next(e for r in rows for e in r["edits"] if _expression(e["new"]))
    written, edit["new"] = edit["new"], f"({edit['new']})"
    (pdir / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rec = json.loads((pdir / "project.json").read_text())
    old_key = manifest.projects[0].key(manifest.settings, version=corpus.RESTYLED_FROM)
    (pdir / "project.json").write_text(json.dumps({**rec, "key": old_key, "builder_version": 2}))
    snapshot = (pdir / "snapshot.tar").stat().st_mtime_ns
    said.clear()
    corpus.build_corpus(manifest, out, say=said.append)
    assert "tinylib: 1 broken nodes restyled" in said and "1 of 1 projects already built" in said[1]
    assert (pdir / "snapshot.tar").stat().st_mtime_ns == snapshot
    again = [json.loads(line) for line in (pdir / "tasks.jsonl").open()]
    assert written in [e["new"] for r in again for e in r["edits"]]
    restyled = json.loads((pdir / "project.json").read_text())
    assert restyled["key"] == rec["key"] and restyled["builder_version"] == corpus.BUILDER_VERSION


def _one_repo_manifest(
    tmp_path: Path, repo: Path, head: str = "", entry: str = ""
) -> corpus.Manifest:
    """A manifest of one training project: `repo`, committed as it is now."""
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "x")
    commit = _git(repo, "rev-parse", "HEAD")
    body = f'{head}[[project]]\ngit = "{repo}"\ncommit = "{commit}"\nsplit = "train"\n{entry}'
    return corpus.load_manifest(_manifest(tmp_path, body))


@needs_bwrap
def test_project_without_passing_tests_is_skipped_with_a_reason(tmp_path: Path) -> None:
    repo = tmp_path / "nettest"
    (repo / "tests").mkdir(parents=True)
    (repo / "lib.py").write_text("def f():\n    return 1\n")
    (repo / "tests" / "test_net.py").write_text(
        "import socket\n\ndef test_net():\n    socket.create_connection(('pypi.org', 443), timeout=5)\n"
    )
    manifest = _one_repo_manifest(tmp_path, repo)
    report = corpus.build_corpus(manifest, tmp_path / "c", say=lambda s: None)
    (row,) = report["projects"]
    assert row["status"] == "skipped" and row["reason"] == "tests need the network"
    assert not (tmp_path / "c" / "projects" / "nettest" / "snapshot.tar").exists()


@needs_bwrap
def test_test_modules_that_do_not_import_are_left_out(tmp_path: Path) -> None:
    """One test module that cannot be imported here stops pytest's whole run
    ("Interrupted: 1 error during collection"); the build leaves it out and mines the rest."""
    repo = tmp_path / "halfbroken"
    (repo / "tests").mkdir(parents=True)
    (repo / "lib.py").write_text("def add(a, b):\n    return a + b\n")
    (repo / "conftest.py").write_text(
        "import sys, os\nsys.path.insert(0, os.path.dirname(__file__))\n"
    )
    (repo / "tests" / "test_lib.py").write_text(
        "from lib import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
    )
    (repo / "tests" / "test_extra.py").write_text(
        "from lib import subtract\n\n\ndef test_subtract():\n    assert subtract(3, 2) == 1\n"
    )
    manifest = _one_repo_manifest(tmp_path, repo, "[corpus]\nlimit = 1\n\n", "install = false\n")
    said: list[str] = []
    report = corpus.build_corpus(manifest, tmp_path / "c", say=said.append)
    (row,) = report["projects"]
    assert row["status"] == "built" and row["tasks"] >= 1, row
    assert "left out 1 test file(s) that do not import: tests/test_extra.py" in row["notes"]
    assert any("leaving out 1 test file(s)" in s for s in said)
    with tarfile.open(tmp_path / "c" / "projects" / "halfbroken" / "snapshot.tar") as tar:
        names = tar.getnames()
    assert "tests/test_lib.py" in names and "tests/test_extra.py" not in names


# A stand-in for pytest-cov (its distribution and plugin names): `--cov-fail-under`
# fails a run whose tests all passed, as a coverage threshold does on a few test files.
FAKE_COV_PLUGIN = """def pytest_addoption(parser):
    parser.addoption("--cov", action="append", nargs="?", const=True, default=[])
    parser.addoption("--cov-fail-under", type=float, default=None)


def pytest_sessionfinish(session, exitstatus):
    if session.config.getoption("--cov-fail-under") is not None and exitstatus == 0:
        session.exitstatus = 1
"""


@needs_bwrap
def test_a_coverage_threshold_in_addopts_does_not_fail_verify(tmp_path: Path) -> None:
    """A project whose addopts carry `--cov-fail-under` with pytest-cov installed:
    each verify runs a few test files, below the threshold, and exits 1 with every test
    passed. Coverage is off in every run, its options leave the project's config."""
    plugin = tmp_path / "fakecov"
    (plugin / "pytest_cov").mkdir(parents=True)
    (plugin / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "pytest-cov"\nversion = "99.0"\n\n'
        '[project.entry-points.pytest11]\npytest_cov = "pytest_cov.plugin"\n\n'
        '[tool.setuptools]\npackages = ["pytest_cov"]\n'
    )
    (plugin / "pytest_cov" / "__init__.py").write_text("")
    (plugin / "pytest_cov" / "plugin.py").write_text(FAKE_COV_PLUGIN)
    repo = tmp_path / "covered"
    (repo / "tests").mkdir(parents=True)
    (repo / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "covered"\nversion = "1.0"\n\n[tool.setuptools]\npy-modules = ["lib"]\n'
    )
    (repo / "pytest.ini").write_text("[pytest]\naddopts = -ra --cov=lib --cov-fail-under=99\n")
    (repo / "lib.py").write_text("def add(a, b):\n    return a + b\n")
    (repo / "tests" / "test_lib.py").write_text(
        "from lib import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
    )
    manifest = _one_repo_manifest(
        tmp_path, repo, "[corpus]\nlimit = 1\ntwo_site = 0\n\n", f'deps = ["{plugin}"]\n'
    )
    report = corpus.build_corpus(manifest, tmp_path / "c", say=lambda s: None)
    (row,) = report["projects"]
    assert row["status"] == "built" and row["tasks"] == 1, row
    assert "addopts without --cov=lib --cov-fail-under=99" in row["notes"]
    out = tmp_path / "c" / "projects" / "covered"
    with tarfile.open(out / "snapshot.tar") as tar:
        assert tar.extractfile("pytest.ini").read() == b"[pytest]\naddopts = -ra\n"  # type: ignore[union-attr]
        assert any(n.startswith(".deps/pytest_cov") for n in tar.getnames())
    (task,) = [json.loads(line) for line in (out / "tasks.jsonl").open()]
    assert "no:pytest_cov" in task["verify"]


def test_check_plugins_are_off_in_every_run(tmp_path: Path) -> None:
    """Coverage and linters that a project's test extras install (found by their
    entry points, as pytest finds them) add no option to the runs the build makes."""
    deps = tmp_path / ".deps"
    deps.mkdir()
    # the entry-point names in the real plugins' wheels (pytest-cov, pytest-mypy, ...)
    real = ("pytest_cov", "enabler", "mypy", "ruff", "flake8", "black", "pylint", "checkdocs")
    for name in real:
        module = f"fake_{name}"
        (deps / f"{module}.py").write_text(
            f"def pytest_addoption(parser):\n    parser.addoption('--{module}-check')\n"
        )
        info = deps / f"fake_{name}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fake-{name}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[pytest11]\n{name} = {module}\n")
    known = corpus.known_pytest_options(tmp_path, [".deps"])
    assert "--timeout" in known and not [o for o in known if o.endswith("-check")], known
    # without the harness's options, pytest loads every one of them
    env = {**os.environ, "PYTHONPATH": str(deps)}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    assert all(f"--fake_{name}-check" in out for name in real)


def test_a_verify_failing_on_the_snapshot_is_named_in_the_skip() -> None:
    output = "....\nFAIL Required test coverage of 99% not reached.\n4 passed in 0.1s\n"
    assert corpus._failure_line(output) == "FAIL Required test coverage of 99% not reached."
    assert corpus._failure_line("\n  1 failed\n") == "1 failed"
    assert corpus._failure_line("") == "no output"


def test_uncollectable_reads_both_of_pytests_forms(tmp_path: Path) -> None:
    for rel in ("tests/test_a.py", "tests/test_b.py", "tests/conftest.py", "lib.py"):
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text("")
    output = (
        "_____ ERROR collecting tests/test_a.py _____\nImportError: x\n"
        "ERROR tests/test_b.py - ModuleNotFoundError: No module named 'y'\n"
        "ERROR tests/conftest.py - oops\nERROR lib.py\nERROR ../outside/test_c.py\n"
        "ERROR tests/test_gone.py - z\n!!! Interrupted: 2 errors during collection !!!\n"
    )
    assert corpus.uncollectable(output, tmp_path) == ["tests/test_a.py", "tests/test_b.py"]
    assert corpus.uncollectable("1 passed in 0.01s", tmp_path) == []


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            '[[project]]\npypi = "six==1.16.0"\nsplit = "train"\ntset = []\n',
            "(six==1.16.0): unknown key tset",
        ),
        ('[[project]]\npypi = "six==1.16.0"\n', "(six==1.16.0): split must be train or heldout"),
        ('[[project]]\npypi = "six"\nsplit = "train"\n', "pypi must pin one version"),
        ('[[project]]\ngit = "/x"\nsplit = "train"\n', "git needs commit"),
        ('[[project]]\nsplit = "train"\n', "give exactly one of pypi and git"),
        ("[corpus]\nlimit = -1\n[[project]]\n", "[corpus] limit must be a non-negative number"),
        ('[corpus]\nlimt = 3\n[[project]]\npypi = "a==1"\nsplit = "train"\n', "unknown key limt"),
        (
            '[[project]]\npypi = "a==1"\nsplit = "train"\n[[project]]\npypi = "a==2"\nsplit = "train"\n',
            "name 'a' appears twice",
        ),
        ("[[project]\n", "malformed TOML"),
    ],
)
def test_manifest_errors_are_one_line(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(TaskError) as e:
        corpus.load_manifest(_manifest(tmp_path, body))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_checked_in_manifest_parses() -> None:
    """configs/corpus.toml: enough projects, at least 8 held out, no demo sample."""
    m = corpus.load_manifest(Path(__file__).parents[2] / "configs" / "corpus.toml")
    assert len(m.projects) >= 40
    assert sum(p.split == "heldout" for p in m.projects) >= 8
    assert all("sample_repo" not in p.git for p in m.projects)


def test_report_keeps_an_earlier_builds_rows_only_for_unchanged_entries(tmp_path: Path) -> None:
    """A report spanning builds: a project this folder lacks takes the earlier report's
    row (marked), but only where the manifest entry, settings and builder still match."""
    body = "[corpus]\nlimit = 3\n\n" + "".join(
        f'[[project]]\npypi = "{n}==1.0"\nsplit = "{s}"\n\n'
        for n, s in (
            ("alpha", "train"),
            ("beta", "heldout"),
            ("gamma", "train"),
            ("delta", "train"),
        )
    )
    manifest = corpus.load_manifest(_manifest(tmp_path, body))
    keys = {p.name: p.key(manifest.settings) for p in manifest.projects}
    out = tmp_path / "corpus"
    here = out / "projects" / "alpha"
    here.mkdir(parents=True)
    here_rec = {
        "name": "alpha",
        "split": "train",
        "status": "built",
        "tasks": 5,
        "key": keys["alpha"],
    }
    (here / "project.json").write_text(json.dumps(here_rec))

    def row(name: str, split: str, tasks: int, key: str) -> dict:
        return {"name": name, "split": split, "status": "built", "tasks": tasks, "key": key}

    earlier = tmp_path / "earlier.json"
    earlier.write_text(
        json.dumps(
            {
                "projects": [
                    row("alpha", "train", 99, keys["alpha"]),  # this folder has its own
                    row("beta", "heldout", 7, keys["beta"]),  # kept
                    row("gamma", "train", 8, "0123456789abcdef"),  # the entry changed since
                    {"name": "delta", "split": "train", "status": "built", "tasks": 9},  # no key
                ]
            }
        )
    )
    report = corpus.write_report(manifest, out, earlier=earlier)
    by_name = {r["name"]: r for r in report["projects"]}
    assert by_name["alpha"]["tasks"] == 5 and not by_name["alpha"].get("earlier")
    assert by_name["beta"]["tasks"] == 7 and by_name["beta"]["earlier"] is True
    assert by_name["gamma"]["status"] == by_name["delta"]["status"] == "not built"
    assert report["totals"]["tasks"] == 12 and report["totals"]["heldout_tasks"] == 7
    assert report["totals"]["projects_from_earlier"] == 1
    md = (out / "report.md").read_text()
    assert "| beta | heldout | built (earlier) | 7 |" in md and "1 rows marked *earlier*" in md
    # Without an earlier report, only what this folder holds.
    assert corpus.write_report(manifest, out)["totals"]["tasks"] == 5
    # A record built for another version of the entry is not this entry's build.
    (here / "project.json").write_text(json.dumps({**here_rec, "key": "fedcba9876543210"}))
    stale = corpus.write_report(manifest, out, earlier=earlier)
    assert {r["name"]: r["status"] for r in stale["projects"]}["alpha"] == "built"
    assert {r["name"]: r["tasks"] for r in stale["projects"]}["alpha"] == 99  # the earlier row
    assert corpus.write_report(manifest, out)["totals"]["tasks"] == 0

    earlier.write_text("{not json")
    with pytest.raises(TaskError) as e:
        corpus.build_corpus(manifest, out, only=["alpha"], earlier=earlier, say=lambda s: None)
    assert "not a corpus build report" in str(e.value) and "\n" not in str(e.value)


def test_sample_repository_is_refused(tmp_path: Path) -> None:
    sample = Path(__file__).parents[2] / "examples" / "sample_repo"
    shutil.copytree(sample, tmp_path / "copy")
    with pytest.raises(corpus.Skip, match="sample repository"):
        corpus._check_not_sample(tmp_path / "copy")


@needs_bwrap
def test_tasks_mine_handles_the_same_layouts(tmp_path: Path, capsys) -> None:
    """`opencomposer tasks mine REPO` on the src-layout, must-install, foreign-addopts
    project: it used to stop at "no passing tests to mine from"."""
    repo, _ = _project(tmp_path)
    task, ws = _mine_one(repo, tmp_path, capsys)
    assert "PYTHONPATH=src:.deps" in task.verify
    assert (ws / ".deps").is_dir() and asyncio.run(_run(task.verify, ws)) != 0


def _mine_one(repo: Path, tmp_path: Path, capsys) -> tuple[Any, Path]:
    """`tasks mine REPO --limit 1`: the one task, and its workspace unpacked."""
    from opencomposer.server.cli import main

    code = main(["tasks", "mine", str(repo), "--out", str(tmp_path / "mined"), "--limit", "1"])
    assert code == 0, capsys.readouterr().err
    (task,) = load_suite(tmp_path / "mined")
    ws = tmp_path / "ws"
    safe_extract(task.repo_tar, ws)
    return task, ws


def test_marks_of_missing_plugins_under_filterwarnings_error(tmp_path: Path, capsys) -> None:
    """A suite whose conftest marks items with a missing plugin's marker (`no_cover`),
    under `filterwarnings = error`: pytest stops with an internal error until unknown-mark
    warnings are let through; the verify command carries that too."""
    repo, _ = _project(tmp_path)
    (repo / "pytest.ini").write_text(
        "[pytest]\naddopts = -ra --cov=tinylib\nfilterwarnings =\n    error\n"
    )
    (repo / "tests" / "conftest.py").write_text(
        "import pytest\n\n\ndef pytest_collection_modifyitems(items):\n"
        "    for item in items:\n        item.add_marker(pytest.mark.no_cover)\n"
    )
    task, ws = _mine_one(repo, tmp_path, capsys)
    assert "ignore::pytest.PytestUnknownMarkWarning" in task.verify
    assert asyncio.run(_run(task.verify, ws)) != 0


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        (
            "setup.cfg",
            "[metadata]\nname = x\n\n[tool:pytest]\naddopts =\n    --cov=x\n    --cov-report term\n"
            "    --doctest-modules\ntestpaths = tests\n",
            "[metadata]\nname = x\n\n[tool:pytest]\naddopts = --doctest-modules\ntestpaths = tests\n",
        ),
        (
            "pyproject.toml",
            '[project]\nname = "x"\n\n[tool.pytest.ini_options]\naddopts = [\n  "-ra",\n'
            '  "--benchmark-skip",\n]\n',
            '[project]\nname = "x"\n\n[tool.pytest.ini_options]\naddopts = "-ra"\n',
        ),
    ],
)
def test_foreign_addopts_are_stripped_the_rest_kept(
    tmp_path: Path, name: str, text: str, expected: str
) -> None:
    (tmp_path / name).write_text(text)
    known = corpus.known_pytest_options(tmp_path, [])
    assert "--doctest-modules" in known and "--cov" not in known
    dropped = corpus.strip_foreign_addopts([tmp_path], known)
    assert dropped and all(
        d.startswith("--cov") or d in ("term", "--benchmark-skip") for d in dropped
    )
    assert (tmp_path / name).read_text() == expected
    assert corpus.strip_foreign_addopts([tmp_path], known) == []  # nothing left to strip


def test_build_order_takes_the_splits_in_turn() -> None:
    specs = [corpus.ProjectSpec(name=f"t{i}", split="train") for i in range(8)] + [
        corpus.ProjectSpec(name=f"h{i}", split="heldout") for i in range(2)
    ]
    order = [s.name for s in corpus._interleave_splits(specs)]
    assert sorted(order) == sorted(s.name for s in specs)
    assert order.index("h0") < 5 and order.index("h1") < 10
    assert [n for n in order if n.startswith("t")] == [f"t{i}" for i in range(8)]
    # a build stopped after any prefix of half or more has both splits
    assert {n[0] for n in order[:5]} == {"t", "h"}


def test_task_workspaces_leave_out_pips_in_tree_build(tmp_path: Path) -> None:
    import io

    snap = tmp_path / "snapshot.tar"
    with tarfile.open(snap, "w") as tar:
        for name, data in (
            ("pkg/core.py", b"x = 1\n"),
            ("build/lib/pkg/core.py", b"x = 1\n"),
            ("build/bdist.linux-x86_64/y", b""),
            ("buildtools/z.py", b""),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    edit = {"path": "pkg/core.py", "offset": 4, "old": "1", "new": "2", "line": 1}
    out = corpus.patched_tar(snap, [edit])
    with tarfile.open(fileobj=io.BytesIO(out)) as tar:
        assert tar.getnames() == ["pkg/core.py", "buildtools/z.py"]
        assert tar.extractfile("pkg/core.py").read() == b"x = 2\n"  # type: ignore[union-attr]


def test_a_missing_test_dependency_is_named_and_its_skip_retried(tmp_path: Path) -> None:
    reason = "a test dependency is missing: ModuleNotFoundError: No module named 'nose2.tools'"
    assert corpus.missing_module(reason) == "nose2"
    assert corpus.missing_module("no tests in the source") == ""
    # without .deps on the path, nothing is installed
    assert not corpus.install_missing("nose2", [tmp_path], corpus.TestEnv())
    assert not corpus.install_missing("no;such", [tmp_path], corpus.TestEnv(pythonpath=[".deps"]))
    # retried once by a build that installs missing dependencies, not again after it tried
    skipped = {"status": "skipped", "reason": reason}
    assert corpus._worth_retrying(skipped)
    assert corpus._worth_retrying({**skipped, "deps_tried": True})  # not yet left out
    assert not corpus._worth_retrying({**skipped, "deps_tried": True, "leave_out_tried": True})
    assert not corpus._worth_retrying({"status": "skipped", "reason": "no tests in the source"})
    assert corpus._worth_retrying({"status": "error", "reason": "OSError: disk full"})
    # bugs that did not verify: retried once the harness options have changed since
    unverified = {
        "status": "skipped",
        "reason": "none of 36 caught bugs verified from the snapshot",
    }
    assert corpus._worth_retrying(unverified)
    assert not corpus._worth_retrying({**unverified, "always_args": list(corpus.ALWAYS_ARGS)})


WORKER_PARENT = """
import concurrent.futures, multiprocessing, os, sys, time
from opencomposer.training.corpus import _end_with

def work(folder):
    import tempfile
    with tempfile.TemporaryDirectory(dir=folder) as d:  # a project's scratch folder
        open(os.path.join(d, "started"), "w").close()  # inside the with: it cleans up
        time.sleep(120)

if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=1, mp_context=ctx, initializer=_end_with, initargs=(os.getpid(),)
    ) as pool:
        pool.submit(work, sys.argv[1])
        time.sleep(0.5)
        print(*[p.pid for p in pool._processes.values()], flush=True)
        time.sleep(120)
"""


def test_build_workers_end_with_the_build(tmp_path: Path) -> None:
    """A killed build leaves no worker building, and no scratch folder behind."""
    import os
    import signal
    import sys
    import time

    script = tmp_path / "parent.py"
    script.write_text(WORKER_PARENT)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    parent = subprocess.Popen(
        [sys.executable, str(script), str(scratch)], stdout=subprocess.PIPE, text=True
    )
    try:
        (worker,) = map(int, parent.stdout.readline().split())  # type: ignore[union-attr]
        # killed before its `with` is entered, the worker would leave the folder it had
        # just made: wait until it is building. A fresh environment's first imports
        # (bytecode compiled on a loaded 2-core machine) can take tens of seconds.
        deadline = time.monotonic() + 180
        while not any((p / "started").exists() for p in scratch.iterdir()):
            assert time.monotonic() < deadline, "the worker never started building"
            time.sleep(0.1)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(worker, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(worker, signal.SIGKILL)
            pytest.fail("the worker outlived the build")
        assert not any(scratch.iterdir())
    finally:
        parent.kill()


SIGNALLED_TWICE = """
import os, shutil, signal, sys, tempfile, time
from opencomposer.training import corpus

signal.signal(signal.SIGTERM, corpus._worker_ends)
rmtree = shutil.rmtree

def signalled_again(*args, **kwargs):  # the build's next thread exits mid-cleanup
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
    rmtree(*args, **kwargs)

shutil.rmtree = signalled_again
try:
    with tempfile.TemporaryDirectory(dir=sys.argv[1]):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
except SystemExit:
    pass
print(len(os.listdir(sys.argv[1])), flush=True)
os._exit(0)
"""


def test_a_worker_signalled_again_while_unwinding_still_cleans_up(tmp_path: Path) -> None:
    """A killed build signals its worker once for each of its threads; the signals after
    the first must not cut short the cleanup the first one started."""
    import sys

    script = tmp_path / "worker.py"
    script.write_text(SIGNALLED_TWICE)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    run = subprocess.run(
        [sys.executable, str(script), str(scratch)], capture_output=True, text=True, timeout=120
    )
    assert run.stdout.strip() == "0", run.stderr[-2000:]


def test_a_worker_told_to_end_takes_no_more_projects(tmp_path: Path) -> None:
    """After SIGTERM a worker lives 5 s more; a project it picks up meanwhile is refused
    before it makes a folder (os._exit would leave that project's scratch behind)."""
    spec = corpus.ProjectSpec(name="late", split="train", pypi="late==1.0")
    corpus._ending.set()
    try:
        with pytest.raises(SystemExit):
            corpus.build_project(spec, corpus.CorpusSettings(), tmp_path)
    finally:
        corpus._ending.clear()
    assert not any(tmp_path.iterdir())
