"""Mixture-of-experts layers: top-k router, token permutation, grouped expert GEMMs.

A token goes through ``top_k`` of ``num_experts`` SwiGLU experts chosen by a linear
router whose softmax runs in fp32 (Mixtral's routing: softmax over all experts, keep the
top k, renormalize them). Two expert paths compute the same function:

- ``impl="loop"``: for each expert, gather its tokens, run the MLP, scatter-add back --
  the reference, written as transformers' Mixtral does it, which the fast path is tested
  against;
- ``impl="grouped"``: sort the (token, slot) pairs by expert once (``permute``), run
  all experts as two ``torch._grouped_mm`` calls over contiguous groups, undo the sort
  (``unpermute``). ``torch._grouped_mm`` works on this CPU build (fp32 and bf16,
  forward and backward) as well as on CUDA.

The expert weights use transformers' ``MixtralExperts`` layout and names
(``gate_up_proj`` [E, 2F, D], ``down_proj`` [E, D, F]), so ``GroupedExperts.wrap`` can
take over a Hugging Face Mixtral's experts without copying and ``save_pretrained`` still
writes an ordinary Mixtral checkpoint. With an ``MXTrainingConfig`` the grouped GEMMs
run in MXFP8 (emulated: exact quantize-dequantize around ``_grouped_mm``; forward
blocks along the model dim, backward along the output dim for the input gradient and
along each expert's tokens for the weight gradient -- groups are padded to 32 tokens so
no block straddles two experts).

Auxiliary losses: the Switch/Mixtral load-balancing loss (1.0 when perfectly balanced)
and the ST-MoE router z-loss. ``MoE.forward`` leaves them in ``MoE.aux``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from opencomposer.kernels.mx import BLOCK, MXTrainingConfig, compute_dtype, fake_quantize
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


def make_permutation(indices: torch.Tensor, num_experts: int, align: int = 1) -> Permutation:
    """Sort the pairs of ``indices`` [T, k] by expert (stable); pad every expert's group
    to a multiple of ``align`` rows."""
    flat = indices.reshape(-1)  # [T*k]
    order = torch.argsort(flat, stable=True)  # [T*k] pair ids grouped by expert
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    padded = (counts + align - 1) // align * align  # [E]
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
        from opencomposer.kernels.mx import mx_linear

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
        align = BLOCK if self.mx is not None else 1
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
