"""`hf:PATH` — the fallback backend: plain `transformers` on the CPU, in-process.

Used where vLLM is absent, and as the baseline in `benchmarks/model.py`. Each turn
runs a hand-written sampling loop with a KV cache in a worker thread (the event loop
stays free for the language server); the thread hands every token back to the
loop, checks a stop flag between tokens (so `aclose()` stops it within one token),
and records the token ids and logprobs.

Logprobs are those of the raw model distribution (log-softmax of the logits before
temperature and top-p), the same convention as vLLM's default `raw_logprobs`, so
traces from either backend mean the same thing.

Weights load in float32 by default although the folder holds bfloat16: for this
one-token-at-a-time loop, PyTorch 2.13's CPU bf16 path was ~3x slower per decoded
token than fp32 on this AVX512-BF16 machine (SmolLM2-135M, same process, best of 3:
3.9 s vs 1.3 s a token under a load average of ~30; the ratio held on every
repeat). Pass `dtype="bfloat16"` to halve the memory.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from opencomposer.agent.backends._local import (
    ChatTokenizer,
    check_fits,
    read_context_window,
    read_prompt_style,
    read_turn_budget,
)
from opencomposer.agent.backends._stream import Emit, TaskStream
from opencomposer.agent.protocols import Message, Sampling, TurnOutput

OnToken = Callable[[str, int, float], None]


class HFModel:
    def __init__(
        self,
        path: str | Path,
        *,
        name: str | None = None,
        dtype: str = "float32",
        max_concurrency: int = 4,
        context_window: int | None = None,
        prompt_style: str | None = None,
    ) -> None:
        self.path = str(path)
        self.prompt_style = prompt_style or read_prompt_style(path)
        self.max_turns = read_turn_budget(path)  # a session without its own budget uses it
        self.name = name or f"hf:{path}"
        self.context_window = context_window or read_context_window(path)
        self.dtype = dtype
        self.tokenizer = ChatTokenizer(path)
        self._model: Any = None
        self._stop_ids: set[int] = set()
        self._load_lock = asyncio.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="hf-gen")

    async def start(self) -> None:
        """Load the weights (done on the first turn otherwise)."""
        async with self._load_lock:
            if self._model is None:
                await asyncio.get_running_loop().run_in_executor(self._pool, self._load)

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(self.path, dtype=getattr(torch, self.dtype))
        self._stop_ids = self.tokenizer.stop_ids()
        self._model = model.eval()

    def count_tokens(self, text: str) -> int:
        return self.tokenizer.count(text)

    def stream(self, messages: list[Message], sampling: Sampling) -> TaskStream:
        async def produce(out: TurnOutput, emit: Emit) -> None:
            await self.start()
            loop = asyncio.get_running_loop()
            prompt = await loop.run_in_executor(self._pool, self.tokenizer.prompt_ids, messages)
            check_fits(len(prompt), self.context_window)
            out.prompt_token_ids, out.prompt_tokens = prompt, len(prompt)
            token_ids: list[int] = []
            logprobs: list[float] = []
            out.completion_token_ids, out.completion_logprobs = token_ids, logprobs

            def on_token(delta: str, token: int, logprob: float) -> None:
                token_ids.append(token)
                logprobs.append(logprob)
                out.completion_tokens += 1
                emit(delta)

            def on_token_threadsafe(delta: str, token: int, logprob: float) -> None:
                loop.call_soon_threadsafe(on_token, delta, token, logprob)

            stop = threading.Event()
            job = loop.run_in_executor(
                self._pool, self._generate, prompt, sampling, stop, on_token_threadsafe
            )
            try:
                reason, tail = await asyncio.shield(job)
            except asyncio.CancelledError:
                stop.set()
                raise
            await asyncio.sleep(0)  # let the last on_token callbacks land
            emit(tail)
            out.finish_reason = reason

        return TaskStream(produce)

    def _generate(
        self, prompt: list[int], sampling: Sampling, stop: threading.Event, on_token: OnToken
    ) -> tuple[str, str]:
        """The sampling loop (worker thread). Returns (finish_reason, unsent text)."""
        import torch

        model, tok = self._model, self.tokenizer.hf
        generator = torch.Generator()
        if sampling.seed is not None:
            generator.manual_seed(sampling.seed)
        else:
            generator.seed()
        budget = min(sampling.max_tokens, self.context_window - len(prompt))
        hold = max((len(s) for s in sampling.stop), default=1) - 1
        ids: list[int] = []
        sent = ""
        with torch.inference_mode():
            result = model(input_ids=torch.tensor([prompt]), use_cache=True)
            while True:
                logits = result.logits[0, -1].float()  # [vocab]
                token = _sample(logits, sampling, generator)
                logprob = torch.log_softmax(logits, dim=-1)[token].item()
                ids.append(token)
                text = tok.decode(
                    [i for i in ids if i not in self._stop_ids], skip_special_tokens=True
                )
                cut = _find_stop(text, sampling.stop)
                if cut is not None or token in self._stop_ids:
                    on_token("", token, logprob)
                    return "stop", text[len(sent) : cut]
                ready = text[:-1] if text.endswith("\ufffd") else text
                ready = ready[: max(len(sent), len(ready) - hold)]
                on_token(ready[len(sent) :], token, logprob)
                sent = ready
                if len(ids) >= budget:
                    return "length", text[len(sent) :]
                if stop.is_set():
                    return "cancelled", ""
                result = model(
                    input_ids=torch.tensor([[token]]),
                    past_key_values=result.past_key_values,
                    use_cache=True,
                )

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._model = None


def _sample(logits: Any, sampling: Sampling, generator: Any) -> int:
    import torch

    if sampling.temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < sampling.top_p  # always keeps the top one
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


def _find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None
