"""RoPE on interleaved pairs (op `rope`): the last R = 2 * cos.shape[-1] channels of x [T, ..., D]
rotate pair by pair ((x[2i], x[2i+1]) by the angle of i, or back with `inverse`); the other
channels are copied. fp32 math, output in x's dtype (bf16 rounded to nearest even). Each program
handles BLOCK_H rows (heads) of one token: a row and its pair partner (the neighbour, j ^ 1
within the rotated part) are loaded (the second load hits L1), so no register shuffles are
needed. Matches `rope_ref` within fp32 rounding (a fused multiply-add may round once less).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends.reference.basic import rope as rope_ref  # noqa: F401  (the oracle)
from .block_scaled import bf16_bits16


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, H, D, R, sign, BLOCK_H: tl.constexpr,
                 BLOCK_D: tl.constexpr, OUT_BF16: tl.constexpr):
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < H) & (cols[None, :] < D)
    row = (t * H + heads.to(tl.int64))[:, None] * D
    x = tl.load(x_ptr + row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rel = cols - (D - R)  # position inside the rotated part (negative: copied)
    rot = rel >= 0
    odd = (rel & 1) == 1
    partner = tl.where(odd, cols - 1, cols + 1)
    xp = tl.load(x_ptr + row + partner[None, :], mask=mask & rot[None, :], other=0.0).to(tl.float32)
    half = tl.where(rot, rel // 2, 0)
    c = tl.load(cos_ptr + t * (R // 2) + half, mask=rot & (cols < D), other=1.0)
    s = tl.load(sin_ptr + t * (R // 2) + half, mask=rot & (cols < D), other=0.0) * sign
    # even j: x_j c - x_{j+1} s; odd j: x_{j-1} s + x_j c
    y = x * c[None, :] + tl.where(odd, s, -s)[None, :] * xp
    if OUT_BF16:
        tl.store(y_ptr + row + cols[None, :], bf16_bits16(y), mask=mask)
    else:
        tl.store(y_ptr + row + cols[None, :], y, mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [T, ..., D] with cos/sin [T, R/2] -> x with its last R channels rotated, x's dtype."""
    t, d = x.shape[0], x.shape[-1]
    r = 2 * cos.shape[-1]
    if cos.shape != (t, r // 2) or sin.shape != cos.shape or r > d:
        raise ValueError(f"cos/sin must be [{t}, R/2] with R <= {d}, got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"rope kernel: dtype {x.dtype} unsupported")
    xc = x.contiguous()
    y = torch.empty_like(xc)
    h = xc.numel() // (t * d) if t * d else 0
    if h:
        bd = triton.next_power_of_2(d)
        bh = max(1, min(triton.next_power_of_2(h), 4096 // bd))
        out_bf16 = x.dtype == torch.bfloat16
        _rope_kernel[(t, -(-h // bh))](xc, cos.float().contiguous(), sin.float().contiguous(),
                                      y.view(torch.int16) if out_bf16 else y, h, d, r,
                                      -1.0 if inverse else 1.0, BLOCK_H=bh, BLOCK_D=bd, OUT_BF16=out_bf16)
    return y


OPS = {"rope": rope}
