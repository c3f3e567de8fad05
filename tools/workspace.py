"""`LocalWorkspace`: the `Workspace` protocol over a folder on disk, with an overlay of
open editor buffers; and `walk_files`, the one `.gitignore`-aware file walk that
list_dir, glob, grep (fallback) and read_lints share.

Safety: every path a tool names goes through `resolve()`, which refuses NUL bytes,
absolute paths and anything whose real path (symlinks followed) is outside the
root. Writes are atomic (temp file in the same folder, then rename) and keep the
file's mode, so an interrupted write never leaves half a file.

The language server subclasses `LocalWorkspace` and overrides `write_text` and
`delete` for files open in the editor; `write_disk`/`delete_disk` stay available
for the on-disk part.

    ws = LocalWorkspace(Path("repo"), buffers={"src/app.py": "unsaved text"})
    ws.read_text("src/app.py")   # -> "unsaved text"
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pathspec
from opencomposer.tools.protocols import PathError, ToolError

SKIP_DIRS = frozenset({".git", ".hg", ".svn"})


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


def atomic_write(target: Path, data: bytes) -> None:
    """Write `data` to `target` through a temp file and a rename; keep an existing mode."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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

    def resolve(self, path: str) -> Path:
        if "\0" in path:
            raise PathError(f"path {path!r} contains a NUL byte")
        cleaned = path.strip()
        drive = (
            len(cleaned) > 2 and cleaned[0].isalpha() and cleaned[1] == ":" and cleaned[2] in "/\\"
        )
        if cleaned.startswith(("/", "\\", "~")) or drive:
            raise PathError(f"path {path} is absolute; use a path relative to the workspace root")
        real = (self.root / cleaned).resolve()
        if real != self.root and not real.is_relative_to(self.root):
            raise PathError(f"path {path} resolves outside the workspace; refused")
        return real

    def relative(self, path: Path) -> str:
        try:
            rel = Path(path).resolve().relative_to(self.root)
        except ValueError:
            raise PathError(f"{path} is outside the workspace") from None
        return rel.as_posix() if rel.parts else "."

    def key(self, path: str) -> str:
        """Canonical workspace-relative form of `path` (the buffers' key)."""
        return self.relative(self.resolve(path))

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
        target = self.root / key
        try:
            return target.read_bytes()
        except FileNotFoundError:
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
                on_disk = (self.root / key).read_bytes()
            except OSError:
                changed[key] = text
                continue
            if on_disk != text.encode("utf-8"):
                changed[key] = text
        return changed

    # -- writes --------------------------------------------------------------

    async def write_text(self, path: str, text: str) -> None:
        key = self.key(path)
        self.write_disk(key, text)
        if key in self.buffers:
            self.buffers[key] = text

    async def delete(self, path: str) -> None:
        key = self.key(path)
        self.delete_disk(key)
        self.buffers.pop(key, None)

    def write_disk(self, key: str, text: str) -> None:
        target = self.resolve(key)
        if target.is_dir():
            raise ToolError(f"{key} is a directory; cannot write it as a file")
        try:
            atomic_write(target, text.encode("utf-8"))
        except PermissionError:
            raise ToolError(f"permission denied writing {key}") from None
        except NotADirectoryError:
            raise ToolError(f"cannot create {key}: a parent of it is a file") from None
        except FileExistsError:
            raise ToolError(f"cannot create {key}: a parent of it is a file") from None

    def delete_disk(self, key: str) -> None:
        target = self.resolve(key)
        if target == self.root or target.is_dir():
            raise ToolError(f"{key} is a directory; delete_file removes files only")
        try:
            target.unlink()
        except FileNotFoundError:
            if key not in self.buffers:
                raise ToolError(f"file not found: {key}") from None
        except PermissionError:
            raise ToolError(f"permission denied deleting {key}") from None


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


def _load_ignore(folder: Path) -> pathspec.GitIgnoreSpec | None:
    try:
        lines = (folder / ".gitignore").read_text("utf-8", "replace").splitlines()
    except OSError:
        return None
    return pathspec.GitIgnoreSpec.from_lines(lines) if lines else None


def _ancestors_ignore(root: Path, start: str) -> _Ignore:
    """Rules from the root down to, not including, the folder `start`."""
    node = _Ignore(None, "", _load_ignore(root))
    parts = start.split("/")
    for i in range(1, len(parts)):
        base = "/".join(parts[:i])
        node = _Ignore(node, base, _load_ignore(root / base))
    return node


def walk(root: Path, start: str = "", *, include_dirs: bool = False) -> Iterator[tuple[str, bool]]:
    """(workspace-relative path, is_dir) under `start`, depth first in name order.

    Honours every `.gitignore` from the root down (nested files included) and
    skips VCS folders. Symlinks are listed but never followed into, and those
    pointing outside the root are left out (no loops, no escape).
    """
    root = root.resolve()
    start = "" if start in ("", ".") else start.strip("/")
    if start:
        rules = _Ignore(_ancestors_ignore(root, start), start, _load_ignore(root / start))
    else:
        rules = _Ignore(None, "", _load_ignore(root))
    yield from _walk(root, start, rules, include_dirs)


def _walk(root: Path, rel: str, rules: _Ignore, include_dirs: bool) -> Iterator[tuple[str, bool]]:
    try:
        entries = sorted(os.scandir(root / rel if rel else root), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        child = f"{rel}/{entry.name}" if rel else entry.name
        try:
            link = entry.is_symlink()
            if link and not Path(entry.path).resolve().is_relative_to(root):
                continue
            is_dir = entry.is_dir()
        except OSError:
            continue
        if is_dir and entry.name in SKIP_DIRS:
            continue
        if rules.ignored(child, is_dir):
            continue
        if not is_dir:
            yield child, False
            continue
        if include_dirs:
            yield child, True
        if not link:
            yield from _walk(
                root, child, _Ignore(rules, child, _load_ignore(root / child)), include_dirs
            )


def walk_files(root: Path, start: str = "") -> Iterator[str]:
    """Workspace-relative paths of the files under `start` (see `walk`)."""
    for rel, is_dir in walk(root, start):
        if not is_dir:
            yield rel
