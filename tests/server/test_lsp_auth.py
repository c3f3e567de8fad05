"""`opencomposer serve --tcp` takes only clients that know its token.

The server is the real process. A connection that does not open with `initialize`
carrying the token gets one error and is closed, and nothing it sent has any effect:
no session, no trace, no file. The token is recorded, mode 0600, where a client on
this machine finds it, and the record goes when the server stops.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from lsp_harness import REPO, SERVER, Editor, scripted, server_env
from opencomposer.server import lsp_auth

ASK = "opencomposer.ask"


def frame(message: dict) -> bytes:
    body = json.dumps(message).encode()
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


def initialize(root: Path, msg_id: int = 1, options: object = None) -> dict:
    params: dict = {"processId": None, "rootUri": root.as_uri(), "capabilities": {}}
    if options is not None:
        params["initializationOptions"] = options
    return {"jsonrpc": "2.0", "id": msg_id, "method": "initialize", "params": params}


def ask(msg_id: int) -> dict:
    args = [{"query": "write it", "approve": "all"}]
    return {
        "jsonrpc": "2.0",
        "id": msg_id,
        "method": "workspace/executeCommand",
        "params": {"command": ASK, "arguments": args},
    }


@pytest.fixture
async def server(repo: Path, home: Path, tmp_path: Path):
    """A TCP server whose model, if a session ever ran, would write pwned.txt."""
    turns = ['<write_file path="pwned.txt"><content>x</content></write_file>', "done"]
    proc = await asyncio.create_subprocess_exec(
        *SERVER,
        "--tcp",
        "127.0.0.1:0",
        "--model",
        scripted(tmp_path / "m.json", turns),
        stderr=asyncio.subprocess.PIPE,
        env=server_env(home),
        cwd=str(REPO),
    )
    listening = (await asyncio.wait_for(proc.stderr.readline(), 60)).decode()
    token_line = (await asyncio.wait_for(proc.stderr.readline(), 10)).decode()
    host, port = listening.rsplit(" ", 1)[-1].strip().rsplit(":", 1)
    yield {"proc": proc, "host": host, "port": int(port), "token_line": token_line}
    if proc.returncode is None:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)


async def exchange(server: dict, data: bytes) -> tuple[list[dict], bool]:
    """Send raw bytes on a fresh connection; (the answers, whether the server closed it)."""
    reader, writer = await asyncio.open_connection(server["host"], server["port"])
    writer.write(data)
    await writer.drain()
    raw = b""
    closed = False
    try:
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), 5)
            if not chunk:
                closed = True
                break
            raw += chunk
    except TimeoutError:
        pass
    writer.close()
    answers = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        length = int(head.split(b":")[1])
        answers.append(json.loads(rest[:length]))
        raw = rest[length:]
    return answers, closed


def no_effect(repo: Path, home: Path) -> None:
    assert not (repo / "pwned.txt").exists()
    db = home / "traces.db"
    if db.exists():
        import sqlite3

        with sqlite3.connect(db) as conn:
            assert conn.execute("SELECT count(*) FROM sessions").fetchone() == (0,)


async def test_the_token_is_printed_once_and_recorded_for_this_user_only(server, home):
    info = json.loads((home / "servers" / f"{server['port']}.json").read_text())
    assert info["port"] == server["port"] and info["pid"] == server["proc"].pid
    assert len(info["token"]) >= 40 and info["token"] in server["token_line"]
    path = home / "servers" / f"{server['port']}.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert lsp_auth.token_for(server["port"]) == info["token"]
    server["proc"].terminate()
    assert await asyncio.wait_for(server["proc"].wait(), 30) == 0
    assert not path.exists()  # a stopped server leaves no token behind
    rest = (await server["proc"].stderr.read()).decode()
    assert info["token"] not in rest


OPENINGS = [
    "no options",
    "no token",
    "wrong token",
    "token as a number",
    "token with a lone surrogate",
    "ask first",
    "initialized first",
    "not json",
    "garbage",
]


async def test_a_client_without_the_token_is_refused_and_has_no_effect(server, repo, home):
    """Guards item 7 of issue 19: any local process could connect, pick the root folder,
    the model and approve: all, and run a session."""
    token = lsp_auth.token_for(server["port"])
    options = {
        "no options": None,
        "no token": {"model": "smollm2"},
        "wrong token": {"token": token[:-1] + ("A" if token[-1] != "A" else "B")},
        "token as a number": {"token": 12345},
        "token with a lone surrogate": {"token": token + "\ud800"},
    }
    for opening in OPENINGS:
        if opening in options:
            first = frame(initialize(repo, options=options[opening]))
        elif opening == "ask first":
            first = frame(ask(1))
        elif opening == "initialized first":
            first = frame({"jsonrpc": "2.0", "method": "initialized", "params": {}})
        elif opening == "not json":
            first = b"Content-Length: 5\r\n\r\n{nope"
        else:
            first = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
        # whatever follows the refused opening must not run either
        answers, closed = await exchange(
            server, first + frame(initialize(repo, 2, {"token": token})) + frame(ask(3))
        )
        assert closed, opening
        assert len(answers) <= 1 and all("error" in a for a in answers), (opening, answers)
        if opening in options or opening == "ask first":
            (answer,) = answers
            assert answer["id"] == 1 and answer["error"]["code"] == -32003, opening
    await asyncio.sleep(0.5)
    no_effect(repo, home)
    assert server["proc"].returncode is None


async def test_with_the_token_a_session_runs(server, repo, home, tmp_path):
    editor = await Editor.connect(repo, server["host"], server["port"])
    try:
        result = await editor.command(ASK, {"query": "write it", "approve": "all"})
        assert result["status"] == "completed"
        assert (repo / "pwned.txt").read_text() == "x"
    finally:
        await editor.close()


async def test_a_silent_connection_does_not_block_others(server, repo):
    reader, writer = await asyncio.open_connection(server["host"], server["port"])
    try:
        editor = await Editor.connect(repo, server["host"], server["port"])
        assert await editor.command("opencomposer.sessions", {}) == []
        await editor.close()
    finally:
        writer.close()


def test_a_non_loopback_address_needs_allow_remote(home):
    """Binding every interface exposes the token to the network: refused by default."""
    out = subprocess.run(
        [*SERVER, "--tcp", "0.0.0.0:0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=server_env(home),
        cwd=str(REPO),
    )
    assert out.returncode == 2 and "--allow-remote" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (home / "servers").exists() or not any((home / "servers").iterdir())


def test_allow_remote_listens_with_a_warning(home, tmp_path):
    spec = scripted(tmp_path / "done.json", ["done"])
    proc = subprocess.Popen(
        [*SERVER, "--tcp", "0.0.0.0:0", "--allow-remote", "--model", spec],
        stderr=subprocess.PIPE,
        text=True,
        env=server_env(home),
        cwd=str(REPO),
    )
    try:
        first, second = proc.stderr.readline(), proc.stderr.readline()
        assert "warning" in first and "unencrypted" in first
        assert "listening on 0.0.0.0:" in second
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_cli_serve_refuses_allow_remote_without_tcp(home):
    out = subprocess.run(
        [sys.executable, "-m", "opencomposer.server.cli", "serve", "--allow-remote"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "OPENCOMPOSER_HOME": str(home)},
        cwd=str(REPO),
    )
    assert out.returncode == 2 and "--allow-remote goes with --tcp" in out.stderr


class _QuietUI:
    def server_event(self, event): ...
    async def server_approval(self, message, actions): ...
    def server_progress(self, token, value): ...
    def server_show_document(self, path): ...
    def server_log(self, level, message): ...
    def server_edit_failed(self, message): ...
    def server_stopped(self, reason): ...


async def test_the_tui_link_sends_the_recorded_token_and_fails_clearly_without_it(
    server, repo, tmp_path, monkeypatch
):
    from opencomposer.clients.tui.link import LinkConfig, LinkError, ServerLink

    address = f"{server['host']}:{server['port']}"
    link = ServerLink(LinkConfig(workspace=repo, tcp=address), _QuietUI())
    await link.start()
    try:
        assert await link.command("opencomposer.sessions", {}) == []
    finally:
        await link.stop()

    wrong = ServerLink(LinkConfig(workspace=repo, tcp=address, token="not-it"), _QuietUI())
    with pytest.raises(LinkError):
        await wrong.start()

    monkeypatch.setenv("OPENCOMPOSER_HOME", str(tmp_path / "elsewhere"))
    monkeypatch.delenv("OPENCOMPOSER_TOKEN", raising=False)
    lost = ServerLink(LinkConfig(workspace=repo, tcp=address), _QuietUI())
    with pytest.raises(LinkError, match="no token for the language server"):
        await lost.start()
