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

Every stream also passes through a `RepetitionGuard`: a reply that keeps repeating
itself ("a mix of a mix of …") is stopped as soon as the guard sees it, the
producer is cancelled, and `output.finish_reason` is "repetition" (the session then
ends with status `repetition` instead of spending its whole token budget).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from opencomposer.agent.protocols import ModelError, TurnOutput
from opencomposer.agent.text import valid_text

Emit = Callable[[str], None]
Producer = Callable[[TurnOutput, Emit], Awaitable[None]]

_DONE = object()
_NUMBER = re.compile(r"\d+")


class RepetitionGuard:
    """Detects degenerate output: the last `span` characters are one block of `p`
    characters (`p <= max_period`) repeated exactly, where `span = max(min_chars,
    repeats * p)`.

    Legitimate text rarely does that: code with many similar lines differs in names
    and numbers, and a separator line or an indented block is far shorter than
    `min_chars`. The check runs once per `every` new characters and costs a few
    C-level searches over at most `window` characters (the last `probe`
    characters' nearest earlier occurrences give the candidate periods), so the
    guard is amortised O(1) per character of output.

    A reply that counts instead ("at line 12, line 13, line 14, …", 1,000 tokens on
    one line) repeats only once its numbers are blanked out. So when the whole window
    is one line, it is checked again with every number read as 0, for a block with
    three letters or more repeated at least `counting_repeats` times. Code tables that
    count (`'item_001': 7,` …) are not one line, and a line of numbers (`1.2e-05, …`)
    has fewer letters.
    """

    def __init__(
        self,
        *,
        min_chars: int = 800,
        repeats: int = 4,
        max_period: int = 200,
        every: int = 64,
        probe: int = 24,
        candidates: int = 8,
        counting_repeats: int = 12,
    ) -> None:
        self.min_chars = min_chars
        self.repeats = repeats
        self.max_period = max_period
        self.every = every
        self.probe = probe
        self.candidates = candidates
        self.counting_repeats = counting_repeats
        self.window = max(min_chars, repeats * max_period)
        self._unchecked = 0

    def feed(self, text: str, added: int) -> int | None:
        """`text` is the whole reply so far, `added` the characters new since the last
        call; the period of the repetition when it is degenerate, else None."""
        self._unchecked += added
        if self._unchecked < self.every or len(text) < self.min_chars:
            return None
        self._unchecked = 0
        return self.period(text)

    def period(self, text: str) -> int | None:
        s = text[-self.window :]
        if len(s) < self.min_chars:
            return None
        p = self._periodic(s, self.repeats, self.min_chars)
        if p is None and "\n" not in s:
            blind = _NUMBER.sub("0", s)
            p = self._periodic(blind, self.counting_repeats, 0)
            if p is not None and sum(c.isalpha() for c in blind[-p:]) < 3:
                p = None
        return p

    def _periodic(self, s: str, repeats: int, min_span: int) -> int | None:
        """The period p when the last max(min_span, repeats * p) characters of `s`
        are one block of p characters repeated exactly, else None."""
        n, probe = len(s), min(self.probe, len(s) // 2)
        if probe < 1:
            return None
        tail = s[-probe:]
        end = n - 1  # an occurrence must end before the last character: period >= 1
        for _ in range(self.candidates):
            j = s.rfind(tail, 0, end)
            if j < 0:
                return None
            p = n - probe - j
            if p > self.max_period:
                return None
            span = max(min_span, repeats * p)
            if span > n:
                return None
            block = s[n - span :]
            if block[p:] == block[:-p]:
                return p
            end = j + probe - 1  # the next candidate lies further back
        return None


class TaskStream:
    def __init__(self, produce: Producer, *, guard: RepetitionGuard | None = None) -> None:
        self.output: TurnOutput | None = None
        self._produce = produce
        self._guard = guard if guard is not None else RepetitionGuard()
        self._repeated: int | None = None
        self._partial = TurnOutput(text="")
        self._held = ""  # a high surrogate whose low half may open the next delta
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
        if not delta or self._repeated is not None:
            return
        delta, self._held = self._held + delta, ""
        if "\ud800" <= delta[-1] <= "\udbff":
            delta, self._held = delta[:-1], delta[-1]
        delta = valid_text(delta)
        if not delta:
            return
        if self._first is None:
            self._first = time.monotonic()
        self._partial.text += delta
        self._queue.put_nowait(delta)
        period = self._guard.feed(self._partial.text, len(delta))
        if period is not None:
            self._repeated = period
            if self._task is not None and not self._task.done():
                self._task.cancel()  # the producer stops at its next await

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
        if self._held:  # a high surrogate that never got its low half
            self._held = ""
            out.text += "\ufffd"
            self._queue.put_nowait("\ufffd")
        if self._repeated is not None:
            out.finish_reason = "repetition"
            out.meta["repetition_period"] = self._repeated
        now = time.monotonic()
        if self._started:
            out.meta.setdefault("duration_s", round(now - self._started, 4))
            if self._first is not None:
                out.meta.setdefault("time_to_first_token_s", round(self._first - self._started, 4))
        self.output = out
        self._queue.put_nowait(_DONE)
