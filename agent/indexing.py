"""The codebase index of one session's workspace, as `codebase_search` sees it.

An `IndexHandle` opens the index on first use, on its own worker thread, and is
itself the tools' `Index` (a synchronous `search`), so every session gets the
same object whichever front door opened it (`agent.factory`). How the index is
opened is the caller's: by default the workspace's own `CodebaseIndex`
(`.opencomposer/index/`, built or brought up to date by a Merkle refresh); a
training environment passes an opener that seeds it from a per-snapshot cache
(`training/snapshot_index.py`).

Two kinds of change reach it:

- editor buffers (`update_buffer`/`drop_buffer`, from the language server): before
  the index opens they are only remembered (latest text per path) and replayed
  when it opens, so typing never pays for an index nobody asked for;
- files a tool changed on disk (`changed`): the next search first runs the Merkle
  refresh, which re-embeds only what changed.

All index work runs on one thread: the index need not be thread-safe, and a
search never sees a half-applied update.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opencomposer.tools.protocols import SearchHit

log = logging.getLogger(__name__)

Opener = Callable[[], Any]  # runs on the handle's thread; returns an opened, refreshed index


class IndexHandle:
    """The codebase index of one workspace, opened on first use in a worker thread."""

    def __init__(self, root: Path, *, opener: Opener | None = None) -> None:
        self.root = Path(root)
        self._opener = opener or self._open_local
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="oc-index")
        self._index: Any = None
        self._opening: asyncio.Future[Any] | None = None
        self._pending: dict[str, str] = {}
        self._lock = threading.Lock()
        self._flush_queued = False
        self._stale = False

    # -- opening -----------------------------------------------------------------

    async def get(self) -> IndexHandle:
        """Open the index (once; concurrent callers share the opening) and return
        this handle, which searches it. A failed opening is retried next time."""
        if self._index is not None:
            return self
        if self._opening is None:
            loop = asyncio.get_running_loop()
            self._opening = loop.run_in_executor(self._pool, self._open)
        try:
            await asyncio.shield(self._opening)
        except Exception:
            self._opening = None
            raise
        return self

    def _open(self) -> Any:
        if self._index is None:
            self._index = self._opener()
            self._flush()
        return self._index

    def _open_local(self) -> Any:
        from opencomposer.index import CodebaseIndex

        index = CodebaseIndex.open(self.root)
        index.refresh()
        return index

    # -- searching ---------------------------------------------------------------

    def search(self, query: str, *, k: int = 10, path: str | None = None) -> list[SearchHit]:
        """The tools' `Index` protocol: blocks its (worker) caller until the handle's
        thread has brought the index up to date and searched it."""
        return self._pool.submit(self._search, query, k, path).result()

    async def query(self, query: str, k: int, path: str | None) -> list[Any]:
        """`search` for an event loop (the language server's `opencomposer.search`)."""
        await self.get()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._search, query, k, path)

    def _search(self, query: str, k: int, path: str | None) -> list[Any]:
        index = self._open()
        if self._stale:
            self._stale = False
            index.refresh()
        return index.search(query, k=k, path=path)

    # -- changes -----------------------------------------------------------------

    def changed(self, path: str = "") -> None:
        """A tool changed files on disk (`path`, or anything for a command): the next
        search refreshes first."""
        self._stale = True

    def update_buffer(self, key: str, text: str) -> None:
        with self._lock:
            self._pending[key] = text
            if self._index is None or self._flush_queued:
                return
            self._flush_queued = True
        self._pool.submit(self._flush)

    def drop_buffer(self, key: str) -> None:
        """The editor closed the file: the disk is the truth again."""
        with self._lock:
            self._pending.pop(key, None)
            if self._index is None:
                return
        self._pool.submit(self._index.drop_buffer, key)

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            self._flush_queued = False
        for key, text in pending.items():
            try:
                self._index.update_buffer(key, text)
            except Exception:
                log.exception("index update of %s failed", key)

    def close(self) -> None:
        """Close the index and stop the worker thread (after the work queued on it)."""

        def shut() -> None:
            if self._index is not None and hasattr(self._index, "close"):
                self._index.close()
            self._index = None

        try:
            self._pool.submit(shut).result()
        except RuntimeError:
            pass  # already shut down
        self._pool.shutdown(wait=True)
