"""`LocalWorkspace`: the `Workspace` protocol over a folder on disk, with an overlay of
open editor buffers; and `walk_files`, the one `.gitignore`-aware file walk that
list_dir, glob, grep (fallback) and read_lints share.

Safety. Every path a tool names goes through `resolve()`, which refuses NUL bytes,
absolute paths and anything whose real path (symlinks followed) is outside the
root. A check alone would race: a folder swapped for a symlink between the check
and the open would redirect the access. So every disk access then walks the
checked path again from the root, one component at a time, through directory
descriptors (`openat` with `O_NOFOLLOW`): the walk passes only through real
folders under the root, and a swap makes it fail, never escape. The descriptor
of the root is opened for each operation (not held for the workspace's life), so
a root that a training environment deletes and recreates is never written as a
ghost.

Only regular files are read or replaced: a FIFO, socket or device is refused
after an `lstat`, and the open itself is `O_NONBLOCK`, so nothing a tool reads
can block. Files over `MAX_FILE_BYTES` are refused with one line: the tools hold
a file's text, its edited copy and their diff in memory at once, so a cap on the
input is a cap on the process. Writes are atomic (a temp file in the same
folder, then a rename, both through the folder's descriptor) and keep the file's
mode, so an interrupted write never leaves half a file. `delete` removes the
entry itself: a symlink goes, its target stays.

The language server subclasses `LocalWorkspace` and overrides `write_text` and
`delete` for files open in the editor; `write_disk`/`delete_disk` stay available
for the on-disk part.

    ws = LocalWorkspace(Path("repo"), buffers={"src/app.py": "unsaved text"})
    ws.read_text("src/app.py")   # -> "unsaved text"
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

import pathspec
from opencomposer.tools.protocols import PathError, ToolError, Workspace
from opencomposer.tools.specs import RUN_TERMINAL

SKIP_DIRS = frozenset({".git", ".hg", ".svn"})
# The most a file tool loads. edit_file on a file this size peaks near 2x it on a hit
# and 3.5x on a miss (tests/tools/test_tools_files.py measures both).
MAX_FILE_BYTES = 16_000_000
_WRITE_CHUNK = 1 << 20  # characters encoded at a time, so a write never holds a second full copy

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _O_CLOEXEC
_O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _O_CLOEXEC


def decode_text(data: bytes, path: str) -> str:
    """UTF-8 text of `data`; ToolError for binary (NUL bytes) or non-UTF-8 content."""
    if b"\0" in data:
        raise ToolError(f"{path} is a binary file ({len(data)} bytes); only text files can be read")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ToolError(
            f"{path} is not UTF-8 text (invalid byte 0x{data[e.start]:02x} at offset {e.start})"
        ) from None


# -- descriptor-relative file access ---------------------------------------------


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISLNK(mode):
        return "a symlink"
    return "not a regular file"


def _swapped(key: str) -> PathError:
    return PathError(
        f"{key}: a part of the path is a symlink that was not there when it was checked; refused"
    )


@contextlib.contextmanager
def parent_dir(root: Path, key: str, *, create: bool = False) -> Iterator[tuple[int, str]]:
    """(descriptor of the folder that holds `key`, the last name in `key`).

    `key` is a canonical workspace-relative path (what `LocalWorkspace.key` gives:
    no `.`, `..` or symlinks). The walk opens each folder relative to the one
    before with `O_NOFOLLOW`, so a component that is a symlink now raises
    PathError. With `create`, missing folders are made. Other failures are the
    OSError of the step (FileNotFoundError, NotADirectoryError, PermissionError).
    """
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise PathError(f"{key} is not a plain workspace path")
    fd = os.open(root, _O_DIR)
    try:
        for name in parts[:-1]:
            try:
                sub = os.open(name, _O_DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o777, dir_fd=fd)
                sub = os.open(name, _O_DIR, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    if stat.S_ISLNK(st.st_mode):
                        raise _swapped(key) from None
                    raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR)) from None
                raise
            os.close(fd)
            fd = sub
        yield fd, parts[-1]
    finally:
        os.close(fd)


def read_regular(dir_fd: int, name: str, key: str, limit: int | None = None) -> bytes:
    """The bytes of the regular file `name` in `dir_fd`; ToolError for anything else.

    An `lstat` first, so a FIFO or device is never opened; then an `O_NOFOLLOW |
    O_NONBLOCK` open and an `fstat` of what was opened, so a swap in between is
    caught too. `limit` defaults to MAX_FILE_BYTES.
    """
    limit = MAX_FILE_BYTES if limit is None else limit
    with open(open_regular(dir_fd, name, key, limit), "rb", buffering=0) as f:
        data = f.readall()
    if len(data) > limit:
        raise _too_big(key, len(data), limit)
    return data


def open_regular(dir_fd: int, name: str, key: str, limit: int | None = None) -> int:
    """A read descriptor of the regular file `name` in `dir_fd` (see `read_regular`)."""
    limit = MAX_FILE_BYTES if limit is None else limit
    _check_regular(os.stat(name, dir_fd=dir_fd, follow_symlinks=False), key, limit)
    fd = os.open(name, _O_READ, dir_fd=dir_fd)
    try:
        _check_regular(os.fstat(fd), key, limit)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_regular(st: os.stat_result, key: str, limit: int) -> None:
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
    if stat.S_ISLNK(st.st_mode):
        raise _swapped(key)
    if not stat.S_ISREG(st.st_mode):
        raise ToolError(f"{key} is {_kind(st.st_mode)}, not a regular file; refused")
    if st.st_size > limit:
        raise _too_big(key, st.st_size, limit)


def _too_big(key: str, size: int, limit: int) -> ToolError:
    return ToolError(
        f"{key} is {size / 1e6:.1f} MB, over the {limit / 1e6:.0f} MB the file tools load; "
        f"use {RUN_TERMINAL} (grep, sed -n 'A,Bp', head) for it"
    )


def _replace(dir_fd: int, name: str, key: str, text: str) -> None:
    """Atomically make `name` in `dir_fd` a regular file holding `text` (UTF-8)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise ToolError(f"{key} is a directory; cannot write it as a file")
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise _swapped(key)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise ToolError(f"{key} is {_kind(st.st_mode)}, not a regular file; refused")
    tmp = f".{name[:200]}.{secrets.token_hex(4)}.tmp"
    # A new file gets 0o666 less the umask from the kernel; an existing one keeps its mode.
    fd = os.open(
        tmp,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _O_CLOEXEC,
        0o600 if st is not None else 0o666,
        dir_fd=dir_fd,
    )
    try:
        with open(fd, "wb") as f:  # buffered: its write() never stops short
            for i in range(0, len(text), _WRITE_CHUNK):
                f.write(_encode(text[i : i + _WRITE_CHUNK], key))
            f.flush()
            if st is not None:
                os.fchmod(fd, stat.S_IMODE(st.st_mode))
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def _encode(text: str, key: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ToolError(
            f"cannot write {key}: the text holds a lone surrogate "
            f"(U+{ord(text[e.start]):04X}), which is not valid UTF-8"
        ) from None


class LocalWorkspace:
    """A folder on disk; `buffers` (path -> text) is the open-editor overlay.

    The dict is used as given, not copied, so the owner (the language server)
    can keep it current as documents open, change and close. Its keys are
    workspace-relative POSIX paths.
    """

    def __init__(self, root: Path, buffers: dict[str, str] | None = None) -> None:
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise PathError(f"workspace {root} is not a directory")
        self.buffers: dict[str, str] = buffers if buffers is not None else {}

    # -- paths ---------------------------------------------------------------

    def resolve(self, path: str, *, follow: bool = True) -> Path:
        """Absolute real path of `path`; PathError if it escapes the root.

        With `follow=False` the last component is kept as named (a symlink stays
        the link: what `delete` removes); the folders above it are resolved.
        """
        key = self.key(path, follow=follow)
        return self.root if key == "." else self.root / key

    def key(self, path: str, *, follow: bool = True) -> str:
        """Canonical workspace-relative form of `path` (the buffers' key): one
        spelling per file, whatever `./`, `//`, `..` or symlinks named it."""
        if "\0" in path:
            raise PathError(f"path {path!r} contains a NUL byte")
        cleaned = path.strip()
        drive = (
            len(cleaned) > 2 and cleaned[0].isalpha() and cleaned[1] == ":" and cleaned[2] in "/\\"
        )
        if cleaned.startswith(("/", "\\", "~")) or drive:
            raise PathError(f"path {path} is absolute; use a path relative to the workspace root")
        if not follow:
            head, _, last = cleaned.rstrip("/").rpartition("/")
            if last not in ("", ".", ".."):
                folder = self.key(head or ".")
                return last if folder == "." else f"{folder}/{last}"
        root = str(self.root)
        try:
            real = os.path.realpath(os.path.join(root, cleaned))
        except OSError as e:  # a component changed while it was being resolved
            raise PathError(f"path {path} cannot be resolved: {e.strerror}") from None
        if real == root:
            return "."
        inside = root.rstrip("/") + "/"
        if not real.startswith(inside):
            raise PathError(f"path {path} resolves outside the workspace; refused")
        return real[len(inside) :]

    def relative(self, path: Path) -> str:
        """Workspace-relative form of `path`; its folders are resolved, its last name is kept."""
        path = Path(path)
        try:
            if path == self.root or path.name in ("", ".", ".."):
                rel = path.resolve().relative_to(self.root)
            else:
                rel = path.parent.resolve().relative_to(self.root) / path.name
        except (ValueError, RuntimeError):
            raise PathError(f"{path} is outside the workspace") from None
        return rel.as_posix() if rel.parts else "."

    # -- reads ---------------------------------------------------------------

    def read_bytes(self, path: str) -> bytes:
        key = self.key(path)
        if key in self.buffers:
            return self.buffers[key].encode("utf-8")
        return self._read_disk(key)

    def read_text(self, path: str) -> str:
        key = self.key(path)
        if key in self.buffers:
            return self.buffers[key]
        return decode_text(self._read_disk(key), key)

    def _read_disk(self, key: str) -> bytes:
        if key == ".":
            raise ToolError(f"{key} is a directory, not a file")
        try:
            with parent_dir(self.root, key) as (dir_fd, name):
                return read_regular(dir_fd, name, key)
        except (FileNotFoundError, NotADirectoryError):
            raise ToolError(f"file not found: {key}") from None
        except IsADirectoryError:
            raise ToolError(f"{key} is a directory, not a file") from None
        except PermissionError:
            raise ToolError(f"permission denied reading {key}") from None
        except OSError as e:
            raise ToolError(f"cannot read {key}: {e.strerror}") from None

    def exists(self, path: str) -> bool:
        key = self.key(path)
        return key in self.buffers or (self.root / key).exists()

    def is_dir(self, path: str) -> bool:
        return self.resolve(path).is_dir()

    def overlay(self) -> dict[str, str]:
        changed: dict[str, str] = {}
        for key, text in list(self.buffers.items()):
            try:
                on_disk = self._read_disk(key)
            except ToolError:
                changed[key] = text
                continue
            if on_disk != text.encode("utf-8", "surrogatepass"):
                changed[key] = text
        return changed

    # -- writes --------------------------------------------------------------

    async def write_text(self, path: str, text: str) -> None:
        key = self.key(path)
        self.write_disk(key, text)
        if key in self.buffers:
            self.buffers[key] = text

    async def delete(self, path: str) -> None:
        key = self.key(path, follow=False)
        self.delete_disk(key)
        self.buffers.pop(key, None)

    def write_disk(self, key: str, text: str) -> None:
        key = self.key(key)
        if key == ".":
            raise ToolError(f"{key} is a directory; cannot write it as a file")
        try:
            with parent_dir(self.root, key, create=True) as (dir_fd, name):
                _replace(dir_fd, name, key, text)
        except PermissionError:
            raise ToolError(f"permission denied writing {key}") from None
        except (NotADirectoryError, FileExistsError):
            raise ToolError(f"cannot create {key}: a parent of it is a file") from None
        except IsADirectoryError:
            raise ToolError(f"{key} is a directory; cannot write it as a file") from None
        except OSError as e:
            raise ToolError(f"cannot write {key}: {e.strerror}") from None

    def delete_disk(self, key: str) -> None:
        """Remove the entry `key` names (a symlink itself, never its target)."""
        key = self.key(key, follow=False)
        if key == ".":
            raise ToolError(f"{key} is a directory; only files are deleted")
        try:
            with parent_dir(self.root, key) as (dir_fd, name):
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    raise ToolError(f"{key} is a directory; only files are deleted")
                os.unlink(name, dir_fd=dir_fd)
        except (FileNotFoundError, NotADirectoryError):
            if key not in self.buffers:
                raise ToolError(f"file not found: {key}") from None
        except PermissionError:
            raise ToolError(f"permission denied deleting {key}") from None
        except OSError as e:
            raise ToolError(f"cannot delete {key}: {e.strerror}") from None


# -- walking -----------------------------------------------------------------


class _Ignore:
    """The .gitignore rules in force in one folder: its parent's plus its own file."""

    def __init__(self, parent: _Ignore | None, base: str, spec: pathspec.GitIgnoreSpec | None):
        self.parent = parent
        self.base = base  # workspace-relative folder the spec's patterns are relative to
        self.spec = spec

    def ignored(self, rel: str, is_dir: bool) -> bool:
        """Git's rule: the deepest .gitignore with a matching pattern decides."""
        node: _Ignore | None = self
        probe = rel + "/" if is_dir else rel
        while node is not None:
            if node.spec is not None:
                sub = probe[len(node.base) + 1 :] if node.base else probe
                verdict = node.spec.check_file(sub).include
                if verdict is not None:
                    return verdict
            node = node.parent
        return False


def _load_ignore(dir_fd: int) -> pathspec.GitIgnoreSpec | None:
    """The folder's .gitignore, if it is a regular file (as git: a symlink or FIFO is not read)."""
    try:
        data = read_regular(dir_fd, ".gitignore", ".gitignore")
    except (OSError, ToolError):
        return None
    lines = data.decode("utf-8", "replace").splitlines()
    if _IGNORE_BACKEND != "re2":
        lines = [line for line in lines if len(_STARS.findall(line)) <= _MAX_WILDCARDS]
    return pathspec.GitIgnoreSpec.from_lines(lines, backend=_IGNORE_BACKEND) if lines else None


def _ignore_backend() -> str:
    """RE2 where it is installed (a declared dependency): it matches in linear time.
    Python's `re` backtracks, so a hostile rule (`*a*a*a*a*a*a*b` against a long
    name, `a/**/a/**/a/**/b` against a deep path) held the GIL for minutes; without
    RE2, rules with more than three wildcards are dropped instead."""
    try:
        import re2  # noqa: F401
    except ImportError:
        return "simple"
    return "re2"


_IGNORE_BACKEND = _ignore_backend()
_STARS = re.compile(r"(?<!\\)\*+")
_MAX_WILDCARDS = 3


def open_dir(dir_fd: int, name: str) -> int:
    """A descriptor of the folder `name` in `dir_fd`, never through a symlink."""
    return os.open(name, _O_DIR, dir_fd=dir_fd)


def walk(root: Path, start: str = "", *, include_dirs: bool = False) -> Iterator[tuple[str, bool]]:
    """(workspace-relative path, is_dir) under `start`, depth first in name order.

    Honours every `.gitignore` from the root down (nested files included) and
    skips VCS folders. Symlinks are listed but never followed into, and those
    pointing outside the root are left out (no loops, no escape); a broken or
    looping link is listed as a plain entry. Folders are opened through
    descriptors with O_NOFOLLOW (see the module docstring), so a folder swapped
    for a symlink mid-walk is skipped, not followed.
    """
    for rel, kind in _walk_kinds(root, start, include_dirs):
        yield rel, kind == "dir"


def walk_files(root: Path, start: str = "") -> Iterator[str]:
    """Workspace-relative paths of the regular files under `start` (see `walk`):
    no FIFOs, sockets, devices or broken links, which no tool can read."""
    for rel, kind in _walk_kinds(root, start, False):
        if kind == "file":
            yield rel


def _walk_kinds(root: Path, start: str, include_dirs: bool) -> Iterator[tuple[str, str]]:
    root = root.resolve()
    start = "" if start in ("", ".") else start.strip("/")
    try:
        fd = os.open(root, _O_DIR)
    except OSError:
        return
    try:
        rules: _Ignore | None = None
        parts = start.split("/") if start else []
        for i, name in enumerate(parts):
            rules = _Ignore(rules, "/".join(parts[:i]), _load_ignore(fd))
            try:
                sub = open_dir(fd, name)
            except OSError:
                return
            os.close(fd)
            fd = sub
        rules = _Ignore(rules, start, _load_ignore(fd))
        yield from _walk(root, fd, start, rules, include_dirs)
    finally:
        os.close(fd)


def _walk(
    root: Path, dir_fd: int, rel: str, rules: _Ignore, include_dirs: bool
) -> Iterator[tuple[str, str]]:
    try:
        with os.scandir(dir_fd) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        child = f"{rel}/{entry.name}" if rel else entry.name
        kind = _entry_kind(root, child, entry)
        if kind is None:
            continue
        is_dir = kind in ("dir", "dirlink")
        if is_dir and entry.name in SKIP_DIRS:
            continue
        if rules.ignored(child, is_dir):
            continue
        if not is_dir:
            yield child, kind
            continue
        if include_dirs:
            yield child, "dir"
        if kind == "dir":
            try:
                sub = open_dir(dir_fd, entry.name)
            except OSError:  # swapped for a symlink or removed since the scan
                continue
            try:
                yield from _walk(
                    root, sub, child, _Ignore(rules, child, _load_ignore(sub)), include_dirs
                )
            finally:
                os.close(sub)


def _entry_kind(root: Path, child: str, entry: os.DirEntry[str]) -> str | None:
    """ "dir", "dirlink", "file", "other" (special file, broken or looping link), or
    None for a link that points outside the root."""
    try:
        if entry.is_symlink():
            target = os.path.realpath(root / child)
            if not Path(target).is_relative_to(root):
                return None
            try:
                st = os.stat(root / child)
            except OSError:
                return "other"  # broken, or a loop
            if stat.S_ISDIR(st.st_mode):
                return "dirlink"
            return "file" if stat.S_ISREG(st.st_mode) else "other"
        if entry.is_dir(follow_symlinks=False):
            return "dir"
        return "file" if entry.is_file(follow_symlinks=False) else "other"
    except OSError:
        return None


# -- near misses ---------------------------------------------------------------

SUGGEST_MAX = 3
SUGGEST_MAX_SCAN = 50_000  # entries walked before the search for a near miss gives up


def not_found(ws: Workspace, key: str, what: str = "file", *, otherwise: str = "") -> ToolError:
    """`{what} not found: KEY`, naming up to three paths the caller may have meant.

    Models often name a file by its base name (`test_x.py` for `tests/test_x.py`)
    or drop a leading folder (`pkg/mod.py` for `src/pkg/mod.py`), or name a package
    as a module (`pkg.py` for `src/pkg/__init__.py`). Ranked: a path that ends with
    every part of `key`, then one with the same base name or the package's
    `__init__.py`, then the same base name in another case; shorter paths first. `what` is "file",
    "directory" or "path" (either), which also says what may match. `otherwise` is
    the advice given in brackets when nothing is near."""
    near = similar_paths(ws, key, files=what != "directory", dirs=what != "file")
    if not near:
        return ToolError(f"{what} not found: {key}" + (f" ({otherwise})" if otherwise else ""))
    if len(near) == 1:
        return ToolError(f"{what} not found: {key}; did you mean {near[0]}?")
    return ToolError(f"{what} not found: {key}; did you mean one of: {', '.join(near)}?")


def similar_paths(ws: Workspace, key: str, *, files: bool = True, dirs: bool = False) -> list[str]:
    """Existing workspace files and/or folders (.gitignore respected, unsaved
    buffers included) that `key` probably meant; see `not_found`."""
    if key in (".", ""):
        return []
    tail = "/" + key
    name = key.rsplit("/", 1)[-1]
    folded = name.casefold()
    package = key[: -len(".py")] + "/__init__.py" if key.endswith(".py") else ""
    ranked: list[tuple[int, int, str]] = []
    seen: set[str] = set()

    def consider(rel: str) -> None:
        if rel in seen or rel == key:
            return
        seen.add(rel)
        base = rel.rsplit("/", 1)[-1]
        if rel.endswith(tail):
            rank = 0
        elif base == name or package and (rel == package or rel.endswith("/" + package)):
            rank = 1
        elif base.casefold() == folded:
            rank = 2
        else:
            return
        ranked.append((rank, rel.count("/"), rel))

    for i, (rel, is_dir) in enumerate(walk(ws.root, include_dirs=dirs)):
        if i >= SUGGEST_MAX_SCAN:
            break
        if dirs if is_dir else files:
            consider(rel)
    if files:
        for rel in ws.overlay():
            consider(rel)
    return [rel for _, _, rel in sorted(ranked)[:SUGGEST_MAX]]
