"""Triton MX GEMM for GPUs with FP8 tensor cores but no MX block scaling (sm89/sm90:
L40S, H100, H200).

Why it works: an MX dot product over K splits into K/32 blocks, and inside a block both
operands share one scale, so ``sum_k a_k b_k = sum_blocks sa * sb * dot(a_blk, b_blk)``.
The kernel walks K in steps of 32, runs each step's FP8 x FP8 dot on tensor cores with
fp32 accumulation, and multiplies it by the two blocks' scales before accumulating.

Imported lazily by ``mx.mx_mm`` only when ``gemm_backend`` picks ``triton``; it is never
imported on CPU. It takes the MX tensors' parts (FP8 elements and E8M0 scales), so it needs
nothing of ``mx``, and it has not been run on this project's CPU-only CI (a GPU test,
``pytest -m gpu tests/kernels``, compares it with the exact emulation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mx_mm_kernel(
    a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk,
    stride_sam, stride_sak, stride_sbn, stride_sbk,
    stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MX_BLOCK: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    rk = tl.arange(0, MX_BLOCK)  # [32]
    mask_m = rm < M
    mask_n = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K // MX_BLOCK):
        k = kb * MX_BLOCK + rk
        a = tl.load(
            a_ptr + rm[:, None] * stride_am + k[None, :] * stride_ak,
            mask=mask_m[:, None], other=0.0,
        )  # [BLOCK_M, 32] fp8  # fmt: skip
        b = tl.load(
            b_ptr + rn[None, :] * stride_bn + k[:, None] * stride_bk,
            mask=mask_n[None, :], other=0.0,
        )  # [32, BLOCK_N] fp8  # fmt: skip
        sa = tl.load(sa_ptr + rm * stride_sam + kb * stride_sak, mask=mask_m, other=127)
        sb = tl.load(sb_ptr + rn * stride_sbn + kb * stride_sbk, mask=mask_n, other=127)
        fa = tl.exp2(sa.to(tl.float32) - 127.0)  # [BLOCK_M]
        fb = tl.exp2(sb.to(tl.float32) - 127.0)  # [BLOCK_N]
        acc += tl.dot(a, b) * fa[:, None] * fb[None, :]
    c = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def mx_mm(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    block: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``a @ b.T`` for FP8 ``a`` [M, K] and ``b`` [N, K] with E8M0 scales [M, K/block]
    and [N, K/block] -> [M, N]."""
    m, k = a.shape
    n = b.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    grid = (triton.cdiv(m, 64), triton.cdiv(n, 64))
    _mx_mm_kernel[grid](
        a, b, a_scales, b_scales, out,
        m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        a_scales.stride(0), a_scales.stride(1), b_scales.stride(0), b_scales.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_M=64, BLOCK_N=64, MX_BLOCK=block,
    )  # fmt: skip
    return out
