"""The session loop end to end with the scripted model, a real workspace and a real
trace store: events, edits, errors returned to the model, budgets, cancellation,
approvals, context management."""

import asyncio
import time

import pytest
from opencomposer.agent.protocols import Sampling
from opencomposer.agent.session import Session, SessionConfig
from opencomposer.tools.workspace import LocalWorkspace

from tests.agent.conftest import scripted

FIX = """Let me look.
<read_file path="calc.py"/>
<grep pattern="def add"/>
<edit_file path="calc.py">
<old>    return a - b</old>
<new>    return a + b</new>
</edit_file>"""


async def run(model, repo, store=None, query="fix add", **kw):
    events = []
    cfg = kw.pop("config", SessionConfig(approve="all"))
    session = Session(
        model=model,
        workspace=LocalWorkspace(repo),
        config=cfg,
        on_event=lambda e: events.append(e.to_wire()),
        traces=store,
        **kw,
    )
    result = await session.run(query)
    return result, events


async def test_full_session_edits_and_traces(repo, store):
    result, events = await run(scripted(FIX, "Fixed: add now adds."), repo, store)
    assert result.status == "completed"
    assert result.answer == "Fixed: add now adds."
    assert (repo / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"
    types = [e["type"] for e in events]
    assert types[0] == "session_start" and types[-1] == "session_end"
    assert types.count("tool_start") == 3 and types.count("tool_end") == 3
    assert "edit" in types and types.count("model_start") == 2
    assert all("t" in e for e in events)
    # the second prompt carries the results, in message order
    results_msg = result.turns[1].messages[-1].content
    assert results_msg.index('name="read_file" index="0"') < results_msg.index(
        'name="edit_file" index="2"'
    )
    trace = store.export(result.session_id)
    assert trace["status"] == "completed" and len(trace["turns"]) == 2
    assert [c["name"] for c in trace["tool_calls"]] == ["read_file", "grep", "edit_file"]
    assert (
        trace["edits"][0]["path"] == "calc.py" and "+    return a + b" in trace["edits"][0]["diff"]
    )


async def test_malformed_calls_become_error_results_and_the_loop_goes_on(repo, store):
    bad = (
        '<nonexistent_tool path="x"/>\n<read_file/>\n<read_file path="calc.py" start_line="one"/>\n'
        '<read_file path="../outside.txt"/>\n<edit_file path="calc.py"><old>not there</old><new>x</new></edit_file>\n'
        '</grep>\n<glob pattern="*.py"/>'
    )
    result, events = await run(scripted(bad, "ok"), repo, store)
    assert result.status == "completed" and result.answer == "ok"
    ends = [e for e in events if e["type"] == "tool_end"]
    assert [e["status"] for e in ends].count("error") == 6
    msg = result.turns[1].messages[-1].content
    assert "unknown tool <nonexistent_tool>" in msg
    assert "missing required parameter path" in msg
    assert "must be an integer" in msg
    assert "stray closing tag" in msg
    assert 'name="glob" index="6" status="ok"' in msg
    assert (repo / "calc.py").read_text().endswith("a - b\n")


async def test_model_failing_mid_stream_ends_with_error_and_keeps_trace(repo, store):
    result, events = await run(scripted(FIX, fail_after_chars=20), repo, store)
    assert result.status == "error" and "model failed" in result.error
    assert events[-1]["type"] == "session_end" and events[-1]["status"] == "error"
    assert store.get(result.session_id)["status"] == "error"


async def test_cancel_stops_model_and_tools_quickly(repo, store):
    slow = "<run_terminal>sleep 30</run_terminal>" + " and more text" * 200
    session = Session(
        model=scripted(slow, cps=100),
        workspace=LocalWorkspace(repo),
        config=SessionConfig(approve="all"),
        traces=store,
    )
    task = asyncio.create_task(session.run("wait"))
    await asyncio.sleep(1.0)
    t0 = time.monotonic()
    session.cancel()
    result = await task
    assert time.monotonic() - t0 < 0.5
    assert result.status == "cancelled"
    assert store.get(result.session_id)["status"] == "cancelled"


async def test_outside_cancellation_propagates_and_finishes_trace(repo, store):
    session = Session(
        model=scripted("x" * 1000, cps=50), workspace=LocalWorkspace(repo), traces=store
    )
    task = asyncio.create_task(session.run("q"))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert store.get(session.id)["status"] == "cancelled"


async def test_approval_policy(repo):
    asked = []

    async def approver(name, args):
        asked.append(name)
        return "reject"

    edit = '<edit_file path="calc.py"><old>a - b</old><new>a + b</new></edit_file>\n<read_file path="calc.py"/>'
    result, _ = await run(
        scripted(edit, "done"), repo, config=SessionConfig(approve="safe"), approver=approver
    )
    assert asked == ["edit_file"]  # read_file is read-only: not asked
    assert "rejected" in result.turns[1].messages[-1].content
    assert (repo / "calc.py").read_text().endswith("a - b\n")

    async def always(name, args):
        asked.append(name)
        return "always"

    two = edit + '\n<write_file path="n.txt"><content>x</content></write_file>'
    asked.clear()
    result, _ = await run(
        scripted(two, "done"), repo, config=SessionConfig(approve="safe"), approver=always
    )
    assert asked == ["edit_file", "write_file"]
    assert (repo / "calc.py").read_text().endswith("a + b\n")

    # no approver: calls that need approval are refused with a clear reason
    result, _ = await run(
        scripted('<delete_file path="n.txt"/>', "done"), repo, config=SessionConfig(approve="none")
    )
    assert "needs the user's approval" in result.turns[1].messages[-1].content
    assert (repo / "n.txt").exists()


async def test_max_turns(repo):
    loop = '<read_file path="calc.py"/>'
    result, _ = await run(
        scripted(*[loop] * 5), repo, config=SessionConfig(approve="all", max_turns=3)
    )
    assert result.status == "max_turns" and len(result.turns) == 3

    # none set: the model's own budget (a trained policy's), and the session's above it
    model = scripted(*[loop] * 5)
    model.max_turns = 2  # type: ignore[attr-defined]
    result, _ = await run(model, repo, config=SessionConfig(approve="all"))
    assert result.status == "max_turns" and len(result.turns) == 2
    model = scripted(*[loop] * 5)
    model.max_turns = 2  # type: ignore[attr-defined]
    result, _ = await run(model, repo, config=SessionConfig(approve="all", max_turns=4))
    assert len(result.turns) == 4


async def test_context_management_shrinks_old_tool_output_not_the_request(repo):
    (repo / "big.txt").write_text("line of text\n" * 4000)
    turns = ['<read_file path="big.txt"/>'] * 3 + ["done"]
    model = scripted(*turns, context_window=4000)
    cfg = SessionConfig(approve="all", sampling=Sampling(max_tokens=256), output_limit=12_000)
    query = "please summarise big.txt " * 20
    result, _ = await run(model, repo, query=query, config=cfg)
    assert result.status == "completed"
    last_prompt = result.turns[-1].messages
    assert last_prompt[1].content == query
    assert sum(model.count_tokens(m.content) for m in last_prompt) <= 4000
    assert "elided to fit the context window" in last_prompt[3].content


async def test_calls_start_before_the_message_ends(repo):
    msg = '<read_file path="calc.py"/>\n' + "some more words " * 20 + '\n<glob pattern="*"/>'
    result, events = await run(scripted(msg, "ok", cps=400), repo)
    first_start = next(e for e in events if e["type"] == "tool_start")
    end = next(e for e in events if e["type"] == "model_end")
    assert first_start["t"] < end["t"] - 0.3


async def test_same_path_calls_keep_message_order(repo):
    msg = (
        '<edit_file path="calc.py"><old>a - b</old><new>a * b</new></edit_file>\n'
        '<read_file path="calc.py"/>\n'
        '<edit_file path="calc.py"><old>a * b</old><new>a + b</new></edit_file>\n'
        '<read_file path="calc.py"/>'
    )
    result, _ = await run(scripted(msg, "ok"), repo)
    outs = [c.result.output for c in result.turns[0].calls]
    assert "a * b" in outs[1] and "a + b" in outs[3]


async def test_a_megabyte_of_output_reaches_the_model_capped(repo):
    (repo / "big.txt").write_text(("y" * 99 + "\n") * 10_000)
    cmd = "<run_terminal>head -c 1000000 /dev/zero | tr '\\0' a</run_terminal>"
    result, _ = await run(scripted(f'<read_file path="big.txt"/>\n{cmd}', "ok"), repo)
    assert result.status == "completed"
    for call in result.turns[0].calls:
        assert len(call.result.output) <= SessionConfig().output_limit + 200
    assert "aaaa" in result.turns[0].calls[1].result.output


async def test_a_megabyte_reply_without_calls_is_the_answer(repo):
    # not one character repeated: that is degenerate output, which the repetition guard stops
    text = "".join(f"line {i}\n" for i in range(120_000))[:1_000_000]
    result, _ = await run(scripted(text), repo)
    assert result.status == "completed" and len(result.answer) == 1_000_000


CHECK = "<run_terminal><command>python -c 'import calc; assert calc.add(2, 2) == 4'</command></run_terminal>"
WRONG = """<edit_file path="calc.py">
<old>    return a - b</old>
<new>    return a * b - b</new>
</edit_file>"""
RIGHT = """<edit_file path="calc.py">
<old>    return a * b - b</old>
<new>    return a + b</new>
</edit_file>"""


async def test_an_answer_after_its_own_check_failed_is_sent_back_once(repo, store):
    # a wrong change, the model's own check fails, it answers anyway: the answer goes
    # back with the check's exit code, and the model fixes it in the turns it has left
    model = scripted(WRONG, CHECK, "Fixed, the test passes.", RIGHT, CHECK, "Fixed: add adds.")
    result, events = await run(model, repo, store)
    assert result.status == "completed" and result.answer == "Fixed: add adds."
    assert (repo / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"
    note = result.turns[3].messages[-1]
    assert note.role == "user" and result.turns[3].messages[-2].content.startswith("Fixed, the")
    assert "`python -c 'import calc; assert calc.add(2, 2) == 4'` exited with code 1" in (
        note.content
    )
    # the trace keeps the note where the model read it, and a follow-up continues it
    trace = store.export(result.session_id)
    assert "exited with code 1" in trace["turns"][3]["messages"][-1]["content"]

    # a search that finds nothing after the failing check leaves it the last word
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    model = scripted(WRONG, CHECK, SEARCH, "Done.", RIGHT, CHECK, "Fixed: add adds.")
    result, _ = await run(model, repo)
    assert result.answer == "Fixed: add adds." and "exited with code 1" in (
        result.turns[4].messages[-1].content
    )

    # sent back once a request: a second answer over a failing check ends the request
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    model = scripted(WRONG, CHECK, "Done.", "Still done.", "never asked")
    result, _ = await run(model, repo)
    assert result.status == "completed" and result.answer == "Still done."
    assert len(result.turns) == 4


SEARCH = "<run_terminal><command>grep -n 'def sub' calc.py</command></run_terminal>"


async def test_answers_a_check_does_not_contradict_end_the_request(repo):
    # no change; a change never run afterwards; a check that passed after the change;
    # a failing command before the change; a search that found nothing after the
    # change (exit 1, no output: not a check); no turn left; the setting off
    fix = RIGHT.replace("a * b - b", "a - b")
    cases = [
        (CHECK, "It fails because add subtracts."),
        (fix, "Fixed."),
        (CHECK, fix, CHECK, "Fixed."),
        (fix, SEARCH, "Fixed."),
    ]
    for turns in cases:
        (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
        result, _ = await run(scripted(*turns, "never asked"), repo)
        assert result.status == "completed" and result.answer == turns[-1], turns
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    cfg = SessionConfig(approve="all", max_turns=3)
    result, _ = await run(scripted(WRONG, CHECK, "Done.", "never asked"), repo, config=cfg)
    assert result.status == "completed" and result.answer == "Done."
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    cfg = SessionConfig(approve="all", recheck=False)
    result, _ = await run(scripted(WRONG, CHECK, "Done.", "never asked"), repo, config=cfg)
    assert result.answer == "Done."
