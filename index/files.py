"""Which files of a workspace the index reads, and their text.

The walk honours every `.gitignore` (at its own level, as git does), every
`.opencomposerignore` (same syntax, for things git tracks but search should not
see), and defaults that keep noise and secrets out: VCS folders, virtualenvs,
`node_modules`, caches, build output, lock files, minified and generated files,
binaries, files over a size limit and secret files (`.env`, keys, credentials).
Every skipped file is counted by reason, so the CLI can say why a file is absent.

A workspace may be hostile (a cloned repository, a task's tarball, a model's
writes), so the index reads it the way `tools/workspace.py` does, with its own
small implementation (index/ imports nothing else of ours):

- Folders are opened one component at a time through directory descriptors
  with `O_NOFOLLOW`, from the walk and again when a file is read: a folder
  swapped for a symlink after the walk makes the read fail, never escape.
- Only regular files are read: an `lstat` first, then an `O_NOFOLLOW |
  O_NONBLOCK` open and an `fstat` of what was opened, so a FIFO, socket or
  device (there from the start, or swapped in later) is skipped and can never
  block. Ignore files are read the same way.
- Reads stop at `WalkConfig.max_file_bytes` (a file that grows after the walk is
  skipped, not loaded whole); the cap is far below the tools' `MAX_FILE_BYTES`.
- Symlinked folders are never followed (no loops, nothing outside the root). A
  symlinked file is indexed only when it names a file the walk itself indexes,
  and then that file is read: a link to `/etc/passwd`, to a secret or ignored
  file, or into `.git`, adds nothing. Broken and looping links are skipped.
- The walk stops `MAX_DEPTH` folders down. Ignore rules match through RE2
  (`google-re2`, linear time): Python's regular expressions backtrack, and
  `**/a/**/a/**/a/**/b` against a deep path took 45 s for one file. Where RE2 is
  not installed, rules with more than `MAX_WILDCARDS` wildcards are dropped instead
  (three wildcards at that depth stay under 0.1 s).
"""

from __future__ import annotations

import errno
import fnmatch
import os
import re
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pathspec

IGNORE_FILES = (".gitignore", ".opencomposerignore")
# Deeper folders are skipped ("too deep"): real trees stay far above this, and it bounds
# the descriptors a walk holds open and the length of the paths ignore rules match.
MAX_DEPTH = 64
# Ignore rules with more wildcards (runs of `*`) are dropped (see the module docstring).
MAX_WILDCARDS = 3

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _O_CLOEXEC
_O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _O_CLOEXEC

DEFAULT_DIRS = frozenset(
    {
        ".git", ".hg", ".svn", ".opencomposer", "node_modules", "__pycache__", ".venv", "venv",
        ".tox", ".nox", ".mypy_cache", ".pytest_cache", ".ruff_cache", ".eggs", "site-packages",
        "dist", "build", ".next", ".gradle", ".idea", ".cache",
    }
)  # fmt: skip

LOCK_FILES = frozenset(
    {
        "package-lock.json", "yarn.lock", "pnpm-lock.yaml", "poetry.lock", "Pipfile.lock",
        "Cargo.lock", "Gemfile.lock", "composer.lock", "uv.lock", "go.sum", "bun.lockb",
        "npm-shrinkwrap.json", "flake.lock", "pdm.lock", "mix.lock", "packages.lock.json",
    }
)  # fmt: skip

SECRET_PATTERNS = (
    ".env", ".env.*", "*.env", "*.pem", "*.key", "*.p12", "*.pfx", "*.jks", "*.keystore",
    "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*", ".netrc", ".npmrc", ".pypirc",
    ".htpasswd", "credentials*.json", "*secret*.json", "*secrets*.y*ml", ".git-credentials",
    "*.kdbx", "service-account*.json",
)  # fmt: skip

GENERATED_PATTERNS = ("*.min.js", "*.min.css", "*.min.mjs", "*.map", "*_pb2.py", "*_pb2_grpc.py", "*.pb.go", "*.pb.cc", "*.pb.h", "*.generated.*", "*.g.dart", "*.lock")  # fmt: skip

BINARY_EXTENSIONS = frozenset(
    [
        ".png",
        ".jpg",
        ".jpeg",
        ".gif",
        ".bmp",
        ".ico",
        ".webp",
        ".tiff",
        ".psd",
        ".pdf",
        ".zip",
        ".gz",
        ".tgz",
        ".bz2",
        ".xz",
        ".zst",
        ".7z",
        ".rar",
        ".tar",
        ".jar",
        ".war",
        ".whl",
        ".egg",
        ".so",
        ".dll",
        ".dylib",
        ".a",
        ".o",
        ".obj",
        ".exe",
        ".bin",
        ".class",
        ".pyc",
        ".pyo",
        ".pyd",
        ".wasm",
        ".mp3",
        ".mp4",
        ".wav",
        ".ogg",
        ".flac",
        ".avi",
        ".mov",
        ".mkv",
        ".webm",
        ".ttf",
        ".otf",
        ".woff",
        ".woff2",
        ".eot",
        ".sqlite",
        ".db",
        ".npy",
        ".npz",
        ".pt",
        ".pth",
        ".safetensors",
        ".gguf",
        ".onnx",
        ".pkl",
        ".parquet",
        ".arrow",
        ".h5",
        ".ckpt",
        ".dat",
        ".iso",
    ]
)

GENERATED_MARKERS = (
    b"@generated",
    b"DO NOT EDIT",
    b"Code generated by",
    b"autogenerated",
    b"Auto-generated",
)


@dataclass(frozen=True, kw_only=True)
class WalkConfig:
    # Larger files are skipped ("too large"), ignore files included.
    max_file_bytes: int = 1_000_000
    # Minified: long lines on average, or one very long line.
    max_avg_line_chars: int = 250
    max_line_chars: int = 5_000


@dataclass(kw_only=True)
class Walk:
    """Result of one walk: indexable files (relative POSIX path -> absolute path)."""

    files: dict[str, Path] = field(default_factory=dict)
    skipped: Counter[str] = field(default_factory=Counter)
    # (size, mtime_ns) of each file as the walk saw it (a link: of the file it names).
    stats: dict[str, tuple[int, int]] = field(default_factory=dict)
    # A symlinked file -> the indexed file it names, which is what `Reader` reads for it.
    links: dict[str, str] = field(default_factory=dict)

    def source(self, rel: str) -> str:
        """The workspace path whose bytes are `rel`'s content."""
        return self.links.get(rel, rel)


class Unreadable(Exception):
    """A listed file that cannot be read as a regular file now; `reason` is the skip reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def read_regular(dir_fd: int, name: str, limit: int) -> tuple[bytes, os.stat_result]:
    """The bytes and `fstat` of the regular file `name` in the folder `dir_fd`.

    Unreadable for anything else (a symlink, FIFO, socket or device: never opened
    in a way that can block) or for more than `limit` bytes; OSError when it is
    gone or not permitted.
    """
    before = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    _check_regular(before, limit)
    try:
        fd = os.open(name, _O_READ, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:  # swapped for a symlink since the lstat
            raise Unreadable("symlink") from None
        raise
    with open(fd, "rb", buffering=0) as f:
        st = os.fstat(fd)
        _check_regular(st, limit)
        data = f.read(limit + 1)
    if len(data) > limit:
        raise Unreadable("too large")
    return data, st


def _check_regular(st: os.stat_result, limit: int) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise Unreadable("symlink")
    if not stat.S_ISREG(st.st_mode):
        raise Unreadable("special file")
    if st.st_size > limit:
        raise Unreadable("too large")


class Reader:
    """Reads the files a walk listed, each through the descriptors of its folders.

    Every folder is opened with `O_NOFOLLOW` from the root down, so a path whose
    folder became a symlink is Unreadable("symlink"); the chain of the last file's
    folders is kept open, so sorted paths open each folder once.

        with Reader(root, limit) as reader:
            data, st = reader.read("src/app.py")
    """

    def __init__(self, root: Path, limit: int) -> None:
        self.limit = limit
        try:
            self._root = os.open(os.path.realpath(root), _O_DIR)
        except OSError:
            self._root = -1  # gone: every read is FileNotFoundError
        self._chain: list[tuple[str, int]] = []  # (folder name, descriptor), root downwards

    def read(self, rel: str) -> tuple[bytes, os.stat_result]:
        """(bytes, fstat) of the workspace file `rel`; Unreadable or OSError if it cannot be."""
        if self._root < 0:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), rel)
        *folders, name = rel.split("/")
        keep = 0
        while keep < min(len(folders), len(self._chain)) and self._chain[keep][0] == folders[keep]:
            keep += 1
        self._drop(keep)
        for part in folders[keep:]:
            parent = self._chain[-1][1] if self._chain else self._root
            try:
                fd = os.open(part, _O_DIR, dir_fd=parent)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise Unreadable("symlink") from None
                raise
            self._chain.append((part, fd))
        return read_regular(self._chain[-1][1] if self._chain else self._root, name, self.limit)

    def _drop(self, keep: int) -> None:
        while len(self._chain) > keep:
            os.close(self._chain.pop()[1])

    def close(self) -> None:
        self._drop(0)
        if self._root >= 0:
            os.close(self._root)
            self._root = -1

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _wildcards(line: str) -> int:
    """Runs of `*` in an ignore rule (`**` is one run; `\\*` is a literal star)."""
    return len(re.findall(r"(?<!\\)\*+", line))


def _load_spec(
    dir_fd: int, config: WalkConfig, skipped: Counter[str]
) -> pathspec.GitIgnoreSpec | None:
    """The folder's ignore rules. As git does, an ignore file that is not a regular
    file (a symlink, a FIFO) is not read."""
    lines: list[str] = []
    for name in IGNORE_FILES:
        try:
            data, _ = read_regular(dir_fd, name, config.max_file_bytes)
        except (OSError, Unreadable):
            continue
        for line in data.decode("utf-8", errors="replace").splitlines():
            if _BACKEND != "re2" and _wildcards(line) > MAX_WILDCARDS:
                skipped["ignore rule too complex"] += 1
            else:
                lines.append(line)
    return pathspec.GitIgnoreSpec.from_lines(lines, backend=_BACKEND) if lines else None


def _ignore_backend() -> str:
    """RE2 where it is installed (a declared dependency), else pathspec's own."""
    try:
        import re2  # noqa: F401
    except ImportError:
        return "simple"
    return "re2"


_BACKEND = _ignore_backend()


def name_skip_reason(name: str) -> str | None:
    """Why a file name alone rules a file out, or None."""
    if name in LOCK_FILES:
        return "lock file"
    if any(fnmatch.fnmatch(name, p) for p in SECRET_PATTERNS):
        return "secret"
    if os.path.splitext(name)[1].lower() in BINARY_EXTENSIONS:
        return "binary"
    if any(fnmatch.fnmatch(name, p) for p in GENERATED_PATTERNS):
        return "generated or minified"
    return None


def content_skip_reason(data: bytes, config: WalkConfig) -> str | None:
    """Why a file's bytes rule it out (binary, minified, generated), or None."""
    head = data[:8192]
    if b"\0" in head:
        return "binary"
    if any(m in data[:1024] for m in GENERATED_MARKERS):
        return "generated or minified"
    lines = data.count(b"\n") + 1
    if len(data) > 2000 and (
        len(data) / lines > config.max_avg_line_chars
        or max(map(len, data.split(b"\n", 50)[:50])) > config.max_line_chars
    ):
        return "generated or minified"
    return None


def decode(data: bytes) -> str | None:
    """UTF-8 text; a few bad bytes become U+FFFD, mostly-undecodable data is None."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        return text if text.count("\ufffd") <= max(8, len(text) // 100) else None


def walk(root: Path, config: WalkConfig | None = None) -> Walk:
    """All indexable files under root, gitignore-style rules applied per folder."""
    config = config or WalkConfig()
    out = Walk()
    real_root = os.path.realpath(root)
    # Each entry: (folder relative to root, spec); a spec matches paths relative to its folder.
    specs: list[tuple[str, pathspec.GitIgnoreSpec]] = []
    symlinks: list[str] = []

    def ignored(rel: str, is_dir: bool) -> bool:
        for base, spec in specs:
            if base and not rel.startswith(base + "/"):
                continue
            sub = rel[len(base) + 1 :] if base else rel
            if spec.match_file(sub + "/" if is_dir else sub):
                return True
        return False

    def visit(dir_fd: int, rel_folder: str, depth: int) -> None:
        spec = _load_spec(dir_fd, config, out.skipped)
        if spec is not None:
            specs.append((rel_folder, spec))
        try:
            with os.scandir(dir_fd) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            out.skipped["unreadable"] += 1
            entries = []
        for entry in entries:
            rel = f"{rel_folder}/{entry.name}" if rel_folder else entry.name
            try:
                is_link = entry.is_symlink()
                is_dir = entry.is_dir(follow_symlinks=False)
                is_file = entry.is_file(follow_symlinks=False)
            except OSError:
                continue
            if is_dir:
                if entry.name in DEFAULT_DIRS or entry.name.endswith(".egg-info"):
                    continue
                if ignored(rel, True):
                    continue
                if depth >= MAX_DEPTH:
                    out.skipped["too deep"] += 1
                    continue
                _visit_folder(dir_fd, entry.name, rel, depth + 1)
                continue
            if is_link:
                if not ignored(rel, False):
                    symlinks.append(rel)
                continue
            if not is_file:
                out.skipped["special file"] += 1  # FIFO, socket, device
                continue
            if ignored(rel, False):
                continue
            reason = name_skip_reason(entry.name)
            if reason is None:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    reason = "unreadable"
                else:
                    if not stat.S_ISREG(st.st_mode):
                        reason = "special file"
                    elif st.st_size > config.max_file_bytes:
                        reason = "too large"
            if reason:
                out.skipped[reason] += 1
                continue
            out.files[rel] = Path(real_root, rel)
            out.stats[rel] = (st.st_size, st.st_mtime_ns)
        if spec is not None:
            specs.pop()

    def _visit_folder(parent_fd: int, name: str, rel: str, depth: int) -> None:
        try:
            fd = os.open(name, _O_DIR, dir_fd=parent_fd)
        except OSError:  # swapped for a symlink or removed since the scan
            out.skipped["unreadable"] += 1
            return
        try:
            if _exists(fd, "pyvenv.cfg"):
                return  # a virtualenv under any name
            visit(fd, rel, depth)
        finally:
            os.close(fd)

    try:
        root_fd = os.open(real_root, _O_DIR)
    except OSError:
        out.skipped["unreadable"] += 1
        return out
    try:
        visit(root_fd, "", 0)
    finally:
        os.close(root_fd)
    regular = frozenset(out.files)
    for rel in symlinks:
        target = _link_target(real_root, rel)
        if target is None or target not in regular:
            out.skipped["symlink"] += 1
            continue
        out.files[rel] = Path(real_root, rel)
        out.stats[rel] = out.stats[target]
        out.links[rel] = target
    return out


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return True


def _link_target(real_root: str, rel: str) -> str | None:
    """The workspace path a symlink resolves to, or None (outside the root, a loop, broken)."""
    try:
        target = os.path.realpath(os.path.join(real_root, rel))
    except OSError:
        return None
    if not target.startswith(real_root.rstrip("/") + "/"):
        return None
    return target[len(real_root.rstrip("/")) + 1 :]
