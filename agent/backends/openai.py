"""`openai:URL#MODEL` — any OpenAI-compatible `/chat/completions` endpoint.

Works with `vllm serve`, llama.cpp's server and hosted APIs. URL is the API base
(`http://127.0.0.1:8000/v1`); the key, if any, comes from `OPENCOMPOSER_API_KEY`.
The turn streams over Server-Sent Events (`stream: true`) through httpx. Logprobs
are requested and recorded when the server gives them; a server that rejects them
(HTTP 400 naming logprobs) is asked again without, and that is remembered.
Token ids are not available through this API, so traces from it cannot be replayed
token-exactly. HTTP errors, unreachable hosts and broken streams raise `ModelError`
with one line; `aclose()` closes the connection.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from opencomposer.agent.backends._stream import Emit, TaskStream
from opencomposer.agent.protocols import Message, ModelError, Sampling, TurnOutput

API_KEY_ENV = "OPENCOMPOSER_API_KEY"


class OpenAIModel:
    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        name: str | None = None,
        context_window: int = 8192,
        timeout_s: float = 600.0,
        logprobs: bool = True,
    ) -> None:
        base = base_url.rstrip("/")
        self.url = base if base.endswith("/chat/completions") else base + "/chat/completions"
        self.model = model
        self.name = name or f"openai:{base_url}#{model}"
        self.context_window = context_window
        self.timeout_s = timeout_s
        self.logprobs = logprobs
        self._client: Any = None

    async def start(self) -> None:
        """Nothing to start; here so every backend can be warmed the same way."""

    def count_tokens(self, text: str) -> int:
        return math.ceil(len(text) / 4)  # no tokenizer at hand: ~4 characters a token

    def stream(self, messages: list[Message], sampling: Sampling) -> TaskStream:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [m.as_dict() for m in messages],
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.stop:
            body["stop"] = list(sampling.stop)

        async def produce(out: TurnOutput, emit: Emit) -> None:
            if self.logprobs:
                try:
                    await self._request({**body, "logprobs": True}, out, emit)
                    return
                except _Rejected:
                    self.logprobs = False
            await self._request(body, out, emit)

        return TaskStream(produce)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _request(self, body: dict[str, Any], out: TurnOutput, emit: Emit) -> None:
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=10.0))
        headers = {"Accept": "text/event-stream"}
        if key := os.environ.get(API_KEY_ENV):
            headers["Authorization"] = f"Bearer {key}"
        try:
            async with self._client.stream("POST", self.url, json=body, headers=headers) as resp:
                if resp.status_code >= 400:
                    detail = _error_detail((await resp.aread()).decode("utf-8", "replace"))
                    if (
                        resp.status_code == 400
                        and "logprobs" in body
                        and "logprob" in detail.lower()
                    ):
                        raise _Rejected(detail)
                    raise ModelError(f"{self.url}: HTTP {resp.status_code}: {detail}")
                await self._read_events(resp, out, emit)
        except httpx.ConnectError as e:
            raise ModelError(f"cannot reach {self.url}: {e}") from None
        except httpx.TimeoutException:
            raise ModelError(f"{self.url}: no answer within {self.timeout_s:g} s") from None
        except httpx.HTTPError as e:
            raise ModelError(f"the stream from {self.url} broke: {e or type(e).__name__}") from None

    async def _read_events(self, resp: Any, out: TurnOutput, emit: Emit) -> None:
        finished = False
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue  # comments, event names, keep-alives
            data = line[5:].strip()
            if data == "[DONE]":
                finished = True
                break
            try:
                chunk = json.loads(data)
            except ValueError:
                raise ModelError(f"{self.url} sent a malformed event: {data[:80]!r}") from None
            if "error" in chunk:
                raise ModelError(f"{self.url}: {_error_detail(json.dumps(chunk))}")
            if usage := chunk.get("usage"):
                out.prompt_tokens = usage.get("prompt_tokens", out.prompt_tokens)
                out.completion_tokens = usage.get("completion_tokens", out.completion_tokens)
            for choice in chunk.get("choices") or []:
                emit((choice.get("delta") or {}).get("content") or "")
                content = (choice.get("logprobs") or {}).get("content") or []
                if content:
                    out.completion_logprobs = (out.completion_logprobs or []) + [
                        float(c["logprob"]) for c in content
                    ]
                if choice.get("finish_reason"):
                    out.finish_reason = choice["finish_reason"]
                    finished = True
        if not finished:
            raise ModelError(f"the stream from {self.url} ended before the turn finished")
        out.completion_tokens = out.completion_tokens or self.count_tokens(out.text)


class _Rejected(Exception):
    """HTTP 400 on a request that asked for logprobs."""


def _error_detail(text: str) -> str:
    try:
        error = json.loads(text).get("error", text)
        message = error.get("message", error) if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = text
    line = " ".join(str(message).split())
    return line[:300] or "(empty body)"
