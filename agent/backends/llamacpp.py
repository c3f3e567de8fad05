"""`llamacpp:PATH_OR_NAME` (and the default `smollm2` where llama-cpp-python is
installed) — the interactive engine: one stream at a time, as fast as the CPU allows.

vLLM stays the engine for batched sampling (the RL loop asks for `vllm:` by name);
this backend serves one person at a time, where vLLM-CPU's per-step overhead
(scheduler, engine-core IPC, detokenizer process) costs more than the 135M model's
arithmetic: on 2 cores vLLM decodes ~20 tokens/s, llama.cpp ~76 on the same weights.

How a turn runs (one worker thread, `_Engine.generate`; the event loop only receives
text deltas through `call_soon_threadsafe`):

- The prompt is rendered and tokenized by the model's own chat template
  (`_local.ChatTokenizer`), as for vLLM, so the trace records exactly the ids the
  engine was given.
- Prefix reuse: the engine remembers the token ids in its KV cache; a new prompt
  evaluates only what follows the longest common prefix (every turn of a session
  resends the conversation, so turn 5 pays for turn 4's reply and tool results, not
  for the whole history).
- Sampling happens here, on the raw logits (`_Sampler`): temperature, top-p, seed. The
  logprob recorded for each token is the raw (temperature 1) log-softmax of the
  logits it was sampled from, as vLLM's `logprobs=0` gives; the stop token (e.g.
  `<|im_end|>`) is kept in the token ids, without text, as vLLM does.
- Speculation by prompt lookup (`_Drafts`): the last 3 (or 2) tokens are looked up
  in the prompt and reply so far; if they occurred before, the up to `draft` tokens
  that followed are proposed, and the model checks them in one batched pass. Each
  position's token is still sampled from the model's own distribution at that
  position; a proposal is kept only while it equals that sample, so the output has
  exactly the distribution of plain decoding (the proposal is deterministic) and the
  logprobs are the model's. Edits copy text the model has just read, so most of an
  edit's tokens arrive several per pass.

The repair's reads (`agent/repair.py`) run in a sequence of the KV cache of their own
(`READS`), with the conversation's cells saved to memory meanwhile (`_park`), so the
turn after a repair still finds its prompt cached. `top_tokens` takes
the log-softmax and the likeliest tokens of every row in float32, searching only the
vocabulary blocks that can hold them (`_top`); `greedy` decodes up to `GREEDY_SEQS`
continuations side by side, as sequences that share the cells of their common prefix.

Weights: a GGUF made from the Hugging Face folder (`_gguf.gguf_for`, Q8_0 by default,
cached), so a trained checkpoint in a folder runs here as it does on vLLM.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from opencomposer.agent.alternatives import CONTEXT_TOKENS
from opencomposer.agent.backends._local import (
    ChatTokenizer,
    alternative_turns,
    check_fits,
    passive_omp_wait,
    read_context_window,
    read_fix_samples,
    read_prompt_style,
    read_repair,
    read_turn_budget,
)
from opencomposer.agent.backends._stream import Emit, TaskStream
from opencomposer.agent.protocols import Message, ModelError, Sampling, TurnOutput

# llama.cpp's threads meet at an OpenMP barrier several hundred times per token; by
# default a waiting thread spins, and on a loaded machine (a build, a test run) the
# thread it waits for is off its core: measured here at load 13-17, 2 threads fell to
# 0.1 tokens/s (1 thread: 5.7); with passive waiting, 2 threads ran at 16-17.
# Read once, when libgomp loads (the first `import llama_cpp`); set it to override.
passive_omp_wait()

DRAFT_TOKENS = 12  # proposed per pass; a rejected proposal costs ~1 ms per token on 2 cores
NGRAMS = (3, 2)  # the suffix lengths looked up, longest first
# The KV cache's sequences: the conversation's, then the repair's reads (scores, top
# tokens, greedy prefixes), then GREEDY_SEQS greedy continuations decoded side by side
TURNS, READS = 0, 1
GREEDY_SEQS = 32


class LlamaCppModel:
    """The `Model` protocol on llama.cpp: one engine, one turn at a time (`_lock`)."""

    def __init__(
        self,
        path: str | Path,
        *,
        name: str | None = None,
        context_window: int | None = None,
        qtype: str = "q8_0",
        threads: int | None = None,
        draft: int = DRAFT_TOKENS,
        prompt_style: str | None = None,
    ) -> None:
        self.path = str(path)
        self.name = name or f"llamacpp:{path}"
        self.prompt_style = prompt_style or read_prompt_style(path)
        self.max_turns = read_turn_budget(path)  # a session without its own budget uses it
        # replies for a turn that changes files, the likeliest change kept (a session's
        # `fix_samples` unset uses it; `agent/alternatives.py`)
        self.fix_samples = read_fix_samples(path)
        # small edits of its own tried against a failing command (`agent/repair.py`)
        self.repair = read_repair(path)
        self.context_window = context_window or read_context_window(path)
        self.qtype = qtype
        self.threads = threads or len(os.sched_getaffinity(0))
        self.draft = draft
        self.tokenizer = ChatTokenizer(path)
        self.gguf: Path | None = None
        self._engine: _Engine | None = None
        self._start_lock = asyncio.Lock()
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        """Convert the weights if needed and load them (~1 s once converted); idempotent."""
        async with self._start_lock:
            if self._engine is not None:
                return
            try:
                self._engine = await asyncio.to_thread(self._build_engine)
            except Exception as e:
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise ModelError(f"llama.cpp could not start {self.path}: {first}") from e

    def _build_engine(self) -> _Engine:
        from opencomposer.agent.backends._gguf import gguf_for

        stop_ids = self.tokenizer.stop_ids()  # loads the tokenizer off the loop
        self.gguf = gguf_for(self.path, self.qtype)
        return _Engine(self.gguf, self.context_window, self.threads, stop_ids)

    async def close(self) -> None:
        async with self._lock:  # never free the context under a running turn
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()

    def count_tokens(self, text: str) -> int:
        return self.tokenizer.count(text)

    def stream(self, messages: list[Message], sampling: Sampling) -> TaskStream:
        async def produce(out: TurnOutput, emit: Emit) -> None:
            await self.start()
            prompt = await asyncio.to_thread(self.tokenizer.prompt_ids, messages)
            check_fits(len(prompt), self.context_window)
            out.prompt_token_ids, out.prompt_tokens = prompt, len(prompt)
            async with self._lock:
                engine = self._engine
                if engine is None:
                    raise ModelError("the llama.cpp engine was closed")
                await self._run(engine, prompt, sampling, out, emit)

        return TaskStream(produce)

    async def alternatives(
        self, turn: TurnOutput, keep: int, n: int, sampling: Sampling
    ) -> list[TurnOutput]:
        """`n` more replies that start as `turn` does up to `keep` characters and go on
        independently (`_local.alternative_turns`), one after another (the engine runs
        one stream), each reusing the cached prompt."""
        return await alternative_turns(
            turn,
            keep,
            n,
            self.tokenizer.hf.decode,
            lambda ids, k: self._continuations(ids, k, sampling),
        )

    async def _continuations(self, ids: list[int], n: int, sampling: Sampling) -> list[TurnOutput]:
        """`n` continuations of the token ids `ids`, sampled in turn; each output holds the
        continuation alone."""
        check_fits(len(ids), self.context_window)
        outs = []
        for i in range(n):
            more, pieces = TurnOutput(text=""), list[str]()
            seed = None if sampling.seed is None else sampling.seed + 1 + i
            async with self._lock:
                engine = self._engine
                if engine is None:
                    raise ModelError("the llama.cpp engine was closed")
                await self._run(engine, ids, replace(sampling, seed=seed), more, pieces.append)
            more.text = "".join(pieces)
            outs.append(more)
        return outs

    async def logprob(
        self, context: str, text: str, *, context_tokens: int = CONTEXT_TOKENS
    ) -> float:
        """As `VLLMModel.logprob`, on this engine: the scored tokens ask for logits, the
        context reuses what the cache holds (`_Engine.score`)."""
        ids, first = self.tokenizer.scored_ids(context, text, context_tokens)
        return float(await self._on_engine(lambda engine: engine.score(ids, first), len(ids)))

    async def top_tokens(
        self, ids: list[int], first: int, k: int
    ) -> list[tuple[float, list[tuple[int, float]]]]:
        """`repair.TokenLM.top_tokens` on this engine (`_Engine.top`)."""
        return await self._on_engine(lambda engine: engine.top(ids, first, k), len(ids))

    async def greedy(
        self, prefixes: list[list[int]], max_tokens: int, until: list[int]
    ) -> list[list[int]]:
        """`repair.TokenLM.greedy`, up to `GREEDY_SEQS` prefixes side by side
        (`_Engine.greedy`); each reuses what the cache shares with the one before."""
        longest = max((len(p) for p in prefixes), default=0) + max_tokens

        return await self._on_engine(lambda e: e.greedy(prefixes, max_tokens, until), longest)

    async def _on_engine(self, job: Callable[[_Engine], Any], tokens: int) -> Any:
        await self.start()
        check_fits(tokens, self.context_window)
        async with self._lock:
            engine = self._engine
            if engine is None:
                raise ModelError("the llama.cpp engine was closed")
            return await asyncio.to_thread(job, engine)

    async def _run(
        self, engine: _Engine, prompt: list[int], sampling: Sampling, out: TurnOutput, emit: Emit
    ) -> None:
        loop = asyncio.get_running_loop()
        stop = threading.Event()

        def deliver(text: str) -> None:  # from the engine's thread to the loop
            loop.call_soon_threadsafe(emit, text)

        job = loop.run_in_executor(
            None, engine.generate, prompt, sampling, out, deliver, stop, self.draft
        )
        try:
            await asyncio.shield(job)
        except asyncio.CancelledError:
            stop.set()  # the thread stops after its current step
            # Wait for it however often this task is cancelled again (a consumer's
            # generator finalizer cancels too): the lock, and the context, must not be
            # released while the thread still decodes.
            while not job.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([job])
            raise


def _amx_crashes() -> bool:
    """Whether this CPU has AMX tiles, where llama.cpp built natively puts the weights
    in its AMX buffer type, whose matrix multiply (``ggml_backend_amx_mul_mat``)
    crashed the process with SIGSEGV on the embedded model's first batch, whatever its
    size (Xeon with AMX, llama-cpp-python 0.3.36). Without the extra buffer types the
    weights stay in plain CPU buffers and the AVX-512 kernels run them."""
    from opencomposer.index.embed import cpu_has_amx

    return cpu_has_amx()


_PARAMS_LOCK = threading.Lock()


@contextlib.contextmanager
def _default_params(model: dict[str, Any], context: dict[str, Any]) -> Iterator[None]:
    """Set llama.cpp model and context params that ``llama_cpp.Llama`` takes no argument
    for (``use_extra_bufts``, ``n_seq_max``, ``kv_unified``) on the defaults its
    constructor starts from, while one engine is built."""
    from llama_cpp import llama as llama_module

    low = llama_module.llama_cpp
    saved = {}
    for name, fields in (
        ("llama_model_default_params", model),
        ("llama_context_default_params", context),
    ):
        saved[name] = defaults = getattr(low, name)

        def params(defaults: Callable[[], Any] = defaults, fields: dict[str, Any] = fields) -> Any:
            p = defaults()
            for k, v in fields.items():
                setattr(p, k, v)
            return p

        setattr(low, name, params)
    with _PARAMS_LOCK:
        try:
            yield
        finally:
            for name, defaults in saved.items():
                setattr(low, name, defaults)


class _Engine:
    """A llama.cpp context and the token ids its KV cache holds (positions 0..n-1)."""

    def __init__(self, gguf: Path, n_ctx: int, threads: int, stop_ids: set[int]) -> None:
        import llama_cpp

        # sequence TURNS holds the conversation, READS what the repair reads (so the
        # next turn still finds its prompt cached), and the GREEDY_SEQS after it the
        # continuations decoded side by side; one cache of n_ctx cells serves them all
        with _default_params(
            {"use_extra_bufts": not _amx_crashes()},
            {"n_seq_max": READS + 1 + GREEDY_SEQS, "kv_unified": True},
        ):
            self.llama = llama_cpp.Llama(
                model_path=str(gguf),
                n_ctx=n_ctx,
                n_batch=512,
                n_threads=threads,
                n_threads_batch=threads,
                verbose=False,
            )
        self.n_vocab = self.llama.n_vocab()
        self.stop_ids = stop_ids
        # the ids whose keys and values the cache holds, in sequence TURNS and READS
        self.cached: list[int] = []
        self.read: list[int] = []
        # the conversation's cells, saved to memory while the repair reads (`_park`)
        self.parked: tuple[Any, list[int]] | None = None
        self.pieces: dict[int, bytes] = {}
        self.stats: dict[str, float] = {}

    def close(self) -> None:
        self.llama.close()

    def _piece(self, token: int) -> bytes:
        """The token's bytes (special tokens have none, as vLLM's text skips them)."""
        piece = self.pieces.get(token)
        if piece is None:
            piece = self.pieces[token] = self.llama._model.detokenize([token])
        return piece

    def _held(self, seq: int) -> list[int]:
        return self.read if seq == READS else self.cached

    def _decode(self, tokens: list[int], *, all_logits: bool, seq: int = TURNS) -> Any:
        """Append `tokens` to sequence `seq` of the cache; the logits of every position
        (all_logits) or of the last one, as float32 rows [positions, vocab] the next
        decode won't touch."""
        import numpy as np

        ctx, batch = self.llama._ctx, self.llama._batch
        held = self._held(seq)
        rows = None
        for i in range(0, len(tokens), 512):
            chunk = tokens[i : i + 512]
            _fill(batch.batch, [(seq, t, len(held) + j) for j, t in enumerate(chunk)], all_logits)
            ctx.decode(batch)
            held.extend(chunk)
            n = len(chunk) if all_logits else 1
            rows = np.ctypeslib.as_array(ctx.get_logits(), shape=(n, self.n_vocab)).copy()
        return rows

    def _truncate(self, n: int, seq: int = TURNS) -> None:
        held = self._held(seq)
        if n < len(held):
            self.llama._ctx.kv_cache_seq_rm(seq, n, -1)
            del held[n:]

    def _park(self) -> None:
        """Before the repair's reads: the conversation's cells saved to memory and taken
        out of the cache. Every pass attends over all the cells in use, and ~1,500 of a
        conversation's made a ~20 s `propose` 3-7 s slower; saving and restoring them
        takes milliseconds, where evaluating the prompt again took 4-6 s."""
        if self.parked is not None or not self.cached:
            return
        import ctypes

        import llama_cpp

        ctx = self.llama._ctx.ctx
        size = llama_cpp.llama_state_seq_get_size(ctx, TURNS)
        buf = (ctypes.c_uint8 * size)()
        if size and llama_cpp.llama_state_seq_get_data(ctx, buf, size, TURNS) == size:
            self.parked = (buf, list(self.cached))
        self._truncate(0, TURNS)

    def _unpark(self) -> None:
        """Before a turn: the reads' cells dropped, the conversation's put back (when
        they cannot be, the turn evaluates its prompt anew)."""
        self._truncate(0, READS)
        if self.parked is None:
            return
        import llama_cpp

        buf, ids = self.parked
        self.parked = None
        self._truncate(0, TURNS)
        if llama_cpp.llama_state_seq_set_data(self.llama._ctx.ctx, buf, len(buf), TURNS):
            self.cached = ids

    def _room(self, cells: int) -> None:
        """Make room in the cache for `cells` more cells of the repair's reads: the
        conversation's are dropped when both cannot fit (the next turn reads its
        prompt anew)."""
        if len(self.cached) + len(self.read) + cells > self.llama.n_ctx():
            self._truncate(0, TURNS)

    def generate(
        self,
        prompt: list[int],
        sampling: Sampling,
        out: TurnOutput,
        emit: Callable[[str], None],
        stop: threading.Event,
        draft: int,
    ) -> None:
        """One turn, in the calling (worker) thread; `stop` set ends it after this step."""
        try:
            self._unpark()
            self._generate(prompt, sampling, out, emit, stop, draft)
        except BaseException:
            self.reset()  # what the cache holds is no longer known
            raise

    def score(self, ids: list[int], first: int) -> float:
        """The sum of the log-probabilities of `ids[first:]`, each after the ids before
        it; the cache keeps what it shares with `ids`. Only the scored positions ask
        for logits over the vocabulary."""
        return sum(
            here for rows, targets in self._rows(ids, first) for here, _ in _top(rows, targets, 0)
        )

    def top(
        self, ids: list[int], first: int, k: int
    ) -> list[tuple[float, list[tuple[int, float]]]]:
        """For each of `ids[first:]`: (its log-probability after the ids before it, the
        `k` likeliest tokens there with theirs), as `score` reads the cache."""
        return [row for rows, targets in self._rows(ids, first) for row in _top(rows, targets, k)]

    def _rows(self, ids: list[int], first: int) -> Iterator[tuple[Any, list[int]]]:
        """(logit rows, the ids they predict) for `ids[first:]`, a chunk at a time: the
        context up to `ids[first]` reuses what the cache shares with it, its last row
        predicts `ids[first]`, then every row of the rest. Nothing when `first` is out
        of range."""
        if not 0 < first < len(ids):
            return
        try:
            self._park()
            common = min(_common_prefix(self.read, ids), first - 1)
            self._truncate(common, READS)
            self._room(len(ids) - common)
            yield self._decode(ids[common:first], all_logits=False, seq=READS), [ids[first]]
            for i in range(first, len(ids) - 1, 512):
                chunk = ids[i : min(i + 512, len(ids) - 1)]
                rows = self._decode(chunk, all_logits=True, seq=READS)
                yield rows, ids[i + 1 : i + 1 + len(chunk)]
        except BaseException:
            self.reset()  # what the cache holds is no longer known
            raise

    def greedy(
        self, prefixes: list[list[int]], max_tokens: int, until: list[int]
    ) -> list[list[int]]:
        """The greedy continuation of each prefix, `max_tokens` at most, up to a stop
        token or its `until` (kept). Up to `GREEDY_SEQS` continuations are decoded side
        by side, each a sequence of the cache that shares the cells of the prefix before
        it (one pass of n tokens costs about what one of a single token does on this
        model); sequence READS ends holding the last prefix but its last token."""
        out: list[list[int]] = []
        try:
            self._park()
            for lo in range(0, len(prefixes), GREEDY_SEQS):
                group = prefixes[lo : lo + GREEDY_SEQS]
                out += self._greedy_group(group, max_tokens, until[lo : lo + GREEDY_SEQS])
        except BaseException:
            self.reset()
            raise
        return out

    def _greedy_group(
        self, prefixes: list[list[int]], max_tokens: int, until: list[int]
    ) -> list[list[int]]:
        import numpy as np

        ctx, batch = self.llama._ctx, self.llama._batch
        # a cell per token of what the prefixes do not share, and per token continued
        cells, held = 0, self.read
        for p in prefixes:
            cells += len(p) - 1 - min(_common_prefix(held, p), len(p) - 1)
            held = p[:-1]
        cells += len(prefixes) * (max_tokens + 1)
        self._room(cells)
        if len(self.read) + cells > self.llama.n_ctx():
            return [self._greedy_one(p, max_tokens, u) for p, u in zip(prefixes, until, strict=True)]  # fmt: skip
        out: list[list[int]] = [[] for _ in prefixes]
        first = READS + 1  # the sequence of prefixes[0]
        # (sequence, its next token, that token's position)
        live: list[tuple[int, int, int]] = []
        for seq, p in enumerate(prefixes, start=first):
            if not p:
                continue
            common = min(_common_prefix(self.read, p), len(p) - 1)
            self._truncate(common, READS)
            self._decode(p[common:-1], all_logits=False, seq=READS)
            ctx.kv_cache_seq_cp(READS, seq, 0, len(p) - 1)
            live.append((seq, p[-1], len(p) - 1))
        try:
            while live:
                _fill(batch.batch, live, True)
                ctx.decode(batch)
                rows = np.ctypeslib.as_array(ctx.get_logits(), shape=(len(live), self.n_vocab))
                best = rows.argmax(axis=1)
                going = []
                for (seq, _, pos), token in zip(live, best.tolist(), strict=True):
                    got = out[seq - first]
                    if token in self.stop_ids:
                        continue
                    got.append(token)
                    if token != until[seq - first] and len(got) < max_tokens:
                        going.append((seq, token, pos + 1))
                live = going
        finally:
            for seq in range(first, first + len(prefixes)):
                ctx.kv_cache_seq_rm(seq, -1, -1)
        return out

    def _greedy_one(self, prefix: list[int], max_tokens: int, until: int) -> list[int]:
        """One greedy continuation in sequence READS, a token per pass."""
        import numpy as np

        out: list[int] = []
        common = min(_common_prefix(self.read, prefix), len(prefix) - 1)
        self._truncate(common, READS)
        self._room(len(prefix) - common + max_tokens)
        rows = self._decode(prefix[common:], all_logits=False, seq=READS)
        while len(out) < max_tokens:
            token = int(np.argmax(rows[-1]))
            if token in self.stop_ids:
                break
            out.append(token)
            if token == until:
                break
            if len(out) < max_tokens:
                rows = self._decode([token], all_logits=False, seq=READS)
        return out

    def reset(self) -> None:
        """Forget the cached prefix (the next turn evaluates its whole prompt)."""
        self.llama._ctx.kv_cache_clear()
        self.cached, self.read, self.parked = [], [], None

    def _generate(
        self,
        prompt: list[int],
        sampling: Sampling,
        out: TurnOutput,
        emit: Callable[[str], None],
        stop: threading.Event,
        draft: int,
    ) -> None:
        t0 = time.perf_counter()
        common = _common_prefix(self.cached, prompt)
        common = min(common, len(prompt) - 1)  # the last prompt token gives the logits
        self._truncate(common)
        logits = self._decode(prompt[common:], all_logits=False)
        t1 = time.perf_counter()

        ids: list[int] = []
        logprobs: list[float] = []
        out.completion_token_ids, out.completion_logprobs = ids, logprobs
        sampler = _Sampler(sampling)
        drafts = _Drafts(prompt) if draft > 0 else None
        text = _Text(sampling.stop, emit)
        budget = min(sampling.max_tokens, self.llama.n_ctx() - len(prompt))
        passes = proposed = accepted = 0
        engine_s = sample_s = 0.0
        rows = logits
        proposal: list[int] = []
        while not stop.is_set():
            # rows[i] is the distribution after the cache's last token and proposal[:i]
            done = False
            for i in range(len(rows)):
                ts = time.perf_counter()
                token, logprob = sampler.sample(rows[i])
                sample_s += time.perf_counter() - ts
                ids.append(token)
                logprobs.append(logprob)
                out.completion_tokens += 1
                keep = i < len(proposal) and proposal[i] == token
                accepted += keep
                if token in self.stop_ids:
                    out.finish_reason = "stop"
                    done = True
                elif text.add(self._piece(token)):
                    out.finish_reason, out.meta["stop_reason"] = "stop", text.stop_reason
                    done = True
                elif len(ids) >= budget:
                    out.finish_reason = "length"
                    done = True
                if done or not keep:
                    # proposal[i:] were evaluated for nothing: drop them from the cache
                    self._truncate(len(self.cached) - len(proposal) + i)
                    break
            if done:
                break
            last = ids[-1]
            proposal = drafts.propose(ids, draft) if drafts is not None else []
            proposal = proposal[: max(0, budget - len(ids) - 1)]
            passes += 1
            proposed += len(proposal)
            ts = time.perf_counter()
            rows = self._decode([last, *proposal], all_logits=bool(proposal))
            engine_s += time.perf_counter() - ts
        else:
            out.finish_reason = "cancelled"
        text.flush()
        out.meta.update(
            prompt_reused_tokens=common,
            prefill_s=round(t1 - t0, 4),
            decode_s=round(time.perf_counter() - t1, 4),
            engine_s=round(engine_s, 4),  # llama_decode of the reply's passes
            sampler_s=round(sample_s, 4),
            decode_passes=passes,
            draft_proposed=proposed,
            draft_accepted=accepted,
        )


# `_top` finds a row's k likeliest tokens among the vocabulary's blocks of this many:
# the k tokens lie in the k blocks with the highest maxima, so only those are sorted.
# For 64 rows of ~49k logits, np.argpartition took 42 ms; `_top` with k = 8, its
# log-softmax included, 16 ms (2-core AMD EPYC).
TOP_BLOCK = 64


def _top(rows: Any, targets: list[int], k: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """For each row of logits [positions, vocab]: (the log-probability of its target,
    its `k` likeliest tokens as (id, log-probability), likeliest first). The
    log-softmax is taken in float32, whose rounding (~1e-6 nat) is far below what a
    bf16 or Q8_0 model's own noise moves a score."""
    import numpy as np

    logits = np.asarray(rows, dtype=np.float32)
    n, vocab = logits.shape
    peak = logits.max(axis=1, keepdims=True)
    lse = (peak + np.log(np.exp(logits - peak).sum(axis=1, keepdims=True)))[:, 0]
    here = logits[np.arange(n), targets] - lse
    if k <= 0:
        return [(float(h), []) for h in here]
    blocks = -(-vocab // TOP_BLOCK)
    k = min(k, vocab)
    if k >= blocks:
        order = np.argsort(-logits, axis=1)[:, :k]
    else:
        padded = np.full((n, blocks * TOP_BLOCK), -np.inf, dtype=np.float32)
        padded[:, :vocab] = logits
        best_blocks = np.argpartition(-padded.reshape(n, blocks, TOP_BLOCK).max(axis=2), k - 1, axis=1)[:, :k]  # fmt: skip
        ids = (best_blocks[:, :, None] * TOP_BLOCK + np.arange(TOP_BLOCK)).reshape(n, -1)
        values = np.take_along_axis(padded, ids, axis=1)
        picked = np.argpartition(-values, k - 1, axis=1)[:, :k]
        order = np.take_along_axis(ids, picked, axis=1)
        order = np.take_along_axis(order, np.argsort(-np.take_along_axis(logits, order, axis=1), axis=1), axis=1)  # fmt: skip
    logp = np.take_along_axis(logits, order, axis=1) - lse[:, None]
    return [
        (float(here[r]), [(int(t), float(lp)) for t, lp in zip(order[r], logp[r], strict=True)])
        for r in range(n)
    ]


def _fill(batch: Any, tokens: Sequence[tuple[int, int, int]], all_logits: bool) -> None:
    """A llama batch of `tokens`, each (sequence, token id, position); logits for every
    token (all_logits) or the last one."""
    batch.n_tokens = len(tokens)
    for i, (seq, token, pos) in enumerate(tokens):
        batch.token[i] = token
        batch.pos[i] = pos
        batch.seq_id[i][0] = seq
        batch.n_seq_id[i] = 1
        batch.logits[i] = all_logits
    if tokens:
        batch.logits[len(tokens) - 1] = True


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _Sampler:
    """Temperature + top-p sampling on raw logits, with the raw logprob of the sample.

    Top-p needs the distribution sorted, but at the temperatures an agent uses almost
    all the mass sits in a few tokens: the 64 largest are sorted first and the whole
    vocabulary only when they hold less than `top_p` (the result is the same)."""

    def __init__(self, sampling: Sampling) -> None:
        import numpy as np

        self.temperature = sampling.temperature
        self.top_p = sampling.top_p
        self.rng = np.random.default_rng(sampling.seed)

    def sample(self, logits: Any) -> tuple[int, float]:
        import numpy as np

        top = float(logits.max())
        lse = top + float(np.log(np.exp(logits - top).sum()))
        if self.temperature <= 0:
            token = int(logits.argmax())
            return token, float(logits[token]) - lse
        z = np.exp((logits - top) / self.temperature)
        total = float(z.sum())
        if self.top_p >= 1.0:  # the whole distribution: nothing to sort
            token = int(self.rng.choice(len(z), p=z / total))
            return token, float(logits[token]) - lse
        k = 64
        head = np.argpartition(z, -k)[-k:]
        head = head[np.argsort(z[head])[::-1]]
        if float(z[head].sum()) < self.top_p * total:
            head = np.argsort(z)[::-1]
        cum = np.cumsum(z[head]) / total
        # the token that crosses top_p stays; rounding can leave cum[-1] just under top_p
        keep = min(len(head), int(np.searchsorted(cum, self.top_p)) + 1)
        probs = z[head[:keep]] / float(z[head[:keep]].sum())
        token = int(head[int(self.rng.choice(keep, p=probs))])
        return token, float(logits[token]) - lse


class _Drafts:
    """Prompt-lookup proposals: where did the last few tokens occur before, and what
    followed them there? An index from each n-gram to the position after its latest
    earlier occurrence, kept up to date as the reply grows."""

    def __init__(self, prompt: list[int]) -> None:
        self.tokens = list(prompt)
        self.prompt_len = len(prompt)
        self.index: dict[tuple[int, ...], int] = {}
        for end in range(1, len(self.tokens)):
            self._add(end)

    def _add(self, end: int) -> None:
        """Record the n-grams that end just before position `end` (which exists)."""
        for n in NGRAMS:
            if end >= n:
                self.index[tuple(self.tokens[end - n : end])] = end

    def propose(self, reply: list[int], k: int) -> list[int]:
        """Up to `k` tokens that may follow prompt + `reply`."""
        for token in reply[len(self.tokens) - self.prompt_len :]:
            self.tokens.append(token)
            self._add(len(self.tokens) - 1)
        end = len(self.tokens)
        for n in NGRAMS:
            j = self.index.get(tuple(self.tokens[end - n : end])) if end >= n else None
            if j is not None:
                return self.tokens[j : j + k]
        return []


class _Text:
    """The reply's text from token pieces (bytes, UTF-8 decoded incrementally), handed
    to `emit` as it grows, less any tail that may be the start of a stop string; a stop
    string ends the text before it, as vLLM does."""

    def __init__(self, stops: tuple[str, ...], emit: Callable[[str], None]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.emit = emit
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.sent = 0
        self.stop_reason: str | None = None

    def add(self, piece: bytes) -> bool:
        """Append one token's bytes; True when a stop string has appeared."""
        self.text += self.decoder.decode(piece)
        if self.stops:
            hits = [(i, s) for s in self.stops if (i := self.text.find(s, self.sent)) >= 0]
            if hits:
                cut, self.stop_reason = min(hits)
                self.text = self.text[:cut]
                return True
        upto = len(self.text) - self.hold
        if upto > self.sent:
            self.emit(self.text[self.sent : upto])
            self.sent = upto
        return False

    def flush(self) -> None:
        if self.stop_reason is None:
            self.text += self.decoder.decode(b"", final=True)
        if len(self.text) > self.sent:
            self.emit(self.text[self.sent :])
            self.sent = len(self.text)
