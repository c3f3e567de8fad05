"""The TUI's panels and prompt, against the real language server (Textual Pilot).

The session browser lists traces and submits one as a training task; the search
panel queries the codebase index (slow: it builds the index and loads the embedder);
the prompt keeps a history, completes `@file` mentions, takes multi-line text and
pastes; the command palette lists the app's commands; the theme flips light/dark.

    .venv/bin/python -m pytest tests/clients/test_tui_panels.py -q [-m slow]
"""

from __future__ import annotations

import pytest
from opencomposer.clients.tui.prompt import PromptInput, match_files, workspace_files
from opencomposer.clients.tui.screens import LogScreen, SearchScreen, SessionsScreen
from textual import events
from tui_harness import (
    DONE,
    EDIT,
    ask,
    connected,
    make_app,
    make_script,
    make_workspace,
    screen_text,
    session_ended,
    wait_for,
)


async def test_sessions_browser_submits_a_training_task(tmp_path):
    ws = make_workspace(tmp_path / "repo")
    model = make_script(tmp_path / "turns.json", [EDIT, DONE])
    app = make_app(ws, model, tmp_path / "home")
    async with app.run_test(size=(90, 30)) as pilot:
        await ask(pilot, "fix add")
        await session_ended(pilot)
        await pilot.press("ctrl+o")
        await wait_for(
            pilot,
            lambda: isinstance(app.screen, SessionsScreen) and bool(app.screen.sessions),
            what="sessions",
        )
        screen = app.screen
        assert screen.sessions[0]["session_id"] == app.session.session_id
        assert "fix add" in screen_text(app)
        verify = screen.query_one("#sessions-verify")
        verify.value = "python -m pytest -q test_calc.py"
        verify.focus()
        await pilot.press("enter")
        status = screen.query_one("#sessions-status")
        await wait_for(pilot, lambda: "…" not in str(status.render()), 120, "submit")
        assert "submitted" in str(status.render()), str(status.render())
        assert any("task" in str(n.message).lower() for n in app._notifications)


async def test_sessions_submit_error_is_one_line(tmp_path):
    ws = make_workspace(tmp_path / "repo")
    model = make_script(tmp_path / "turns.json", [DONE])
    app = make_app(ws, model, tmp_path / "home")
    async with app.run_test(size=(90, 30)) as pilot:
        await ask(pilot, "hello")
        await session_ended(pilot)
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: bool(getattr(app.screen, "sessions", None)), what="sessions")
        app.screen.query_one("#sessions-table").focus()
        await pilot.press("s")
        status = app.screen.query_one("#sessions-status")
        await wait_for(
            pilot,
            lambda: "submit" in str(status.render()) and "…" not in str(status.render()),
            30,
            "error",
        )
        assert "Traceback" not in screen_text(app)


@pytest.mark.slow
async def test_search_panel_shows_ranked_results_with_preview(tmp_path):
    ws = make_workspace(tmp_path / "repo")
    model = make_script(tmp_path / "turns.json", [DONE])
    app = make_app(ws, model, tmp_path / "home")
    async with app.run_test(size=(80, 30)) as pilot:
        await connected(pilot)
        await pilot.press("ctrl+f")
        assert isinstance(app.screen, SearchScreen)
        await pilot.press(*"add two numbers", "enter")
        await wait_for(pilot, lambda: bool(app.screen.results), 240, "search results")
        await pilot.pause(0.3)
        paths = [r["path"] for r in app.screen.results]
        assert "calc.py" in paths
        text = screen_text(app)
        assert "def add(a, b):" in text


async def test_log_palette_and_theme(tmp_path):
    ws = make_workspace(tmp_path / "repo")
    model = make_script(tmp_path / "turns.json", [DONE])
    app = make_app(ws, model, tmp_path / "home")
    async with app.run_test(size=(80, 24)) as pilot:
        await connected(pilot)
        titles = [c.title for c in app.get_system_commands(app.screen)]
        for title in (
            "Codebase search",
            "Sessions",
            "Cancel session",
            "Undo session edits",
            "Restart server",
        ):
            assert title in titles
        dark = app.current_theme.dark
        await pilot.press("ctrl+t")
        assert app.current_theme.dark is not dark
        await pilot.press("ctrl+l")
        assert isinstance(app.screen, LogScreen)
        await pilot.press("escape")
        footer = screen_text(app).splitlines()[-1]
        assert "Cancel" in footer and "Search" in footer


async def test_prompt_history_multiline_paste_and_mentions(tmp_path):
    ws = make_workspace(tmp_path / "repo")
    model = make_script(tmp_path / "turns.json", [DONE])
    app = make_app(ws, model, tmp_path / "home")
    async with app.run_test(size=(80, 30)) as pilot:
        await connected(pilot)
        prompt = app.query_one(PromptInput)
        await wait_for(pilot, lambda: bool(prompt.files), what="file list")
        await pilot.press(*"first", "alt+enter", *"line")
        assert prompt.text == "first\nline"
        prompt.clear()
        app.post_message(events.Paste("pasted\nwith newline"))
        await pilot.pause(0.1)
        assert prompt.text == "pasted\nwith newline" and app.session is None  # paste never sends
        prompt.clear()
        await pilot.press(*"look at @calc")
        menu = app.query_one("#mentions")
        assert menu.display and str(menu.get_option_at_index(0).prompt) == "calc.py"
        await pilot.press("tab")
        assert prompt.text == "look at @calc.py " and not menu.display
        await pilot.press("enter")
        await session_ended(pilot)
        await pilot.press(*"draft", "up")
        assert prompt.text == "look at @calc.py "
        await pilot.press("down")
        assert prompt.text == "draft"


def test_file_matching_ranks_names_first(tmp_path):
    ws = make_workspace(tmp_path / "repo")
    files = workspace_files(ws)
    assert files == ["calc.py", "docs/notes.md", "test_calc.py"]
    assert match_files(files, "calc") == ["calc.py", "test_calc.py"]
    assert match_files(files, "NOTES") == ["docs/notes.md"]
    assert match_files(files, "zzz") == []
