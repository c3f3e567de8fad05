"""A tiny mixture-of-experts language model and its training loop, shipped as a test double.

Used by ``benchmarks/kernels.py`` and the slow tests to train the same model from the
same initialization on the same bytes in bf16 (autocast) and in MXFP8 (``to_mxfp8_training``
under the same autocast) and compare the losses. Byte-level (vocabulary 256), pre-norm
decoder: RMSNorm -> causal attention (``scaled_dot_product_attention``) -> RMSNorm -> ``MoE``.
Torch only.

    from opencomposer.kernels.train_tiny import TinyMoELM, train
    losses = train(TinyMoELM.Config(), text=open("README.md", "rb").read(), steps=200)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from opencomposer.kernels.convert import to_mxfp8_training
from opencomposer.kernels.moe import MoE
from torch import nn


class Block(nn.Module):
    def __init__(self, cfg: TinyMoELM.Config):
        super().__init__()
        self.heads = cfg.heads
        self.attn_norm = nn.RMSNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.moe_norm = nn.RMSNorm(cfg.dim)
        self.moe = MoE(
            MoE.Config(dim=cfg.dim, hidden=cfg.hidden, num_experts=cfg.experts, top_k=cfg.top_k)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, -1).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )  # [B, H, T, d/H]
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.moe(self.moe_norm(x))


class TinyMoELM(nn.Module):
    """Byte-level MoE decoder; ``forward(ids [B, T]) -> logits [B, T, 256]``."""

    @dataclass(frozen=True, kw_only=True)
    class Config:
        dim: int = 64
        heads: int = 2
        hidden: int = 128
        layers: int = 2
        experts: int = 8
        top_k: int = 2
        seq: int = 64
        vocab: int = 256

    def __init__(self, cfg: TinyMoELM.Config):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Parameter(torch.randn(cfg.seq, cfg.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]  # [B, T, D]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))  # [B, T, V]

    def aux_loss(self) -> torch.Tensor:
        """Sum over layers of the load-balancing loss plus 1e-3 times the z-loss."""
        return sum(b.moe.aux.load_balance + 1e-3 * b.moe.aux.z for b in self.blocks)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 200
    batch: int = 8
    lr: float = 3e-3
    warmup: int = 20
    aux_coef: float = 0.01
    seed: int = 0
    precision: Literal["fp32", "bf16", "mxfp8"] = "bf16"
    model: TinyMoELM.Config = field(default_factory=TinyMoELM.Config)


def train(cfg: TrainConfig, text: bytes) -> list[float]:
    """Train a fresh ``TinyMoELM`` on random windows of ``text``; returns per-step
    language-model losses. Same seed -> same init and same batches in every precision."""
    torch.manual_seed(cfg.seed)
    model = TinyMoELM(cfg.model)
    if cfg.precision == "mxfp8":
        to_mxfp8_training(model)
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup))
    seq = cfg.model.seq
    losses = []
    for _ in range(cfg.steps):
        start = torch.randint(0, len(data) - seq - 1, (cfg.batch,), generator=gen)
        window = torch.stack([data[s : s + seq + 1] for s in start.tolist()])  # [B, T+1]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.precision != "fp32"):
            logits = model(window[:, :-1])
        loss = F.cross_entropy(
            logits.float().reshape(-1, cfg.model.vocab), window[:, 1:].reshape(-1)
        )
        opt.zero_grad(set_to_none=True)
        (loss + cfg.aux_coef * model.aux_loss()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses
