"""The SQLite trace store: round trip, secret redaction, decisions, git state."""

import json
import os
import signal
import sqlite3
import subprocess
import sys

import pytest
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
        meta={"stop_reason": "token sk-abcdefghijklmnopqrstu"},
    )
    store.write_turn(
        "s1", 1, messages=[{"role": "user", "content": "hi"}], output=out, t_start=0, t_end=1
    )
    clean = TurnOutput(
        text="plain", prompt_token_ids=[1, 2], completion_token_ids=[3], completion_logprobs=[-0.5]
    )
    clean.meta["fix_samples"] = {"chosen": 1, "gains": [None, 2.5, float("nan")]}
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
    # what the backend and the session noted of a turn is kept, redacted and strict JSON
    assert t["turns"][0]["meta"] == {"stop_reason": "token [REDACTED]"}
    assert t["turns"][1]["meta"] == {"fix_samples": {"chosen": 1, "gains": [None, 2.5, None]}}
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


# -- issue 19: the trace store on hostile input ----------------------------------------

CLI = [sys.executable, "-m", "opencomposer.server.cli"]


def _cli(args, home, **kw):
    env = {**os.environ, "OPENCOMPOSER_HOME": str(home)}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=120, **kw)


def _script(tmp_path, *turns):
    path = tmp_path / f"script-{len(list(tmp_path.glob('script-*')))}.json"
    path.write_text(json.dumps({"turns": list(turns)}))
    return f"scripted:{path}"


def _db_bytes(home) -> bytes:
    """Everything SQLite wrote: the database and its write-ahead log."""
    return b"".join(p.read_bytes() for p in sorted(home.glob("traces.db*")) if p.is_file())


def test_session_start_runs_no_program_from_the_repository(tmp_path):
    """Issue 19 items 2-3: a .git/config naming diff.external, core.fsmonitor, a filter
    driver (via .gitattributes), a textconv driver and a hooks folder made `git diff`
    at session start run them on the host, even with --approve none."""
    marks = tmp_path / "marks"
    marks.mkdir()
    ws = tmp_path / "ws"
    ws.mkdir()
    git = lambda *a: subprocess.run(["git", "-C", str(ws), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    (ws / "a.txt").write_text("one\n")
    git("add", "a.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")

    def evil(name):
        p = tmp_path / f"{name}.sh"
        p.write_text(f"#!/bin/sh\ntouch {marks}/{name}\ncat\n")
        p.chmod(0o755)
        return p

    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "post-index-change").write_text(f"#!/bin/sh\ntouch {marks}/hook\n")
    (hooks / "post-index-change").chmod(0o755)
    with (ws / ".git" / "config").open("a") as f:
        f.write(
            f"[core]\n\tfsmonitor = {evil('fsmonitor')}\n\thooksPath = {hooks}\n"
            f"[diff]\n\texternal = {evil('external')}\n"
            f'[diff "conv"]\n\ttextconv = {evil("textconv")}\n'
            f'[filter "f"]\n\tclean = {evil("clean")}\n\tsmudge = {evil("smudge")}\n'
        )
    (ws / ".gitattributes").write_text("*.txt filter=f diff=conv\n")
    (ws / "a.txt").write_text("two\n")
    (ws / "new.txt").write_text("fresh\n")
    home = tmp_path / "home"
    p = _cli(
        [
            "ask",
            "hi",
            "-w",
            str(ws),
            "-m",
            _script(tmp_path, "done"),
            "--approve",
            "none",
            "--json",
        ],
        home,
    )
    assert p.returncode == 0, p.stderr
    assert sorted(m.name for m in marks.iterdir()) == []
    store = TraceStore(home / "traces.db")
    t = store.get(store.list_sessions()[0]["session_id"])
    head = subprocess.run(
        ["git", "-C", str(ws), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    assert t["git_head"] == head.stdout.strip()
    assert "+two" in t["git_diff"] and "+fresh" in t["git_diff"]
    # control: plain git on the same repository does run them
    subprocess.run(["git", "-C", str(ws), "diff", "HEAD"], capture_output=True, timeout=30)
    assert {"fsmonitor", "external"} <= {m.name for m in marks.iterdir()}


SECRETS = {
    "aws ini": ("[default]\naws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY\n", "wJalrXUtnFEMI/K7MDENG"),
    "aws id": ("key id AKIAIOSFODNN7EXAMPL2", "AKIAIOSFODNN7EXAMPL2"),
    "stripe live": ("stripe.api_key = sk_live_51HxYzAbCdEfGhIjKlMn0p", "sk_live_51HxYz"),
    "stripe restricted": ("use rk_live_51HxYzAbCdEfGhIjKlMn0p now", "rk_live_51HxYz"),
    "stripe test": ("STRIPE=sk_test_4eC39HqLyjWDarjtT1zdp7dc", "4eC39HqLyjWDarjtT1zdp7dc"),
    "slack": ("token xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrSt", "AbCdEfGhIjKlMnOpQrSt"),
    "google": ("maps AIzaSyA-1234567890abcdefghijklmnopqrs", "AIzaSyA-1234567890"),
    "jwt": ("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U", "dozjgNryP4J3jVmNHl0w5N"),
    "bearer": ("curl -H 'Authorization: Bearer abcdefghijklmnop12345xyz'", "abcdefghijklmnop12345xyz"),
    "basic": ("Authorization: Basic dXNlcjpwYXNzd29yZDEyMw==", "dXNlcjpwYXNzd29yZDEyMw"),
    "url": ("DATABASE=postgres://admin:Hunter2Secret@db.example.com/app", "Hunter2Secret"),
    "password": ('db_password = "correct horse battery staple"', "correct horse battery"),
    "env line": ("export GITHUB_TOKEN=abcdef0123456789", "abcdef0123456789"),
    "cli flag": ("mysql --password S3cretPass --user root", "S3cretPass"),
    "grep -r hit": ("/root/.ssh/id_rsa:MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7VJTUt9Us8cKj", "MIIEvQIBADANBgkqhkiG9w0"),
    "openssh body": ("b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\nQyNTUxOQAAACBNa8ZxZC1bVw5yQkHh2WmEMbhY0a7m1qL3D3gZ0m8m9AAAAJgNYIRbDWCE", "QyNTUxOQAAACBNa8ZxZC1b"),
    "json key": ('{"type": "service_account", "private_key": "-----BEGIN PRIVATE KEY-----\\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\\nBKcwggSjAgEAAoIBAQC7\\n-----END PRIVATE KEY-----\\n"}', "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC"),
}  # fmt: skip


@pytest.mark.parametrize("text,secret", SECRETS.values(), ids=SECRETS.keys())
def test_secret_formats_never_reach_the_database(tmp_path, text, secret):
    """Issue 19 item 12: formats the redactor missed (INI AWS secret, sk_live_, …)
    checked in the SQLite file's bytes, through every column that holds text."""
    ws = tmp_path / "ws"
    ws.mkdir()
    home = tmp_path / "home"
    store = TraceStore(home / "traces.db")
    store.start_session("s", workspace=ws, model="m", sampling={}, query=f"look: {text}")
    out = TurnOutput(text=f"I saw\n{text}\n", prompt_token_ids=[1], completion_token_ids=[2])
    store.write_turn(
        "s", 1, messages=[{"role": "user", "content": text}], output=out, t_start=0, t_end=1
    )
    store.write_call("s", 1, call_id="c", index=0, name="run_terminal", args={"command": text},
                     status="ok", result=f"out:\n{text}\n", t_start=0, t_end=1)  # fmt: skip
    store.write_edit(
        "s", 1, turn=1, call_id="c", path="cfg", before="", after=text, diff=f"+{text}"
    )
    store.end_session("s", status="completed", answer=text, turns=1, tool_calls=1)
    store.close()
    assert secret.encode() not in _db_bytes(home)
    assert TraceStore(home / "traces.db").export("s")["turns"][0]["prompt_token_ids"] is None


def test_redaction_keeps_ordinary_code():
    """Secret-named keys whose values are code, and look-alikes, stay as written."""
    r = Redactor()
    for code in (
        "password = input()",
        "token = self.token",
        "api_key = os.environ['API_KEY']",
        "secret = None",
        "max_tokens = 4096",
        'tokenizer_name = "gpt2"',
        "password_min_length = 12",
        "API_TOKEN = settings.token",
        "token: ${GITHUB_TOKEN}",
        "sha = 3f786850e387550fdab836ed7e6dc881de23001b",
        "pk_live_abcdefghijklmnopqrstu is a publishable key",
        "if line.startswith('-----BEGIN PRIVATE KEY-----'):",
        "NODE_ENV=production",
    ):
        assert r(code) == code


def test_partial_pem_and_env_two_folders_deep_through_a_session(tmp_path):
    """Issue 19 item 12: read_file of lines 3-6 of a key file (body lines only, no
    BEGIN/END) and of a `.env` two folders deep; neither reaches traces.db."""
    ws = tmp_path / "ws"
    (ws / "a" / "b").mkdir(parents=True)
    body = [
        "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7VJTUt9Us8cKj",
        "MgRVbB9PZ1hXiHQGD4UtjeWYRgRGpYN2vwCOqImL3bHxHQpNnUjtP0S9wEyHmCaT",
        "Rw5rPqK2dL8mN3xZ7vB4cF1gH6jK9sT0uW2yA5eI8oU3nM7bV1cX4zQ9wE6rT2yU",
        "Lp0Ok9Ij8Uh7Yg6Tf5Rd4Es3Wa2Qz1Xc0Vb9Nm8Mk7Jh6Gf5Dd4Ss3Aa2Zz1Xx0Q",
        "Pq9Wo8Ei7Ru6Ty5Yu4Ui3Io2Op1As0Df9Gh8Jk7Lz6Xc5Vb4Nm3Qw2Er1Ty0Ui9Op",
    ]
    (ws / "id_rsa").write_text(
        "-----BEGIN RSA PRIVATE KEY-----\n"
        + "\n".join(body)
        + "\nabc=\n-----END RSA PRIVATE KEY-----\n"
    )
    (ws / "a" / "b" / ".env").write_text(
        "DB_PASS=hunter2pass\nSESSION=Zq81kLm20xYt\nWEBHOOK=whsec_Abc123Def456Ghi789Jkl\n"
    )
    home = tmp_path / "home"
    model = _script(
        tmp_path,
        '<read_file path="id_rsa" start_line="3" end_line="6"/>\n<read_file path="a/b/.env"/>',
        "I read them.",
    )
    p = _cli(["ask", "read", "-w", str(ws), "-m", model, "--approve", "safe", "--json"], home)
    assert p.returncode == 0, p.stderr
    assert body[2] in p.stdout and "hunter2pass" in p.stdout  # the reads happened
    data = _db_bytes(home)
    for secret in (*body[1:5], "hunter2pass", "Zq81kLm20xYt", "whsec_Abc123"):
        assert secret.encode() not in data, secret


def test_export_is_strict_json_without_nan(tmp_path):
    """Issue 19 item 13: NaN logprobs and rewards made `traces export` write `NaN`."""
    home = tmp_path / "home"
    ws = tmp_path / "ws"
    ws.mkdir()
    store = TraceStore(home / "traces.db")
    store.start_session(
        "s", workspace=ws, model="m", sampling={"temperature": float("nan")}, query="q"
    )
    out = TurnOutput(
        text="x",
        prompt_token_ids=[1],
        completion_token_ids=[2, 3],
        completion_logprobs=[float("nan"), float("-inf")],
    )
    store.write_turn(
        "s", 1, messages=[{"role": "user", "content": "q"}], output=out, t_start=0, t_end=1
    )
    store.set_meta("s", reward=float("nan"), scores=[float("inf"), 1.0])
    store.end_session("s", status="completed", answer="a", turns=1, tool_calls=0)
    store.close()

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    for args in (["traces", "export", "s"], ["traces", "list", "--json"]):
        p = _cli(args, home)
        assert p.returncode == 0, p.stderr
        data = json.loads(p.stdout, parse_constant=refuse)
    p = _cli(["traces", "export", "s"], home)
    data = json.loads(p.stdout, parse_constant=refuse)
    assert data["turns"][0]["completion_logprobs"] == [None, None]
    assert data["meta"]["reward"] is None and data["meta"]["scores"] == [None, 1.0]


VICTIM = """
import sys, time
from pathlib import Path
from opencomposer.agent.traces import TraceStore
store = TraceStore(Path(sys.argv[1]))
store.start_session("victim", workspace=Path(sys.argv[2]), model="m", sampling={}, query="q")
print("started", flush=True)
time.sleep(600)
"""


def test_session_killed_with_sigkill_is_marked_interrupted(tmp_path):
    """Issue 19 item 13: a session whose process was killed with `kill -9` stayed
    `running` forever; reading the store now marks it `interrupted`, on disk too."""
    ws = tmp_path / "ws"
    ws.mkdir()
    db = tmp_path / "home" / "traces.db"
    proc = subprocess.Popen(
        [sys.executable, "-c", VICTIM, str(db), str(ws)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "started"
        store = TraceStore(db)
        assert store.get("victim")["status"] == "running"  # alive: left alone
        store.start_session("mine", workspace=ws, model="m", sampling={}, query="q")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    rows = {r["session_id"]: r["status"] for r in store.list_sessions()}
    assert rows == {"victim": "interrupted", "mine": "running"}
    with sqlite3.connect(db) as raw:
        assert raw.execute("SELECT status FROM sessions WHERE id='victim'").fetchone() == (
            "interrupted",
        )
    listed = _cli(["traces", "list", "--json"], db.parent)
    assert {r["session_id"]: r["status"] for r in json.loads(listed.stdout)}[
        "victim"
    ] == "interrupted"


def test_old_database_gains_the_owner_columns(tmp_path):
    db = tmp_path / "traces.db"
    with sqlite3.connect(db) as raw:
        raw.execute(
            "CREATE TABLE sessions (id TEXT PRIMARY KEY, started REAL, ended REAL, status TEXT,"
            " workspace TEXT, git_head TEXT, git_diff TEXT, model TEXT, sampling TEXT, query TEXT,"
            " answer TEXT, turns INTEGER DEFAULT 0, tool_calls INTEGER DEFAULT 0, meta TEXT)"
        )
        raw.execute("INSERT INTO sessions (id, status) VALUES ('old', 'running')")
    store = TraceStore(db)
    assert store.get("old")["status"] == "running"  # no owner recorded: left as it was
    store.start_session("new", workspace=tmp_path, model="m", sampling={}, query="q")
    assert store.get("new")["pid"] == os.getpid()


def test_old_database_gains_the_turn_meta_column(tmp_path):
    db = tmp_path / "traces.db"
    store = TraceStore(db)
    store.start_session("s", workspace=tmp_path, model="m", sampling={}, query="q")
    store.close()
    with sqlite3.connect(db) as raw:  # a store written before turns had `meta`
        raw.execute("ALTER TABLE turns DROP COLUMN meta")
        raw.execute(
            "INSERT INTO turns (session_id, turn, messages, text) VALUES ('s', 1, '[]', 'a')"
        )
    store = TraceStore(db)
    out = TurnOutput(text="b", meta={"repetition_period": 3})
    store.write_turn("s", 2, messages=[], output=out, t_start=0, t_end=1)
    turns = store.export("s")["turns"]
    assert [t["meta"] for t in turns] == [{}, {"repetition_period": 3}]
