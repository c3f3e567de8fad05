"""The TUI continues its session: a second request is a follow-up (same session id,
the agent sees the history), ctrl+s or `/new` starts a new session, and `c` in the
sessions list (ctrl+o) continues a past one.

Real language server, `scripted:` model (it plays the turn numbered by the assistant
messages in the prompt, so a follow-up that lost its history would replay turn 1).

    .venv/bin/python -m pytest tests/clients/test_tui_followup.py -q
"""

from __future__ import annotations

import json
import sqlite3

from opencomposer.clients.tui.screens import SessionsScreen
from opencomposer.clients.tui.transcript import AssistantEntry, DiffEntry, NoteEntry
from tui_harness import (
    CALC,
    DONE,
    EDIT,
    FIXED,
    connected,
    make_app,
    make_script,
    make_workspace,
    screen_text,
    session_ended,
    wait_for,
)

SECOND = "It returned the difference; now it returns the sum."


async def send(pilot, text: str) -> None:
    await connected(pilot)
    pilot.app.query_one("#prompt").load_text(text)
    await pilot.press("enter")
    query = text.removeprefix("/new ")
    await wait_for(pilot, lambda: getattr(pilot.app.session, "query", None) == query, what=text)
    await session_ended(pilot)


def trace_turns(home, session_id: str) -> list[list[dict]]:
    with sqlite3.connect(home / "traces.db") as db:
        rows = db.execute(
            "SELECT messages FROM turns WHERE session_id=? ORDER BY turn", (session_id,)
        ).fetchall()
    return [json.loads(r[0]) for r in rows]


async def test_a_second_request_follows_up_and_ctrl_s_starts_a_new_session(tmp_path):
    ws = make_workspace(tmp_path / "repo")
    home = tmp_path / "home"
    app = make_app(ws, make_script(tmp_path / "turns.json", [EDIT, DONE, SECOND]), home)
    async with app.run_test(size=(100, 50)) as pilot:
        await send(pilot, "fix add")
        first = app.session.session_id
        assert app.session.status == "completed" and app.conversation == first
        await send(pilot, "what did it return before?")
        assert app.session.session_id == first and app.session.request == 2
        assert app.session.status == "completed"
        assert [e.shown for e in app.query(AssistantEntry)][-1].startswith(SECOND)
        assert "request 2" in str(app.query_one("#status").render())
        follow_up_prompt = trace_turns(home, first)[2]
        assert [m["content"] for m in follow_up_prompt if m["role"] == "user"][0] == "fix add"
        # undo covers the session: the first request's edit goes back
        assert (ws / "calc.py").read_text() == FIXED
        await pilot.press("ctrl+g")
        await wait_for(pilot, lambda: (ws / "calc.py").read_text() == CALC, what="undo")
        assert all(d.state == "reverted" for d in app.query(DiffEntry))

        await pilot.press("ctrl+s")
        assert app.conversation is None
        assert any("new session" in str(n.render()) for n in app.query(NoteEntry))
        assert "New session" in screen_text(app)  # in the footer
        await send(pilot, "fix add again")
        assert app.session.session_id != first
        assert app.session.request == 1 and app.session.status == "completed"
        assert (ws / "calc.py").read_text() == FIXED  # turn 1 played again: a new session
        assert app.conversation == app.session.session_id


async def test_slash_new_starts_a_new_session_with_the_request_after_it(tmp_path):
    ws = make_workspace(tmp_path / "repo")
    app = make_app(ws, make_script(tmp_path / "turns.json", [DONE]), tmp_path / "home")
    async with app.run_test(size=(100, 40)) as pilot:
        await send(pilot, "hello")
        first = app.session.session_id
        await send(pilot, "/new hello again")
        assert app.session.query == "hello again"
        assert app.session.session_id not in (None, first) and app.session.request == 1


async def test_the_sessions_list_continues_a_past_session(tmp_path):
    ws = make_workspace(tmp_path / "repo")
    app = make_app(ws, make_script(tmp_path / "turns.json", [DONE, SECOND]), tmp_path / "home")
    async with app.run_test(size=(100, 40)) as pilot:
        await send(pilot, "hello")
        first = app.session.session_id
        await pilot.press("ctrl+s")
        assert app.conversation is None
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: isinstance(app.screen, SessionsScreen), what="sessions")
        await wait_for(pilot, lambda: app.screen.sessions, what="the list")
        await pilot.press("c")
        await wait_for(pilot, lambda: app.conversation == first, what="continue")
        await send(pilot, "and then?")
        assert app.session.session_id == first and app.session.request == 2
        assert [e.shown for e in app.query(AssistantEntry)][-1].startswith(SECOND)
