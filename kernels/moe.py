"""Mixture-of-experts layers: top-k router, token permutation, grouped expert GEMMs.

A token goes through ``top_k`` of ``num_experts`` SwiGLU experts chosen by a linear
router whose softmax runs in fp32 (Mixtral's routing: softmax over all experts, keep the
top k, renormalize them). Two expert paths compute the same function:

- ``impl="loop"``: for each expert, gather its tokens, run the MLP, scatter-add back --
  the reference, written as transformers' Mixtral does it, which the fast path is tested
  against;
- ``impl="grouped"``: sort the (token, slot) pairs by expert once (``make_permutation``:
  one stable argsort, counts by bincount), gather the tokens once, run every expert's
  SwiGLU as grouped GEMMs over contiguous groups of the sorted buffer, and sum each
  token's k weighted outputs back with one gather (``grouped_swiglu``). Forward and
  backward are one autograd node (``_GroupedSwiGLU``) whose backward is also grouped:
  input and weight gradients are grouped GEMMs on the sorted buffer. The GEMMs run as
  one ``torch.bmm`` over groups padded to the largest (CPU, several threads, balanced
  groups), one ``torch.mm`` per group slice (CPU otherwise), or ``torch._grouped_mm``
  (CUDA, bf16); see ``default_gemm_backend``.

Why it is faster than the loop (measured by ``benchmarks/kernels.py --only moe``): the
loop's autograd graph does per expert a boolean-mask ``where``, a gather, chunk/cat, a
weight-slice backward that zero-fills a full-size [E, 2F, D] gradient and adds it up,
and a scatter-add, around GEMMs that two threads split between them; the grouped path
has a handful of whole-buffer ops and GEMMs that hand whole experts to threads.

The expert weights use transformers' ``MixtralExperts`` layout and names
(``gate_up_proj`` [E, 2F, D], ``down_proj`` [E, D, F]), so ``GroupedExperts.wrap`` can
take over a Hugging Face Mixtral's experts without copying and ``save_pretrained`` still
writes an ordinary Mixtral checkpoint. With an ``MXTrainingConfig`` the grouped GEMMs
run in MXFP8 (emulated: exact quantize-dequantize around ``_grouped_mm``, composite
autograd rather than the fused node; forward blocks along the model dim, backward along
the output dim for the input gradient and along each expert's tokens for the weight
gradient -- groups are padded to 32 tokens so no block straddles two experts).

Auxiliary losses: the Switch/Mixtral load-balancing loss (1.0 when perfectly balanced)
and the ST-MoE router z-loss. ``MoE.forward`` leaves them in ``MoE.aux``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from opencomposer.kernels.mx import (
    BLOCK,
    MXTrainingConfig,
    compute_dtype,
    fake_quantize,
    mx_linear,
)
from torch import nn

Impl = Literal["grouped", "loop"]


# ------------------------------------------------------------------------- router


@dataclass(frozen=True, kw_only=True)
class RouterOutput:
    logits: torch.Tensor  # [T, E] fp32
    probs: torch.Tensor  # [T, E] fp32
    weights: torch.Tensor  # [T, k] fp32, each row sums to 1 when normalized
    indices: torch.Tensor  # [T, k] int64 expert ids


class Router(nn.Module):
    """Linear top-k router; logits and softmax in fp32 whatever the model dtype."""

    @dataclass(frozen=True, kw_only=True)
    class Config:
        dim: int
        num_experts: int
        top_k: int = 2
        norm_topk_prob: bool = True

    def __init__(self, config: Router.Config):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.dim))  # [E, D]
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> RouterOutput:
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        probs = logits.softmax(dim=-1)  # [T, E]
        weights, indices = probs.topk(self.config.top_k, dim=-1)  # [T, k]
        if self.config.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return RouterOutput(logits=logits, probs=probs, weights=weights, indices=indices)


def load_balancing_loss(probs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Switch-Transformer balance loss ``E * sum_e f_e * P_e``: ``f_e`` the fraction of
    routed (token, slot) pairs sent to expert e, ``P_e`` its mean router probability.
    1.0 at perfect balance, up to E when everything goes to one expert."""
    num_experts = probs.shape[-1]
    counts = torch.bincount(indices.reshape(-1), minlength=num_experts)  # [E]
    f = counts.to(probs.dtype) / indices.numel()  # [E]
    return num_experts * (f * probs.mean(dim=0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE z-loss: mean squared log-partition of the router logits."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


# -------------------------------------------------------------------- permutation


@dataclass(frozen=True, kw_only=True)
class Permutation:
    """Where each (token, slot) pair lives in the expert-sorted buffer."""

    rows: torch.Tensor  # [T * k] buffer row of pair (t, j) at index t * k + j
    order: torch.Tensor  # [T * k] pair id (t * k + j) of each pair, in buffer order
    tokens: torch.Tensor  # [T * k] source token of each pair, in buffer order (no pads)
    dest: torch.Tensor  # [T * k] buffer row of each pair, in buffer order
    offsets: torch.Tensor  # [E] int32 cumulative group ends, as _grouped_mm takes them
    counts: torch.Tensor  # [E] tokens per expert, before padding
    size: int  # buffer rows P (padded groups included)


def make_permutation(
    indices: torch.Tensor, num_experts: int, align: int = 1, *, capacity: bool = False
) -> Permutation:
    """Sort the pairs of ``indices`` [T, k] by expert (stable); pad every expert's group
    to a multiple of ``align`` rows, or with ``capacity`` to the largest group's size
    (rounded up to ``align``) so the buffer reshapes to [E, C, ...] for a batched GEMM."""
    flat = indices.reshape(-1)  # [T*k]
    order = torch.argsort(flat, stable=True)  # [T*k] pair ids grouped by expert
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    padded = (counts + align - 1) // align * align  # [E]
    if capacity and num_experts:
        padded = padded.max().expand(num_experts)
    ends = padded.cumsum(0)  # [E]
    starts = ends - padded  # [E]
    expert = flat[order]  # [T*k]
    first = counts.cumsum(0) - counts  # [E] index of each expert's first pair in `order`
    dest = starts[expert] + torch.arange(flat.numel(), device=flat.device) - first[expert]
    rows = torch.empty_like(dest)
    rows[order] = dest
    return Permutation(
        rows=rows,
        order=order,
        tokens=order // indices.shape[-1],
        dest=dest,
        offsets=ends.to(torch.int32),
        counts=counts,
        size=int(ends[-1]) if num_experts else 0,
    )


def permute(x: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """Token rows ``x`` [T, D] -> expert-sorted buffer [P, D] (pad rows are zero)."""
    rows = x.index_select(0, perm.tokens)  # [T*k, D]
    if perm.size == rows.shape[0]:  # no padding: the buffer is the gather itself
        return rows
    return x.new_zeros(perm.size, x.shape[-1]).index_copy(0, perm.dest, rows)


def unpermute(
    y: torch.Tensor, perm: Permutation, weights: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Expert outputs ``y`` [P, D] -> tokens [T, D]: each pair's row times its router
    weight (``weights`` [T, k]), summed per token into ``out`` (default zeros in y's dtype)."""
    t = weights.shape[0]
    if perm.size != perm.dest.shape[0]:
        y = y.index_select(0, perm.dest)  # [T*k, D] drop pad rows
    w = weights.reshape(-1)[perm.order]  # [T*k] weights in buffer order (fp32 router)
    out = y.new_zeros(t, y.shape[-1]) if out is None else out
    return out.index_add_(0, perm.tokens, (y * w.unsqueeze(-1)).to(out.dtype))


# --------------------------------------------------------------- grouped GEMMs


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per-group ``x_g @ w[g].T`` for ``x`` [P, K] split at ``offsets``, ``w`` [E, N, K]
    -> [P, N]."""
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)


class _MXGroupedMM(torch.autograd.Function):
    """``grouped_mm`` with every operand MX-quantized along its contraction dim (STE)."""

    @staticmethod
    def forward(ctx, x, w, offsets, cfg: MXTrainingConfig, dtype: torch.dtype):
        ctx.save_for_backward(x, w, offsets)
        ctx.cfg = cfg
        xq = fake_quantize(x.contiguous(), cfg.elem, cfg.mode, dtype)  # [P, K] along K
        wq = fake_quantize(w.contiguous(), cfg.elem, cfg.mode, dtype)  # [E, N, K] along K
        return torch._grouped_mm(xq, wq.transpose(-2, -1), offs=offsets)  # [P, N]

    @staticmethod
    def backward(ctx, g):
        x, w, offsets = ctx.saved_tensors
        cfg: MXTrainingConfig = ctx.cfg
        g = g.contiguous()  # [P, N]
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # dX_g = dY_g @ W_g: contraction over N
            gq = fake_quantize(g, cfg.grad_elem, cfg.mode)  # [P, N] along N
            wt = fake_quantize(w.transpose(-2, -1).contiguous(), cfg.elem, cfg.mode, g.dtype)
            grad_x = torch._grouped_mm(gq, wt.transpose(-2, -1), offs=offsets).to(x.dtype)
        if ctx.needs_input_grad[1]:  # dW_g = dY_g^T @ X_g: contraction over the group's tokens
            gt = fake_quantize(g.t().contiguous(), cfg.grad_elem, cfg.mode, torch.float32)
            xt = fake_quantize(x.t().contiguous(), cfg.elem, cfg.mode, torch.float32)
            grad_w = torch._grouped_mm(gt, xt.t(), offs=offsets).to(w.dtype)  # [E, N, K]
        return grad_x, grad_w, None, None, None


GemmBackend = Literal["bmm", "mm", "grouped_mm"]

TOKEN_CHUNK = 512  # tokens per piece of the elementwise work around the permutation
MAX_CAPACITY_PADDING = 1.25  # "bmm" only while E * max_count <= this * T * k


def default_gemm_backend(x: torch.Tensor, counts: torch.Tensor) -> GemmBackend:
    """How ``grouped_swiglu`` runs its grouped GEMMs.

    - ``grouped_mm`` on CUDA in bf16: one ``torch._grouped_mm`` launch per GEMM.
    - ``bmm`` on CPU in fp32 with several threads and groups of similar size: pad every
      group to the largest (capacity C) and run ``torch.bmm`` over chunks of [threads, C,
      ...], so each thread takes a whole expert instead of sharing each small GEMM.
    - ``mm`` otherwise: one ``torch.mm`` per expert on its contiguous slice of the sorted
      buffer (``_grouped_mm``'s CPU kernel is the same loop).

    Measured here (2 threads, 8 experts, ~1000 tokens each, 9% padding, fwd+bwd of the
    experts against the loop, on a quiet machine): bf16 ``mm`` 1.17x / ``bmm`` 0.95x;
    fp32 ``mm`` 1.21x / ``bmm`` 1.34x. Under heavy load ``bmm`` led in bf16 as well.
    """
    if x.is_cuda:
        return "grouped_mm" if x.dtype == torch.bfloat16 else "mm"
    if x.dtype != torch.float32 or torch.get_num_threads() < 2:
        return "mm"
    total = int(counts.sum())
    padded = int(counts.max()) * counts.numel() if counts.numel() else 0
    return "bmm" if total > 0 and padded <= MAX_CAPACITY_PADDING * total else "mm"


@dataclass(frozen=True, kw_only=True)
class _Chunk:
    """Experts ``[lo, hi)`` whose groups fill buffer rows ``[start, end)``."""

    lo: int
    hi: int
    start: int
    end: int


@dataclass(frozen=True, kw_only=True)
class _Groups:
    """How the sorted buffer is cut into the pieces that run together.

    ``mm``: one chunk per non-empty expert. ``bmm``: chunks of ``torch.get_num_threads()``
    experts of ``capacity`` rows each, so the threads each take one expert and the chunk's
    activations are still in cache for the elementwise work between the GEMMs.
    ``grouped_mm``: one chunk of all experts.
    """

    backend: GemmBackend
    num_experts: int
    offsets: torch.Tensor  # [E] int32 group ends (grouped_mm)
    chunks: list[_Chunk]

    @classmethod
    def make(cls, backend: GemmBackend, perm: Permutation) -> _Groups:
        e_num = perm.counts.numel()
        if backend == "grouped_mm":
            chunks = [_Chunk(lo=0, hi=e_num, start=0, end=perm.size)]
        elif backend == "bmm":
            cap = perm.size // e_num if e_num else 0  # 0: no tokens, nothing to run
            step = max(1, torch.get_num_threads()) if cap else e_num + 1
            chunks = [
                _Chunk(
                    lo=lo, hi=min(lo + step, e_num), start=lo * cap, end=min(lo + step, e_num) * cap
                )
                for lo in range(0, e_num if cap else 0, step)
            ]
        else:
            chunks, start = [], 0
            for e, c in enumerate(perm.counts.tolist()):
                if c:
                    chunks.append(_Chunk(lo=e, hi=e + 1, start=start, end=start + c))
                start += c
        return cls(backend=backend, num_experts=e_num, offsets=perm.offsets, chunks=chunks)

    def covers_every_expert(self) -> bool:
        return sum(c.hi - c.lo for c in self.chunks) == self.num_experts


def _gmm(x: torch.Tensor, w: torch.Tensor, c: _Chunk, g: _Groups, *, trans: bool, out=None):
    """Rows of each group of chunk ``c`` times its expert's ``w[e].T`` (``trans``) or
    ``w[e]``: ``x`` [rows, K] with ``w`` [E, N, K] (trans) or [E, K, N] -> [rows, N]."""
    if g.backend == "grouped_mm":
        res = torch._grouped_mm(x, w.transpose(-2, -1) if trans else w, offs=g.offsets)
        return res if out is None else out.copy_(res)
    n = w.shape[1] if trans else w.shape[2]
    out = x.new_empty(x.shape[0], n) if out is None else out
    wc = w[c.lo : c.hi]
    wc = wc.transpose(-2, -1) if trans else wc
    if c.hi - c.lo == 1:
        return torch.mm(x, wc[0], out=out)
    m = c.hi - c.lo
    torch.bmm(x.view(m, -1, x.shape[1]), wc, out=out.view(m, -1, n))
    return out


def _gmm_grad(dy: torch.Tensor, x: torch.Tensor, c: _Chunk, g: _Groups, out: torch.Tensor):
    """Weight gradients ``dy_e.T @ x_e`` of chunk ``c``'s experts into ``out`` [E, N, K]."""
    if g.backend == "grouped_mm":  # no host sync; experts without tokens zeroed explicitly
        out.copy_(torch._grouped_mm(dy.t(), x, offs=g.offsets))
        empty = torch.diff(g.offsets, prepend=g.offsets.new_zeros(1)) == 0  # [E]
        out.masked_fill_(empty[:, None, None], 0)
    elif c.hi - c.lo == 1:
        torch.mm(dy.t(), x, out=out[c.lo])
    else:
        m = c.hi - c.lo
        dyc, xc = dy.view(m, -1, dy.shape[1]), x.view(m, -1, x.shape[1])
        torch.bmm(dyc.transpose(1, 2), xc, out=out[c.lo : c.hi])


class _GroupedSwiGLU(torch.autograd.Function):
    """The whole expert bank as one autograd node: gather the (token, slot) pairs in
    expert order, SwiGLU through grouped GEMMs, weighted sum back to the tokens.

    Why one node: autograd over the composite keeps many temporaries and runs a dozen
    small ops (chunk/cat, casts, scatter-adds, per-expert zero-filled weight gradients)
    around the GEMMs; here the backward is written out -- per chunk of experts, the input
    and weight gradients of both projections as GEMMs on the chunk's rows and
    ``silu_backward`` in between while those rows are in cache -- and gathers plus a
    k-way sum replace scatter-adds (every token has exactly k pairs, at ``perm.rows``).
    Pad rows of the buffer are zero going in and their output gradient is zero, so they
    add nothing to any weight gradient. Rounding follows the loop: GEMMs in the input
    dtype, router weights applied in fp32 and rounded once.
    """

    @staticmethod
    def forward(ctx, hidden, weights, w13, w2, perm: Permutation, groups: _Groups, keep: bool):
        dtype = hidden.dtype
        t, d = hidden.shape
        k = weights.shape[1]
        f = w2.shape[-1]
        w13c, w2c = w13.to(dtype), w2.to(dtype)
        x = hidden.index_select(0, perm.tokens)  # [T*k, D] sorted by expert
        if perm.size != x.shape[0]:  # padded groups: zero rows between them
            x = hidden.new_zeros(perm.size, d).index_copy_(0, perm.dest, x)  # [P, D]
        y = x.new_empty(perm.size, d)  # [P, D]
        hs, acts = [], []  # per chunk: [rows, 2F] = [gate | up], [rows, F]
        for c in groups.chunks:
            rows = slice(c.start, c.end)
            h = _gmm(x[rows], w13c, c, groups, trans=True)
            a = torch.mul(F.silu(h[:, :f]), h[:, f:])
            _gmm(a, w2c, c, groups, trans=True, out=y[rows])
            if keep:  # chunk-sized buffers: big ones would be fresh pages on every call
                hs.append(h)
                acts.append(a)
        yk = y.index_select(0, perm.rows).view(t, k, d)  # [T, k, D] pair order
        out = hidden.new_empty(t, d)  # [T, D]
        for s in range(0, t, TOKEN_CHUNK):  # fp32 products in cache-sized pieces
            out[s : s + TOKEN_CHUNK] = (
                yk[s : s + TOKEN_CHUNK] * weights[s : s + TOKEN_CHUNK, :, None]
            ).sum(1)
        ctx.save_for_backward(weights, w13c, w2c, x, yk)
        ctx.hs, ctx.acts = hs, acts  # intermediates, not inputs or outputs: plain attributes
        ctx.perm, ctx.groups = perm, groups
        ctx.param_dtypes = (w13.dtype, w2.dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        weights, w13c, w2c, x, yk = ctx.saved_tensors
        hs, acts = ctx.hs, ctx.acts
        ctx.hs = ctx.acts = None
        perm: Permutation = ctx.perm
        groups: _Groups = ctx.groups
        t, k = weights.shape
        d, f = w2c.shape[1], w2c.shape[2]
        dout = dout.contiguous()
        want_gw = ctx.needs_input_grad[1]
        grad_weights = torch.empty_like(weights) if want_gw else None  # [T, k]
        padded = perm.size != t * k
        dy = dout.new_zeros(perm.size, d) if padded else dout.new_empty(perm.size, d)  # [P, D]
        for s in range(0, t, TOKEN_CHUNK):  # in cache-sized pieces of tokens
            piece = slice(s, s + TOKEN_CHUNK)
            g = dout[piece].unsqueeze(1)  # [n, 1, D]
            if want_gw:  # d out[t] / d weights[t, j] = <dout[t], y of pair (t, j)>
                grad_weights[piece] = torch.linalg.vecdot(yk[piece].float(), g.float())
            dyk = (g * weights[piece, :, None]).to(
                dout.dtype
            )  # [n, k, D] fp32 product, rounded once
            dy.index_copy_(0, perm.rows[s * k : (s + TOKEN_CHUNK) * k], dyk.view(-1, d))
        new = torch.empty if groups.covers_every_expert() else torch.zeros
        grad_w13 = new(w13c.shape, dtype=w13c.dtype, device=w13c.device)  # [E, 2F, D]
        grad_w2 = new(w2c.shape, dtype=w2c.dtype, device=w2c.device)  # [E, D, F]
        dx = dout.new_empty(perm.size, d)  # [P, D]
        for c, h, a in zip(groups.chunks, hs, acts, strict=True):
            rows = slice(c.start, c.end)
            da = _gmm(dy[rows], w2c, c, groups, trans=False)  # [rows, F]
            _gmm_grad(dy[rows], a, c, groups, grad_w2)
            gate, up = h[:, :f], h[:, f:]
            dh = torch.empty_like(h)  # [rows, 2F] = [d gate | d up]
            torch.mul(da, F.silu(gate), out=dh[:, f:])
            torch.ops.aten.silu_backward.grad_input(da.mul_(up), gate, grad_input=dh[:, :f])
            _gmm_grad(dh, x[rows], c, groups, grad_w13)
            _gmm(dh, w13c, c, groups, trans=False, out=dx[rows])
        grad_hidden = dx.index_select(0, perm.rows).view(t, k, d).sum(1)  # [T, D]
        return (
            grad_hidden,
            grad_weights,
            grad_w13.to(ctx.param_dtypes[0]),
            grad_w2.to(ctx.param_dtypes[1]),
            None,
            None,
            None,
        )


def grouped_swiglu(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    backend: GemmBackend | None = None,
) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * SwiGLU_{e[t, j]}(hidden[t])`` for ``hidden`` [T, D]
    (computed in its dtype), ``top_k_index``/``top_k_weights`` [T, k], experts
    ``gate_up_proj`` [E, 2F, D] (gate rows first) and ``down_proj`` [E, D, F];
    differentiable in hidden, the router weights and both weight banks. ``backend``
    overrides ``default_gemm_backend``."""
    num_experts = gate_up_proj.shape[0]
    counts = torch.bincount(top_k_index.reshape(-1), minlength=num_experts)
    backend = backend or default_gemm_backend(hidden, counts)
    perm = make_permutation(top_k_index, num_experts, capacity=backend == "bmm")
    groups = _Groups.make(backend, perm)
    inputs = (hidden, top_k_weights, gate_up_proj, down_proj)
    keep = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    return _GroupedSwiGLU.apply(*inputs, perm, groups, keep)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU MLPs in transformers' ``MixtralExperts`` layout.

    ``forward(hidden [T, D], top_k_index [T, k], top_k_weights [T, k]) -> [T, D]``, the
    same call transformers' ``MixtralSparseMoeBlock`` makes, so this module can stand in
    for its ``experts``.
    """

    @dataclass(frozen=True, kw_only=True)
    class Config:
        dim: int
        hidden: int
        num_experts: int
        impl: Impl = "grouped"

    def __init__(self, config: GroupedExperts.Config, mx: MXTrainingConfig | None = None):
        super().__init__()
        self.config = config
        self.mx = mx
        e, d, f = config.num_experts, config.dim, config.hidden
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * f, d))  # [E, 2F, D]
        self.down_proj = nn.Parameter(torch.empty(e, d, f))  # [E, D, F]
        nn.init.normal_(self.gate_up_proj, std=d**-0.5)
        nn.init.normal_(self.down_proj, std=f**-0.5)

    @staticmethod
    def can_wrap(module: nn.Module) -> bool:
        """True for a transformers ``MixtralExperts``-style bank this class can run."""
        if isinstance(module, GroupedExperts):
            return module.mx is None
        gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(gu, nn.Parameter) and isinstance(down, nn.Parameter)):
            return False
        if gu.dim() != 3 or down.dim() != 3 or hasattr(module, "gate_up_proj_bias"):
            return False
        e, two_f, d = gu.shape
        if down.shape != (e, d, two_f // 2) or getattr(module, "is_transposed", False):
            return False
        act = getattr(module, "act_fn", None)
        probe = torch.linspace(-3, 3, 7)
        return act is not None and torch.allclose(act(probe), F.silu(probe))

    @classmethod
    def wrap(
        cls, module: nn.Module, *, mx: MXTrainingConfig | None = None, impl: Impl = "grouped"
    ) -> GroupedExperts:
        """A ``GroupedExperts`` that shares ``module``'s parameter objects (no copy)."""
        e, two_f, d = module.gate_up_proj.shape
        if isinstance(module, GroupedExperts):
            impl = module.config.impl
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.config = cls.Config(dim=d, hidden=two_f // 2, num_experts=e, impl=impl)
        new.mx = mx
        new.gate_up_proj = module.gate_up_proj
        new.down_proj = module.down_proj
        return new

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.config.impl == "loop":
            return self.forward_loop(hidden, top_k_index, top_k_weights)
        return self.forward_grouped(hidden, top_k_index, top_k_weights)

    def _linear(self, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.mx is None:
            return F.linear(x.to(dtype), w.to(dtype))
        return mx_linear(x.to(dtype), w, cfg=self.mx)

    def forward_loop(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The reference: one expert at a time, as transformers' Mixtral does it."""
        dtype = compute_dtype(hidden)
        hidden = hidden.to(dtype)
        out = torch.zeros_like(hidden)  # [T, D]
        for e in range(self.config.num_experts):
            token, slot = torch.where(top_k_index == e)  # [n_e], [n_e]
            if token.numel() == 0:
                continue
            gate, up = self._linear(hidden[token], self.gate_up_proj[e], dtype).chunk(2, dim=-1)
            y = self._linear(F.silu(gate) * up, self.down_proj[e], dtype)  # [n_e, D]
            y = y * top_k_weights[token, slot, None]  # fp32 router weights
            out.index_add_(0, token, y.to(dtype))
        return out

    def forward_grouped(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The fast path: permute once, two grouped GEMMs, one weighted scatter-add."""
        dtype = compute_dtype(hidden)
        hidden = hidden.to(dtype)
        if self.mx is None:
            return grouped_swiglu(
                hidden, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj
            )
        align = BLOCK
        perm = make_permutation(top_k_index, self.config.num_experts, align)
        x = permute(hidden, perm)  # [P, D]
        gate, up = self._gmm(x, self.gate_up_proj, perm, dtype).chunk(2, dim=-1)  # [P, F] x2
        y = self._gmm(F.silu(gate) * up, self.down_proj, perm, dtype)  # [P, D]
        return unpermute(y, perm, top_k_weights, out=torch.zeros_like(hidden))  # [T, D]

    def _gmm(self, x: torch.Tensor, w: torch.Tensor, perm: Permutation, dtype: torch.dtype):
        if self.mx is None:
            return grouped_mm(x, w.to(dtype), perm.offsets)
        return _MXGroupedMM.apply(x, w, perm.offsets, self.mx, dtype)

    def extra_repr(self) -> str:
        c = self.config
        mx = f", mx={self.mx.elem}/{self.mx.mode}" if self.mx else ""
        return f"experts={c.num_experts}, dim={c.dim}, hidden={c.hidden}, impl={c.impl}{mx}"


# ---------------------------------------------------------------------- MoE layer


@dataclass(frozen=True, kw_only=True)
class MoEAux:
    load_balance: torch.Tensor  # scalar, 1.0 when balanced
    z: torch.Tensor  # scalar router z-loss
    tokens_per_expert: torch.Tensor  # [E]


class MoE(nn.Module):
    """Router + ``GroupedExperts``: ``[..., D] -> [..., D]``; losses in ``self.aux``."""

    @dataclass(frozen=True, kw_only=True)
    class Config:
        dim: int
        hidden: int
        num_experts: int = 8
        top_k: int = 2
        impl: Impl = "grouped"
        mx: MXTrainingConfig | None = None

    def __init__(self, config: MoE.Config):
        super().__init__()
        self.config = config
        self.gate = Router(
            Router.Config(dim=config.dim, num_experts=config.num_experts, top_k=config.top_k)
        )
        self.experts = GroupedExperts(
            GroupedExperts.Config(
                dim=config.dim,
                hidden=config.hidden,
                num_experts=config.num_experts,
                impl=config.impl,
            ),
            mx=config.mx,
        )
        self.aux: MoEAux | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [T, D]
        r = self.gate(flat)
        self.aux = MoEAux(
            load_balance=load_balancing_loss(r.probs, r.indices),
            z=router_z_loss(r.logits),
            tokens_per_expert=torch.bincount(
                r.indices.reshape(-1), minlength=self.config.num_experts
            ),
        )
        return self.experts(flat, r.indices, r.weights).reshape(shape)


def use_grouped_experts(model: nn.Module) -> nn.Module:
    """Swap every transformers ``MixtralExperts``-style bank in ``model`` for the grouped
    path (high precision), in place; parameters, names and checkpoints unchanged."""
    swaps = [
        (n, m)
        for n, m in model.named_modules()
        if n and not isinstance(m, GroupedExperts) and GroupedExperts.can_wrap(m)
    ]
    for name, module in swaps:
        parent, _, child = name.rpartition(".")
        setattr(
            model.get_submodule(parent) if parent else model, child, GroupedExperts.wrap(module)
        )
    return model
