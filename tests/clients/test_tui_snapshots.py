"""Snapshot tests of the TUI against the real language server (pytest-textual-snapshot).

Timings never reach the screen here (`show_timings=False`: durations and elapsed time
are masked, spinners are still), sizes are fixed, and the workspace lives at a fixed
path so nothing on screen depends on the run. Update after a deliberate change with
`pytest tests/clients/test_tui_snapshots.py --snapshot-update` and look at the SVGs.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
from opencomposer.clients.tui.screens import ApprovalScreen
from opencomposer.clients.tui.transcript import DiffEntry
from tui_harness import (
    DONE,
    EDIT,
    READ_BOTH,
    RUN_TESTS,
    ask,
    make_app,
    make_script,
    make_workspace,
    session_ended,
    wait_for,
)

FIXED_ROOT = Path("/tmp/opencomposer-tui-snapshots")


@pytest.fixture
def place(request):
    root = FIXED_ROOT / request.node.name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _still(app) -> None:
    app.query_one("#prompt").cursor_blink = False


def _session_app(place: Path, turns: list[str]):
    ws = make_workspace(place / "repo")
    return make_app(ws, make_script(place / "turns.json", turns), place / "home")


async def _accept_after_session(pilot) -> None:
    _still(pilot.app)
    await ask(pilot, "fix add, the test fails")
    await session_ended(pilot)
    entry = pilot.app.query_one(DiffEntry)
    entry.focus()
    await pilot.press("a")
    await wait_for(pilot, lambda: entry.state == "accept", what="accept")
    pilot.app.query_one("#prompt").focus()
    await pilot.pause(0.3)


def test_snapshot_full_session_accepted(place, snap_compare):
    app = _session_app(place, [READ_BOTH, EDIT, DONE])
    assert snap_compare(app, terminal_size=(100, 48), run_before=_accept_after_session)


def test_snapshot_forty_columns(place, snap_compare):
    app = _session_app(place, [READ_BOTH, EDIT, DONE])
    assert snap_compare(app, terminal_size=(40, 60), run_before=_accept_after_session)


def test_snapshot_approval_dialog(place, snap_compare):
    app = _session_app(place, [RUN_TESTS, DONE])

    async def until_dialog(pilot) -> None:
        _still(pilot.app)
        await ask(pilot, "run it")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, ApprovalScreen), what="dialog")
        await pilot.pause(0.5)
        screen = pilot.app.screen
        masked = re.sub(r"\([0-9a-f]{8,}\)", "(session)", screen.message)
        screen.query_one("#approval-message").update(masked)
        pilot.app.session.progress = ""
        pilot.app._refresh_status()
        await pilot.pause(0.1)

    assert snap_compare(app, terminal_size=(80, 24), run_before=until_dialog)


def test_snapshot_server_cannot_start(place, snap_compare):
    ws = make_workspace(place / "repo")
    boom = [
        sys.executable,
        "-c",
        "import sys; sys.stderr.write('unknown model spec: nope\\n'); sys.exit(2)",
    ]
    app = make_app(ws, "nope", place / "home", command=boom)

    async def until_banner(pilot) -> None:
        _still(pilot.app)
        await wait_for(pilot, lambda: pilot.app.server_error is not None, what="banner")
        await pilot.pause(0.2)

    assert snap_compare(app, terminal_size=(60, 16), run_before=until_banner)
