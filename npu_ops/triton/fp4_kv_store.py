"""FP4 main-KV store: RoPE'd KV rows -> packed E2M1 + E4M3 scale per 16, scattered into a cache.

x [M, D] (fp32/bf16/fp16, D % 16 == 0) and slots [M] (int32/int64; a negative slot skips its
row) write codes[slots[i]] (uint8 [S, D/2], element 0 in the low nibble) and
scales[slots[i]] ([S, D/16], float8_e4m3fn or its uint8 view). Bit-exact with
`quant.fp4_quant` (see `fp4_kv_store_ref`).

How the kernel stays exact with integer/fp32 ops only (no division, no fp8 arithmetic):
- scale = e4m3(min(max(amax, 6 * 2^-9) / 6, 448)). The candidate E4M3 code comes from the bits
  of an approximate q = amax * (1/6) (truncated to the E4M3 grid), is corrected by at most one
  step by exact comparisons of amax with 6 * grid value, and is rounded to nearest-even by
  comparing amax with 6 * (midpoint). Every 6 * grid / midpoint value has <= 7 significant
  bits, so those products are exact, and comparing amax with 6 * m is equivalent to comparing
  the correctly rounded fp32 quotient amax / 6 (what torch computes) with m.
- The E4M3 byte is the integer code itself (sign 0), stored through a uint8 view: no fp8 store.
- The E2M1 code of x / s compares |x| with (E2M1 midpoint) * s: again exact products (<= 3 + 4
  significant bits), and equivalent to comparing the correctly rounded quotient with the
  midpoint (the quotient's rounding can never land on or cross a midpoint), so no division.
Tiles: BLOCK_G groups x 8 channel pairs (even / odd channels loaded separately and packed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends.reference import quant

GROUP = 16
BLOCK_G = 32  # groups per tile: 2 x (32 x 8) fp32 live values


def fp4_kv_store_ref(x: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """The torch reference: quantise with `quant.fp4_quant` and scatter rows (slots < 0 skipped)."""
    packed, scale = quant.fp4_quant(x)
    keep = slots >= 0
    idx = slots[keep].long()
    codes.view(torch.uint8)[idx] = packed[keep]
    scales.view(torch.uint8)[idx] = scale[keep].view(torch.uint8)


@triton.jit
def _e4m3_value(c):
    """E4M3 (fn) code 0..127 (int32) -> fp32 value; 127 maps to 480 (only used as a bound)."""
    e = c >> 3
    m = c & 7
    p2 = ((tl.maximum(e, 1) - 10 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(max(e,1)-10)
    return ((e > 0).to(tl.int32) * 8 + m).to(tl.float32) * p2

@triton.jit
def _fp4_kv_store_kernel(x_ptr, slot_ptr, code_ptr, scale_ptr, n_groups, groups_per_row,
                         n_tiles, num_programs, BLOCK_G: tl.constexpr):
    pid = tl.program_id(0)
    j = tl.arange(0, 8)
    for t in range(pid, n_tiles, num_programs):
        g = t * BLOCK_G + tl.arange(0, BLOCK_G)
        row = g // groups_per_row
        gi = g - row * groups_per_row
        slot = tl.load(slot_ptr + row, mask=g < n_groups, other=-1).to(tl.int64)
        gmask = (g < n_groups) & (slot >= 0)
        mask = gmask[:, None]
        base = g.to(tl.int64)[:, None] * 16 + 2 * j[None, :]
        x0 = tl.load(x_ptr + base, mask=mask, other=0.0).to(tl.float32)      # even channels
        x1 = tl.load(x_ptr + base + 1, mask=mask, other=0.0).to(tl.float32)  # odd channels
        amax = tl.maximum(tl.max(tl.abs(x0), axis=1), tl.max(tl.abs(x1), axis=1))
        amax = tl.maximum(amax, 0.01171875)  # 6 * 2^-9
        # candidate E4M3 code: truncate q ~ amax / 6 to the E4M3 grid
        q = amax * 0.16666666666666666
        qb = q.to(tl.int32, bitcast=True)
        qe = ((qb >> 23) & 0xFF) - 127
        c_norm = (qe + 7) * 8 + ((qb >> 20) & 7)
        c_sub = (tl.minimum(q, 1.0) * 512.0).to(tl.int32)  # below 2^-6: multiples of 2^-9
        c = tl.where(qe >= -6, c_norm, c_sub)
        c = tl.minimum(tl.maximum(c, 0), 126)
        # exact fix-up: floor code of amax / 6 ...
        c = c + (amax >= 6.0 * _e4m3_value(c + 1)).to(tl.int32) - (amax < 6.0 * _e4m3_value(c)).to(tl.int32)
        # ... then round to nearest, ties to even, saturating at 448 (code 126)
        lo = _e4m3_value(c)
        mid6 = 3.0 * (lo + _e4m3_value(c + 1))
        up = (amax > mid6) | ((amax == mid6) & ((c & 1) == 1))
        c = tl.minimum(c + up.to(tl.int32), 126)
        s = _e4m3_value(c)[:, None]
        a0 = tl.abs(x0)
        a1 = tl.abs(x1)
        c0 = (a0 > 0.25 * s).to(tl.int32) + (a0 >= 0.75 * s).to(tl.int32) + (a0 > 1.25 * s).to(tl.int32) \
            + (a0 >= 1.75 * s).to(tl.int32) + (a0 > 2.5 * s).to(tl.int32) + (a0 >= 3.5 * s).to(tl.int32) \
            + (a0 > 5.0 * s).to(tl.int32) + (x0 < 0).to(tl.int32) * 8
        c1 = (a1 > 0.25 * s).to(tl.int32) + (a1 >= 0.75 * s).to(tl.int32) + (a1 > 1.25 * s).to(tl.int32) \
            + (a1 >= 1.75 * s).to(tl.int32) + (a1 > 2.5 * s).to(tl.int32) + (a1 >= 3.5 * s).to(tl.int32) \
            + (a1 > 5.0 * s).to(tl.int32) + (x1 < 0).to(tl.int32) * 8
        byte = (c0 | (c1 << 4)).to(tl.uint8)
        out_row = slot * groups_per_row + gi
        tl.store(code_ptr + out_row[:, None] * 8 + j[None, :], byte, mask=mask)
        tl.store(scale_ptr + out_row, c.to(tl.uint8), mask=gmask)


def fp4_kv_store(x: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantise rows x [M, D] to FP4 and write them to codes[slots] ([S, D/2] uint8) and
    scales[slots] ([S, D/16] float8_e4m3fn or uint8), in place. Requires triton."""
    from .launch import grid_for

    if x.dim() != 2 or x.shape[1] % GROUP:
        raise ValueError(f"x must be [M, D] with D a multiple of {GROUP}, got {tuple(x.shape)}")
    m, d = x.shape
    if slots.shape != (m,):
        raise ValueError(f"slots must be [{m}], got {tuple(slots.shape)}")
    cv, sv = codes.view(torch.uint8), scales.view(torch.uint8)
    if cv.shape[1:] != (d // 2,) or sv.shape[1:] != (d // GROUP,) or cv.shape[0] != sv.shape[0]:
        raise ValueError(f"codes {tuple(codes.shape)} / scales {tuple(scales.shape)} do not fit rows of width {d}")
    if not (cv.is_contiguous() and sv.is_contiguous()):
        raise ValueError("codes and scales must be contiguous")
    n_groups = m * d // GROUP
    if n_groups == 0:
        return
    n_tiles = -(-n_groups // BLOCK_G)
    grid = grid_for(n_tiles, x.device)
    _fp4_kv_store_kernel[(grid,)](x.contiguous(), slots.contiguous(), cv, sv, n_groups, d // GROUP,
                                  n_tiles, grid, BLOCK_G=BLOCK_G)


def fp4_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.fp4_quant` on top of the store kernel: [..., D] -> (uint8 [..., D/2], E4M3 [..., D/16])."""
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    m = x2.shape[0]
    codes = torch.empty(m, d // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(m, d // GROUP, dtype=torch.float8_e4m3fn, device=x.device)
    fp4_kv_store(x2, torch.arange(m, device=x.device), codes, scales)
    return codes.reshape(*x.shape[:-1], d // 2), scales.reshape(*x.shape[:-1], d // GROUP)


OPS = {"fp4_quant": fp4_quant}
