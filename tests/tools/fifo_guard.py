"""Run a tool call that must not block on a FIFO (imported by tests/tools test files)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from opencomposer.tools.protocols import ToolResult


def unblocked(
    fifo: Path, coro_fn: Callable[[], Awaitable[ToolResult]], timeout: float = 10.0
) -> ToolResult:
    """Run a tool call on its own event loop in a thread; a call that blocks on the
    FIFO is unblocked (a writer opens and closes it) and the test fails."""
    out: list[ToolResult] = []
    worker = threading.Thread(target=lambda: out.append(asyncio.run(coro_fn())), daemon=True)  # type: ignore[arg-type]
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(timeout)
        pytest.fail(f"the call blocked on the FIFO {fifo.name}")
    return out[0]
