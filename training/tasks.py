"""Training and benchmark tasks: one folder each, `task.toml` plus `repo.tar`.

A task (DESIGN.md, "Tasks") is the workspace at the task's start (`repo.tar`),
the user's `query`, a `setup` command run once in the sandbox before the agent
starts, and a `verify` command whose exit status 0 means the task is solved.
The environment server (`training/env.py`), the benchmark (`training/bench.py`)
and the RL loop read only this format; the sources that write it are
`write_task` (anything), `task_from_trace` (logged sessions), `training/mining.py`
(bug injection into real repositories) and `training/starter.py` (the starter
suite). Suites by name (`starter`, `own`, the committed ones) are `training/catalog.py`'s:
it sits above the generators, which sit above this module.

`task.toml`::

    query = "tests/test_util.py::test_clamp fails with AssertionError ..."
    setup = ""                       # optional, run in the sandbox before the agent
    verify = "python -m pytest -q tests/test_util.py"
    timeout_s = 600                  # the whole episode
    command_timeout_s = 120          # optional: one sandboxed command
    protect = ["tests/test_util.py"] # optional: restored from repo.tar before verify
    split = "train"                  # optional: "train" | "heldout"
    source = "mined:inflection"      # optional: where the task came from

    [reward]                         # optional weights; default {verify = 1.0}
    verify = 0.8                     # the verify command passes
    answer = 0.2                     # the final answer matches answer_pattern
    answer_pattern = "\\b4242\\b"
    tool_call = 0.1                  # at least one tool call succeeded
    [[reward.checks]]                # extra graded commands, run like verify
    command = "python -c 'import ast; ast.parse(open(\"m.py\").read())'"
    weight = 0.1

The reward of an episode is the weighted fraction of the parts that passed;
`resolved` means verify passed (and the answer matched, where one is weighted).
The final answer is also written to `.opencomposer/answer.txt` in the workspace
before verify runs, so a verify command may grade it.

Run the tests: `.venv/bin/python -m pytest tests/training/test_tasks*.py -q`.
"""

from __future__ import annotations

import io
import json
import posixpath
import re
import shutil
import tarfile
import tempfile
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opencomposer.tools import specs
from opencomposer.tools.git import Git, GitError, run_git

TASK_FILE = "task.toml"
REPO_TAR = "repo.tar"
ANSWER_FILE = ".opencomposer/answer.txt"
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_COMMAND_TIMEOUT_S = 120.0
# Never packed into a repo.tar: version control, environments, caches.
SKIP_NAMES = frozenset(
    {
        ".git",
        ".hg",
        ".venv",
        "venv",
        "node_modules",
        "__pycache__",
        ".pytest_cache",
        ".mypy_cache",
        ".ruff_cache",
        ".tox",
        ".nox",
        ".opencomposer",
    }
)
_REWARD_KEYS = frozenset({"verify", "answer", "answer_pattern", "tool_call", "checks"})
_TOP_KEYS = frozenset(
    {
        "id",
        "query",
        "setup",
        "verify",
        "timeout_s",
        "command_timeout_s",
        "protect",
        "split",
        "source",
        "reward",
    }
)


class TaskError(ValueError):
    """A task folder or task source that cannot be used; the message is one line."""


@dataclass(frozen=True, kw_only=True)
class Task:
    """One task, as read from its folder. `reward` holds the weights (see module doc)."""

    id: str
    dir: Path
    query: str
    setup: str
    verify: str
    timeout_s: float
    reward: dict[str, Any] = field(default_factory=lambda: {"verify": 1.0})
    command_timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S
    protect: tuple[str, ...] = ()
    split: str = ""
    source: str = ""

    @property
    def repo_tar(self) -> Path:
        return self.dir / REPO_TAR


def load_task(dir: Path | str) -> Task:
    """Read one task folder; TaskError (one clear line) for anything malformed."""
    d = Path(dir)
    toml_path = d / TASK_FILE
    if not toml_path.is_file():
        raise TaskError(f"{d}: no {TASK_FILE}")
    try:
        data = tomllib.loads(toml_path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise TaskError(f"{toml_path}: malformed TOML: {_one_line(str(e))}") from None
    if not (d / REPO_TAR).is_file():
        raise TaskError(f"{d}: no {REPO_TAR}")
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise TaskError(f"{toml_path}: unknown key {', '.join(unknown)}")

    def get(key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        value = data.get(key, default)
        if value is None:
            raise TaskError(f"{toml_path}: missing {key}")
        if not isinstance(value, kind) or isinstance(value, bool):
            raise TaskError(f"{toml_path}: {key} must be {_kind_name(kind)}")
        return value

    query = get("query", str)
    verify = get("verify", str)
    if not query.strip():
        raise TaskError(f"{toml_path}: query is empty")
    if not verify.strip():
        raise TaskError(f"{toml_path}: verify is empty")
    timeout_s = float(get("timeout_s", (int, float), DEFAULT_TIMEOUT_S))
    command_timeout_s = float(get("command_timeout_s", (int, float), DEFAULT_COMMAND_TIMEOUT_S))
    if timeout_s <= 0 or command_timeout_s <= 0:
        raise TaskError(f"{toml_path}: timeouts must be positive")
    protect = get("protect", list, [])
    if not all(isinstance(p, str) and _safe_rel(p) for p in protect):
        raise TaskError(f"{toml_path}: protect must list workspace-relative paths")
    return Task(
        id=get("id", str, d.name),
        dir=d.resolve(),
        query=query,
        setup=get("setup", str, ""),
        verify=verify,
        timeout_s=timeout_s,
        reward=_check_reward(data.get("reward", {"verify": 1.0}), toml_path),
        command_timeout_s=command_timeout_s,
        protect=tuple(protect),
        split=get("split", str, ""),
        source=get("source", str, ""),
    )


def _check_reward(reward: Any, where: Path) -> dict[str, Any]:
    if not isinstance(reward, dict):
        raise TaskError(f"{where}: reward must be a table of weights")
    unknown = sorted(set(reward) - _REWARD_KEYS)
    if unknown:
        raise TaskError(f"{where}: unknown reward key {', '.join(unknown)}")
    for key in ("verify", "answer", "tool_call"):
        w = reward.get(key, 0.0)
        if isinstance(w, bool) or not isinstance(w, int | float) or w < 0:
            raise TaskError(f"{where}: reward.{key} must be a non-negative number")
    if reward.get("answer") and not isinstance(reward.get("answer_pattern"), str):
        raise TaskError(f"{where}: reward.answer needs reward.answer_pattern")
    if "answer_pattern" in reward:
        try:
            re.compile(reward["answer_pattern"])
        except (re.error, TypeError) as e:
            raise TaskError(f"{where}: reward.answer_pattern is not a regex: {e}") from None
    checks = reward.get("checks", [])
    if not isinstance(checks, list) or not all(
        isinstance(c, dict)
        and isinstance(c.get("command"), str)
        and isinstance(c.get("weight", 1.0), int | float)
        for c in checks
    ):
        raise TaskError(f"{where}: reward.checks must be [[reward.checks]] with command and weight")
    out = {"verify": 1.0, **reward}
    total = sum(float(out.get(k, 0.0)) for k in ("verify", "answer", "tool_call"))
    total += sum(float(c.get("weight", 1.0)) for c in checks)
    if total <= 0:
        raise TaskError(f"{where}: reward weights sum to zero")
    return out


# ---------------------------------------------------------------- writing


def write_task(
    out_dir: Path | str,
    *,
    query: str,
    verify: str,
    repo_dir: Path | str | None = None,
    repo_tar: Path | str | bytes | None = None,
    setup: str = "",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    command_timeout_s: float | None = None,
    reward: dict[str, Any] | None = None,
    protect: Iterable[str] = (),
    split: str = "",
    source: str = "",
) -> Path:
    """Write a task folder (created if needed) and return it.

    The workspace comes from `repo_dir` (packed deterministically, skipping
    SKIP_NAMES) or from `repo_tar` (a path or the bytes of a tar). The result is
    read back with `load_task`, so a task that this writes always loads.
    """
    if (repo_dir is None) == (repo_tar is None):
        raise TaskError("write_task needs exactly one of repo_dir and repo_tar")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if repo_dir is not None:
        (out / REPO_TAR).write_bytes(pack_dir(Path(repo_dir)))
    elif isinstance(repo_tar, bytes):
        (out / REPO_TAR).write_bytes(repo_tar)
    else:
        shutil.copyfile(Path(repo_tar), out / REPO_TAR)  # type: ignore[arg-type]
    lines = [
        f"query = {_toml_str(query)}",
        f"setup = {_toml_str(setup)}",
        f"verify = {_toml_str(verify)}",
        f"timeout_s = {float(timeout_s)}",
    ]
    if command_timeout_s is not None:
        lines.append(f"command_timeout_s = {float(command_timeout_s)}")
    if protect:
        lines.append(f"protect = [{', '.join(_toml_str(p) for p in protect)}]")
    if split:
        lines.append(f"split = {_toml_str(split)}")
    if source:
        lines.append(f"source = {_toml_str(source)}")
    lines += ["", "[reward]"]
    reward = dict(reward or {"verify": 1.0})
    checks = reward.pop("checks", [])
    for key, value in reward.items():
        lines.append(f"{key} = {_toml_value(value)}")
    for check in checks:
        lines += ["", "[[reward.checks]]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in check.items()]
    (out / TASK_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")
    load_task(out)
    return out


def pack_dir(root: Path, *, skip: frozenset[str] = SKIP_NAMES) -> bytes:
    """A deterministic tar of `root` (sorted, zero mtimes and owners): the same tree
    always gives the same bytes, so generated suites are reproducible."""
    if not root.is_dir():
        raise TaskError(f"{root}: not a folder")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in _walk(root, skip):
            rel = path.relative_to(root).as_posix()
            info = tar.gettarinfo(str(path), arcname=rel)
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if info.isreg():
                with path.open("rb") as fh:
                    tar.addfile(info, fh)
            elif info.isdir() or info.issym():
                tar.addfile(info)
    return buf.getvalue()


def _walk(root: Path, skip: frozenset[str]) -> Iterable[Path]:
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        if entry.name in skip or entry.name.endswith(".pyc"):
            continue
        yield entry
        if entry.is_dir() and not entry.is_symlink():
            yield from _walk(entry, skip)


def safe_extract(tar_path: Path, dest: Path) -> None:
    """Unpack `repo.tar` into `dest`, refusing any entry that would land outside it
    (`../`, absolute paths, links pointing out, devices). TaskError names the entry.

    Tars made the usual way (`tar -cf repo.tar -C repo .`) hold a `.` entry for the
    root and `./`-prefixed names: those are the workspace itself and inside it.
    """
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(tar_path) as tar:
            _extract(tar, dest)
    except tarfile.FilterError as e:
        raise TaskError(f"{tar_path}: unsafe entry: {_one_line(str(e))}") from None
    except (tarfile.TarError, OSError, EOFError) as e:
        raise TaskError(f"{tar_path}: unreadable tar: {_one_line(str(e))}") from None


def _extract(tar: tarfile.TarFile, dest: Path, *, forbid: frozenset[str] = frozenset()) -> None:
    """Check every member, then extract with tarfile's `data` filter, which also
    refuses links that only escape through other links (`a -> .`, `a/b -> ../..`)."""
    members = []
    for member in tar.getmembers():
        rel = _check_member(member, forbid=forbid)
        if rel != ".":
            members.append(member)
    tar.extractall(dest, members=members, filter="data")


def _member_path(name: str) -> str:
    """An entry's name as a workspace-relative path: `./a/b` and `a//b/` are `a/b`,
    `.` and `./` are the root `.`; absolute names stay absolute (and are refused)."""
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        return name
    parts = [p for p in name.replace("\\", "/").split("/") if p not in ("", ".")]
    return "/".join(parts) or "."


def _check_member(m: tarfile.TarInfo, *, forbid: frozenset[str] = frozenset()) -> str:
    """The member's normalised path; TaskError if it is not a plain file, folder or
    link that stays inside the workspace."""
    name = m.name
    rel = _member_path(name)
    if rel.startswith("/") or re.match(r"^[A-Za-z]:", rel) or ".." in rel.split("/"):
        raise TaskError(f"repo.tar entry {name!r} escapes the workspace")
    if forbid & set(rel.split("/")):
        raise TaskError(f"repo.tar entry {name!r} is not allowed here")
    if m.isdev() or m.isfifo():
        raise TaskError(f"repo.tar entry {name!r} is a device or fifo")
    if not (m.isreg() or m.isdir() or m.issym() or m.islnk()):
        raise TaskError(f"repo.tar entry {name!r} is not a file, folder or link")
    if rel == "." and not m.isdir():
        raise TaskError(f"repo.tar entry {name!r} is the workspace itself but not a folder")
    if m.issym() or m.islnk():
        target = m.linkname
        if target.startswith("/") or re.match(r"^[A-Za-z]:", target):
            raise TaskError(f"repo.tar entry {name!r} links outside the workspace ({target})")
        # a symlink resolves from its folder; a hard link names another entry
        base = posixpath.dirname(rel) if m.issym() else ""
        resolved = posixpath.normpath(posixpath.join(base, _member_path(target)))
        if resolved == ".." or resolved.startswith("../"):
            raise TaskError(f"repo.tar entry {name!r} links outside the workspace ({target})")
    return rel


def _safe_rel(path: str) -> bool:
    parts = Path(path).parts
    return bool(parts) and not Path(path).is_absolute() and ".." not in parts


# ---------------------------------------------------------------- from traces

# A command that runs tests: pytest, unittest, `npm test`, `go test`, `make check`,
# `python test_calc.py`, `cargo test`, `tox`, …
_TEST_COMMAND = re.compile(r"test|check|spec|\btox\b|\bnox\b", re.IGNORECASE)


def task_from_trace(
    session_id: str,
    *,
    out: Path,
    verify: str | None = None,
    store: Any = None,
) -> Path:
    """Turn one logged session into a task folder under `out` (named after the session).

    The workspace at the session's start is rebuilt from the trace's git HEAD
    (`git archive`) plus the uncommitted diff recorded at start (`git apply`);
    without git, from today's files with the session's own edits reverted. The
    verify command is `verify` if given, else the last test command the session
    ran with exit status 0; TaskError if there is neither.
    """
    if store is None:
        from opencomposer.agent.traces import TraceStore

        store = TraceStore()
    try:
        if hasattr(store, "resolve"):
            session_id = store.resolve(session_id)
        trace = store.export(session_id)
    except KeyError as e:
        raise TaskError(
            _one_line(str(e.args[0] if e.args else e)) or f"no session {session_id!r}"
        ) from None
    if not trace:
        raise TaskError(f"no session {session_id!r} in the trace store")
    session = trace.get("session", trace)
    query = _first_query(trace)
    if not query:
        raise TaskError(f"session {session_id}: no user query recorded")
    verify = verify or _recorded_verify(trace)
    if not verify:
        raise TaskError(
            f"session {session_id}: no passing test run recorded; give a verify command (--verify)"
        )
    workspace = Path(str(session.get("workspace") or ""))
    with tempfile.TemporaryDirectory(prefix="oc-trace-task-") as tmp:
        start = Path(tmp) / "repo"
        head = session.get("git_head") or session.get("head")
        diff = session.get("git_diff") or session.get("diff") or ""
        if head:
            _rebuild_from_git(workspace, str(head), str(diff), start)
        else:
            _rebuild_by_reverting(workspace, trace, start)
        return write_task(
            Path(out) / _safe_id(session_id),
            query=query,
            verify=verify,
            repo_dir=start,
            source=f"trace:{session_id}",
        )


def _first_query(trace: dict[str, Any]) -> str:
    session = trace.get("session", trace)
    if isinstance(session.get("query"), str) and session["query"].strip():
        return session["query"]
    for msg in trace.get("messages", []):
        if msg.get("role") == "user" and msg.get("kind", "text") == "text":
            return str(msg.get("content", ""))
    return ""


def _recorded_verify(trace: dict[str, Any]) -> str | None:
    found = None
    for call in trace.get("tool_calls", []):
        spec = specs.BY_NAME.get(str(call.get("name")))
        if spec is None or spec.kind != "command" or call.get("status", "ok") != "ok":
            continue
        args = call.get("args") or {}
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = {}
        command = str(args.get("command", "")).strip()
        result = str(call.get("result") or call.get("output") or "")
        exit_code = call.get("exit_code", _exit_code(result))
        if command and exit_code == 0 and _TEST_COMMAND.search(command):
            found = command
    return found


def _exit_code(result: str) -> int | None:
    m = re.search(r"exit(?: code| status)?[:= ]+(-?\d+)", result, re.IGNORECASE)
    return int(m.group(1)) if m else None


def _rebuild_from_git(workspace: Path, head: str, diff: str, dest: Path) -> None:
    """The workspace at HEAD plus the recorded diff. The repository is untrusted:
    git runs with its programs disabled (`tools.git`), the archive is unpacked with
    the repo.tar checks, and `git apply` may write only into `dest`."""
    git = Git.find(workspace) if (workspace / ".git").exists() else None
    if git is None:
        raise TaskError(f"{workspace}: the session's git repository is gone")
    dest.mkdir(parents=True)
    try:
        archive = git.run("archive", "--format=tar", head, cwd=workspace, timeout=120)
        if archive.returncode != 0:
            raise TaskError(
                f"{workspace}: git archive {head[:12]} failed: {_one_line(archive.stderr.decode())}"
            )
        try:
            with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
                _extract(tar, dest, forbid=frozenset({".git"}))
        except (tarfile.TarError, OSError) as e:
            raise TaskError(f"{workspace}: git archive {head[:12]}: {_one_line(str(e))}") from None
        if diff.strip():
            applied = run_git(
                ["apply", "--whitespace=nowarn", "-"], cwd=dest, input=diff.encode(), writable=dest
            )
            if applied.returncode != 0:
                raise TaskError(
                    "the recorded uncommitted diff does not apply: "
                    + _one_line(applied.stderr.decode())
                )
    except GitError as e:
        raise TaskError(f"{workspace}: {e}") from None


def _rebuild_by_reverting(workspace: Path, trace: dict[str, Any], dest: Path) -> None:
    if not workspace.is_dir():
        raise TaskError(f"{workspace}: the session's workspace is gone and it had no git HEAD")
    shutil.copytree(workspace, dest, symlinks=True, ignore=shutil.ignore_patterns(*SKIP_NAMES))
    for edit in reversed(trace.get("edits", [])):
        path = dest / str(edit["path"])
        if edit.get("before") is None:
            path.unlink(missing_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(edit["before"], encoding="utf-8")


# ---------------------------------------------------------------- helpers


def _safe_id(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-.") or "task"


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {str: "a string", int: "a number", float: "a number", list: "a list"}
    return " or ".join(dict.fromkeys(names.get(k, k.__name__) for k in kinds))


def _toml_str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(float(value)) if isinstance(value, float) else str(value)
    if isinstance(value, str):
        return _toml_str(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TaskError(f"cannot write {type(value).__name__} to task.toml")
