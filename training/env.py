"""The environment server: tasks run as episodes in fresh sandboxed workspaces, on Ray.

Where things run (the design decision this module makes):

- **Ray actors (`EnvActor`) own the workspaces.** Per task an actor unpacks
  `repo.tar` once, safely, into a *template* and runs the task's `setup` there in
  the sandbox; per episode it copies the template into a fresh workspace
  (`cp -a --reflink=auto`: copy-on-write on btrfs/xfs, a plain copy elsewhere).
  All workspaces of a server live on one size-limited tmpfs (`disk_mb`) mounted
  at the server's root where the process may mount (root), so a command that
  fills the disk fills that tmpfs, never the machine's disk. It is one mount for
  the server's lifetime on purpose: bubblewrap re-binds every mount under `/`
  read-only, and a mount that disappears while another sandbox starts makes that
  sandbox fail, so per-workspace mounts coming and going would break sandboxes
  machine-wide. The price: episodes of one server share that space, so one that
  fills it makes the others' writes fail until it is released.
  Warm pools keep `pool_size` ready copies per task. At the end the actor runs the
  task's `verify` (and graded checks) in a clean sandbox — a fresh bubblewrap
  process, protected files restored from the template — and deletes the
  workspace. Setup, verify and copies are the heavy parts; they run in the actors,
  off the caller's event loop, in parallel.
- **The session loop and the model run in the caller.** The production `Session`,
  opened by the same factory as `ask` and `serve` (`agent.factory.open_session`),
  drives the model the caller gives (the RL loop shares one vLLM engine across
  episodes) and runs the tools itself against a `LocalWorkspace` on the leased
  folder: the same tool code, with `run_terminal` in the agent core's bubblewrap
  sandbox, and `codebase_search` on an index seeded from the task's snapshot
  (`training/snapshot_index.py`: built once per snapshot, refreshed per episode).
  Actors are therefore pinned to the caller's node (node affinity), even
  when `address=` joins a cluster; scale out with one caller per node. A tool
  call costs what it costs locally (see `benchmarks/env.py`); `Lease.exec` runs a
  command through the actor instead, for callers that drive tools themselves.
- **Nothing hangs the caller.** Every call into an actor has a deadline; a dead
  actor (RayActorError) or a timeout makes the episode retry on a fresh lease
  (`retries`) and then fail with `status="env_error"`; the caller's `finally`
  releases the lease, and removes the folder itself if the actor is gone.

    server = EnvironmentServer(EnvConfig(num_actors=2))
    result = await server.run_episode(task, model_spec_or_factory="scripted:turns.json")
    result.reward, result.resolved, result.metrics, result.turns

    async with server.lease(task) as lease:     # lower level, for the RL loop
        ws = lease.workspace                     # a LocalWorkspace on the episode's copy
        await lease.exec("python -m pytest -q")
        verdict = await lease.verify(answer="...", tool_ok=True)

Tests: `.venv/bin/python -m pytest tests/training/test_env*.py -q` (real Ray, real bwrap).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from opencomposer.agent.events import Edit, Event, ModelEnd, ToolEnd, ToolStart
from opencomposer.tools.protocols import SandboxConfig
from opencomposer.tools.sandbox import CommandResult, run_sandboxed
from opencomposer.training.snapshot_index import SnapshotIndexes
from opencomposer.training.tasks import ANSWER_FILE, Task, TaskError, safe_extract

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class EnvConfig:
    """How the environment server runs episodes."""

    num_actors: int = 2
    pool_size: int = 2  # warm workspaces kept ready per task per actor (0: none)
    root: Path | None = None  # where workspaces live; default $TMPDIR/opencomposer-env-<pid>
    disk_mb: int | None = (
        4096  # size of the tmpfs holding all workspaces (root only; None: no mount)
    )
    memory_mb: int = 4096  # per-command memory limit in the sandbox
    max_processes: int = 256  # per-command process limit in the sandbox
    retries: int = 1  # fresh attempts after the environment (not the agent) failed
    address: str | None = None  # Ray cluster to join; None starts or reuses a local Ray
    call_timeout_s: float = 120.0  # deadline of an actor call beyond its own work
    max_templates: int = 64  # unpacked tasks kept per actor (LRU)
    index_cache: Path | None = None  # snapshot indexes (snapshot_index.py); None: ~/.cache/…


@dataclass(kw_only=True)
class Verdict:
    """What verify (and the graded parts) found."""

    reward: float
    resolved: bool
    parts: dict[str, bool]
    verify_exit: int
    verify_output: str
    timed_out: bool = False


@dataclass(kw_only=True)
class EpisodeResult:
    """One episode: the reward, the metrics, and the session's turns for the trainer.

    `status` is the session's status (completed, max_turns, …), `timeout` when the
    episode ran past the task's `timeout_s`, `setup_failed` when the task's setup
    failed, `env_error` when the environment itself failed after its retries.
    """

    task_id: str
    status: str
    reward: float
    resolved: bool
    parts: dict[str, bool] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    answer: str = ""
    session_id: str = ""
    # The session's model_end events, in order (each turn's prompt and its output with
    # token ids and logprobs): what the rollout builder makes training samples from.
    turns: list[ModelEnd] = field(default_factory=list)
    verify_output: str = ""
    error: str | None = None
    attempts: int = 1


# ---------------------------------------------------------------- the sandbox


def sandbox_config(task: Task, config: EnvConfig) -> SandboxConfig:
    return SandboxConfig(
        mode="workspace-write",
        timeout_s=task.command_timeout_s,
        max_timeout_s=task.command_timeout_s,
        memory_mb=config.memory_mb,
        max_processes=config.max_processes,
    )


async def run_command(command: str, *, cwd: Path, sandbox: SandboxConfig) -> CommandResult:
    """One command in the agent core's bubblewrap sandbox (the same code as the tools'),
    with this interpreter's folder first on PATH so `python` has the project's packages.
    A killed command says so in its output and never exits 0."""
    bindir = str(Path(sys.executable).parent)
    result = await run_sandboxed(
        f'export PATH="{bindir}:$PATH"\n{command}', root=cwd, config=sandbox
    )
    if result.killed_reason is None:
        return result
    return replace(
        result,
        exit_code=result.exit_code or -9,
        output=result.output + f"\n[killed: {result.killed_reason}]",
    )


# ---------------------------------------------------------------- workspaces on disk


def mount_tmpfs(path: Path, size_mb: int) -> bool:
    """Mount a size-limited tmpfs at `path` (an empty folder); False where not allowed."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    opts = f"size={size_mb}m,mode=0755"
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


def sweep_stale_roots(base: Path) -> None:
    """Remove server roots (`opencomposer-env-PID`) of processes that are gone."""
    for d in base.glob("opencomposer-env-*"):
        pid = d.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            remove_workspace(d)


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve()) if path.exists() else str(path)
    found = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            point = line.split()[1].replace("\\040", " ")
            if point == prefix or point.startswith(prefix + "/"):
                found.append(point)
    return sorted(found, key=len, reverse=True)


def remove_workspace(path: Path) -> None:
    """Unmount whatever is mounted at or under `path`, then delete it; never raises."""
    for point in _mounts_under(path):
        with contextlib.suppress(Exception):
            subprocess.run(["umount", "-l", point], capture_output=True, timeout=30)
    with contextlib.suppress(Exception):
        _make_writable(path)
        shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(Exception):
        path.parent.rmdir()


def _make_writable(path: Path) -> None:
    for dirpath, dirnames, _ in os.walk(path):
        for d in dirnames:
            with contextlib.suppress(OSError):
                os.chmod(os.path.join(dirpath, d), 0o755)


def _tar_key(task: Task) -> str:
    st = task.repo_tar.stat()
    raw = f"{task.repo_tar}:{st.st_size}:{st.st_mtime_ns}:{task.setup}"
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


class Workspaces:
    """Templates, warm pools and episode copies on one machine (used inside an actor,
    and directly by tests and benchmarks)."""

    def __init__(self, root: Path, config: EnvConfig):
        self.root = root
        self.config = config
        self.mount = bool(_mounts_under(root.parent)) or bool(_mounts_under(root))
        self.templates: dict[str, Path] = {}
        self.pools: dict[str, deque[Path]] = {}
        self.leases: dict[str, Path] = {}
        self._template_locks: dict[str, asyncio.Lock] = {}
        self._pins: Counter[str] = Counter()  # users of each template, by key
        self._lease_keys: dict[str, str] = {}
        self._refills: set[asyncio.Task[Any]] = set()
        self._filling: set[str] = set()
        remove_workspace(root)  # what a dead predecessor (a restarted actor) left behind
        (root / "templates").mkdir(parents=True, exist_ok=True)
        (root / "ws").mkdir(parents=True, exist_ok=True)

    async def template(self, task: Task) -> Path:
        """The task unpacked (safely) with its setup run; built once, then reused."""
        key = _tar_key(task)
        lock = self._template_locks.setdefault(key, asyncio.Lock())
        async with lock:
            if key in self.templates:
                self.templates[key] = self.templates.pop(key)  # LRU: most recent last
                return self.templates[key]
            dest = self.root / "templates" / key
            remove_workspace(dest)
            try:
                await asyncio.to_thread(safe_extract, task.repo_tar, dest / "repo")
                if task.setup.strip():
                    res = await run_command(
                        task.setup, cwd=dest / "repo", sandbox=sandbox_config(task, self.config)
                    )
                    if res.exit_code != 0:
                        why = "timed out" if res.timed_out else f"exit {res.exit_code}"
                        raise SetupFailed(f"setup failed ({why}): {_tail(res.output)}")
            except BaseException:
                remove_workspace(dest)
                raise
            self.templates[key] = dest / "repo"
            self._evict(keep=key)
            return dest / "repo"

    def _evict(self, keep: str | None = None) -> None:
        """Drop the least recently used templates past ``max_templates``. One in use (a
        lease verifies against it, a copy of it is being made) stays until its last
        user is done, so the cache runs over by the templates in use; ``keep`` is the
        one just built, for its caller."""
        over = len(self.templates) - self.config.max_templates
        idle = [k for k in self.templates if not self._pins[k] and k != keep]
        for key in idle[: max(0, over)]:
            path = self.templates.pop(key)
            for ws in self.pools.pop(key, deque()):
                remove_workspace(ws)
            remove_workspace(path.parent)

    def _pin(self, key: str) -> None:
        self._pins[key] += 1

    @contextlib.contextmanager
    def _pinned(self, key: str) -> Iterator[None]:
        self._pin(key)
        try:
            yield
        finally:
            self._unpin(key)

    def _unpin(self, key: str) -> None:
        self._pins[key] -= 1
        if self._pins[key] <= 0:
            del self._pins[key]
            self._evict()

    async def copy(self, template: Path) -> Path:
        """A fresh workspace: its own folder holding a copy-on-write copy of the template."""
        dest = self.root / "ws" / uuid.uuid4().hex[:12] / "repo"
        dest.mkdir(parents=True)
        proc = await asyncio.create_subprocess_exec(
            "cp",
            "-a",
            "--reflink=auto",
            f"{template}/.",
            str(dest),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await proc.communicate()
        if proc.returncode != 0:
            remove_workspace(dest)
            raise OSError(f"copying the workspace failed: {err.decode(errors='replace').strip()}")
        return dest

    async def acquire(self, task: Task) -> tuple[str, Path]:
        """A workspace for one episode; its template is kept (for `verify`) until the
        lease is released."""
        key = _tar_key(task)
        template = await self.template(task)
        self._pin(key)  # no await since `template` returned: it is still there
        try:
            pool = self.pools.setdefault(key, deque())
            path = pool.popleft() if pool else await self.copy(template)
        except BaseException:
            self._unpin(key)
            raise
        if self.config.pool_size > 0:
            self._refill(key, template)
        lease_id = uuid.uuid4().hex[:12]
        self.leases[lease_id] = path
        self._lease_keys[lease_id] = key
        return lease_id, path

    def _refill(self, key: str, template: Path) -> None:
        if key in self._filling:
            return  # one fill loop per task, so the pool never overfills

        async def fill() -> None:
            pool = self.pools.setdefault(key, deque())
            try:
                while len(pool) < self.config.pool_size and key in self.templates:
                    with self._pinned(key):
                        copy = await self.copy(template)
                    if key in self.templates:
                        pool.append(copy)
                    else:  # evicted meanwhile, with its pool
                        remove_workspace(copy)
            finally:
                self._filling.discard(key)

        self._filling.add(key)
        task = asyncio.ensure_future(fill())
        self._refills.add(task)
        task.add_done_callback(self._refills.discard)

    async def prewarm(self, task: Task) -> int:
        key = _tar_key(task)
        template = await self.template(task)
        with self._pinned(key):
            pool = self.pools.setdefault(key, deque())
            while len(pool) < self.config.pool_size:
                pool.append(await self.copy(template))
        return len(pool)

    def release(self, lease_id: str) -> None:
        path = self.leases.pop(lease_id, None)
        if path is not None:
            remove_workspace(path)
        key = self._lease_keys.pop(lease_id, None)
        if key is not None:
            self._unpin(key)

    async def verify(self, lease_id: str, task: Task, *, answer: str, tool_ok: bool) -> Verdict:
        path = self.leases[lease_id]
        template = self.templates.get(_tar_key(task)) or await self.template(task)
        return await verify_workspace(
            path, template, task, answer=answer, tool_ok=tool_ok, config=self.config
        )

    async def aclose(self) -> None:
        """Stop pool refills (waiting for their copies to end), then `close`."""
        for t in list(self._refills):
            t.cancel()
        await asyncio.gather(*self._refills, return_exceptions=True)
        self.close()

    def close(self) -> None:
        for t in list(self._refills):
            t.cancel()
        for lease_id in list(self.leases):
            self.release(lease_id)
        for pool in self.pools.values():
            for ws in pool:
                remove_workspace(ws)
        self.pools.clear()
        for path in self.templates.values():
            remove_workspace(path.parent)
        self.templates.clear()
        shutil.rmtree(self.root, ignore_errors=True)


class SetupFailed(TaskError):
    """The task's setup command failed: the task, not the agent, is at fault."""


async def verify_workspace(
    path: Path, template: Path, task: Task, *, answer: str, tool_ok: bool, config: EnvConfig
) -> Verdict:
    """Grade a finished workspace: protected files restored from the template, the
    answer written to ANSWER_FILE, then verify and each check in a fresh sandbox."""
    for rel in task.protect:
        src, dst = template / rel, path / rel
        with contextlib.suppress(OSError):
            if dst.is_symlink() or dst.is_file():
                dst.unlink()
            elif dst.is_dir():
                shutil.rmtree(dst)
            if src.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
    answer_file = path / ANSWER_FILE
    with contextlib.suppress(OSError):
        if answer_file.is_symlink():
            answer_file.unlink()
        answer_file.parent.mkdir(parents=True, exist_ok=True)
        answer_file.write_text(answer, encoding="utf-8")
    sandbox = sandbox_config(task, config)
    res = await run_command(task.verify, cwd=path, sandbox=sandbox)
    w = task.reward
    parts: dict[str, bool] = {"verify": res.exit_code == 0}
    weights: dict[str, float] = {"verify": float(w.get("verify", 1.0))}
    if w.get("answer"):
        parts["answer"] = bool(re.search(w["answer_pattern"], answer or ""))
        weights["answer"] = float(w["answer"])
    if w.get("tool_call"):
        parts["tool_call"] = tool_ok
        weights["tool_call"] = float(w["tool_call"])
    for i, check in enumerate(w.get("checks", [])):
        c = await run_command(check["command"], cwd=path, sandbox=sandbox)
        parts[f"check{i}"] = c.exit_code == 0
        weights[f"check{i}"] = float(check.get("weight", 1.0))
    total = sum(weights.values()) or 1.0
    reward = sum(weights[k] for k, ok in parts.items() if ok) / total
    resolved = parts["verify"] and parts.get("answer", True)
    return Verdict(
        reward=round(reward, 6),
        resolved=resolved,
        parts=parts,
        verify_exit=res.exit_code,
        verify_output=_tail(res.output, 4000),
        timed_out=res.timed_out,
    )


def _tail(text: str, limit: int = 600) -> str:
    text = text.strip()
    return text if len(text) <= limit else "…" + text[-limit:]


# ---------------------------------------------------------------- the Ray actor


class EnvActor:
    """One environment worker (a Ray actor, async, many leases at once)."""

    def __init__(self, root: str, config: EnvConfig):
        logging.basicConfig(level=logging.WARNING)
        self.ws = Workspaces(Path(root), config)

    async def ping(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "mount": self.ws.mount, "leases": len(self.ws.leases)}

    async def acquire(self, task: Task) -> tuple[str, str, int]:
        lease_id, path = await self.ws.acquire(task)
        return lease_id, str(path), os.getpid()

    async def prewarm(self, task: Task) -> int:
        return await self.ws.prewarm(task)

    async def exec(self, lease_id: str, command: str, sandbox: SandboxConfig) -> CommandResult:
        return await run_command(command, cwd=self.ws.leases[lease_id], sandbox=sandbox)

    async def verify(self, lease_id: str, task: Task, answer: str, tool_ok: bool) -> Verdict:
        return await self.ws.verify(lease_id, task, answer=answer, tool_ok=tool_ok)

    async def release(self, lease_id: str) -> None:
        self.ws.release(lease_id)

    async def shutdown(self) -> None:
        await self.ws.aclose()


# ---------------------------------------------------------------- the caller's side


class EnvError(Exception):
    """The environment (an actor, Ray, the machine) failed, not the agent."""


_RAY_STARTED_HERE = False
RAY_START_ATTEMPTS = 3


def ensure_ray(address: str | None = None) -> None:
    """Start Ray quietly (or join `address`); reuse a Ray already started in-process."""
    global _RAY_STARTED_HERE
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    kwargs: dict[str, Any] = dict(
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
        configure_logging=False,
        ignore_reinit_error=True,
    )
    if address is None:
        kwargs["object_store_memory"] = 80 * 1024 * 1024
    # Ray announces its (default-on) token authentication on every local start.
    auth_log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = auth_log.level
    auth_log.setLevel(logging.ERROR)
    try:
        for attempt in range(1, RAY_START_ATTEMPTS + 1):
            try:
                ray.init(address=address, **kwargs)
                break
            except Exception as e:
                # A loaded machine can keep the local raylet from registering within
                # Ray's 30 s; the processes it started are stopped and it starts anew.
                if address is not None or "timed out during startup" not in str(e):
                    raise
                ray.shutdown()
                if attempt == RAY_START_ATTEMPTS:
                    raise EnvError(
                        f"Ray's local node did not start in {attempt} tries (is the machine "
                        f"overloaded?): {str(e).splitlines()[0]}"
                    ) from None
                log.warning("Ray start-up timed out (try %d); starting it again", attempt)
    finally:
        auth_log.setLevel(level)
    _RAY_STARTED_HERE = address is None


@dataclass(kw_only=True)
class Lease:
    """One episode's workspace, held from an actor until `release`."""

    server: EnvironmentServer
    actor: Any
    task: Task
    lease_id: str
    root: Path

    @property
    def workspace(self) -> Any:
        from opencomposer.tools.workspace import LocalWorkspace

        return LocalWorkspace(self.root)

    async def exec(self, command: str, *, timeout_s: float | None = None) -> CommandResult:
        sandbox = sandbox_config(self.task, self.server.config)
        if timeout_s is not None:
            sandbox = replace(sandbox, timeout_s=timeout_s)
        return await self.server._call(
            self.actor.exec.remote(self.lease_id, command, sandbox), sandbox.timeout_s
        )

    async def verify(self, *, answer: str = "", tool_ok: bool = False) -> Verdict:
        budget = self.task.command_timeout_s * (2 + len(self.task.reward.get("checks", [])))
        return await self.server._call(
            self.actor.verify.remote(self.lease_id, self.task, answer, tool_ok), budget
        )

    async def release(self) -> None:
        try:
            await self.server._call(self.actor.release.remote(self.lease_id), 10)
        except EnvError:
            pass
        remove_workspace(self.root)  # the actor may be gone; the folder is on this node


class EnvironmentServer:
    """A pool of `EnvActor`s on this node and the episodes run through them."""

    def __init__(self, config: EnvConfig | None = None):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.config = config or EnvConfig()
        ensure_ray(self.config.address)
        if self.config.root is None:
            sweep_stale_roots(Path(tempfile.gettempdir()))
        root = self.config.root or Path(tempfile.gettempdir()) / f"opencomposer-env-{os.getpid()}"
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.mounted = (
            self.config.disk_mb is not None
            and not _mounts_under(self.root)
            and mount_tmpfs(self.root, self.config.disk_mb)
        )
        node = ray.get_runtime_context().get_node_id()
        actor_cls = ray.remote(EnvActor).options(
            num_cpus=0,
            max_concurrency=1000,
            max_restarts=-1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
        )
        self.actors = [
            actor_cls.remote(str(self.root / f"actor{i}"), self.config)
            for i in range(self.config.num_actors)
        ]
        self._load = [0] * len(self.actors)
        self.indexes = SnapshotIndexes(self.config.index_cache)
        self._models: dict[str, Any] = {}
        self._pids: set[int] = set()  # actor processes seen, so close() can wait them out

    async def start(self) -> None:
        """Wait until every actor answers (optional: the first call waits anyway)."""
        pings = await asyncio.gather(*(self._call(a.ping.remote(), 0) for a in self.actors))
        self._pids.update(p["pid"] for p in pings)

    async def _call(self, ref: Any, work_s: float) -> Any:
        import ray

        try:
            return await asyncio.wait_for(ref, timeout=work_s + self.config.call_timeout_s)
        except ray.exceptions.RayTaskError as e:
            # Ray raises the actor's error as a class deriving from both RayTaskError and
            # the original, whose message is the whole remote traceback; e.cause is the
            # exception the actor raised, with its own one-line message.
            cause = getattr(e, "cause", None) or e.as_instanceof_cause()
            if isinstance(cause, TaskError):
                raise cause from None
            raise EnvError(f"environment call failed: {_one_line(cause)}") from None
        except TaskError:
            raise
        except (ray.exceptions.RayActorError, ray.exceptions.RayError) as e:
            raise EnvError(f"environment actor failed: {_one_line(e)}") from None
        except TimeoutError:
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=False)
            raise EnvError("environment call timed out") from None

    async def _await_actors(self, timeout_s: float = 60.0) -> None:
        """After a failure: give restarting actors up to `timeout_s` to answer again."""
        import ray

        async def ping(actor: Any) -> None:
            deadline = time.monotonic() + timeout_s
            died = 0
            while time.monotonic() < deadline and died < 6:
                try:
                    await asyncio.wait_for(
                        actor.ping.remote(), timeout=max(0.1, deadline - time.monotonic())
                    )
                    return
                except ray.exceptions.ActorDiedError:
                    died += 1  # dead for good, or between death and restart: look again briefly
                except (TimeoutError, ray.exceptions.RayError):
                    pass
                await asyncio.sleep(0.5)

        await asyncio.gather(*(ping(a) for a in self.actors))

    def _pick(self, task: Task) -> int:
        least = min(self._load)
        choices = [i for i, n in enumerate(self._load) if n == least]
        return choices[int(hashlib.sha1(task.id.encode()).hexdigest(), 16) % len(choices)]

    @contextlib.asynccontextmanager
    async def lease(self, task: Task) -> AsyncIterator[Lease]:
        """A fresh workspace for one episode; released (deleted) on exit, always."""
        i = self._pick(task)
        actor = self.actors[i]
        self._load[i] += 1
        lease: Lease | None = None
        try:
            budget = task.command_timeout_s + 60  # unpack + setup + copy
            lease_id, root, pid = await self._call(actor.acquire.remote(task), budget)
            self._pids.add(pid)
            lease = Lease(server=self, actor=actor, task=task, lease_id=lease_id, root=Path(root))
            yield lease
        finally:
            self._load[i] -= 1
            if lease is not None:
                await asyncio.shield(lease.release())

    async def prewarm(self, tasks: list[Task], *, index: bool = False) -> None:
        """Build templates and fill warm pools ahead of the episodes; with `index`, also
        the codebase index of each task's snapshot (one build per snapshot, in this
        process, while the actors prepare workspaces)."""

        async def indexes() -> None:
            for task in tasks:
                await asyncio.to_thread(self.indexes.ensure, task)

        await asyncio.gather(
            *([indexes()] if index else []),
            *(
                self._call(a.prewarm.remote(t), t.command_timeout_s + 60)
                for t in tasks
                for a in self.actors
            ),
        )

    def model(self, spec_or_factory: Any) -> Any:
        """A Model for one episode. A spec string is built once and shared by all
        episodes (backends serve concurrent sessions; scripted ones are stateless); a
        callable is called per episode; a Model is used as is."""
        if isinstance(spec_or_factory, str):
            from opencomposer.agent.backends import make_model

            if spec_or_factory not in self._models:
                self._models[spec_or_factory] = make_model(spec_or_factory)
            return self._models[spec_or_factory]
        if callable(spec_or_factory) and not hasattr(spec_or_factory, "stream"):
            return spec_or_factory()
        return spec_or_factory

    async def run_episode(
        self,
        task: Task,
        *,
        model_spec_or_factory: Any,
        session_config: Any = None,
        on_event: Callable[[Event], None] | None = None,
        traces: Any = None,
    ) -> EpisodeResult:
        """Run the production Session on a fresh copy of the task and grade it.

        Environment failures retry on a fresh lease (`EnvConfig.retries`), then end
        as `status="env_error"`; a failing setup ends as `setup_failed`. The episode
        runs at most `task.timeout_s` (then `status="timeout"`, graded as it stands).
        """
        last = ""
        for attempt in range(1, self.config.retries + 2):
            try:
                result = await self._episode(
                    task, model_spec_or_factory, session_config, on_event, traces
                )
                result.attempts = attempt
                return result
            except SetupFailed as e:
                return EpisodeResult(
                    task_id=task.id,
                    status="setup_failed",
                    reward=0.0,
                    resolved=False,
                    error=str(e),
                    attempts=attempt,
                )
            except TaskError as e:
                return EpisodeResult(
                    task_id=task.id,
                    status="task_error",
                    reward=0.0,
                    resolved=False,
                    error=str(e),
                    attempts=attempt,
                )
            except (EnvError, OSError) as e:
                last = str(e)
                log.warning("episode %s attempt %d: %s", task.id, attempt, e)
                await self._await_actors()
        return EpisodeResult(
            task_id=task.id,
            status="env_error",
            reward=0.0,
            resolved=False,
            error=last,
            attempts=self.config.retries + 1,
        )

    async def _episode(
        self, task: Task, model_spec: Any, session_config: Any, on_event: Any, traces: Any
    ) -> EpisodeResult:
        from opencomposer.agent.factory import open_session
        from opencomposer.agent.indexing import IndexHandle
        from opencomposer.agent.session import SessionConfig

        t0 = time.monotonic()
        metrics = EpisodeMetrics()
        turns: list[ModelEnd] = []  # the rollout's turns: prompt, token ids, logprobs

        def sink(event: Event) -> None:
            metrics.observe(event)
            if isinstance(event, ModelEnd):
                turns.append(event)
            if on_event is not None:
                on_event(event)

        cfg = session_config or SessionConfig(approve="all", emit_deltas=False)
        cfg = replace(cfg, sandbox=sandbox_config(task, self.config))
        async with self.lease(task) as lease:
            index = IndexHandle(
                lease.root, opener=functools.partial(self.indexes.open, task, lease.root)
            )
            session = open_session(
                model=self.model(model_spec),
                workspace=lease.workspace,
                config=cfg,
                index=index,
                on_event=sink,
                traces=traces,
            )
            run = asyncio.ensure_future(session.run(task.query))
            status = None
            try:
                result = await asyncio.wait_for(asyncio.shield(run), timeout=task.timeout_s)
            except asyncio.CancelledError:
                # The episode itself is cancelled (a training run stops with groups in
                # flight): stop the shielded session too and let it end now, while its
                # trace store is still open, instead of leaving it to the loop's exit.
                session.cancel()
                await asyncio.wait([run], timeout=30)
                raise
            except TimeoutError:
                session.cancel("timeout")
                try:
                    result = await asyncio.wait_for(run, timeout=30)
                except (TimeoutError, asyncio.CancelledError):
                    run.cancel()
                    raise EnvError("the session did not stop after its time limit") from None
                status = "timeout"
            finally:
                await asyncio.to_thread(index.close)
            t_verify = time.monotonic()
            verdict = await lease.verify(answer=result.answer, tool_ok=metrics.tool_ok > 0)
            verify_s = time.monotonic() - t_verify
        m = metrics.summary()
        m["wall_s"] = round(time.monotonic() - t0, 3)
        m["verify_s"] = round(verify_s, 3)
        if traces is not None:
            traces.set_meta(
                result.session_id,
                task_id=task.id,
                episode_status=status or result.status,
                reward=verdict.reward,
                resolved=verdict.resolved,
            )
        return EpisodeResult(
            task_id=task.id,
            status=status or result.status,
            reward=verdict.reward,
            resolved=verdict.resolved,
            parts=verdict.parts,
            metrics=m,
            answer=result.answer,
            session_id=result.session_id,
            turns=turns,
            verify_output=verdict.verify_output,
            error=result.error,
        )

    async def close(self) -> None:
        """Delete every workspace and stop the actors (Ray itself stays up for reuse)."""
        import ray

        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                asyncio.gather(*(a.shutdown.remote() for a in self.actors), return_exceptions=True),
                timeout=30,
            )
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        self.actors = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in self._pids):
            await asyncio.sleep(0.05)  # a dying actor may still be mounting a pool copy
        remove_workspace(self.root)
        for m in self._models.values():
            with contextlib.suppress(Exception):
                await m.close()
        self._models.clear()

    async def __aenter__(self) -> EnvironmentServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class EpisodeMetrics:
    """Episode metrics, computed from the session's event stream; reads, searches and
    edits are told apart by each tool's `kind` (tools/specs.py)."""

    def __init__(self) -> None:
        self.turns = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.tool_calls = 0
        self.tool_ok = 0
        self.calls_per_turn: dict[int, int] = {}
        self.reads_before_edit = 0
        self.searches_before_edit = 0
        self.edited = False
        self.edit_failures = 0

    def observe(self, e: Event) -> None:
        match e:
            case ModelEnd():
                self.turns += 1
                self.prompt_tokens += e.prompt_tokens
                self.completion_tokens += e.completion_tokens
            case ToolStart():
                self.tool_calls += 1
                self.calls_per_turn[e.turn] = self.calls_per_turn.get(e.turn, 0) + 1
                kind = _kind(e.name)
                if not self.edited and kind == "read":
                    self.reads_before_edit += 1
                if not self.edited and kind == "search":
                    self.searches_before_edit += 1
                if kind == "edit":
                    self.edited = True
            case ToolEnd():
                if e.status == "ok":
                    self.tool_ok += 1
                elif _kind(e.name) == "edit":
                    self.edit_failures += 1
            case Edit():
                self.edited = True

    def summary(self) -> dict[str, float]:
        per_turn = list(self.calls_per_turn.values())
        return {
            "turns": self.turns,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "tokens": self.prompt_tokens + self.completion_tokens,
            "tool_calls": self.tool_calls,
            "parallel_calls_per_turn": round(sum(per_turn) / len(per_turn), 3) if per_turn else 0.0,
            "max_parallel_calls": max(per_turn, default=0),
            "reads_before_first_edit": self.reads_before_edit,
            "searches_before_first_edit": self.searches_before_edit,
            "edit_failures": self.edit_failures,
        }


def _kind(name: str) -> str:
    """What a call does, from its tool's spec ("" for a call of an unknown tool)."""
    from opencomposer.tools.specs import BY_NAME

    spec = BY_NAME.get(name)
    return spec.kind if spec is not None else ""


def _one_line(e: object) -> str:
    return " ".join(str(e).split())[:300]
