"""`opencomposer tui` in a real terminal (tmux), prompt to accepted edit, `scripted:` model.

The same script that runs the embedded model by hand
(`python -m opencomposer.clients.tui.demo_driver --model smollm2`), here with a
scripted model so it takes seconds. Skipped where tmux is not installed.

    .venv/bin/python -m pytest tests/clients/test_tui_demo_driver.py -q
"""

from __future__ import annotations

import json
import shutil

import pytest
from opencomposer.clients.tui import demo_driver

FIX = (
    "The subtotal ignores quantities.\n"
    '<edit_file path="shop/cart.py">\n'
    "<old>        return sum(item.price for item in self.items)</old>\n"
    "<new>        return sum(item.price * item.quantity for item in self.items)</new>\n"
    "</edit_file>"
)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_demo_driver_prompt_to_accepted_edit(tmp_path, capsys):
    turns = tmp_path / "turns.json"
    turns.write_text(
        json.dumps(
            {
                "turns": ['Reading.\n<read_file path="shop/cart.py"/>', FIX, "Fixed."],
                "chars_per_second": 400,
            }
        )
    )
    code = demo_driver.main(
        ["--model", f"scripted:{turns}", "--timeout", "120", "--out", str(tmp_path / "out")]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    screen = (tmp_path / "out" / "final_screen.txt").read_text()
    assert "✎ shop/cart.py  accepted" in screen
    assert "■ session completed" in screen
    assert "+        return sum(item.price * item.quantity for item in self.items)" in out
    assert "result: accepted edit" in out
    assert "sample's tests after the edit: pass (3 passed" in out


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_demo_driver_reports_a_session_without_an_edit(tmp_path, capsys):
    turns = tmp_path / "turns.json"
    turns.write_text(json.dumps({"turns": ["Nothing to change."]}))
    code = demo_driver.main(["--model", f"scripted:{turns}", "--timeout", "120"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "result: no accepted edit: the session ended without an edit to accept" in out
