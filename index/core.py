"""`CodebaseIndex`: the persistent, incremental hybrid index behind `codebase_search`.

Storage is one SQLite database in `<workspace>/.opencomposer/index/index.db`
(WAL mode, so readers never see a half-written update):

- `files`   path -> content hash, size, mtime (the Merkle tree's leaves),
- `chunks`  one row per chunk (path, line span, symbol, scope, text, vector key),
- `vectors` vector key (hash of the embedded text) -> float16 vector, so a chunk
  whose text did not change is never embedded again, even when its lines moved,
- `lex`     an FTS5 table of identifier-split terms (BM25),
- `meta`    format version, embedder identity, chunker settings, a generation
  counter that tells other processes to reload.

Vectors live in FAISS in memory, rebuilt from `vectors` at open: an exact
`IndexFlatIP` up to `FLAT_MAX` chunks, an `IndexIVFFlat` beyond (both remove ids
correctly, unlike HNSW). A query runs both retrievers and fuses their ranks
(reciprocal-rank fusion, `RRF_K`, lexical weight `LEXICAL_WEIGHT`); the
benchmark `benchmarks/retrieval.py` measures fusion against each alone.

Writers hold an exclusive `flock` on `.opencomposer/index/lock`, so two indexers
never interleave; the second waits and then finds nothing left to do. A
database that fails SQLite's integrity check or the index's own (every chunk
has a vector, all of one size and the embedder's; the lexical rows are the
chunks'), or was written by another format version or embedder, is deleted and
rebuilt from disk with a one-line warning, at open or whenever a later call
meets the damage. The index folder must be a real folder inside the workspace
(`index_dir`), and whatever a workspace put where the index's own files go (a
FIFO, a folder, a symlink) is removed before anything opens it.

Thread safety: every public method takes one re-entrant lock, so the language
server may call them from `asyncio.to_thread` concurrently.
"""

from __future__ import annotations

import fcntl
import fnmatch
import io
import json
import logging
import os
import shutil
import sqlite3
import stat
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .chunking import Chunk, ChunkConfig, chunk_text
from .embed import Embedder, EmbedderConfig
from .files import (
    Reader,
    Unreadable,
    WalkConfig,
    content_skip_reason,
    decode,
    name_skip_reason,
    walk,
)
from .lexical import FTS_TOKENIZER, document, fts_query, split_identifier
from .merkle import Tree, content_hash, diff

log = logging.getLogger("opencomposer.index")
_T = TypeVar("_T")

FORMAT_VERSION = 4
INDEX_DIR = Path(".opencomposer") / "index"
FLAT_MAX = 150_000
# Small k trusts the top of each list; 5 beat the textbook 60 by +0.02 MRR@10 (retrieval.py).
RRF_K = 5
LEXICAL_WEIGHT = 1.0
CANDIDATES = 50
# Files whose mtime is this recent may still change within the same mtime tick.
RACY_S = 2.0
LOCK_WAIT_S = 600.0

# progress(phase, done, total): phase is "scan", "embed" or "save".
Progress = Callable[[str, int, int], None]


class IndexProblem(Exception):
    """A problem the user can act on (one line)."""


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:120]


def _damage(e: BaseException) -> str:
    """One line naming what is wrong with a damaged database."""
    return f"corrupt ({_first_line(e)})"


# SQLite result codes that say the database is busy, read-only, full or out of memory:
# nothing is wrong with it, so it must not be deleted and rebuilt.
_TRANSIENT = frozenset(
    {5, 6, 7, 8, 9, 10, 13, 14, 23}
)  # BUSY LOCKED NOMEM READONLY INTERRUPT IOERR FULL CANTOPEN AUTH


def _check_transient(e: BaseException, where: Path) -> None:
    """IndexProblem (one line) for an SQLite error that is not damage."""
    code = getattr(e, "sqlite_errorcode", None)
    if code is not None and code & 0xFF in _TRANSIENT:
        raise IndexProblem(f"the index at {where} is unavailable: {_first_line(e)}") from None


class _Corrupt(Exception):
    """The stored index contradicts itself (what SQLite's own checks cannot see)."""


# What a damaged database raises on the way in or out; the index is rebuilt on any of them.
_DAMAGE = (sqlite3.DatabaseError, _Corrupt)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# The files SQLite and the writer lock keep in the index folder.
_OWN_FILES = ("index.db", "index.db-wal", "index.db-shm", "index.db-journal", "lock", ".gitignore")


def index_dir(root: Path) -> Path:
    """`root`'s index folder, made if missing; IndexProblem if it is not a real folder.

    A hostile workspace may make `.opencomposer` a symlink (the index would then
    be written outside it) or put a FIFO, a folder or a symlink where the
    database or lock goes (an open would block, fail, or follow the link out).
    The folders must be real folders under the root; inside the index folder,
    which is ours, any of our files that is not a regular file is removed.
    SQLite opens the database by path, so this is a check before the open, not a
    guarantee against a process swapping the file in between.
    """
    path = Path(root)
    for part in INDEX_DIR.parts:
        path = path / part
        try:
            os.mkdir(path)
        except FileExistsError:
            pass
        except OSError as e:
            raise IndexProblem(f"cannot create the index folder {path}: {e.strerror}") from None
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a folder"
            raise IndexProblem(
                f"{path} is {what}; the index is kept only in a real folder inside the workspace"
            )
    for name in _OWN_FILES:
        own = path / name
        try:
            st = os.lstat(own)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            continue
        log.warning("opencomposer: %s is not a regular file; removing it", own)
        try:
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(own)
            else:
                os.unlink(own)
        except OSError as e:
            raise IndexProblem(f"cannot remove {own}: {e.strerror}") from None
    try:  # keep the index out of the user's commits
        fd = os.open(
            path / ".gitignore", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _O_CLOEXEC
        )
    except OSError:
        pass  # there already, or a read-only workspace
    else:
        with open(fd, "w") as f:
            f.write("*\n")
    return path


@dataclass(frozen=True, kw_only=True)
class Hit:
    path: str
    start_line: int
    end_line: int
    score: float
    text: str = ""
    symbol: str = ""
    scope: str = ""


@dataclass(kw_only=True)
class IndexStats:
    files: int = 0
    chunks: int = 0
    files_changed: int = 0
    files_removed: int = 0
    chunks_embedded: int = 0
    seconds: float = 0.0
    embed_seconds: float = 0.0
    # Loading the embedding model (once per process); not part of the rate.
    load_seconds: float = 0.0
    skipped: dict[str, int] = field(default_factory=dict)
    # Where the time went: scan (walk, stat, hash), chunk (tree-sitter), embed, store
    # (SQLite rows and the lexical index, one transaction per ~1,000 chunks), faiss.
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def chunks_per_s(self) -> float:
        busy = self.seconds - self.load_seconds
        return self.chunks_embedded / busy if busy > 0 else 0.0


def embed_text(chunk: Chunk) -> str:
    """What the embedder sees: the symbol and scope as words, the path, the enclosing header, the code.

    Spelling `split_before` as "split before" first gave MiniLM (a model of
    English) +0.02 MRR@10 on its own in benchmarks/retrieval.py.
    """
    name = " ".join(split_identifier(chunk.symbol)) if chunk.symbol else ""
    scope = f"(in {' '.join(split_identifier(chunk.scope))})" if chunk.scope else ""
    head = " ".join(x for x in (name, scope, "-", chunk.path) if x)
    context = chunk.context.splitlines()[-1].strip() if chunk.context else ""
    return f"{head}\n{context}\n{chunk.text}" if context else f"{head}\n{chunk.text}"


def lexical_names(chunk: Chunk) -> str:
    return document(f"{chunk.path} {chunk.scope} {chunk.symbol}")


_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS files (path TEXT PRIMARY KEY, hash TEXT NOT NULL,
    size INTEGER NOT NULL, mtime_ns INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS chunks (id INTEGER PRIMARY KEY, path TEXT NOT NULL,
    start_line INTEGER NOT NULL, end_line INTEGER NOT NULL, symbol TEXT NOT NULL,
    scope TEXT NOT NULL, text TEXT NOT NULL, vkey TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS chunks_path ON chunks(path);
CREATE INDEX IF NOT EXISTS chunks_vkey ON chunks(vkey);
CREATE TABLE IF NOT EXISTS vectors (vkey TEXT PRIMARY KEY, vec BLOB NOT NULL);
CREATE VIRTUAL TABLE IF NOT EXISTS lex USING fts5(names, body, tokenize="{FTS_TOKENIZER}");
"""


class CodebaseIndex:
    """Hybrid (FAISS + BM25) index of one workspace, persisted under `.opencomposer/index/`."""

    def __init__(self, root: Path, embedder: Embedder, progress: Progress | None = None):
        self.root = root
        self.dir = root / INDEX_DIR
        self.embedder = embedder
        self.progress = progress
        self.chunk_config = ChunkConfig()
        self.walk_config = WalkConfig()
        self._lock = threading.RLock()
        self._writing = False  # this object holds the flock (under self._lock)
        self._buffers: dict[str, str] = {}
        self._db: sqlite3.Connection | None = None
        self._generation = -1
        self._meta: dict[int, tuple[str, int, int, str]] = {}
        self._vectors: Any = None  # faiss index
        self._tree = Tree.build({})
        self._query_cache: dict[str, np.ndarray] = {}
        self._orphans: set[str] = set()
        self._phases: Counter[str] = Counter()

    # -- life cycle ------------------------------------------------------------

    @classmethod
    def open(
        cls,
        root: Path,
        *,
        embedder: str | None = None,
        progress: Callable | None = None,
    ) -> CodebaseIndex:
        """Load the index of root (or create an empty one); call `refresh()` to build it."""
        root = Path(root).expanduser().resolve()
        if not root.is_dir():
            raise IndexProblem(f"workspace {root} is not a folder")
        index = cls(root, Embedder(EmbedderConfig.resolve(embedder)), progress)
        with index._lock:
            index._connect()
        return index

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def __enter__(self) -> CodebaseIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def db_path(self) -> Path:
        return self.dir / "index.db"

    def _expected_meta(self) -> dict[str, str]:
        return {
            "format_version": str(FORMAT_VERSION),
            "embedder": self.embedder.config.key,
            "chunker": json.dumps(asdict(self.chunk_config), sort_keys=True),
        }

    def _connect(self) -> None:
        """Open the database; a corrupt or stale one is replaced (one-line warning)."""
        index_dir(self.root)
        problem = self._try_open()
        if problem is None:
            return
        with self._writer():
            problem = self._try_open()  # another process may have rebuilt it meanwhile
            if problem is None:
                return
            self._rebuild(problem)

    def _rebuild(self, problem: str) -> None:
        """Replace the database with an empty one (under the writer lock); the next
        `_refresh` fills it."""
        log.warning("opencomposer: index at %s is %s; rebuilding it", self.dir, problem)
        if self._db is not None:
            self._db.close()
            self._db = None
        self._discard()
        if (again := self._try_open()) is not None:
            raise IndexProblem(f"cannot create the index at {self.db_path}: {again}")

    def _try_open(self) -> str | None:
        if self._db is not None:
            self._db.close()
            self._db = None
        try:
            fresh = os.lstat(self.db_path).st_size == 0
        except FileNotFoundError:
            fresh = True
        try:
            db = sqlite3.connect(self.db_path, check_same_thread=False, timeout=30.0)
        except sqlite3.Error as e:
            return f"unreadable ({e})"
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            if not fresh:
                check = db.execute("PRAGMA quick_check").fetchone()
                if not check or check[0] != "ok":
                    raise sqlite3.DatabaseError(f"integrity check failed: {check}")
                stored = dict(db.execute("SELECT key, value FROM meta").fetchall())
                for key, want in self._expected_meta().items():
                    if stored.get(key) != want:
                        db.close()
                        return f"stale ({key} changed)"
            db.executescript(_SCHEMA)
            if fresh:
                with db:
                    db.executemany(
                        "INSERT OR REPLACE INTO meta VALUES (?, ?)",
                        [*self._expected_meta().items(), ("generation", "0")],
                    )
            self._db = db
            self._load_memory()
        except (*_DAMAGE, ValueError, TypeError) as e:
            db.close()
            self._db = None
            _check_transient(e, self.dir)
            return _damage(e)
        return None

    def _discard(self) -> None:
        for suffix in ("", "-wal", "-shm", "-journal"):
            path = str(self.db_path) + suffix
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise IndexProblem(
                    f"cannot remove the damaged index {path}: {e.strerror}"
                ) from None

    @contextmanager
    def _writer(self) -> Iterator[None]:
        """Exclusive across processes (flock) and threads (RLock); re-entrant."""
        with self._lock:
            if self._writing:
                yield
                return
            with self._locked():
                self._writing = True
                try:
                    yield
                finally:
                    self._writing = False

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock_file() as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.warning("opencomposer: another process is updating %s; waiting", self.dir)
                deadline = time.monotonic() + LOCK_WAIT_S
                while True:
                    time.sleep(0.05)
                    try:
                        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            raise IndexProblem(
                                f"index at {self.dir} stayed locked for {LOCK_WAIT_S:.0f} s"
                            ) from None
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _lock_file(self) -> io.FileIO:
        """The lock file, opened so that whatever a workspace put there never blocks or is followed."""
        index_dir(self.root)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | _O_CLOEXEC
        try:
            fd = os.open(self.dir / "lock", flags, 0o644)
        except OSError as e:
            raise IndexProblem(
                f"cannot open the index lock {self.dir / 'lock'}: {e.strerror}"
            ) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise IndexProblem(f"{self.dir / 'lock'} is not a regular file")
        return io.FileIO(fd, "r+")

    # -- memory state ------------------------------------------------------------

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise IndexProblem("index is closed")
        return self._db

    def _stored_generation(self) -> int:
        row = self.db.execute("SELECT value FROM meta WHERE key='generation'").fetchone()
        return int(row[0]) if row else 0

    def _load_memory(self) -> None:
        """Chunk metadata, the FAISS index and the Merkle tree from the database."""
        db = self.db
        self._generation = self._stored_generation()
        self._meta = {
            row[0]: (sys.intern(row[1]), row[2], row[3], row[4])
            for row in db.execute("SELECT id, path, start_line, end_line, symbol FROM chunks")
        }
        rows = db.execute(
            "SELECT c.id, v.vec FROM chunks c JOIN vectors v ON v.vkey = c.vkey"
        ).fetchall()
        if len(rows) != len(self._meta):
            raise _Corrupt(f"{len(self._meta) - len(rows)} chunks have no vector")
        if len({len(r[1]) for r in rows}) > 1 or (rows and len(rows[0][1]) % 2):
            raise _Corrupt("stored vectors differ in length")
        # FTS5's own row count (a shadow table: no scan); lexical rows must be the chunks'.
        if db.execute("SELECT count(*) FROM lex_docsize").fetchone()[0] != len(self._meta):
            raise _Corrupt("the lexical index and the chunks disagree")
        ids = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
        vecs = (
            np.frombuffer(b"".join(r[1] for r in rows), dtype=np.float16)
            .reshape(len(rows), -1)
            .astype(np.float32)
            if rows
            else np.zeros((0, 0), np.float32)
        )
        self._vectors = _vector_index(vecs, ids, self._dim_or(vecs))
        self._tree = Tree.build(dict(db.execute("SELECT path, hash FROM files").fetchall()))

    def _dim_or(self, vecs: np.ndarray) -> int:
        if vecs.size:
            return int(vecs.shape[1])
        return self.embedder.dim

    def _reload_if_changed(self) -> None:
        try:
            if self._stored_generation() != self._generation:
                self._load_memory()
        except (ValueError, TypeError) as e:
            raise _Corrupt(str(e)) from None

    def _check_dim(self, vecs: np.ndarray) -> None:
        """Vectors from the embedder must fit the stored ones (a damaged store may not)."""
        if vecs.ndim != 2 or vecs.shape[1] != self._vectors.d:
            raise _Corrupt(
                f"stored vectors have {self._vectors.d} dimensions, the embedder gives {vecs.shape[-1]}"
            )

    # -- building ------------------------------------------------------------------

    def refresh(self) -> IndexStats:
        """Bring the index up to date with disk (and open buffers); embed only what changed."""
        t0 = time.perf_counter()
        with self._writer():
            stats = self._repairing(self._refresh, then=lambda rebuilt: rebuilt)
        stats.seconds = time.perf_counter() - t0
        return stats

    def _repairing(self, work: Callable[[], _T], *, then: Callable[[IndexStats], _T]) -> _T:
        """`work()`; if the database turns out damaged, rebuild it from disk and
        return `then(stats of the rebuild)`.

        Every public method goes through here, so a database damaged while open, or
        in ways its integrity check cannot see, is rebuilt with one warning; a
        second failure is one IndexProblem line, never a traceback.
        """
        with self._lock:
            try:
                return work()
            except _DAMAGE as e:
                _check_transient(e, self.dir)
                problem = _damage(e)
            with self._writer():
                self._rebuild(problem)
                try:
                    return then(self._refresh())
                except _DAMAGE as e:
                    raise IndexProblem(
                        f"the index at {self.dir} is unusable even rebuilt: {_damage(e)}"
                    ) from None

    def _refresh(self) -> IndexStats:
        t_scan = time.perf_counter()
        self._phases: Counter[str] = Counter()
        self._reload_if_changed()
        found = walk(self.root, self.walk_config)
        skipped: Counter[str] = Counter(found.skipped)
        stored = {
            row[0]: (row[1], row[2], row[3])
            for row in self.db.execute("SELECT path, hash, size, mtime_ns FROM files")
        }
        hashes: dict[str, str] = {}
        texts: dict[str, str] = {}
        stats_of: dict[str, tuple[int, int]] = {}
        racy = time.time_ns() - int(RACY_S * 1e9)
        paths = sorted(set(found.files) | set(self._buffers))
        with Reader(self.root, self.walk_config.max_file_bytes) as reader:
            for i, rel in enumerate(paths):
                if self.progress and i % 200 == 0:
                    self.progress("scan", i, len(paths))
                if rel in self._buffers:
                    texts[rel] = self._buffers[rel]
                    hashes[rel] = content_hash(texts[rel].encode("utf-8", errors="replace"))
                    stats_of[rel] = (-1, -1)
                    continue
                size, mtime_ns = found.stats[rel]
                old = stored.get(rel)
                if old is not None and old[1] == size and old[2] == mtime_ns:
                    hashes[rel] = old[0]
                    stats_of[rel] = (size, mtime_ns)
                    continue
                try:
                    data, st = reader.read(found.source(rel))
                except Unreadable as e:  # became a symlink, FIFO or huge file since the walk
                    skipped[e.reason] += 1
                    continue
                except OSError:
                    skipped["vanished"] += 1
                    continue
                reason = content_skip_reason(data, self.walk_config)
                text = decode(data) if reason is None else None
                if text is None:
                    skipped[reason or "not UTF-8"] += 1
                    continue
                hashes[rel] = content_hash(data)
                texts[rel] = text
                # A file written within the mtime tick may change again unseen: re-read it next time.
                stats_of[rel] = (st.st_size, st.st_mtime_ns if st.st_mtime_ns < racy else -1)
        new_tree = Tree.build(hashes)
        changes = diff(self._tree, new_tree)
        # Files whose stat changed but content did not: refresh the stat cache only.
        restat = [
            (stats_of[p][0], stats_of[p][1], p)
            for p in hashes
            if p in stored and stored[p][0] == hashes[p] and stored[p][1:] != stats_of[p]
        ]
        stats = IndexStats(skipped=dict(skipped))
        self._phases["scan"] += time.perf_counter() - t_scan
        todo = changes.added + changes.changed
        if todo:
            t_load = time.perf_counter()
            _ = self.embedder.model  # loaded once per process; timed apart from the build
            stats.load_seconds = time.perf_counter() - t_load
        t_chunk = time.perf_counter()
        chunks_by_file = {p: chunk_text(p, texts[p], self.chunk_config) for p in todo}
        self._phases["chunk"] += time.perf_counter() - t_chunk
        embedded, embed_s = self._write(
            chunks_by_file,
            removed=changes.removed,
            file_rows={p: (hashes[p], *stats_of[p]) for p in todo},
            restat=restat,
        )
        self._tree = new_tree
        stats.files = len(hashes)
        stats.chunks = len(self._meta)
        stats.files_changed = len(todo)
        stats.files_removed = len(changes.removed)
        stats.chunks_embedded = embedded
        stats.embed_seconds = embed_s
        stats.phases = {k: round(v, 3) for k, v in self._phases.items()}
        return stats

    def _write(
        self,
        chunks_by_file: dict[str, list[Chunk]],
        *,
        removed: list[str],
        file_rows: dict[str, tuple[str, int, int]],
        restat: list[tuple[int, int, str]] | None = None,
    ) -> tuple[int, float]:
        """Replace the chunks of the given files; embed vectors not already stored.

        Work is committed in batches of files, so an interrupted build keeps
        what it finished. Returns (chunks embedded, seconds spent embedding).
        """
        db = self.db
        if removed or restat:
            with db:
                for path in removed:
                    self._delete_path_rows(path)
                db.executemany("DELETE FROM files WHERE path = ?", [(p,) for p in removed])
                if restat:
                    db.executemany("UPDATE files SET size=?, mtime_ns=? WHERE path=?", restat)
                self._bump_generation()
        files = list(chunks_by_file)
        total = sum(len(c) for c in chunks_by_file.values())
        done = embedded = 0
        embed_s = 0.0
        batch: list[str] = []
        batch_chunks = 0
        for n, path in enumerate(files):
            batch.append(path)
            batch_chunks += len(chunks_by_file[path])
            if batch_chunks < 1024 and n + 1 < len(files):
                continue
            items = [(p, c, embed_text(c)) for p in batch for c in chunks_by_file[p]]
            keys = [content_hash(t.encode("utf-8", errors="replace")) for _, _, t in items]
            have = self._existing_keys(set(keys))
            need: dict[str, str] = {}
            for key, (_, _, t) in zip(keys, items, strict=True):
                if key not in have:
                    need.setdefault(key, t)
            t0 = time.perf_counter()
            vecs = self._embed_with_progress(list(need.values()), done, total)
            self._check_dim(vecs)
            embed_s += time.perf_counter() - t0
            self._phases["embed"] += time.perf_counter() - t0
            embedded += len(need)
            t_store = time.perf_counter()
            with db:
                db.executemany(
                    "INSERT OR REPLACE INTO vectors VALUES (?, ?)",
                    [(k, v.astype(np.float16).tobytes()) for k, v in zip(need, vecs, strict=True)],
                )
                for path in batch:
                    self._delete_path_rows(path)
                new_ids: list[int] = []
                for (path, c, _), key in zip(items, keys, strict=True):
                    cur = db.execute(
                        "INSERT INTO chunks (path, start_line, end_line, symbol, scope, text, vkey)"
                        " VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (path, c.start_line, c.end_line, c.symbol, c.scope, c.text, key),
                    )
                    cid = int(cur.lastrowid or 0)
                    new_ids.append(cid)
                    db.execute(
                        "INSERT INTO lex (rowid, names, body) VALUES (?, ?, ?)",
                        (cid, lexical_names(c), document(c.text)),
                    )
                    self._meta[cid] = (sys.intern(path), c.start_line, c.end_line, c.symbol)
                db.executemany(
                    "INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?)",
                    [(p, *file_rows[p]) for p in batch],
                )
                self._bump_generation()
            t_faiss = time.perf_counter()
            self._phases["store"] += t_faiss - t_store
            all_vecs = self._vectors_for(keys, need, vecs)
            if new_ids:
                self._vectors.add_with_ids(all_vecs, np.array(new_ids, dtype=np.int64))
            self._phases["faiss"] += time.perf_counter() - t_faiss
            done += len(items)
            batch, batch_chunks = [], 0
        if self._orphans:
            # Vectors no chunk uses any more; only the keys of deleted rows are candidates.
            with db:
                db.executemany(
                    "DELETE FROM vectors WHERE vkey = ? AND NOT EXISTS"
                    " (SELECT 1 FROM chunks WHERE chunks.vkey = vectors.vkey)",
                    [(k,) for k in self._orphans],
                )
            self._orphans.clear()
        if self.progress and total:
            self.progress("embed", total, total)
        return embedded, embed_s

    def _existing_keys(self, keys: set[str]) -> set[str]:
        have: set[str] = set()
        listed = list(keys)
        for i in range(0, len(listed), 500):
            part = listed[i : i + 500]
            q = f"SELECT vkey FROM vectors WHERE vkey IN ({','.join('?' * len(part))})"
            have.update(r[0] for r in self.db.execute(q, part))
        return have

    def _vectors_for(self, keys: list[str], need: dict[str, str], vecs: np.ndarray) -> np.ndarray:
        fresh = dict(zip(need, vecs, strict=True))
        missing = [k for k in set(keys) if k not in fresh]
        for i in range(0, len(missing), 500):
            part = missing[i : i + 500]
            q = f"SELECT vkey, vec FROM vectors WHERE vkey IN ({','.join('?' * len(part))})"
            for k, blob in self.db.execute(q, part):
                fresh[k] = np.frombuffer(blob, dtype=np.float16).astype(np.float32)
        if not keys:
            return np.zeros((0, self._vectors.d), np.float32)
        return np.stack([fresh[k] for k in keys]).astype(np.float32)

    def _embed_with_progress(self, texts: list[str], done: int, total: int) -> np.ndarray:
        """All texts in one length-sorted pass (least padding), reporting progress per batch."""
        if not texts:
            return np.zeros((0, self._vectors.d), np.float32)
        report = None
        if self.progress:
            progress = self.progress
            report = lambda n: progress("embed", min(total, done + n), total)  # noqa: E731
        return self.embedder.encode(texts, progress=report)

    def _delete_path_rows(self, path: str) -> None:
        rows = self.db.execute("SELECT id, vkey FROM chunks WHERE path = ?", (path,)).fetchall()
        if not rows:
            return
        ids = [r[0] for r in rows]
        self._orphans.update(r[1] for r in rows)
        self.db.executemany("DELETE FROM lex WHERE rowid = ?", [(i,) for i in ids])
        self.db.execute("DELETE FROM chunks WHERE path = ?", (path,))
        self._vectors.remove_ids(np.array(ids, dtype=np.int64))
        for i in ids:
            self._meta.pop(i, None)

    def _bump_generation(self) -> None:
        self._generation = self._stored_generation() + 1
        self.db.execute(
            "INSERT OR REPLACE INTO meta VALUES ('generation', ?)", (str(self._generation),)
        )

    # -- the language server's view --------------------------------------------------

    def update_buffer(self, path: str, text: str) -> IndexStats:
        """Index an open editor buffer's text for path (didChange / didSave).

        Re-chunks that one file and embeds only chunks whose text is new. The
        buffer wins over disk in later refreshes until `drop_buffer(path)`.
        """
        t0 = time.perf_counter()
        rel = self._relative(path)
        if name_skip_reason(rel.rsplit("/", 1)[-1]) is not None:
            return IndexStats()

        def run() -> IndexStats:
            self._reload_if_changed()
            chunks = chunk_text(rel, text, self.chunk_config)
            h = content_hash(text.encode("utf-8", errors="replace"))
            embedded, embed_s = self._write({rel: chunks}, removed=[], file_rows={rel: (h, -1, -1)})
            files = dict(self._tree.files)
            files[rel] = h
            self._tree = Tree.build(files)
            return IndexStats(
                files=1, chunks=len(self._meta), files_changed=1, chunks_embedded=embedded,
                seconds=time.perf_counter() - t0, embed_seconds=embed_s,
            )  # fmt: skip

        with self._writer():
            self._buffers[rel] = text  # a rebuild indexes it too
            return self._repairing(run, then=lambda rebuilt: rebuilt)

    def drop_buffer(self, path: str) -> None:
        """The editor closed path: disk is the truth again from the next refresh."""
        with self._lock:
            self._buffers.pop(self._relative(path), None)

    def remove(self, path: str) -> None:
        """Forget a file, or every file under a folder."""
        rel = self._relative(path)

        def run() -> None:
            self._reload_if_changed()
            prefix = rel.rstrip("/") + "/"
            gone = [p for p in self._tree.files if p == rel or p.startswith(prefix)]
            self._write({}, removed=gone, file_rows={})
            self._tree = Tree.build({p: h for p, h in self._tree.files.items() if p not in gone})

        with self._writer():
            self._buffers.pop(rel, None)
            self._repairing(run, then=lambda _: run())

    def _relative(self, path: str | Path) -> str:
        p = Path(path)
        if p.is_absolute():
            try:
                p = p.resolve().relative_to(self.root)
            except ValueError:
                raise IndexProblem(f"{path} is outside the workspace {self.root}") from None
        rel = p.as_posix()
        while rel.startswith("./"):
            rel = rel[2:]
        if rel == ".." or rel.startswith("../") or "/../" in rel:
            raise IndexProblem(f"{path} is outside the workspace {self.root}")
        return rel

    # -- search ----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._meta)

    def search(self, query: str, *, k: int = 10, path: str | None = None) -> list[Hit]:
        """The k best chunks for query, fused from vector and lexical ranks; path: prefix or glob."""

        def run() -> list[Hit]:
            return self._search(query, k, path)

        return self._repairing(run, then=lambda _: run())

    def _search(self, query: str, k: int, path: str | None) -> list[Hit]:
        with self._lock:
            self._reload_if_changed()
            if not query.strip() or not self._meta or k <= 0:
                return []
            allowed = self._allowed_ids(path)
            if allowed is not None and not len(allowed):
                return []
            dense = self.dense_search(query, n=max(CANDIDATES, k), allowed=allowed)
            lexical = self.lexical_search(query, n=max(CANDIDATES, k), allowed=allowed)
            fused: dict[int, float] = {}
            for rank, cid in enumerate(dense):
                fused[cid] = fused.get(cid, 0.0) + 1.0 / (RRF_K + rank + 1)
            for rank, cid in enumerate(lexical):
                fused[cid] = fused.get(cid, 0.0) + LEXICAL_WEIGHT / (RRF_K + rank + 1)
            best = sorted(fused.items(), key=lambda kv: -kv[1])[:k]
            return self._hits(best)

    def _allowed_ids(self, path: str | None) -> np.ndarray | None:
        if not path or path.strip() in (".", "./", "/"):
            return None
        p = path.strip()
        p = p[2:] if p.startswith("./") else p
        if any(ch in p for ch in "*?["):
            keep = [i for i, m in self._meta.items() if fnmatch.fnmatch(m[0], p)]
        else:
            prefix = p.rstrip("/") + "/"
            bare = p.rstrip("/")
            keep = [i for i, m in self._meta.items() if m[0] == bare or m[0].startswith(prefix)]
        return np.array(keep, dtype=np.int64)

    def dense_search(self, query: str, *, n: int, allowed: np.ndarray | None = None) -> list[int]:
        import faiss

        if n <= 0 or not self._meta:
            return []
        qv = self._query_vector(query[:4000])
        self._check_dim(qv)
        params = None
        if allowed is not None:
            sel = faiss.IDSelectorBatch(allowed)
            params = (
                faiss.SearchParametersIVF(sel=sel, nprobe=self._vectors.nprobe)
                if isinstance(self._vectors, faiss.IndexIVF)
                else faiss.SearchParameters(sel=sel)
            )
        # One query: OpenMP threads only wait on each other (measured at 112k vectors on a
        # busy 2-core machine: 16 ms on one thread, 100 ms on two).
        threads = faiss.omp_get_max_threads()
        faiss.omp_set_num_threads(1)
        try:
            _, ids = self._vectors.search(qv, min(n, len(self._meta)), params=params)
        finally:
            faiss.omp_set_num_threads(threads)
        return [int(i) for i in ids[0] if i >= 0]

    def _query_vector(self, query: str) -> np.ndarray:
        """[1, dim]; recent queries are cached (agents repeat themselves)."""
        qv = self._query_cache.pop(query, None)
        if qv is None:
            qv = self.embedder.encode([query])
        self._query_cache[query] = qv
        while len(self._query_cache) > 128:
            self._query_cache.pop(next(iter(self._query_cache)))
        return qv

    def lexical_search(self, query: str, *, n: int, allowed: np.ndarray | None = None) -> list[int]:
        match = fts_query(query)
        if match is None:
            return []
        # The names column (path, scope, symbol) weighs more than the body.
        rows = self.db.execute(
            "SELECT rowid FROM lex WHERE lex MATCH ? ORDER BY bm25(lex, 3.0, 1.0) LIMIT ?",
            (match, n if allowed is None else n * 20),
        ).fetchall()
        ids = [r[0] for r in rows]
        if allowed is not None:
            ok = set(allowed.tolist())
            ids = [i for i in ids if i in ok]
        return ids[:n]

    def _hits(self, scored: list[tuple[int, float]]) -> list[Hit]:
        if not scored:
            return []
        ids = [cid for cid, _ in scored]
        q = f"SELECT id, text, scope FROM chunks WHERE id IN ({','.join('?' * len(ids))})"
        extra = {r[0]: (r[1], r[2]) for r in self.db.execute(q, ids)}
        hits = []
        for cid, score in scored:
            if cid not in self._meta or cid not in extra:
                continue
            path, start, end, symbol = self._meta[cid]
            text, scope = extra[cid]
            hits.append(Hit(path=path, start_line=start, end_line=end, score=round(score, 6), text=text, symbol=symbol, scope=scope))  # fmt: skip
        return hits


def _vector_index(vecs: np.ndarray, ids: np.ndarray, dim: int) -> Any:
    """Exact inner product up to FLAT_MAX vectors; an IVF index (also deletable) beyond."""
    import faiss

    n = len(ids)
    if n <= FLAT_MAX:
        index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
    else:
        nlist = int(4 * np.sqrt(n))
        quantizer = faiss.IndexFlatIP(dim)
        index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
        rng = np.random.default_rng(0)
        index.train(vecs[rng.choice(n, size=min(n, 64 * nlist), replace=False)])
        index.nprobe = 24
    if n:
        index.add_with_ids(np.ascontiguousarray(vecs, dtype=np.float32), ids)
    return index
