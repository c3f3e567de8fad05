"""The environment server with real Ray (local), real bubblewrap and the `scripted:` model.

Each bad input of issue 6 gets a test: escaping repo.tar, failing setup, hanging
verify, network, disk filling, fork bombs, writes outside the workspace, a dying
actor, an episode past its time limit; plus the graded reward and the metrics.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tarfile
import time
import uuid
from pathlib import Path

import pytest
from opencomposer.training.env import (
    EnvConfig,
    EnvironmentServer,
    Workspaces,
)
from opencomposer.training.tasks import load_task, write_task

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")

BUGGY = "def add(a, b):\n    return a - b\n"
TEST = "from calc import add\n\nassert add(2, 3) == 5\nprint('ok')\n"
FIX = '<edit_file path="calc.py">\n<old>return a - b</old>\n<new>return a + b</new>\n</edit_file>'


def _task(tmp: Path, name: str = "fix", **kw) -> object:
    repo = tmp / f"repo-{name}"
    repo.mkdir(parents=True, exist_ok=True)
    (repo / "calc.py").write_text(BUGGY)
    (repo / "test_calc.py").write_text(TEST)
    kw.setdefault("verify", "python test_calc.py")
    kw.setdefault("query", "test_calc.py fails; fix calc.py")
    return load_task(write_task(tmp / "tasks" / name, repo_dir=repo, **kw))


def _model(tmp: Path, *turns: str, rate: float = 0) -> str:
    path = tmp / f"model-{uuid.uuid4().hex[:6]}.json"
    path.write_text(json.dumps({"turns": list(turns), "chars_per_second": rate}))
    return f"scripted:{path}"


def _terminal(command: str) -> str:
    return f"<run_terminal>\n<command>{command}</command>\n</run_terminal>"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("env")
    srv = EnvironmentServer(EnvConfig(num_actors=2, root=root / "ws", pool_size=1, disk_mb=64))
    yield srv
    asyncio.run(srv.close())
    assert not (root / "ws").exists()


async def test_episode_resolves_with_reward_and_metrics(server, tmp_path: Path) -> None:
    task = _task(tmp_path, reward={"verify": 0.8, "tool_call": 0.2})
    model = _model(tmp_path, '<read_file path="calc.py"/>\n<grep pattern="add"/>', FIX, "Fixed.")
    events: list[dict] = []
    r = await server.run_episode(
        task, model_spec_or_factory=model, on_event=lambda e: events.append(e.to_wire())
    )
    assert (r.status, r.resolved, r.reward) == ("completed", True, 1.0), r
    assert r.answer == "Fixed."
    m = r.metrics
    assert m["turns"] == 3 and m["tool_calls"] == 3
    assert m["parallel_calls_per_turn"] == 1.5 and m["max_parallel_calls"] == 2
    assert m["reads_before_first_edit"] == 1 and m["searches_before_first_edit"] == 1
    assert m["edit_failures"] == 0 and m["wall_s"] > 0
    assert len(r.turns) == 3 and r.turns[0].output.text.startswith("<read_file")
    assert [e["type"] for e in events][0] == "session_start"
    # the task itself is untouched: a second episode starts from the broken code again
    r2 = await server.run_episode(task, model_spec_or_factory=_model(tmp_path, "Nothing to do."))
    assert (r2.resolved, r2.reward) == (False, 0.0)


async def test_partial_reward_and_edit_failures(server, tmp_path: Path) -> None:
    task = _task(
        tmp_path,
        reward={
            "verify": 0.6,
            "tool_call": 0.2,
            "checks": [{"command": "python -m py_compile calc.py", "weight": 0.2}],
        },
    )
    bad_edit = '<edit_file path="calc.py">\n<old>no such text</old>\n<new>x</new>\n</edit_file>'
    r = await server.run_episode(
        task, model_spec_or_factory=_model(tmp_path, bad_edit, "I give up.")
    )
    assert r.parts == {"verify": False, "tool_call": False, "check0": True}
    assert r.reward == pytest.approx(0.2) and not r.resolved
    assert r.metrics["edit_failures"] == 1


async def test_protected_tests_are_restored_before_verify(server, tmp_path: Path) -> None:
    task = _task(tmp_path, protect=["test_calc.py"])
    cheat = '<write_file path="test_calc.py">\n<content>print("ok")\n</content>\n</write_file>'
    r = await server.run_episode(
        task, model_spec_or_factory=_model(tmp_path, cheat, "Tests pass now.")
    )
    assert not r.resolved


async def test_answer_graded_tasks(server, tmp_path: Path) -> None:
    task = _task(
        tmp_path,
        verify="grep -qw 4242 .opencomposer/answer.txt",
        reward={"verify": 1.0, "answer": 1.0, "answer_pattern": r"\b4242\b"},
    )
    r = await server.run_episode(task, model_spec_or_factory=_model(tmp_path, "The value is 4242."))
    assert r.resolved and r.reward == 1.0
    r = await server.run_episode(task, model_spec_or_factory=_model(tmp_path, "It is 42."))
    assert not r.resolved and r.reward == 0.0


async def test_failing_setup_is_reported(server, tmp_path: Path) -> None:
    task = _task(tmp_path, setup="echo preparing; exit 3")
    r = await server.run_episode(task, model_spec_or_factory=_model(tmp_path, "hi"))
    assert r.status == "setup_failed" and "exit 3" in r.error and "preparing" in r.error


async def test_setup_runs_once_into_the_template(server, tmp_path: Path) -> None:
    task = _task(tmp_path, setup="echo built > built.txt", verify="test -f built.txt")
    for _ in range(2):
        r = await server.run_episode(task, model_spec_or_factory=_model(tmp_path, "ok"))
        assert r.resolved


async def test_escaping_repo_tar_is_contained(server, tmp_path: Path) -> None:
    task = _task(tmp_path)
    marker = tmp_path / "escaped.txt"
    with tarfile.open(task.repo_tar, "a") as tar:
        info = tarfile.TarInfo("../" * 12 + str(marker).lstrip("/"))
        info.size = 1
        import io

        tar.addfile(info, io.BytesIO(b"x"))
    r = await server.run_episode(task, model_spec_or_factory=_model(tmp_path, "hi"))
    assert r.status == "task_error" and "escapes the workspace" in r.error
    assert not marker.exists()


async def test_hanging_verify_is_cut(server, tmp_path: Path) -> None:
    task = _task(tmp_path, verify="sleep 600", command_timeout_s=2)
    t0 = time.monotonic()
    r = await server.run_episode(task, model_spec_or_factory=_model(tmp_path, "done"))
    assert not r.resolved and "timeout" in r.verify_output
    assert time.monotonic() - t0 < 30


async def test_network_is_unreachable(server, tmp_path: Path) -> None:
    probe = "python -c 'import socket; socket.create_connection((\"1.1.1.1\", 53), timeout=3)'"
    task = _task(tmp_path, verify=probe)
    r = await server.run_episode(
        task,
        model_spec_or_factory=_model(
            tmp_path, _terminal("curl -sS -m 3 http://1.1.1.1 || echo no-net"), "done"
        ),
    )
    assert not r.resolved
    assert "no-net" in r.turns[1].prompt[-1].content or "exit code" in r.turns[1].prompt[-1].content


async def test_disk_filling_and_writes_outside_stay_inside(server, tmp_path: Path) -> None:
    outside = Path("/tmp") / f"oc-env-escape-{uuid.uuid4().hex[:6]}"
    home_file = tmp_path / "home-escape"
    fill = "dd if=/dev/zero of=big bs=1M count=200 2>&1; ls -la big"
    escape = f"touch {outside}; echo x > {home_file}; echo > /etc/oc-escape"
    task = _task(tmp_path, verify="python test_calc.py")
    r = await server.run_episode(
        task,
        model_spec_or_factory=_model(
            tmp_path,
            _terminal(fill) + "\n" + _terminal(escape),
            _terminal("rm big") + "\n" + FIX,
            "done",
        ),
    )
    assert r.resolved  # the workspace works again once the agent removed its big file
    assert not outside.exists() and not home_file.exists() and not Path("/etc/oc-escape").exists()
    if server.mounted:
        assert "No space left" in r.turns[1].prompt[-1].content


async def test_fork_bomb_is_contained(server, tmp_path: Path) -> None:
    task = _task(tmp_path, command_timeout_s=5)
    bomb = _terminal("bomb() { bomb | bomb & }; bomb; sleep 30")
    t0 = time.monotonic()
    r = await server.run_episode(task, model_spec_or_factory=_model(tmp_path, bomb, FIX, "done"))
    assert r.resolved and r.metrics["tool_calls"] == 2
    assert time.monotonic() - t0 < 60


async def test_episode_time_limit(server, tmp_path: Path) -> None:
    task = _task(tmp_path, timeout_s=1.5)
    slow = _model(tmp_path, "x" * 10_000, rate=100)
    t0 = time.monotonic()
    r = await server.run_episode(task, model_spec_or_factory=slow)
    assert r.status == "timeout" and not r.resolved
    assert time.monotonic() - t0 < 15


async def test_cancelled_episode_ends_its_session_before_returning(server, tmp_path: Path) -> None:
    from opencomposer.agent.traces import TraceStore

    store = TraceStore(tmp_path / "traces.db")
    slow = _model(tmp_path, "x" * 10_000, rate=100)
    episode = asyncio.ensure_future(
        server.run_episode(_task(tmp_path), model_spec_or_factory=slow, traces=store)
    )
    await asyncio.sleep(3)  # mid-turn
    episode.cancel()
    with pytest.raises(asyncio.CancelledError):
        await episode
    sessions = store.list_sessions()
    store.close()  # as a training run does next: nothing may write to it later
    assert len(sessions) == 1 and sessions[0]["ended"] and sessions[0]["status"] == "cancelled"
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert not [t for t in others if not t.done()]  # no session left running


async def test_eight_concurrent_episodes(server, tmp_path: Path) -> None:
    task = _task(tmp_path)
    model = _model(tmp_path, _terminal("python test_calc.py; sleep 0.5"), FIX, "done", rate=2000)
    results = await asyncio.gather(
        *(server.run_episode(task, model_spec_or_factory=model) for _ in range(8))
    )
    assert all(r.resolved for r in results), [(r.status, r.error) for r in results]


async def test_lease_api_and_cleanup(server, tmp_path: Path) -> None:
    task = _task(tmp_path)
    async with server.lease(task) as lease:
        root = lease.root
        assert (root / "calc.py").read_text() == BUGGY
        await lease.workspace.write_text("calc.py", BUGGY.replace("-", "+"))
        res = await lease.exec("python test_calc.py && echo $PWD")
        assert res.exit_code == 0 and str(root) in res.output
        verdict = await lease.verify()
        assert verdict.resolved
    assert not root.exists()


async def test_dying_actor_retries_then_fails_never_hangs(tmp_path: Path) -> None:
    import ray

    srv = EnvironmentServer(
        EnvConfig(num_actors=1, root=tmp_path / "ws", retries=1, call_timeout_s=20)
    )
    try:
        await srv.start()
        task = _task(tmp_path)
        killed = []

        def kill_on_first_tool(event) -> None:
            if event.type == "tool_start" and not killed:
                killed.append(1)
                ray.kill(srv.actors[0], no_restart=False)

        model = _model(tmp_path, FIX, "done")
        t0 = time.monotonic()
        r = await srv.run_episode(task, model_spec_or_factory=model, on_event=kill_on_first_tool)
        assert killed and r.attempts == 2 and r.resolved, r
        # an actor that never comes back: the episode fails, it does not hang
        ray.kill(srv.actors[0], no_restart=True)
        r = await srv.run_episode(task, model_spec_or_factory=model)
        assert r.status == "env_error" and r.error
        assert time.monotonic() - t0 < 90
    finally:
        await srv.close()
    assert not (tmp_path / "ws").exists()


async def test_workspace_copies_are_independent(tmp_path: Path) -> None:
    task = _task(tmp_path)
    ws = Workspaces(tmp_path / "local", EnvConfig(pool_size=0))
    try:
        (a_id, a), (b_id, b) = await ws.acquire(task), await ws.acquire(task)
        (a / "calc.py").write_text("changed")
        with open(b / "calc.py", "a") as fh:  # in-place write, not a rename
            fh.write("# more\n")
        assert (b / "calc.py").read_text() == BUGGY + "# more\n"
        template = ws.templates[next(iter(ws.templates))]
        assert (template / "calc.py").read_text() == BUGGY
        ws.release(a_id)
        ws.release(b_id)
        assert not a.exists() and not b.exists()
    finally:
        ws.close()
    assert not (tmp_path / "local").exists()
    assert str(tmp_path) not in Path("/proc/mounts").read_text()


async def test_a_template_in_use_outlives_its_eviction(tmp_path: Path) -> None:
    """The template cache holds one task. A second task's template is built while an
    episode of the first is still being copied from its template: the copy must not
    lose its source, and the first is evicted only once its lease is released."""
    a = _task(tmp_path, "a", protect=["test_calc.py"])
    b = _task(tmp_path, "b", query="another task")
    ws = Workspaces(tmp_path / "local", EnvConfig(pool_size=0, max_templates=1))
    a_template = await ws.template(a)
    copying, go_on = asyncio.Event(), asyncio.Event()
    copy = ws.copy

    async def held_copy(template: Path) -> Path:
        if template == a_template:  # hold the first task's copy until the second is in
            copying.set()
            await go_on.wait()
        return await copy(template)

    ws.copy = held_copy  # type: ignore[method-assign]
    try:
        first = asyncio.ensure_future(ws.acquire(a))
        await copying.wait()
        b_id, _ = await ws.acquire(b)  # builds the second template: the cache is over
        go_on.set()
        a_id, a_path = await first
        assert len(ws.templates) == 2  # over the cap while both are in use
        (a_path / "calc.py").write_text(BUGGY.replace("a - b", "a + b"))
        assert (await ws.verify(a_id, a, answer="fixed", tool_ok=True)).resolved
        ws.release(a_id)
        assert len(ws.templates) == 1 and not a_template.exists()  # the released one went
        assert (await ws.verify(b_id, b, answer="", tool_ok=True)).resolved is False
        ws.release(b_id)
        assert len(ws.templates) == 1  # within the cap: kept for the next episode
    finally:
        ws.close()


def test_a_ray_start_that_times_out_under_load_is_tried_again(monkeypatch):
    """Ray's local node gives up when its raylet does not register within 30 s (a
    loaded machine): the half-started Ray is shut down and started again, and after
    the last try the caller gets one clear line."""
    import sys
    import types

    from opencomposer.training import env as env_mod

    calls: list[str] = []
    outcomes: list[Exception | None] = []

    def init(**kw):
        calls.append("init")
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome

    fake = types.SimpleNamespace(
        is_initialized=lambda: False, init=init, shutdown=lambda: calls.append("shutdown")
    )
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setattr(env_mod, "_RAY_STARTED_HERE", False)
    timeout = Exception(
        "The current node timed out during startup. This could happen because some of "
        "the raylet failed to startup or the GCS has become overloaded."
    )
    outcomes[:] = [timeout, None]
    env_mod.ensure_ray()
    assert calls == ["init", "shutdown", "init"]

    calls.clear()
    outcomes[:] = [timeout] * env_mod.RAY_START_ATTEMPTS
    with pytest.raises(env_mod.EnvError, match=r"did not start in 3 tries .*timed out during"):
        env_mod.ensure_ray()
    assert calls.count("init") == 3

    calls.clear()
    outcomes[:] = [ValueError("bad option")]  # anything else is not retried
    with pytest.raises(ValueError, match="bad option"):
        env_mod.ensure_ray()
    assert calls == ["init"]
