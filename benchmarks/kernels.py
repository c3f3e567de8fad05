"""Kernel numbers: MXFP8 accuracy and quantization speed, grouped MoE against the
per-expert loop, a tiny MoE language model trained in bf16 and in MXFP8, and (on a GPU)
bf16 against FP8 GEMM and grouped-GEMM TFLOP/s.

Every speed is a ratio to a baseline measured in the same run (median of repeats,
interleaved), because this CPU is shared and absolute times swing.

    .venv/bin/python benchmarks/kernels.py                 # everything that runs here
    .venv/bin/python benchmarks/kernels.py --only moe,sqnr # a subset
    .venv/bin/python benchmarks/kernels.py --json out.json # also write the numbers

Sections: sqnr, quantize, moe, train, gpu (skipped without CUDA).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from opencomposer.kernels import mx
from opencomposer.kernels.moe import MoE

ROOT = Path(__file__).resolve().parents[1]
RESULTS: dict[str, object] = {}


def timed(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, runs interleaved so load swings hit all alike."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def report(key: str, value: object, text: str) -> None:
    RESULTS[key] = value
    print(f"  {text}", flush=True)


# ---------------------------------------------------------------------------- SQNR


def bench_sqnr() -> None:
    print("SQNR of quantize/dequantize on N(0,1), 4M values (expected ~31 dB E4M3, ~25 dB E5M2)")
    x = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(0))
    for elem in ("e4m3", "e5m2"):
        for mode in ("floor", "rceil"):
            db = mx.sqnr_db(x, mx.quantize(x, elem=elem, mode=mode).dequantize())
            report(f"sqnr_{elem}_{mode}_db", round(db, 2), f"{elem} {mode:5s}: {db:.2f} dB")


# ------------------------------------------------------------------------ quantize


def naive_quantize(x: torch.Tensor, elem: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """The straightforward way: one block at a time, log2 in floating point."""
    fmt = mx.ELEM_FORMATS[elem]
    rows, k = x.shape
    data = torch.empty(rows, k, dtype=fmt.dtype)
    scales = torch.empty(rows, k // 32, dtype=torch.uint8)
    for i in range(rows):
        for b in range(k // 32):
            blk = x[i, b * 32 : (b + 1) * 32]
            amax = blk.abs().max()
            exp = torch.floor(torch.log2(amax)) - fmt.emax if amax > 0 else torch.tensor(-127.0)
            exp = exp.clamp(-127, 127)
            data[i, b * 32 : (b + 1) * 32] = (
                (blk / 2**exp).clamp(-fmt.max_normal, fmt.max_normal).to(fmt.dtype)
            )
            scales[i, b] = int(exp) + 127
    return data, scales


def bench_quantize() -> None:
    print("Quantize throughput (E4M3, floor), elements/s as a ratio to baselines")
    x = torch.randn(2048, 1024, generator=torch.Generator().manual_seed(0))  # 2M values
    small = x[:16]  # 512 blocks for the per-block loop
    t = timed({"ours": lambda: mx.quantize(x), "naive": lambda: naive_quantize(small)}, 3)
    ours_rate, naive_rate = x.numel() / t["ours"], small.numel() / t["naive"]
    d, s = naive_quantize(small)
    q = mx.quantize(small)
    same = torch.equal(d.view(torch.uint8), q.data.view(torch.uint8)) and torch.equal(s, q.scales)
    report("quantize_melem_per_s", round(ours_rate / 1e6, 1), f"ours: {ours_rate / 1e6:.1f} M/s")
    report(
        "quantize_vs_naive",
        round(ours_rate / naive_rate, 1),
        f"per-block torch loop: {naive_rate / 1e6:.3f} M/s -> ours is "
        f"{ours_rate / naive_rate:.0f}x (bit-identical on its blocks: {same})",
    )
    try:
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except Exception as e:  # torchao is optional: pip install --no-deps torchao
        report("quantize_vs_torchao", None, f"torchao to_mx unavailable ({type(e).__name__})")
        return
    t = timed(
        {"ours": lambda: mx.quantize(x), "torchao": lambda: to_mx(x, torch.float8_e4m3fn, 32)}, 5
    )
    from torchao.prototype.mx_formats.config import ScaleCalculationMode as Mode

    agree = {}
    for mode, theirs in (("floor", Mode.FLOOR), ("rceil", Mode.RCEIL)):
        scale, data = to_mx(x, torch.float8_e4m3fn, 32, scaling_mode=theirs)
        q = mx.quantize(x, mode=mode)
        agree[mode] = torch.equal(data.view(torch.uint8), q.data.view(torch.uint8)) and (
            torch.equal(scale.view(torch.uint8).reshape(-1), q.scales.reshape(-1))
        )
    report(
        "quantize_vs_torchao",
        round(t["torchao"] / t["ours"], 2),
        f"torchao to_mx (emulated, eager): {x.numel() / t['torchao'] / 1e6:.1f} M/s -> ours is "
        f"{t['torchao'] / t['ours']:.2f}x (bit-identical, floor/rceil: {agree})",
    )


# ----------------------------------------------------------------------------- MoE


def bench_moe() -> None:
    tokens, dim, hidden = 2048, 576, 1536  # SmolLM2-135M's MLP, 8 experts, top-2
    print(
        f"MoE layer forward+backward, {tokens} tokens, dim {dim}, expert hidden {hidden}, "
        "8 experts, top-2: grouped (_grouped_mm) vs per-expert loop"
    )
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(0)
        layer = MoE(MoE.Config(dim=dim, hidden=hidden, num_experts=8, top_k=2)).to(dtype)
        x = torch.randn(tokens, dim, dtype=dtype, requires_grad=True)
        g = torch.randn(tokens, dim, dtype=dtype)

        def run(impl: str, fwd_only: bool = False, layer=layer, x=x, g=g) -> None:
            layer.experts.config = dataclasses.replace(layer.experts.config, impl=impl)
            if fwd_only:
                with torch.no_grad():
                    layer(x)
                return
            layer(x).backward(g)

        t = timed({"grouped": lambda: run("grouped"), "loop": lambda: run("loop")}, 5)
        f = timed({"grouped": lambda: run("grouped", True), "loop": lambda: run("loop", True)}, 5)
        name = str(dtype).removeprefix("torch.")
        report(
            f"moe_speedup_{name}",
            round(t["loop"] / t["grouped"], 2),
            f"{name}: fwd+bwd loop {t['loop'] * 1e3:.0f} ms, grouped {t['grouped'] * 1e3:.0f} ms "
            f"-> {t['loop'] / t['grouped']:.2f}x; forward only -> {f['loop'] / f['grouped']:.2f}x",
        )


# --------------------------------------------------------------------------- train


def bench_train(steps: int) -> None:
    from opencomposer.kernels.tiny import TrainConfig, train

    text = b"".join(p.read_bytes() for p in sorted(ROOT.glob("kernels/*.py")))
    print(f"Tiny MoE LM (8 experts, top-2), {steps} steps on {len(text) // 1000} kB of source")
    runs = {}
    for precision in ("bf16", "mxfp8"):
        t = time.perf_counter()
        runs[precision] = train(TrainConfig(steps=steps, precision=precision), text)
        final = statistics.mean(runs[precision][-20:])
        report(
            f"train_{precision}_final_loss",
            round(final, 4),
            f"{precision}: first {runs[precision][0]:.3f}, final (mean of last 20) {final:.4f} "
            f"in {time.perf_counter() - t:.0f} s",
        )
    a, b = (statistics.mean(runs[p][-20:]) for p in ("bf16", "mxfp8"))
    report(
        "train_rel_gap", round(abs(b - a) / a, 4), f"relative gap {abs(b - a) / a:.2%} (bound 3%)"
    )


# ----------------------------------------------------------------------------- GPU


def tflops(flops: float, seconds: float) -> float:
    return flops / seconds / 1e12


def bench_gpu() -> None:
    if not torch.cuda.is_available():
        print("GPU: no CUDA device here; skipped")
        return
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    print(f"GPU {name} (capability {torch.cuda.get_device_capability(dev)}), MX backend "
          f"{mx.gemm_backend(dev)}")  # fmt: skip

    def cuda_time(fn: Callable[[], object], reps: int = 20) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / reps

    m = n = k = 8192
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    flops = 2 * m * n * k
    results = {"bf16": cuda_time(lambda: a @ b.t())}
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.tensor(1.0, device=dev)
    try:
        results["fp8 tensorwise _scaled_mm"] = cuda_time(
            lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        )
    except Exception as e:
        print(f"  fp8 _scaled_mm failed: {str(e).splitlines()[0]}")
    qa, qb = mx.quantize(a), mx.quantize(b)
    try:
        results[f"mxfp8 ({mx.gemm_backend(dev)})"] = cuda_time(
            lambda: mx.mx_mm(qa, qb, torch.bfloat16)
        )
        ref = mx.mx_mm(qa, qb, torch.float32, "emulated")
        got = mx.mx_mm(qa, qb, torch.float32)
        print(f"  mx_mm vs emulation max rel err {((got - ref).abs().max() / ref.abs().max()):.2e}")
    except Exception as e:
        print(f"  mx_mm failed: {str(e).splitlines()[0]}")
    for label, s in results.items():
        report(f"gpu_gemm_{label}", round(tflops(flops, s), 1), f"GEMM {m}^3 {label}: "
               f"{tflops(flops, s):.0f} TFLOP/s")  # fmt: skip

    experts, tokens, dim, hidden = 8, 16384, 4096, 8192  # per-expert 2048 tokens
    x = torch.randn(tokens, dim, device=dev, dtype=torch.bfloat16)
    w = torch.randn(experts, hidden, dim, device=dev, dtype=torch.bfloat16)
    offs = torch.arange(1, experts + 1, device=dev, dtype=torch.int32) * (tokens // experts)
    gflops = 2 * tokens * dim * hidden
    grouped = {
        "bf16 _grouped_mm": cuda_time(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))
    }
    try:
        x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
        sa = torch.ones(tokens, device=dev)
        sb = torch.ones(experts, hidden, device=dev)
        grouped["fp8 rowwise _scaled_grouped_mm"] = cuda_time(
            lambda: torch._scaled_grouped_mm(
                x8, w8.transpose(-2, -1), sa, sb, offs=offs, out_dtype=torch.bfloat16
            )
        )
    except Exception as e:
        print(f"  _scaled_grouped_mm failed: {str(e).splitlines()[0]}")
    for label, s in grouped.items():
        report(f"gpu_grouped_{label}", round(tflops(gflops, s), 1),
               f"grouped GEMM {experts}x({tokens // experts}x{dim}x{hidden}) {label}: "
               f"{tflops(gflops, s):.0f} TFLOP/s")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="sqnr,quantize,moe,train,gpu")
    parser.add_argument("--steps", type=int, default=200, help="training steps per precision")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    sections = {
        "sqnr": bench_sqnr,
        "quantize": bench_quantize,
        "moe": bench_moe,
        "train": lambda: bench_train(args.steps),
        "gpu": bench_gpu,
    }
    wanted = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in sections]
    if unknown:
        print(f"unknown section(s) {unknown}; choose from {list(sections)}", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for s in wanted:
        sections[s]()
    if args.json:
        args.json.write_text(json.dumps(RESULTS, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
