"""RMSNorm (op `rms_norm`): y = x * rsqrt(mean(x^2) + eps) * weight, fp32 math, output in x's
dtype (bf16 rounded to nearest even). One program per BLOCK_R rows; a row is read once (whole
rows up to 8192 channels sit in registers). Matches `rms_norm_ref` within fp32 rounding (the
device rsqrt is not correctly rounded; at most one bf16 ulp apart after the final rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends.reference.basic import rms_norm as rms_norm_ref  # noqa: F401  (the oracle)
from .pdl import pdl_launch, pdl_start
from .block_scaled import bf16_bits16

MAX_D = 8192


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, R, D, x_stride, eps, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                     OUT_BF16: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < R) & (cols[None, :] < D)
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    y = x * inv[:, None] * w[None, :]
    if OUT_BF16:
        tl.store(y_ptr + offs, bf16_bits16(y), mask=mask)
    else:
        tl.store(y_ptr + offs, y, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> RMS-normalised x * weight in x's dtype (bf16 or fp32), contiguous. Rows of a
    2-D x are read at its row stride (`linear_pair`'s outputs are views of one stacked output)."""
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"weight must be [{d}], got {tuple(weight.shape)}")
    if d > MAX_D or x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"rms_norm kernel: width {d} > {MAX_D} or dtype {x.dtype} unsupported")
    xc = x if x.dim() == 2 and x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    r = y.numel() // d if d else 0
    if r:
        bd = triton.next_power_of_2(d)
        br = max(1, min(16, 2048 // bd))
        out_bf16 = x.dtype == torch.bfloat16
        _rms_norm_kernel[(-(-r // br),)](xc, weight.contiguous(), y.view(torch.int16) if out_bf16 else y, r, d,
                                        xc.stride(0) if xc.dim() == 2 else d, float(eps), BLOCK_R=br, BLOCK_D=bd,
                                        OUT_BF16=out_bf16, **pdl_launch(xc))
    return y


OPS = {"rms_norm": rms_norm}
