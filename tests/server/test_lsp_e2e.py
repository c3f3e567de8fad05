"""End to end: the real `opencomposer serve --stdio` process, a pygls client playing
the editor, and the `scripted:` model. Each test names the behaviour it guards."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from pathlib import Path

import pytest
from conftest import CALC, FIX
from lsp_harness import _plain, scripted
from lsprotocol import types as lsp
from pygls.exceptions import JsonRpcException

ASK = "opencomposer.ask"


def decisions(home: Path, session_id: str) -> dict[str, str]:
    with sqlite3.connect(home / "traces.db") as db:
        rows = db.execute(
            "SELECT path, decision FROM edits WHERE session_id=?", (session_id,)
        ).fetchall()
    return {path: decision for path, decision in rows}


def status(home: Path, session_id: str) -> str:
    with sqlite3.connect(home / "traces.db") as db:
        return db.execute("SELECT status FROM sessions WHERE id=?", (session_id,)).fetchone()[0]


async def test_initialize_announces_commands_full_sync_and_code_actions(spawn, tmp_path):
    editor = await spawn(scripted(tmp_path / "m.json", ["hi"]), initialize=False)
    result = await editor.handshake()
    caps = result.capabilities
    assert set(caps.execute_command_provider.commands) >= {
        "opencomposer.ask",
        "opencomposer.cancel",
        "opencomposer.search",
        "opencomposer.decide",
        "opencomposer.undo",
        "opencomposer.sessions",
        "opencomposer.submit",
    }
    assert caps.text_document_sync.change == lsp.TextDocumentSyncKind.Full
    assert caps.code_action_provider


async def test_ask_streams_events_and_progress_and_edits_the_open_buffer(
    spawn, repo, home, tmp_path
):
    editor = await spawn(scripted(tmp_path / "m.json", [FIX, "Fixed add."], 3000))
    editor.open("calc.py")
    result = await editor.command(
        ASK, {"query": "fix the failing test", "uri": editor.uri("calc.py")}
    )
    sid = result["session_id"]
    assert result["status"] == "completed" and result["answer"] == "Fixed add."
    types = editor.event_types(sid)
    assert types[0] == "session_start" and types[-1] == "session_end"
    for kind in (
        "model_start",
        "model_delta",
        "tool_start",
        "edit",
        "tool_end",
        "model_end",
        "message",
    ):
        assert kind in types
    edit = next(e for e in editor.events if e["type"] == "edit")
    assert edit["path"] == "calc.py" and "+    return a + b" in edit["diff"]
    # the buffer holds the edit; the open file on disk is left to the editor
    assert editor.buffer("calc.py") == CALC.replace("a - b", "a + b")
    assert (repo / "calc.py").read_text() == CALC
    kinds = [p["kind"] for p in editor.progress]
    assert kinds[0] == "begin" and kinds[-1] == "end" and "report" in kinds
    assert editor.progress_created == [f"opencomposer/{sid}"]
    assert status(home, sid) == "completed"


async def test_edit_to_a_file_not_open_goes_through_apply_edit_and_reaches_disk(
    spawn, repo, tmp_path
):
    editor = await spawn(scripted(tmp_path / "m.json", [FIX, "done"]))
    result = await editor.command(ASK, {"query": "fix"})
    assert result["status"] == "completed"
    assert len(editor.edits_received) == 1
    assert (repo / "calc.py").read_text() == CALC.replace("a - b", "a + b")


async def test_write_and_delete_file_use_resource_operations(spawn, repo, tmp_path):
    turns = [
        '<write_file path="pkg/new.py">\n<content>X = 1\n</content>\n</write_file>',
        '<delete_file path="test_calc.py"/>',
        "ok",
    ]
    editor = await spawn(scripted(tmp_path / "m.json", turns))
    result = await editor.command(ASK, {"query": "reorganise"})
    assert result["status"] == "completed"
    kinds = [type(c).__name__ for e in editor.edits_received for c in e.document_changes]
    assert kinds == ["CreateFile", "TextDocumentEdit", "DeleteFile"]
    assert (repo / "pkg/new.py").read_text() == "X = 1"
    assert not (repo / "test_calc.py").exists()


async def test_a_refused_apply_edit_is_an_error_result_and_nothing_changes(spawn, repo, tmp_path):
    editor = await spawn(scripted(tmp_path / "m.json", [FIX, "gave up"]))
    editor.open("calc.py")
    editor.refuse_edits = True
    result = await editor.command(ASK, {"query": "fix"})
    assert result["status"] == "completed"
    end = next(e for e in editor.events if e["type"] == "tool_end")
    assert end["name"] == "edit_file" and end["status"] == "error"
    assert not [e for e in editor.events if e["type"] == "edit"]
    assert editor.buffer("calc.py") == CALC and (repo / "calc.py").read_text() == CALC


async def test_reads_see_the_unsaved_buffer(spawn, repo, tmp_path):
    turns = ['<grep pattern="UNSAVED_MARKER"/>', "seen"]
    editor = await spawn(scripted(tmp_path / "m.json", turns))
    editor.open("calc.py", CALC + "UNSAVED_MARKER = 1\n")
    await editor.command(ASK, {"query": "find it"})
    with sqlite3.connect(editor.root.parent / "home" / "traces.db") as db:
        (result,) = db.execute("SELECT result FROM tool_calls WHERE name='grep'").fetchone()
    assert "calc.py:7:UNSAVED_MARKER = 1" in result


async def test_cancel_command_stops_the_session_within_500ms(spawn, home, tmp_path):
    slow = "thinking " * 400  # ~3600 chars at 100/s: half a minute if not stopped
    editor = await spawn(scripted(tmp_path / "m.json", [slow], 100))
    ask = asyncio.ensure_future(editor.command(ASK, {"query": "slow"}))
    start = await asyncio.wait_for(editor.wait_event(lambda e: e["type"] == "model_delta"), 20)
    t0 = time.monotonic()
    cancelled = await editor.command("opencomposer.cancel", {"session_id": start["session_id"]})
    result = await asyncio.wait_for(ask, 10)
    elapsed = time.monotonic() - t0
    assert cancelled == {"cancelled": [start["session_id"]]}
    assert result["status"] == "cancelled"
    assert elapsed < 2.0, elapsed  # the spec says 500 ms; benchmarks/lsp.py measures it
    assert editor.event_types()[-1] == "session_end"
    assert status(home, start["session_id"]) == "cancelled"


async def test_cancel_request_on_the_ask_answers_request_cancelled(spawn, home, tmp_path):
    editor = await spawn(scripted(tmp_path / "m.json", ["slow " * 1000], 100))
    params = lsp.ExecuteCommandParams(command=ASK, arguments=[{"query": "slow"}])
    msg_id = "ask-1"
    fut = editor.protocol.send_request(lsp.WORKSPACE_EXECUTE_COMMAND, params, msg_id=msg_id)
    start = await asyncio.wait_for(editor.wait_event(lambda e: e["type"] == "model_delta"), 20)
    editor.protocol.notify(lsp.CANCEL_REQUEST, lsp.CancelParams(id=msg_id))
    with pytest.raises(JsonRpcException) as info:
        await asyncio.wait_for(asyncio.wrap_future(fut), 10)
    assert info.value.code == -32800
    assert info.value.data["session_id"] == start["session_id"]
    assert status(home, start["session_id"]) == "cancelled"


async def test_run_terminal_asks_for_approval_and_runs_after_run(spawn, repo, tmp_path):
    turns = ["<run_terminal><command>echo approved > out.txt</command></run_terminal>", "ran it"]
    editor = await spawn(scripted(tmp_path / "m.json", turns))
    editor.approve_with = "Run"
    result = await editor.command(ASK, {"query": "run"})
    assert result["status"] == "completed"
    assert (
        len(editor.approval_requests) == 1
        and "echo approved > out.txt" in editor.approval_requests[0]
    )
    assert (repo / "out.txt").read_text().strip() == "approved"


async def test_rejected_approval_does_not_run_the_command(spawn, repo, tmp_path):
    turns = ["<run_terminal><command>echo no > out.txt</command></run_terminal>", "ok"]
    editor = await spawn(scripted(tmp_path / "m.json", turns))
    editor.approve_with = "Reject"
    await editor.command(ASK, {"query": "run"})
    end = next(e for e in editor.events if e["type"] == "tool_end")
    assert end["status"] == "error"
    assert not (repo / "out.txt").exists()


async def test_always_for_this_command_is_asked_once_per_connection(spawn, repo, tmp_path):
    turns = ["<run_terminal><command>echo x >> out.txt</command></run_terminal>", "ok"]
    editor = await spawn(scripted(tmp_path / "m.json", turns))
    editor.approve_with = "Always for this command"
    await editor.command(ASK, {"query": "one"})
    await editor.command(ASK, {"query": "two"})
    assert len(editor.approval_requests) == 1
    assert (repo / "out.txt").read_text().split() == ["x", "x"]


async def test_reject_reverts_one_file_and_undo_reverts_the_rest(spawn, repo, home, tmp_path):
    turns = [
        FIX
        + '\n<edit_file path="test_calc.py">\n<old>== 5</old>\n<new>== 5  # fixed</new>\n</edit_file>',
        "done",
    ]
    editor = await spawn(scripted(tmp_path / "m.json", turns))
    editor.open("calc.py")
    original_test = (repo / "test_calc.py").read_text()
    sid = (await editor.command(ASK, {"query": "fix"}))["session_id"]
    assert "a + b" in editor.buffer("calc.py") and "# fixed" in (repo / "test_calc.py").read_text()
    decided = await editor.command(
        "opencomposer.decide", {"session_id": sid, "path": "calc.py", "decision": "reject"}
    )
    assert decided == {"ok": True, "reverted": True}
    assert editor.buffer("calc.py") == CALC
    undone = await editor.command("opencomposer.undo", {"session_id": sid})
    assert undone["reverted"] == ["test_calc.py", "calc.py"]
    assert (repo / "test_calc.py").read_text() == original_test
    assert decisions(home, sid) == {"calc.py": "undo", "test_calc.py": "undo"}
    accepted = await editor.command(
        "opencomposer.decide", {"session_id": sid, "path": "calc.py", "decision": "accept"}
    )
    assert accepted == {"ok": True, "reverted": False}
    assert decisions(home, sid)["calc.py"] == "accept"


async def test_sessions_lists_traces(spawn, tmp_path):
    editor = await spawn(scripted(tmp_path / "m.json", ["hello"]))
    sid = (await editor.command(ASK, {"query": "say hello"}))["session_id"]
    sessions = await editor.command("opencomposer.sessions", {"limit": 5})
    assert sessions[0]["session_id"] == sid and sessions[0]["query"] == "say hello"
    assert {"started", "status", "model", "edits"} <= set(sessions[0])


async def test_code_action_offers_ask_on_a_selection_only(spawn, tmp_path):
    editor = await spawn(scripted(tmp_path / "m.json", ["hi"]))
    uri = editor.open("calc.py")

    async def actions(a: tuple[int, int], b: tuple[int, int]):
        params = lsp.CodeActionParams(
            text_document=lsp.TextDocumentIdentifier(uri=uri),
            range=lsp.Range(
                start=lsp.Position(line=a[0], character=a[1]),
                end=lsp.Position(line=b[0], character=b[1]),
            ),
            context=lsp.CodeActionContext(diagnostics=[]),
        )
        # read the raw JSON: lsprotocol's client-side hook types any {command: …} as a Command
        editor.protocol.get_result_type = lambda method: None
        return _plain(
            await editor.protocol.send_request_async(lsp.TEXT_DOCUMENT_CODE_ACTION, params)
        )

    (action,) = await actions((0, 0), (1, 5))
    assert (
        action["title"] == "Ask opencomposer about this selection" and action["kind"] == "refactor"
    )
    assert action["command"]["command"] == ASK and action["command"]["arguments"][0]["uri"] == uri
    assert not await actions((1, 2), (1, 2))


async def test_reveal_shows_edited_documents(spawn, repo, tmp_path):
    editor = await spawn(scripted(tmp_path / "m.json", [FIX, "done"]))
    await editor.command(ASK, {"query": "fix", "reveal": True})
    for _ in range(50):
        if editor.shown:
            break
        await asyncio.sleep(0.05)
    assert editor.shown == [(repo / "calc.py").as_uri()]


async def test_submit_turns_a_session_into_a_task(spawn, repo, home, tmp_path):
    editor = await spawn(scripted(tmp_path / "m.json", [FIX, "done"]))
    sid = (await editor.command(ASK, {"query": "fix the add bug"}))["session_id"]
    out = tmp_path / "tasks"
    try:
        result = await editor.command(
            "opencomposer.submit",
            {"session_id": sid, "verify": "python -m pytest -q", "out": str(out)},
        )
    except JsonRpcException as e:  # the training package may reject a non-git workspace
        assert e.code == -32000 and sid in e.message
        return
    task = Path(result["task_dir"])
    assert (task / "task.toml").exists() and "fix the add bug" in (task / "task.toml").read_text()


async def test_wrong_parameters_and_unknown_commands_are_clear_errors(spawn, tmp_path):
    editor = await spawn(scripted(tmp_path / "m.json", ["hi"]))
    cases = [
        ((ASK,), "takes one argument object"),
        ((ASK, {}), "needs 'query'"),
        ((ASK, {"query": 5}), "'query' must be a string"),
        ((ASK, {"query": "x", "approve": "sometimes"}), "one of none, safe, all"),
        ((ASK, {"query": "x", "bogus": 1}), "unknown field 'bogus'"),
        (
            ("opencomposer.decide", {"session_id": "a", "path": "p", "decision": "maybe"}),
            "accept, reject",
        ),
        (("opencomposer.search", {"query": "x", "k": 0}), "'k' must be an integer"),
        (("opencomposer.nope", {}), "not defined"),
    ]
    for args, message in cases:
        with pytest.raises(JsonRpcException) as info:
            await editor.command(*args)
        assert info.value.code == -32602, args
        assert message in info.value.message, (args, info.value.message)
    failures = [
        (("opencomposer.undo", {"session_id": "doesnotexist"}), "doesnotexist"),
        ((ASK, {"query": "x", "model": "bogus"}), "unknown model spec 'bogus'"),
        (("opencomposer.cancel", {"session_id": "nosuch"}), "no running session nosuch"),
    ]
    for args, message in failures:
        with pytest.raises(JsonRpcException) as info:
            await editor.command(*args)
        assert info.value.code == -32000 and message in info.value.message, (
            args,
            info.value.message,
        )
    # and the server is still there
    assert await editor.command("opencomposer.cancel", {}) == {"cancelled": []}


async def test_malformed_json_rpc_gets_error_responses_and_the_server_stays_up(spawn, tmp_path):
    editor = await spawn(scripted(tmp_path / "m.json", ["hi"]))
    replies: list[dict] = []
    original = editor.protocol.handle_message

    def spy(message):
        if getattr(message, "error", None) is not None:
            replies.append(message)
        return original(message)

    editor.protocol.handle_message = spy
    stdin = editor.process.stdin
    for body in (
        b"{not json",
        b"[1, 2]",
        b'{"jsonrpc": "2.0", "id": 7}',
        b'{"jsonrpc": "2.0", "id": 8, "method": "textDocument/codeAction", "params": {"x": 1}}',
    ):
        stdin.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
    await stdin.drain()
    for _ in range(100):
        if len(replies) >= 4:
            break
        await asyncio.sleep(0.05)
    codes = sorted((r.id, r.error.code) for r in replies if r.id is not None) + [
        (None, r.error.code) for r in replies if r.id is None
    ]
    assert (7, -32600) in codes and (8, -32602) in codes
    assert [c for i, c in codes if i is None] == [-32700, -32600]
    assert await editor.command("opencomposer.sessions", {}) == []


async def test_disconnect_mid_session_stops_it_and_marks_the_trace(spawn, home, tmp_path):
    editor = await spawn(scripted(tmp_path / "m.json", ["slow " * 2000], 100))
    asyncio.ensure_future(editor.command(ASK, {"query": "slow"}))
    start = await asyncio.wait_for(editor.wait_event(lambda e: e["type"] == "model_delta"), 20)
    editor.process.stdin.close()
    code = await asyncio.wait_for(editor.process.wait(), 10)
    assert code == 0
    assert status(home, start["session_id"]) == "disconnected"


async def test_a_50mb_file_opens_and_the_agent_reads_it(spawn, repo, tmp_path):
    big = "".join(f"line {i} " + "x" * 90 + "\n" for i in range(500_000))  # ~50 MB
    (repo / "big.txt").write_text("small on disk\n")
    turns = ['<read_file path="big.txt" start_line="250000" end_line="250001"/>', "read"]
    editor = await spawn(scripted(tmp_path / "m.json", turns))
    editor.open("big.txt", big)
    t0 = time.monotonic()
    assert await editor.command("opencomposer.cancel", {}, timeout=60) == {"cancelled": []}
    assert time.monotonic() - t0 < 30
    await editor.command(ASK, {"query": "read"}, timeout=120)
    with sqlite3.connect(editor.root.parent / "home" / "traces.db") as db:
        (result,) = db.execute("SELECT result FROM tool_calls WHERE name='read_file'").fetchone()
    assert "line 249999 " in result


async def test_two_clients_share_one_workspace_over_tcp(repo, home, tmp_path):
    from lsp_harness import REPO, SERVER, Editor, server_env

    spec = scripted(tmp_path / "m.json", [FIX, "done"], 2000)
    proc = await asyncio.create_subprocess_exec(
        *SERVER,
        "--tcp",
        "127.0.0.1:0",
        "--model",
        spec,
        stderr=asyncio.subprocess.PIPE,
        env=server_env(home),
        cwd=str(REPO),
    )
    try:
        line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
        host, port = line.rsplit(" ", 1)[-1].strip().rsplit(":", 1)
        a = await Editor.connect(repo, host, int(port))
        b = await Editor.connect(repo, host, int(port))
        b.open("calc.py")
        ra, rb = await asyncio.gather(
            a.command(ASK, {"query": "from a"}), b.command("opencomposer.sessions", {})
        )
        assert ra["status"] == "completed"
        assert {e["session_id"] for e in a.events} == {ra["session_id"]}
        assert not b.events  # events go only to the client that asked
        # b's open buffer is b's: a's edit reached the disk through a's editor
        assert (repo / "calc.py").read_text() == CALC.replace("a - b", "a + b")
        undone = await b.command("opencomposer.undo", {"session_id": ra["session_id"]})
        assert undone == {"reverted": ["calc.py"]}
        assert b.buffer("calc.py") == CALC
        rb2 = await b.command(ASK, {"query": "from b"})
        assert {e["session_id"] for e in b.events} == {rb2["session_id"]}
        listed = {s["session_id"] for s in await a.command("opencomposer.sessions", {})}
        assert {ra["session_id"], rb2["session_id"]} <= listed
        await a.close()
        await b.close()
    finally:
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 30) == 0  # SIGTERM: a clean stop


def test_module_entry_rejects_a_bad_tcp_address():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "opencomposer.server.lsp", "--tcp", "nowhere"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "HOST:PORT" in out.stderr and "Traceback" not in out.stderr
    json.dumps(out.returncode)


@pytest.mark.slow  # loads the MiniLM embedder and builds an index: ~10-60 s here
async def test_search_sees_the_unsaved_buffer_through_the_index(spawn, repo, tmp_path):
    editor = await spawn(scripted(tmp_path / "m.json", ["hi"]))
    (repo / "retry.py").write_text("def backoff(attempt):\n    return min(30, 2 ** attempt)\n")
    hits = await editor.command(
        "opencomposer.search", {"query": "exponential backoff delay", "k": 3}, timeout=240
    )
    assert hits and hits[0]["path"] == "retry.py"
    assert {"path", "start_line", "end_line", "score", "text"} <= set(hits[0])
    uri = editor.open("calc.py")
    editor.change(uri, CALC + "\n\ndef zebra_unicorn_total(xs):\n    return sum(xs)\n")
    for _ in range(100):
        hits = await editor.command("opencomposer.search", {"query": "zebra_unicorn_total", "k": 3})
        if hits and "zebra_unicorn_total" in hits[0]["text"]:
            break
        await asyncio.sleep(0.1)
    assert hits[0]["path"] == "calc.py" and "zebra_unicorn_total" in hits[0]["text"]


@pytest.mark.slow  # a whole demo run, the sample repository's tests included
def test_demo_lsp_fixes_the_sample_repo_through_the_server(tmp_path, home):
    """examples/demo_lsp.py (what `make demo` runs) with a scripted model."""
    import subprocess
    import sys

    from lsp_harness import REPO, server_env

    turns = [
        '<edit_file path="shop/cart.py">\n<old>        return sum(item.price for item in self.items)</old>\n'
        "<new>        return sum(item.price * item.quantity for item in self.items)</new>\n</edit_file>",
        "Fixed: subtotal counts quantities.",
    ]
    spec = scripted(tmp_path / "m.json", turns, 2000)
    out = subprocess.run(
        [sys.executable, str(REPO / "examples" / "demo_lsp.py"), "--model", spec],
        capture_output=True,
        text=True,
        timeout=240,
        env=server_env(home),
        cwd=str(REPO),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "▶ edit_file" in text and "+        return sum(item.price * item.quantity" in text
    assert "status: completed" in text and f"trace: {home}/traces.db#" in text
    assert (
        "passed" in text.split("tests after the session")[-1]
        and "failed" not in text.split("tests after the session")[-1]
    )


async def test_two_sessions_at_once_and_cancelling_one_leaves_the_other(spawn, home, tmp_path):
    # Distinct words, not a count either: either would be stopped by the repetition guard.
    steps = " ".join(f"st{chr(97 + (i * 2654435761 >> 9) % 26)}p{i}" for i in range(150))
    editor = await spawn(scripted(tmp_path / "m.json", [steps], 500))  # ~2 s per session
    first = asyncio.ensure_future(editor.command(ASK, {"query": "one"}))
    second = asyncio.ensure_future(editor.command(ASK, {"query": "two"}))
    await asyncio.wait_for(editor.wait_event(lambda e: e["type"] == "model_delta"), 30)
    for _ in range(100):
        started = {e["session_id"] for e in editor.events if e["type"] == "session_start"}
        if len(started) == 2:
            break
        await asyncio.sleep(0.05)
    assert len(started) == 2
    victim = sorted(started)[0]
    assert await editor.command("opencomposer.cancel", {"session_id": victim}) == {
        "cancelled": [victim]
    }
    results = {
        r["session_id"]: r["status"]
        for r in await asyncio.wait_for(asyncio.gather(first, second), 60)
    }
    survivor = (started - {victim}).pop()
    assert results == {victim: "cancelled", survivor: "completed"}
    assert status(home, victim) == "cancelled" and status(home, survivor) == "completed"


async def test_shutdown_and_exit_end_the_process_with_0_and_exit_alone_with_1(spawn, tmp_path):
    spec = scripted(tmp_path / "m.json", ["hi"])
    polite = await spawn(spec)
    await polite.shutdown_async(None)
    polite.exit(None)
    assert await asyncio.wait_for(polite.process.wait(), 20) == 0
    abrupt = await spawn(spec)
    abrupt.exit(None)
    assert await asyncio.wait_for(abrupt.process.wait(), 20) == 1
