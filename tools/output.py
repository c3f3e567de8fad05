"""Bounded output: cut long text at the head and tail, and capture a stream without
ever holding more than a fixed number of bytes.

Both keep the start (where a command says what it is doing) and the end (where it
says how it failed) and put one marker line in the middle that says how much was
cut, so the model knows the output is incomplete and by how much.

Also here: `returns_errors`, the convention every tool in this package follows
(internal code raises `ToolError`; the public tool function turns it into an error
`ToolResult`, so a tool never raises for a user mistake whoever calls it).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import ParamSpec

from opencomposer.tools.protocols import ToolError, ToolResult

P = ParamSpec("P")


def _marker(chars: int, lines: int) -> str:
    what = f"{chars} characters" + (f" ({lines} lines)" if lines else "")
    return f"\n[... {what} cut from the middle ...]\n"


def cap(text: str, limit: int) -> str:
    """`text` if it fits in `limit` characters, else its head and tail around a marker.

    Cuts fall on line boundaries when one is near, so lines are not torn in half.
    The result is at most `limit` characters plus the marker line.
    """
    if limit <= 0 or len(text) <= limit:
        return text
    head_len = limit // 2
    tail_len = limit - head_len
    head = text[:head_len]
    tail = text[len(text) - tail_len :]
    nl = head.rfind("\n")
    if nl >= head_len * 3 // 4:
        head = head[: nl + 1]
    nl = tail.find("\n")
    if 0 <= nl <= tail_len // 4:
        tail = tail[nl + 1 :]
    cut = text[len(head) : len(text) - len(tail)]
    return head.rstrip("\n") + _marker(len(cut), cut.count("\n")) + tail


class OutputCapture:
    """Keeps the first `limit // 2` bytes and the last `limit // 2` bytes of a stream.

    Memory stays below about `2 * limit` bytes however much is fed, which is what
    lets the sandbox run a command that prints without end. `text()` decodes
    what was kept (UTF-8, invalid bytes replaced) with a marker for the cut.
    """

    def __init__(self, limit: int) -> None:
        self.limit = max(limit, 2)
        self._head_limit = self.limit // 2
        self._tail_limit = self.limit - self._head_limit
        self._head = bytearray()
        self._tail = bytearray()
        self.total = 0  # bytes fed
        self._dropped_lines = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self._head_limit - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if not data:
            return
        self._tail += data
        excess = len(self._tail) - self._tail_limit
        # Trim in bulk (amortised O(1) per byte) once the tail is twice its budget.
        if excess > self._tail_limit:
            self._dropped_lines += self._tail.count(b"\n", 0, excess)
            del self._tail[:excess]

    @property
    def truncated(self) -> bool:
        return self.total > len(self._head) + min(len(self._tail), self._tail_limit)

    def text(self) -> str:
        tail = self._tail
        dropped_lines = self._dropped_lines
        excess = len(tail) - self._tail_limit
        if excess > 0:
            dropped_lines += tail.count(b"\n", 0, excess)
            tail = tail[excess:]
        head_s = bytes(self._head).decode("utf-8", "replace")
        tail_s = bytes(tail).decode("utf-8", "replace")
        cut = self.total - len(self._head) - len(tail)
        if cut <= 0:
            return head_s + tail_s
        return head_s.rstrip("\n") + _marker_bytes(cut, dropped_lines) + tail_s


def _marker_bytes(cut: int, lines: int) -> str:
    what = f"{cut} bytes" + (f" ({lines} lines)" if lines else "")
    return f"\n[... {what} of output cut from the middle ...]\n"


def returns_errors(
    fn: Callable[P, Awaitable[ToolResult]],
) -> Callable[P, Awaitable[ToolResult]]:
    """Turn a `ToolError` raised inside a tool into `ToolResult.error(message)`."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> ToolResult:
        try:
            return await fn(*args, **kwargs)
        except ToolError as e:
            return ToolResult.error(str(e))

    return wrapper
