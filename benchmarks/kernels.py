"""Kernel numbers: MXFP8 accuracy and quantization speed, grouped MoE against the
per-expert loop, a tiny MoE language model trained in bf16 and in MXFP8, and (on a GPU)
bf16 against FP8 GEMM and grouped-GEMM TFLOP/s.

Every speed is a ratio to a baseline measured in the same run (median of repeats,
interleaved), because this CPU is shared and absolute times swing.

    .venv/bin/python benchmarks/kernels.py                 # everything that runs here
    .venv/bin/python benchmarks/kernels.py --only moe,sqnr # a subset
    .venv/bin/python benchmarks/kernels.py --json out.json # also write the numbers

Sections: sqnr, quantize, moe, train, gpu (toy sizes on CPU without CUDA; on a lent
GPU run ``bash benchmarks/kernels_gpu.sh``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
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


def timed_runs(
    fns: dict[str, Callable[[], object]], repeats: int, cpu: dict[str, list[float]] | None = None
) -> dict[str, list[float]]:
    """Seconds of every run of each function, runs interleaved so load swings hit all
    alike; with ``cpu``, also each run's CPU seconds of this process (all its threads:
    what the work cost, whatever else the machine ran meanwhile)."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            c, t = time.process_time(), time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
            if cpu is not None:
                cpu.setdefault(name, []).append(time.process_time() - c)
    return times


def timed(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function (``timed_runs``)."""
    return {name: statistics.median(ts) for name, ts in timed_runs(fns, repeats).items()}


def load() -> str:
    """The 1-minute load average: this CPU is shared, so every figure says what it ran beside."""
    return f"{os.getloadavg()[0]:.1f}"


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


MOE_SHAPES = (  # (tokens, model dim, expert hidden): 8 experts, top-2
    (4096, 576, 1536),  # SmolLM2-135M's MLP, 2 sequences of 2048 tokens
    (2048, 1024, 2816),  # a larger model, Mixtral's 3.5x expert ratio
)


def gemm_floor(layer: MoE, counts: list[int], dtype: torch.dtype) -> Callable[[bool], None]:
    """The loop's GEMMs and nothing else (per expert: gate/up and down forward, and their
    input and weight gradients), on ready inputs. ``loop time / this`` is the most any
    expert path running the same GEMMs at the same speed can gain over the loop."""
    w13 = layer.experts.gate_up_proj.detach()
    w2 = layer.experts.down_proj.detach()
    f = w2.shape[-1]
    xs = [torch.randn(c, w13.shape[-1], dtype=dtype) for c in counts]
    hs = [torch.randn(c, 2 * f, dtype=dtype) for c in counts]
    acts = [torch.randn(c, f, dtype=dtype) for c in counts]
    dys = [torch.randn(c, w2.shape[1], dtype=dtype) for c in counts]

    def run(fwd_only: bool) -> None:
        for e in range(len(counts)):
            torch.mm(xs[e], w13[e].t())
            torch.mm(acts[e], w2[e].t())
            if not fwd_only:
                torch.mm(dys[e], w2[e])  # d act
                torch.mm(dys[e].t(), acts[e])  # d down_proj
                torch.mm(hs[e], w13[e])  # d x
                torch.mm(hs[e].t(), xs[e])  # d gate_up_proj

    return run


def bench_moe(shapes: tuple[tuple[int, int, int], ...] = MOE_SHAPES, repeats: int = 3) -> None:
    """The MoE layer (router, experts, aux losses) with the grouped expert path against
    the per-expert loop reference, same weights and inputs, runs interleaved."""
    from opencomposer.kernels.moe import default_gemm_backend

    print(
        f"MoE layer, 8 experts, top-2: grouped vs per-expert loop "
        f"({torch.get_num_threads()} threads, load {load()})"
    )
    for tokens, dim, hidden in shapes:
        for dtype in (torch.bfloat16, torch.float32):
            torch.manual_seed(0)
            layer = MoE(MoE.Config(dim=dim, hidden=hidden, num_experts=8, top_k=2)).to(dtype)
            x = torch.randn(tokens, dim, dtype=dtype, requires_grad=True)
            g = torch.randn(tokens, dim, dtype=dtype)

            def run(impl: str, fwd_only: bool = False, layer=layer, x=x, g=g) -> torch.Tensor:
                layer.experts.config = dataclasses.replace(layer.experts.config, impl=impl)
                if fwd_only:
                    with torch.no_grad():
                        return layer(x)
                x.grad = None
                layer(x).backward(g)
                return x.grad

            out = {impl: (run(impl, True), run(impl).clone()) for impl in ("grouped", "loop")}
            err = max(
                ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                for a, b in zip(out["grouped"], out["loop"], strict=True)
            )
            with torch.no_grad():
                counts = torch.bincount(layer.gate(x).indices.reshape(-1), minlength=8)
            backend = default_gemm_backend(x, counts)
            gemms = gemm_floor(layer, counts.tolist(), dtype)
            fc: dict[str, list[float]] = {}
            tc: dict[str, list[float]] = {}
            fr = timed_runs({"grouped": lambda: run("grouped", True), "loop": lambda: run("loop", True), "gemms": lambda gemms=gemms: gemms(True)}, repeats, fc)  # fmt: skip
            tr = timed_runs({"grouped": lambda: run("grouped"), "loop": lambda: run("loop"), "gemms": lambda gemms=gemms: gemms(False)}, repeats, tc)  # fmt: skip
            ceil_f = statistics.median(fc["loop"]) / statistics.median(fc["gemms"])
            ceil_t = statistics.median(tc["loop"]) / statistics.median(tc["gemms"])
            cpu_f = statistics.median(fc["loop"]) / statistics.median(fc["grouped"])
            cpu_t = statistics.median(tc["loop"]) / statistics.median(tc["grouped"])
            f = {k: statistics.median(v) for k, v in fr.items()}
            t = {k: statistics.median(v) for k, v in tr.items()}
            best_f = min(fr["loop"]) / min(fr["grouped"])  # best run against best run
            best_t = min(tr["loop"]) / min(tr["grouped"])
            name = str(dtype).removeprefix("torch.")
            key = f"moe_{tokens}x{dim}x{hidden}_{name}"
            RESULTS[f"{key}_fwd_speedup"] = round(f["loop"] / f["grouped"], 2)
            RESULTS[f"{key}_best_of_speedups"] = [round(best_f, 2), round(best_t, 2)]
            RESULTS[f"{key}_cpu_time_speedups"] = [round(cpu_f, 2), round(cpu_t, 2)]
            RESULTS[f"{key}_cpu_time_ceiling"] = [round(ceil_f, 2), round(ceil_t, 2)]
            report(
                f"{key}_fwdbwd_speedup",
                round(t["loop"] / t["grouped"], 2),
                f"T={tokens} D={dim} F={hidden} {name:8s} [{backend}, max group "
                f"{int(counts.max())}/mean {counts.float().mean():.0f}]: "
                f"fwd loop {f['loop'] * 1e3:.0f} ms / grouped {f['grouped'] * 1e3:.0f} ms "
                f"= {f['loop'] / f['grouped']:.2f}x (best-of {best_f:.2f}x); fwd+bwd loop "
                f"{t['loop'] * 1e3:.0f} ms / grouped {t['grouped'] * 1e3:.0f} ms = "
                f"{t['loop'] / t['grouped']:.2f}x (best-of {best_t:.2f}x); CPU-time ratio fwd "
                f"{cpu_f:.2f}x, fwd+bwd {cpu_t:.2f}x (ceiling: loop / its GEMMs alone "
                f"{ceil_f:.2f}x, {ceil_t:.2f}x); "
                f"max rel diff (out, dx) {err:.1e}; load {load()}",
            )


# --------------------------------------------------------------------------- train


def bench_train(steps: int) -> None:
    from opencomposer.kernels.train_tiny import TrainConfig, train

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
    """bf16 against FP8/MXFP8 GEMM and grouped-GEMM TFLOP/s, on the MX path
    ``mx.gemm_backend`` picks for the device (Blackwell: MX ``_scaled_mm``; Ada/Hopper:
    the Triton kernel; elsewhere: emulation).

    On a GPU the sizes are the real ones (8192^3 GEMM; 8 experts x 2048 tokens, 4096 ->
    8192 grouped). Without CUDA the same code runs at toy sizes on the CPU so that the
    script is known to run before a device is lent; those CPU figures mean nothing.
    On a lent H200: ``bash benchmarks/kernels_gpu.sh`` (see that file).
    """
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if cuda:
        name = (
            f"{torch.cuda.get_device_name(dev)}, capability {torch.cuda.get_device_capability(dev)}"
        )
        m = n = k = 8192
        experts, tokens, dim, hidden = 8, 16384, 4096, 8192
    else:
        name = "no CUDA device: CPU fallback at toy sizes, checks the script runs"
        m = n = k = 256
        experts, tokens, dim, hidden = 8, 512, 256, 512
    print(f"GPU section on {name}; MX GEMM backend {mx.gemm_backend(dev)}")

    def dev_time(fn: Callable[[], object], reps: int = 20 if cuda else 2) -> float:
        fn()
        if not cuda:
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            return (time.perf_counter() - t) / reps
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / reps

    def attempt(results: dict[str, float], label: str, fn: Callable[[], object]) -> None:
        try:
            results[label] = dev_time(fn)
        except Exception as e:  # a path this device or torch build lacks: say so, go on
            print(f"  {label}: unavailable ({type(e).__name__}: {str(e).splitlines()[0][:120]})")

    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    gemm: dict[str, float] = {"bf16 mm": dev_time(lambda: a @ b.t())}
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.tensor(1.0, device=dev)
    attempt(gemm, "fp8 tensorwise _scaled_mm", lambda: torch._scaled_mm(
        a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))  # fmt: skip
    qa, qb = mx.quantize(a), mx.quantize(b)
    attempt(gemm, f"mxfp8 mx_mm ({mx.gemm_backend(dev)})", lambda: mx.mx_mm(qa, qb, torch.bfloat16))
    ref = mx.mx_mm(qa, qb, torch.float32, "emulated")
    try:
        err = ((mx.mx_mm(qa, qb, torch.float32) - ref).abs().max() / ref.abs().max()).item()
        report("gpu_mx_mm_rel_err", err, f"mx_mm vs exact emulation: max rel err {err:.1e}")
    except Exception as e:
        print(f"  mx_mm check failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
    for label, sec in gemm.items():
        report(f"gpu_gemm_{label}", round(tflops(2 * m * n * k, sec), 2),
               f"GEMM {m}x{n}x{k} {label}: {tflops(2 * m * n * k, sec):.3g} TFLOP/s")  # fmt: skip

    x = torch.randn(tokens, dim, device=dev, dtype=torch.bfloat16)
    w = torch.randn(experts, hidden, dim, device=dev, dtype=torch.bfloat16)
    offs = torch.arange(1, experts + 1, device=dev, dtype=torch.int32) * (tokens // experts)
    grouped: dict[str, float] = {}
    attempt(
        grouped, "bf16 _grouped_mm", lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    )
    x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    sa = torch.ones(tokens, device=dev)
    sb = torch.ones(experts, hidden, device=dev)
    attempt(grouped, "fp8 rowwise _scaled_grouped_mm", lambda: torch._scaled_grouped_mm(
        x8, w8.transpose(-2, -1), sa, sb, offs=offs, out_dtype=torch.bfloat16))  # fmt: skip
    for label, sec in grouped.items():
        fl = 2 * tokens * dim * hidden
        report(f"gpu_grouped_{label}", round(tflops(fl, sec), 2),
               f"grouped GEMM {experts}x({tokens // experts}x{dim}->{hidden}) {label}: "
               f"{tflops(fl, sec):.3g} TFLOP/s")  # fmt: skip

    from opencomposer.kernels.moe import MoE as MoELayer
    from opencomposer.kernels.mx import MXTrainingConfig

    layers: dict[str, float] = {}
    xs = torch.randn(tokens // 2, dim // 2, device=dev, dtype=torch.bfloat16, requires_grad=True)
    for label, cfg in (("bf16", None), ("mxfp8 (emulated grouped GEMMs)", MXTrainingConfig())):
        torch.manual_seed(0)
        layer = MoELayer(MoELayer.Config(dim=dim // 2, hidden=hidden // 4, mx=cfg))
        layer = layer.to(dev, torch.bfloat16)
        attempt(
            layers, f"MoE layer fwd+bwd {label}", lambda layer=layer: layer(xs).sum().backward()
        )
    fl = 3 * 2 * (tokens // 2) * 2 * 3 * (dim // 2) * (hidden // 4)  # 3x fwd, k=2, 3 GEMMs
    for label, sec in layers.items():
        report(f"gpu_{label}", round(tflops(fl, sec), 2),
               f"{label} ({tokens // 2} tokens, {dim // 2}->{hidden // 4}, 8 experts, top-2): "
               f"{sec * 1e3:.3g} ms, {tflops(fl, sec):.3g} TFLOP/s")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="sqnr,quantize,moe,train,gpu")
    parser.add_argument("--steps", type=int, default=200, help="training steps per precision")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
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
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {load()}")
    for s in wanted:
        sections[s]()
    if args.json:
        args.json.write_text(json.dumps(RESULTS, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
