"""MoE layers: the grouped path against the per-expert loop reference, permutation,
aux losses, the MXFP8 variant, and standing in for transformers' Mixtral experts."""

from __future__ import annotations

import pytest
import torch
from opencomposer.kernels import moe
from opencomposer.kernels.moe import GroupedExperts, MoE, Router
from opencomposer.kernels.mx import MXTrainingConfig, to_mxfp8_training


def make_moe(impl="grouped", mx=None, dim=64, hidden=96, experts=8, k=2, seed=0) -> MoE:
    torch.manual_seed(seed)
    cfg = MoE.Config(dim=dim, hidden=hidden, num_experts=experts, top_k=k, impl=impl, mx=mx)
    return MoE(cfg)


def both_paths(mx=None, **kw) -> tuple[MoE, MoE]:
    fast = make_moe("grouped", mx, **kw)
    ref = make_moe("loop", mx, **kw)
    ref.load_state_dict(fast.state_dict())
    return fast, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matches_loop_forward_and_backward(dtype):
    fast, ref = both_paths()
    fast, ref = fast.to(dtype), ref.to(dtype)
    x = torch.randn(3, 37, 64, dtype=dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = fast(xa), ref(xb)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(ya, yb, **tol)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(xa.grad, xb.grad, **tol)
    for (name, pa), pb in zip(fast.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(pa.grad, pb.grad, **tol, msg=name)


def test_grouped_handles_experts_that_get_no_tokens():
    fast, ref = both_paths()
    with torch.no_grad():  # route everything to experts 2 and 5
        fast.gate.weight.zero_()
        fast.gate.weight[2, 0] = fast.gate.weight[5, 0] = 10.0
        ref.gate.weight.copy_(fast.gate.weight)
    x = torch.randn(20, 64)
    x[:, 0] = x[:, 0].abs() + 1
    ya, yb = fast(x), ref(x)
    assert fast.aux.tokens_per_expert.tolist() == [0, 0, 20, 0, 0, 20, 0, 0]
    torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-5)
    ya.sum().backward()
    assert fast.experts.gate_up_proj.grad[0].abs().max() == 0


def test_mx_grouped_matches_mx_loop():
    mx = MXTrainingConfig()
    fast, ref = both_paths(mx=mx)
    x = torch.randn(50, 64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = fast(xa), ref(xb)
    torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        fast.experts.down_proj.grad, ref.experts.down_proj.grad, rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(
        fast.experts.gate_up_proj.grad, ref.experts.gate_up_proj.grad, rtol=1e-5, atol=1e-5
    )


def test_mx_moe_is_close_to_high_precision_and_really_quantizes():
    hp, _ = both_paths()
    q = make_moe(mx=MXTrainingConfig())
    q.load_state_dict(hp.state_dict())
    x = torch.randn(64, 64)
    a, b = hp(x), q(x)
    err = ((a - b).pow(2).sum() / a.pow(2).sum()).sqrt()
    assert 1e-3 < err < 0.1


def test_permutation_round_trip_and_alignment():
    idx = torch.tensor([[0, 3], [3, 1], [0, 1], [3, 0]])  # [T=4, k=2]
    perm = moe.make_permutation(idx, num_experts=4, align=4)
    assert perm.counts.tolist() == [3, 2, 0, 3]
    assert perm.offsets.tolist() == [4, 8, 8, 12]
    x = torch.arange(4.0).repeat_interleave(3).view(4, 3)  # token t is the row [t, t, t]
    buf = moe.permute(x, perm)  # [P=12, 3]
    assert buf[:, 0].tolist() == [0, 2, 3, 0, 1, 2, 0, 0, 0, 1, 3, 0]
    back = moe.unpermute(buf, perm, torch.full((4, 2), 0.5))
    torch.testing.assert_close(back, x)


def test_router_softmax_runs_in_fp32_and_renormalizes():
    r = Router(Router.Config(dim=32, num_experts=8, top_k=2)).to(torch.bfloat16)
    out = r(torch.randn(10, 32, dtype=torch.bfloat16))
    assert out.logits.dtype == torch.float32 and out.probs.dtype == torch.float32
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(10))
    assert out.indices.shape == (10, 2)


def test_aux_losses():
    e = 4
    balanced = torch.full((8, e), 1 / e)
    idx = torch.arange(8).remainder(e).view(8, 1)
    assert moe.load_balancing_loss(balanced, idx).item() == pytest.approx(1.0)
    collapsed = torch.zeros(8, e)
    collapsed[:, 0] = 1
    assert moe.load_balancing_loss(collapsed, torch.zeros(8, 1, dtype=torch.long)).item() == e
    logits = torch.zeros(5, e)
    assert moe.router_z_loss(logits).item() == pytest.approx(torch.log(torch.tensor(4.0)) ** 2)
    m = make_moe()
    m(torch.randn(16, 64))
    assert m.aux.load_balance.requires_grad and m.aux.z.requires_grad


def test_stands_in_for_transformers_mixtral_experts():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    model = MixtralForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        ref = model(ids).logits
        keys = model.state_dict().keys()
        moe.use_grouped_experts(model)
        assert isinstance(model.model.layers[0].mlp.experts, GroupedExperts)
        assert model.state_dict().keys() == keys
        torch.testing.assert_close(model(ids).logits, ref, rtol=1e-5, atol=1e-5)
        to_mxfp8_training(model)
        experts = model.model.layers[0].mlp.experts
        assert experts.mx is not None
        assert experts.gate_up_proj is model.model.layers[0].mlp.experts.gate_up_proj
        assert (model(ids).logits - ref).abs().max() < 0.5
