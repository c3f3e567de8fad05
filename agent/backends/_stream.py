"""One `ModelStream` for every backend: a producer task feeding a queue.

A backend writes one coroutine, `produce(out, emit)`, that generates a turn: it
calls `emit(delta)` for each piece of text and fills the token fields of `out`
(a `TurnOutput` whose `text` `emit` keeps up to date). `TaskStream` runs it as a
task that starts on the first `__anext__`, so:

- the consumer reads deltas as they come and never blocks the producer;
- `aclose()` cancels the task at once, wherever it waits (a sleep, an HTTP read,
  the vLLM output queue, a worker thread's future), and the consumer's pending
  `__anext__` ends cleanly; `output.finish_reason` is then "cancelled" and `output`
  keeps what was generated so far;
- any failure reaches the consumer as `ModelError` (one line), after the deltas
  produced before it, with `output.finish_reason == "error"`.

`output.meta` gets `time_to_first_token_s` and `duration_s`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from opencomposer.agent.protocols import ModelError, TurnOutput

Emit = Callable[[str], None]
Producer = Callable[[TurnOutput, Emit], Awaitable[None]]

_DONE = object()


class TaskStream:
    def __init__(self, produce: Producer) -> None:
        self.output: TurnOutput | None = None
        self._produce = produce
        self._partial = TurnOutput(text="")
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._started = 0.0
        self._first: float | None = None

    def __aiter__(self) -> AsyncIterator[str]:
        return self._iterate()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._task is None:
            self._partial.finish_reason = "cancelled"
            self._finish()
        elif not self._task.done():
            self._task.cancel()
            await asyncio.wait([self._task])

    async def _iterate(self) -> AsyncIterator[str]:
        if self._task is None and not self._closed:
            self._started = time.monotonic()
            self._task = asyncio.create_task(self._run())
        try:
            while True:
                item = await self._queue.get()
                if item is _DONE:
                    self._queue.put_nowait(_DONE)  # a second iteration ends too
                    return
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, str)
                yield item
        finally:
            # The consumer stopped early (break, exception): stop generating too.
            if self._task is not None and not self._task.done():
                self._task.cancel()

    def _emit(self, delta: str) -> None:
        if not delta:
            return
        if self._first is None:
            self._first = time.monotonic()
        self._partial.text += delta
        self._queue.put_nowait(delta)

    async def _run(self) -> None:
        try:
            await self._produce(self._partial, self._emit)
        except asyncio.CancelledError:
            self._partial.finish_reason = "cancelled"
        except ModelError as e:
            self._partial.finish_reason = "error"
            self._queue.put_nowait(e)
        except Exception as e:  # a backend bug or engine failure: still one line
            self._partial.finish_reason = "error"
            error = ModelError(f"{type(e).__name__}: {e}".splitlines()[0])
            error.__cause__ = e
            self._queue.put_nowait(error)
        finally:
            self._finish()

    def _finish(self) -> None:
        out = self._partial
        now = time.monotonic()
        if self._started:
            out.meta.setdefault("duration_s", round(now - self._started, 4))
            if self._first is not None:
                out.meta.setdefault("time_to_first_token_s", round(self._first - self._started, 4))
        self.output = out
        self._queue.put_nowait(_DONE)
