"""Run one shell command in a bubblewrap sandbox, with limits; used by run_terminal
and by training environments for a task's `setup` and `verify` commands.

    result = await run_sandboxed("pytest -q", root=Path("repo"), config=SandboxConfig())

What bounds what (measured on this kind of machine, root inside a VM):

- Files: `/` is bound read-only, the workspace read-write (`workspace-write`) or
  read-only (`read-only`) at its own path, `/tmp` is a fresh tmpfs capped at the
  memory limit, `/proc` and `/dev` are new. Nothing outside the workspace can be
  changed.
- Git: what git *runs* comes from a git directory's `config` and `hooks`, and
  `commondir` or a `.git` file say where that directory is. Those are bound
  read-only over the writable workspace (`git_guard`), the folders above them are
  made mount points so they cannot be renamed and replaced. A mount cannot hold a
  name that does not exist yet, nor a symlink: a control file that appears during a
  run is deleted after it, and a symlinked one (a shared hooks folder) is put back
  as it was. So a command cannot
  plant a program that a later git on the host (the session's start, the user's
  own `git commit`) would run. Its other files (objects, refs, the index) stay
  writable: `git add` and `git commit` work.
- Sockets: `--unshare-all` gives the command its own empty network namespace (so
  no TCP, and no host abstract UNIX socket); a seccomp filter (`seccomp.py`)
  refuses to create AF_UNIX sockets, so no host socket file (docker.sock, an
  editor's IPC socket, an SSH agent) can be connected to. `socketpair` still works.
- Environment: variables that look like secrets, by name or by value (a token's
  shape, a URL with a password), are not passed in (`sandbox_env`).
- Processes: RLIMIT_NPROC does *not* bound a root user (the kernel skips the check
  for the initial user, and a user namespace keeps that kernel uid). What does is a
  `pids` cgroup (v1 or v2) with `pids.max`; the first refused fork ends the run
  ("process limit"). Where no cgroup can be made, a watchdog counts the processes
  in the sandbox's PID namespace every 20 ms and kills it past the limit.
- Start-up: bwrap is started with `--json-status-fd` and `--block-fd`; while it
  builds its namespaces, a thread reads its namespace init's pid, applies the
  rlimits (prlimit) and moves it into the cgroups, then unblocks it, so the
  command and all its children are born confined. Moving a task between v1
  cgroups costs an RCU grace period (~30 ms here); done this way it overlaps
  bwrap's own set-up instead of adding to it.
- Memory: RLIMIT_AS per process, plus a memory cgroup limit on the whole tree when
  one can be made; /tmp is a size-capped tmpfs.
- Time and cancellation: the command runs in its own PID namespace whose init is
  bwrap's child, kept in bwrap's process group: one SIGKILL to the group ends that
  init, and the kernel then kills everything left in the namespace, even processes
  that called setsid. Cancelling the awaiting task kills it synchronously, before
  the CancelledError propagates.
- Output: stdout and stderr are merged and streamed through `OutputCapture`, so
  memory stays bounded however much the command prints.

Mode `off` runs `bash -c` directly with the same limits (the process group and the
cgroup are killed instead of a namespace); without bwrap the other modes refuse.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import os
import platform
import re
import resource
import shutil
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Coroutine, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opencomposer.tools.output import OutputCapture
from opencomposer.tools.protocols import SandboxConfig, ToolError
from opencomposer.tools.seccomp import unix_socket_filter

POLL_S = 0.02
DRAIN_S = 1.0  # after the command ends, how long escaped holders of the pipe may delay us
MAX_FILE_BYTES = 8 * 1024**3
# A variable is kept out of the sandbox when its name says it holds a secret, or its
# value looks like one: a URL with a password, `password=…` in a DSN, or the shape of
# a well-known token (kept here rather than shared with agent/redact.py: tools/
# imports nothing of the agent's).
SECRET_ENV = re.compile(
    r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH|COOKIE|PRIVATE|(?:^|_)(?:PASS|PW|PAT|DSN)(?:$|_)",
    re.I,
)
_URL_PASSWORD = re.compile(r"://[^/?#\s:@]*:[^/?#\s@]+@")  # scheme://user:password@
_KEY_VALUE = re.compile(
    r"(?i)(?:^|[\s;&?,])(?:password|passwd|pwd|secret|token|api[_-]?key|access[_-]?key)=[^\s&;]"
)
_TOKEN_HINTS = (
    "-----BEGIN", "sk-", "sk_", "rk_", "gh", "github_pat_", "glpat-", "xox", "AKIA", "ASIA",
    "AIza", "hf_", "npm_", "pypi-", "eyJ",
)  # fmt: skip
_TOKEN = re.compile(
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----"
    r"|\bsk-(?:proj-|ant-)?[A-Za-z0-9_\-]{16,}"
    r"|\b[rs]k_(?:live|test)_[A-Za-z0-9]{10,}"
    r"|\bgh[pousr]_[A-Za-z0-9]{20,}|\bgithub_pat_[A-Za-z0-9_]{20,}|\bglpat-[A-Za-z0-9_\-]{20,}"
    r"|\bxox[abposr]-[A-Za-z0-9\-]{10,}"
    r"|\b(?:AKIA|ASIA)[0-9A-Z]{16}\b|\bAIza[0-9A-Za-z_\-]{30,}"
    r"|\bhf_[A-Za-z0-9]{30,}|\bnpm_[A-Za-z0-9]{36}|\bpypi-[A-Za-z0-9_\-]{50,}"
    r"|\beyJ[A-Za-z0-9_\-]{10,}\.[A-Za-z0-9_\-]{10,}\.[A-Za-z0-9_\-]{10,}"  # JWT
)
CGROUP_PREFIX = "opencomposer-sbx-"


class SandboxError(ToolError):
    """The sandbox cannot run the command at all (no bwrap, bad mode)."""


@dataclass(frozen=True, kw_only=True)
class CommandResult:
    exit_code: int  # negative: killed by that signal
    output: str
    timed_out: bool = False
    duration_s: float = 0.0
    killed_reason: str | None = None  # "timeout", "process limit", "memory limit", "cancelled"

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_reason is None


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def _shell() -> str:
    return shutil.which("bash") or "/bin/sh"


def sandbox_argv(
    command: str,
    root: Path,
    config: SandboxConfig,
    guard: GitGuard | None = None,
    over: Collection[tuple[str, str]] = (),
    scratch: str | None = None,
) -> list[str]:
    """The full argv that runs `command` in `root` under `config`; SandboxError if it can't.

    `guard`: the workspace's `git_guard`, when the caller has it already. `over`:
    (source, target) files bound read-only over files of the workspace (a trial run's
    changed files, `run_sandboxed(files=…)`). `scratch`: a folder outside the workspace
    the command may write, at the same path (`run_sandboxed(scratch=…)`)."""
    shell = [_shell(), "-c", command]
    if config.mode == "off":
        return shell
    if config.mode not in ("read-only", "workspace-write"):
        raise SandboxError(
            f"unknown sandbox mode {config.mode!r}; use read-only, workspace-write or off"
        )
    bwrap = bwrap_path()
    if bwrap is None:
        raise SandboxError(
            "bubblewrap (bwrap) is not installed, so commands cannot be sandboxed; "
            "install the Debian package bubblewrap, or set the sandbox mode to off"
        )
    if unix_socket_filter() is None:
        raise SandboxError(
            f"no seccomp filter for this CPU architecture ({platform.machine()}), so host "
            "UNIX sockets cannot be kept out of the sandbox; set the sandbox mode to off"
        )
    bind = "--bind" if config.mode == "workspace-write" else "--ro-bind"
    git_binds = (guard or git_guard(root)).binds() if config.mode == "workspace-write" else []
    # No --new-session: the host-side setsid (start_new_session) already gives the tree
    # a session without a controlling terminal, and bwrap's namespace init must stay in
    # our process group so that one killpg reaches it (its death ends the namespace).
    argv = [bwrap, "--unshare-all", "--die-with-parent"]
    if config.network:
        argv.append("--share-net")
    argv += [
        "--ro-bind", "/", "/",
        "--dev", "/dev",
        "--proc", "/proc",
        "--size", str(config.memory_mb * 1024 * 1024), "--tmpfs", "/tmp",
        *_under_tmp_binds(root),
        bind, str(root), str(root),
        *git_binds,
        *(arg for source, target in over for arg in ("--ro-bind", source, target)),
        *(("--bind", scratch, scratch) if scratch else ()),
        "--chdir", str(root),
        "--",
    ]  # fmt: skip
    return argv + shell


# -- git's control files --------------------------------------------------------

# In a git directory, where git takes programs to run from (config, hooks) or where
# it finds the directory that holds them (commondir; config.worktree when enabled).
_GIT_CONTROL = ("config", "config.worktree", "commondir")


@dataclass(frozen=True)
class GitGuard:
    """What keeps a sandboxed command from changing what git runs (module docstring).

    A bind mount makes a file or folder read-only and unrenamable, but it cannot hold
    a name that does not exist yet, nor a symlink (mounts follow it); those are put
    back after the run instead (`restore`).
    """

    pins: tuple[str, ...]  # folders made mount points: cannot be renamed or replaced
    read_only: tuple[str, ...]  # control files and hook folders that exist
    absent: tuple[str, ...]  # control files that do not exist, and must not appear
    links: tuple[tuple[str, str], ...]  # control entries that are symlinks: (path, target)

    def binds(self) -> list[str]:
        argv: list[str] = []
        for p in self.pins:
            argv += ["--bind", p, p]
        for p in self.read_only:
            argv += ["--ro-bind", p, p]
        return argv

    def restore(self) -> list[str]:
        """Undo what the run did to the names mounts cannot hold; the paths put back."""
        changed = []
        for path in self.absent:
            if os.path.lexists(path) and _remove(path):
                changed.append(path)
        for path, target in self.links:
            with contextlib.suppress(OSError):
                if os.readlink(path) == target:
                    continue
            if _remove(path):
                with contextlib.suppress(OSError):
                    os.symlink(target, path)
                    changed.append(path)
        return changed


def _remove(path: str) -> bool:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.unlink(path)
    except OSError:
        return False
    return True


def git_guard(root: Path) -> GitGuard:
    """Find the git directories inside `root` (its `.git`, the one a `.git` file names,
    submodules' and linked worktrees' folders) and what in them must stay as it is."""
    top = os.path.realpath(root)

    def inside(path: str) -> bool:
        return path.startswith(top + os.sep)

    gitdirs: list[str] = []  # real paths (no symlink in them)
    guarded: list[str] = []  # existing entries, bound read-only unless symlinks
    for dot_git in [os.path.join(top, ".git"), *_submodule_dot_gits(top)]:
        try:
            mode = os.lstat(dot_git).st_mode
        except OSError:
            continue
        if stat.S_ISDIR(mode):
            gitdirs.append(dot_git)
        else:
            guarded.append(dot_git)
            target = _gitdir_named_by(dot_git)
            if target is not None:
                gitdirs.append(os.path.realpath(target))
    absent: list[str] = []
    seen: set[str] = set()
    while gitdirs:
        gitdir = gitdirs.pop()
        if gitdir in seen or not inside(gitdir) or not os.path.isdir(gitdir):
            continue
        seen.add(gitdir)
        for name in _GIT_CONTROL:
            path = os.path.join(gitdir, name)
            (guarded if os.path.lexists(path) else absent).append(path)
        if os.path.join(gitdir, "commondir") in absent and os.path.exists(
            os.path.join(gitdir, "HEAD")
        ):
            # a repository's own folder (a linked worktree's runs its common folder's hooks)
            hooks = os.path.join(gitdir, "hooks")
            with contextlib.suppress(OSError):
                os.mkdir(hooks)  # as `git init` makes it: something to bind
            (guarded if os.path.lexists(hooks) else absent).append(hooks)
        gitdirs += _nested_gitdirs(gitdir)
    links = []
    for p in guarded:
        with contextlib.suppress(OSError):  # not a symlink
            links.append((p, os.readlink(p)))
    # The rest are real paths inside `top`: each gitdir is, and they are not symlinks.
    read_only = [p for p in guarded if not os.path.islink(p) and os.path.exists(p)]
    pins = set()
    for path in [*guarded, *absent]:
        folder = os.path.dirname(path)
        while inside(folder) and folder not in pins:
            pins.add(folder)
            folder = os.path.dirname(folder)
    return GitGuard(
        pins=tuple(sorted(pins, key=lambda p: p.count(os.sep))),
        read_only=tuple(read_only),
        absent=tuple(absent),
        links=tuple(links),
    )


def _gitdir_named_by(dot_git: str) -> str | None:
    """The folder a `.git` file (`gitdir: PATH`) or a `.git` symlink points to."""
    if os.path.islink(dot_git):
        return os.path.realpath(dot_git)
    try:
        with open(dot_git, errors="replace") as f:
            text = f.read(4096)
    except OSError:
        return None
    m = re.match(r"gitdir:\s*(.+?)\s*$", text, re.M)
    return os.path.join(os.path.dirname(dot_git), m.group(1)) if m else None


def _submodule_dot_gits(top: str) -> list[str]:
    """`PATH/.git` for each `path = PATH` in `.gitmodules`."""
    try:
        with open(os.path.join(top, ".gitmodules"), errors="replace") as f:
            text = f.read(1_000_000)
    except OSError:
        return []
    found = []
    for m in re.finditer(r"^\s*path\s*=\s*(.+?)\s*$", text, re.M):
        path = os.path.realpath(os.path.join(top, m.group(1).strip('"')))
        if path.startswith(top + os.sep):
            found.append(os.path.join(path, ".git"))
    return found


def _nested_gitdirs(gitdir: str) -> list[str]:
    """Submodules' folders under `modules/` (names may hold slashes) and linked
    worktrees' folders under `worktrees/`."""
    found = []
    with contextlib.suppress(OSError), os.scandir(os.path.join(gitdir, "worktrees")) as it:
        found += [e.path for e in it if e.is_dir(follow_symlinks=False)]
    for folder, dirs, files in os.walk(os.path.join(gitdir, "modules")):
        if "HEAD" in files:
            found.append(folder)
            dirs.clear()  # its own modules/ are found from it
    return found


def _under_tmp_binds(root: Path) -> list[str]:
    """Read-only binds for the running interpreter's environment when it lives under
    /tmp, which the private /tmp would otherwise hide (a checkout built in /tmp)."""
    prefix = Path(sys.prefix).resolve()
    tmp = Path("/tmp")
    if tmp not in prefix.parents or prefix == root or root in prefix.parents:
        return []
    return ["--ro-bind", str(prefix), str(prefix)]


def _is_secret(name: str, value: str) -> bool:
    if SECRET_ENV.search(name):
        return True
    # Substring tests first: nearly no value holds any of these.
    if "://" in value and _URL_PASSWORD.search(value):
        return True
    if "=" in value and _KEY_VALUE.search(value):
        return True
    return any(h in value for h in _TOKEN_HINTS) and _TOKEN.search(value) is not None


@functools.lru_cache(maxsize=8)
def _without_secrets(environ: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    # Cached: the environment rarely changes, and checking every value each run
    # would cost a few hundred microseconds of the sandbox's start-up.
    return tuple((k, v) for k, v in environ if not _is_secret(k, v))


def sandbox_path() -> str:
    """PATH as commands get it. Started from a virtual environment (the project's, or
    opencomposer's own), its tools (python, pytest) come first, as in a shell where it
    is active."""
    path = os.environ.get("PATH", "")
    if sys.prefix == sys.base_prefix:
        return path
    venv_bin = str(Path(sys.executable).parent)
    rest = [p for p in path.split(os.pathsep) if p and p != venv_bin]
    return os.pathsep.join([venv_bin, *rest])


def sandbox_env(mode: str = "workspace-write") -> dict[str, str]:
    """The caller's environment without secrets, set up for non-interactive use.

    Sandboxed, caches go to the private /tmp: the home folder is read-only there.
    """
    env = dict(_without_secrets(tuple(os.environ.items())))
    if "PATH" in env or sys.prefix != sys.base_prefix:
        env["PATH"] = sandbox_path()
    env.update(TERM="dumb", PAGER="cat", GIT_PAGER="cat", GIT_TERMINAL_PROMPT="0")
    env.setdefault("LANG", "C.UTF-8")
    if mode != "off":
        env.update(XDG_CACHE_HOME="/tmp/.cache", MPLCONFIGDIR="/tmp/.config/matplotlib")
    return env


# -- cgroups ------------------------------------------------------------------

_counter = itertools.count()


class Cgroup:
    """Per-run cgroups (pids, memory) in whichever hierarchy this process may write.

    `create` returns None where no cgroup can be made (no permission, cgroup v2
    without delegation); the sandbox then falls back to the namespace watchdog.
    """

    def __init__(self, dirs: dict[str, Path], max_processes: int) -> None:
        self.dirs = dirs  # controller -> folder
        self.max_processes = max_processes

    @classmethod
    def create(cls, config: SandboxConfig) -> Cgroup | None:
        name = f"{CGROUP_PREFIX}{os.getpid()}-{next(_counter)}"
        dirs: dict[str, Path] = {}
        for controller, parent in _cgroup_parents().items():
            _sweep(parent)
            folder = parent / name
            try:
                folder.mkdir()
                if controller == "pids":
                    (folder / "pids.max").write_text(str(config.max_processes))
                elif (folder / "memory.max").exists():
                    (folder / "memory.max").write_text(str(config.memory_mb * 1024 * 1024))
                    with contextlib.suppress(OSError):
                        (folder / "memory.swap.max").write_text("0")
                else:
                    (folder / "memory.limit_in_bytes").write_text(
                        str(config.memory_mb * 1024 * 1024)
                    )
            except OSError:
                with contextlib.suppress(OSError):
                    folder.rmdir()
                continue
            dirs[controller] = folder
        if "pids" not in dirs:
            for folder in dirs.values():
                with contextlib.suppress(OSError):
                    folder.rmdir()
            return None
        return cls(dirs, config.max_processes)

    def attach(self, pid: int) -> None:
        """Move process `pid` in; its children to come are born inside.

        On cgroup v1 this takes one RCU grace period (~30 ms here), which is why the
        sandbox does it while bwrap builds the namespaces rather than before exec.
        """
        for folder in self.dirs.values():
            with open(folder / "cgroup.procs", "w") as f:
                f.write(str(pid))

    def _event(self, controller: str, files: tuple[str, ...], key: str) -> int:
        folder = self.dirs.get(controller)
        if folder is None:
            return 0
        for fname in files:
            try:
                for line in (folder / fname).read_text().splitlines():
                    k, _, v = line.partition(" ")
                    if k == key:
                        return int(v)
            except (OSError, ValueError):
                continue
        return 0

    def forks_refused(self) -> int:
        return self._event("pids", ("pids.events",), "max")

    def oom_kills(self) -> int:
        return self._event("memory", ("memory.events", "memory.oom_control"), "oom_kill")

    def kill_all(self) -> None:
        for folder in self.dirs.values():
            with contextlib.suppress(OSError):
                for line in (folder / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(line), signal.SIGKILL)

    def remove(self) -> bool:
        """Try once to delete the cgroups; False while processes are still in them."""
        gone = True
        for folder in self.dirs.values():
            try:
                folder.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                gone = False
        return gone

    async def close(self, within_s: float = 2.0) -> None:
        """Kill what is left and delete the cgroups once the kernel has reaped it all.

        What is still there after `within_s` is left to `_sweep` in a later run.
        """
        deadline = time.monotonic() + within_s
        for attempt in itertools.count():
            self.kill_all()
            if self.remove() or time.monotonic() > deadline:
                return
            # The kernel lets go of exited tasks a moment after they are reaped.
            await asyncio.sleep(0.001 if attempt < 20 else 0.01)


def _cgroup_parents() -> dict[str, Path]:
    """controller -> the folder of this process's own cgroup for it, where writable."""
    base = Path("/sys/fs/cgroup")
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return {}
    found: dict[str, Path] = {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":
            unified = base / "unified" if (base / "unified").is_dir() else base
            try:
                available = (unified / rel / "cgroup.controllers").read_text().split()
            except OSError:
                continue
            for c in ("pids", "memory"):
                if c in available and c not in found:
                    found[c] = unified / rel
            continue
        for c in controllers.split(","):
            if c in ("pids", "memory") and (base / c).is_dir():
                found[c] = base / c / rel
    return {c: p for c, p in found.items() if os.access(p, os.W_OK)}


def _sweep(parent: Path) -> None:
    """Remove empty cgroups left by sandboxes of processes that are gone."""
    with contextlib.suppress(OSError):
        for folder in parent.glob(f"{CGROUP_PREFIX}*"):
            pid = folder.name[len(CGROUP_PREFIX) :].split("-")[0]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                with contextlib.suppress(OSError):
                    folder.rmdir()


# -- the namespace watchdog (where no pids cgroup can be made) -------------------


def _pid_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _count_in_ns(ns: str) -> int:
    n = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry.name}/ns/pid") == ns:
                    n += 1
    return n


# -- running ------------------------------------------------------------------


def _limits(config: SandboxConfig) -> list[tuple[int, int]]:
    return [
        (resource.RLIMIT_AS, config.memory_mb * 1024 * 1024),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_FSIZE, MAX_FILE_BYTES),
    ]


def _child_setup(config: SandboxConfig, cgroup: Cgroup | None) -> None:
    """Mode off: limits and cgroup applied in the child between fork and exec."""
    for which, value in _limits(config):
        resource.setrlimit(which, (value, value))
    if cgroup is not None:
        with contextlib.suppress(OSError):  # then only the rlimits bound it
            cgroup.attach(os.getpid())


def _read_child_pid(fd: int) -> int | None:
    """The namespace init's host pid from bwrap's --json-status-fd; None if bwrap failed."""
    buf = b""
    while True:
        m = re.search(rb'"child-pid"\s*:\s*(\d+)', buf)
        if m:
            return int(m.group(1))
        chunk = os.read(fd, 4096)
        if not chunk:
            return None
        buf += chunk


def _open_gate(
    status_fd: int, block_fd: int, config: SandboxConfig, cgroup: Cgroup | None
) -> tuple[int | None, bool]:
    """Confine bwrap's namespace init while it is held at --block-fd, then let it go.

    Returns (init pid, whether the cgroup took it). Runs in a thread: the cgroup
    move costs an RCU grace period, spent while bwrap sets up its namespaces.
    """
    attached = cgroup is not None
    try:
        pid = _read_child_pid(status_fd)
        if pid is None:
            return None, False
        try:
            for which, value in _limits(config):
                resource.prlimit(pid, which, (value, value))
            if cgroup is not None:
                try:
                    cgroup.attach(pid)
                except OSError as e:
                    if isinstance(e, ProcessLookupError):
                        raise
                    attached = False
        except ProcessLookupError:
            return None, False  # bwrap already gave up; its output says why
        return pid, attached
    finally:
        with contextlib.suppress(OSError):
            os.write(block_fd, b"1")
        os.close(block_fd)


async def _pump(stream: asyncio.StreamReader, capture: OutputCapture) -> None:
    while chunk := await stream.read(65536):
        capture.feed(chunk)


class _Run:
    """One started command: its process, its cgroup and how to end it."""

    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        cgroup: Cgroup | None,
        *,
        init_pid: int | None = None,
        status_fd: int | None = None,
    ) -> None:
        self.proc = proc
        self.cgroup = cgroup
        self.init_pid = init_pid  # bwrap's namespace init (None in mode off)
        self.status_fd = status_fd

    def kill(self) -> None:
        # os.kill, not proc.kill(): Popen.send_signal polls first, which can reap the
        # child under asyncio's watcher thread and lose its exit status.
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
        if self.cgroup is not None:
            self.cgroup.kill_all()

    async def close(self) -> None:
        if self.status_fd is not None:
            os.close(self.status_fd)
            self.status_fd = None
        if self.cgroup is not None:
            await self.cgroup.close()

    async def supervise(self, deadline: float, max_processes: int) -> str | None:
        """Wait for the end; the reason it was killed, or None if it ended by itself."""
        waiter = asyncio.ensure_future(self.proc.wait())
        ns = _pid_ns(self.init_pid) if self.init_pid is not None else None
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return "timeout"
                done, _ = await asyncio.wait({waiter}, timeout=min(POLL_S, remaining))
                if done:
                    return None
                if self.cgroup is not None:
                    if self.cgroup.forks_refused():
                        return "process limit"
                elif ns is not None and _count_in_ns(ns) > max_processes:
                    return "process limit"
        finally:
            waiter.cancel()


async def _spawn(
    argv: list[str],
    root: Path,
    mode: str,
    *,
    preexec_fn: Callable[[], object] | None = None,
    pass_fds: Collection[int] = (),
) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *argv,
        cwd=str(root),
        env=sandbox_env(mode),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=preexec_fn,
        pass_fds=pass_fds,
    )


def _seccomp_fd() -> int:
    """A file holding the compiled filter, read by bwrap from its start."""
    program = unix_socket_filter()
    assert program is not None  # sandbox_argv refuses where there is none
    fd = os.memfd_create("opencomposer-seccomp", os.MFD_CLOEXEC)
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


async def _start(argv: list[str], root: Path, config: SandboxConfig) -> _Run:
    cgroup = Cgroup.create(config)
    if config.mode == "off":
        try:
            proc = await _spawn(
                argv, root, config.mode, preexec_fn=lambda: _child_setup(config, cgroup)
            )
        except BaseException:
            if cgroup is not None:
                cgroup.remove()
            raise
        return _Run(proc, cgroup)

    status_r, status_w = os.pipe()
    block_r, block_w = os.pipe()
    seccomp = _seccomp_fd()
    gated = [
        argv[0],
        "--json-status-fd", str(status_w),
        "--block-fd", str(block_r),
        "--seccomp", str(seccomp),
        *argv[1:],
    ]  # fmt: skip
    try:
        proc = await _spawn(gated, root, config.mode, pass_fds=(status_w, block_r, seccomp))
    except BaseException:
        os.close(status_r)
        os.close(block_w)
        if cgroup is not None:
            cgroup.remove()
        raise
    finally:
        os.close(status_w)
        os.close(block_r)
        os.close(seccomp)
    run = _Run(proc, cgroup, status_fd=status_r)
    try:
        init_pid, attached = await asyncio.to_thread(_open_gate, status_r, block_w, config, cgroup)
    except BaseException:
        run.kill()
        _background(_reap(run))
        raise
    run.init_pid = init_pid
    if cgroup is not None and not attached:
        cgroup.remove()
        run.cgroup = None  # the watchdog bounds processes instead
    return run


async def run_sandboxed(
    command: str,
    *,
    root: Path,
    config: SandboxConfig,
    timeout_s: float | None = None,
    files: Mapping[str, str] | None = None,
    scratch: Path | None = None,
) -> CommandResult:
    """Run `command` with bash at `root` under `config`; see the module docstring.

    `files`: a trial run. The command sees these texts ({path in the workspace: text})
    in place of those files, and the whole workspace read-only, so it changes nothing
    however it ends. Each path must name a file that exists; mode `off` cannot do it.
    `scratch`: a folder outside the workspace that the command may write even so, for
    the caller to read what it leaves there (`agent/localize.py`)."""
    root = Path(root).resolve()
    if not root.is_dir():
        raise SandboxError(f"workspace {root} is not a directory")
    if files is not None:
        if config.mode == "off":
            raise SandboxError("a trial run needs the sandbox (mode read-only or workspace-write)")
        config = dataclasses.replace(config, mode="read-only")
    if root == Path(root.anchor) and config.mode == "workspace-write":
        raise SandboxError("the workspace is the file-system root; refusing to make it writable")
    folder = None
    if scratch is not None:
        folder = str(Path(scratch).resolve())
        inside = (
            Path(folder) == root or root in Path(folder).parents or Path(folder) in root.parents
        )
        if not Path(folder).is_dir() or inside:
            raise SandboxError(
                f"a scratch folder must be a folder outside the workspace: {scratch}"
            )
    guard = git_guard(root) if config.mode == "workspace-write" and bwrap_path() else None
    with _trial_files(root, files or {}) as over:
        return await _run(command, root, config, timeout_s, guard, over, folder)


@contextlib.contextmanager
def _trial_files(root: Path, files: Mapping[str, str]) -> Iterator[list[tuple[str, str]]]:
    """(source, target) binds that put `files`' texts over the workspace's files, from
    a private folder outside it that is removed afterwards."""
    if not files:
        yield []
        return
    folder = Path(tempfile.mkdtemp(prefix="opencomposer-trial-"))
    try:
        over = []
        for i, (path, text) in enumerate(files.items()):
            target = (root / path).resolve()
            if root not in target.parents or not target.is_file():
                raise SandboxError(f"a trial run can only replace a file in the workspace: {path}")
            source = folder / str(i)
            source.write_bytes(text.encode("utf-8"))
            shutil.copymode(target, source)
            over.append((str(source), str(target)))
        yield over
    finally:
        shutil.rmtree(folder, ignore_errors=True)


async def _run(
    command: str,
    root: Path,
    config: SandboxConfig,
    timeout_s: float | None,
    guard: GitGuard | None,
    over: list[tuple[str, str]],
    scratch: str | None = None,
) -> CommandResult:
    argv = sandbox_argv(command, root, config, guard, over, scratch)
    limit = config.timeout_s if timeout_s is None else timeout_s
    if limit <= 0:
        raise SandboxError(f"timeout must be positive, got {limit}")
    capture = OutputCapture(config.output_limit)
    start = time.monotonic()
    starting = asyncio.ensure_future(_start(argv, root, config))
    try:
        # Shielded: a cancellation that lands while the process is being started must
        # not orphan it; the callback kills it as soon as it exists instead.
        run = await asyncio.shield(starting)
    except BaseException:
        starting.add_done_callback(_kill_started)
        raise
    proc = run.proc
    assert proc.stdout is not None
    reader = asyncio.ensure_future(_pump(proc.stdout, capture))
    reason: str | None = None
    try:
        reason = await run.supervise(start + limit, config.max_processes)
    except BaseException:
        run.kill()
        reader.cancel()
        _background(_reap(run, guard))
        raise
    if reason is not None:
        run.kill()
    elif config.mode == "off":
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of the finished command
    code = await proc.wait()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(reader), DRAIN_S)
    reader.cancel()
    if reason is None and run.cgroup is not None and run.cgroup.oom_kills():
        reason = "memory limit"
    await run.close()
    output = capture.text()
    if guard is not None and (changed := guard.restore()):
        names = ", ".join(os.path.relpath(p, root) for p in changed)
        output += f"\n[sandbox] put back {names}: git's control files are read-only here\n"
    return CommandResult(
        exit_code=code,
        output=output,
        timed_out=reason == "timeout",
        duration_s=time.monotonic() - start,
        killed_reason=reason,
    )


_BACKGROUND: set[asyncio.Task[None]] = set()


def _background(coro: Coroutine[Any, Any, None]) -> None:
    """Run a clean-up task to its end even though nobody awaits it (asyncio keeps only
    weak references to tasks)."""
    task = asyncio.ensure_future(coro)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


def _kill_started(starting: asyncio.Future[_Run]) -> None:
    if starting.cancelled() or starting.exception() is not None:
        return
    run = starting.result()
    run.kill()
    _background(_reap(run))


async def _reap(run: _Run, guard: GitGuard | None = None) -> None:
    with contextlib.suppress(Exception):
        await run.proc.wait()
    await run.close()
    if guard is not None:
        guard.restore()
