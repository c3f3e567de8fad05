"""How much of a trained LoRA adapter survives the shipped model's precision.

The trainer keeps fp32 master weights; `smollm2` folds the shipped adapter into the
embedded model's bf16 folder (`agent/backends/smollm2.py`, `_merge`), and llama.cpp
then stores that folder's matrices as Q8_0 (`agent/backends/_gguf.py`). An update
smaller than a rounding step disappears on the way. This script measures it for one
checkpoint (a folder with the run's `adapter/`):

    python benchmarks/adapter_precision.py runs/embedded/checkpoints/step_0 \\
        --db runs/embedded/demos.db --sessions 16

It prints, per precision of the merged weights (fp32 as trained, bf16 as shipped, Q8_0
of the bf16 folder as llama.cpp runs it; the base in bf16 and Q8_0 beside them):

- the adapter's update as it lands, against the base in the same precision, over the
  adapted matrices: `|merged - base| / |B A scale|`, and how far it is from the trained
  update, `|(merged - base) - B A scale| / |B A scale|` (0: all of it arrives);
- the mean negative log-likelihood of the trained tokens of accepted sessions of a
  trace store (the demonstrations, tokenized and masked as SFT does), and the share of
  the fp32 adapter's NLL gain over the base that each precision keeps.

Everything computes in fp32 on the CPU; only the weights' values differ.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from precision import machine  # noqa: E402  (CPU, cores, the bf16-relevant flags, load)


def q8_0(t):  # noqa: ANN001, ANN201 - torch tensors
    """The tensor as llama.cpp's Q8_0 stores and reads it (gguf's own quantizer)."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    if t.ndim != 2 or t.shape[-1] % 32:
        return t
    a = np.ascontiguousarray(t.to(torch.float32).numpy())
    q = quantize(a, GGMLQuantizationType.Q8_0)
    return torch.from_numpy(dequantize(q, GGMLQuantizationType.Q8_0).reshape(a.shape).copy())


def demonstrations(db: Path, folder: Path, n: int) -> list[tuple[list[int], list[float]]]:
    """(token ids, loss mask) of `n` accepted sessions of the trace store, spread over
    it, tokenized as SFT tokenizes them (`training/sft.py`)."""
    from opencomposer.training.sft import TraceTokenizer, load_accepted_traces, samples_from_traces

    traces = load_accepted_traces(db=db)
    traces = traces[:: max(1, len(traces) // n)][:n]
    data = samples_from_traces(traces, tokenizer=TraceTokenizer(folder))
    return [(list(s.input_ids), list(s.mask)) for s in data.samples]


def mean_nll(model, samples) -> float:  # noqa: ANN001
    """Mean negative log-likelihood of the trained tokens (mask 1: the answers)."""
    import torch

    total, count = 0.0, 0.0
    with torch.inference_mode():
        for ids, mask in samples:
            x = torch.tensor([ids])
            lp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1)
            lp = lp.gather(-1, x[0, 1:, None])[:, 0]
            m = torch.tensor(mask[1:], dtype=torch.float32)
            total -= float((lp * m).sum())
            count += float(m.sum())
    return total / max(count, 1.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path, help="a checkpoint folder with adapter/")
    p.add_argument("--db", type=Path, default=ROOT / "runs" / "embedded" / "demos.db")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = p.parse_args(argv)

    import torch
    from opencomposer.agent.backends.adapter import AdapterError, merge_adapter, read_adapter
    from opencomposer.agent.backends.smollm2 import smollm2_path
    from opencomposer.training.lora import CHECKPOINT_ADAPTER
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    if a.threads:
        torch.set_num_threads(a.threads)
    adapter = a.checkpoint / CHECKPOINT_ADAPTER
    try:
        meta, tensors = read_adapter(adapter)
    except AdapterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    base_dir = smollm2_path(base=True)
    samples = demonstrations(a.db, base_dir, a.sessions)
    if not samples:
        print(f"error: no accepted sessions in {a.db}", file=sys.stderr)
        return 2
    base = {}
    for f in sorted(base_dir.glob("*.safetensors")):
        base.update(load_file(str(f)))  # bf16, as the embedded folder holds it
    scale = float(meta["alpha"]) / int(meta["rank"])
    layers = sorted({k.rpartition(".")[0] for k in tensors})
    delta = {
        f"{m}.weight": (tensors[f"{m}.lora_b"].float() @ tensors[f"{m}.lora_a"].float()) * scale
        for m in layers
    }
    fp32 = merge_adapter({k: v.float() for k, v in base.items()}, adapter)
    bf16 = merge_adapter(base, adapter)  # the shipped path: folded into the bf16 folder
    variants = {
        "base (bf16)": base,
        "base (Q8_0)": {k: q8_0(v) for k, v in base.items()},
        "adapter, fp32 (trained)": fp32,
        "adapter, bf16 (smollm2 folder)": bf16,
        "adapter, Q8_0 of bf16 (llama.cpp)": {k: q8_0(v) for k, v in bf16.items()},
    }
    config = AutoConfig.from_pretrained(base_dir)
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config).float().eval()
    tokens = int(sum(sum(m[1:]) for _, m in samples))
    print(f"{a.checkpoint}: rank {meta['rank']}, {len(layers)} adapted matrices")
    print(f"{len(samples)} demonstrations, {tokens} trained tokens; {machine()}")
    print()
    print("| weights | update landed | update lost | NLL of trained tokens | share of fp32 gain |")
    print("|---|---|---|---|---|")
    nll: dict[str, float] = {}
    dn = sum(float(d.norm() ** 2) for d in delta.values()) ** 0.5
    for label, state in variants.items():
        t0 = time.perf_counter()
        model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        model.tie_weights()
        nll[label] = mean_nll(model, samples)
        landed = lost = "-"
        if label.startswith("adapter"):
            ref = variants["base (Q8_0)"] if "Q8_0" in label else base
            moves = {k: state[k].float() - ref[k].float() for k in delta}
            moved = sum(float(m.norm() ** 2) for m in moves.values())
            err = sum(float((moves[k] - d).norm() ** 2) for k, d in delta.items())
            landed, lost = f"{moved**0.5 / dn:.3f}", f"{err**0.5 / dn:.3f}"
        gain = nll["base (bf16)"] - nll.get("adapter, fp32 (trained)", float("nan"))
        share = (
            f"{(nll['base (bf16)'] - nll[label]) / gain:.3f}"
            if label.startswith("adapter") and gain
            else "-"
        )
        print(
            f"| {label} | {landed} | {lost} | {nll[label]:.4f} | {share} |"
            f"  ({time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
