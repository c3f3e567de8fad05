"""Codebase indexes for environment episodes, built once per snapshot.

Every episode of a task starts from the same files (the task's `repo.tar`), and
tasks mined from one project differ from each other in a file or two. Building
the index in each episode would embed the whole project every time; instead:

- **One build per snapshot.** The index of a snapshot is built once into
  `<cache>/<key>.db`, `key` being the content hash of `repo.tar` and the
  embedder's identity. A lock file per key makes every environment worker on
  the machine (any process) wait for that one build instead of starting its own.
- **Projects share their work.** A snapshot not yet in the cache starts from the
  database last built for the same project (`Task.source`, e.g.
  `mined:pypi:toolz-1.2.0`); the Merkle refresh then embeds only the files that
  differ (content hashes: deterministic tars give every file mtime 0, so stats
  prove nothing across snapshots).
- **An episode copies, then refreshes.** The episode's workspace is a copy of
  the same tar, so the copied database's file stats hold; the refresh re-embeds
  only what the task's setup and the agent changed before the first search.

The cache is opened lazily, by the first `codebase_search` of an episode (an
episode that never searches pays nothing), or ahead of time by
`EnvironmentServer.prewarm(tasks, index=True)`. Figures: `benchmarks/env.py`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from opencomposer.training.tasks import Task, safe_extract

log = logging.getLogger(__name__)

MAX_ENTRIES = 256  # snapshot databases kept (least recently used go first)


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "opencomposer" / "snapshot-index"


class SnapshotIndexes:
    """The per-snapshot index cache of one machine (see the module docstring)."""

    def __init__(self, cache: Path | None = None, *, max_entries: int = MAX_ENTRIES) -> None:
        self.cache = Path(cache) if cache is not None else default_cache()
        self.max_entries = max_entries
        self._keys: dict[tuple[str, int, int], str] = {}
        self._lock = threading.Lock()

    def key(self, task: Task) -> str:
        """Content hash of the task's repo.tar plus the embedder's identity."""
        from opencomposer.index.embed import EmbedderConfig

        st = task.repo_tar.stat()
        stat_key = (str(task.repo_tar), st.st_size, st.st_mtime_ns)
        with self._lock:
            tar_hash = self._keys.get(stat_key)
        if tar_hash is None:
            h = hashlib.blake2b(digest_size=12)
            with task.repo_tar.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            tar_hash = h.hexdigest()
            with self._lock:
                self._keys[stat_key] = tar_hash
        embedder = EmbedderConfig.resolve().key
        return f"{tar_hash}-{hashlib.blake2b(embedder.encode(), digest_size=6).hexdigest()}"

    def ensure(self, task: Task) -> Path:
        """The snapshot's index database, built first if the cache lacks it."""
        key = self.key(task)
        db = self.cache / f"{key}.db"
        if db.exists():
            _touch(db)
            return db
        self.cache.mkdir(parents=True, exist_ok=True)
        with _flock(self.cache / f"{key}.lock"):
            if db.exists():
                return db
            self._build(task, key, db)
        self._evict()
        return db

    def open(self, task: Task, root: Path) -> Any:
        """The index of an episode's workspace `root` (a copy of the task's snapshot),
        opened from the snapshot's database and refreshed against the workspace."""
        from opencomposer.index import CodebaseIndex
        from opencomposer.index.snapshots import seed

        for attempt in range(2):
            db = self.ensure(task)
            try:
                seed(root, db, trust_stats=True)
                break
            except FileNotFoundError:
                if attempt:
                    raise  # evicted between ensure and copy twice: give up
        index = CodebaseIndex.open(root)
        index.refresh()
        return index

    def _build(self, task: Task, key: str, db: Path) -> None:
        from opencomposer.index import CodebaseIndex
        from opencomposer.index.snapshots import seed, store

        family = self._family(task)
        with tempfile.TemporaryDirectory(prefix="build-", dir=self.cache) as tmp:
            root = Path(tmp) / "repo"
            safe_extract(task.repo_tar, root)
            base = self._family_db(family)
            if base is not None:
                try:
                    seed(root, base, trust_stats=False)
                except OSError:  # evicted meanwhile: build from nothing
                    base = None
            with CodebaseIndex.open(root) as index:
                stats = index.refresh()
            store(root, db)
        log.info(
            "snapshot index %s: %d files, %d chunks embedded in %.1f s%s",
            key, stats.files, stats.chunks_embedded, stats.seconds,
            " (seeded from its project)" if base is not None else "",
        )  # fmt: skip
        if family is not None:
            tmp_name = family.with_name(family.name + f".{os.getpid()}")
            tmp_name.write_text(key + "\n")
            tmp_name.replace(family)

    def _family(self, task: Task) -> Path | None:
        if not task.source:
            return None
        digest = hashlib.blake2b(task.source.encode(), digest_size=8).hexdigest()
        return self.cache / f"project-{digest}.txt"

    def _family_db(self, family: Path | None) -> Path | None:
        """The database last built for the task's project, if it is still cached."""
        if family is None:
            return None
        try:
            db = self.cache / f"{family.read_text().strip()}.db"
        except OSError:
            return None
        return db if db.exists() else None

    def _evict(self) -> None:
        dbs = sorted(self.cache.glob("*.db"), key=lambda p: _mtime(p), reverse=True)
        for old in dbs[self.max_entries :]:
            old.unlink(missing_ok=True)
            (self.cache / f"{old.stem}.lock").unlink(missing_ok=True)


@contextlib.contextmanager
def _flock(path: Path) -> Iterator[None]:
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _touch(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.utime(path)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
