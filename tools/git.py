"""Git on a worktree we do not trust: none of the repository's own programs run.

A repository names programs that git runs on its behalf: `core.fsmonitor`,
hooks (`post-index-change` fires when `git diff` refreshes the index), filter
drivers (`filter.X.clean` runs on worktree files that `.gitattributes` selects),
`diff.external` and textconv drivers, `core.pager`, credential helpers,
`core.sshCommand` and remote helpers (a partial clone fetches lazily), and any
of these can come from `.git/config`, a file it includes, or
`.git/info/attributes`. The agent's sandbox can write the workspace, so one
session could plant such a setting for the next session's `git diff` to run on
the host. Every git command the project runs on a user's or a task's worktree
goes through `Git.run`, which closes this in three layers:

1. **Environment.** The caller's `GIT_*` variables are dropped (no inherited
   `GIT_DIR`, `GIT_EXTERNAL_DIFF`, `GIT_SSH_COMMAND` …); `GIT_ALLOW_PROTOCOL` is
   empty, so no transport at all can start (no lazy fetch, ssh or remote helper);
   `GIT_OPTIONAL_LOCKS=0`, so reads never write the index (no index hook); no
   pager, editor, askpass or terminal prompt.
2. **Configuration from the command line**, which outranks every file
   (`GIT_CONFIG_COUNT`, so no key needs quoting): fixed overrides
   (`core.fsmonitor=false`, `core.hooksPath=/dev/null`, `protocol.allow=never`,
   `credential.helper=`, …); then, for every driver the repository's own config
   defines (`filter.X`, `diff.X`, `merge.X`, `tar.X`, `hook.X`), its program keys
   set empty, which git reads as "no program"; and every other key of the
   repository's config whose name says it holds a program (`…command`, `…cmd`,
   `…program`, `…helper`, `sshCommand`, `editor`, `askPass`, …) set empty. The
   repository's config is listed first with `git config --list --show-scope`
   (a command that reads files and runs nothing). System and global config files
   are the user's own and stay trusted, unless they lie inside the worktree.
   `diff` always gets `--no-ext-diff --no-textconv`. The worktree is the folder
   holding `.git`, found by walking up as git does and passed explicitly, so
   `core.worktree` cannot point git at the rest of the disk; a bare repository
   inside the workspace is never picked up.
3. **Sandbox.** Where bubblewrap works, git runs in new namespaces (no network)
   with the whole file system read-only (plus one writable folder where a
   command needs it, e.g. `git apply`), so a program we did not think of still
   changes nothing.

    git = Git.find(Path("workspace"))          # None outside a repository
    head = git.run("rev-parse", "HEAD").stdout
    run_git(["apply", "-"], cwd=dest, input=patch, writable=dest)   # no repository
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shlex
import shutil
import signal
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

DEFAULT_TIMEOUT_S = 60.0

# Fixed overrides: what git may run is nothing; what it may reach is nothing.
_FIXED = (
    ("core.fsmonitor", "false"),
    ("core.hooksPath", "/dev/null"),
    ("core.pager", "cat"),
    ("core.askPass", ""),
    ("core.sshCommand", ""),
    ("credential.helper", ""),
    ("protocol.allow", "never"),
    ("submodule.recurse", "false"),
    ("diff.ignoreSubmodules", "all"),
    ("status.submoduleSummary", "false"),
    ("color.ui", "false"),
)
# Keys of a driver section that name a program, and what neutral value disables it.
_DRIVERS = {
    "filter": (("clean", ""), ("smudge", ""), ("process", ""), ("required", "false")),
    "diff": (("command", ""), ("textconv", "")),
    "merge": (("driver", ""),),
    "tar": (("command", ""),),
    "hook": (("command", ""),),
}
# Variable names (any section) that hold a program or a path git executes.
_PROGRAM_VAR = re.compile(
    r"(?:command|cmd|program|helper|hook|hookspath|fsmonitor|editor|pager|askpass|"
    r"gitproxy|textconv|clean|smudge|process|driver|uploadpack|receivepack)$",
    re.IGNORECASE,
)
# Never blanked: an empty value would break the command instead of disabling it
# (`diff.external` is switched off by --no-ext-diff, which `run` always adds).
_KEEP = frozenset({"diff.external"})
_CLEAN_ENV = {
    "GIT_ALLOW_PROTOCOL": "",
    "GIT_PROTOCOL_FROM_USER": "0",
    "GIT_NO_LAZY_FETCH": "1",
    "GIT_OPTIONAL_LOCKS": "0",
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_PAGER": "cat",
    "PAGER": "cat",
    "GIT_EDITOR": "true",
    "GIT_LITERAL_PATHSPECS": "1",
}
_DROP_ENV = frozenset({"EDITOR", "VISUAL", "SSH_ASKPASS", "LESSOPEN", "LESSCLOSE"})


class GitError(RuntimeError):
    """git could not be started at all (not installed, timed out); one line."""


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_") and k not in _DROP_ENV}
    env.update(_CLEAN_ENV)
    return env


def _with_config(env: dict[str, str], pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    pairs = list(pairs)
    out = dict(env)
    out["GIT_CONFIG_COUNT"] = str(len(pairs))
    for i, (key, value) in enumerate(pairs):
        out[f"GIT_CONFIG_KEY_{i}"] = key
        out[f"GIT_CONFIG_VALUE_{i}"] = value
    return out


def _inside(path: Path, folders: Iterable[Path]) -> bool:
    return any(path == f or f in path.parents for f in folders)


def untrusted_overrides(listing: bytes, untrusted: Sequence[Path]) -> list[tuple[str, str]]:
    """Config overrides that blank every program named by an untrusted config entry.

    `listing` is `git config --list -z --show-scope --show-origin`: records of
    scope NUL origin NUL key [LF value] NUL. An entry is trusted when it comes from
    the system or global scope through a file outside every `untrusted` folder.
    """
    out: dict[str, str] = {}
    fields = listing.split(b"\0")
    for i in range(0, len(fields) - 2, 3):
        scope = fields[i].decode(errors="replace")
        origin = fields[i + 1].decode(errors="replace")
        key = fields[i + 2].split(b"\n", 1)[0].decode(errors="replace")
        if scope == "command":
            continue  # ours
        if scope in ("system", "global") and origin.startswith("file:"):
            source = Path(origin[5:])
            if source.is_absolute() and not _inside(_resolved(source), untrusted):
                continue
        section, _, rest = key.partition(".")
        sub, _, var = rest.rpartition(".")
        if sub and section.lower() in _DRIVERS:
            for name, value in _DRIVERS[section.lower()]:
                out[f"{section}.{sub}.{name}"] = value
        if _PROGRAM_VAR.search(var) and key.lower() not in _KEEP:
            out[key] = ""
    return sorted(out.items())


def _resolved(p: Path) -> Path:
    try:
        return p.resolve()
    except OSError:
        return p


# -- the sandbox ------------------------------------------------------------------


@functools.cache
def _bwrap() -> str | None:
    """bwrap's path if it can make namespaces here (tested once per process)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return None
    try:
        ok = subprocess.run(
            [bwrap, *_bwrap_args(Path("/"), None), "true"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return bwrap if ok.returncode == 0 else None


def _bwrap_args(cwd: Path, writable: Path | None) -> list[str]:
    args = ["--unshare-all", "--die-with-parent", "--new-session"]
    args += ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    if writable is not None:
        args += ["--bind", str(writable), str(writable)]
    return [*args, "--chdir", str(cwd), "--"]


def confined(argv: Sequence[str], *, cwd: Path, writable: Path | None = None) -> list[str]:
    """`argv` wrapped in a read-only, network-less bubblewrap where one works here."""
    bwrap = _bwrap()
    if bwrap is None:
        return list(argv)
    return [bwrap, *_bwrap_args(cwd, writable), *argv]


# -- running ------------------------------------------------------------------------


def _exec(
    argv: Sequence[str],
    *,
    cwd: Path,
    env: dict[str, str],
    input: bytes | None,
    timeout: float,
    writable: Path | None,
) -> subprocess.CompletedProcess[bytes]:
    """Run in its own process group, killed whole past `timeout` (a config that
    includes a FIFO, a huge repository): GitError, never a hang."""
    argv = confined(argv, cwd=cwd, writable=writable)
    try:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL if input is None else subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as e:
        raise GitError(f"cannot run git: {e}") from None
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise GitError(f"git took over {timeout:.0f} s in {cwd}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _git() -> str:
    git = shutil.which("git")
    if git is None:
        raise GitError("git is not installed")
    return git


def _guard(args: Sequence[str]) -> list[str]:
    """`diff` never runs an external diff or a textconv program."""
    args = list(args)
    if args and args[0] == "diff":
        args[1:1] = ["--no-ext-diff", "--no-textconv", "--no-color"]
    return args


class Git:
    """One repository's git, run with the repository's programs disabled."""

    def __init__(self, worktree: Path, git_dir: Path, *, timeout: float = DEFAULT_TIMEOUT_S):
        self.worktree = worktree
        self.git_dir = git_dir
        self.timeout = timeout  # each command's limit (a config can include a FIFO)
        self._env: dict[str, str] | None = None

    @classmethod
    def find(cls, path: Path, *, timeout: float = DEFAULT_TIMEOUT_S) -> Git | None:
        """The repository `path` is in (the nearest folder up holding `.git`), or None."""
        start = _resolved(Path(path))
        for folder in (start, *start.parents):
            if os.path.lexists(folder / ".git"):
                return cls(folder, folder / ".git", timeout=timeout)
        return None

    def _prefix(self) -> list[str]:
        return [_git(), "--no-pager", f"--git-dir={self.git_dir}", f"--work-tree={self.worktree}"]

    def env(self, cwd: Path | None = None) -> dict[str, str]:
        """The environment that carries the overrides (listed once per `Git`)."""
        if self._env is None:
            base = _with_config(_base_env(), _FIXED)
            listing = _exec(
                [*self._prefix(), "config", "--list", "-z", "--show-scope", "--show-origin"],
                cwd=self.worktree,
                env=base,
                input=None,
                timeout=self.timeout,
                writable=None,
            )
            if listing.returncode != 0:
                err = " ".join(listing.stderr.decode(errors="replace").split())[:300]
                raise GitError(f"git cannot read the repository's config: {err}")
            untrusted = [_resolved(self.worktree), _resolved(self.git_dir)]
            blanks = untrusted_overrides(listing.stdout, untrusted)
            self._env = _with_config(_base_env(), [*blanks, *_FIXED])
        return self._env

    def run(
        self,
        *args: str,
        cwd: Path | None = None,
        input: bytes | None = None,
        timeout: float | None = None,
    ) -> subprocess.CompletedProcess[bytes]:
        """`git ARGS` in this repository (cwd: the worktree, or a folder inside it)."""
        where = cwd or self.worktree
        argv = [*self._prefix(), *_guard(args)]
        limit = self.timeout if timeout is None else timeout
        return _exec(argv, cwd=where, env=self.env(), input=input, timeout=limit, writable=None)

    def run_each(
        self, args: Sequence[str], paths: Sequence[str], *, cwd: Path | None = None
    ) -> bytes:
        """`git ARGS PATH` for each path, in one sandbox; their stdout concatenated."""
        if not paths:
            return b""
        script = f'for p in "$@"; do {shlex.join([*self._prefix(), *_guard(args)])} "$p"; done'
        out = _exec(
            ["sh", "-c", script, "git-each", *paths],
            cwd=cwd or self.worktree,
            env=self.env(),
            input=None,
            timeout=self.timeout * 2,
            writable=None,
        )
        return out.stdout


def run_git(
    args: Sequence[str],
    *,
    cwd: Path,
    input: bytes | None = None,
    writable: Path | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> subprocess.CompletedProcess[bytes]:
    """`git ARGS` in `cwd`, which is *not* to be a repository (e.g. `git apply` into a
    fresh folder): no repository is looked for above `cwd`, only `writable` may change."""
    cwd = _resolved(Path(cwd))
    env = _with_config(_base_env(), _FIXED)
    env["GIT_CEILING_DIRECTORIES"] = str(cwd.parent)
    env["GIT_DIR"] = str(cwd / ".git-none")  # a repository that is never there
    argv = [_git(), "--no-pager", *_guard(args)]
    return _exec(argv, cwd=cwd, env=env, input=input, timeout=timeout, writable=writable)
