"""`opencomposer ask` hands its request to a running `serve --tcp` of this user.

Real processes: the server, then `ask` as a user runs it. The scripted model is read
once, when the server first loads it; rewriting its file afterwards tells the two
paths apart (the server keeps playing the old turns, a fresh in-process model the
new ones), so each test knows which process ran the session.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from lsp_harness import REPO, SERVER, scripted, server_env
from opencomposer.agent import events as ev
from opencomposer.server.ask import event_from_wire

CLI = [sys.executable, "-m", "opencomposer.server.cli"]
EDIT = '<edit_file path="calc.py"><old>return a - b</old><new>return a + b</new></edit_file>'


@pytest.fixture
def served(tmp_path: Path, home: Path):
    """A TCP server on the scripted model; (its spec file, its process)."""
    spec = scripted(tmp_path / "m.json", [EDIT, "fixed by the server"])
    proc = subprocess.Popen(
        [*SERVER, "--tcp", "127.0.0.1:0", "--model", spec],
        stderr=subprocess.PIPE,
        text=True,
        env=server_env(home),
        cwd=str(REPO),
    )
    assert proc.stderr is not None
    assert "listening" in proc.stderr.readline()
    proc.stderr.readline()  # the token line
    yield spec, proc
    proc.terminate()
    proc.wait(30)


def ask(args: list[str], home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "ask", *args], capture_output=True, text=True, env=server_env(home), timeout=120
    )


def rewrite(spec: str) -> None:
    """New turns for the model file; only a process that loads it from now on sees them."""
    scripted(Path(spec.removeprefix("scripted:")), ["answered in the asking process"])


def test_ask_runs_on_the_running_server_and_writes_its_edits(served, repo, home) -> None:
    spec, _ = served
    args = ["fix add", "-w", str(repo), "-m", spec, "--json", "--approve", "all"]
    first = ask(args, home)
    assert first.returncode == 0, first.stderr
    events = [json.loads(line) for line in first.stdout.splitlines()]
    assert events[0]["type"] == "session_start" and events[-1]["type"] == "session_end"
    assert {"tool_start", "edit", "model_end", "message"} <= {e["type"] for e in events}
    assert "model_delta" not in {e["type"] for e in events}
    messages = [e["text"] for e in events if e["type"] == "message"]
    assert messages[-1] == "fixed by the server"
    assert "return a + b" in (repo / "calc.py").read_text()  # the edit reached the disk

    rewrite(spec)  # the server loaded the model at the first ask and keeps it
    (repo / "calc.py").write_text((repo / "calc.py").read_text().replace("a + b", "a - b"))
    second = ask(args, home)
    assert second.returncode == 0, second.stderr
    assert "fixed by the server" in second.stdout
    assert "return a + b" in (repo / "calc.py").read_text()


def test_no_server_flag_and_other_models_run_here(served, repo, home) -> None:
    spec, _ = served
    assert ask(["q", "-w", str(repo), "-m", spec, "--json"], home).returncode == 0
    rewrite(spec)
    here = ask(["q", "-w", str(repo), "-m", spec, "--json", "--no-server"], home)
    assert here.returncode == 0, here.stderr
    assert "answered in the asking process" in here.stdout
    other = scripted(repo.parent / "other.json", ["another model"])
    there = ask(["q", "-w", str(repo), "-m", other, "--json"], home)
    assert "another model" in there.stdout


def test_an_unreachable_server_falls_back_to_this_process(tmp_path, repo, home) -> None:
    import os
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    spec = scripted(tmp_path / "m.json", ["answered in the asking process"])
    record = {"host": "127.0.0.1", "port": port, "token": "t", "pid": os.getpid(), "model": spec}
    (home / "servers").mkdir(mode=0o700)
    (home / "servers" / f"{port}.json").write_text(json.dumps(record))
    out = ask(["q", "-w", str(repo), "-m", spec, "--json"], home)
    assert out.returncode == 0, out.stderr
    assert "answered in the asking process" in out.stdout
    assert f"the server on port {port} is unreachable" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_events_come_back_typed_from_their_wire_form() -> None:
    end = ev.ModelEnd(t=1.5, turn=2, prompt_tokens=300, completion_tokens=40)
    wire = {**end.to_wire(), "session_id": "abc"}
    assert event_from_wire(wire) == end
    assert event_from_wire({"type": "no_such_event", "t": 0}) is None
    assert event_from_wire({"type": "model_end", "t": 0}) is None  # fields missing
