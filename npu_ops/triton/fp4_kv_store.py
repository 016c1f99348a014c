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
from .fp4_common import e2m1_code, e4m3_value, fp4_scale_code

GROUP = 16
BLOCK_G = 256  # groups per tile: 2 x (256 x 8) fp32 live values (H200 sweep: 32 -> 342 GB/s, 256 -> 528 GB/s)


def fp4_kv_store_ref(x: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """The torch reference: quantise with `quant.fp4_quant` and scatter rows (slots < 0 skipped)."""
    packed, scale = quant.fp4_quant(x)
    keep = slots >= 0
    idx = slots[keep].long()
    codes.view(torch.uint8)[idx] = packed[keep]
    scales.view(torch.uint8)[idx] = scale[keep].view(torch.uint8)


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
        c = fp4_scale_code(amax)
        s = e4m3_value(c)[:, None]
        c0 = e2m1_code(x0, s)
        c1 = e2m1_code(x1, s)
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
