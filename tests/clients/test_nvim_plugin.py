"""Real headless Neovim with the plugin in clients/nvim against the real server:
the agent's edit lands in the buffer (and, the buffer being clean, on disk), the
approval goes through vim.ui.select, the session streams into the split, and
:OpenComposerUndo-style undo puts the buffer back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
REPO = HERE.parents[1]
CALC = "def add(a, b):\n    return a - b\n"
TURNS = [
    'Fixing add.\n<edit_file path="calc.py">\n<old>    return a - b</old>\n<new>    return a + b</new>\n</edit_file>',
    "<run_terminal><command>echo ran > ran.txt</command></run_terminal>",
    "Fixed the bug in add.",
]


@pytest.mark.skipif(shutil.which("nvim") is None, reason="needs nvim (apt-get install neovim)")
def test_nvim_plugin_applies_the_agent_edit_to_the_buffer(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    root.mkdir()
    (root / "calc.py").write_text(CALC)
    model = tmp_path / "turns.json"
    model.write_text(json.dumps({"turns": TURNS, "chars_per_second": 0}))
    out = tmp_path / "out.json"
    env = dict(os.environ)
    env.update(
        OC_PLUGIN=str(REPO / "clients" / "nvim"),
        OC_ROOT=str(root),
        OC_PYTHON=sys.executable,
        OC_MODEL=f"scripted:{model}",
        OC_OUT=str(out),
        OPENCOMPOSER_HOME=str(tmp_path / "home"),
        HOME=str(tmp_path),  # no user config, shada or swap files of the person running the tests
    )
    proc = subprocess.run(
        ["nvim", "--headless", "--clean", "-n", "-u", str(HERE / "nvim_session.lua")],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.exists(), (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    got = json.loads(out.read_text())
    assert "error" not in got, got
    assert got["steps"] == ["attached=true", "done=true"], got
    assert got["result"]["status"] == "completed"
    assert got["result"]["answer"] == "Fixed the bug in add."
    assert got["buffer"] == ["def add(a, b):", "    return a + b"]
    assert got["modified"] is False  # the buffer was clean, so the plugin wrote it
    assert got["disk"] == got["buffer"]
    (select,) = got["selects"]
    assert "echo ran > ran.txt" in select["prompt"]
    assert select["titles"] == ["Run", "Always for this command", "Reject"]
    assert (root / "ran.txt").read_text().strip() == "ran"
    split = "\n".join(got["split"])
    assert "▶ edit_file" in split and "✎ calc.py" in split and "— completed" in split
    assert "Fixing add." in split and "<edit_file" not in split  # prose, not the call's XML
    assert got["after_undo"] == ["def add(a, b):", "    return a - b"]
    assert (root / "calc.py").read_text() == CALC
