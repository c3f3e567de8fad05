"""The embedder: the direct mean-pooling path agrees with sentence-transformers; settings are checked."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from opencomposer.index.embed import Embedder, EmbedderConfig, EmbedderError, _is_mean_pooled

TEXTS = [
    "def retry_with_backoff(fn, attempts=5):\n    for attempt in range(attempts):\n        fn()",
    "x",
    "class UserStore:\n    " + "def add(self, user): self.users.append(user)\n    " * 40,
    "parse an http header line into a name and a value",
]


def _reference(folder: Path, max_tokens: int) -> np.ndarray:
    import torch
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu", model_kwargs={"dtype": torch.float32})
    st.max_seq_length = max_tokens
    return st.encode(TEXTS, normalize_embeddings=True, convert_to_numpy=True)


def test_direct_path_matches_sentence_transformers(tiny_embedder: Path) -> None:
    assert _is_mean_pooled(tiny_embedder)
    embedder = Embedder(EmbedderConfig(folder=tiny_embedder, dtype="fp32", max_tokens=64, batch_size=2))  # fmt: skip
    ours = embedder.encode(TEXTS)
    assert ours.shape == (len(TEXTS), 32) and ours.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(ours, _reference(tiny_embedder, 64), atol=1e-4)
    # the token budget truncates: the long text's vector changes with it, the short ones' do not
    longer = Embedder(EmbedderConfig(folder=tiny_embedder, dtype="fp32", max_tokens=256)).encode(TEXTS)  # fmt: skip
    assert np.allclose(longer[1], ours[1], atol=1e-5) and not np.allclose(longer[2], ours[2], atol=1e-3)  # fmt: skip


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_reduced_precision_stays_close(tiny_embedder: Path, dtype: str) -> None:
    exact = Embedder(EmbedderConfig(folder=tiny_embedder, dtype="fp32")).encode(TEXTS)
    fast = Embedder(EmbedderConfig(folder=tiny_embedder, dtype=dtype)).encode(TEXTS)
    assert np.min(np.sum(exact * fast, axis=1)) > 0.98  # cosine to the fp32 vector


def test_other_poolings_go_through_sentence_transformers(
    tiny_embedder: Path, cls_pooled_embedder: Path
) -> None:
    cls_folder = cls_pooled_embedder
    assert not _is_mean_pooled(cls_folder)
    vecs = Embedder(EmbedderConfig(folder=cls_folder, dtype="fp32")).encode(TEXTS)
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    mean = Embedder(EmbedderConfig(folder=tiny_embedder, dtype="fp32")).encode(TEXTS)
    assert not np.allclose(vecs, mean, atol=1e-3)  # really CLS pooling, not the mean


def test_progress_and_empty_input(tiny_embedder: Path) -> None:
    embedder = Embedder(EmbedderConfig(folder=tiny_embedder, dtype="fp32", batch_size=3))
    seen: list[int] = []
    embedder.encode(TEXTS * 2, progress=seen.append)
    assert seen == [3, 6, 8]
    assert embedder.encode([]).shape == (0, 32)


def test_bad_settings_are_one_line(tiny_embedder: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:  # fmt: skip
    monkeypatch.setenv("OPENCOMPOSER_EMBED_DTYPE", "fp8")
    with pytest.raises(EmbedderError, match="must be bf16, fp32 or int8"):
        EmbedderConfig.resolve(tiny_embedder)
    monkeypatch.delenv("OPENCOMPOSER_EMBED_DTYPE")
    with pytest.raises(EmbedderError, match="not a sentence-transformers model"):
        EmbedderConfig.resolve(tmp_path)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_embedder, broken)
    (broken / "model.safetensors").write_bytes(b"not weights")
    with pytest.raises(EmbedderError) as e:
        Embedder(EmbedderConfig(folder=broken, dtype="fp32", max_tokens=33)).encode(["x"])
    assert "\n" not in str(e.value) and "cannot load embedder" in str(e.value)
