"""RoPE on interleaved pairs (op `rope`): the last R = 2 * cos.shape[-1] channels of x [T, ..., D]
rotate pair by pair ((x[2i], x[2i+1]) by the angle of i, or back with `inverse`); the other
channels are copied. fp32 math, output in x's dtype (bf16 rounded to nearest even). Each program
handles BLOCK_H rows (heads) of one token: a row and its pair partner (the neighbour, j ^ 1
within the rotated part) are loaded (the second load hits L1), so no register shuffles are
needed. Matches `rope_ref` within fp32 rounding (a fused multiply-add may round once less).

`rope_tables` (op `rope_tables`) is `backends.rope_tables` in one launch: each position's cos /
sin from the angle-sum identities over the fp64-made tables of its high and low bits (the torch
version is nine small kernels per call).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends.reference.basic import rope as rope_ref  # noqa: F401  (the oracle)
from .pdl import pdl_launch, pdl_start
from .block_scaled import bf16_bits16


@triton.jit
def rope_cols(x, xp, cos_ptr, sin_ptr, t, cols, D, R, sign, valid):
    """Rotated values of channels `cols` (any shape) of token t's rows, given their values x and
    their pair partners' values xp (channel cols ^ 1 inside the rotated last R channels; unused
    outside them): fp32, not rounded."""
    rel = cols - (D - R)  # position inside the rotated part (negative: copied)
    rot = (rel >= 0) & valid
    odd = (rel & 1) == 1
    half = tl.where(rot, rel // 2, 0)
    c = tl.load(cos_ptr + t * (R // 2) + half, mask=rot, other=1.0)
    s = tl.load(sin_ptr + t * (R // 2) + half, mask=rot, other=0.0) * sign
    # even j: x_j c - x_{j+1} s; odd j: x_{j-1} s + x_j c
    return x * c + tl.where(odd, s, -s) * tl.where(rot, xp, 0.0)


@triton.jit
def partner_cols(cols, D, R):
    """The pair partner of each channel inside the rotated last R channels (itself outside)."""
    rel = cols - (D - R)
    return tl.where(rel >= 0, tl.where((rel & 1) == 1, cols - 1, cols + 1), cols)


@triton.jit
def rope_rows(x_ptr, cos_ptr, sin_ptr, y_ptr, t, heads, H, D, R, sign, BLOCK_D: tl.constexpr,
              OUT_BF16: tl.constexpr):
    """Rows `heads` of token t of x [T, H, D] rotated into y (a row and its pair partners are
    loaded: the second load hits L1, no register shuffles)."""
    cols = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < H) & (cols[None, :] < D)
    row = (t * H + heads.to(tl.int64))[:, None] * D
    x = tl.load(x_ptr + row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rot = cols >= D - R
    xp = tl.load(x_ptr + row + partner_cols(cols, D, R)[None, :], mask=mask & rot[None, :], other=0.0).to(tl.float32)
    y = rope_cols(x, xp, cos_ptr, sin_ptr, t, cols[None, :], D, R, sign, cols[None, :] < D)
    if OUT_BF16:
        tl.store(y_ptr + row + cols[None, :], bf16_bits16(y), mask=mask)
    else:
        tl.store(y_ptr + row + cols[None, :], y, mask=mask)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, H, D, R, sign, BLOCK_H: tl.constexpr,
                 BLOCK_D: tl.constexpr, OUT_BF16: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rope_rows(x_ptr, cos_ptr, sin_ptr, y_ptr, tl.program_id(0), heads, H, D, R, sign, BLOCK_D, OUT_BF16)


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
                                      -1.0 if inverse else 1.0, BLOCK_H=bh, BLOCK_D=bd, OUT_BF16=out_bf16, **pdl_launch(xc))
    return y


@triton.jit
def _rope_tables_kernel(pos_ptr, ca_ptr, sa_ptr, cb_ptr, sb_ptr, cos_ptr, sin_ptr, T, F, SPLIT: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_F)
    rmask = rows < T
    mask = rmask[:, None] & (cols[None, :] < F)
    p = tl.load(pos_ptr + rows, mask=rmask, other=0).to(tl.int64)
    a = (p >> SPLIT) + (1 << SPLIT)  # (arithmetic shift: floor for p < 0)
    b = p & ((1 << SPLIT) - 1)
    hi = a[:, None] * F + cols[None, :]
    lo = b[:, None] * F + cols[None, :]
    ca = tl.load(ca_ptr + hi, mask=mask, other=1.0)
    sa = tl.load(sa_ptr + hi, mask=mask, other=0.0)
    cb = tl.load(cb_ptr + lo, mask=mask, other=1.0)
    sb = tl.load(sb_ptr + lo, mask=mask, other=0.0)
    out = rows.to(tl.int64)[:, None] * F + cols[None, :]
    tl.store(cos_ptr + out, ca * cb - sa * sb, mask=mask)
    tl.store(sin_ptr + out, sa * cb + ca * sb, mask=mask)


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [..., F] fp32 of positions [...] (-2^20 <= p < 2^20) times inv_freq [F]."""
    from ...backends.rope_tables import SPLIT, angle_tables

    ca, sa, cb, sb = angle_tables(inv_freq)
    f = inv_freq.shape[0]
    p = positions.reshape(-1)
    if p.dtype not in (torch.int32, torch.int64):
        p = p.long()
    p = p.contiguous()
    cos = torch.empty(*positions.shape, f, dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    t = p.numel()
    if t and f:
        bf = triton.next_power_of_2(f)
        bt = max(1, min(triton.next_power_of_2(t), 4096 // bf))
        _rope_tables_kernel[(-(-t // bt),)](p, ca, sa, cb, sb, cos, sin, t, f, SPLIT=SPLIT, BLOCK_T=bt, BLOCK_F=bf, **pdl_launch(p))
    return cos, sin


OPS = {"rope": rope, "rope_tables": rope_tables}
