"""The LoRA adapter file: what `training/lora.py` writes and the embedded model folds in.

A folder with ``adapter.safetensors`` (``<module>.lora_a``: r x in, ``<module>.lora_b``:
out x r, for each adapted linear layer) and ``adapter.json`` (``rank``, ``alpha``,
``targets`` and ``base_fingerprint``, a hash of the base weights it was trained on).
`merge_adapter` folds it into a plain Hugging Face state dict:
``W + (alpha / rank) * B A``, and refuses an adapter trained on other weights.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads only where an adapter is read or merged
    import torch

ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_CONFIG = "adapter.json"


class AdapterError(ValueError):
    """An adapter that cannot be applied; one line."""


def fingerprint(state: dict[str, torch.Tensor], names: Iterable[str]) -> str:
    """A short hash of the base weights an adapter applies to (those layers only)."""
    import torch

    h = hashlib.sha256()
    for name in sorted(names):
        t = state[name].detach().to(torch.float32).cpu().contiguous()
        h.update(name.encode())
        h.update(t.numpy().tobytes()[: 1 << 16])  # the first 64 KiB of each: enough to tell
    return h.hexdigest()[:16]


def read_adapter(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(meta, tensors)`` of a saved adapter; AdapterError (one line) when unusable."""
    from safetensors.torch import load_file

    try:
        meta = json.loads((folder / ADAPTER_CONFIG).read_text())
        tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    except FileNotFoundError as e:
        raise AdapterError(f"{folder}: no adapter ({e.filename} missing)") from None
    except (ValueError, OSError) as e:
        raise AdapterError(f"{folder}: unreadable adapter: {e}") from None
    if not isinstance(meta, dict) or not {"rank", "alpha"} <= meta.keys():
        raise AdapterError(f"{folder / ADAPTER_CONFIG}: expected rank and alpha")
    return meta, tensors


def merge_adapter(state: dict[str, torch.Tensor], folder: Path) -> dict[str, torch.Tensor]:
    """``state`` (a plain HF state dict) with the adapter in ``folder`` folded in, in
    the state's dtypes. Refuses an adapter whose layers or base weights do not match."""
    import torch

    meta, tensors = read_adapter(folder)
    scale = float(meta["alpha"]) / int(meta["rank"])
    layers = sorted({k.rpartition(".")[0] for k in tensors})
    names = [f"{layer}.weight" for layer in layers]
    absent = [n for n in names if n not in state]
    if absent:
        raise AdapterError(f"adapter layer {absent[0]} is not in the base model")
    want = meta.get("base_fingerprint")
    if want and fingerprint(state, names) != want:
        raise AdapterError(f"{folder}: adapter was trained on other base weights")
    out = dict(state)
    for layer, name in zip(layers, names, strict=True):
        a = tensors[f"{layer}.lora_a"].to(torch.float32)
        b = tensors[f"{layer}.lora_b"].to(torch.float32)
        w = state[name]
        out[name] = (w.to(torch.float32) + (b @ a) * scale).to(w.dtype)
    return out


def folder_weights(base: Path) -> dict[str, torch.Tensor]:
    """The weights of the Hugging Face folder ``base`` (its ``*.safetensors``)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(base.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def merged_folder_weights(base: Path, adapter: Path) -> dict[str, torch.Tensor]:
    """The weights of the Hugging Face folder ``base`` with the adapter in ``adapter``
    folded in (`merge_adapter`)."""
    return merge_adapter(folder_weights(base), adapter)


def stack_adapters(
    state: dict[str, torch.Tensor], lower: Path, upper: Path
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """One adapter for the weights ``state`` equal to folding in ``lower`` and then
    ``upper`` (an adapter trained on ``state`` with ``lower`` folded in, e.g. more
    training of a shipped policy): ``W + s1 B1 A1 + s2 B2 A2 = W + [s1 B1 | s2 B2] [A1; A2]``,
    so rank ``r1 + r2`` and ``alpha`` = rank (scale 1). Returns ``(meta, tensors)`` in
    `read_adapter`'s form, with ``state``'s fingerprint; AdapterError when ``lower`` was
    not trained on ``state`` or ``upper`` not on ``state`` with ``lower`` in it."""
    import torch

    merged = merge_adapter(state, lower)  # checks lower's fingerprint against state
    merge_adapter(merged, upper)  # and upper's against the weights it was trained on
    parts = []
    for folder in (lower, upper):
        meta, tensors = read_adapter(folder)
        scale = float(meta["alpha"]) / int(meta["rank"])
        parts.append((int(meta["rank"]), scale, meta, tensors))
    layers = sorted({k.rpartition(".")[0] for _, _, _, t in parts for k in t})
    out: dict[str, torch.Tensor] = {}
    for layer in layers:
        w = state[f"{layer}.weight"]
        a_parts, b_parts = [], []
        for rank, scale, _, tensors in parts:
            a = tensors.get(f"{layer}.lora_a")
            b = tensors.get(f"{layer}.lora_b")
            if a is None or b is None:  # a layer only the other adapter adapts
                a, b = w.new_zeros(rank, w.shape[1]), w.new_zeros(w.shape[0], rank)
            a_parts.append(a.to(torch.float32))
            b_parts.append(b.to(torch.float32) * scale)
        out[f"{layer}.lora_a"] = torch.cat(a_parts, dim=0).contiguous()
        out[f"{layer}.lora_b"] = torch.cat(b_parts, dim=1).contiguous()
    rank = sum(r for r, _, _, _ in parts)
    targets = sorted({t for _, _, m, _ in parts for t in m.get("targets") or ()})
    names = [f"{layer}.weight" for layer in layers]
    meta = {
        "rank": rank,
        "alpha": float(rank),
        "targets": targets,
        "base_fingerprint": fingerprint(state, names),
    }
    return meta, out
