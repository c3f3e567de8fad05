"""Reproducing a failure a request quotes (`agent/reproduce.py`): reading the quoted
lines, finding the tests a real pytest run fails that way, and a session whose repair
fixes a bug reported without a test name while the model itself never runs a check."""

import subprocess
import sys
from pathlib import Path

from opencomposer.agent import reproduce
from opencomposer.agent.session import Session, SessionConfig
from opencomposer.tools.workspace import LocalWorkspace

from tests.agent.test_repair import KNOWN, PICK, Repairing, repairing

TESTS = (
    "from m import pick\n\n\ndef test_pick():\n    assert pick(2, 2) == 2\n"
    "    assert pick(3, 1) == 0\n"
)
# another file's test that fails on its own, whatever the bug
OTHER = (
    "from m import pick\n\n\ndef test_low():\n    assert pick(1, 3) == 1\n\n\n"
    "class TestInput:\n    def test_raise(self):\n        raise ValueError('bad input 42')\n"
)
ISSUE = (
    "Something broke: `pick` gives wrong results. The output:\n\n```\n"
    "E       assert 0 == 2\nE        +  where 0 = pick(2, 2)\n```\n\nFix the code (not the tests)."
)


def project(root: Path) -> Path:
    (root / "m.py").write_text(PICK)
    (root / "tests").mkdir()
    (root / "tests" / "test_m.py").write_text(TESTS)
    (root / "tests" / "test_other.py").write_text(OTHER)
    return root


def test_the_quoted_failure_is_read_from_the_requests_code_blocks():
    assert reproduce.quoted(ISSUE) == ["assert 0 == 2", "+ where 0 = pick(2, 2)"]
    traceback = (
        "It crashes:\n```\nTraceback (most recent call last):\n"
        '  File "app.py", line 3, in <module>\n'
        "json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)\n```"
    )
    assert reproduce.quoted(traceback) == [
        "json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)"
    ]
    # outside a code block, and lines too short to tell failures apart
    assert reproduce.quoted("It fails:\nE   KeyError: 'name'\nE\nE   ?  ^") == ["KeyError: 'name'"]
    assert reproduce.quoted("Add a --verbose flag to the CLI.") == []


def test_the_tests_whose_sections_hold_the_most_quoted_lines_are_chosen():
    output = (
        "F.FE\n"
        "==================================== ERRORS ====================================\n"
        "___________________ ERROR collecting tests/test_c.py ___________________\n"
        "E   ImportError: cannot import name 'gone'\n"
        "=================================== FAILURES ===================================\n"
        "_____________________ TestA.test_b[x-1] _____________________\n"
        "t.py:3: in test_b\n"
        "E   assert 0 == 2\n"
        "E    +  where 0 = pick(2, 2)\n"
        "_____________________ test_d _____________________\n"
        "E   assert 0 == 2\n"
        "=========================== short test summary info ============================\n"
        "FAILED tests/test_a.py::TestA::test_b[x-1] - assert 0 == 2\n"
        "FAILED tests/test_a.py::test_d - assert 0 == 2\n"
        "ERROR tests/test_c.py - ImportError: cannot import name 'gone'\n"
    )
    quotes = reproduce.quoted(ISSUE)
    assert reproduce.matching(output, quotes) == ["tests/test_a.py::TestA::test_b[x-1]"]
    assert reproduce.matching(output, ["assert 0 == 2"]) == [
        "tests/test_a.py::TestA::test_b[x-1]",
        "tests/test_a.py::test_d",
    ]
    found = reproduce.matching(output, ["ImportError: cannot import name 'gone'"])
    assert found == ["tests/test_c.py"]
    assert reproduce.matching(output, ["KeyError: 'name'"]) == []
    moved = output.replace("assert 0 == 2", "assert <A object at 0x7f04a1eb5450> == 2")
    at = reproduce.quoted("```\nE   assert <A object at 0x7f99c0d2e3b0> == 2\n```")
    assert reproduce.matching(moved, at) == reproduce.matching(output, ["assert 0 == 2"])
    assert reproduce.matching("1 passed in 0.01s", quotes) == []


def test_a_real_pytest_run_names_the_test_that_fails_as_quoted(tmp_path):
    root = project(tmp_path)
    words = reproduce.SUITE.split()
    done = subprocess.run(
        [sys.executable, *words[1:]], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1
    assert reproduce.matching(done.stdout, reproduce.quoted(ISSUE)) == [
        "tests/test_m.py::test_pick"
    ]
    raised = reproduce.quoted("```\nE   ValueError: bad input 42\n```")
    found = reproduce.matching(done.stdout, raised)
    assert found == ["tests/test_other.py::TestInput::test_raise"]
    assert reproduce.command(found) == (
        "python -m pytest -q --tb=short tests/test_other.py::TestInput::test_raise"
    )


async def test_a_bug_reported_without_a_test_is_repaired_against_the_tests_that_show_it(
    repo, store
):
    """The request quotes the failure but names no test, and the model only reads: the
    session ran the suite, found the test that fails as quoted (not the other file's,
    which fails its own way), and the repair made the model's own edit that passes it."""
    root = project(repo)
    read = '<read_file path="m.py"/>'
    model = Repairing(["Looking at `pick`.\n" + read, "Fixed: `<=` in `pick`."], KNOWN)
    session = Session(model=model, workspace=LocalWorkspace(root), config=repairing(), traces=store)
    result = await session.run(ISSUE)
    assert result.status == "completed"
    assert (root / "m.py").read_text() == PICK.replace("lo < hi", "lo <= hi")
    turn = result.turns[0]
    assert [c.name for c in turn.calls] == ["read_file", "edit_file"]
    meta = turn.output.meta["repair"]
    assert meta["command"] == "python -m pytest -q --tb=short tests/test_m.py::test_pick"
    assert meta["reproduced"]["suite_s"] > 0
    assert "repair" not in result.turns[1].output.meta  # the check passes now
    assert not list(root.rglob("__pycache__"))  # the suite ran read-only


async def test_nothing_is_run_for_a_failure_no_test_shows_or_with_repair_off(tmp_path):
    root = project(tmp_path)
    read = '<read_file path="m.py"/>'
    for query, cfg in (
        ("Something broke:\n```\nE   KeyError: 'missing'\n```", repairing()),
        (ISSUE, SessionConfig(approve="all")),
        (ISSUE, repairing(reproduce_s=0)),
    ):
        model = Repairing(["Reading.\n" + read, "Done."], KNOWN)
        result = await Session(model=model, workspace=LocalWorkspace(root), config=cfg).run(query)
        assert result.status == "completed"
        assert (root / "m.py").read_text() == PICK, (query, cfg)
        assert all("repair" not in t.output.meta for t in result.turns)


async def test_an_answer_while_the_reproduced_failure_shows_is_sent_back_once(repo):
    """No edit the model proposes passes (the test wants a value no small edit gives):
    its answer goes back once, naming the tests that still fail; the next one ends it."""
    root = project(repo)
    (root / "tests" / "test_m.py").write_text(TESTS.replace("== 2", "== 7"))
    query = ISSUE.replace("0 == 2", "0 == 7")
    model = Repairing(["It is fixed.", "It cannot pass: 7 is not a value `pick` returns."], KNOWN)
    # the trial budget only needs to see the code fail once; no edit can pass
    cfg = SessionConfig(approve="all", repair=True, verify_s=60.0)
    result = await Session(model=model, workspace=LocalWorkspace(root), config=cfg).run(query)
    assert result.status == "completed" and len(result.turns) == 2
    assert result.answer.startswith("It cannot pass")
    sent = [m.content for m in result.turns[1].messages if m.role == "user"][-1]
    assert sent.startswith("`python -m pytest -q --tb=short tests/test_m.py::test_pick`")
    assert "still fails" in sent
    assert (root / "m.py").read_text() == PICK
