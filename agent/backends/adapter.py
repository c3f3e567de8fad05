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


def merged_folder_weights(base: Path, adapter: Path) -> dict[str, torch.Tensor]:
    """The weights of the Hugging Face folder ``base`` (its ``*.safetensors``) with the
    adapter in ``adapter`` folded in (`merge_adapter`)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(base.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return merge_adapter(state, adapter)
