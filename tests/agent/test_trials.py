"""Candidate edits tried in one forked pytest run (`agent/trials.py`): which commands
it takes, a real run in the sandbox with each kind of verdict, and a session whose
repair uses it and still keeps only what a real trial run passes."""

from pathlib import Path

from opencomposer.agent import repair, trials
from opencomposer.agent.session import Session
from opencomposer.tools.protocols import SandboxConfig
from opencomposer.tools.sandbox import bwrap_path, run_sandboxed
from opencomposer.tools.workspace import LocalWorkspace

from tests.agent.test_repair import KNOWN, PICK, Repairing, edit, repairing, run

TEST = "from m import pick\n\n\ndef test_pick():\n    assert pick(2, 2) == 2 and pick(3, 1) == 0\n"
CHECK = "python -m pytest -q -p no:cacheprovider test_m.py"


def test_only_a_plain_pytest_command_is_run_forked():
    p = trials.plan("PYTHONPATH=src:.deps python3 -m pytest -x -q 'tests/test a.py'")
    assert p == trials.Plan(("PYTHONPATH=src:.deps",), "python3", True, ("-x", "-q", "tests/test a.py"))  # fmt: skip
    assert trials.plan(".venv/bin/pytest -k pick") == trials.Plan((), "python", False, ("-k", "pick"))  # fmt: skip
    for command in (
        "python -m pytest -q | tail",
        "cd src && pytest",
        "python -c 'import m'",
        "python -m unittest",
        "X=$HOME pytest",
        "pytest 'unclosed",
        "",
    ):
        assert trials.plan(command) is None, command


def workspace(root: Path) -> Path:
    root.mkdir()
    (root / "m.py").write_text(PICK)
    (root / "other.py").write_text("def other():\n    return 1\n")
    (root / "test_m.py").write_text(TEST)
    return root


async def forked(root: Path, command: str, candidates, each_s=5.0, stop_after=4):
    assert bwrap_path(), "bubblewrap is missing: run `make system-deps`"
    config = SandboxConfig(mode="read-only")

    async def go(line: str, folder: Path) -> None:
        await run_sandboxed(line, root=root, config=config, files={}, scratch=folder)

    return await trials.forked(
        command, str(root), candidates, go, each_s=each_s, stop_after=stop_after
    )


async def test_each_candidate_gets_its_own_verdict(tmp_path):
    root = workspace(tmp_path / "repo")
    wrong = {"m.py": PICK.replace("return lo", "return hi")}
    right = {"m.py": PICK.replace("lo < hi", "lo <= hi")}
    unread = {"other.py": "def other():\n    return 2\n"}  # no test imports it
    stuck = {"m.py": PICK.replace("    if lo < hi:", "    while True:\n        pass\n    if 1:")}
    broken = {"m.py": PICK.replace("if lo", "if (lo")}
    got = await forked(root, CHECK, [wrong, right, unread, stuck, broken], each_s=3.0)
    assert got == [False, True, None, False, False]
    assert (root / "m.py").read_text() == PICK
    assert not list(root.rglob("__pycache__"))  # the run wrote nothing in the workspace


async def test_the_run_stops_after_enough_have_passed(tmp_path):
    root = workspace(tmp_path / "repo")
    right = {"m.py": PICK.replace("lo < hi", "lo <= hi")}
    wrong = {"m.py": PICK.replace("return lo", "return hi")}
    got = await forked(root, CHECK, [right, wrong, wrong, wrong, wrong], stop_after=1)
    # two run side by side: the first pass ends the run once those running are done
    assert got[0] is True and got[3:] == [None, None]


async def test_no_verdicts_when_the_code_passes_or_the_command_is_not_plain_pytest(tmp_path):
    root = workspace(tmp_path / "repo")
    right = {"m.py": PICK.replace("lo < hi", "lo <= hi")}
    (root / "m.py").write_text(right["m.py"])
    # the code as it is passes here: what the run says of a candidate cannot be trusted
    assert await forked(root, CHECK, [right]) is None
    assert await forked(root, f"{CHECK} | tail -1", [right]) is None
    # options before `-m pytest`: not a command the forked run knows how to start
    assert await forked(root, "python -I -m pytest -q test_m.py", [right]) is None
    # a test file that is not there fails every run alike (a usage error): the run
    # stops at once
    (root / "m.py").write_text(PICK)
    assert await forked(root, "python -m pytest -q test_missing.py", [right] * 50) is None


async def test_a_forked_pass_is_kept_only_after_a_real_trial_run_passes(repo, store, monkeypatch):
    """Every candidate said to pass a forked run still gets a real trial run before it is
    kept: with runs that say each first candidate passes, the repair keeps the one that
    truly does."""
    (repo / "m.py").write_text(PICK)
    (repo / "test_m.py").write_text(TEST)
    wrong = edit("        return lo", "        return hi")

    async def all_pass(command, root, candidates, run, **kw):
        return [True] + [None] * (len(candidates) - 1)  # it stops at its first pass

    model = Repairing([run(CHECK), "A fix.\n" + wrong, "Fixed."], KNOWN)
    cfg = repairing()
    monkeypatch.setattr(trials, "forked", all_pass)
    result = await Session(model=model, workspace=LocalWorkspace(repo), config=cfg).run("fix")
    assert (repo / "m.py").read_text() == PICK.replace("lo < hi", "lo <= hi")
    meta = result.turns[1].output.meta["repair"]
    # a forked round a candidate: each says its first passes, and the real run says no,
    # until the one that truly passes
    assert meta["forked"]["rounds"] == meta["forked"]["passed"] == meta["runs"] - 1 >= 1
    # and each it turned down is counted as failing the command
    assert meta.get("turned_down", {}).get("failed", 0) == meta["forked"]["rounds"] - 1


async def test_a_repair_tries_only_what_passed_its_forked_run(repo, store):
    (repo / "m.py").write_text(PICK)
    (repo / "test_m.py").write_text(TEST)
    wrong = edit("        return lo", "        return hi")
    model = Repairing([run(CHECK), "A fix.\n" + wrong, "Fixed."], KNOWN)
    cfg = repairing()
    session = Session(model=model, workspace=LocalWorkspace(repo), config=cfg, traces=store)
    result = await session.run("fix pick")
    assert (repo / "m.py").read_text() == PICK.replace("lo < hi", "lo <= hi")
    meta = result.turns[1].output.meta["repair"]
    forked = meta["forked"]
    assert forked["rounds"] >= 1 and forked["passed"] >= 1 and forked["failed"] >= 1
    # the change's own run, then a real run only for what passed a forked run
    assert meta["runs"] <= 1 + forked["passed"] + forked["unknown"]


# a bug that two tests of the file catch; the failing one alone names one of them
BOTH = (
    "from m import pick\n\n\n"
    "def test_pick():\n    assert pick(2, 2) == 2\n\n\n"
    "def test_same():\n    assert pick(5, 5) == 5\n\n\n"
    "def test_less():\n    assert pick(1, 3) == 1\n"
)
ONE = "python -m pytest -q -p no:cacheprovider test_m.py::test_pick"


async def both_caught(repo, monkeypatch, candidates: list[tuple[str, str]]):
    """A session whose check is ONE, with `candidates` ((old, new) lines of m.py)
    proposed in that order."""
    (repo / "m.py").write_text(PICK)
    (repo / "test_m.py").write_text(BOTH)

    async def proposed(*args, **kw):
        return [
            repair.Proposal("m.py", PICK.replace(old, new), old, new, 0.0, exact=False)
            for old, new in candidates
        ]

    monkeypatch.setattr(repair, "propose", proposed)
    read = '<read_file path="m.py"/>'
    model = Repairing([run(ONE), "Reading.\n" + read, "Fixed."], KNOWN)
    cfg = repairing()
    result = await Session(model=model, workspace=LocalWorkspace(repo), config=cfg).run("fix")
    return (repo / "m.py").read_text(), result.turns[1].output.meta["repair"]


# passes test_pick (pick(2, 2) == 2), not test_same; breaks nothing that passed
NARROW = ("    return 0\n", "    return 2\n")
RIGHT = ("    if lo < hi:\n", "    if lo <= hi:\n")


async def test_an_edit_that_passes_every_test_of_the_file_is_preferred(repo, monkeypatch):
    """The first edit passes the failing test but leaves test_same, which the bug
    fails too, failing: the repair goes on and keeps the later edit that passes both."""
    text, meta = await both_caught(repo, monkeypatch, [NARROW, RIGHT])
    assert text == PICK.replace(*RIGHT)
    assert meta["turned_down"]["partial"] == 1 and "gain" in meta


async def test_an_edit_that_leaves_the_bug_caught_by_another_test_is_not_made(repo, monkeypatch):
    text, meta = await both_caught(repo, monkeypatch, [NARROW])
    assert text == PICK and meta["turned_down"]["partial"] == 1 and "gain" not in meta


async def held_session(repo, monkeypatch, check: str, twice: bool = False, **config):
    """A session whose model reproduces the failure with `check`, sends a wrong change
    (`twice`: the same edit twice, the second of which cannot apply) with a rerun, then
    reads m.py; the one edit proposed is wrong too."""
    (repo / "m.py").write_text(PICK)
    (repo / "test_m.py").write_text(BOTH)
    wrong = PICK.replace("        return lo", "        return hi")

    async def proposed(*args, **kw):
        known = kw.get("known") or (lambda path, after: False)
        if known("m.py", wrong):
            return []
        return [repair.Proposal("m.py", wrong, "        return lo", "        return hi", 0.0)]

    monkeypatch.setattr(repair, "propose", proposed)
    change = "A fix.\n" + edit("    return 0", "    return 1") * (1 + twice) + "\n" + run(check)
    model = Repairing([run(check), change, 'Reading.\n<read_file path="m.py"/>', "Done."], KNOWN)
    cfg = repairing(**config)
    return await Session(model=model, workspace=LocalWorkspace(repo), config=cfg).run("fix")


async def test_a_change_that_still_fails_the_test_is_not_made_when_no_edit_passes(
    repo, monkeypatch
):
    """The change and the one proposed edit both fail the test: the change is not made,
    its call says why, the rerun after it runs, and the next repair, of the same code,
    knows the edit failed."""
    for twice in (False, True):
        result = await held_session(repo, monkeypatch, ONE, twice=twice)
        assert (repo / "m.py").read_text() == PICK
        *changes, rerun = result.turns[1].calls
        assert len(changes) == 1 + twice
        for change in changes:
            assert change.result.status == "error"
            assert change.result.output.startswith("not made:") and ONE in change.result.output
        assert rerun.result.meta["exit_code"] != 0  # it ran, on the code as it was
        assert result.turns[1].output.meta["repair"]["held_back"] == 1 + twice
        assert result.turns[2].output.meta["repair"]["known_failed"] == 1


async def test_a_failing_change_is_made_when_holding_is_off_or_the_check_names_no_test(
    repo, monkeypatch
):
    for check, config in (
        (ONE, {"hold_failing": False}),
        # not a pytest run: what it fails is not known to be the bug's tests
        ("python3 -c 'import m; assert m.pick(2, 2) == 2'", {}),
    ):
        result = await held_session(repo, monkeypatch, check, **config)
        assert "return 1" in (repo / "m.py").read_text(), check
        assert result.turns[1].calls[0].result.status == "ok"
        assert "held_back" not in result.turns[1].output.meta["repair"]
        # the code changed: the edit that failed before is tried again
        assert "known_failed" not in result.turns[2].output.meta.get("repair", {})


async def test_a_pytest_run_of_no_test_does_not_replace_the_failing_check(repo, monkeypatch):
    """The model runs the failing test, and beside it a test file that is not there
    (pytest's exit 4: no test ran): the repair still tries its edits against the test
    that failed, the only run that checked the code."""
    (repo / "m.py").write_text(PICK)
    (repo / "test_m.py").write_text(BOTH)

    async def proposed(*args, **kw):
        return [repair.Proposal("m.py", PICK.replace(*RIGHT), *RIGHT, 0.0)]

    monkeypatch.setattr(repair, "propose", proposed)
    missing = "python -m pytest -q -p no:cacheprovider test_missing.py"
    read = '<read_file path="m.py"/>'
    model = Repairing(
        ["Running.\n" + run(ONE) + run(missing), "Reading.\n" + read, "Fixed."], KNOWN
    )
    cfg = repairing()
    result = await Session(model=model, workspace=LocalWorkspace(repo), config=cfg).run("fix")
    assert result.turns[0].calls[1].result.meta["exit_code"] == 4
    assert result.turns[1].output.meta["repair"]["command"] == ONE
    assert (repo / "m.py").read_text() == PICK.replace(*RIGHT)


def one_at_a_time(monkeypatch, candidates: list[tuple[str, str]]) -> None:
    """`repair.propose` as a model with `candidates` in that order: the first one not
    yet known to have failed, or none."""

    async def proposed(*args, **kw):
        known = kw.get("known") or (lambda path, after: False)
        for old, new in candidates:
            if not known("m.py", PICK.replace(old, new)):
                return [repair.Proposal("m.py", PICK.replace(old, new), old, new, 0.0)]
        return []

    monkeypatch.setattr(repair, "propose", proposed)


async def refused_every_turn(repo, turns: int) -> tuple[Session, object]:
    """A session whose model reproduces the failure, then sends the same wrong change
    and rerun every turn (each change refused, each rerun failing alike) until the
    test passes, then answers."""
    (repo / "m.py").write_text(PICK)
    (repo / "test_m.py").write_text(BOTH)
    change = "A fix.\n" + edit("    return 0", "    return 1") + "\n" + run(ONE)

    def reply(messages):
        return "Fixed." if "exit code 0" in messages[-1].content else change

    model = Repairing([run(ONE)] + [reply] * turns, KNOWN)
    cfg = repairing(max_turns=turns + 1)
    session = Session(model=model, workspace=LocalWorkspace(repo), config=cfg)
    return session, await session.run("fix")


WRONG = [("        return lo", f"        return lo + {n}") for n in range(1, 4)]


async def test_a_repair_that_rules_out_candidates_keeps_a_repeating_model_going(repo, monkeypatch):
    """The same refused change and failing rerun, turn after turn, would end the session
    as a loop after three turns; while each turn's repair rules out a candidate, the
    session goes on, and the repair reaches the fix."""
    one_at_a_time(monkeypatch, [*WRONG, RIGHT])
    _, result = await refused_every_turn(repo, 6)
    assert result.status == "completed" and result.answer == "Fixed."
    assert (repo / "m.py").read_text() == PICK.replace(*RIGHT)
    metas = [t.output.meta["repair"] for t in result.turns[1:-1]]
    # three turns alike, each with a change refused: a loop, but for the repair
    assert [m["ruled_out"] for m in metas[:3]] == [1] * 3
    assert all(m["held_back"] == 1 for m in metas[:3]) and "gain" in metas[3]


async def test_a_repair_that_rules_out_nothing_lets_the_loop_end_the_session(repo, monkeypatch):
    """Once the repair has no candidate left to rule out, the turns repeat, and three
    of them end the session as a loop."""
    one_at_a_time(monkeypatch, WRONG[:1])
    _, result = await refused_every_turn(repo, 8)
    assert result.status == "repetition" and "3 turns in a row" in result.error
    assert (repo / "m.py").read_text() == PICK
    assert [t.output.meta["repair"].get("ruled_out", 0) for t in result.turns[1:]] == [1, 0, 0, 0]
