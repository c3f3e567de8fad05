"""MXFP8: OCP Microscaling (MX) v1.0 formats, an MX linear layer, and the trainer hook.

An MX tensor stores blocks of 32 consecutive values along the last dimension as 8-bit
floating-point elements (E4M3 or E5M2) that share one power-of-two scale in E8M0
(an 8-bit biased exponent, 127 = 2^0, 0xFF = NaN). The spec's conversion is

    shared_exp = floor(log2(max |V_i|)) - emax_elem          # mode="floor"
    X = 2^shared_exp;  P_i = saturate(round_to_nearest_even(V_i / X))

where ``emax_elem`` is the exponent of the element format's largest normal (8 for E4M3,
15 for E5M2). Because ``floor`` can put the block maximum above the element's largest
normal, such values saturate to it. ``mode="rceil"`` (the rounding NVIDIA's MXFP8
training recipe and Blackwell's ``cvt.rp.ue8m0`` use) instead picks the smallest scale
with ``max |V_i| / X <= max_normal``: ``X = 2^ceil(log2(fp32(max |V_i| / max_normal)))``,
so nothing saturates.

Special values, as the reference microxcaling library and torchao treat them: a block
holding a NaN or an Inf gets the NaN scale 0xFF and NaN elements, so the whole block
dequantizes to NaN; an all-zero block gets the smallest scale (code 0, 2^-127) and zero
elements; scales clamp to the E8M0 range [2^-127, 2^127].

Training (``MXLinear``; ``convert.to_mxfp8_training`` swaps a model's layers) follows the published MXFP8 recipe
(Mishra et al., "Recipes for Pre-training LLMs with MXFP8", 2025): every GEMM operand is
quantized along its contraction dimension -- activations and weights along K in the
forward pass, the output gradient and the weight along N for the input gradient, the
output gradient and the activations along the token dimension for the weight gradient --
all in E4M3 with ``rceil`` scales by default. Quantization is a straight-through
estimator: master weights stay in high precision and gradients flow as if the rounding
were the identity.

GEMM back ends, chosen by device capability (``gemm_backend``):

- ``emulated`` (CPU and any device): dequantize both operands exactly to bf16/fp32 and
  multiply with fp32 accumulation, which is what the hardware computes.
- ``scaled_mm`` (CUDA capability >= 10.0, Blackwell): ``torch._scaled_mm`` with E8M0
  block scales in the swizzled 128x4 layout cuBLAS expects.
- ``triton`` (CUDA capability >= 8.9 with triton installed, e.g. H100/H200): a Triton
  kernel doing FP8 tensor-core dots over K-steps of 32 and applying both block scales
  per step.

Run the tests with ``pytest tests/kernels`` and the numbers with
``python benchmarks/kernels.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

Elem = Literal["e4m3", "e5m2"]
ScaleMode = Literal["floor", "rceil"]

BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 0xFF


@dataclass(frozen=True, kw_only=True)
class ElemFormat:
    """An FP8 element format of the MX spec."""

    name: str
    dtype: torch.dtype
    ebits: int
    mbits: int
    bias: int
    emax: int  # exponent of the largest normal
    max_normal: float
    nan_code: int  # the uint8 pattern stored for NaN elements


ELEM_FORMATS: dict[str, ElemFormat] = {
    "e4m3": ElemFormat(
        name="e4m3",
        dtype=torch.float8_e4m3fn,
        ebits=4,
        mbits=3,
        bias=7,
        emax=8,
        max_normal=448.0,
        nan_code=0x7F,
    ),
    "e5m2": ElemFormat(
        name="e5m2",
        dtype=torch.float8_e5m2,
        ebits=5,
        mbits=2,
        bias=15,
        emax=15,
        max_normal=57344.0,
        nan_code=0x7F,
    ),
}


class MXFormatError(ValueError):
    """A tensor or argument that cannot be put in MX format (one-line message)."""


def elem_format(elem: str) -> ElemFormat:
    try:
        return ELEM_FORMATS[elem]
    except KeyError:
        raise MXFormatError(
            f"unknown MX element format {elem!r}; expected one of {sorted(ELEM_FORMATS)}"
        ) from None


@dataclass
class MXTensor:
    """A tensor in MX format: FP8 elements and one E8M0 scale per block of the last dim."""

    data: torch.Tensor  # [..., K] float8_e4m3fn or float8_e5m2
    scales: torch.Tensor  # [..., K // block] uint8 E8M0 codes
    elem: str = "e4m3"
    block: int = BLOCK

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def scale_values(self) -> torch.Tensor:
        """The scales as float32 powers of two (NaN for 0xFF)."""
        codes = self.scales.to(torch.int32)
        values = torch.ldexp(torch.ones_like(codes, dtype=torch.float32), codes - E8M0_BIAS)
        return torch.where(codes == E8M0_NAN, torch.nan, values)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Exact values elements * 2^(scale - 127) in ``dtype`` (exact in bf16 and fp32
        except below bf16/fp32's subnormal range); NaN blocks come out all NaN."""
        *lead, k = self.data.shape
        nb = k // self.block
        x = self.data.to(torch.float32).reshape(*lead, nb, self.block)
        x = x * self.scale_values().unsqueeze(-1)  # power-of-two scaling: exact
        return x.reshape(*lead, k).to(dtype)


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) for finite a > 0 (fp32, subnormals included), exactly, as int32."""
    _, e = torch.frexp(a)  # a = m * 2^e, m in [0.5, 1)
    return e - 1


def _ceil_log2(a: torch.Tensor) -> torch.Tensor:
    """ceil(log2(a)) for finite a > 0, exactly, as int32."""
    m, e = torch.frexp(a)
    return torch.where(m == 0.5, e - 1, e)


def shared_exponents(amax: torch.Tensor, fmt: ElemFormat, mode: ScaleMode) -> torch.Tensor:
    """Unbiased shared exponents (int32, clamped to [-127, 127]) for block maxima ``amax``
    (fp32, finite, >= 0). Zero blocks get -127."""
    tiny = torch.finfo(torch.float32).smallest_normal
    safe = torch.where(amax > 0, amax, tiny)
    if mode == "floor":
        exp = _floor_log2(safe) - fmt.emax
    elif mode == "rceil":
        exp = _ceil_log2(safe / fmt.max_normal)  # fp32 division, then round up
    else:
        raise MXFormatError(f"unknown MX scale mode {mode!r}; expected 'floor' or 'rceil'")
    exp = torch.where(amax > 0, exp, -E8M0_BIAS)
    return exp.clamp(-E8M0_BIAS, E8M0_BIAS)


def quantize(
    x: torch.Tensor, elem: Elem = "e4m3", block: int = BLOCK, mode: ScaleMode = "floor"
) -> MXTensor:
    """Quantize ``x`` to MX along its last dimension (a multiple of ``block``).

    Returns an ``MXTensor`` whose ``data`` has ``x``'s shape in the element's float8
    dtype and whose ``scales`` hold one uint8 E8M0 code per block.
    """
    fmt = elem_format(elem)
    if x.dim() == 0 or x.shape[-1] % block != 0:
        raise MXFormatError(
            f"MX quantization needs the last dimension to be a multiple of the block size "
            f"{block}; got shape {tuple(x.shape)}"
        )
    if not x.is_floating_point():
        raise MXFormatError(f"MX quantization needs a floating-point tensor; got {x.dtype}")
    *lead, k = x.shape
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.to(torch.float32)  # bf16 stays bf16: power-of-two scaling is exact in it too
    xb = x.reshape(*lead, k // block, block)  # [..., blocks, block]
    lo, hi = torch.aminmax(xb, dim=-1)  # one pass; NaN propagates
    amax = torch.maximum(-lo, hi).float()  # [..., blocks]
    finite = torch.isfinite(amax)  # a NaN or an Inf anywhere makes the block NaN
    amax = torch.where(finite, amax, 0.0)
    exp = shared_exponents(amax, fmt, mode)  # [..., blocks]
    inv_scale = torch.ldexp(torch.ones_like(amax), -exp).to(x.dtype)  # exact powers of two
    y = (xb * inv_scale.unsqueeze(-1)).clamp_(-fmt.max_normal, fmt.max_normal)  # saturate
    codes = y.to(fmt.dtype).view(torch.uint8)  # round to nearest even
    scales = (exp + E8M0_BIAS).to(torch.uint8)
    if not bool(finite.all()):
        codes[~finite] = fmt.nan_code
        scales[~finite] = E8M0_NAN
    data = codes.reshape(*lead, k).view(fmt.dtype)
    return MXTensor(data=data, scales=scales, elem=elem, block=block)


def fake_quantize(
    x: torch.Tensor,
    elem: Elem = "e4m3",
    mode: ScaleMode = "floor",
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """quantize then dequantize along the last dimension (to ``dtype``, default x's)."""
    return quantize(x, elem=elem, mode=mode).dequantize(dtype or x.dtype)


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of approximation ``y`` of ``x`` in dB."""
    x, y = x.detach().double(), y.detach().double()
    return float(10 * torch.log10(x.pow(2).sum() / (x - y).pow(2).sum()))


# --------------------------------------------------------------------------- GEMMs

Backend = Literal["emulated", "scaled_mm", "triton"]


def gemm_backend(device: torch.device) -> Backend:
    """The fastest MX GEMM this device has: Blackwell's MX ``_scaled_mm``, a Triton FP8
    kernel on Ada/Hopper, else exact emulation."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "emulated"
    major, minor = torch.cuda.get_device_capability(device)
    if major >= 10:
        return "scaled_mm"
    if (major, minor) >= (8, 9) and _triton_available():
        return "triton"
    return "emulated"


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def mx_mm(
    a: MXTensor, b: MXTensor, out_dtype: torch.dtype, backend: Backend | None = None
) -> torch.Tensor:
    """``a @ b.T`` for ``a`` [M, K] and ``b`` [N, K], both blocked along K -> [M, N]."""
    if a.shape[-1] != b.shape[-1] or a.block != b.block:
        raise MXFormatError(f"mx_mm: K mismatch {tuple(a.shape)} vs {tuple(b.shape)}")
    backend = backend or gemm_backend(a.data.device)
    if backend == "scaled_mm":
        return _mx_mm_scaled(a, b, out_dtype)
    if backend == "triton":
        from opencomposer.kernels import mx_triton

        return mx_triton.mx_mm(a.data, a.scales, b.data, b.scales, a.block, out_dtype)
    compute = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
    return F.linear(a.dequantize(compute), b.dequantize(compute)).to(out_dtype)


def _to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """Rearrange [rows, K/32] E8M0 scales into cuBLAS's swizzled 128x4 tile layout."""
    rows, cols = scales.shape
    n_row, n_col = -(-rows // 128), -(-cols // 4)
    padded = scales.new_zeros(n_row * 128, n_col * 4)
    padded[:rows, :cols] = scales
    blocks = padded.view(n_row, 128, n_col, 4).permute(0, 2, 1, 3)
    return blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).flatten()


def _mx_mm_scaled(a: MXTensor, b: MXTensor, out_dtype: torch.dtype) -> torch.Tensor:
    e8m0 = torch.float8_e8m0fnu
    return torch._scaled_mm(
        a.data,
        b.data.t(),
        scale_a=_to_blocked(a.scales).view(e8m0),
        scale_b=_to_blocked(b.scales).view(e8m0),
        out_dtype=out_dtype,
    )


# ---------------------------------------------------------------------- training


@dataclass(frozen=True, kw_only=True)
class MXTrainingConfig:
    """How ``MXLinear`` quantizes. The defaults are the published MXFP8 recipe."""

    elem: Elem = "e4m3"  # activations and weights
    grad_elem: Elem = "e4m3"  # output gradients (the recipe found E4M3 enough)
    mode: ScaleMode = "rceil"
    backend: Backend | None = None  # None: chosen by device capability


def _pad_to_block(x: torch.Tensor) -> torch.Tensor:
    """Zero-pad the last dim to a multiple of 32: zeros add nothing to a dot product."""
    pad = -x.shape[-1] % BLOCK
    return F.pad(x, (0, pad)) if pad else x


def _q(x: torch.Tensor, elem: Elem, mode: ScaleMode) -> MXTensor:
    return quantize(_pad_to_block(x.contiguous()), elem=elem, mode=mode)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a GEMM on ``x`` should produce: autocast's when active, else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class _MXLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, cfg: MXTrainingConfig, out_dtype: torch.dtype):
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        out = mx_mm(
            _q(x2, cfg.elem, cfg.mode), _q(weight, cfg.elem, cfg.mode), out_dtype, cfg.backend
        )  # [M, N]
        ctx.save_for_backward(x2, weight)
        ctx.cfg, ctx.x_shape, ctx.x_dtype = cfg, x.shape, x.dtype
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x2, weight = ctx.saved_tensors
        cfg: MXTrainingConfig = ctx.cfg
        g = grad_out.reshape(-1, weight.shape[0])  # [M, N]
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # dX = dY @ W: contraction over N
            grad_x = mx_mm(
                _q(g, cfg.grad_elem, cfg.mode),
                _q(weight.t(), cfg.elem, cfg.mode),
                g.dtype,
                cfg.backend,
            )  # [M, K]
            grad_x = grad_x.reshape(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:  # dW = dY^T @ X: contraction over tokens M
            grad_w = mx_mm(
                _q(g.t(), cfg.grad_elem, cfg.mode),
                _q(x2.t(), cfg.elem, cfg.mode),
                torch.float32,
                cfg.backend,
            ).to(weight.dtype)  # [N, K]
        return grad_x, grad_w, None, None


def mx_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    cfg: MXTrainingConfig | None = None,
) -> torch.Tensor:
    """``F.linear`` with MXFP8 GEMMs in forward and backward (straight-through)."""
    cfg = cfg or MXTrainingConfig()
    out_dtype = compute_dtype(x)
    y = _MXLinearFunction.apply(x, weight, cfg, out_dtype)
    return y if bias is None else y + bias.to(y.dtype)


class MXLinear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs run in MXFP8; parameters stay in the master dtype.

    ``in_features`` must be a multiple of 32 (the forward contraction); other
    contraction dimensions are zero-padded.
    """

    @dataclass(frozen=True, kw_only=True)
    class Config(MXTrainingConfig):
        pass

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, *, config=None, **kw
    ):
        if in_features % BLOCK:
            raise MXFormatError(f"MXLinear needs in_features % {BLOCK} == 0; got {in_features}")
        super().__init__(in_features, out_features, bias=bias, **kw)
        self.mx_config: MXTrainingConfig = config or MXLinear.Config()

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: MXTrainingConfig | None = None) -> MXLinear:
        """A ``MXLinear`` sharing ``linear``'s parameter objects (no copy)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.mx_config = config or MXLinear.Config()
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mx_linear(x, self.weight, self.bias, self.mx_config)

    def extra_repr(self) -> str:
        c = self.mx_config
        return f"{super().extra_repr()}, elem={c.elem}, grad_elem={c.grad_elem}, mode={c.mode}"


__all__ = [
    "BLOCK",
    "ELEM_FORMATS",
    "MXFormatError",
    "MXLinear",
    "MXTensor",
    "MXTrainingConfig",
    "fake_quantize",
    "gemm_backend",
    "mx_linear",
    "mx_mm",
    "quantize",
    "sqnr_db",
]
