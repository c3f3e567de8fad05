"""The boundaries of the agent package: the model a session talks to.

Every backend (`opencomposer.agent.backends`) implements `Model`. A turn is
streamed as text deltas; when the stream ends, `ModelStream.output` holds the
whole turn with, where the engine gives them, the exact prompt and completion
token ids and the completion logprobs, so training never re-tokenizes text.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

Role = Literal["system", "user", "assistant"]


@dataclass(kw_only=True)
class Message:
    role: Role
    content: str
    # "tool_results" marks a user message that carries tool output, so that context
    # management may shrink it and training may mask it out.
    kind: Literal["text", "tool_results"] = "text"

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True, kw_only=True)
class Sampling:
    temperature: float = 0.2
    top_p: float = 0.95
    max_tokens: int = 1024
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(kw_only=True)
class TurnOutput:
    text: str
    finish_reason: str = "stop"  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    completion_logprobs: list[float] | None = None
    weight_version: int | None = None
    meta: dict[str, object] = field(default_factory=dict)


class ModelError(Exception):
    """The backend failed (engine crash, HTTP error, broken stream)."""


class PromptTooLong(ModelError):
    """The prompt does not fit the model's context window: this request fails, the
    model is fine."""


@runtime_checkable
class ModelStream(Protocol):
    """Async iterator of text deltas; `output` is set once iteration has finished."""

    output: TurnOutput | None

    def __aiter__(self) -> AsyncIterator[str]: ...

    async def aclose(self) -> None:
        """Stop generating (cancellation); safe to call more than once."""
        ...


@runtime_checkable
class Model(Protocol):
    name: str
    context_window: int

    def stream(self, messages: list[Message], sampling: Sampling) -> ModelStream: ...

    def count_tokens(self, text: str) -> int: ...

    async def close(self) -> None: ...
