"""Embedded model speed: vLLM in-process against the `hf:` (transformers) backend.

Measures, on this machine and in one run, SmolLM2-135M-Instruct's time to first
token and generated tokens per second, for one prompt alone and for 8 prompts at
once (vLLM batches them in one engine; the hf backend runs one sequence per
worker thread), and prints vLLM's figures as ratios of hf's. Both backends get the
same prompts, the same sampling (temperature 0.7, fixed seeds) and the same token
budget; one warm-up turn each is not timed. Engine start and model load times are
printed too.

Run: `.venv/bin/python benchmarks/model.py [--max-tokens 64] [--batch 8]`
(the vLLM engine start takes ~25 s on an idle 2-core machine, much longer under load).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from opencomposer.agent.backends import make_model
from opencomposer.agent.protocols import Message, Model, Sampling

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash map is to a new programmer.",
    "List ten fruits and one fact about each.",
    "Describe how a binary search works, step by step.",
    "Write a short story about a robot learning to paint.",
    "What are the differences between TCP and UDP?",
    "Write a bash script that counts the lines of every .py file in a folder.",
    "Explain recursion with an example in JavaScript.",
]


async def run_batch(model: Model, prompts: list[str], max_tokens: int) -> tuple[float, float]:
    """(mean time to first token in s, generated tokens per second over the batch)."""
    streams = [
        model.stream(
            [Message(role="user", content=p)],
            Sampling(temperature=0.7, top_p=0.95, max_tokens=max_tokens, seed=i),
        )
        for i, p in enumerate(prompts)
    ]

    async def drain(stream) -> None:  # type: ignore[no-untyped-def]
        async for _ in stream:
            pass

    start = time.monotonic()
    await asyncio.gather(*(drain(s) for s in streams))
    wall = time.monotonic() - start
    outputs = [s.output for s in streams]
    ttft = statistics.mean(float(o.meta.get("time_to_first_token_s", wall)) for o in outputs)
    tokens = sum(o.completion_tokens for o in outputs)
    return ttft, tokens / wall


async def measure(spec: str, max_tokens: int, batch: int) -> dict[str, float]:
    model = make_model(spec)
    start = time.monotonic()
    await model.start()  # type: ignore[attr-defined]
    figures = {"start_s": time.monotonic() - start}
    try:
        await run_batch(model, PROMPTS[:1], 8)  # warm-up
        figures["ttft_1"], figures["tps_1"] = await run_batch(model, PROMPTS[:1], max_tokens)
        prompts = (PROMPTS * ((batch + len(PROMPTS) - 1) // len(PROMPTS)))[:batch]
        figures["ttft_n"], figures["tps_n"] = await run_batch(model, prompts, max_tokens)
    finally:
        await model.close()
    return figures


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    results = {}
    for label, spec in (("hf", "hf:smollm2"), ("vllm", "vllm:smollm2")):
        results[label] = await measure(spec, args.max_tokens, args.batch)
        print(
            f"{label}: " + ", ".join(f"{k}={v:.3f}" for k, v in results[label].items()), flush=True
        )
    hf, vl = results["hf"], results["vllm"]
    n = args.batch
    print(f"\nSmolLM2-135M, {args.max_tokens} tokens per prompt; vLLM relative to hf (same run):")
    print(f"{'':28}{'hf':>10}{'vllm':>10}{'vllm/hf':>10}")
    rows = [
        ("load / engine start (s)", "start_s", False),
        ("TTFT, 1 prompt (s)", "ttft_1", False),
        ("tokens/s, 1 prompt", "tps_1", True),
        (f"TTFT, {n} prompts (s)", "ttft_n", False),
        (f"tokens/s, {n} prompts", "tps_n", True),
    ]
    for title, key, higher_better in rows:
        ratio = vl[key] / hf[key] if hf[key] else float("nan")
        note = "x faster" if higher_better else "x the time"
        print(f"{title:28}{hf[key]:10.3f}{vl[key]:10.3f}{ratio:10.2f} {note}")


if __name__ == "__main__":
    asyncio.run(main())
