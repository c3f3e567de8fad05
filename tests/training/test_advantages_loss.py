"""The clipped policy loss against hand-computed numbers."""

import math

import pytest
import torch
from opencomposer.training.loss import LossConfig, policy_loss, token_logprobs_and_entropy

L = math.log


def _case():
    # seq0 A=+1: ratios 1.5 (clipped at 1.28), 0.5, (masked); seq1 A=-1: 1.5, 0.5, 1.0
    logprobs = torch.tensor([[L(1.5), L(0.5), 5.0], [L(1.5), L(0.5), 0.0]], requires_grad=True)
    old = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return logprobs, old, adv, mask


def test_token_level_clipped_loss_by_hand():
    logprobs, old, adv, mask = _case()
    loss, stats = policy_loss(
        logprobs, old, adv, mask, config=LossConfig(clip_low=0.2, clip_high=0.28)
    )
    # per token: -1.28, -0.5 | +1.5, +0.8, +1.0 -> 1.52 / 5 tokens
    assert float(loss.detach()) == pytest.approx(0.304, abs=1e-6)
    assert stats["tokens"] == 5
    assert stats["clip_frac"] == pytest.approx(2 / 5)  # 1.5 with A>0, 0.5 with A<0
    loss.backward()
    g = logprobs.grad
    assert float(g[0, 0]) == 0.0  # clipped: no gradient
    assert float(g[0, 1]) == pytest.approx(-0.5 / 5)  # d(-ratio*A)/dlogp = -ratio*A
    assert float(g[0, 2]) == 0.0  # masked
    assert float(g[1, 0]) == pytest.approx(1.5 / 5)  # unclipped side wins for A<0
    assert float(g[1, 1]) == 0.0  # 0.5 < 0.8 with A<0: clipped


def test_sequence_aggregation_by_hand():
    logprobs, old, adv, mask = _case()
    loss, _ = policy_loss(logprobs, old, adv, mask, config=LossConfig(aggregation="sequence"))
    assert float(loss.detach()) == pytest.approx(
        ((-1.28 - 0.5) / 2 + (1.5 + 0.8 + 1.0) / 3) / 2, abs=1e-6
    )


def test_separate_low_and_high_clip():
    lp = torch.tensor([[L(0.7)]])
    old = torch.zeros(1, 1)
    loss, _ = policy_loss(
        lp,
        old,
        torch.tensor([-1.0]),
        torch.ones(1, 1),
        config=LossConfig(clip_low=0.1, clip_high=0.5),
    )
    # A<0, ratio 0.7 below 1-0.1: -min(-0.7, -0.9) = 0.9
    assert float(loss.detach()) == pytest.approx(0.9)


def test_kl_to_reference_k3():
    lp = torch.zeros(1, 2)
    ref = torch.full((1, 2), L(2.0))
    loss, stats = policy_loss(
        lp,
        lp.clone(),
        torch.tensor([0.0]),
        torch.ones(1, 2),
        config=LossConfig(kl_coef=0.5),
        ref_logprobs=ref,
    )
    k3 = 2.0 - L(2.0) - 1.0
    assert stats["kl_ref"] == pytest.approx(k3)
    assert float(loss.detach()) == pytest.approx(0.5 * k3)


def test_micro_batches_sum_to_the_full_batch_loss():
    logprobs, old, adv, mask = _case()
    full, _ = policy_loss(logprobs, old, adv, mask)
    parts = sum(
        policy_loss(
            logprobs[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], num_tokens=5.0
        )[0]
        for i in range(2)
    )
    assert float(parts.detach()) == pytest.approx(float(full.detach()))


def test_logprobs_and_entropy_of_uniform_logits():
    logits = torch.zeros(1, 2, 4)
    lp, ent = token_logprobs_and_entropy(logits, torch.tensor([[0, 3]]))
    assert lp.tolist()[0] == pytest.approx([L(0.25)] * 2)
    assert ent.tolist()[0] == pytest.approx([L(4.0)] * 2)
