"""`scripted:FILE` — a test double that plays fixed assistant turns.

FILE is JSON::

    {"turns": ["I'll read it.\\n<read_file path=\\"a.py\\"/>", "Done."],
     "chars_per_second": 200,        # optional; 0 or absent streams at once
     "fail_after_chars": 50,         # optional; raise ModelError after N chars
     "context_window": 8192}         # optional

It is stateless across sessions: the turn played is the number of assistant
messages already in the conversation, so every session starts from the first turn
whatever the prompt, and a turn past the end is empty. In code (not in FILE) a turn
may also be a function of the conversation so far that returns the turn's text, so a
scripted player can say what the tool results have shown. Text streams in small
chunks paced against the stream's start (so total time is len/rate however slow the
consumer), the first chunk at once. Token counts are a 4-characters-a-token
estimate; there are no token ids.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from opencomposer.agent.backends._stream import Emit, TaskStream
from opencomposer.agent.protocols import Message, ModelError, Sampling, TurnOutput

CHUNKS_PER_SECOND = 50

Turn = str | Callable[[list[Message]], str]


class ScriptedModel:
    def __init__(
        self,
        turns: Sequence[Turn],
        *,
        chars_per_second: float = 0.0,
        fail_after_chars: int | None = None,
        context_window: int = 8192,
        name: str = "scripted",
    ) -> None:
        self.name = name
        self.turns: list[Turn] = list(turns)
        self.chars_per_second = chars_per_second
        self.fail_after_chars = fail_after_chars
        self.context_window = context_window

    @classmethod
    def from_file(cls, path: str | Path) -> ScriptedModel:
        """Load FILE; a missing or malformed file raises ValueError with one line."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except OSError as e:
            raise ValueError(f"scripted model file {path}: {e.strerror or e}") from None
        except ValueError as e:
            raise ValueError(f"scripted model file {path} is not JSON: {e}") from None
        turns = data.get("turns") if isinstance(data, dict) else None
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise ValueError(f'scripted model file {path} needs "turns": a list of strings')
        try:
            rate = float(data.get("chars_per_second") or 0.0)
            fail = data.get("fail_after_chars")
            fail = None if fail is None else int(fail)
            window = int(data.get("context_window") or 8192)
        except (TypeError, ValueError):
            raise ValueError(
                f"scripted model file {path}: chars_per_second, fail_after_chars and "
                "context_window must be numbers"
            ) from None
        if rate < 0 or (fail is not None and fail < 0) or window <= 0:
            raise ValueError(f"scripted model file {path}: negative rate, limit or window")
        return cls(
            turns,
            chars_per_second=rate,
            fail_after_chars=fail,
            context_window=window,
            name=f"scripted:{path}",
        )

    def stream(self, messages: list[Message], sampling: Sampling) -> TaskStream:
        index = sum(1 for m in messages if m.role == "assistant")
        turn = self.turns[index] if index < len(self.turns) else ""
        text = turn if isinstance(turn, str) else turn(list(messages))
        prompt_tokens = sum(self.count_tokens(m.content) for m in messages)

        async def produce(out: TurnOutput, emit: Emit) -> None:
            out.prompt_tokens = prompt_tokens
            out.meta["scripted_turn"] = index
            await self._play(text, out, emit)
            out.completion_tokens = self.count_tokens(text)

        return TaskStream(produce)

    async def start(self) -> None:
        """Nothing to start; here so every backend can be warmed the same way."""

    def count_tokens(self, text: str) -> int:
        return math.ceil(len(text) / 4)

    async def close(self) -> None:
        return None

    async def _play(self, text: str, out: TurnOutput, emit: Emit) -> None:
        rate = self.chars_per_second
        size = max(1, round(rate / CHUNKS_PER_SECOND)) if rate > 0 else max(1, len(text))
        start = time.monotonic()
        sent = 0
        while sent < len(text):
            if rate > 0 and sent:
                await asyncio.sleep(max(0.0, start + sent / rate - time.monotonic()))
            chunk = text[sent : sent + size]
            if self.fail_after_chars is not None and sent + len(chunk) > self.fail_after_chars:
                emit(chunk[: self.fail_after_chars - sent])
                out.completion_tokens = self.count_tokens(out.text)
                raise ModelError(
                    f"scripted model failed after {self.fail_after_chars} characters "
                    "(fail_after_chars)"
                )
            emit(chunk)
            sent += len(chunk)
        if rate > 0:
            await asyncio.sleep(max(0.0, start + len(text) / rate - time.monotonic()))
