"""Shared pieces of the TUI tests: a sample workspace, scripted turns, waiting helpers.

Every app here starts the REAL language server (`python -m opencomposer.server.lsp
--stdio --model scripted:FILE`) as a child, exactly as `opencomposer tui` does.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from opencomposer.clients.tui.app import OpenComposerApp

CALC = "def add(a, b):\n    return a - b\n"
TEST_CALC = "from calc import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n"
FIXED = CALC.replace("a - b", "a + b")

READ_BOTH = (
    "I'll read the code and the test together.\n"
    '<read_file path="calc.py"/>\n<read_file path="test_calc.py"/>\n'
    '<grep pattern="def add" path="."/>'
)
EDIT = (
    "The bug is the **minus** sign.\n"
    '<edit_file path="calc.py">\n<old>    return a - b</old>\n<new>    return a + b</new>\n</edit_file>'
)
RUN_TESTS = 'Let me run the tests.\n<run_terminal>\n<command>python -c "print(2 + 3)"</command>\n</run_terminal>'
DONE = "Fixed: `add` now adds.\n\n- one edit to `calc.py`"


def make_workspace(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "calc.py").write_text(CALC)
    (root / "test_calc.py").write_text(TEST_CALC)
    (root / "docs").mkdir(exist_ok=True)
    (root / "docs" / "notes.md").write_text("# Notes\n")
    return root


def make_script(path: Path, turns: list[str], chars_per_second: float = 0) -> str:
    path.write_text(json.dumps({"turns": turns, "chars_per_second": chars_per_second}))
    return f"scripted:{path}"


def make_app(workspace: Path, model: str, home: Path, **kwargs) -> OpenComposerApp:
    env = {"OPENCOMPOSER_HOME": str(home)}
    return OpenComposerApp(workspace=workspace, model=model, env=env, show_timings=False, **kwargs)


async def wait_for(pilot, cond: Callable[[], bool], timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        await pilot.pause(0.05)


async def connected(pilot) -> None:
    await wait_for(
        pilot, lambda: pilot.app.connected or pilot.app.server_error, what="server start"
    )
    assert pilot.app.connected, pilot.app.server_error


async def ask(pilot, text: str) -> None:
    await connected(pilot)
    pilot.app.query_one("#prompt").load_text(text)
    await pilot.press("enter")
    await wait_for(pilot, lambda: pilot.app.session is not None, what="session start")


async def session_ended(pilot, timeout: float = 60.0) -> None:
    await wait_for(
        pilot,
        lambda: pilot.app.session is not None and pilot.app.session.ended is not None,
        timeout,
        "session end",
    )
    await pilot.pause(0.2)


def screen_text(app) -> str:
    """The visible characters of the screen, row by row (for readable assertions)."""
    import html
    import re

    rows: dict[float, list[tuple[float, str]]] = {}
    pattern = r'<text class="[^"]*" x="([\d.]+)" y="([\d.]+)" textLength="[\d.]+" clip-path="[^"]*">(.*?)</text>'
    for m in re.finditer(pattern, app.export_screenshot()):
        text = html.unescape(m.group(3)).replace("\xa0", " ")
        rows.setdefault(float(m.group(2)), []).append((float(m.group(1)), text))
    lines = []
    for y in sorted(rows):
        line = ""
        for x, text in sorted(rows[y]):
            line = line.ljust(round(x / 12.2)) + text
        lines.append(line.rstrip())
    return "\n".join(lines)
