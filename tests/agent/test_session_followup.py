"""Follow-ups: a session answers several requests, keeping its history.

Guards: a follow-up that starts from a blank conversation (the model would not see
the first request or its answer), turn numbers or call ids that restart (the
second request's trace rows would overwrite the first's), a trace that shows only
one request, a session continued from its trace (another process) that loses the
history or the edit sequence, and a long session that no longer fits its window.
"""

from __future__ import annotations

import asyncio

import pytest
from opencomposer.agent.session import History, Session, SessionConfig
from opencomposer.agent.traces import TraceStore
from opencomposer.tools.workspace import LocalWorkspace

from tests.agent.conftest import scripted

EDIT = '<edit_file path="calc.py">\n<old>a - b</old>\n<new>a + b</new>\n</edit_file>'
EDIT2 = '<edit_file path="calc.py">\n<old>a + b</old>\n<new>b + a</new>\n</edit_file>'


def session(model, repo, store, events=None, **kw) -> Session:
    return Session(
        model=model,
        workspace=LocalWorkspace(repo),
        config=SessionConfig(approve="all"),
        traces=store,
        on_event=(lambda e: events.append(e.to_wire())) if events is not None else None,
        **kw,
    )


async def test_a_second_run_continues_the_conversation(repo, store):
    events: list[dict] = []
    s = session(scripted(EDIT, "Fixed add.", "It now adds b and a."), repo, store, events)
    first = await s.run("fix add")
    second = await s.run("and what does it return now?")
    assert (first.status, second.status) == ("completed", "completed")
    assert second.session_id == first.session_id
    assert second.answer == "It now adds b and a."
    prompt = [(m.role, m.content) for m in second.turns[0].messages]
    assert prompt[1] == ("user", "fix add")
    assert ("assistant", "Fixed add.") in prompt  # the first request's answer
    assert any(m.kind == "tool_results" for m in second.turns[0].messages)
    assert prompt[-1] == ("user", "and what does it return now?")
    assert [t.turn for t in first.turns] == [1, 2] and [t.turn for t in second.turns] == [3]
    starts = [e for e in events if e["type"] == "session_start"]
    ends = [e for e in events if e["type"] == "session_end"]
    assert [e["request"] for e in starts] == [1, 2] and [e["request"] for e in ends] == [1, 2]
    assert {e["session_id"] for e in starts} == {first.session_id}
    assert ends[1]["turns"] == 3  # the whole session's turns
    trace = store.export(first.session_id)
    assert [t["turn"] for t in trace["turns"]] == [1, 2, 3]
    assert trace["status"] == "completed" and trace["answer"] == "It now adds b and a."
    assert [(r["request"], r["query"], r["turn"]) for r in trace["meta"]["requests"]] == [
        (1, "fix add", 1),
        (2, "and what does it return now?", 3),
    ]
    assert trace["turns"][2]["messages"][-1]["content"] == "and what does it return now?"


async def test_a_follow_up_in_another_process_continues_from_the_trace(repo, tmp_path):
    path = tmp_path / "traces.db"
    store = TraceStore(path)
    first = await session(scripted(EDIT, "Fixed add."), repo, store).run("fix add")
    store.close()
    store = TraceStore(path)  # a restarted server: nothing in memory
    history = History.from_trace(store.export(first.session_id))
    assert (history.requests, history.turns, history.tool_calls, history.edits) == (1, 2, 1, 1)
    model = scripted(EDIT, "Fixed add.", EDIT2, "Swapped.")
    s = session(model, repo, store, session_id=first.session_id, history=history)
    second = await s.run("swap the operands")
    assert second.status == "completed" and second.answer == "Swapped."
    assert (repo / "calc.py").read_text() == "def add(a, b):\n    return b + a\n"
    prompt = second.turns[0].messages
    assert [m.content for m in prompt if m.role == "user"][0] == "fix add"
    trace = store.export(first.session_id)
    assert [t["turn"] for t in trace["turns"]] == [1, 2, 3, 4]
    assert [c["call_id"] for c in trace["tool_calls"]] == ["t1c0", "t3c0"]
    assert [(e["seq"], e["turn"]) for e in trace["edits"]] == [(1, 1), (2, 3)]
    assert len(trace["meta"]["requests"]) == 2
    # one time line: the follow-up's turns start after the first request's
    assert trace["turns"][2]["t_start"] >= trace["turns"][1]["t_end"]
    store.close()


async def test_a_running_session_takes_no_second_request(repo, store):
    s = session(scripted("slow " * 400, cps=2000), repo, store)
    task = asyncio.ensure_future(s.run("first"))
    await asyncio.sleep(0.05)
    with pytest.raises(RuntimeError, match="still running"):
        await s.run("second")
    s.cancel()
    assert (await task).status == "cancelled"


async def test_a_long_session_drops_its_oldest_requests_to_fit(repo, store):
    # a 2000-token window holds the ~1000-token system prompt and about one exchange
    # ~1600 characters that never repeat, not even as a count (the letter varies too)
    prose = " ".join(f"w{chr(97 + (i * 2654435761 >> 9) % 26)}rd{i}" for i in range(250))
    turns = ["A " + prose, "B " + prose, "C"]
    s = session(scripted(*turns, context_window=2000), repo, store)
    for query in ("one " * 100, "two " * 100):
        assert (await s.run(query)).status == "completed"
    third = await s.run("three")
    assert third.status == "completed", third.error
    prompt = third.turns[0].messages
    assert prompt[0].role == "system" and prompt[-1].content == "three"
    text = "".join(m.content for m in prompt)
    assert "earlier messages of this session elided" in text and "one one" not in text
