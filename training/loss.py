"""The policy-gradient loss: clipped importance ratio, token-level mean, optional KL.

For every completion token t of a rollout with advantage A:

    ratio_t = exp(logp_t - logp_old_t)            # logp_old: what the sampler recorded
    loss_t  = -min(ratio_t * A, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A)
            + kl_coef * k3(logp_t, logp_ref_t)     # optional, k3 = e^(ref-logp) - (ref-logp) - 1

Departures from PPO-as-written, and why:

- the old logprobs are the *sampler's* (vLLM's) logprobs, recorded at rollout
  time, not a re-computation by the trainer: with asynchronous rollouts they are
  the behaviour policy, so the ratio also corrects for staleness;
- separate low/high clip ("clip-higher", DAPO): a larger upper bound lets rare
  good tokens grow, which keeps entropy from collapsing;
- token-level aggregation (DAPO / Dr. GRPO): the loss is a sum over every
  unmasked token of the step divided by the step's total number of unmasked
  tokens (``num_tokens``), so long answers are not down-weighted per token and
  gradient accumulation over micro-batches gives exactly the full-batch loss;
  ``aggregation="sequence"`` gives the original GRPO per-sequence mean instead;
- the mask is 1 on model-generated tokens only: prompts, tool results and
  padding carry no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["token", "sequence"]


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    aggregation: Aggregation = "token"


def policy_loss(
    logprobs: torch.Tensor,  # [B, T] under the current weights (requires grad)
    old_logprobs: torch.Tensor,  # [B, T] recorded by the sampler
    advantages: torch.Tensor,  # [B]
    mask: torch.Tensor,  # [B, T] 1 on trained tokens
    *,
    config: LossConfig = LossConfig(),
    ref_logprobs: torch.Tensor | None = None,  # [B, T]
    num_tokens: float | None = None,
    num_sequences: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss (to be summed over micro-batches) and detached statistics.

    ``num_tokens`` (token aggregation) or ``num_sequences`` (sequence
    aggregation) is the normaliser of the whole optimizer step; without it the
    micro-batch's own count is used.
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs) * mask
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logprobs.dtype)[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None:
        d = (ref_logprobs - logprobs) * mask
        kl = torch.exp(d) - d - 1.0
        if config.kl_coef:
            per_token = per_token + config.kl_coef * kl
    per_token = per_token * mask
    if config.aggregation == "token":
        denom = num_tokens if num_tokens is not None else mask.sum().clamp(min=1.0)
        loss = per_token.sum() / denom
    elif config.aggregation == "sequence":
        seq = per_token.sum(-1) / mask.sum(-1).clamp(min=1.0)
        denom = num_sequences if num_sequences is not None else float(seq.shape[0])
        loss = seq.sum() / denom
    else:
        raise ValueError(f"unknown aggregation {config.aggregation!r}; use 'token' or 'sequence'")
    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)
        is_clipped = ((ratio < 1.0 - config.clip_low) & (adv < 0)) | (
            (ratio > 1.0 + config.clip_high) & (adv > 0)
        )
        stats = {
            "ratio_mean": float((ratio * mask).sum() / n),
            "clip_frac": float((is_clipped.to(mask.dtype) * mask).sum() / n),
            "kl_old": float((-log_ratio * mask).sum() / n),  # k1 estimate of KL(old || new)
            "kl_ref": float((kl * mask).sum() / n),
            "tokens": float(mask.sum()),
        }
    return loss, stats


def token_logprobs_and_entropy(
    logits: torch.Tensor,  # [B, T, V] for positions 0..T-1
    targets: torch.Tensor,  # [B, T] the next token at each position
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and the entropy of the distribution, per position, in fp32."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, T, V]
    chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, T]
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)  # [B, T]
    return chosen, entropy
