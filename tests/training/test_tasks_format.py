"""The task format: loading, writing, suites, safe unpacking, tasks from traces."""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
from opencomposer.training.catalog import load_suite
from opencomposer.training.tasks import (
    TaskError,
    load_task,
    pack_dir,
    safe_extract,
    task_from_trace,
    write_task,
)


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "m.py").write_text("def f():\n    return 1\n")
    (repo / ".git").mkdir()
    (repo / ".git" / "HEAD").write_text("ref")
    (repo / "__pycache__").mkdir()
    return repo


def test_write_then_load_roundtrip(tmp_path: Path) -> None:
    out = write_task(
        tmp_path / "t1",
        query='Fix "f"\nit returns 1 & should <return> 2',
        verify="python -c 'import pkg.m as m; assert m.f() == 2'",
        repo_dir=_repo(tmp_path),
        setup="true",
        timeout_s=30,
        reward={"verify": 0.8, "tool_call": 0.2, "checks": [{"command": "true", "weight": 0.5}]},
        protect=["pkg/m.py"],
        split="train",
    )
    task = load_task(out)
    assert task.id == "t1"
    assert task.query.startswith('Fix "f"\nit returns 1 & should <return> 2')
    assert task.timeout_s == 30.0 and task.setup == "true" and task.split == "train"
    assert task.reward["verify"] == 0.8 and task.reward["checks"][0]["weight"] == 0.5
    assert task.protect == ("pkg/m.py",)
    with tarfile.open(out / "repo.tar") as tar:
        names = tar.getnames()
    assert "pkg/m.py" in names
    assert not any(n.startswith((".git", "__pycache__")) for n in names)


def test_pack_is_deterministic(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    first = pack_dir(repo)
    (repo / "pkg" / "m.py").touch()
    assert pack_dir(repo) == first


@pytest.mark.parametrize(
    "toml, message",
    [
        ("query = 'x'\nverify = 'true'\ntimeout_s = [", "malformed TOML"),
        ("verify = 'true'", "missing query"),
        ("query = 'x'", "missing verify"),
        ("query = 'x'\nverify = 'true'\ntimeout_s = 'soon'", "timeout_s must be a number"),
        ("query = 'x'\nverify = 'true'\ntimeout_s = -1", "positive"),
        ("query = 'x'\nverify = 'true'\nbogus = 1", "unknown key bogus"),
        ("query = 'x'\nverify = 'true'\n[reward]\nanswer = 1.0", "answer_pattern"),
        ("query = 'x'\nverify = 'true'\n[reward]\nverify = 0", "sum to zero"),
        ("query = 'x'\nverify = 'true'\nprotect = ['../etc/passwd']", "protect"),
    ],
)
def test_malformed_task_toml_is_one_clear_line(tmp_path: Path, toml: str, message: str) -> None:
    d = tmp_path / "bad"
    d.mkdir()
    (d / "task.toml").write_text(toml)
    (d / "repo.tar").write_bytes(pack_dir(_repo(tmp_path)))
    with pytest.raises(TaskError) as e:
        load_task(d)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_missing_parts(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="no task.toml"):
        load_task(tmp_path)
    (tmp_path / "task.toml").write_text("query='x'\nverify='true'\n")
    with pytest.raises(TaskError, match="no repo.tar"):
        load_task(tmp_path)


def test_load_suite_folder_and_errors(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    for name in ("b", "a"):
        write_task(tmp_path / "suite" / name, query="q", verify="true", repo_dir=repo)
    (tmp_path / "suite" / "not-a-task").mkdir()
    assert [t.id for t in load_suite(tmp_path / "suite")] == ["a", "b"]
    assert [t.id for t in load_suite(tmp_path / "suite" / "a")] == ["a"]
    with pytest.raises(TaskError, match="no task suite"):
        load_suite(tmp_path / "nope")
    with pytest.raises(TaskError, match="no task folders"):
        load_suite(repo)


def _tar_with(member: tarfile.TarInfo, data: bytes = b"") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        ok = tarfile.TarInfo("fine.txt")
        ok.size = 2
        tar.addfile(ok, io.BytesIO(b"ok"))
        member.size = len(data) if member.isreg() else 0
        tar.addfile(member, io.BytesIO(data) if member.isreg() else None)
    return buf.getvalue()


def _info(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    return info


@pytest.mark.parametrize(
    "member",
    [
        _info("../escape.txt"),
        _info("a/../../escape.txt"),
        _info("/tmp/abs-escape.txt"),
        _info("link", tarfile.SYMTYPE, "/etc/passwd"),
        _info("sub/link", tarfile.SYMTYPE, "../../outside"),
        _info("hard", tarfile.LNKTYPE, "../outside"),
        _info("dev", tarfile.CHRTYPE),
    ],
    ids=[
        "dotdot",
        "nested-dotdot",
        "absolute",
        "abs-symlink",
        "rel-symlink-out",
        "hardlink-out",
        "device",
    ],
)
def test_escaping_repo_tar_entries_are_refused(tmp_path: Path, member: tarfile.TarInfo) -> None:
    tar = tmp_path / "repo.tar"
    tar.write_bytes(_tar_with(member, b"pwned"))
    dest = tmp_path / "a" / "b" / "ws"
    with pytest.raises(TaskError) as e:
        safe_extract(tar, dest)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "a" / "escape.txt").exists()
    assert not (tmp_path / "a" / "b" / "escape.txt").exists()
    assert not Path("/tmp/abs-escape.txt").exists()


def test_inside_links_are_fine(tmp_path: Path) -> None:
    tar = tmp_path / "repo.tar"
    tar.write_bytes(_tar_with(_info("sub/link", tarfile.SYMTYPE, "../fine.txt")))
    safe_extract(tar, tmp_path / "ws")
    assert (tmp_path / "ws" / "sub" / "link").read_text() == "ok"


def _chain_tar() -> bytes:
    """Links that only escape through another link: `d/up -> ..` is the root, so
    `d/up/out -> ..` lands outside although each link alone looks inside."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.addfile(_info("d", tarfile.DIRTYPE))
        tar.addfile(_info("d/up", tarfile.SYMTYPE, ".."))
        tar.addfile(_info("d/up/out", tarfile.SYMTYPE, ".."))
        evil = _info("d/up/out/escape.txt")
        evil.size = 1
        tar.addfile(evil, io.BytesIO(b"x"))
    return buf.getvalue()


@pytest.mark.parametrize(
    "member",
    [
        _info("./../escape.txt"),
        _info("./a/./../../escape.txt"),
        _info(".//../escape.txt"),
        _info("./link", tarfile.SYMTYPE, "./../../outside"),
        _info("./hard", tarfile.LNKTYPE, "./../outside"),
        _info("./hard-abs", tarfile.LNKTYPE, "/etc/passwd"),
        _info("./fifo", tarfile.FIFOTYPE),
        _info("./blk", tarfile.BLKTYPE),
        _info(".", tarfile.SYMTYPE, "/"),
        _info("./", tarfile.REGTYPE),
    ],
    ids=lambda m: f"{m.name}:{m.type.decode()}",
)
def test_dot_slash_escapes_are_still_refused(tmp_path: Path, member: tarfile.TarInfo) -> None:
    """Accepting `.` and `./` names must not let `./..`, links or special files through."""
    tar = tmp_path / "repo.tar"
    tar.write_bytes(_tar_with(member, b"pwned"))
    dest = tmp_path / "a" / "b" / "ws"
    with pytest.raises(TaskError) as e:
        safe_extract(tar, dest)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "a" / "b" / "escape.txt").exists()
    assert not (tmp_path / "a" / "b" / "outside").exists()


def test_links_escaping_through_links_are_refused(tmp_path: Path) -> None:
    tar = tmp_path / "repo.tar"
    tar.write_bytes(_chain_tar())
    dest = tmp_path / "a" / "ws"
    with pytest.raises(TaskError) as e:
        safe_extract(tar, dest)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "a" / "escape.txt").exists()
    assert not (tmp_path / "escape.txt").exists()


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs tar")
def test_repo_tar_made_the_usual_way_loads_and_unpacks(tmp_path: Path) -> None:
    """Issue 19 item 14: `tar -cf repo.tar -C repo .` writes a `.` entry and `./`-prefixed
    names; it was refused as "escapes the workspace"."""
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "m.py").write_text("def f():\n    return 1\n")
    (repo / "README").write_text("hi\n")
    (repo / "link").symlink_to("pkg/m.py")
    task = tmp_path / "task"
    task.mkdir()
    subprocess.run(["tar", "-cf", str(task / "repo.tar"), "-C", str(repo), "."], check=True)
    with tarfile.open(task / "repo.tar") as made:
        names = made.getnames()
    assert "." in names and "./pkg/m.py" in names  # what the usual way writes
    (task / "task.toml").write_text('query = "q"\nverify = "true"\n')
    loaded = load_task(task)
    ws = tmp_path / "ws"
    safe_extract(loaded.repo_tar, ws)
    assert (ws / "pkg" / "m.py").read_text() == "def f():\n    return 1\n"
    assert (ws / "README").read_text() == "hi\n" and (ws / "link").read_text().startswith("def")
    assert load_suite(tmp_path / "task")[0].id == "task"


def test_garbage_tar(tmp_path: Path) -> None:
    tar = tmp_path / "repo.tar"
    tar.write_bytes(b"not a tar at all" * 100)
    with pytest.raises(TaskError, match="unreadable tar"):
        safe_extract(tar, tmp_path / "ws")


# ---------------------------------------------------------------- from traces


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
    ).stdout.strip()


class FakeStore:
    def __init__(self, trace: dict):
        self.trace = trace

    def resolve(self, prefix: str) -> str:
        if not self.trace["session_id"].startswith(prefix):
            raise KeyError(f"no session {prefix!r}")
        return self.trace["session_id"]

    def export(self, session_id: str) -> dict:
        if session_id != self.trace["session_id"]:
            raise KeyError(session_id)
        return self.trace


def test_task_from_trace_rebuilds_start_from_git_head_and_diff(tmp_path: Path) -> None:
    repo = tmp_path / "ws"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "m.py").write_text("X = 1\n")
    _git(repo, "add", "m.py")
    _git(repo, "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "one")
    head = _git(repo, "rev-parse", "HEAD")
    (repo / "m.py").write_text("X = 2\n")  # uncommitted at the session's start
    diff = _git(repo, "diff")
    (repo / "m.py").write_text("X = 3\n")  # what the session later did
    trace = {
        "session_id": "abc123",
        "workspace": str(repo),
        "git_head": head,
        "git_diff": diff + "\n",
        "query": "make X three",
        "tool_calls": [
            {
                "name": "run_terminal",
                "status": "ok",
                "args": {"command": "python -m pytest -q"},
                "result": "exit code: 1\n1 failed",
            },
            {
                "name": "run_terminal",
                "status": "ok",
                "args": {"command": "python -m pytest -q t.py"},
                "result": "exit code: 0\n1 passed",
            },
            {
                "name": "run_terminal",
                "status": "ok",
                "args": {"command": "ls"},
                "result": "exit code: 0",
            },
        ],
        "edits": [],
    }
    out = task_from_trace("abc", out=tmp_path / "tasks", store=FakeStore(trace))
    task = load_task(out)
    assert task.query == "make X three"
    assert task.verify == "python -m pytest -q t.py"
    assert task.source == "trace:abc123"
    dest = tmp_path / "unpacked"
    safe_extract(task.repo_tar, dest)
    assert (dest / "m.py").read_text() == "X = 2\n"

    given = task_from_trace(
        "abc123", out=tmp_path / "t2", store=FakeStore(trace), verify="make check"
    )
    assert load_task(given).verify == "make check"


def test_task_from_trace_errors(tmp_path: Path) -> None:
    trace = {
        "session_id": "s1",
        "workspace": str(tmp_path),
        "query": "q",
        "tool_calls": [],
        "edits": [],
    }
    with pytest.raises(TaskError, match="no session"):
        task_from_trace("zzz", out=tmp_path, store=FakeStore(trace))
    with pytest.raises(TaskError, match="--verify"):
        task_from_trace("s1", out=tmp_path, store=FakeStore(trace))


def test_task_from_trace_without_git_reverts_edits(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a.py").write_text("new\n")
    (ws / "created.py").write_text("made by the session\n")
    trace = {
        "session_id": "s2",
        "workspace": str(ws),
        "git_head": None,
        "query": "q",
        "tool_calls": [],
        "edits": [
            {"path": "a.py", "before": "old\n", "after": "new\n"},
            {"path": "created.py", "before": None, "after": "made by the session\n"},
        ],
    }
    task = load_task(
        task_from_trace("s2", out=tmp_path / "o", store=FakeStore(trace), verify="true")
    )
    dest = tmp_path / "unpacked"
    safe_extract(task.repo_tar, dest)
    assert (dest / "a.py").read_text() == "old\n"
    assert not (dest / "created.py").exists()
    assert (ws / "a.py").read_text() == "new\n"  # the user's workspace is untouched


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
async def test_task_from_a_real_session_trace(tmp_path: Path) -> None:
    """The real Session + TraceStore: the start state, the query and the passing test run."""
    import json
    import sys

    from opencomposer.agent.backends import make_model
    from opencomposer.agent.session import Session, SessionConfig
    from opencomposer.agent.traces import TraceStore
    from opencomposer.tools.workspace import LocalWorkspace

    ws = tmp_path / "ws"
    ws.mkdir()
    _git(ws, "init", "-q")
    (ws / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (ws / "test_calc.py").write_text("from calc import add\nassert add(2, 3) == 5\n")
    _git(ws, "add", ".")
    _git(ws, "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "start")
    py = sys.executable
    turns = [
        '<edit_file path="calc.py">\n<old>return a - b</old>\n<new>return a + b</new>\n</edit_file>',
        f"<run_terminal>\n<command>{py} test_calc.py</command>\n</run_terminal>",
        "Fixed add.",
    ]
    script = tmp_path / "m.json"
    script.write_text(json.dumps({"turns": turns}))
    store = TraceStore(tmp_path / "traces.db")
    session = Session(
        model=make_model(f"scripted:{script}"),
        workspace=LocalWorkspace(ws),
        config=SessionConfig(approve="all"),
        traces=store,
    )
    result = await session.run("test_calc.py fails, fix add")
    assert result.status == "completed"
    out = task_from_trace(result.session_id[:6], out=tmp_path / "tasks", store=store)
    task = load_task(out)
    assert task.query == "test_calc.py fails, fix add"
    assert task.verify == f"{py} test_calc.py"
    dest = tmp_path / "start"
    safe_extract(task.repo_tar, dest)
    assert (dest / "calc.py").read_text() == "def add(a, b):\n    return a - b\n"  # before the fix
