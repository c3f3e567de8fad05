"""MXFP8 format: bit-exact against a scalar reference written from the OCP MX v1.0 spec,
SQNR at the level 3 mantissa bits give, MXLinear numerics, and the trainer hook."""

from __future__ import annotations

import math
import random
import struct

import pytest
import torch
import torch.nn.functional as F
from opencomposer.kernels import mx
from opencomposer.kernels.convert import mx_modules, to_mxfp8_training
from opencomposer.kernels.mx import MXFormatError, MXLinear, quantize
from torch import nn

# ----------------------------------------------------------------- scalar reference
# Written from the spec with Python floats (doubles) only; torch is used solely to
# encode an already-representable value into its float8 bit pattern.

SPEC = {  # mantissa bits, exponent bias, emax (exponent of the largest normal), max normal
    "e4m3": (3, 7, 8, 448.0),
    "e5m2": (2, 15, 15, 57344.0),
}


def f32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


def floor_log2(a: float) -> int:
    return math.frexp(a)[1] - 1


def ceil_log2(a: float) -> int:
    m, e = math.frexp(a)
    return e - 1 if m == 0.5 else e


def ref_element(v: float, elem: str) -> float:
    """Round ``v`` to the element format: nearest, ties to even, saturating."""
    mbits, bias, _, max_normal = SPEC[elem]
    sign = -1.0 if math.copysign(1.0, v) < 0 else 1.0
    a = min(abs(v), max_normal)
    if a == 0:
        return sign * 0.0
    e = max(floor_log2(a), 1 - bias)  # below the normal range: subnormal spacing
    ulp = 2.0 ** (e - mbits)
    n = a / ulp
    r = math.floor(n)
    if n - r > 0.5 or (n - r == 0.5 and r % 2 == 1):
        r += 1
    return sign * min(r * ulp, max_normal)


def ref_block(values: list[float], elem: str, mode: str) -> tuple[int, list[float] | None]:
    """(E8M0 code, element values) of one block; None elements for a NaN block."""
    _, _, emax, max_normal = SPEC[elem]
    if any(math.isnan(v) or math.isinf(v) for v in values):
        return 0xFF, None
    amax = max(abs(v) for v in values)
    if amax == 0:
        exp = -127
    elif mode == "floor":
        exp = floor_log2(amax) - emax
    else:
        exp = ceil_log2(f32(amax / max_normal))
    exp = max(-127, min(127, exp))
    scale = 2.0**exp
    return exp + 127, [ref_element(v / scale, elem) for v in values]


def ref_quantize(x: torch.Tensor, elem: str, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 element codes, uint8 scale codes) for a 2-D fp32 tensor."""
    dtype = mx.ELEM_FORMATS[elem].dtype
    nan_code = mx.ELEM_FORMATS[elem].nan_code
    rows, k = x.shape
    codes = torch.zeros(rows, k, dtype=torch.uint8)
    scales = torch.zeros(rows, k // 32, dtype=torch.uint8)
    for i in range(rows):
        for b in range(k // 32):
            scale, elems = ref_block(x[i, b * 32 : (b + 1) * 32].tolist(), elem, mode)
            scales[i, b] = scale
            if elems is None:
                codes[i, b * 32 : (b + 1) * 32] = nan_code
            else:
                enc = torch.tensor(elems, dtype=torch.float64).to(torch.float32).to(dtype)
                assert torch.equal(enc.to(torch.float64), torch.tensor(elems, dtype=torch.float64))
                codes[i, b * 32 : (b + 1) * 32] = enc.view(torch.uint8)
    return codes, scales


def block_of(values: list[float]) -> list[float]:
    """Pad a list of interesting values to a block with small fillers."""
    return (values + [0.0] * 32)[:32]


def edge_blocks() -> torch.Tensor:
    sub = 2.0**-140  # an fp32 subnormal
    tie_e4m3 = [256.0, 1.0625, 1.1875, -1.0625, 2.0**-10, 3 * 2.0**-10, 2.0**-9 * 1.5]
    rows = [
        [0.0] * 32,  # zero block
        [-0.0] * 32,  # negative zeros
        block_of([sub, -sub, 3 * sub, 2.0**-149]),  # fp32 subnormals only
        block_of([448.0, -448.0, 1.0, 0.5]),  # e4m3 max normal exactly
        block_of([449.0, 464.0, 500.0, -511.0, 1.0]),  # above max normal after scaling
        block_of([57344.0, 61440.0, -65000.0, 1.0]),  # e5m2 max normal and beyond
        block_of(tie_e4m3),  # ties to even at unit and subnormal spacing
        block_of([1.0, 1.0 + 2.0**-4, 1.0 + 3 * 2.0**-4, 2.0**-7, 2.0**-8 * 3]),  # more ties
        block_of([1.0e3, 1.0e-3, 1.0e-30, -7.0, 3.3e-5]),  # mixed magnitudes
        block_of([float("nan"), 1.0, 2.0]),  # NaN block
        block_of([float("inf"), 1.0]),  # Inf block
        block_of([-float("inf"), -1.0]),
        block_of([3.4028234663852886e38, -1.0e38, 1.0]),  # fp32 max
        block_of([1.17549435e-38, 2.0**-127, 2.0**-126 * 1.5]),  # smallest normals
        block_of([2.0**127, 2.0**-100]),  # huge exponent range in one block
        [float(i) - 16 for i in range(32)],  # integers
        [2.0 ** (i - 16) for i in range(32)],  # powers of two
        block_of([0.1, 0.2, 0.3, 0.7]),  # rceil scale = exact power of two boundary-ish
        block_of([448.0 * 2.0**-5]),  # rceil: amax / max_normal is exactly a power of two
        block_of([57344.0 * 2.0**3, 1.0]),
    ]
    return torch.tensor([f32(v) if math.isfinite(v) else v for v in sum(rows, [])]).view(-1, 32)


def random_blocks(n: int, seed: int) -> torch.Tensor:
    rng = random.Random(seed)
    vals = []
    for _ in range(n):
        base = rng.randint(-140, 120)
        spread = rng.choice([0, 2, 8, 30])
        for _ in range(32):
            v = rng.uniform(1, 2) * 2.0 ** (base - rng.randint(0, spread))
            vals.append(f32(v if rng.random() < 0.5 else -v))
    return torch.tensor(vals).view(n, 32)


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_bit_exact_against_spec_reference_on_edge_cases(elem, mode):
    x = edge_blocks()
    q = quantize(x, elem=elem, mode=mode)
    codes, scales = ref_quantize(x, elem, mode)
    assert torch.equal(q.scales, scales)
    assert torch.equal(q.data.view(torch.uint8), codes)


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_bit_exact_against_spec_reference_on_random_magnitudes(elem, mode):
    x = random_blocks(96, seed=hash((elem, mode)) % 1000)
    q = quantize(x.view(-1, 64), elem=elem, mode=mode)
    codes, scales = ref_quantize(x.view(-1, 64), elem, mode)
    assert torch.equal(q.scales, scales)
    assert torch.equal(q.data.view(torch.uint8), codes)


def test_special_blocks_have_the_documented_encoding():
    x = edge_blocks()
    q = quantize(x)
    assert q.scales[0, 0] == 0  # zero block: smallest scale, zero elements
    assert torch.all(q.data[0].float() == 0)
    assert q.scales[9, 0] == 0xFF and q.scales[10, 0] == 0xFF  # NaN and Inf blocks
    deq = q.dequantize()
    assert torch.isnan(deq[9]).all() and torch.isnan(deq[10]).all()
    assert torch.isfinite(deq[:9]).all()
    assert deq[3, 0] == 448.0 and deq[3, 1] == -448.0  # max normal survives exactly


def test_floor_saturates_and_rceil_does_not():
    x = torch.tensor(block_of([500.0, 1.0])).view(1, 32)  # floor scale 2^0: 500 > 448
    assert quantize(x, mode="floor").dequantize()[0, 0] == 448.0
    q = quantize(x, mode="rceil")  # scale 2^1: 500 / 2 = 250 rounds to 256 (spacing 16)
    assert q.scales[0, 0] == 128 and q.data[0, 0].float() == 256.0
    assert q.dequantize()[0, 0] == 512.0


def test_dequantize_is_exact_and_shapes_follow_blocks():
    x = torch.randn(3, 4, 64)
    q = quantize(x, elem="e4m3")
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == (3, 4, 64)
    assert q.scales.dtype == torch.uint8 and q.scales.shape == (3, 4, 2)
    deq32, deq16 = q.dequantize(torch.float32), q.dequantize(torch.bfloat16)
    assert torch.equal(deq16.float(), deq32)  # 3-bit mantissas times powers of two fit bf16
    assert torch.equal(quantize(deq32).dequantize(), deq32)  # idempotent
    assert quantize(x, elem="e5m2").data.dtype == torch.float8_e5m2


def test_bf16_input_quantizes_like_its_fp32_value():
    x = torch.randn(8, 96).bfloat16()
    a, b = quantize(x), quantize(x.float())
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert torch.equal(a.scales, b.scales)


@pytest.mark.parametrize("shape", [(3, 33), (31,), (4, 48)])
def test_last_dim_not_a_multiple_of_the_block_is_rejected(shape):
    with pytest.raises(MXFormatError, match="multiple of the block size 32; got shape"):
        quantize(torch.randn(shape))


def test_bad_element_and_mode_are_one_line_errors():
    with pytest.raises(MXFormatError, match="unknown MX element format 'e2m1'"):
        quantize(torch.randn(32), elem="e2m1")
    with pytest.raises(MXFormatError, match="unknown MX scale mode 'round'"):
        quantize(torch.randn(32), mode="round")


@pytest.mark.parametrize(
    ("elem", "mode", "low", "high"),
    [
        ("e4m3", "floor", 29.5, 32.5),  # ~6 dB per mantissa bit + ~12.8: about 31 dB
        ("e4m3", "rceil", 29.5, 32.5),
        ("e5m2", "floor", 23.5, 26.5),  # one mantissa bit fewer: ~6 dB lower
    ],
)
def test_sqnr_on_gaussian_data_is_at_the_mantissa_limit(elem, mode, low, high):
    x = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    db = mx.sqnr_db(x, quantize(x, elem=elem, mode=mode).dequantize())
    assert low < db < high, db


# ------------------------------------------------------------------------ MXLinear


def fq(t: torch.Tensor, elem="e4m3", mode="rceil") -> torch.Tensor:
    """Quantize-dequantize along the last dim, zero-padding it to a multiple of 32."""
    pad = -t.shape[-1] % 32
    q = quantize(F.pad(t, (0, pad)), elem=elem, mode=mode).dequantize()
    return q[..., : t.shape[-1]]


def test_mx_linear_quantizes_each_operand_along_its_contraction_dim():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 64, requires_grad=True)  # 10 tokens: not a multiple of 32
    lin = nn.Linear(64, 48)
    layer = MXLinear.from_linear(lin)
    y = layer(x)
    x2, w = x.detach().reshape(-1, 64), lin.weight.detach()
    expect = fq(x2) @ fq(w).t() + lin.bias.detach()
    torch.testing.assert_close(y.reshape(-1, 48), expect, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(y)
    y.backward(g)
    g2 = g.reshape(-1, 48)
    dx = fq(g2) @ fq(w.t()).t()  # contraction over N
    dw = fq(g2.t()) @ fq(x2.t()).t()  # contraction over tokens
    torch.testing.assert_close(x.grad.reshape(-1, 64), dx, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lin.weight.grad, dw, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lin.bias.grad, g2.sum(0))


def test_mx_linear_gradients_track_high_precision_ones():
    torch.manual_seed(0)
    x = torch.randn(256, 128, requires_grad=True)
    lin = nn.Linear(128, 256, bias=False)
    ref_y = lin(x)
    g = torch.randn_like(ref_y)
    ref_dx, ref_dw = torch.autograd.grad(ref_y, (x, lin.weight), g)
    y = MXLinear.from_linear(lin)(x)
    dx, dw = torch.autograd.grad(y, (x, lin.weight), g)
    assert mx.sqnr_db(ref_y, y) > 25
    assert mx.sqnr_db(ref_dx, dx) > 25
    assert mx.sqnr_db(ref_dw, dw) > 25


def test_mx_linear_under_bf16_autocast_outputs_bf16():
    lin = MXLinear.from_linear(nn.Linear(64, 32))
    x = torch.randn(4, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and lin.weight.grad.dtype == torch.float32


def test_emulated_backend_on_cpu():
    assert mx.gemm_backend(torch.device("cpu")) == "emulated"


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 64)
        self.up = nn.Linear(64, 96)
        self.odd = nn.Linear(40, 64)  # in_features not a multiple of 32: left alone
        self.down = nn.Linear(96, 64)
        self.lm_head = nn.Linear(64, 50, bias=False)


def test_to_mxfp8_training_swaps_eligible_linears_and_keeps_the_state_dict():
    model = Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {id(p) for p in model.parameters()}
    out = to_mxfp8_training(model)
    assert out is model
    assert isinstance(model.up, MXLinear) and isinstance(model.down, MXLinear)
    assert type(model.odd) is nn.Linear and type(model.lm_head) is nn.Linear
    assert {id(p) for p in model.parameters()} == params  # optimizers built before still work
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(
        torch.equal(after[k], before[k]) and after[k].dtype == before[k].dtype for k in after
    )
    assert sorted(mx_modules(model)) == ["down", "up"]


def test_to_mxfp8_training_skip_and_elem():
    model = to_mxfp8_training(Tiny(), elem="e5m2", skip=lambda name, m: name == "down")
    assert isinstance(model.up, MXLinear) and model.up.mx_config.elem == "e5m2"
    assert type(model.down) is nn.Linear
    assert isinstance(to_mxfp8_training(model).down, MXLinear)  # idempotent on swapped ones


def test_mx_training_step_reduces_loss():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    to_mxfp8_training(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(64, 64)
    target = torch.sin(x)
    losses = []
    for _ in range(15):
        loss = F.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_backend_matches_emulation():
    x = torch.randn(256, 512, device="cuda")
    w = torch.randn(384, 512, device="cuda")
    a, b = quantize(x), quantize(w)
    backend = mx.gemm_backend(x.device)
    got = mx.mx_mm(a, b, torch.float32, backend)
    ref = mx.mx_mm(a, b, torch.float32, "emulated")
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-2)


def test_blackwell_scale_swizzle_is_a_padded_permutation():
    scales = torch.arange(130 * 6, dtype=torch.int32).view(130, 6)  # pads to 256 x 8
    out = mx._to_blocked(scales)
    assert out.numel() == 256 * 8
    padded = torch.zeros(256, 8, dtype=torch.int32)
    padded[:130, :6] = scales
    assert torch.equal(out.sort().values, padded.flatten().sort().values)
    assert out[:4].tolist() == [0, 1, 2, 3]  # row 0's four scales lead the first tile
    assert out[4:8].tolist() == scales[32, :4].tolist()  # then row 32's (32x4x4 tiling)
