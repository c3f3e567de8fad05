"""The codebase index of one workspace as the language server and `ask` use it:
opened lazily on the first search, on its own worker thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class IndexHandle:
    """The codebase index of one workspace, opened on first use in a worker thread.

    Buffer updates before that are only remembered (latest text per path) and
    replayed when the index opens, so typing never pays for an index nobody asked
    for. All index work runs on one thread: the index need not be thread-safe.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="oc-index")
        self._index: Any = None
        self._opening: asyncio.Future[Any] | None = None
        self._pending: dict[str, str] = {}
        self._lock = threading.Lock()
        self._flush_queued = False

    async def get(self) -> Any:
        if self._index is not None:
            return self._index
        if self._opening is None:
            loop = asyncio.get_running_loop()
            self._opening = loop.run_in_executor(self._pool, self._open)
        try:
            return await asyncio.shield(self._opening)
        except Exception:
            self._opening = None
            raise

    def _open(self) -> Any:
        from opencomposer.index import CodebaseIndex

        index = CodebaseIndex.open(self.root)
        index.refresh()
        self._index = index
        self._flush()
        return index

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

    async def search(self, query: str, k: int, path: str | None) -> list[Any]:
        index = await self.get()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: index.search(query, k=k, path=path))
