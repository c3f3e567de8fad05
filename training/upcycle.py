"""Sparse upcycling: a dense Llama checkpoint -> a Mixtral mixture-of-experts checkpoint.

Following Komatsuzaki et al. ("Sparse Upcycling", 2022), every decoder layer's MLP is
copied into ``num_experts`` experts and a router is added; attention, norms, embeddings
and the head are kept. Because Mixtral renormalizes the top-k router weights to sum to
one, a layer whose experts are exact copies computes exactly the dense MLP whatever the
router says, so the upcycled model starts with the dense model's logits (up to float
rounding) and training only has to learn to specialize the experts. ``noise > 0`` adds
Gaussian noise (that fraction of each weight matrix's standard deviation) to every expert
copy to break the symmetry at once; routers start as small random matrices.

The output is an ordinary Hugging Face folder in the original Mixtral layout
(``block_sparse_moe.gate`` and ``block_sparse_moe.experts.{j}.w1/w2/w3``), which both
``transformers.AutoModelForCausalLM`` and vLLM load, with the dense folder's tokenizer
files copied. Run it from Python::

    from opencomposer.training.upcycle import upcycle
    upcycle(smollm2_path(), Path("out/smollm2-moe"), num_experts=4, top_k=2)

Tests: ``pytest tests/training/test_upcycle.py`` (``-m slow`` adds vLLM and SmolLM2).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import torch

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
_MLP_KEY = re.compile(r"^(model\.layers\.\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_NAME = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}

# Llama config fields that carry over to Mixtral unchanged.
_SHARED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "use_cache",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "rope_parameters",
    "attention_dropout",
)


class UpcycleError(ValueError):
    """The dense folder cannot be upcycled (one-line message)."""


def mixtral_config(dense: dict, *, num_experts: int, top_k: int) -> dict:
    """The Mixtral ``config.json`` for a Llama ``config.json`` dict."""
    if dense.get("model_type") != "llama":
        raise UpcycleError(
            f"upcycling needs a Llama-architecture model; config says model_type="
            f"{dense.get('model_type')!r}"
        )
    if dense.get("attention_bias") or dense.get("mlp_bias"):
        raise UpcycleError("upcycling to Mixtral needs attention_bias=false and mlp_bias=false")
    if not 1 <= top_k <= num_experts:
        raise UpcycleError(f"need 1 <= top_k <= num_experts; got top_k={top_k}, {num_experts=}")
    cfg = {k: dense[k] for k in _SHARED_FIELDS if k in dense}
    cfg.update(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
        router_jitter_noise=0.0,
        sliding_window=None,
        dtype=dense.get("dtype") or dense.get("torch_dtype") or "float32",
    )
    return cfg


def _load_dense(dense_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(dense_dir.glob("*.safetensors"))
    if not files:
        raise UpcycleError(f"no *.safetensors weights in {dense_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def upcycle_state_dict(
    dense: dict[str, torch.Tensor],
    *,
    num_experts: int,
    hidden_size: int,
    noise: float = 0.0,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Rename a Llama state dict into Mixtral's, copying each MLP into the experts."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    layers: set[str] = set()
    for key, w in dense.items():
        m = _MLP_KEY.match(key)
        if m is None:
            out[key] = w
            continue
        layer, proj = m.groups()
        layers.add(layer)
        std = w.float().std().item() if noise > 0 else 0.0
        for j in range(num_experts):
            expert = w
            if noise > 0:
                eps = torch.randn(w.shape, generator=gen) * (noise * std)
                expert = (w.float() + eps).to(w.dtype)
            out[f"{layer}.block_sparse_moe.experts.{j}.{_EXPERT_NAME[proj]}.weight"] = (
                expert.clone()
            )
    if not layers:
        raise UpcycleError("no mlp.gate_proj/up_proj/down_proj weights found to upcycle")
    dtype = next(iter(dense.values())).dtype
    for layer in sorted(layers):
        router = torch.randn(num_experts, hidden_size, generator=gen) * 0.02  # [E, D]
        out[f"{layer}.block_sparse_moe.gate.weight"] = router.to(dtype)
    return out


def upcycle(
    dense_dir: Path,
    out_dir: Path,
    *,
    num_experts: int = 4,
    top_k: int = 2,
    noise: float = 0.0,
) -> Path:
    """Write a Mixtral Hugging Face folder at ``out_dir`` built from the Llama folder
    ``dense_dir`` and return ``out_dir``.

    ``config.json`` names ``MixtralForCausalLM``; weights go to ``model.safetensors``;
    tokenizer and generation files are copied. An existing ``out_dir`` holding a
    Mixtral checkpoint is replaced; any other non-empty ``out_dir`` is refused.
    """
    from safetensors.torch import save_file

    dense_dir, out_dir = Path(dense_dir), Path(out_dir)
    try:
        dense_cfg = json.loads((dense_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UpcycleError(f"cannot read {dense_dir / 'config.json'}: {e}") from None
    cfg = mixtral_config(dense_cfg, num_experts=num_experts, top_k=top_k)
    _check_target(out_dir)
    state = upcycle_state_dict(
        _load_dense(dense_dir),
        num_experts=num_experts,
        hidden_size=cfg["hidden_size"],
        noise=noise,
    )
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        state = {k: v.contiguous() for k, v in state.items()}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        for f in dense_dir.iterdir():
            if f.is_file() and _is_side_file(f.name):
                shutil.copy2(f, tmp / f.name)
        tmp.chmod(0o755)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _is_side_file(name: str) -> bool:
    """Tokenizer, chat template and generation files -- not weights, config or markers."""
    return (
        name != "config.json"
        and not name.endswith(WEIGHT_SUFFIXES)
        and not name.startswith(("opencomposer-", "."))
    )


def _check_target(out_dir: Path) -> None:
    if not out_dir.exists() or not any(out_dir.iterdir()):
        return
    try:
        existing = json.loads((out_dir / "config.json").read_text())
    except (OSError, ValueError):
        existing = {}
    if existing.get("model_type") != "mixtral":
        raise UpcycleError(f"{out_dir} exists and is not an upcycled model; refusing to replace it")
