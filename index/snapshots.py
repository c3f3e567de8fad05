"""Start a workspace's index from a stored index database instead of from nothing.

A database is relocatable: its rows hold workspace-relative paths, and vectors
are keyed by the text they embed. Copied into another workspace's
`.opencomposer/index/`, the next `refresh()` keeps every file whose stored
content hash still matches and embeds only the rest (the Merkle diff; a chunk
whose text is already stored is not embedded again even when its file changed).

Whether the copy may trust the stored file stats (size and mtime) is the
caller's call: a workspace unpacked from the same tar as the stored index has
the same stats, so an unchanged file is not even read. Across different
snapshots it may not: tars packed deterministically give every file mtime 0,
so a file edited without changing its size would look unchanged. `seed(...,
trust_stats=False)` forgets the stats, and the refresh compares content hashes.

    seed(episode_root, cache / "abc.db", trust_stats=True)
    index = CodebaseIndex.open(episode_root); index.refresh()
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

from .core import INDEX_DIR, index_dir


def database(root: Path) -> Path:
    """Where the index of the workspace `root` keeps its database."""
    return Path(root) / INDEX_DIR / "index.db"


def seed(root: Path, db: Path, *, trust_stats: bool) -> None:
    """Copy the index database `db` into the workspace `root` (replacing its own).

    The index folder must be a real folder inside `root` (IndexProblem otherwise), and
    the copy is written to a fresh file: nothing a workspace put there is followed.
    """
    dest = index_dir(root) / database(root).name
    for suffix in ("-wal", "-shm", "-journal"):
        Path(str(dest) + suffix).unlink(missing_ok=True)
    tmp = dest.with_suffix(".seeding")
    tmp.unlink(missing_ok=True)
    shutil.copyfile(db, tmp)
    if not trust_stats:
        con = sqlite3.connect(tmp)
        try:
            with con:
                con.execute("UPDATE files SET mtime_ns = -1")
        finally:
            con.close()
    tmp.replace(dest)


def store(root: Path, db: Path) -> None:
    """Save the (closed) index database of the workspace `root` as `db`, atomically."""
    src = database(root)
    con = sqlite3.connect(src)
    try:
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        con.close()
    tmp = db.with_name(db.name + ".tmp")
    shutil.copyfile(src, tmp)
    tmp.replace(db)
