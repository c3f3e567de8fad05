"""The TUI connected over TCP (`--tcp HOST:PORT`) to a running language server.

The server is the real one (`python -m opencomposer.server.lsp --tcp`), with the
`scripted:` model; the TUI reads it through the same reader thread as a child's stdout.

    .venv/bin/python -m pytest tests/clients/test_tui_tcp.py -q
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from opencomposer.clients.tui.app import OpenComposerApp
from opencomposer.clients.tui.transcript import DiffEntry, ToolCard
from tui_harness import (
    DONE,
    EDIT,
    FIXED,
    READ_BOTH,
    ask,
    make_script,
    make_workspace,
    session_ended,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_session_over_tcp_then_server_gone(tmp_path, monkeypatch):
    ws = make_workspace(tmp_path / "repo")
    model = make_script(tmp_path / "turns.json", [READ_BOTH, EDIT, DONE], 4000)
    port = _free_port()
    # one home for both: the TUI finds the server's token where the server recorded it
    monkeypatch.setenv("OPENCOMPOSER_HOME", str(tmp_path / "home"))
    env = {**os.environ}
    server = subprocess.Popen(
        [sys.executable, "-m", "opencomposer.server.lsp", "--tcp", f"127.0.0.1:{port}"]
        + ["--model", model],
        cwd=ws,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert "listening" in server.stderr.readline()
        app = OpenComposerApp(
            workspace=ws, model=model, tcp=f"127.0.0.1:{port}", show_timings=False
        )
        async with app.run_test(size=(100, 40)) as pilot:
            await ask(pilot, "fix add")
            await session_ended(pilot)
            assert app.session.status == "completed"
            assert [c.name_ for c in app.query(ToolCard)][:3] == ["read_file", "read_file", "grep"]
            assert (ws / "calc.py").read_text() == FIXED
            assert app.query_one(DiffEntry).path == "calc.py"
            server.terminate()
            deadline = time.monotonic() + 20
            while app.server_error is None:
                assert time.monotonic() < deadline, "no notice of the closed connection"
                await pilot.pause(0.1)
            assert f"the connection to 127.0.0.1:{port} closed" in app.server_error
    finally:
        server.terminate()
        server.wait(timeout=20)
