"""The `opencomposer` CLI as a user runs it: a real process, the scripted model."""

import json
import os
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "opencomposer.server.cli"]


@pytest.fixture
def env(tmp_path):
    return {**os.environ, "OPENCOMPOSER_HOME": str(tmp_path / "home")}


def run(args, env, **kw):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=120, **kw)


def test_ask_json_event_stream_and_traces(tmp_path, env):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a.py").write_text("x = 1\n")
    script = tmp_path / "s.json"
    script.write_text(
        json.dumps(
            {
                "turns": [
                    '<read_file path="a.py"/>\n<edit_file path="a.py"><old>x = 1</old><new>x = 2</new></edit_file>',
                    "done",
                ]
            }
        )
    )
    p = run(
        ["ask", "bump x", "-w", str(ws), "-m", f"scripted:{script}", "--json", "--approve", "all"],
        env,
    )
    assert p.returncode == 0, p.stderr
    events = [json.loads(line) for line in p.stdout.splitlines()]
    assert [e["type"] for e in events][0] == "session_start"
    assert events[-1]["type"] == "session_end" and events[-1]["status"] == "completed"
    assert {
        "session_start",
        "model_start",
        "tool_start",
        "tool_end",
        "edit",
        "model_end",
        "message",
    } <= {e["type"] for e in events}
    assert "model_delta" not in {e["type"] for e in events}
    assert all(isinstance(e["t"], float | int) for e in events)
    assert (ws / "a.py").read_text() == "x = 2\n"
    sid = events[0]["session_id"]

    listing = run(["traces", "list", "--json"], env)
    assert json.loads(listing.stdout)[0]["session_id"] == sid
    shown = run(["traces", "show", sid[:6]], env)
    assert "edit a.py" in shown.stdout and shown.returncode == 0
    exported = json.loads(run(["traces", "export", sid], env).stdout)
    assert exported["edits"][0]["after"] == "x = 2\n"


def test_without_approval_edits_are_refused_in_json_mode(tmp_path, env):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a.py").write_text("x = 1\n")
    script = tmp_path / "s.json"
    script.write_text(
        json.dumps({"turns": ['<write_file path="b.py"><content>y</content></write_file>', "ok"]})
    )
    p = run(["ask", "q", "-w", str(ws), "-m", f"scripted:{script}", "--json"], env)
    assert p.returncode == 0
    assert not (ws / "b.py").exists()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["ask", "q", "-w", "/nonexistent/dir", "-m", "scripted:/x.json"], "not a directory"),
        (["ask", "q", "-m", "gpt-nothing"], "unknown model spec"),
        (["ask", "   ", "-m", "scripted:/etc/hostname"], "empty"),
        (["traces", "show", "nosuchsession"], "no session"),
    ],
)
def test_user_mistakes_are_one_line(args, needle, env, tmp_path):
    p = run(args, env, cwd=tmp_path)
    assert p.returncode != 0
    assert needle in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
