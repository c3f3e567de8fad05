"""Group-relative advantages: GRPO, Dr. GRPO and RLOO.

A group is the G rollouts of one task. Each estimator turns the group's rewards
into one advantage per rollout, which every completion token of that rollout
shares:

- ``grpo``: ``(r_i - mean) / (std + eps)`` with the unbiased (n-1) standard
  deviation, as in DeepSeekMath.
- ``dr_grpo``: ``r_i - mean``; Dr. GRPO ("Understanding R1-Zero-Like Training")
  drops the std division because it up-weights groups that are nearly all right or
  all wrong.
- ``rloo``: ``r_i - mean_{j != i} r_j``, the leave-one-out baseline; it equals
  ``G / (G - 1) * (r_i - mean)``.

A group whose rewards are all equal carries no signal for any of them (every
advantage is 0): it is skipped (``None``), so it neither costs a training pass nor
dilutes the token-level mean. Rollouts that crashed or timed out are removed
before this point (see ``rollouts.group_samples``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

Estimator = Literal["grpo", "dr_grpo", "rloo"]
ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo")


def group_advantages(
    rewards: Sequence[float], *, estimator: Estimator = "grpo", eps: float = 1e-6
) -> list[float] | None:
    """Advantages for one group, or None when the group is skipped.

    A group is skipped when it has fewer than two rewards or all are equal
    (within 1e-12).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; use one of {ESTIMATORS}")
    n = len(rewards)
    if n < 2 or max(rewards) - min(rewards) <= 1e-12:
        return None
    mean = sum(rewards) / n
    if estimator == "dr_grpo":
        return [r - mean for r in rewards]
    if estimator == "rloo":
        total = sum(rewards)
        return [r - (total - r) / (n - 1) for r in rewards]
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
    return [(r - mean) / (std + eps) for r in rewards]
