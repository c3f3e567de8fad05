"""Follow-ups over LSP: `opencomposer.ask` with `session_id` continues that session.

The real server over stdio, a pygls editor, the `scripted:` model (it plays the turn
whose index is the number of assistant messages in the prompt, so a follow-up that
lost its history would replay the first turn). Guards: a follow-up that starts a
fresh conversation, a new id for a continued session, events under another id, a
trace that keeps only one request, undo that forgets the first request's edits,
and unclear errors for unknown or still-running sessions.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

import pytest
from conftest import CALC, FIX, TEST_CALC
from lsp_harness import scripted
from pygls.exceptions import JsonRpcException

ASK = "opencomposer.ask"
TEST_EDIT = '<edit_file path="test_calc.py">\n<old>== 5</old>\n<new>== 5  # checked</new>\n</edit_file>'  # fmt: skip
TURNS = [FIX, "Fixed add.", "Also noting it in the test.\n" + TEST_EDIT, "Noted in the test."]


def trace_turns(home: Path, session_id: str) -> list[tuple[int, list[dict[str, str]]]]:
    with sqlite3.connect(home / "traces.db") as db:
        rows = db.execute(
            "SELECT turn, messages FROM turns WHERE session_id=? ORDER BY turn", (session_id,)
        ).fetchall()
    return [(turn, json.loads(messages)) for turn, messages in rows]


async def test_a_follow_up_continues_the_session_with_its_history(spawn, repo, home, tmp_path):
    editor = await spawn(scripted(tmp_path / "m.json", TURNS))
    first = await editor.command(ASK, {"query": "fix the failing test", "auto_apply_edits": True})
    sid = first["session_id"]
    second = await editor.command(
        ASK, {"query": "note it in the test", "session_id": sid, "auto_apply_edits": True}
    )
    assert second["session_id"] == sid
    assert (second["status"], second["answer"]) == ("completed", "Noted in the test.")
    assert second["edits"] == ["test_calc.py"]  # this request's edits
    # the follow-up's first prompt holds the first request, its tool result and answer
    turns = trace_turns(home, sid)
    assert [t for t, _ in turns] == [1, 2, 3, 4]
    prompt = turns[2][1]
    contents = [m["content"] for m in prompt]
    assert contents[1] == "fix the failing test" and contents[-1] == "note it in the test"
    assert "Fixed add." in contents and any("<tool_result" in c for c in contents)
    # every event of both requests under the one id; one session_start per request
    starts = [e for e in editor.events if e["type"] == "session_start"]
    assert [(e["session_id"], e["request"]) for e in starts] == [(sid, 1), (sid, 2)]
    assert {e["session_id"] for e in editor.events} == {sid}
    ends = [e for e in editor.events if e["type"] == "session_end"]
    assert [e["request"] for e in ends] == [1, 2] and ends[-1]["turns"] == 4
    sessions = await editor.command("opencomposer.sessions", {})
    assert [s["session_id"] for s in sessions] == [sid]
    # undo covers the whole session: both requests' edits
    undone = await editor.command("opencomposer.undo", {"session_id": sid})
    assert sorted(undone["reverted"]) == ["calc.py", "test_calc.py"]
    assert (repo / "calc.py").read_text() == CALC
    assert (repo / "test_calc.py").read_text() == TEST_CALC


async def test_without_session_id_a_new_session_starts(spawn, home, tmp_path):
    editor = await spawn(scripted(tmp_path / "m.json", ["Hello."]))
    a = await editor.command(ASK, {"query": "hi"})
    b = await editor.command(ASK, {"query": "hi again"})
    assert a["session_id"] != b["session_id"] and b["answer"] == "Hello."
    assert len(trace_turns(home, b["session_id"])) == 1


async def test_a_restarted_server_continues_a_session_from_its_trace(spawn, repo, home, tmp_path):
    model = scripted(tmp_path / "m.json", TURNS)
    editor = await spawn(model)
    sid = (await editor.command(ASK, {"query": "fix", "auto_apply_edits": True}))["session_id"]
    await editor.close()
    editor = await spawn(model)  # a new process: nothing of the session in memory
    second = await editor.command(
        ASK, {"query": "note it", "session_id": sid[:8], "auto_apply_edits": True}
    )
    assert second["session_id"] == sid and second["answer"] == "Noted in the test."
    assert [t for t, _ in trace_turns(home, sid)] == [1, 2, 3, 4]
    undone = await editor.command("opencomposer.undo", {"session_id": sid})
    assert sorted(undone["reverted"]) == ["calc.py", "test_calc.py"]


async def test_unknown_and_running_sessions_are_one_line_errors(spawn, tmp_path):
    editor = await spawn(scripted(tmp_path / "m.json", ["slow " * 1000], 200))
    with pytest.raises(JsonRpcException) as info:
        await editor.command(ASK, {"query": "x", "session_id": "feedbeef0000"})
    assert info.value.code == -32000 and "no session 'feedbeef0000'" in info.value.message
    assert "\n" not in info.value.message
    running = asyncio.ensure_future(editor.command(ASK, {"query": "slow"}))
    start = await asyncio.wait_for(editor.wait_event(lambda e: e["type"] == "model_delta"), 20)
    sid = start["session_id"]
    with pytest.raises(JsonRpcException) as info:
        await editor.command(ASK, {"query": "more", "session_id": sid})
    assert info.value.code == -32000 and info.value.message == f"session {sid} is still running"
    await editor.command("opencomposer.cancel", {"session_id": sid})
    assert (await asyncio.wait_for(running, 10))["status"] == "cancelled"
    with pytest.raises(JsonRpcException) as info:
        await editor.command(ASK, {"query": "x", "session_id": ""})
    assert info.value.code == -32602 and "'session_id' is empty" in info.value.message


async def test_reject_after_a_follow_up_keeps_what_was_accepted(spawn, repo, home, tmp_path):
    mul = '<edit_file path="calc.py">\n<old>    return a * b</old>\n<new>    return b * a</new>\n</edit_file>'  # fmt: skip
    editor = await spawn(scripted(tmp_path / "m.json", [FIX, "Fixed add.", mul, "Swapped."]))
    sid = (await editor.command(ASK, {"query": "fix", "auto_apply_edits": True}))["session_id"]
    decide = {"session_id": sid, "path": "calc.py"}
    await editor.command("opencomposer.decide", {**decide, "decision": "accept"})
    await editor.command(ASK, {"query": "swap mul", "session_id": sid, "auto_apply_edits": True})
    assert "b * a" in (repo / "calc.py").read_text()
    result = await editor.command("opencomposer.decide", {**decide, "decision": "reject"})
    assert result == {"ok": True, "reverted": True}
    assert (repo / "calc.py").read_text() == CALC.replace("a - b", "a + b")  # accepted fix kept
    # everything decided: a second reject means the whole file, back as before the session
    await editor.command("opencomposer.decide", {**decide, "decision": "accept"})
    await editor.command("opencomposer.decide", {**decide, "decision": "reject"})
    assert (repo / "calc.py").read_text() == CALC
