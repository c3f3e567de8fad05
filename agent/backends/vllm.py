"""`vllm:PATH_OR_NAME` (and the default `smollm2`) — vLLM in-process, async engine.

One `AsyncLLM` (vLLM V1) per `VLLMModel`, shared by every session that streams
through it: the RL loop runs 8-16 sessions at once and vLLM batches them. The
engine starts on the first turn (or `await model.start()`), about 25 s for
SmolLM2-135M on 2 CPU cores; `close()` shuts it down.

How it departs from `vllm serve`:

- The prompt is rendered and tokenized here with the model's own chat template
  (`_local.ChatTokenizer`) and handed over as token ids, so the trace records
  exactly what the engine saw; completion token ids and the logprob of each sampled
  token (`SamplingParams(logprobs=0)`, raw model distribution) come back with the
  text deltas (`RequestOutputKind.DELTA`).
- `aclose()` cancels the consuming task; vLLM's `generate()` aborts the request
  in the engine when cancelled.
- `reload_weights(weights, version)` swaps weights into the running engine in place,
  for the RL loop: a folder of safetensors goes straight to the worker's
  `reload_weights(weights_path=...)` through `collective_rpc` by method name (no
  pickled function, so no `VLLM_ALLOW_INSECURE_SERIALIZATION`); in-memory tensors
  are first written to one safetensors file in a staging folder (RAM-backed
  `/dev/shm` where there is one), deleted as soon as the engine has read it.
  `weight_version` is stamped on every turn.

Process model. The engine core runs in a child process; vLLM's CPU platform forces
the `spawn` start method, which re-imports the parent's `__main__`: a script that
starts an engine must keep its top level under `if __name__ == "__main__":` (the
`opencomposer` entry point, `python -m pytest` and the language server already do).
The engine is built in a worker thread so the event loop (LSP handshakes, other
sessions) keeps running during the 25 s start. vLLM's logs go to stderr at WARNING
(`VLLM_LOGGING_STREAM`, `VLLM_LOGGING_LEVEL`; set them to override), because stdout
carries the LSP protocol and `ask --json`. On CPU the KV cache is sized by
`kv_cache_gib` (default 1 GiB: 46,592 tokens of SmolLM2, 16 sessions of ~2.9k) rather
than a share of the machine's memory, which vLLM-CPU would otherwise take; on a GPU
the default is vLLM's own (`gpu_memory_utilization`).

On CPU the engine runs eagerly (`enforce_eager=None` means eager on CPU): with
vLLM 0.32-CPU and torch 2.13 the torch.compile path produced wrong text for
SmolLM2 here (greedy "What is the capital of France?" gave "L'Étoile, la
Marseillaise, ..." where eager and transformers give "The capital of France is
Paris."), and eager also skips minutes of compilation at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from opencomposer.agent.alternatives import CONTEXT_TOKENS
from opencomposer.agent.backends._local import (
    DEFAULT_WAIT,
    ChatTokenizer,
    alternative_turns,
    check_fits,
    own_omp_wait_policy,
    read_context_window,
    read_fix_samples,
    read_prompt_style,
    read_repair,
    read_turn_budget,
)
from opencomposer.agent.backends._stream import Emit, TaskStream
from opencomposer.agent.protocols import Message, ModelError, Sampling, TurnOutput

_ENV_DEFAULTS = {
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# Before anything imports vllm: its logging is configured once, at import.
for _key, _value in _ENV_DEFAULTS.items():
    os.environ.setdefault(_key, _value)


@contextlib.contextmanager
def _environ(values: dict[str, str | None]) -> Iterator[None]:
    """``os.environ`` with ``values`` (None: removed) inside, as it was after."""

    def put(items: dict[str, str | None]) -> None:
        for k, v in items.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    saved = {k: os.environ.get(k) for k in values}
    try:
        put(values)
        yield
    finally:
        put(saved)


def default_dtype(*, cpu: bool = True) -> str:
    """The engine's dtype unless one is given: bf16, except on a CPU without native bf16
    (no AVX512-BF16 or AMX, e.g. AVX2 only), where vLLM's bf16 linears fall back to a
    slow path: a 1,500-token prefill took 3.6x as long in bf16 there, and 8 streams'
    decode 2.4x, while one stream's decode, bound by memory, was 11-19 % faster in bf16
    (`benchmarks/precision.py`)."""
    if not cpu:
        return "bfloat16"
    from opencomposer.index.embed import cpu_has_bf16

    return "bfloat16" if cpu_has_bf16() else "float32"


class VLLMModel:
    def __init__(
        self,
        path: str | Path,
        *,
        name: str | None = None,
        dtype: str | None = None,  # None: `default_dtype()`
        context_window: int | None = None,
        kv_cache_gib: float | None = None,
        max_num_seqs: int = 16,
        enforce_eager: bool | None = None,
        seed: int = 0,
        prompt_style: str | None = None,
    ) -> None:
        self.path = str(path)
        self.prompt_style = prompt_style or read_prompt_style(path)
        self.max_turns = read_turn_budget(path)  # a session without its own budget uses it
        # replies for a turn that changes files, the likeliest change kept (a session's
        # `fix_samples` unset uses it; `agent/alternatives.py`)
        self.fix_samples = read_fix_samples(path)
        # small edits of its own tried against a failing command (`agent/repair.py`)
        self.repair = read_repair(path)
        self.name = name or f"vllm:{path}"
        self.context_window = context_window or read_context_window(path)
        self.dtype = dtype
        self.kv_cache_gib = kv_cache_gib
        self.max_num_seqs = max_num_seqs
        self.enforce_eager = enforce_eager
        self.seed = seed
        self.tokenizer = ChatTokenizer(path)
        self.weight_version = 0
        self._engine: Any = None
        self._stop_ids: list[int] = []
        self._start_lock = asyncio.Lock()
        self._staging: Path | None = None
        self._reload_lock = asyncio.Lock()

    # -- engine lifecycle ----------------------------------------------------

    async def start(self) -> None:
        """Start the engine (the first turn does it otherwise); idempotent."""
        async with self._start_lock:
            if self._engine is not None:
                return
            try:
                self._engine = await asyncio.to_thread(self._build_engine)
            except Exception as e:
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise ModelError(f"vLLM could not start {self.path}: {first}") from e

    @property
    def weight_dtype(self) -> str:
        """The dtype the engine holds its weights in (`training/weight_sync.py` sends
        new weights in it)."""
        from vllm.platforms import current_platform

        return self.dtype or default_dtype(cpu=current_platform.is_cpu())

    def engine_args(self) -> dict[str, Any]:
        """vLLM's engine arguments for this model (also what `benchmarks/model.py` gives
        vLLM's offline `LLM` to measure the bare engine)."""
        from vllm.platforms import current_platform

        cpu = current_platform.is_cpu()
        eager = cpu if self.enforce_eager is None else self.enforce_eager
        kv_gib = self.kv_cache_gib if self.kv_cache_gib is not None else (1.0 if cpu else None)
        return {
            "model": self.path,
            "tokenizer": self.path,
            "dtype": self.weight_dtype,
            "max_model_len": self.context_window,
            "max_num_seqs": self.max_num_seqs,
            "kv_cache_memory_bytes": None if kv_gib is None else int(kv_gib * 2**30),
            "enforce_eager": eager,
            "seed": self.seed,
            "disable_log_stats": True,
        }

    def engine_env(self) -> dict[str, str | None]:
        """Environment variables for the engine's processes (None: unset), in force
        while they start. On CPU:

        - ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` where 2 cores or fewer are usable: vLLM
          keeps one core per worker for its scheduler process, which on 2 cores leaves
          the model a single OpenMP thread. 8 sampled streams measured 72-82 tokens/s
          with the reservation, 98-105 without (2-core AMD EPYC, load 1.6-2.1);
        - ``OMP_WAIT_POLICY`` unset where only `llamacpp`'s import set it (passive):
          the worker's two threads then ran at 74-91 tokens/s instead; and
          ``OPENCOMPOSER_OMP_DEFAULT_WAIT`` set, so that the engine's processes do not
          set it again when they re-import the parent's modules.

        A value the user set is kept."""
        from vllm.platforms import current_platform

        env: dict[str, str | None] = {}
        if not current_platform.is_cpu():
            return env
        if "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ and len(os.sched_getaffinity(0)) <= 2:
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        if own_omp_wait_policy():
            env["OMP_WAIT_POLICY"] = None
        if "OMP_WAIT_POLICY" not in os.environ or own_omp_wait_policy():
            env[DEFAULT_WAIT] = "1"
        return env

    def _build_engine(self) -> Any:
        self._stop_ids = sorted(self.tokenizer.stop_ids())  # loads the tokenizer off the loop
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        with _environ(self.engine_env()):
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**self.engine_args()))

    async def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            # vLLM's shutdown stops the engine process before it cancels the output
            # handler, which then logs the engine's death as an error with a traceback.
            # Cancelled first (it runs on this loop), it has nothing left to report.
            handler = getattr(engine, "output_handler", None)
            if handler is not None and not handler.done():
                handler.cancel()
                await asyncio.gather(handler, return_exceptions=True)
            await asyncio.to_thread(engine.shutdown)
            # AsyncLLM.__del__ shuts down again, at interpreter exit when vLLM's
            # module globals are gone, and prints a TypeError; once is enough.
            engine.shutdown = lambda *args, **kwargs: None
        self._drop_staging()

    def _drop_staging(self) -> None:
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None

    # -- turns ---------------------------------------------------------------

    def count_tokens(self, text: str) -> int:
        return self.tokenizer.count(text)

    def stream(self, messages: list[Message], sampling: Sampling) -> TaskStream:
        async def produce(out: TurnOutput, emit: Emit) -> None:
            await self.start()
            prompt = self.tokenizer.prompt_ids(messages)
            check_fits(len(prompt), self.context_window)
            out.prompt_token_ids, out.prompt_tokens = prompt, len(prompt)
            out.weight_version = self.weight_version
            await self._generate(prompt, sampling, out, emit)
            if self.weight_version != out.weight_version:
                out.meta["weight_version_end"] = self.weight_version

        return TaskStream(produce)

    def _params(self, sampling: Sampling, prompt_len: int, kind: Any, n: int = 1) -> Any:
        """vLLM's sampling parameters for `sampling`: the raw logprob of each sampled
        token, the reply bounded by what is left of the context window."""
        from vllm import SamplingParams

        return SamplingParams(
            n=n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=min(sampling.max_tokens, self.context_window - prompt_len),
            seed=sampling.seed,
            stop=list(sampling.stop) or None,
            stop_token_ids=self._stop_ids,
            logprobs=0,
            output_kind=kind,
        )

    async def _generate(
        self, prompt: list[int], sampling: Sampling, out: TurnOutput, emit: Emit
    ) -> None:
        from vllm.sampling_params import RequestOutputKind

        token_ids: list[int] = []
        logprobs: list[float] = []
        out.completion_token_ids, out.completion_logprobs = token_ids, logprobs
        params = self._params(sampling, len(prompt), RequestOutputKind.DELTA)
        request_id = f"oc-{uuid.uuid4().hex}"
        async for result in self._engine.generate({"prompt_token_ids": prompt}, params, request_id):
            for completion in result.outputs[:1]:
                ids = list(completion.token_ids)
                token_ids.extend(ids)
                logprobs.extend(_sampled_logprobs(ids, completion.logprobs))
                out.completion_tokens += len(ids)
                emit(completion.text)
                if completion.finish_reason:
                    out.finish_reason = completion.finish_reason
                    if completion.stop_reason is not None:
                        out.meta["stop_reason"] = completion.stop_reason

    # -- alternatives and scores (the session's `fix_samples`) ---------------

    async def alternatives(
        self, turn: TurnOutput, keep: int, n: int, sampling: Sampling
    ) -> list[TurnOutput]:
        """`n` more replies that start as `turn` does up to `keep` characters and go on
        independently, in one batch (`_local.alternative_turns`)."""
        return await alternative_turns(
            turn,
            keep,
            n,
            self.tokenizer.hf.decode,
            lambda ids, k: self.continuations(ids, k, sampling),
        )

    async def continuations(self, ids: list[int], n: int, sampling: Sampling) -> list[TurnOutput]:
        """`n` independent continuations of the token ids `ids` (a prompt and a reply so
        far); each output holds the continuation alone (its text, ids, raw logprobs)."""
        from vllm.sampling_params import RequestOutputKind

        await self.start()
        check_fits(len(ids), self.context_window)
        params = self._params(sampling, len(ids), RequestOutputKind.FINAL_ONLY, n=n)
        final: Any = None
        async for result in self._engine.generate(
            {"prompt_token_ids": ids}, params, f"oc-{uuid.uuid4().hex}"
        ):
            final = result
        outs = []
        for c in final.outputs if final is not None else []:
            got = list(c.token_ids)
            outs.append(
                TurnOutput(
                    text=c.text,
                    finish_reason=c.finish_reason or "stop",
                    completion_tokens=len(got),
                    completion_token_ids=got,
                    completion_logprobs=_sampled_logprobs(got, c.logprobs),
                    weight_version=self.weight_version,
                )
            )
        return outs

    async def logprob(
        self, context: str, text: str, *, context_tokens: int = CONTEXT_TOKENS
    ) -> float:
        """log P(`text` | the last `context_tokens` tokens of `context`), both plain text
        (no chat template): how likely the model finds a piece of code where it stands."""
        ids, first = self.tokenizer.scored_ids(context, text, context_tokens)
        scored = await self._prompt_logprobs(ids, 0, first)
        return float(
            sum(scored[i][ids[i]].logprob for i in range(first, len(ids)) if scored[i] is not None)
        )

    async def top_tokens(
        self, ids: list[int], first: int, k: int
    ) -> list[tuple[float, list[tuple[int, float]]]]:
        """`repair.TokenLM.top_tokens`: the prompt's own logprobs, `k` per position."""
        scored = await self._prompt_logprobs(ids, k, first)
        rows = []
        for i in range(first, min(len(ids), len(scored))):
            got = scored[i] or {}
            here = got.get(ids[i])
            top = sorted(((t, lp.logprob) for t, lp in got.items()), key=lambda x: -x[1])[:k]
            rows.append((here.logprob if here is not None else -math.inf, top))
        return rows

    async def _prompt_logprobs(self, ids: list[int], k: int, first: int = 1) -> list[Any]:
        """vLLM's prompt logprobs of `ids`: per position None (the first) or {token id:
        Logprob} holding the token there and the `k` likeliest; those before `first`
        may be missing.

        The tokens a request shares with one before come from the prefix cache (the
        scores of a code's variants share all the code up to the change), which vLLM
        leaves off by default for prompt logprobs: the positions the cache held get no
        scores. When the cache held a position from `first` on (two prompts that share
        more than the context), the prompt is scored again without it. Tokens are not
        decoded (the rows of cached positions hold no real tokens to decode)."""
        from vllm import SamplingParams

        await self.start()
        check_fits(len(ids) + 1, self.context_window)
        final: Any = None
        held = 0
        for cached in (True, False):
            params = SamplingParams(
                max_tokens=1,
                temperature=0.0,
                prompt_logprobs=k,
                detokenize=False,
                skip_reading_prefix_cache=not cached,
            )
            final = None
            async for result in self._engine.generate(
                {"prompt_token_ids": ids}, params, f"oc-{uuid.uuid4().hex}"
            ):
                final = result
            if final is None:
                return []
            # the position after the last one the cache held is the first one scored
            held = final.num_cached_tokens or 0
            if held < max(first, 1):
                break
        rows = list(final.prompt_logprobs or [])
        return [None if i <= held else row for i, row in enumerate(rows)]

    async def greedy(
        self, prefixes: list[list[int]], max_tokens: int, until: list[int]
    ) -> list[list[int]]:
        """`repair.TokenLM.greedy`: the prefixes in one batch."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        await self.start()
        for p in prefixes:
            check_fits(len(p) + max_tokens, self.context_window)
        stops = list(self.tokenizer.stop_ids())

        async def one(prefix: list[int], end: int) -> list[int]:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=0.0,
                stop_token_ids=[*stops, end] if end >= 0 else stops,
                include_stop_str_in_output=True,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            final: Any = None
            async for result in self._engine.generate(
                {"prompt_token_ids": prefix}, params, f"oc-{uuid.uuid4().hex}"
            ):
                final = result
            outs = final.outputs if final is not None else []
            return list(outs[0].token_ids) if outs else []

        return list(
            await asyncio.gather(*(one(p, u) for p, u in zip(prefixes, until, strict=True)))
        )

    # -- weight sync ---------------------------------------------------------

    async def reload_weights(
        self, weights: Iterable[tuple[str, Any]] | str | Path, version: int
    ) -> None:
        """Load new weights into the running engine in place; later turns carry
        `weight_version == version`.

        `weights` is a folder holding `*.safetensors` in checkpoint (Hugging Face)
        names, one `.safetensors` file, or `(name, tensor)` pairs such as
        `model.state_dict().items()`. Turns in flight finish on the new weights;
        their `meta["weight_version_end"]` says so.
        """
        await self.start()
        async with self._reload_lock:  # one staging folder, one reload at a time
            folder = await asyncio.to_thread(self._weights_folder, weights)
            try:
                await self._engine.collective_rpc(
                    "reload_weights", kwargs={"weights_path": str(folder)}
                )
            except Exception as e:
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise ModelError(f"vLLM weight reload from {folder} failed: {first}") from e
            finally:
                self._drop_staging()  # the engine holds the weights now; free the RAM
            await self._engine.reset_prefix_cache()
            self.weight_version = version

    def _weights_folder(self, weights: Iterable[tuple[str, Any]] | str | Path) -> Path:
        if isinstance(weights, str | Path):
            path = Path(weights).expanduser().resolve()
            if path.is_dir() and any(path.glob("*.safetensors")):
                return path
            if not (path.is_file() and path.suffix == ".safetensors"):
                raise ModelError(f"no .safetensors weights at {path}")
            staging = self._fresh_staging()
            (staging / "model.safetensors").symlink_to(path)
            return staging
        from safetensors.torch import save_file

        tensors: dict[str, Any] = {}
        seen: set[int] = set()
        for name, tensor in weights:
            t = tensor.detach().to("cpu")
            if t.data_ptr() in seen:  # tied weights share storage; safetensors refuses that
                t = t.clone()
            seen.add(t.data_ptr())
            tensors[name] = t.contiguous()
        staging = self._fresh_staging()
        save_file(tensors, str(staging / "model.safetensors"))
        return staging

    def _fresh_staging(self) -> Path:
        self._drop_staging()
        shm = Path("/dev/shm")
        base = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
        self._staging = Path(tempfile.mkdtemp(prefix="opencomposer-weights-", dir=base))
        return self._staging


def _sampled_logprobs(ids: list[int], logprobs: Any) -> list[float]:
    """The logprob of each sampled token from vLLM's per-position {id: Logprob}."""
    if logprobs is None:
        return [float("nan")] * len(ids)
    return [float(position[token].logprob) for token, position in zip(ids, logprobs, strict=True)]
