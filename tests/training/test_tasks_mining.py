"""Bug-injection mining on a tiny real repository (pytest, bwrap sandbox, no network).

Guards: mutations keep the file's formatting except the one node; only covered
functions are mutated; every kept task fails before and passes with the original
restored (checked again here, independently of the miner); the query names the
failing test and its error; the tests are protected.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from opencomposer.training.mining import MineConfig, find_mutations, mine, prepare_own, restyle
from opencomposer.training.tasks import TaskError, load_task, safe_extract

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")

LIB = '''"""A small library."""


def clamp(x, lo, hi):
    # keep x within [lo, hi]
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x


def window(xs, n):
    return [xs[i : i + n] for i in range(len(xs) - n + 1)]


def is_even(n):
    return n % 2 == 0


def untested(a, b):
    return a + b
'''

TESTS = """from mylib import clamp, is_even, window


def test_clamp():
    assert clamp(5, 0, 10) == 5
    assert clamp(-1, 0, 10) == 0
    assert clamp(11, 0, 10) == 10
    assert clamp(10, 0, 10) == 10


def test_window():
    assert window([1, 2, 3], 2) == [[1, 2], [2, 3]]
    assert window([1, 2, 3], 3) == [[1, 2, 3]]


def test_even():
    assert is_even(4) and not is_even(3)
"""


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "mylib-repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "mylib.py").write_text(LIB)
    (repo / "tests" / "test_mylib.py").write_text(TESTS)
    (repo / "conftest.py").write_text(
        "import sys, os\nsys.path.insert(0, os.path.dirname(__file__))\n"
    )
    return repo


def test_mutations_replace_one_node_and_keep_formatting(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    covered = {4: ["t"], 13: ["t"]}  # clamp and window, not is_even or untested
    muts = find_mutations(repo, "mylib.py", covered)
    assert {m.function for m in muts} == {"clamp", "window"}
    kinds = {m.kind for m in muts}
    assert {"flipped comparison", "off-by-one bound", "dropped branch"} <= kinds
    for m in muts:
        text = m.apply(LIB.encode()).decode()
        assert "# keep x within [lo, hi]" in text  # comments survive
        changed = [a for a, b in zip(LIB.splitlines(), text.splitlines(), strict=False) if a != b]
        assert len(changed) >= 1 and text != LIB
        compile(text, "mylib.py", "exec")


KINDS_LIB = """def mix(xs, factor, flag):
    total = 0
    scale = 3
    for i in range(len(xs)):
        if xs[i] > 0 and flag:
            total += xs[i] * factor
        elif not flag:
            total = total - xs[0]
    helper(total, scale)
    while total > 100:
        total //= 2
    if total == 7:
        return True
    return max(total, 0) << 1


def helper(a, b):
    pass
"""


def test_every_bug_kind_is_produced_and_parses(tmp_path: Path) -> None:
    """SWE-smith's procedural kinds: one function rich enough to show each of them."""
    from opencomposer.training.mining import KINDS

    (tmp_path / "k.py").write_text(KINDS_LIB)
    muts = find_mutations(tmp_path, "k.py", {1: ["t"]})
    assert set(KINDS) == {m.kind for m in muts}
    seen = set()
    for m in muts:
        text = m.apply(KINDS_LIB.encode()).decode()
        assert text != KINDS_LIB and text not in seen  # no two mutations give the same file
        seen.add(text)
        compile(text, "k.py", "exec")
        assert text.startswith("def mix(xs, factor, flag):")  # only the one node changed
    negated = {m.new for m in muts if m.kind == "negated condition"}
    assert "not total > 100" in negated and any("not (" in n or "not xs" in n for n in negated)
    assert {m.new for m in muts if m.kind == "dropped factor"} == {"xs[i]"}


STYLED = b"""def f(a, b, c):
    if key[0] == "*" and a*b > 1:
        return call(a,
                    b)
    y = (a+b) * c
    return f"{a!r:>3}" + "x"
"""


@pytest.mark.parametrize(
    ("old", "unparsed", "written"),
    [
        ('key[0] == "*"', "key[0] != '*'", 'key[0] != "*"'),  # the source's quotes
        ("a*b > 1", "a * b >= 1", "a*b >= 1"),  # its spacing
        ('key[0] == "*" and a*b > 1', "key[0] == '*' or a * b > 1", 'key[0] == "*" or a*b > 1'),
        ("(a+b) * c", "c * (a + b)", "c * (a+b)"),  # parenthesised where the place needs it
        ("(a+b) * c", "a + b", "a+b"),
        ('f"{a!r:>3}" + "x"', "f'{a!r:>3}' - 'x'", 'f"{a!r:>3}" - "x"'),
        ('f"{a!r:>3}" + "x"', "'y'", '"y"'),  # a new string in the quotes around it
        ("call(a,\n                    b)", "call(b, a)", "call(b, a)"),
        ("return call(a,\n                    b)", "return None", "return None"),
    ],
)
def test_the_broken_node_is_written_as_the_source_writes_it(
    old: str, unparsed: str, written: str
) -> None:
    """`ast.unparse`'s own style would tell a policy which line is broken."""
    import ast

    start = STYLED.index(old.encode())
    end = start + len(old.encode())
    assert restyle(STYLED, start, end, unparsed) == written
    as_parsed = ast.dump(ast.parse(STYLED[:start] + unparsed.encode() + STYLED[end:]))
    assert ast.dump(ast.parse(STYLED[:start] + written.encode() + STYLED[end:])) == as_parsed


def test_restyle_keeps_a_text_it_cannot_better() -> None:
    start = STYLED.index(b"a*b > 1")
    assert restyle(STYLED, start, start + 7, "a * b >=") == "a * b >="  # does not parse
    assert restyle(STYLED, start, start + 3, "a + b") == "a + b"  # no node spans it


def test_mined_bugs_keep_the_source_style(tmp_path: Path) -> None:
    (tmp_path / "q.py").write_text('def q(s):\n    return s == "*" and len(s)*2 > 1\n')
    muts = [m for m in find_mutations(tmp_path, "q.py", {1: ["t"]}, check=False) if m.checked()]
    assert muts and all("'" not in m.new for m in muts)
    assert any(m.new == 's == "*" or len(s)*2 > 1' for m in muts), [m.new for m in muts]


def _run(cmd: str, cwd: Path) -> int:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run(
        ["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, timeout=120
    ).returncode


@pytest.mark.parametrize(
    "limit", [1, pytest.param(4, marks=pytest.mark.slow)], ids=["one", "several"]
)
def test_mine_keeps_verified_tasks(tmp_path: Path, limit: int) -> None:
    repo = _repo(tmp_path)
    before = {p: p.read_bytes() for p in repo.rglob("*") if p.is_file()}
    cfg = MineConfig(max_attempts=3 * limit, seed=1)
    paths = mine(repo, out=tmp_path / "out", limit=limit, config=cfg)
    assert {p: p.read_bytes() for p in repo.rglob("*") if p.is_file()} == before  # repo untouched
    assert 1 <= len(paths) <= limit
    for path in paths:
        task = load_task(path)
        assert task.protect == ("tests/test_mylib.py",)
        assert "tests/test_mylib.py::test_" in task.query and "E " in task.query
        assert "pytest" in task.verify and task.source == "mined:mylib-repo"
        ws = tmp_path / "check" / task.id
        safe_extract(task.repo_tar, ws)
        assert (ws / "mylib.py").read_text() != LIB
        assert not (ws / ".opencomposer").exists()
        assert _run(task.verify, ws) != 0  # fails before
        sol = json.loads((path / "solution.json").read_text())
        for e in sol["edits"]:
            text = (ws / e["path"]).read_text()
            assert text.count(e["old"]) >= 1
            (ws / e["path"]).write_text(text.replace(e["old"], e["new"], 1))
        assert (ws / "mylib.py").read_text() == LIB
        assert _run(task.verify, ws) == 0  # passes with the original restored


LOOP_LIB = "def countdown(n):\n    while n > 0:\n        n -= 1\n    return n\n"


def test_a_mutant_that_never_ends_is_given_up_on_early(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio
    import time

    from opencomposer.training import mining

    repo = tmp_path / "loop"
    repo.mkdir()
    (repo / "loop.py").write_text(LOOP_LIB)
    (repo / "test_loop.py").write_text(
        "from loop import countdown\n\n\ndef test_countdown():\n    assert countdown(3) == 0\n"
    )
    (repo / "conftest.py").write_text(
        "import sys, os\nsys.path.insert(0, os.path.dirname(__file__))\n"
    )
    monkeypatch.setattr(mining, "TRIAL_FLOOR_S", 3.0)
    cfg = MineConfig(test_timeout_s=120)
    node = "test_loop.py::test_countdown"
    start = LOOP_LIB.index("n -= 1")
    forever = mining.Mutation(
        path="loop.py", function="countdown", kind="changed constant", line=3,
        start=start, end=start + 6, old="n -= 1", new="n -= 0", tests=[node],
    )  # fmt: skip

    async def go() -> tuple[mining.Baseline, mining.Trial | None, float]:
        scratch, plugin = mining.setup_scratch(repo, tmp_path / "mine", cfg)
        base = await mining.baseline(scratch, cfg, plugin, "loop")
        t0 = time.monotonic()
        found = await mining.trial(scratch, [forever], cfg, plugin, base)
        assert (scratch / "loop.py").read_text() == LOOP_LIB  # restored
        return base, found, time.monotonic() - t0

    base, found, seconds = asyncio.run(go())
    assert set(base.durations) == {node} and base.durations[node] >= 0
    assert mining.trial_budget([node], cfg, base.durations) < 10
    assert mining.trial_budget([node, "other"], cfg, base.durations) == 150  # unknown: the cap
    assert found is None
    assert seconds < 60  # cut at its budget (~3 s), not at the cap (150 s)


def test_mine_errors_are_one_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "m.py").write_text("x = 1\n")
    with pytest.raises(TaskError, match="no test files"):
        mine(empty, out=tmp_path / "o")
    (empty / "test_m.py").write_text("def test_fail():\n    assert False\n")
    with pytest.raises(TaskError, match="no passing tests"):
        mine(empty, out=tmp_path / "o")
    with pytest.raises(TaskError, match="not a folder"):
        mine(tmp_path / "missing", out=tmp_path / "o")


def test_prepare_own_imports_from_the_copy(tmp_path: Path) -> None:
    root = tmp_path / "copy"
    (root / "tools").mkdir(parents=True)
    (root / "tools" / "__init__.py").write_text("")
    (root / "tools" / "marker.py").write_text("WHERE = 'copy'\n")
    (root / "test_where.py").write_text(
        "from opencomposer.tools.marker import WHERE\n\ndef test_where():\n    assert WHERE == 'copy'\n"
    )
    prepare_own(root)
    assert _run("python -m pytest -q -p no:cacheprovider test_where.py", root) == 0


def test_committed_pypi_suite_loads() -> None:
    from opencomposer.training.catalog import load_suite

    tasks = load_suite("pypi")
    assert len(tasks) >= 4 and {t.source.split(":")[2].split("-")[0] for t in tasks} >= {
        "inflection",
        "toolz",
    }
    for t in tasks:
        assert t.protect and "pytest" in t.verify and (t.dir / "solution.json").is_file()


@pytest.mark.slow
def test_committed_pypi_suite_is_verified(tmp_path: Path) -> None:
    from opencomposer.training.catalog import load_suite

    for task in load_suite("pypi"):
        ws = tmp_path / task.id
        safe_extract(task.repo_tar, ws)
        assert _run(task.verify, ws) != 0, task.id
        for e in json.loads((task.dir / "solution.json").read_text())["edits"]:
            text = (ws / e["path"]).read_text()
            (ws / e["path"]).write_text(text.replace(e["old"], e["new"], 1))
        assert _run(task.verify, ws) == 0, task.id


@pytest.mark.slow
def test_own_suite_is_mined_from_this_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from opencomposer.training import mining
    from opencomposer.training.catalog import load_suite

    monkeypatch.setenv("OPENCOMPOSER_HOME", str(tmp_path))
    monkeypatch.setattr(
        mining, "OWN_TARGETS", (("tools/output.py", "tests/tools/test_tools_output.py"),)
    )
    paths = mining.ensure_own_suite(limit=1, refresh=True)
    assert len(paths) == 1
    tasks = load_suite("own")
    assert [t.id for t in tasks] == [paths[0].name] and tasks[0].source == "mined:own"
    ws = tmp_path / "ws"
    safe_extract(tasks[0].repo_tar, ws)
    assert (ws / "conftest.py").read_text().startswith("# Added by opencomposer's task miner")
    assert _run(tasks[0].verify, ws) != 0
