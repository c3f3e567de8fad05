"""Where a failing test went (`agent/localize.py`): a real profiled pytest run in the
sandbox, the reading of its record, and a session whose repair finds the function
with the bug only through that run (the test failed on its own assertion)."""

import json
from pathlib import Path

from opencomposer.agent import localize
from opencomposer.agent.session import Session
from opencomposer.tools.protocols import SandboxConfig
from opencomposer.tools.sandbox import bwrap_path, run_sandboxed
from opencomposer.tools.workspace import LocalWorkspace

from tests.agent.test_repair import KNOWN, PICK, Repairing, edit, repairing, run

CODE = (
    "class Pair:\n"
    "    def __init__(self, a, b):\n"
    "        self.a, self.b = a, b\n"
    "\n"
    "    def __repr__(self):\n"
    "        return f'Pair({self.a}, {self.b})'\n"
    "\n"
    "    def __eq__(self, other):\n"
    "        return (self.a, self.b) == (other.a, other.b)\n"
    "\n"
    "\n"
    "def scale(n):\n"
    "    return n * 2\n"
    "\n"
    "\n"
    "def make(n):\n"
    "    return Pair(n, scale(n))\n"
    "\n"
    "\n"
    "def unused():\n"
    "    return 0\n"
)
TESTS = (
    "from m import make, unused\n"
    "\n"
    "\n"
    "def test_other():\n"
    "    assert unused() == 0\n"
    "\n"
    "\n"
    "def test_make():\n"
    "    got = make(2)\n"
    "    assert got.b == 5, got\n"
)
PYTEST = "python -m pytest -q -p no:cacheprovider tests/test_m.py"


def project(root: Path) -> Path:
    root.mkdir()
    (root / "m.py").write_text(CODE)
    (root / "tests").mkdir()
    (root / "tests" / "test_m.py").write_text(TESTS)
    return root


async def profiled(root: Path, command: str) -> tuple[list[tuple[str, int]], str]:
    assert bwrap_path(), "bubblewrap is missing: run `make system-deps`"
    config = SandboxConfig(mode="read-only")
    first = await run_sandboxed(command, root=root, config=config, files={})

    async def go(traced: str, folder: Path) -> None:
        await run_sandboxed(traced, root=root, config=config, files={}, scratch=folder)

    got = await localize.failing_run(command, str(root), first.output, go)
    return got.called, first.output


async def test_a_profiled_run_gives_what_the_failing_test_called_last_first(tmp_path):
    root = project(tmp_path / "repo")
    got, output = await profiled(root, PYTEST)
    assert "test_m.py:10: AssertionError" in output  # no frame of the code
    # make called Pair.__init__ and scale; the report's __repr__ and __eq__ are left out,
    # and so are the functions of the test that passed
    assert set(got) == {("m.py", 15), ("m.py", 11), ("m.py", 1)}
    assert got[0] == ("m.py", 1)  # Pair.__init__, called last
    assert not list(root.rglob("__pycache__"))  # the run wrote nothing in the workspace


async def test_a_traced_run_gives_the_lines_of_the_code_it_ran(tmp_path):
    root = project(tmp_path / "repo")
    config = SandboxConfig(mode="read-only")
    command = f"{PYTEST}::test_make"
    first = await run_sandboxed(command, root=root, config=config, files={})

    async def go(traced: str, folder: Path) -> None:
        await run_sandboxed(traced, root=root, config=config, files={}, scratch=folder)

    got = await localize.failing_run(command, str(root), first.output, go)
    assert got.called[0] == ("m.py", 1)
    assert got.executed is not None and set(got.executed) == {"m.py"}  # no test file
    ran = got.executed["m.py"]
    assert {2, 12, 16} <= ran  # Pair.__init__, scale and make ran
    assert 20 not in ran and 19 in ran  # `unused` was defined, never called
    everything = await localize.failing_run(PYTEST, str(root), first.output, go)
    assert everything.executed is not None and 20 in everything.executed["m.py"]


async def test_a_run_past_the_line_events_followed_tells_no_lines(tmp_path, monkeypatch):
    root = project(tmp_path / "repo")
    monkeypatch.setattr(localize, "LINE_EVENTS", 3)
    config = SandboxConfig(mode="read-only")
    first = await run_sandboxed(PYTEST, root=root, config=config, files={})

    async def go(traced: str, folder: Path) -> None:
        await run_sandboxed(traced, root=root, config=config, files={}, scratch=folder)

    got = await localize.failing_run(PYTEST, str(root), first.output, go)
    assert got.called and got.executed is None  # the calls are all there still


def test_a_record_whose_called_code_shows_no_lines_tells_nothing():
    root = "/w"
    calls = [["/w/a.py", 1, "f", 1], ["/w/b.py", 4, "g", 2]]
    trace = {"tests": [], "all": calls, "lines": {"/w/a.py": [1, 2], "/w/b.py": [5]}}
    assert localize.executed_lines(trace, root) == {"a.py": {0, 1}, "b.py": {4}}
    # b.py's g was called, yet no line of it ran: another tracer took this one's place
    assert localize.executed_lines({**trace, "lines": {"/w/a.py": [1, 2]}}, root) is None
    assert localize.executed_lines({"tests": [], "all": calls}, root) is None


async def test_a_command_that_is_not_python_finds_nothing(tmp_path):
    root = project(tmp_path / "repo")
    assert (await profiled(root, "exit 1"))[0] == []


async def test_a_command_that_sets_its_own_path_is_traced_too(tmp_path):
    root = project(tmp_path / "repo")
    plain = (await profiled(root, PYTEST))[0]
    assert plain and (await profiled(root, f"PYTHONPATH=/nowhere {PYTEST}"))[0] == plain
    assert (await profiled(root, f"export PYTHONPATH=/nowhere; {PYTEST}"))[0] == plain


def test_the_tracer_goes_first_in_a_path_the_command_sets():
    put = localize.with_tracer_path
    assert put("PYTHONPATH=src:.deps python -m pytest", "/t") == (
        "PYTHONPATH='/t':src:.deps python -m pytest"
    )
    assert put("cd a && export PYTHONPATH=b; env PYTHONPATH=c pytest", "/t") == (
        "cd a && export PYTHONPATH='/t':b; env PYTHONPATH='/t':c pytest"
    )
    assert put("MYPYTHONPATH=x pytest", "/t") == "MYPYTHONPATH=x pytest"


def test_the_failing_test_is_found_by_its_frame_then_its_name_then_the_whole_run():
    root = "/w"
    trace = {
        "tests": [
            ["/w/t/test_a.py", 3, "test_one", [["/w/a.py", 1, "f", 5], ["/w/a.py", 9, "g", 7]]],
            ["/w/t/test_a.py", 12, "test_two", [["/w/b.py", 4, "h", 11]]],
        ],
        "all": [["/w/a.py", 1, "f", 5], ["/w/c.py", 2, "k", 20]],
    }
    assert localize.called_lines(trace, "t/test_a.py:14: AssertionError", root) == [("b.py", 3)]
    assert localize.called_lines(trace, "t/test_a.py:5: in test_one", root) == [
        ("a.py", 8),
        ("a.py", 0),
    ]
    named = "FAILED t/test_a.py::test_two - assert 1 == 2"
    assert localize.called_lines(trace, named, root) == [("b.py", 3)]
    assert localize.called_lines(trace, "Traceback: nothing known", root) == [
        ("c.py", 1),
        ("a.py", 0),
    ]
    assert localize.called_lines({}, "t/test_a.py:5: in test_one", root) == []


def test_a_record_cut_short_is_skipped(tmp_path):
    (tmp_path / "1.json").write_text('{"tests": [')  # a process killed while it wrote
    (tmp_path / "2.json").write_text(json.dumps({"tests": [], "all": [["/w/a.py", 1, "f", 1]]}))
    assert localize.read_trace(tmp_path) == {"tests": [], "all": [["/w/a.py", 1, "f", 1]]}


CHECK_TEST = (
    "from m import pick\n\n\ndef test_pick():\n    assert pick(2, 2) == 2 and pick(3, 1) == 0\n"
)


async def test_the_repair_finds_a_function_only_the_failing_test_reached(repo, store):
    """The test fails on its own assertion, and the model's change is to another
    file: only the profiled run points the repair at `pick`, where its fix is."""
    (repo / "m.py").write_text(PICK)
    (repo / "other.py").write_text("def other():\n    return 1\n")
    (repo / "test_m.py").write_text(CHECK_TEST)
    check = "python -m pytest -q -p no:cacheprovider test_m.py"
    wrong = edit("    return 1", "    return 2", path="other.py")
    model = Repairing(["Reproducing.\n" + run(check), "A fix.\n" + wrong, "Fixed."], KNOWN)
    cfg = repairing()
    session = Session(model=model, workspace=LocalWorkspace(repo), config=cfg, traces=store)
    result = await session.run("fix pick")
    assert "test_m.py:5: AssertionError" in result.turns[0].calls[0].result.output
    assert (repo / "m.py").read_text() == PICK.replace("lo < hi", "lo <= hi")
    assert (repo / "other.py").read_text() == "def other():\n    return 1\n"
    meta = result.turns[1].output.meta["repair"]
    assert ["m.py", 1, 4] in meta["spans"] and ["other.py", 1, 2] in meta["spans"]
    # the failing run never ran `other`: its edits come after those of `pick`
    assert meta["not_run"] > 0 and meta["runs"] <= meta["proposals"] - meta["not_run"] + 1
    # of pick's four lines, `return lo` did not run (pick(2, 2) failed the assertion
    # first); other.py was never imported
    assert meta["reached"] == [3, 6]


def test_the_guard_runs_every_test_of_the_failing_tests_files():
    failed = "FAILED t/test_a.py::test_x - assert 1 == 2\nERROR t/test_b.py::test_z - boom"
    g = localize.guard_command
    assert g("python -m pytest -x -q --tb=short -k test_x", failed) == (
        "python -m pytest -q --tb=short t/test_a.py t/test_b.py -p no:cacheprovider -rfE -q"
    )
    assert g("PYTHONPATH=.deps pytest -p no:randomly t/test_a.py::C::test_x", "") == (
        "PYTHONPATH=.deps pytest -p no:randomly t/test_a.py -p no:cacheprovider -rfE -q"
    )
    assert g("python -m pytest --maxfail=1 --lf tests/", "") == (
        "python -m pytest tests/ -p no:cacheprovider -rfE -q"
    )
    for command in ("python -m pytest -q | tail -3", "python3 -c 'import m'", "pytest -k x"):
        assert g(command, "") is None, command  # a pipe, not pytest, nothing to widen to
    assert localize.failed_tests(failed) == {"t/test_a.py::test_x", "t/test_b.py::test_z"}


def test_a_forked_run_has_only_the_failed_tests_collected():
    failed = "FAILED t/test_a.py::C::test_x - assert 1 == 2\nERROR t/test_b.py::test_z - boom"
    n = localize.narrowed_command
    assert n("python -m pytest -x -q --tb=short -k test_x", failed) == (
        "python -m pytest -q --tb=short t/test_a.py::C::test_x t/test_b.py::test_z"
    )
    assert n("PYTHONPATH=src pytest -p no:randomly t/ t/test_a.py::C", failed) == (
        "PYTHONPATH=src pytest -p no:randomly t/test_a.py::C::test_x t/test_b.py::test_z"
    )
    for command, output in (("python -m pytest t/", "1 passed"), ("pytest | tail", failed)):
        assert n(command, output) is None, command  # no failed test named; not plain pytest


TWO_TESTS = (
    "from m import pick\n\n\n"
    "def test_pick():\n    assert pick(2, 2) == 2\n\n\n"
    "def test_other():\n    assert pick(3, 1) == 0\n"
)


async def test_an_edit_that_breaks_another_test_of_the_file_is_not_taken(repo):
    """The model checks one test only. `return hi` for `return 0`, the n-gram model's
    best edit, passes it but fails the file's other test: the repair goes on to `<=`,
    which passes both."""
    (repo / "m.py").write_text(PICK)
    (repo / "test_m.py").write_text(TWO_TESTS)
    check = "python -m pytest -q -p no:cacheprovider test_m.py::test_pick"
    wrong = edit("        return lo", "        return hi")
    model = Repairing([run(check), "A fix.\n" + wrong, "Fixed."], KNOWN)
    cfg = repairing()
    result = await Session(model=model, workspace=LocalWorkspace(repo), config=cfg).run("fix")
    assert (repo / "m.py").read_text() == PICK.replace("lo < hi", "lo <= hi")
    assert result.turns[1].output.meta["repair"]["runs"] >= 3


def test_a_pytest_run_of_no_test_is_told_apart():
    for command, code in (
        ("python -m pytest -q tests/test_nope.py", 4),
        ("pytest -k no_such_test", 5),
        (".venv/bin/pytest -x", 5),
    ):
        assert localize.ran_no_test(command, code), command
    for command, code in (
        ("python -m pytest -q", 1),  # tests failed
        ("python -m pytest -q", 2),  # interrupted: a collection error is the code's
        ("python -c 'import sys; sys.exit(4)'", 4),  # not pytest
        ("cd src && pytest", 5),  # shell syntax: not known to be a plain pytest run
    ):
        assert not localize.ran_no_test(command, code), command


def test_the_folders_packages_were_installed_into_are_found(tmp_path):
    """An in-tree virtualenv's site-packages and a `pip install --target` folder (it
    holds `*.dist-info`) are install folders; the project's own `src/` with its
    `*.egg-info` is not, nor is anything under node_modules or .git."""
    for folder in (
        ".deps/lib",
        ".deps/lib-1.0.dist-info",
        ".venv/lib/python3.11/site-packages/other",
        "src/pkg",
        "src/pkg.egg-info",
        "node_modules/x/y-1.0.dist-info",
        ".git/objects/z-1.0.dist-info",
        "a/b/c/d/e/f-1.0.dist-info",  # deeper than INSTALLED_DEPTH looks
    ):
        (tmp_path / folder).mkdir(parents=True)
    found = localize.installed_folders(tmp_path)
    assert found == (".deps/", ".venv/lib/python3.11/site-packages/")
    assert localize.is_installed(".deps/lib/__init__.py", found)
    assert not localize.is_installed("src/pkg/__init__.py", found)
    assert localize.installed_folders(tmp_path / "missing") == ()


# the project's code calls a library installed in the workspace (`.deps`), which calls
# back into it and raises: the traceback and the profiled run both go through it
LIB = (
    "def call(fn, *args):\n"
    "    out = fn(*args)\n"
    "    check(out)\n"
    "    return out\n"
    "\n"
    "\n"
    "def check(out):\n"
    "    if out == 0:\n"
    "        raise ValueError('zero')\n"
)
USES_LIB = (
    "import os, sys\n"
    "sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '.deps'))\n"
    "import lib\n"
    "\n"
    "\n" + PICK + "\n\n"
    "def run_pick(lo, hi):\n"
    "    return lib.call(pick, lo, hi)\n"
)
LIB_TEST = "from m import run_pick\n\n\ndef test_pick():\n    assert run_pick(3, 3) == 3\n"


def with_library(root: Path) -> Path:
    (root / "m.py").write_text(USES_LIB)
    (root / "test_m.py").write_text(LIB_TEST)
    (root / ".deps" / "lib").mkdir(parents=True)
    (root / ".deps" / "lib-1.0.dist-info").mkdir()
    (root / ".deps" / "lib" / "__init__.py").write_text(LIB)
    return root


async def test_a_profiled_run_leaves_out_the_code_of_installed_packages(tmp_path):
    (tmp_path / "repo").mkdir()
    root = with_library(tmp_path / "repo")
    command = "python -m pytest -q -p no:cacheprovider test_m.py"
    config = SandboxConfig(mode="read-only")
    first = await run_sandboxed(command, root=root, config=config, files={})
    assert ".deps/lib/__init__.py" in first.output and "ValueError: zero" in first.output

    async def go(traced: str, folder: Path) -> None:
        await run_sandboxed(traced, root=root, config=config, files={}, scratch=folder)

    everything = (await localize.failing_run(command, str(root), first.output, go)).called
    assert {p for p, _ in everything} == {"m.py", ".deps/lib/__init__.py"}
    skip = localize.installed_folders(root)
    got = (await localize.failing_run(command, str(root), first.output, go, skip)).called
    assert got == [("m.py", 5), ("m.py", 11)]  # pick, called back last; run_pick


async def test_the_repair_does_not_edit_an_installed_package(repo, store):
    """The failing test's traceback ends in a library installed in the workspace: the
    repair looks at the project's functions the test reached, not the library's."""
    with_library(repo)
    check = "python -m pytest -q -p no:cacheprovider test_m.py"
    read = '<read_file path="m.py"/>'
    model = Repairing(["Reproducing.\n" + run(check), "Reading.\n" + read, "Done."], KNOWN)
    cfg = repairing()
    session = Session(model=model, workspace=LocalWorkspace(repo), config=cfg, traces=store)
    result = await session.run("fix pick")
    assert "ValueError: zero" in result.turns[0].calls[0].result.output
    meta = result.turns[1].output.meta["repair"]
    assert meta["spans"] and all(path == "m.py" for path, _, _ in meta["spans"]), meta["spans"]
    assert (repo / ".deps" / "lib" / "__init__.py").read_text() == LIB
