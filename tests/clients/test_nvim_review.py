"""The Neovim plugin's review and follow-ups, in real headless Neovim against the
real server (`nvim_review.lua` drives it; the `scripted:` model plays the agent).

Guards: edits that land without a reviewable diff, a hunk reject that reverts the
wrong lines or the whole file, an accept that changes the buffer, decisions that
never reach the trace, a follow-up that starts a new session (or loses the first
request's history), an undo that misses a request's edits, and `:OpenComposerNew`
that continues the old session.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
REPO = HERE.parents[1]
CALC = (
    "def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    "def mul(a, b):\n    return a / b\n"
)
TEST_CALC = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"


def edit(path: str, old: str, new: str) -> str:
    return f'<edit_file path="{path}">\n<old>{old}</old>\n<new>{new}</new>\n</edit_file>'


TURNS = [
    "Fixing both.\n"
    + edit("calc.py", "def add(a, b):\n    return a - b", "def add(a, b):\n    return a + b")
    + "\n"
    + edit("calc.py", "    return a / b", "    return a * b")
    + "\n"
    + edit("test_calc.py", "== 5", "== 5  # checked"),
    "Fixed add and mul.",
    edit("calc.py", "def add(a, b):\n", 'def add(a, b):\n    """The sum."""\n'),
    "Documented add.",
]


def run_nvim(
    tmp_path: Path, script: str, turns: list[str], cps: float = 0
) -> tuple[dict, Path, Path]:
    root = tmp_path / "repo"
    root.mkdir()
    (root / "calc.py").write_text(CALC)
    (root / "test_calc.py").write_text(TEST_CALC)
    model = tmp_path / "turns.json"
    model.write_text(json.dumps({"turns": turns, "chars_per_second": cps}))
    out, home = tmp_path / "out.json", tmp_path / "home"
    env = dict(os.environ)
    env.update(
        OC_PLUGIN=str(REPO / "clients" / "nvim"),
        OC_ROOT=str(root),
        OC_PYTHON=sys.executable,
        OC_MODEL=f"scripted:{model}",
        OC_OUT=str(out),
        OPENCOMPOSER_HOME=str(home),
        HOME=str(tmp_path),
    )
    proc = subprocess.run(
        ["nvim", "--headless", "--clean", "-n", "-u", str(HERE / script)],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.exists(), (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    got = json.loads(out.read_text())
    assert "error" not in got, got
    return got, root, home


@pytest.mark.skipif(shutil.which("nvim") is None, reason="needs nvim (apt-get install neovim)")
def test_review_hunks_files_follow_ups_and_undo(tmp_path: Path) -> None:
    got, _, home = run_nvim(tmp_path, "nvim_review.lua", TURNS)
    assert got["errors"] == []  # every decide and undo answered without an error
    first, second, third = got["first"], got["second"], got["third"]
    assert first["status"] == "completed" and first["answer"] == "Fixed add and mul."

    # the edits landed, and show as two hunks: added lines highlighted, removed lines
    # as virtual lines above them, a hint naming the keys
    landed = CALC.replace("a - b", "a + b", 1).replace("a / b", "a * b")
    assert got["calc_landed"] == landed.splitlines()
    assert got["hunks"] == [
        {"a": 2, "na": 1, "b": 2, "nb": 1},
        {"a": 10, "na": 1, "b": 10, "nb": 1},
    ]
    added = sorted((m["row"], m["end_row"]) for m in got["marks"] if m.get("hl") == "DiffAdd")
    assert added == [(1, 2), (9, 10)]
    removed = [m for m in got["marks"] if m["virt_lines"]]
    assert [(m["row"], m["virt_lines"], m["above"]) for m in removed] == [
        (1, ["    return a - b|DiffDelete"], True),
        (9, ["    return a / b|DiffDelete"], True),
    ]
    assert ",a accept · ,r reject" in removed[0]["hint"]
    split = "\n".join(got["split"])
    assert "Fixing both." in split and "<edit_file" not in split  # prose, not XML
    assert "> fix add and mul" in split and "✎ calc.py" in split
    assert got["opened"] == [True, 2]  # <CR> on "✎ calc.py": the file, at its first hunk

    # reject hunk 1 (mapping), ]h to hunk 2, accept it (command): one revert, one kept
    after = CALC.replace("a / b", "a * b").splitlines()
    assert got["after_reject"] == after
    assert [m["row"] for m in got["marks_after_reject"] if m.get("hl")] == [9]
    assert got["cursor_after_jump"] == 10
    assert got["after_accept"] == after and got["calc_settled"] is True
    assert got["marks_after_accept"] == [] and got["calc_modified"] is False
    assert got["calc_disk"] == after  # the buffer had been saved: the revert is saved too
    # test_calc.py rejected as a file: back as before
    assert got["test_landed"][-1].endswith("# checked")
    assert got["test_after_reject"] == TEST_CALC.splitlines()

    # the follow-up continued the session; its edit is under review against the
    # file as the user left it
    assert second["session_id"] == first["session_id"]
    assert second["answer"] == "Documented add."
    assert got["hunks_follow_up"] == [{"a": 2, "na": 0, "b": 2, "nb": 1}]
    assert any("follow-up 2 in session" in line for line in got["split_follow_up"])

    # undo: the whole session, both requests
    assert sorted(got["undo"]["reverted"]) == ["calc.py", "test_calc.py"]
    assert got["calc_after_undo"] == CALC.splitlines() and got["review_left"] == []
    assert got["disk_after_undo"] == {
        "calc": CALC.splitlines(),
        "test": TEST_CALC.splitlines(),
    }

    # :OpenComposerNew: a fresh session, without history (the model starts from turn 1)
    assert third["session_id"] != first["session_id"]
    assert third["answer"] == "Fixed add and mul."
    assert "new session" in "\n".join(got["split_end"])

    with sqlite3.connect(home / "traces.db") as db:
        turns = db.execute(
            "SELECT turn FROM turns WHERE session_id=? ORDER BY turn", (first["session_id"],)
        ).fetchall()
    assert [t for (t,) in turns] == [1, 2, 3, 4]


@pytest.mark.skipif(shutil.which("nvim") is None, reason="needs nvim (apt-get install neovim)")
def test_a_decision_while_the_agent_runs_waits_for_the_end(tmp_path: Path) -> None:
    # ~2,600 characters at 1,000/s; the letter varies, so the repetition guard sees no count
    slow = " ".join(f"w{chr(97 + (i * 2654435761 >> 9) % 26)}rd{i}" for i in range(300))
    turns = [TURNS[0], slow]
    got, _, home = run_nvim(tmp_path, "nvim_review_running.lua", turns, cps=1000)
    assert got["errors"] == [] and got["running_at_accept"] is True
    assert got["queued"] == 2  # calc.py and test_calc.py, held until the request ended
    with sqlite3.connect(home / "traces.db") as db:
        rows = db.execute(
            "SELECT DISTINCT path, decision FROM edits WHERE session_id=?",
            (got["result"]["session_id"],),
        ).fetchall()
    assert sorted(rows) == [("calc.py", "accept"), ("test_calc.py", "accept")]
