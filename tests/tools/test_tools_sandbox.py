"""run_sandboxed under real bubblewrap: confinement, no network, limits, timeouts, cancellation.

Each test names the escape it guards against. Run: pytest tests/tools/test_tools_sandbox.py
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from pathlib import Path

import pytest
from opencomposer.tools import sandbox
from opencomposer.tools.protocols import SandboxConfig
from opencomposer.tools.sandbox import SandboxError, run_sandboxed

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", autouse=True)
def _needs_bwrap() -> None:
    assert sandbox.bwrap_path(), "bubblewrap is missing: run `make system-deps`"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "data.txt").write_text("inside\n")
    return ws


def cfg(**kw: object) -> SandboxConfig:
    return SandboxConfig(**{"timeout_s": 20.0, **kw})  # type: ignore[arg-type]


def _alive_with(marker: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmdline:
                found.append(pid)
    return found


async def test_runs_in_the_workspace_and_writes_there(root: Path) -> None:
    r = await run_sandboxed("pwd; cat data.txt; echo made > out.txt", root=root, config=cfg())
    assert r.exit_code == 0 and r.killed_reason is None and r.ok
    assert r.output == f"{root}\ninside\n"
    assert (root / "out.txt").read_text() == "made\n"


async def test_writes_outside_the_workspace_are_refused(root: Path, tmp_path: Path) -> None:
    target = tmp_path / "escaped.txt"
    r = await run_sandboxed(
        f"echo x > {target}; touch {Path.home()}/oc-escape", root=root, config=cfg()
    )
    assert r.exit_code != 0 and "Read-only file system" in r.output
    assert not target.exists() and not (Path.home() / "oc-escape").exists()


async def test_tmp_is_private_and_writable(root: Path) -> None:
    marker = f"oc-sbx-{os.getpid()}"
    r = await run_sandboxed(f"echo x > /tmp/{marker} && cat /tmp/{marker}", root=root, config=cfg())
    assert r.exit_code == 0 and r.output == "x\n"
    assert not Path(f"/tmp/{marker}").exists()


async def test_read_only_mode_refuses_workspace_writes(root: Path) -> None:
    r = await run_sandboxed(
        "cat data.txt; echo y > data.txt", root=root, config=cfg(mode="read-only")
    )
    assert r.exit_code != 0 and "inside" in r.output
    assert (root / "data.txt").read_text() == "inside\n"


async def test_no_network(root: Path) -> None:
    code = (
        "import socket\n"
        "s = socket.socket(); s.settimeout(2)\n"
        "try:\n    s.connect(('1.1.1.1', 80)); print('CONNECTED')\n"
        "except OSError as e:\n    print('refused', e.errno)\n"
    )
    (root / "net.py").write_text(code)
    r = await run_sandboxed(
        "python3 net.py; cat /proc/net/dev | tail -n +3", root=root, config=cfg()
    )
    assert "CONNECTED" not in r.output and "refused" in r.output
    interfaces = [line.split(":")[0].strip() for line in r.output.splitlines()[1:]]
    assert interfaces == ["lo"]


async def test_timeout_kills_the_whole_tree(root: Path) -> None:
    marker = "654.321"
    start = time.monotonic()
    r = await run_sandboxed(
        f"(sleep {marker} &); setsid sleep {marker} & sleep {marker}",
        root=root,
        config=cfg(timeout_s=1.0),
    )
    assert r.timed_out and r.killed_reason == "timeout" and not r.ok
    assert time.monotonic() - start < 5
    await asyncio.sleep(0.2)
    assert _alive_with(marker) == []


async def test_endless_output_is_capped_and_memory_bounded(root: Path) -> None:
    r = await run_sandboxed(
        "yes 0123456789", root=root, config=cfg(timeout_s=1.5, output_limit=2000)
    )
    assert r.timed_out
    assert len(r.output) < 2200
    assert r.output.startswith("0123456789\n") and r.output.endswith("0123456789\n")
    assert "of output cut from the middle" in r.output


async def test_fork_bomb_is_bounded_and_killed(root: Path) -> None:
    probe = sandbox.Cgroup.create(cfg())
    if probe is None:
        pytest.skip("no pids cgroup here: a real fork bomb would be bounded only by the watchdog")
    probe.remove()
    mine = f"{sandbox.CGROUP_PREFIX}{os.getpid()}-*"
    before = set(Path("/sys/fs/cgroup/pids").glob(mine))  # left by earlier runs, swept later
    start = time.monotonic()
    r = await run_sandboxed(":(){ :|:& };:; sleep 30", root=root, config=cfg(max_processes=64))
    assert r.killed_reason == "process limit"
    assert time.monotonic() - start < 10
    # The cgroup is removed in the background once the tree is gone (up to ~2 s).
    left: list[Path] = []
    for _ in range(50):
        left = sorted(set(Path("/sys/fs/cgroup/pids").glob(mine)) - before)
        if not left:
            break
        await asyncio.sleep(0.1)
    assert not left


async def test_process_watchdog_without_cgroups(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sandbox.Cgroup, "create", classmethod(lambda cls, config: None))
    marker = "765.432"
    r = await run_sandboxed(
        f"for i in $(seq 1 100); do sleep {marker} & done; wait",
        root=root,
        config=cfg(max_processes=20),
    )
    assert r.killed_reason == "process limit"
    await asyncio.sleep(0.2)
    assert _alive_with(marker) == []


async def test_memory_limit(root: Path) -> None:
    r = await run_sandboxed(
        "python3 -c 'x = bytearray(1024 * 1024 * 1024)'; echo after",
        root=root,
        config=cfg(memory_mb=256),
    )
    assert "MemoryError" in r.output and "after" in r.output


async def test_cancellation_kills_within_a_short_time(root: Path) -> None:
    marker = "543.219"
    task = asyncio.create_task(run_sandboxed(f"sleep {marker}", root=root, config=cfg()))
    for _ in range(200):
        await asyncio.sleep(0.02)
        if _alive_with(marker):
            break
    assert _alive_with(marker)
    start = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    while _alive_with(marker) and time.monotonic() < start + 1.0:
        await asyncio.sleep(0.005)
    # Not a timing test (benchmarks/tools_micro.py measures it, ~100 ms or less): the
    # bound only tells "killed at once" from "left running until its own timeout".
    assert not _alive_with(marker), "cancelling the task left the command running"
    await asyncio.sleep(0.3)  # let the background reaper finish before the loop closes


async def test_secrets_do_not_reach_the_command(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENCOMPOSER_API_KEY", "sk-secret")
    monkeypatch.setenv("HARMLESS", "visible")
    r = await run_sandboxed("env", root=root, config=cfg())
    assert "sk-secret" not in r.output and "HARMLESS=visible" in r.output


async def test_mode_off_runs_without_bwrap_with_limits(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)
    r = await run_sandboxed("echo hi > off.txt; cat off.txt", root=root, config=cfg(mode="off"))
    assert r.output == "hi\n" and (root / "off.txt").exists()
    r = await run_sandboxed("sleep 30", root=root, config=cfg(mode="off", timeout_s=0.5))
    assert r.timed_out


async def test_without_bwrap_other_modes_refuse(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)
    with pytest.raises(SandboxError, match="bubblewrap .bwrap. is not installed"):
        await run_sandboxed("true", root=root, config=cfg())
    with pytest.raises(SandboxError, match="unknown sandbox mode"):
        await run_sandboxed("true", root=root, config=cfg(mode="yolo"))


async def test_exit_codes_pass_through(root: Path) -> None:
    r = await run_sandboxed("echo out; echo err >&2; exit 3", root=root, config=cfg())
    assert r.exit_code == 3 and r.output == "out\nerr\n" and not r.ok


async def test_limits_are_applied_before_the_command_starts(root: Path) -> None:
    r = await run_sandboxed("ulimit -v; ulimit -c", root=root, config=cfg(memory_mb=300))
    assert r.output == f"{300 * 1024}\n0\n"


async def test_bwrap_failing_at_start_is_reported_not_hung(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = sandbox.sandbox_argv
    monkeypatch.setattr(
        sandbox, "sandbox_argv", lambda *a: [real(*a)[0], "--no-such-option", *real(*a)[1:]]
    )
    r = await run_sandboxed("true", root=root, config=cfg())
    assert r.exit_code != 0 and "no-such-option" in r.output


# -- host UNIX sockets ---------------------------------------------------------

_CONNECT = """
import socket, sys
for path in sys.argv[1:]:
    try:
        s = socket.socket(socket.AF_UNIX); s.settimeout(2); s.connect(path)
        s.sendall(b"hello"); print("CONNECTED", path)
    except OSError as e:
        print("refused", e.errno)
a, b = socket.socketpair(); a.sendall(b"pair"); print("socketpair", b.recv(4).decode())
try:
    d, _ = socket.socketpair(type=socket.SOCK_DGRAM); d.sendto(b"x", sys.argv[1]); print("SENT")
except OSError as e:
    print("dgram refused", e.errno)
"""


async def test_host_unix_sockets_are_unreachable(root: Path) -> None:
    """The sandbox reached host UNIX sockets (`curl --unix-socket /var/tmp/…sock`; on a
    developer's machine docker.sock). Sockets served by the host in a folder the
    sandbox can see (/var/tmp, the workspace itself) must refuse; socketpair works."""
    import socket
    import tempfile

    outside = Path(tempfile.mkdtemp(dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    servers, paths = [], [str(outside / "host.sock"), str(root / "ws.sock")]
    try:
        for path in paths:
            srv = socket.socket(socket.AF_UNIX)
            srv.bind(path)
            srv.listen()
            srv.setblocking(False)
            servers.append(srv)
        (root / "connect.py").write_text(_CONNECT)
        r = await run_sandboxed(f"python3 connect.py {' '.join(paths)}", root=root, config=cfg())
        assert "CONNECTED" not in r.output and r.output.splitlines().count("refused 1") == 2, (
            r.output
        )
        assert "socketpair pair" in r.output and "SENT" not in r.output
        for srv in servers:
            with pytest.raises(BlockingIOError):
                srv.accept()  # nobody ever connected
    finally:
        for srv in servers:
            srv.close()
        for path in paths:
            with contextlib.suppress(OSError):
                os.unlink(path)
        outside.rmdir()


async def test_subprocesses_and_multiprocessing_still_work(root: Path) -> None:
    """The socket filter must leave the plumbing of ordinary programs alone."""
    code = (
        "import asyncio, multiprocessing, subprocess\n"
        "async def main():\n"
        "    p = await asyncio.create_subprocess_exec('true'); return await p.wait()\n"
        "if __name__ == '__main__':\n"
        "    print(subprocess.run(['echo', 'sub'], capture_output=True, text=True).stdout)\n"
        "    print('asyncio', asyncio.run(main()))\n"
        "    with multiprocessing.get_context('spawn').Pool(2) as pool:\n"
        "        print('pool', pool.map(abs, [-1, -2]))\n"
    )
    (root / "plumbing.py").write_text(code)
    r = await run_sandboxed("python3 plumbing.py", root=root, config=cfg())
    assert r.output == "sub\n\nasyncio 0\npool [1, 2]\n", r.output


# -- git's control files -------------------------------------------------------


def _git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(
        ["git", "-c", "user.email=t@t", "-c", "user.name=t", *args],
        cwd=cwd, env=env, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip


@pytest.fixture
def repo(root: Path) -> Path:
    _git(root, "init", "-q")
    _git(root, "add", "data.txt")
    _git(root, "commit", "-qm", "first")
    return root


PLANTS = [
    "printf '[core]\\n\\tfsmonitor = touch PWNED\\n' >> .git/config",
    "git config core.hooksPath hooks2",
    "printf '#!/bin/sh\\ntouch PWNED\\n' > .git/hooks/pre-commit",
    "rm -rf .git/hooks",
    "mv .git/config .git/c.old; cp .git/c.old .git/config; echo '[core] fsmonitor=x' >> .git/config",
    "mv .git .git.old && cp -r .git.old .git && echo '[core] fsmonitor=x' >> .git/config",
    "mkdir -p ../evil && echo ../evil > .git/commondir",
    "echo '[core] fsmonitor=x' > .git/config.worktree",
]


@pytest.mark.parametrize("plant", PLANTS)
async def test_git_config_and_hooks_cannot_be_planted(repo: Path, plant: str) -> None:
    """A sandboxed command wrote .git/config, and the next session's host-side
    `git diff` ran the program it named. Config, hooks and the files that say where
    they are stay as they were, whatever the command tries."""
    config = (repo / ".git" / "config").read_bytes()
    hooks = sorted(p.name for p in (repo / ".git" / "hooks").iterdir())
    await run_sandboxed(plant, root=repo, config=cfg())
    assert (repo / ".git").is_dir() and not (repo / ".git.old").exists()
    assert (repo / ".git" / "config").read_bytes() == config
    assert sorted(p.name for p in (repo / ".git" / "hooks").iterdir()) == hooks
    assert not (repo / ".git" / "commondir").exists()
    assert not (repo / ".git" / "config.worktree").exists()


async def test_git_still_commits_in_the_sandbox(repo: Path) -> None:
    r = await run_sandboxed(
        "echo more >> data.txt && git -c user.email=t@t -c user.name=t commit -qam second"
        " && git log --oneline | wc -l",
        root=repo,
        config=cfg(),
    )
    assert r.output.strip() == "2", r.output
    assert _git(repo, "log", "-1", "--format=%s").strip() == "second"


async def test_hooks_folder_is_guarded_even_when_missing(repo: Path) -> None:
    """`rm -r .git/hooks` before the run must not leave a place to plant one."""
    subprocess.run(["rm", "-rf", str(repo / ".git" / "hooks")], check=True)
    await run_sandboxed(
        "mkdir -p .git/hooks; echo x > .git/hooks/post-checkout", root=repo, config=cfg()
    )
    assert not (repo / ".git" / "hooks" / "post-checkout").exists()


async def test_linked_worktree_dot_git_file_is_read_only(repo: Path, tmp_path: Path) -> None:
    """In a linked worktree `.git` is a file naming the git directory; rewriting it
    would point the host's git at a planted one."""
    wt = tmp_path / "wt"
    _git(repo, "worktree", "add", "-q", str(wt))
    dot_git = (wt / ".git").read_text()
    r = await run_sandboxed(
        "mkdir -p evil && echo 'gitdir: evil' > .git; mv .git g; echo x >> ../ws/.git/config",
        root=wt,
        config=cfg(),
    )
    assert (wt / ".git").read_text() == dot_git and "Read-only" in r.output
    assert "x" not in (repo / ".git" / "config").read_text().split()


async def test_submodule_git_dirs_are_guarded(repo: Path) -> None:
    """Submodules keep their config in .git/modules/NAME and a `.git` file in the
    checkout; both are as dangerous as the top repository's."""
    sub_git = repo / ".git" / "modules" / "lib" / "sub"
    sub_git.mkdir(parents=True)
    (sub_git / "HEAD").write_text("ref: refs/heads/main\n")
    (sub_git / "config").write_text("[core]\n\tbare = false\n")
    (repo / "vendor" / "lib").mkdir(parents=True)
    (repo / "vendor" / "lib" / ".git").write_text("gitdir: ../../.git/modules/lib/sub\n")
    (repo / ".gitmodules").write_text('[submodule "lib"]\n\tpath = vendor/lib\n\turl = x\n')
    r = await run_sandboxed(
        "echo '[core] fsmonitor=x' >> .git/modules/lib/sub/config;"
        " echo 'gitdir: /tmp/x' > vendor/lib/.git; mv .git/modules .git/m;"
        " echo x > .git/modules/lib/sub/hooks/pre-commit; mv vendor/lib vendor/l2",
        root=repo,
        config=cfg(),
    )
    assert r.output.count("Read-only file system") >= 2, r.output
    assert (sub_git / "config").read_text() == "[core]\n\tbare = false\n"
    assert (repo / "vendor" / "lib" / ".git").read_text().startswith("gitdir: ../../")
    assert (repo / ".git" / "modules").is_dir() and not (sub_git / "hooks" / "pre-commit").exists()


# -- secrets in the environment ------------------------------------------------


async def test_secret_looking_values_do_not_reach_the_command(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`DATABASE_URL`-style secrets passed into the sandbox: the name says nothing,
    the value holds the password."""
    secrets = {
        "DATABASE_URL": "postgres://app:hunter2pw@db.internal:5432/app",
        "SENTRY_DSN": "https://abc123@o1.ingest.sentry.io/42",
        "MONGO_URI": "mongodb+srv://root:s3cr3tpw@cluster0.example.net/db",
        "PG_CONN": "host=db user=app password=hunter3pw dbname=x",
        "UPSTREAM": "ghp_" + "a1B2" * 9,
        "PAYMENTS": "sk_live_" + "x9Y8" * 6,
        "DEPLOY_PASS": "plain-words-here",
        "CLOUD": "AKIA" + "ABCDEFGHIJKLMNOP",
    }
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HOMEPAGE_URL", "https://example.com:8080/a@b")
    monkeypatch.setenv("GIT_REMOTE", "ssh://git@github.com/o/r.git")
    r = await run_sandboxed("env", root=root, config=cfg())
    for k, v in secrets.items():
        assert v not in r.output and f"{k}=" not in r.output, k
    assert "HOMEPAGE_URL=https://example.com:8080/a@b" in r.output
    assert "GIT_REMOTE=ssh://git@github.com/o/r.git" in r.output


async def test_symlinked_hooks_folder_is_put_back(repo: Path, tmp_path: Path) -> None:
    """A shared hooks folder linked in as `.git/hooks` cannot be bound read-only (a
    mount follows the link), so replacing the link is undone after the run."""
    shared = repo / "githooks"
    shared.mkdir()
    subprocess.run(["rm", "-rf", str(repo / ".git" / "hooks")], check=True)
    (repo / ".git" / "hooks").symlink_to("../githooks")
    r = await run_sandboxed(
        "rm .git/hooks && mkdir .git/hooks && echo x > .git/hooks/pre-commit",
        root=repo,
        config=cfg(),
    )
    assert os.readlink(repo / ".git" / "hooks") == "../githooks"
    assert not (shared / "pre-commit").exists() and "put back .git/hooks" in r.output


async def test_a_trial_run_sees_the_given_files_and_changes_nothing(root: Path) -> None:
    """A candidate change tried before it is made: the command reads the candidate's
    text, its writes are refused, and no trace of the trial stays behind."""
    (root / "pkg").mkdir()
    (root / "pkg" / "mod.py").write_text("X = 1\n")
    (root / "run.sh").write_text("echo old\n")
    (root / "run.sh").chmod(0o755)
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    r = await run_sandboxed(
        "cat data.txt; python3 -c 'import pkg.mod as m; print(m.X)'; ./run.sh;"
        " echo x > data.txt; touch new.txt; echo wrote=$?",
        root=root,
        config=cfg(),
        files={"pkg/mod.py": "X = 2\n", "run.sh": "echo new\n"},
    )
    assert r.output.startswith("inside\n2\nnew\n") and "Read-only file system" in r.output
    assert r.output.rstrip().endswith("wrote=1")
    assert (root / "data.txt").read_text() == "inside\n"
    assert (root / "pkg" / "mod.py").read_text() == "X = 1\n"
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
    ok = await run_sandboxed(
        "grep -q 2 pkg/mod.py", root=root, config=cfg(), files={"pkg/mod.py": "X = 2\n"}
    )
    assert ok.ok


async def test_a_trial_run_replaces_only_files_of_the_workspace(root: Path, tmp_path: Path) -> None:
    (tmp_path / "outside.txt").write_text("secret\n")
    for path in ("../outside.txt", "missing.py", "."):
        with pytest.raises(SandboxError, match="only replace a file in the workspace"):
            await run_sandboxed("true", root=root, config=cfg(), files={path: "x"})
    with pytest.raises(SandboxError, match="needs the sandbox"):
        await run_sandboxed("true", root=root, config=cfg(mode="off"), files={"data.txt": "x"})
    assert (tmp_path / "outside.txt").read_text() == "secret\n"


async def test_a_trial_run_may_write_its_scratch_folder_only(root: Path, tmp_path: Path) -> None:
    """A profiled trial run leaves its record in a scratch folder outside the
    workspace; the workspace stays read-only, and a scratch folder that holds the
    workspace, or lies in it, is refused."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    r = await run_sandboxed(
        f"echo rec > {scratch}/1.json; echo x > data.txt; echo wrote=$?",
        root=root,
        config=cfg(),
        files={},
        scratch=scratch,
    )
    assert (scratch / "1.json").read_text() == "rec\n" and r.output.rstrip().endswith("wrote=1")
    assert (root / "data.txt").read_text() == "inside\n"
    (root / "sub").mkdir()
    for bad in (root, root / "sub", root.parent, tmp_path / "missing"):
        with pytest.raises(SandboxError, match="scratch folder"):
            await run_sandboxed("true", root=root, config=cfg(), files={}, scratch=bad)
