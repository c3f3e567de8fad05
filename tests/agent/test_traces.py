"""The SQLite trace store: round trip, secret redaction, decisions, git state."""

import subprocess

from opencomposer.agent.protocols import TurnOutput
from opencomposer.agent.redact import Redactor
from opencomposer.agent.traces import TraceStore


def test_round_trip_and_redaction(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / ".env").write_text("DATABASE_URL=postgres://u:hunter2secret@db/x\n")
    store = TraceStore(tmp_path / "t.db")
    store.start_session(
        "s1",
        workspace=ws,
        model="m",
        sampling={"temperature": 0.2},
        query="use sk-abcdefghijklmnopqrstu",
    )
    out = TurnOutput(
        text="saw postgres://u:hunter2secret@db/x",
        prompt_token_ids=[1, 2],
        completion_token_ids=[3],
    )
    store.write_turn(
        "s1", 1, messages=[{"role": "user", "content": "hi"}], output=out, t_start=0, t_end=1
    )
    clean = TurnOutput(
        text="plain", prompt_token_ids=[1, 2], completion_token_ids=[3], completion_logprobs=[-0.5]
    )
    store.write_turn(
        "s1", 2, messages=[{"role": "user", "content": "hi"}], output=clean, t_start=1, t_end=2
    )
    store.write_call(
        "s1",
        1,
        call_id="t1c0",
        index=0,
        name="run_terminal",
        args={"command": "echo $TOKEN"},
        status="ok",
        result='api_key = "abcdef123456"',
        t_start=0,
        t_end=1,
    )
    store.write_edit("s1", 1, turn=1, call_id="t1c0", path="a.py", before="", after="x", diff="+x")
    store.end_session("s1", status="completed", answer="done", turns=2, tool_calls=1)
    assert store.record_decision("s1", "a.py", "accept") == 1

    t = store.export("s1")
    assert "sk-abc" not in t["query"] and "[REDACTED]" in t["query"]
    assert "hunter2secret" not in t["turns"][0]["text"]
    assert t["turns"][0]["prompt_token_ids"] is None and t["turns"][0]["redacted"] == 1
    assert t["turns"][1]["completion_logprobs"] == [-0.5]
    assert "abcdef123456" not in t["tool_calls"][0]["result"]
    assert t["edits"][0]["decision"] == "accept"
    assert store.resolve("s") == "s1"
    assert store.list_sessions()[0]["edits"] == 1
    # a second process sees the same data (WAL)
    other = TraceStore(tmp_path / "t.db")
    assert other.get("s1")["status"] == "completed"


def test_git_state_recorded(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    run = lambda *a: subprocess.run(["git", "-C", str(ws), *a], check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    (ws / "a.txt").write_text("one\n")
    run("add", "a.txt")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    (ws / "a.txt").write_text("two\n")
    (ws / "new.txt").write_text("fresh\n")
    store = TraceStore(tmp_path / "t.db")
    store.start_session("s", workspace=ws, model="m", sampling={}, query="q")
    t = store.get("s")
    assert len(t["git_head"]) == 40
    assert "+two" in t["git_diff"] and "+fresh" in t["git_diff"]


def test_redactor_keeps_code():
    r = Redactor()
    assert r("token = get_token()") == "token = get_token()"
    assert r("Authorization: Bearer abcdefghijklmnop") == "Authorization: Bearer [REDACTED]"
    assert "ghp_" not in r("ghp_" + "a" * 36)
