"""MoE layers: the grouped path against the per-expert loop reference, permutation,
aux losses, the MXFP8 variant, and standing in for transformers' Mixtral experts."""

from __future__ import annotations

import pytest
import torch
from opencomposer.kernels import moe
from opencomposer.kernels.convert import to_mxfp8_training
from opencomposer.kernels.moe import GroupedExperts, MoE, Router
from opencomposer.kernels.mx import MXTrainingConfig


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


def _expert_grads(fn, hidden, weights, experts, g):
    """Output and gradients (hidden, router weights, both banks) of one expert path."""
    h = hidden.clone().requires_grad_()
    w = weights.clone().requires_grad_()
    experts.zero_grad(set_to_none=True)
    y = fn(h, w)
    y.backward(g)
    return [y, h.grad, w.grad, experts.gate_up_proj.grad, experts.down_proj.grad]


@pytest.mark.parametrize("backend", ["bmm", "mm", "grouped_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routing", ["random", "skewed"])
def test_every_gemm_backend_matches_the_loop(backend, dtype, routing):
    """Values and all four gradients, for each backend, against the per-expert loop;
    bf16 is judged by its error against an fp32 run, which must not exceed the loop's."""
    torch.manual_seed(1)
    t, d, f, e, k = 67, 64, 96, 8, 2
    experts = GroupedExperts(GroupedExperts.Config(dim=d, hidden=f, num_experts=e))
    hidden = torch.randn(t, d)
    if routing == "random":
        index = torch.stack([torch.randperm(e)[:k] for _ in range(t)])  # [T, k]
    else:  # experts 6 and 7 get nothing, expert 0 gets every token
        index = torch.stack([torch.tensor([0, 1 + i % 5]) for i in range(t)])
    weights = torch.rand(t, k).softmax(-1)  # fp32, as the router gives them
    g = torch.randn(t, d)

    def fast(h, w):
        return moe.grouped_swiglu(
            h, index, w, experts.gate_up_proj, experts.down_proj, backend=backend
        )

    def loop(h, w):
        return experts.forward_loop(h, index, w)

    gold = _expert_grads(loop, hidden, weights, experts, g)  # fp32 loop
    if dtype == torch.float32:
        got = _expert_grads(fast, hidden, weights, experts, g)
        for name, a, b in zip(["out", "hidden", "weights", "w13", "w2"], got, gold, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
        return
    experts.to(dtype)
    args = (hidden.to(dtype), weights, experts, g.to(dtype))
    got, ref = _expert_grads(fast, *args), _expert_grads(loop, *args)
    for name, a, b, c in zip(
        ["out", "hidden", "weights", "w13", "w2"], got, ref, gold, strict=True
    ):
        assert a.dtype == b.dtype, name
        scale = c.abs().max()
        err_fast = ((a.float() - c).abs().max() / scale).item()
        err_loop = ((b.float() - c).abs().max() / scale).item()
        assert err_fast <= 1.5 * err_loop + 1e-3, (name, err_fast, err_loop)
        assert err_fast < 0.02, (name, err_fast)
    if routing == "skewed":  # experts without tokens get exact zeros
        assert experts.gate_up_proj.grad[6:].abs().max() == 0


def test_bmm_chunks_that_do_not_divide_the_experts():
    """``bmm`` runs experts in chunks of the thread count: 3 threads, 8 experts -> 3+3+2."""
    torch.manual_seed(2)
    experts = GroupedExperts(GroupedExperts.Config(dim=32, hidden=64, num_experts=8))
    hidden, index = torch.randn(40, 32), torch.stack([torch.randperm(8)[:2] for _ in range(40)])
    weights, g = torch.rand(40, 2), torch.randn(40, 32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        got = _expert_grads(
            lambda h, w: moe.grouped_swiglu(
                h, index, w, experts.gate_up_proj, experts.down_proj, backend="bmm"
            ),
            hidden, weights, experts, g,
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    ref = _expert_grads(lambda h, w: experts.forward_loop(h, index, w), hidden, weights, experts, g)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["bmm", "mm"])
def test_grouped_with_no_tokens(backend):
    experts = GroupedExperts(GroupedExperts.Config(dim=32, hidden=64, num_experts=4))
    h = torch.zeros(0, 32, requires_grad=True)
    w = torch.zeros(0, 2, requires_grad=True)
    index = torch.zeros(0, 2, dtype=torch.long)
    out = moe.grouped_swiglu(h, index, w, experts.gate_up_proj, experts.down_proj, backend=backend)
    assert out.shape == (0, 32)
    out.sum().backward()
    assert experts.gate_up_proj.grad.abs().max() == 0


def test_grouped_inference_matches_training_forward():
    """Under no_grad the node keeps no activations; the output must not change."""
    fast, ref = both_paths()
    x = torch.randn(30, 64)
    with torch.no_grad():
        a, b = fast(x), ref(x)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a, fast(x).detach())


def test_grouped_under_autocast_keeps_fp32_master_gradients():
    """The trainer's setting: fp32 parameters, bf16 autocast. Gradients land in fp32."""
    fast, ref = both_paths()
    x = torch.randn(40, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya, yb = fast(x), ref(x)
    assert ya.dtype == yb.dtype == torch.bfloat16
    torch.testing.assert_close(ya, yb, rtol=2e-2, atol=2e-2)
    ya.float().sum().backward()
    yb.float().sum().backward()
    for (name, pa), pb in zip(fast.named_parameters(), ref.parameters(), strict=True):
        assert pa.grad.dtype == torch.float32, name
        scale = pb.grad.abs().max()
        assert (pa.grad - pb.grad).abs().max() <= 0.02 * scale, name


def test_default_gemm_backend_by_threads_and_balance():
    x = torch.zeros(4, 8)
    balanced, skewed = torch.tensor([10, 11, 9, 10]), torch.tensor([40, 0, 0, 0])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert moe.default_gemm_backend(x, balanced) == "bmm"
        assert moe.default_gemm_backend(x, skewed) == "mm"  # padding would be 4x
        assert moe.default_gemm_backend(x.bfloat16(), balanced) == "mm"
        assert moe.default_gemm_backend(x, torch.zeros(4, dtype=torch.long)) == "mm"
        torch.set_num_threads(1)
        assert moe.default_gemm_backend(x, balanced) == "mm"
    finally:
        torch.set_num_threads(threads)


def test_capacity_permutation_pads_every_group_to_the_largest():
    idx = torch.tensor([[0, 3], [3, 1], [0, 1], [3, 0]])  # counts [3, 2, 0, 3]
    perm = moe.make_permutation(idx, num_experts=4, capacity=True)
    assert perm.size == 12 and perm.offsets.tolist() == [3, 6, 9, 12]
    x = torch.arange(1.0, 5.0).unsqueeze(-1)  # token t is the row [t + 1]
    buf = moe.permute(x, perm)
    assert buf[:, 0].tolist() == [1, 3, 4, 2, 3, 0, 0, 0, 0, 1, 2, 4]


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
