"""bf16 against fp32 on this CPU: the GEMM, an SFT step, and the vLLM sampler.

The trainer (`training/trainer.py`, `compute_dtype`) and the `vllm:` backend
(`agent/backends/vllm.py`, `default_dtype`) compute in bf16 only where the CPU has
native bf16 (AVX512-BF16 or AMX); elsewhere (an AVX2-only CPU, say) bf16 runs on a slow
fallback and they compute in fp32. This script measures what that choice is worth here,
from one run, and prints each figure as a ratio to fp32's:

- GEMM: one `[2000, 576] x [576, 1536]` linear (a SmolLM2-135M MLP projection over a
  2,000-token sequence), one thread and every thread;
- SFT step: `Trainer.sft_step` on one `--tokens`-token sample, LoRA rank 16 as
  `configs/embedded.toml` trains (the forward and backward of the whole model), with the
  compute dtype forced to each;
- vLLM: the `vllm:` backend on the embedded model, a `--tokens`-token prompt's prefill
  and a 64-token greedy decode, one stream and 8 sampled streams at once (the RL
  sampler's batch), with `dtype` forced to each (`--skip-vllm` to leave it;
  `--skip-train` leaves the GEMM and the SFT step).

Each figure is the best of `--runs`; the CPU, its bf16 flags and the load average are
printed beside them (this machine is shared; the ratios hold better than the times).

    .venv/bin/python benchmarks/precision.py [--runs 2] [--tokens 1500] [--skip-vllm]
        [--skip-train]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import time
from pathlib import Path
from typing import Any

import torch
from opencomposer.agent.backends import smollm2
from opencomposer.agent.backends.vllm import VLLMModel, default_dtype
from opencomposer.agent.protocols import Message, Sampling
from opencomposer.index.embed import cpu_has_bf16
from opencomposer.training.rollouts import Sample
from opencomposer.training.trainer import Trainer, TrainerConfig, compute_dtype


def machine() -> str:
    info = Path("/proc/cpuinfo").read_text()
    found = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    cpu = found.group(1).strip() if found else "unknown CPU"
    listed = re.search(r"^flags\s*:(.*)$", info, re.M)
    shown = {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    flags = sorted(shown & set(listed.group(1).split() if listed else ()))
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{cpu}, {os.cpu_count()} cores, flags {' '.join(flags) or 'none'}; load {load}"


def best(fn: Any, runs: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def gemm(threads: int, runs: int) -> dict[str, float]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    x, w = torch.randn(2000, 576), torch.randn(1536, 576)
    try:
        out = {}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            a, b = x.to(dtype), w.to(dtype)
            out[name] = best(lambda a=a, b=b: torch.nn.functional.linear(a, b), runs)
        return out
    finally:
        torch.set_num_threads(previous)


def sft_step(tokens: int, runs: int) -> dict[str, float]:
    config = TrainerConfig(lr=3e-4, precision="bf16", lora_rank=16, lora_alpha=32)
    trainer = Trainer.from_pretrained(smollm2.smollm2_path(base=True), config)
    rng = random.Random(0)
    ids = [rng.randrange(1000, 40000) for _ in range(tokens)]
    mask = [1 if i % 5 == 4 else 0 for i in range(tokens)]  # a fifth generated, as in traces
    sample = Sample(input_ids=ids, mask=mask, old_logprobs=[0.0] * tokens, advantage=1.0)
    out = {}
    for name in ("fp32", "bf16"):
        trainer.compute_dtype = name
        out[name] = best(lambda: trainer.sft_step([sample]), runs)
    return out


async def drain(stream: Any) -> None:
    async for _ in stream:
        pass


async def vllm_rates(tokens: int, runs: int) -> dict[str, dict[str, float]]:
    folder = smollm2.smollm2_path(base=True)
    out = {}
    for name, dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
        model = VLLMModel(folder, dtype=dtype)
        await model.start()
        prompt = model.tokenizer.hf.decode(
            [random.Random(1).randrange(1000, 40000) for _ in range(tokens)]
        )
        long = [Message(role="user", content=prompt)]
        ask = [Message(role="user", content="List twenty fruits, one per line.")]
        rates = {"prefill": float("inf"), "decode": float("inf"), "batch": float("inf")}
        try:
            for i in range(runs + 1):
                start = time.perf_counter()
                stream = model.stream(long, Sampling(max_tokens=1, seed=i))
                async for _ in stream:
                    pass
                if i:
                    rates["prefill"] = min(rates["prefill"], time.perf_counter() - start)
                times = []
                stream = model.stream(ask, Sampling(temperature=0, max_tokens=64))
                async for _ in stream:
                    times.append(time.perf_counter())
                n = stream.output.completion_tokens
                if i and n > 1:
                    rates["decode"] = min(rates["decode"], (times[-1] - times[0]) / (n - 1))
                streams = [
                    model.stream(ask, Sampling(temperature=0.7, max_tokens=64, seed=k))
                    for k in range(8)
                ]
                start = time.perf_counter()
                await asyncio.gather(*(drain(s) for s in streams))
                made = sum(s.output.completion_tokens for s in streams)
                if i and made:
                    rates["batch"] = min(rates["batch"], (time.perf_counter() - start) / made)
        finally:
            await model.close()
        out[name] = rates
    return out


def row(label: str, fp32: float, bf16: float, unit: str = "s") -> str:
    return f"| {label} | {fp32:.3f} {unit} | {bf16:.3f} {unit} | {bf16 / fp32:.2f}x |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-train", action="store_true")
    a = ap.parse_args()
    print(machine())
    chosen_train = compute_dtype("bf16", torch.device("cpu"))
    print(
        f"native bf16: {cpu_has_bf16()}; the trainer's `bf16` computes in {chosen_train}, "
        f"the vLLM sampler loads {default_dtype()}"
    )
    print("\n| figure | fp32 | bf16 | bf16 / fp32 (time) |\n|---|---|---|---|")
    cores = len(os.sched_getaffinity(0))
    if not a.skip_train:
        for threads in sorted({1, cores}):
            g = gemm(threads, max(3, a.runs))
            label = f"GEMM 2000x576x1536, {threads} thread(s)"
            print(row(label, g["fp32"], g["bf16"]), flush=True)
        s = sft_step(a.tokens, a.runs)
        label = f"SFT step, one {a.tokens}-token sample (LoRA)"
        print(row(label, s["fp32"], s["bf16"]), flush=True)
    if not a.skip_vllm:
        v = asyncio.run(vllm_rates(a.tokens, a.runs))
        print(
            row(
                f"vLLM prefill, {a.tokens}-token prompt", v["fp32"]["prefill"], v["bf16"]["prefill"]
            )
        )
        print(row("vLLM decode, per token", v["fp32"]["decode"], v["bf16"]["decode"]))
        print(row("vLLM, 8 streams, per token", v["fp32"]["batch"], v["bf16"]["batch"]))


if __name__ == "__main__":
    main()
