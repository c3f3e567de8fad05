"""The int8 embedding path (W8A8 linears in our own BERT forward pass), the precision setting,
and batches on parallel workers.

Fast tests use the tiny random BERT from conftest; the real MiniLM's int8 cosine to fp32 is
checked under `-m slow`. Speed is measured by benchmarks/index_speed.py, never asserted here.
Run: `.venv/bin/python -m pytest tests/index/test_index_int8.py -q`
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from opencomposer.index import CodebaseIndex, embed
from opencomposer.index.cli import cmd_index
from opencomposer.index.embed import DTYPES, Embedder, EmbedderConfig, EmbedderError, _load

TEXTS = [
    "def retry_with_backoff(fn, attempts=5):\n    for attempt in range(attempts):\n        fn()",
    "x",
    "class UserStore:\n    " + "def add(self, user): self.users.append(user)\n    " * 40,
    "parse an http header line into a name and a value",
    "import os\nimport sys\n\nCONFIG = {'retries': 3, 'timeout': 2.5}\n",
]


def _hf_mean_pooled(folder: Path, texts: list[str], max_tokens: int) -> np.ndarray:
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    hf = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    enc = tok(texts, padding=True, truncation=True, max_length=max_tokens, return_tensors="pt")
    with torch.inference_mode():
        hidden = hf(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state  # fmt: skip
    mask = enc["attention_mask"].unsqueeze(-1).float()
    return ((hidden * mask).sum(1) / mask.sum(1)).numpy()


def test_own_bert_forward_matches_hugging_face(tiny_embedder: Path) -> None:
    model = _load(tiny_embedder, "fp32", 64)
    assert model.bert is not None  # BERT + mean pooling: our forward pass, not HF's
    enc = model.tokenize(TEXTS)
    assert not bool(enc["attention_mask"].all())  # the batch is padded: the mask path runs
    ours = model.encode(TEXTS, enc)
    np.testing.assert_allclose(ours, _hf_mean_pooled(tiny_embedder, TEXTS, 64), atol=1e-5)
    # an unpadded batch takes the mask-free attention and still agrees
    same = [TEXTS[2], TEXTS[2][::-1]]
    np.testing.assert_allclose(model.encode(same), _hf_mean_pooled(tiny_embedder, same, 64), atol=1e-5)  # fmt: skip


def test_int8_linear_keeps_outlier_tokens_accurate() -> None:
    import torch

    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    x = torch.randn(32, 64)
    x[3] *= 200.0  # one token with huge activations: per-tensor scaling would crush the rest
    exact = x @ weight.T + bias
    got = embed._Int8Dense(weight, bias)(x)
    rel = (got - exact).norm(dim=1) / exact.norm(dim=1)
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert float(rel.max()) < 0.02, rel


def _quantized(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row int8 as the kernels define it: scale max|row| / 127 (at least 1e-8 / 127)."""
    scale = (np.maximum(np.abs(x).max(1), np.float32(1e-8)) / np.float32(127.0)).astype(np.float32)
    return np.rint(x * (np.float32(1.0) / scale)[:, None]).astype(np.int8), scale


def _assert_quantized(q: np.ndarray, s: np.ndarray, x: np.ndarray) -> None:
    want_q, want_s = _quantized(x)
    np.testing.assert_allclose(s, want_s, rtol=1e-6)
    # a value within float rounding of a .5 boundary may round either way (bf16 inputs
    # land on boundaries often): off by one at most, and rarely
    assert np.abs(q.astype(np.int32) - want_q).max() <= 1
    assert (q != want_q).mean() < 0.02


def test_fused_kernels_match_numpy_and_torch() -> None:
    import torch
    import torch.nn.functional as F
    from opencomposer.index import int8_kernels

    rng = np.random.default_rng(0)
    rows, width = 12, 96
    x = rng.standard_normal((rows, width)).astype(np.float32)
    x[3] *= 300.0  # an outlier token
    x[5] = 0.0  # an all-zero row stays finite
    q, s = np.empty((rows, width), np.int8), np.empty(rows, np.float32)
    int8_kernels.quantize_rows(x, q, s)
    _assert_quantized(q, s, x)
    assert not q[5].any() and np.isfinite(s).all()

    acc = rng.integers(-30_000, 30_000, (rows, width), dtype=np.int32)
    rs = (rng.random(rows) * 1e-3).astype(np.float32)
    cs = (rng.random(width) * 1e-3).astype(np.float32)
    b = rng.standard_normal(width).astype(np.float32)
    exact = (acc * rs[:, None] * cs + b).astype(np.float32)
    out = np.empty((rows, width), np.float32)
    int8_kernels.dequantize(acc, rs, cs, b, out)
    np.testing.assert_allclose(out, exact, rtol=1e-5, atol=1e-6)
    bf16 = np.empty((rows, width), np.int16)
    int8_kernels.dequantize_bf16(acc, rs, cs, b, bf16)
    want = torch.from_numpy(out).bfloat16().view(torch.int16).numpy()
    assert np.abs(bf16.astype(np.int32) - want).max() <= 1  # round to nearest even, as torch

    # GELU over the whole range, far past where erf saturates (large |v| once came out NaN)
    wide = exact * 8.0
    wide[0, :4] = [40.0, -40.0, 1e4, -1e4]
    ones = np.ones(width, np.float32)
    int8_kernels.gelu_quantize((wide * 1e3).astype(np.int32), np.full(rows, 1e-3, np.float32), ones, np.zeros(width, np.float32), q, s)  # fmt: skip
    _assert_quantized(q, s, F.gelu(torch.from_numpy((wide * 1e3).astype(np.int32) * np.float32(1e-3))).numpy())  # fmt: skip
    assert np.isfinite(s).all() and q[0, 2] == 127 and q[0, 3] == 0

    gamma, beta = rng.random(width).astype(np.float32), rng.standard_normal(width).astype(np.float32)  # fmt: skip
    residual = rng.standard_normal((rows, width)).astype(np.float32) * 20
    want = F.layer_norm(torch.from_numpy(residual + exact), (width,), torch.from_numpy(gamma), torch.from_numpy(beta), 1e-12).numpy()  # fmt: skip
    x = residual.copy()
    int8_kernels.residual_layer_norm_quantize(
        acc, rs, cs, b, x, gamma, beta, np.float32(1e-12), q, s
    )
    np.testing.assert_allclose(x, want, atol=2e-5)
    _assert_quantized(q, s, x)
    x = residual.copy()
    int8_kernels.layer_norm_quantize(x, gamma, beta, np.float32(1e-12), q, s)
    np.testing.assert_allclose(x, F.layer_norm(torch.from_numpy(residual), (width,), torch.from_numpy(gamma), torch.from_numpy(beta), 1e-12).numpy(), atol=2e-5)  # fmt: skip
    _assert_quantized(q, s, x)

    # attention output [n * heads, length, d] in bf16 -> token rows [n * length, heads * d]
    n, heads, length, d = 2, 3, 4, 8
    a = torch.from_numpy(rng.standard_normal((n * heads, length, d)).astype(np.float32)).bfloat16()
    tokens = a.float().view(n, heads, length, d).transpose(1, 2).reshape(n * length, heads * d)
    q, s = np.empty((n * length, heads * d), np.int8), np.empty(n * length, np.float32)
    int8_kernels.heads_quantize(a.view(torch.int16).numpy(), length, q, s)
    _assert_quantized(q, s, tokens.numpy())


def test_int8_vectors_stay_close_to_fp32(tiny_embedder: Path) -> None:
    exact = Embedder(EmbedderConfig(folder=tiny_embedder, dtype="fp32")).encode(TEXTS)
    fast = Embedder(EmbedderConfig(folder=tiny_embedder, dtype="int8")).encode(TEXTS)
    cos = np.sum(exact * fast, axis=1)
    assert cos.min() > 0.98, cos
    np.testing.assert_allclose(np.linalg.norm(fast, axis=1), 1.0, atol=1e-5)


def test_parallel_batches_match_serial(tiny_embedder: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    config = EmbedderConfig(folder=tiny_embedder, dtype="int8", batch_size=2)
    texts = TEXTS * 3
    monkeypatch.setenv(embed.THREADS_ENV, "1")
    serial = Embedder(config).encode(texts)
    monkeypatch.setenv(embed.THREADS_ENV, "2")
    seen: list[int] = []
    parallel = Embedder(config).encode(texts, progress=seen.append)
    np.testing.assert_allclose(parallel, serial, atol=1e-6)
    assert seen == [2, 4, 6, 8, 10, 12, 14, 15]  # in batch order, whichever worker finished first


def test_precision_setting_round_trips(
    tiny_embedder: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENCOMPOSER_EMBEDDER", str(tiny_embedder))
    for dtype in DTYPES:
        monkeypatch.setenv(embed.DTYPE_ENV, dtype)
        config = EmbedderConfig.resolve()
        assert config.dtype == dtype and config.key.endswith(f"-{dtype}-64")
        assert EmbedderConfig.resolve(dtype="fp32").dtype == "fp32"  # an argument beats the env
    # the precision is part of the index's embedder identity: same one reuses, another rebuilds
    monkeypatch.setenv(embed.DTYPE_ENV, "int8")
    with CodebaseIndex.open(workspace) as index:
        first = index.refresh()
        assert first.chunks_embedded > 0
    with CodebaseIndex.open(workspace) as index:
        assert index.embedder.config.dtype == "int8"
        assert index.refresh().chunks_embedded == 0
        assert index.search("retry with backoff", k=1)
    monkeypatch.setenv(embed.DTYPE_ENV, "fp32")
    with CodebaseIndex.open(workspace) as index:
        assert index.refresh().chunks_embedded == first.chunks_embedded
        stored = dict(index.db.execute("SELECT key, value FROM meta"))
        assert stored["embedder"].endswith("-fp32-64")


def test_default_precision_follows_the_cpu(tiny_embedder: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.delenv(embed.DTYPE_ENV, raising=False)
    for flags, want in (
        ({"avx512_vnni", "avx512_bf16"}, "int8"),
        ({"avx_vnni"}, "int8"),
        ({"avx512_bf16"}, "bf16"),
        (set(), "fp32"),
    ):
        monkeypatch.setattr(embed, "_cpu_flags", lambda flags=flags: frozenset(flags))
        assert EmbedderConfig.resolve(tiny_embedder).dtype == want, flags


def test_int8_without_numba_falls_back_or_says_why(tiny_embedder: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setattr(embed, "_cpu_flags", lambda: frozenset({"avx512_vnni", "avx512_bf16"}))
    monkeypatch.setattr(embed, "have_int8_kernels", lambda: False)
    monkeypatch.delenv(embed.DTYPE_ENV, raising=False)
    assert EmbedderConfig.resolve(tiny_embedder).dtype == "bf16"  # the default moves on
    monkeypatch.setenv(embed.DTYPE_ENV, "int8")
    with pytest.raises(EmbedderError, match="int8 embedding needs numba"):
        EmbedderConfig.resolve(tiny_embedder)


def test_int8_kernel_failure_is_a_load_error(tiny_embedder: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from opencomposer.index import int8_kernels

    def broken(*args: object) -> None:
        raise RuntimeError("Failed in nopython mode pipeline\nmore detail")

    monkeypatch.setattr(int8_kernels, "layer_norm_quantize", broken)
    with pytest.raises(EmbedderError, match="cannot load embedder .*: Failed in nopython mode pipeline$"):  # fmt: skip
        _load(tiny_embedder, "int8", 61)  # a size no other test loads: not cached
    assert (str(tiny_embedder), "int8", 61) not in embed._LOADED


def test_bad_precision_is_one_clear_line(
    tiny_embedder: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("OPENCOMPOSER_EMBEDDER", str(tiny_embedder))
    monkeypatch.setenv(embed.DTYPE_ENV, "int4")
    with pytest.raises(EmbedderError, match="must be bf16, fp32 or int8, not 'int4'"):
        EmbedderConfig.resolve()
    assert cmd_index(tmp_path) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "int4" in err and "Traceback" not in err
    with pytest.raises(EmbedderError, match="one of int8, bf16, fp32"):
        EmbedderConfig(folder=tiny_embedder, dtype="fp16")
    monkeypatch.setenv(embed.DTYPE_ENV, "int8")
    monkeypatch.setenv(embed.TOKENS_ENV, "lots")
    with pytest.raises(EmbedderError, match="positive whole number, not 'lots'"):
        EmbedderConfig.resolve()
    monkeypatch.setenv(embed.THREADS_ENV, "two")
    with pytest.raises(EmbedderError, match="positive whole number, not 'two'"):
        Embedder._threads(100)


def test_int8_needs_a_mean_pooled_bert(cls_pooled_embedder: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    cls_folder = cls_pooled_embedder
    monkeypatch.setattr(embed, "_cpu_flags", lambda: frozenset({"avx512_vnni"}))
    monkeypatch.delenv(embed.DTYPE_ENV, raising=False)
    assert EmbedderConfig.resolve(cls_folder).dtype == "fp32"  # the default falls back
    monkeypatch.setenv(embed.DTYPE_ENV, "int8")
    with pytest.raises(EmbedderError, match="int8 embedding needs a BERT model with mean pooling"):
        EmbedderConfig.resolve(cls_folder)


@pytest.mark.slow
def test_minilm_int8_cosine_to_fp32() -> None:
    folder = embed.default_model_folder()
    code = [
        "parse command line (in cli) - src/cli.py\ndef parse(argv):\n    parser = argparse.ArgumentParser()\n"
        "    parser.add_argument('--verbose', action='store_true')\n    return parser.parse_args(argv)",
        "checksum - util/hash.py\ndef checksum(path, size=1 << 16):\n    h = hashlib.sha256()\n"
        "    with open(path, 'rb') as f:\n        while block := f.read(size):\n            h.update(block)\n"
        "    return h.hexdigest()",
        "compute the area of a polygon",
        *TEXTS,
    ]
    exact = Embedder(EmbedderConfig(folder=folder, dtype="fp32")).encode(code)
    fast = Embedder(EmbedderConfig(folder=folder, dtype="int8")).encode(code)
    cos = np.sum(exact * fast, axis=1)
    assert cos.mean() > 0.99 and cos.min() > 0.98, cos
