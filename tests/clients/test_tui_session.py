"""The TUI against the real language server and the `scripted:` model (Textual Pilot).

Each test starts `python -m opencomposer.server.lsp --stdio` as the TUI's child and
drives the app with key presses: a full session with parallel calls, an edit accepted,
an edit rejected, an approval, a cancel, a server crash and a server that cannot start.

    .venv/bin/python -m pytest tests/clients/test_tui_session.py -q
"""

from __future__ import annotations

import os
import signal
import sys

from opencomposer.clients.tui.screens import ApprovalScreen
from opencomposer.clients.tui.transcript import AssistantEntry, DiffEntry, ToolCard, ToolGroup
from tui_harness import (
    CALC,
    DONE,
    EDIT,
    FIXED,
    READ_BOTH,
    RUN_TESTS,
    ask,
    connected,
    make_app,
    make_script,
    make_workspace,
    screen_text,
    session_ended,
    wait_for,
)


async def test_full_session_parallel_calls_then_accept(tmp_path):
    ws = make_workspace(tmp_path / "repo")
    model = make_script(tmp_path / "turns.json", [READ_BOTH, EDIT, DONE], 4000)
    app = make_app(ws, model, tmp_path / "home")
    async with app.run_test(size=(100, 50)) as pilot:
        await ask(pilot, "fix add")
        await session_ended(pilot)
        assert app.session.status == "completed"
        groups = list(app.query(ToolGroup))
        assert [len(g.children) for g in groups] == [3, 1]
        first = [c for c in groups[0].children if isinstance(c, ToolCard)]
        assert [c.name_ for c in first] == ["read_file", "read_file", "grep"]
        assert all(c.status == "ok" for c in app.query(ToolCard))
        assert groups[0].styles.grid_size_columns == 3  # parallel calls side by side
        texts = [e.shown for e in app.query(AssistantEntry)]
        assert "read_file" not in "".join(texts)  # tool XML is cut from the prose
        assert texts[-1].startswith("Fixed: `add` now adds.")
        assert (ws / "calc.py").read_text() == FIXED  # applied through workspace/applyEdit
        entry = app.query_one(DiffEntry)
        assert entry.path == "calc.py" and "+    return a + b" in entry.diff
        entry.focus()
        await pilot.press("a")
        await wait_for(pilot, lambda: entry.state == "accept", what="accept")
        assert (ws / "calc.py").read_text() == FIXED
        status = str(app.query_one("#status").render())
        assert "turn 3" in status and "completed" in status


async def test_edit_rejected_restores_file(tmp_path):
    ws = make_workspace(tmp_path / "repo")
    model = make_script(tmp_path / "turns.json", [EDIT, DONE])
    app = make_app(ws, model, tmp_path / "home")
    async with app.run_test(size=(80, 40)) as pilot:
        await ask(pilot, "fix add")
        await session_ended(pilot)
        assert (ws / "calc.py").read_text() == FIXED
        entry = app.query_one(DiffEntry)
        entry.focus()
        await pilot.press("r")
        await wait_for(pilot, lambda: entry.state == "reject", what="reject")
        assert (ws / "calc.py").read_text() == CALC


async def test_decision_during_session_waits_for_its_end(tmp_path):
    ws = make_workspace(tmp_path / "repo")
    slow = "Now I wait a little. " * 30 + '<read_file path="calc.py"/>'
    model = make_script(tmp_path / "turns.json", [EDIT, slow, DONE], 150)
    app = make_app(ws, model, tmp_path / "home")
    async with app.run_test(size=(80, 40)) as pilot:
        await ask(pilot, "fix add")
        await wait_for(pilot, lambda: bool(app.query(DiffEntry)), what="diff")
        entry = app.query_one(DiffEntry)
        entry.focus()
        await pilot.press("r")
        assert entry.state == "queued-reject", (app.session, screen_text(app))
        await session_ended(pilot)
        await wait_for(pilot, lambda: entry.state == "reject", what="queued reject")
        assert (ws / "calc.py").read_text() == CALC


async def test_undo_reverts_the_session(tmp_path):
    ws = make_workspace(tmp_path / "repo")
    model = make_script(tmp_path / "turns.json", [EDIT, DONE])
    app = make_app(ws, model, tmp_path / "home")
    async with app.run_test(size=(80, 40)) as pilot:
        await ask(pilot, "fix add")
        await session_ended(pilot)
        await pilot.press("ctrl+g")
        entry = app.query_one(DiffEntry)
        await wait_for(pilot, lambda: entry.state == "reverted", what="undo")
        assert (ws / "calc.py").read_text() == CALC


async def test_approval_dialog_runs_the_command(tmp_path):
    ws = make_workspace(tmp_path / "repo")
    model = make_script(tmp_path / "turns.json", [RUN_TESTS, DONE])
    app = make_app(ws, model, tmp_path / "home")
    async with app.run_test(size=(80, 40)) as pilot:
        await ask(pilot, "run it")
        await wait_for(pilot, lambda: isinstance(app.screen, ApprovalScreen), what="dialog")
        assert 'python -c "print(2 + 3)"' in app.screen.message
        assert app.screen.actions == ["Run", "Always for this command", "Reject"]
        await pilot.press("y")
        await session_ended(pilot)
        card = app.query_one(ToolCard)
        assert card.name_ == "run_terminal" and card.status == "ok"


async def test_approval_rejected(tmp_path):
    ws = make_workspace(tmp_path / "repo")
    model = make_script(tmp_path / "turns.json", [RUN_TESTS, DONE])
    app = make_app(ws, model, tmp_path / "home")
    async with app.run_test(size=(80, 40)) as pilot:
        await ask(pilot, "run it")
        await wait_for(pilot, lambda: isinstance(app.screen, ApprovalScreen), what="dialog")
        await pilot.press("n")
        await session_ended(pilot)
        assert app.query_one(ToolCard).status == "error"


async def test_cancel_key_stops_the_session(tmp_path):
    ws = make_workspace(tmp_path / "repo")
    model = make_script(tmp_path / "turns.json", ["word " * 2000], 200)
    app = make_app(ws, model, tmp_path / "home")
    async with app.run_test(size=(80, 30)) as pilot:
        await ask(pilot, "talk")
        await wait_for(pilot, lambda: any(e.shown for e in app.query(AssistantEntry)), what="text")
        await pilot.press("escape")
        await session_ended(pilot, timeout=20)
        assert app.session.status == "cancelled"
        assert "cancelled" in screen_text(app)


async def test_server_crash_then_restart(tmp_path):
    ws = make_workspace(tmp_path / "repo")
    model = make_script(tmp_path / "turns.json", ["word " * 2000, DONE], 200)
    app = make_app(ws, model, tmp_path / "home")
    async with app.run_test(size=(80, 30)) as pilot:
        await ask(pilot, "talk")
        await wait_for(pilot, lambda: any(e.shown for e in app.query(AssistantEntry)), what="text")
        os.kill(app.link.process.pid, signal.SIGKILL)
        await wait_for(pilot, lambda: app.server_error is not None, what="crash banner")
        await session_ended(pilot)
        text = screen_text(app)
        assert "exited with code -9" in text and "ctrl+r to restart" in text
        assert "Traceback" not in text
        assert app.session.status == "interrupted"
        await pilot.press("ctrl+r")
        await connected(pilot)
        assert not app.query_one("#banner").display


async def test_server_that_cannot_start(tmp_path):
    ws = make_workspace(tmp_path / "repo")
    boom = [
        sys.executable,
        "-c",
        "import sys; sys.stderr.write('no such model: x\\n'); sys.exit(3)",
    ]
    app = make_app(ws, "x", tmp_path / "home", command=boom)
    async with app.run_test(size=(40, 20)) as pilot:
        await wait_for(pilot, lambda: app.server_error is not None, what="start failure")
        assert "exited with code 3: no such model: x" in app.server_error
        await wait_for(pilot, lambda: "ctrl+r" in screen_text(app), what="the restart banner")
        assert "Traceback" not in screen_text(app)
        await pilot.press("enter")  # sending while down is a notice, not a crash
        assert app.session is None


async def test_empty_prompt_is_refused(tmp_path):
    ws = make_workspace(tmp_path / "repo")
    model = make_script(tmp_path / "turns.json", [DONE])
    app = make_app(ws, model, tmp_path / "home")
    async with app.run_test(size=(80, 24)) as pilot:
        await connected(pilot)
        await pilot.press("space", "enter")
        await pilot.pause(0.2)
        assert app.session is None
        assert any("Type a request" in str(n.message) for n in app._notifications)


async def test_megabyte_file_read_keeps_the_ui_responsive(tmp_path):
    ws = make_workspace(tmp_path / "repo")
    (ws / "big.txt").write_text(("x" * 99 + "\n") * 10_500)
    read = '<read_file path="big.txt"/>'
    model = make_script(tmp_path / "turns.json", [read, DONE])
    app = make_app(ws, model, tmp_path / "home")
    async with app.run_test(size=(80, 30)) as pilot:
        await ask(pilot, "read the big file")
        await session_ended(pilot)
        assert app.session.status == "completed"
        await pilot.press(*"still typing")
        assert app.query_one("#prompt").text == "still typing"
