"""Search tools: grep, glob, codebase_search.

grep runs ripgrep (`rg`) when it is on PATH and a pure-Python walk otherwise;
both respect `.gitignore`, skip binary files and report `path:line:text`. Open
editor buffers (the workspace overlay) are searched from their text, never from
the stale disk copy. Globs follow .gitignore rules: a pattern without a slash
matches a file name in any folder (`*.py`), `**` spans folders, `{a,b}` expands.

rg runs on the host, outside the sandbox, so nothing the model writes may become
one of its options: every value travels inside its own `--flag=value` argument,
the one path operand comes after `--` and starts with `./`, and `--no-config`
keeps a `RIPGREP_CONFIG_PATH` from adding any (`--pre` would run a program). A
folder to search is opened through descriptors like every file access (see
`opencomposer.tools.workspace`) and becomes rg's cwd; a single file is opened the
same way and becomes rg's stdin; so a path swapped for a symlink after the check
is not followed out of the workspace. Only folders and regular files are
searched: rg would block on a FIFO named as the path.

Errors follow the package convention (see `opencomposer.tools.files`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import pathspec
from opencomposer.tools.output import returns_errors
from opencomposer.tools.protocols import SearchHit, ToolContext, ToolError, ToolResult
from opencomposer.tools.specs import GLOB, GREP
from opencomposer.tools.workspace import (
    not_found,
    open_dir,
    open_regular,
    parent_dir,
    read_regular,
    walk_files,
)

GREP_MAX_SHOWN = 200
GREP_MAX_COUNTED = 50_000  # stop reading matches past this; say "more than"
GREP_LINE_CHARS = 300
GREP_MAX_FILESIZE = 4 * 1024 * 1024
GREP_TIMEOUT_S = 30.0
GLOB_MAX_SHOWN = 500
SEARCH_PREVIEW_LINES = 6

Match = tuple[str, int, str]


def _under(path: str, folder: str) -> bool:
    return folder in ("", ".") or path == folder or path.startswith(folder + "/")


def _expand_braces(pattern: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    head, tail = pattern[: m.start()], pattern[m.end() :]
    return [x for alt in m.group(1).split(",") for x in _expand_braces(head + alt + tail)]


def compile_glob(pattern: str) -> pathspec.GitIgnoreSpec:
    """A matcher for workspace-relative paths; ToolError for an unusable pattern."""
    pattern = pattern.strip()
    if not pattern:
        raise ToolError("glob pattern is empty")
    if pattern.startswith("/") or "\0" in pattern or ".." in pattern.split("/"):
        raise ToolError(f"glob pattern {pattern} must be relative to the workspace, without ..")
    if pattern.startswith("./"):
        pattern = pattern[2:]
    try:
        return pathspec.GitIgnoreSpec.from_lines(_expand_braces(pattern))
    except Exception as e:  # pathspec raises several types for bad patterns
        raise ToolError(f"bad glob pattern {pattern}: {e}") from None


def _clip(text: str) -> str:
    text = text.rstrip("\r\n")
    if len(text) > GREP_LINE_CHARS:
        return text[:GREP_LINE_CHARS] + " [...]"
    return text


# -- grep ---------------------------------------------------------------------


@returns_errors
async def grep(
    ctx: ToolContext,
    pattern: str,
    path: str = "",
    glob: str | None = None,
    case_sensitive: bool = True,
) -> ToolResult:
    ws = ctx.workspace
    if not pattern:
        raise ToolError("grep pattern is empty")
    key = ws.key(path or ".")
    if not ws.exists(key):
        raise not_found(ws, key, "path")
    if not _searchable(ws.root / key):
        raise ToolError(f"{key} is not a regular file or a folder; grep searches text files")
    try:
        regex: re.Pattern[str] | None = re.compile(pattern, 0 if case_sensitive else re.IGNORECASE)
    except re.error as e:
        regex = None
        py_error = str(e)
    spec = compile_glob(glob) if glob else None

    overlay = {
        k: v
        for k, v in ws.overlay().items()
        if _under(k, key) and (spec is None or spec.match_file(k))
    }
    rg = shutil.which("rg")
    if rg is None and regex is None:
        raise ToolError(f"invalid regular expression {pattern!r}: {py_error}")
    shown: list[Match] = []
    total = 0
    if not (ws.root / key).exists():
        pass  # an unsaved buffer: nothing on disk to search
    elif rg is not None:
        shown, total = await _grep_rg(rg, ws.root, pattern, key, glob, case_sensitive, set(overlay))
    elif regex is not None:
        shown, total = await asyncio.to_thread(
            _grep_python, ws.root, regex, key, spec, set(overlay)
        )
    if regex is not None:
        for k in sorted(overlay):
            for match in _search_text(k, overlay[k], regex):
                total += 1
                shown.append(match)
    shown.sort(key=lambda m: (m[0], m[1]))
    return _grep_result(pattern, key, shown, total)


def _grep_result(pattern: str, key: str, shown: list[Match], total: int) -> ToolResult:
    where = "the workspace" if key == "." else key
    if total == 0:
        return ToolResult.ok(f"no matches for {pattern!r} in {where}", meta={"matches": 0})
    lines = [f"{p}:{n}:{_clip(t)}" for p, n, t in shown[:GREP_MAX_SHOWN]]
    rest = total - len(lines)
    if rest > 0:
        more = f"more than {rest}" if total >= GREP_MAX_COUNTED else str(rest)
        lines.append(f"[... {more} more matches not shown; narrow the pattern, path or glob]")
    return ToolResult.ok("\n".join(lines), meta={"matches": total})


def _search_text(path: str, text: str, regex: re.Pattern[str]) -> Iterable[Match]:
    for n, line in enumerate(text.split("\n"), 1):
        if regex.search(line):
            yield path, n, line


@functools.cache
def _rg_has_engine_flag(rg: str) -> bool:
    try:
        out = subprocess.run([rg, "--help"], capture_output=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return b"--engine" in out


async def _grep_rg(
    rg: str,
    root: Path,
    pattern: str,
    key: str,
    glob: str | None,
    case_sensitive: bool,
    skip: set[str],
) -> tuple[list[Match], int]:
    args = [
        rg,
        "--no-config",
        "--no-require-git",
        "--hidden",
        "--glob=!.git",
        "--line-number",
        "--no-heading",
        "--with-filename",
        "--null",
        "--color=never",
        "--no-messages",
        "--sort=path",
        f"--max-filesize={GREP_MAX_FILESIZE}",
        "--ignore-case" if not case_sensitive else "--case-sensitive",
    ]
    if _rg_has_engine_flag(rg):
        args.append("--engine=auto")  # PCRE2 when the pattern needs look-around
    for g in _expand_braces(glob) if glob else ():
        args.append(f"--glob={g}")
    args.append(f"--regexp={pattern}")
    return await asyncio.to_thread(_run_rg, args, root, key, pattern, skip)


def _searchable(target: Path) -> bool:
    try:
        mode = target.stat().st_mode
    except OSError:
        return True  # an open buffer not on disk; the search reports what it finds
    return stat.S_ISDIR(mode) or stat.S_ISREG(mode)


class _Start(NamedTuple):
    """How rg is started for one grep: where, on what, and what its names are relative to."""

    cwd: str
    operands: list[str]
    prefix: str  # joined before each name rg prints ("<stdin>" stands for `stdin_name`)
    pass_fds: tuple[int, ...] = ()
    stdin: int | None = None
    stdin_name: str = ""


@contextlib.contextmanager
def _start(root: Path, key: str) -> Iterator[_Start]:
    """Where rg starts for `key`, with no path looked up again after the check.

    A folder is opened through descriptors (see `parent_dir`) and becomes rg's cwd
    as `/proc/self/fd/N`; a file is opened the same way (O_NOFOLLOW, checked
    regular) and handed to rg as stdin. Without /proc the path is given after
    `--` as `./…`.
    """
    if key == ".":
        yield _Start(str(root), [], "")
        return
    if not Path("/proc/self/fd").is_dir():
        yield _Start(str(root), ["--", f"./{key}"], "")
        return
    try:
        with parent_dir(root, key) as (dir_fd, name):
            if (root / key).is_dir():
                fd = open_dir(dir_fd, name)
                try:
                    yield _Start(f"/proc/self/fd/{fd}", [], key + "/", pass_fds=(fd,))
                finally:
                    os.close(fd)
                return
            fd = open_regular(dir_fd, name, key, limit=sys.maxsize)  # rg streams it
            try:
                yield _Start(str(root), ["--", "-"], "", stdin=fd, stdin_name=key)
            finally:
                os.close(fd)
    except OSError as e:
        raise ToolError(f"cannot search {key}: {e.strerror}") from None


def _kill(proc: subprocess.Popen[bytes]) -> None:
    # os.kill, not proc.kill(): Popen.send_signal polls first and can reap the child
    # out from under a concurrent wait.
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL)


def _run_rg(
    args: list[str], root: Path, key: str, pattern: str, skip: set[str]
) -> tuple[list[Match], int]:
    """Read rg's matches in a worker thread, stopping early past GREP_MAX_COUNTED.

    A plain Popen in a thread, not an asyncio subprocess: the asyncio child watcher
    can lose a child's exit to another reaper in the process (Ray, the sandbox) and
    then never resolve, and a line longer than a StreamReader's limit raises. A timer
    kills a search that runs past GREP_TIMEOUT_S.
    """
    with _start(root, key) as start:
        proc = subprocess.Popen(
            args + start.operands,
            cwd=start.cwd,
            pass_fds=start.pass_fds,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL if start.stdin is None else start.stdin,
            start_new_session=True,
        )
    timer = threading.Timer(GREP_TIMEOUT_S, _kill, (proc,))
    timer.start()
    shown: list[Match] = []
    total = 0
    assert proc.stdout is not None and proc.stderr is not None
    try:
        for raw in proc.stdout:
            name, _, rest = raw.rstrip(b"\n").partition(b"\0")
            if start.stdin is not None and name == b"<stdin>":
                path = start.stdin_name
            else:
                path = start.prefix + name.decode("utf-8", "replace").removeprefix("./")
            if path in skip:
                continue
            line_no, _, text = rest.partition(b":")
            total += 1
            if len(shown) < GREP_MAX_SHOWN:
                shown.append((path, int(line_no or 0), text.decode("utf-8", "replace")))
            if total >= GREP_MAX_COUNTED:
                break
    finally:
        timed_out = not timer.is_alive()  # the timer fired and killed rg
        timer.cancel()
        if proc.poll() is None:
            _kill(proc)
        err = proc.stderr.read().decode("utf-8", "replace")
        proc.stdout.close()
        proc.stderr.close()
        code = proc.wait()
    if timed_out and code < 0 and total == 0:
        raise ToolError(
            f"grep for {pattern!r} took over {GREP_TIMEOUT_S:.0f} s; narrow the path or the pattern"
        )
    if code == 2 and total == 0 and err.strip():
        first = " ".join(err.split())
        raise ToolError(f"invalid regular expression {pattern!r}: {first}")
    return shown, total


def _grep_python(
    root: Path,
    regex: re.Pattern[str],
    key: str,
    spec: pathspec.GitIgnoreSpec | None,
    skip: set[str],
) -> tuple[list[Match], int]:
    base = root
    files: Iterable[str] = [key] if (base / key).is_file() else walk_files(base, key)
    shown: list[Match] = []
    total = 0
    for rel in files:
        if rel in skip or (spec is not None and not spec.match_file(rel)):
            continue
        try:
            with parent_dir(base, rel) as (dir_fd, name):
                data = read_regular(dir_fd, name, rel, GREP_MAX_FILESIZE)
        except (OSError, ToolError):  # too big, not a regular file, or gone
            continue
        if b"\0" in data:
            continue
        for match in _search_text(rel, data.decode("utf-8", "replace"), regex):
            total += 1
            if len(shown) < GREP_MAX_SHOWN:
                shown.append(match)
            if total >= GREP_MAX_COUNTED:
                return shown, total
    return shown, total


# -- glob ---------------------------------------------------------------------


@returns_errors
async def glob(ctx: ToolContext, pattern: str) -> ToolResult:
    ws = ctx.workspace
    spec = compile_glob(pattern)

    def scan() -> list[str]:
        found = {rel for rel in walk_files(ws.root) if spec.match_file(rel)}
        found.update(k for k in ws.overlay() if spec.match_file(k))
        return sorted(found)

    paths = await asyncio.to_thread(scan)
    if not paths:
        return ToolResult.ok(f"no files match {pattern}", meta={"files": 0})
    out = paths[:GLOB_MAX_SHOWN]
    if len(paths) > len(out):
        out.append(f"[... {len(paths) - len(out)} more files; use a narrower pattern]")
    return ToolResult.ok("\n".join(out), meta={"files": len(paths)})


# -- codebase_search ------------------------------------------------------------


@returns_errors
async def codebase_search(
    ctx: ToolContext, query: str, path: str | None = None, k: int = 8
) -> ToolResult:
    if not query.strip():
        raise ToolError("query is empty")
    if not 1 <= k <= 50:
        raise ToolError(f"k must be between 1 and 50, got {k}")
    folder = None
    if path:
        folder = ctx.workspace.key(path)
        folder = None if folder == "." else folder
    index = ctx.index
    if index is None and ctx.index_factory is not None:
        try:
            index = await ctx.index_factory()
        except ToolError:
            raise
        except Exception as e:
            raise ToolError(
                f"the codebase index failed to open ({e}); use {GREP} or {GLOB}"
            ) from None
        ctx.index = index
    if index is None:
        raise ToolError(f"no codebase index for this workspace; use {GREP} or {GLOB}")
    hits = await asyncio.to_thread(index.search, query, k=k, path=folder)
    if not hits:
        return ToolResult.ok(f"no results for {query!r}", meta={"results": 0})
    return ToolResult.ok(
        "\n\n".join(_format_hit(ctx, h) for h in hits), meta={"results": len(hits)}
    )


def _format_hit(ctx: ToolContext, hit: SearchHit) -> str:
    head = f"{hit.path}:{hit.start_line}-{hit.end_line} ({hit.score:.3f})"
    if hit.symbol:
        head += f" {hit.symbol}"
    text = hit.text
    if not text:
        try:
            lines = ctx.workspace.read_text(hit.path).split("\n")
            text = "\n".join(lines[hit.start_line - 1 : hit.end_line])
        except ToolError:
            text = ""
    preview = text.split("\n")[:SEARCH_PREVIEW_LINES]
    total = text.count("\n") + 1
    body = "\n".join(f"  {_clip(ln)}" for ln in preview)
    if total > len(preview):
        body += f"\n  [... {total - len(preview)} more lines]"
    return head + ("\n" + body if body.strip() else "")
