"""A tiny stand-in for `opencomposer serve`, speaking the docs/lsp.md contract over stdio.

Only for developing the TUI before the real server exists and for the keystroke
benchmark's steady event stream. The query picks the scenario: "crash" exits mid-session,
"approve" asks before a command, "stream N" sends N model_delta events per second for a
while; anything else is a session with two parallel calls and one edit.

    python tests/clients/tui_fake_server.py
"""

from __future__ import annotations

import asyncio
import difflib
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

from lsprotocol import types as lsp
from pygls.lsp.server import LanguageServer

server = LanguageServer("fake-opencomposer", "0")
state: dict[str, Any] = {"cancel": set(), "edits": {}}


def root() -> Path:
    return Path(server.workspace.root_path or os.getcwd())


def emit(sid: str, type_: str, **fields: Any) -> None:
    server.protocol.notify(
        "opencomposer/event", {"type": type_, "t": 0.0, "session_id": sid, **fields}
    )


async def write(path: Path, text: str) -> bool:
    uri = path.as_uri()
    old = path.read_text() if path.exists() else ""
    lines = old.splitlines(keepends=True)
    edit = lsp.WorkspaceEdit(
        document_changes=[
            lsp.TextDocumentEdit(
                text_document=lsp.OptionalVersionedTextDocumentIdentifier(uri=uri, version=None),
                edits=[
                    lsp.TextEdit(
                        range=lsp.Range(
                            start=lsp.Position(line=0, character=0),
                            end=lsp.Position(line=len(lines), character=0),
                        ),
                        new_text=text,
                    )
                ],
            )
        ]
    )
    result = await server.workspace_apply_edit_async(lsp.ApplyWorkspaceEditParams(edit=edit))
    return bool(result.applied)


@server.command("opencomposer.ask")
async def ask(args: Any) -> dict[str, Any]:
    query = args["query"]
    sid = uuid.uuid4().hex[:8]
    emit(sid, "session_start", workspace=str(root()), model="fake")
    emit(sid, "model_start", turn=1)
    m = re.match(r"stream (\d+)", query)
    if m:
        rate = int(m.group(1))
        deadline = time.monotonic() + float(os.environ.get("FAKE_STREAM_S", "5"))
        i = 0
        while time.monotonic() < deadline and sid not in state["cancel"]:
            emit(sid, "model_delta", turn=1, text=f"word{i} ")
            i += 1
            await asyncio.sleep(1 / rate)
        emit(sid, "session_end", status="ok", turns=1, tool_calls=0, duration_s=1.0, trace="")
        return {"session_id": sid, "status": "ok", "answer": ""}
    for piece in ["I'll look at ", "both files.\n", '<read_file path="a.py"/>']:
        emit(sid, "model_delta", turn=1, text=piece)
        await asyncio.sleep(0.01)
    if "crash" in query:
        await asyncio.sleep(0.1)
        os._exit(3)
    emit(sid, "tool_start", turn=1, call_id="c1", name="read_file", args={"path": "a.py"})
    emit(sid, "tool_start", turn=1, call_id="c2", name="grep", args={"pattern": "def"})
    await asyncio.sleep(0.05)
    emit(
        sid,
        "tool_end",
        turn=1,
        call_id="c1",
        name="read_file",
        status="ok",
        duration_s=0.01,
        result="1 x = 1",
    )
    emit(
        sid,
        "tool_end",
        turn=1,
        call_id="c2",
        name="grep",
        status="ok",
        duration_s=0.02,
        result="a.py:1:x",
    )
    emit(sid, "model_end", turn=1, prompt_tokens=100, completion_tokens=20)
    emit(sid, "message", turn=1, text='I\'ll look at both files.\n<read_file path="a.py"/>')
    emit(sid, "model_start", turn=2)
    if "approve" in query:
        choice = await server.window_show_message_request_async(
            lsp.ShowMessageRequestParams(
                type=lsp.MessageType.Info,
                message="run_terminal wants to run: pytest -q",
                actions=[
                    lsp.MessageActionItem(title=t)
                    for t in ("Run", "Always for this command", "Reject")
                ],
            )
        )
        emit(sid, "message", turn=2, text=f"You chose {choice.title if choice else 'nothing'}.")
        emit(sid, "session_end", status="ok", turns=2, tool_calls=2, duration_s=1.0, trace="")
        return {"session_id": sid, "status": "ok", "answer": "chosen"}
    path = root() / "a.py"
    before = path.read_text() if path.exists() else ""
    after = before.replace("x = 1", "x = 2")
    emit(sid, "tool_start", turn=2, call_id="c3", name="edit_file", args={"path": "a.py"})
    ok = await write(path, after)
    state["edits"][(sid, "a.py")] = before
    diff = "".join(
        difflib.unified_diff(before.splitlines(True), after.splitlines(True), "a/a.py", "b/a.py")
    )
    emit(sid, "edit", path="a.py", diff=diff)
    emit(
        sid,
        "tool_end",
        turn=2,
        call_id="c3",
        name="edit_file",
        status="ok" if ok else "error",
        duration_s=0.03,
    )
    emit(sid, "model_end", turn=2, prompt_tokens=150, completion_tokens=30)
    emit(sid, "message", turn=2, text="Changed **x** to 2.")
    emit(sid, "session_end", status="ok", turns=2, tool_calls=3, duration_s=1.0, trace="")
    return {"session_id": sid, "status": "ok", "answer": "Changed **x** to 2."}


@server.command("opencomposer.cancel")
def cancel(args: Any) -> dict[str, Any]:
    sid = args.get("session_id")
    state["cancel"].add(sid)
    return {"cancelled": [sid]}


@server.command("opencomposer.decide")
async def decide(args: Any) -> dict[str, Any]:
    if args["decision"] == "reject":
        key = (args["session_id"], args["path"])
        await write(root() / args["path"], state["edits"][key])
        return {"ok": True, "reverted": True}
    return {"ok": True, "reverted": False}


@server.command("opencomposer.search")
def search(args: Any) -> list[dict[str, Any]]:
    return [{"path": "a.py", "start_line": 1, "end_line": 1, "score": 0.9, "text": "x = 1\n"}]


@server.command("opencomposer.sessions")
def sessions(args: Any) -> list[dict[str, Any]]:
    return [
        {
            "session_id": "s1",
            "started": "2026-01-01T00:00:00",
            "status": "ok",
            "query": "fix x",
            "model": "fake",
            "edits": 1,
        }
    ]


@server.command("opencomposer.submit")
def submit(args: Any) -> dict[str, Any]:
    return {"task_dir": "/tmp/task-s1"}


if __name__ == "__main__":
    server.start_io()
