"""Supervised fine-tuning on another machine: pack demonstrations here, fit them where
the accelerator is, bring the adapter back.

Recording demonstrations needs the environment (the corpus, the sandbox, each
project's installed dependencies); fitting them needs only torch, transformers and
this package. So the warm start splits in three commands:

    python -m opencomposer.training.sft_offline pack --db runs/x/demos.db [--db ...] \\
        [--validation reference.db] --out samples.npz
    python -m opencomposer.training.sft_offline fit samples.npz --model DIR --out runs/x \\
        --device cuda --epochs 3 --lr 3e-4 --batch 16 --lora-rank 32
    python -m opencomposer.training.sft_offline merge runs/x [or runs/x/checkpoints/step_N]

`pack` tokenizes the accepted demonstrations of the stores (`sft.samples_from_traces`,
exactly what ``opencomposer train --sft`` trains on; ``--style``: only those recorded in
that prompt style) and, with ``--validation``, the resolved reference sessions of
held-out tasks (`nextstep.record_references`; never trained on), into one compressed
file. `fit` runs `sft.fit` on the `Trainer` (LoRA with ``--lora-rank``, full fine-tuning
with 0), a linear warm-up then cosine decay of the rate, and after each epoch the
validation loss: mean negative log-likelihood per trained token of the held-out
sessions. It writes a run folder as ``--sft`` does (``config.json``, ``metrics.jsonl``,
``validation.jsonl``, ``checkpoints/step_N``); with ``--adapter-only`` a checkpoint holds
the adapter and settings alone (a few MB to carry back), one after every epoch, and
`merge` folds it into the base so vLLM and the agent load it. `training/ship.py` ships
such a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

FORMAT = 1
BASE = "smollm2-base"


class OfflineError(ValueError):
    """Bad input to a command; one line."""


def model_dir(spec: str) -> Path:
    """The Hugging Face folder of ``spec``: ``smollm2-base`` / ``smollm2`` (the embedded
    model, converted on first use) or a folder."""
    if spec in ("smollm2", BASE):
        from opencomposer.agent.backends.smollm2 import smollm2_path

        return Path(smollm2_path(base=spec == BASE))
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise OfflineError(f"{spec}: not a model folder (no config.json)")
    return path


# -- pack ------------------------------------------------------------------------------


def _flatten(samples: Sequence[Any]) -> dict[str, Any]:
    import numpy as np

    lengths = np.array([len(s.input_ids) for s in samples], dtype=np.int64)
    ids = [t for s in samples for t in s.input_ids]
    mask = [m for s in samples for m in s.mask]
    return {
        "ids": np.array(ids, dtype=np.int32),
        "mask": np.array(mask, dtype=np.uint8),
        "lengths": lengths,
        "tasks": np.array([s.task_id for s in samples]),
    }


def pack(
    dbs: Sequence[Path],
    out: Path,
    *,
    model: str = BASE,
    style: str | None = "compact",
    validation: Path | None = None,
    edit_weight: int = 1,
) -> dict[str, Any]:
    """Write the samples file; returns its summary (also stored in the file). The
    tokens of turns that call ``edit_file`` weigh ``edit_weight`` in the training loss
    (validation samples stay unweighted, so their loss is per token)."""
    import numpy as np
    from opencomposer.training.sft import TraceTokenizer, load_accepted_traces, samples_from_traces

    if not 1 <= edit_weight <= 255:  # the mask is stored as uint8
        raise OfflineError(f"--edit-weight must be from 1 to 255, not {edit_weight}")
    tokenizer = TraceTokenizer(model_dir(model))
    traces: list[dict[str, Any]] = []
    for db in dbs:
        if not Path(db).is_file():
            raise OfflineError(f"{db}: no such trace store")
        found = load_accepted_traces(100_000, db=db)
        if style:
            found = [t for t in found if (t.get("meta") or {}).get("prompt_style") == style]
        traces += found
    train = samples_from_traces(traces, tokenizer=tokenizer, edit_weight=edit_weight)
    if not train.samples:
        raise OfflineError("no accepted demonstrations in " + ", ".join(map(str, dbs)))
    arrays = {f"train_{k}": v for k, v in _flatten(train.samples).items()}
    summary: dict[str, Any] = {
        "format": FORMAT,
        "model": model,
        "style": style,
        "stores": [str(d) for d in dbs],
        "train_sessions": train.sessions_used,
        "train_samples": len(train.samples),
        "train_tokens": int(sum(sum(m > 0 for m in s.mask) for s in train.samples)),
        "edit_weight": edit_weight,
        "train_seq_tokens": int(sum(len(s.input_ids) for s in train.samples)),
    }
    if validation is not None:
        from opencomposer.training.nextstep import load_references

        refs = [
            t
            for t in load_references(validation)
            if (t.get("meta") or {}).get("resolved") and t.get("status") == "completed"
        ]
        if style:
            refs = [t for t in refs if (t.get("meta") or {}).get("prompt_style") == style]
        val = samples_from_traces(refs, tokenizer=tokenizer, only_accepted=False)
        if not val.samples:
            raise OfflineError(f"{validation}: no resolved reference sessions")
        arrays.update({f"val_{k}": v for k, v in _flatten(val.samples).items()})
        summary.update(
            validation=str(validation),
            val_sessions=val.sessions_used,
            val_tokens=int(sum(sum(s.mask) for s in val.samples)),
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as f:
        np.savez_compressed(f, summary=np.array(json.dumps(summary)), **arrays)
    return summary


def load_samples(path: Path) -> tuple[dict[str, Any], list[Any], list[Any]]:
    """``(summary, train samples, validation samples)`` of a packed file."""
    import numpy as np
    from opencomposer.training.rollouts import Sample

    try:
        data = np.load(path, allow_pickle=False)
        summary = json.loads(str(data["summary"]))
    except (OSError, ValueError, KeyError) as e:
        raise OfflineError(f"{path}: not a samples file ({e})") from None
    if summary.get("format") != FORMAT:
        raise OfflineError(f"{path}: samples format {summary.get('format')}, expected {FORMAT}")

    def split(prefix: str) -> list[Sample]:
        if f"{prefix}_lengths" not in data:
            return []
        ids, mask = data[f"{prefix}_ids"], data[f"{prefix}_mask"]
        out, at = [], 0
        for n, task in zip(data[f"{prefix}_lengths"], data[f"{prefix}_tasks"], strict=True):
            n = int(n)
            out.append(
                Sample(
                    input_ids=ids[at : at + n].tolist(),
                    mask=mask[at : at + n].tolist(),
                    old_logprobs=[0.0] * n,
                    advantage=1.0,
                    task_id=str(task),
                )
            )
            at += n
        return out

    return summary, split("train"), split("val")


# -- fit -------------------------------------------------------------------------------


def schedule(lr: float, total: int, warmup: int) -> Callable[[int], float]:
    """The rate at step ``n`` (from 1): linear warm-up over ``warmup`` steps, then a
    cosine decay to a tenth of ``lr`` at step ``total``."""

    def at(n: int) -> float:
        if warmup > 0 and n <= warmup:
            return lr * n / warmup
        span = max(1, total - warmup)
        progress = min(1.0, (n - warmup) / span)
        return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))

    return at


def fit_samples(
    samples_path: Path,
    model: str,
    out: Path,
    *,
    device: str = "cpu",
    epochs: int = 1,
    lr: float = 3e-4,
    batch: int = 16,
    micro_batch: int = 4,
    lora_rank: int = 16,
    lora_alpha: float = 32.0,
    warmup: int = 10,
    seed: int = 1,
    max_turns: int = 8,
    adapter_only: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """Fit the packed samples; returns the final checkpoint folder."""
    import torch
    from opencomposer.training.sft import fit, fit_steps
    from opencomposer.training.trainer import Trainer, TrainerConfig

    summary, train, val = load_samples(samples_path)
    if not train:
        raise OfflineError(f"{samples_path}: no training samples")
    torch.manual_seed(seed)
    config = TrainerConfig(
        lr=lr,
        micro_batch_size=micro_batch,
        device=device,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
    )
    trainer = Trainer.from_pretrained(model_dir(model), config)
    trainer.prompt_style = summary.get("style") or None
    trainer.max_turns = max_turns
    total = fit_steps(len(train), epochs=epochs, batch=batch)
    run_config = {
        "sft_offline": {
            "samples": str(samples_path),
            "summary": summary,
            "model": model,
            "device": device,
            "epochs": epochs,
            "lr": lr,
            "batch": batch,
            "micro_batch": micro_batch,
            "lora_rank": lora_rank,
            "lora_alpha": lora_alpha,
            "warmup": warmup,
            "seed": seed,
            "steps": total,
        },
        "rollout": {"max_turns": max_turns, "prompt_style": summary.get("style")},
    }
    out.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "validation.jsonl"):  # a new fit replaces an earlier one
        (out / name).unlink(missing_ok=True)
    (out / "config.json").write_text(json.dumps(run_config, indent=1) + "\n")
    per_epoch = fit_steps(len(train), epochs=1, batch=batch)
    lr_at = schedule(lr, total, warmup)
    t_start = time.time()

    def evaluate(epoch: int, step: int) -> None:
        if not val:
            return
        t0 = time.perf_counter()
        loss = trainer.nll(val)
        row = {"epoch": epoch, "step": step, "val_loss": loss, "s": time.perf_counter() - t0}
        _append(out / "validation.jsonl", row)
        log(f"epoch {epoch}: validation loss {loss:.4f} ({row['s']:.1f} s)")

    def on_step(n: int, st: dict[str, float]) -> None:
        row = {
            "step": n,
            "phase": "sft",
            "time": time.time(),
            "lr": lr_at(n),
            **st,
        }
        _append(out / "metrics.jsonl", row)
        if n % 10 == 0 or n == total:
            log(
                f"step {n}/{total}: loss {st['loss']:.4f} lr {lr_at(n):.2e} "
                f"({st['train_s']:.2f} s, {time.time() - t_start:.0f} s in all)"
            )
        if n % per_epoch == 0 or n == total:
            evaluate(-(-n // per_epoch), n)
            if adapter_only and n < total:  # small: every epoch's adapter is kept
                save_adapter_checkpoint(trainer, out / "checkpoints" / f"step_{n}")

    log(
        f"{len(train)} samples ({summary['train_tokens']} trained tokens), {len(val)} validation; "
        f"{total} steps of {batch} on {device}, "
        + (f"LoRA rank {lora_rank}" if lora_rank else "full fine-tuning")
    )
    evaluate(0, 0)
    fit(trainer, train, epochs=epochs, lr=lr, batch=batch, seed=seed, on_step=on_step, lr_at=lr_at)
    folder = out / "checkpoints" / f"step_{total}"
    if adapter_only:
        save_adapter_checkpoint(trainer, folder)
    else:
        trainer.save(folder, extra={"phase": "sft"})
    log(f"saved {folder} in {time.time() - t_start:.0f} s")
    return folder


def _append(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def save_adapter_checkpoint(trainer: Any, folder: Path) -> Path:
    """A checkpoint with the adapter and the model settings alone (`merge` completes it)."""
    from opencomposer.agent.backends._local import write_model_settings
    from opencomposer.training.lora import CHECKPOINT_ADAPTER, is_lora, save_adapter

    if not is_lora(trainer.model):
        raise OfflineError("--adapter-only needs a LoRA run (--lora-rank > 0)")
    save_adapter(trainer.model, folder / CHECKPOINT_ADAPTER)
    settings = {"prompt_style": trainer.prompt_style, "max_turns": trainer.max_turns}
    write_model_settings(folder, {k: v for k, v in settings.items() if v is not None})
    return folder


# -- merge -----------------------------------------------------------------------------


def merge(checkpoint: Path, model: str = BASE) -> Path:
    """Fold ``checkpoint``'s adapter (a run folder: its newest checkpoint's) into the base
    weights there (``model.safetensors``, tokenizer and template beside it), so vLLM,
    llama.cpp's converter and the agent load it; returns the checkpoint."""
    from opencomposer.agent.backends.adapter import AdapterError, merged_folder_weights
    from opencomposer.training.lora import checkpoint_adapter, newest_adapter_checkpoint
    from safetensors.torch import save_file

    if (checkpoint / "checkpoints").is_dir():  # a run folder: its newest checkpoint
        newest = newest_adapter_checkpoint(checkpoint)
        if newest is None:
            raise OfflineError(f"{checkpoint}: no checkpoint with an adapter")
        checkpoint = newest
    adapter = checkpoint_adapter(checkpoint)
    base = model_dir(model)
    try:
        merged = merged_folder_weights(base, adapter)
    except AdapterError as e:
        raise OfflineError(str(e)) from None
    for f in base.iterdir():
        keep = f.is_file() and f.suffix != ".safetensors" and not f.name.startswith("opencomposer")
        if keep and not (checkpoint / f.name).exists():
            shutil.copyfile(f, checkpoint / f.name)
    tmp = checkpoint / "model.safetensors.tmp"
    save_file(merged, str(tmp), metadata={"format": "pt"})
    tmp.replace(checkpoint / "model.safetensors")
    return checkpoint


# -- command line ----------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="tokenize demonstrations into a samples file")
    p.add_argument("--db", type=Path, action="append", required=True, help="a trace store")
    p.add_argument("--validation", type=Path, help="reference sessions of held-out tasks")
    p.add_argument("--model", default=BASE, help="whose tokenizer (default: smollm2-base)")
    p.add_argument("--style", default="compact", help="prompt style to keep ('' for all)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--edit-weight",
        type=int,
        default=1,
        help="loss weight of the turns that edit a file (default 1)",
    )
    f = sub.add_parser("fit", help="fine-tune on a samples file")
    f.add_argument("samples", type=Path)
    f.add_argument("--model", default=BASE, help="the base (default: smollm2-base)")
    f.add_argument("--out", type=Path, required=True, help="the run folder")
    f.add_argument("--device", default="cuda" if _cuda() else "cpu")
    f.add_argument("--epochs", type=int, default=1)
    f.add_argument("--lr", type=float, default=3e-4)
    f.add_argument("--batch", type=int, default=16, help="samples per step")
    f.add_argument("--micro-batch", type=int, default=4, help="samples per forward")
    f.add_argument("--lora-rank", type=int, default=16, help="0: full fine-tuning")
    f.add_argument("--lora-alpha", type=float, default=32.0)
    f.add_argument("--warmup", type=int, default=10, help="warm-up steps")
    f.add_argument("--seed", type=int, default=1)
    f.add_argument("--max-turns", type=int, default=8, help="the turn budget it ships with")
    f.add_argument("--adapter-only", action="store_true", help="save the adapter alone")
    m = sub.add_parser("merge", help="fold an adapter-only checkpoint into the base")
    m.add_argument("checkpoint", type=Path, help="a checkpoint, or a run folder (its newest)")
    m.add_argument("--model", default=BASE)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "pack":
            s = pack(
                a.db,
                a.out,
                model=a.model,
                style=a.style or None,
                validation=a.validation,
                edit_weight=a.edit_weight,
            )
            print(json.dumps(s))
        elif a.cmd == "fit":
            fit_samples(
                a.samples,
                a.model,
                a.out,
                device=a.device,
                epochs=a.epochs,
                lr=a.lr,
                batch=a.batch,
                micro_batch=a.micro_batch,
                lora_rank=a.lora_rank,
                lora_alpha=a.lora_alpha,
                warmup=a.warmup,
                seed=a.seed,
                max_turns=a.max_turns,
                adapter_only=a.adapter_only,
                log=lambda s: print(s, flush=True),
            )
        else:
            print(merge(a.checkpoint, a.model))
    except OfflineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
