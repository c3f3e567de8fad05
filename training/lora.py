"""Low-rank adapters (LoRA) for the trainer, and the adapter file the embedded model ships.

``apply_lora`` freezes a causal LM and wraps its projection layers (``q_proj`` …
``down_proj`` by default) in `LoraLinear`: ``y = W x + (alpha / r) · B (A x)``, with
``A`` (r × in) random and ``B`` (out × r) zero, so training starts from the
unchanged model. Only ``A`` and ``B`` train: the optimizer state is a few MB, not
twice the model.

The sampler and the checkpoints never see the wrappers: `merged_state_dict` gives
the plain Hugging Face state dict with ``W + (alpha / r) · B A`` folded in, which is
what weight sync sends to vLLM and what ``save_pretrained`` writes, so a LoRA run's
checkpoints load anywhere a full fine-tune's do.

The adapter alone (``adapter.safetensors`` + ``adapter.json``: rank, alpha, targets,
and a fingerprint of the base weights it was trained on) is the shipped artifact:
`merge_adapter` folds it into a base state dict when the embedded model loads, and
refuses an adapter trained on other weights.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from opencomposer.agent.backends.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterError,
    fingerprint,
    merge_adapter,
    read_adapter,
)

LoraError = AdapterError  # one name for both: a bad adapter, in training or at load time
__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "LoraError", "merge_adapter", "read_adapter"]

# A checkpoint keeps its adapter in this subfolder: vLLM and transformers load every
# ``*.safetensors`` of a model folder, and the merged model beside it is what they serve.
CHECKPOINT_ADAPTER = "adapter"


def checkpoint_adapter(checkpoint: Path) -> Path:
    """The folder holding a LoRA checkpoint's adapter (``adapter/``; the checkpoint
    itself for one saved before the subfolder)."""
    sub = Path(checkpoint) / CHECKPOINT_ADAPTER
    return sub if (sub / ADAPTER_WEIGHTS).is_file() else Path(checkpoint)


def newest_adapter_checkpoint(run: Path) -> Path | None:
    """The newest checkpoint under ``run/checkpoints`` that holds a LoRA adapter."""
    steps = [
        p
        for p in (Path(run) / "checkpoints").glob("step_*")
        if (checkpoint_adapter(p) / ADAPTER_WEIGHTS).is_file()
    ]
    return max(steps, key=lambda p: int(p.name.split("_")[1]), default=None)


DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoraLinear(torch.nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update."""

    def __init__(self, base: torch.nn.Linear, rank: int, scale: float) -> None:
        super().__init__()
        self.base = base
        self.base.requires_grad_(False)
        self.scale = scale
        self.lora_a = torch.nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_b = torch.nn.Parameter(torch.zeros(base.out_features, rank))
        torch.nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (
            self.base(x)
            + (x @ self.lora_a.t().to(x.dtype)) @ self.lora_b.t().to(x.dtype) * self.scale
        )

    def delta(self) -> torch.Tensor:
        """``scale · B A``, the update to the base weight."""
        return (self.lora_b @ self.lora_a) * self.scale


def apply_lora(model: torch.nn.Module, config: LoraConfig) -> list[str]:
    """Freeze ``model`` and wrap every ``nn.Linear`` whose attribute name is one of
    ``config.targets``; returns the wrapped modules' names. LoraError when none match."""
    if config.rank < 1:
        raise LoraError(f"LoRA rank must be at least 1, got {config.rank}")
    model.requires_grad_(False)
    wrapped = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in config.targets and isinstance(child, torch.nn.Linear):
                setattr(module, child_name, LoraLinear(child, config.rank, config.scale))
                wrapped.append(f"{name}.{child_name}" if name else child_name)
    if not wrapped:
        raise LoraError(f"no linear layer named one of {', '.join(config.targets)} to adapt")
    model.lora_config = config  # type: ignore[assignment]
    return wrapped


def lora_modules(model: torch.nn.Module) -> Iterable[tuple[str, LoraLinear]]:
    for name, m in model.named_modules():
        if isinstance(m, LoraLinear):
            yield name, m


def is_lora(model: torch.nn.Module) -> bool:
    return any(True for _ in lora_modules(model))


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict under its plain names, adapters folded into the weights."""
    deltas = {f"{name}.weight": m.delta().detach() for name, m in lora_modules(model)}
    out: dict[str, torch.Tensor] = {}
    for key, t in model.state_dict().items():
        if ".lora_a" in key or ".lora_b" in key:
            continue
        plain = key.replace(".base.", ".")
        t = t.detach()
        if plain in deltas:
            t = t + deltas[plain].to(t.dtype)
        out[plain] = t
    return out


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable tensors only, by ``<module>.lora_a`` / ``<module>.lora_b``."""
    out = {}
    for name, m in lora_modules(model):
        out[f"{name}.lora_a"] = m.lora_a.detach().contiguous()
        out[f"{name}.lora_b"] = m.lora_b.detach().contiguous()
    return out


def load_adapter_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy saved adapter tensors into a model wrapped by `apply_lora` (the same layout)."""
    mine = dict(lora_modules(model))
    seen = set()
    for key, t in tensors.items():
        name, _, which = key.rpartition(".")
        m = mine.get(name)
        if m is None or which not in ("lora_a", "lora_b"):
            raise LoraError(f"adapter tensor {key} matches no adapted layer")
        param = getattr(m, which)
        if param.shape != t.shape:
            raise LoraError(
                f"adapter tensor {key}: shape {tuple(t.shape)}, expected {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(t.to(param.dtype))
        seen.add(key)
    missing = {f"{n}.{w}" for n in mine for w in ("lora_a", "lora_b")} - seen
    if missing:
        raise LoraError(f"adapter misses {len(missing)} tensors, e.g. {sorted(missing)[0]}")


def save_adapter(
    model: torch.nn.Module, folder: Path, *, extra: dict[str, Any] | None = None
) -> Path:
    """Write ``adapter.safetensors`` (fp32: a resumed run continues exactly) and
    ``adapter.json`` into ``folder``."""
    from safetensors.torch import save_file

    config: LoraConfig = model.lora_config  # type: ignore[assignment]
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(torch.float32) for k, v in adapter_state(model).items()}
    base = {
        k.replace(".base.", "."): v
        for k, v in model.state_dict().items()
        if ".base." in k and k.endswith(".weight")
    }
    meta = {
        **asdict(config),
        "targets": list(config.targets),
        "base_fingerprint": fingerprint(base, base),
        **(extra or {}),
    }
    save_file(tensors, str(folder / ADAPTER_WEIGHTS))
    (folder / ADAPTER_CONFIG).write_text(json.dumps(meta, indent=1) + "\n")
    return folder
