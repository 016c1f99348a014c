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
- The E4M3 byte is the integer code itself (sign 0), stored through an int8 view: no fp8 store
  (and no uint8 pointer, which triton-ascend does not support on Atlas A2/A3).
- The E2M1 code of x / s compares |x| with (E2M1 midpoint) * s: again exact products (<= 3 + 4
  significant bits), and equivalent to comparing the correctly rounded quotient with the
  midpoint (the quotient's rounding can never land on or cross a midpoint), so no division.
Tiles: BLOCK_G groups x 8 channel pairs (even / odd channels loaded separately and packed).

bf16 rows take a faster path (`_encode_words`): each group is read as 8 int32 words of two bf16
(16-byte loads instead of one 2-byte load per element) and encoded two channels per integer op
(SWAR on 16-bit lanes). It is the same function: every threshold mid * s has <= 7 significant
bits, so it is a bf16 value, and for non-negative bf16 values comparing the 15-bit magnitudes as
integers is comparing the values; a lane computes 0x8000 + |x| - T, whose bit 15 is |x| >= T
(T + 1 for the strict comparisons), with no borrow into the other lane. The seven comparisons
become a three-level binary search (1.75; 0.75 / 3.5; 0.25 / 1.25 / 2.5 / 5), since each level
uses one kind of comparison (>= on levels 1-2, > on level 3). -0.0 keeps a zero sign bit, as
`x < 0` does in the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends.reference import quant
from .pdl import pdl_launch, pdl_start
from .fp4_common import byte_to_int8, e2m1_code, e4m3_value, fp4_scale_code, offsets

GROUP = 16
# (BLOCK_G groups per tile, num_warps) per backend. Ascend / interpreter: a tile is 256 x 16
# values (16 KB fp32), far inside half the 192 KB unified buffer. CUDA: from the H200 sweep
# (benchmarks/sweep_kernels.py --only fp4_quant, 65536 x 512 bf16, graph time): word path
# 128/4 44.3 us, 256/4 44.6, 256/8 40.5, 512/8 40.8, 512/4 42.8, 1024/8 42.5; the per-channel
# path (256/4) 66.7 us.
TILES = {"cuda": (256, 8), "default": (256, 4)}


def ub_tiles(block_g: int) -> dict[str, tuple[int, ...]]:
    """Live tiles of one program at its peak (the per-channel path, the larger one): the even and
    odd channel values, their E2M1 codes and the byte tile, [BLOCK_G, 8] each, plus per-group
    scalars (amax, scale code and value, slot, row, masks)."""
    return {"x0": (block_g, 8), "x1": (block_g, 8), "c0": (block_g, 8), "c1": (block_g, 8),
            "byte": (block_g, 8), "per_group": (block_g, 8)}


def fp4_kv_store_ref(x: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """The torch reference: quantise with `quant.fp4_quant` and scatter rows (slots < 0 skipped)."""
    packed, scale = quant.fp4_quant(x)
    keep = slots >= 0
    idx = slots[keep].long()
    codes.view(torch.uint8)[idx] = packed[keep]
    scales.view(torch.uint8)[idx] = scale[keep].view(torch.uint8)


@triton.jit
def _lane_bits(d):
    """Bit 15 of each 16-bit lane of d, moved to bit 0 of the lane (0 or 1 per lane)."""
    return (d >> 15) & 0x00010001


@triton.jit
def _lane_const(t, STRICT: tl.constexpr):
    """Per-group threshold t (fp32, a bf16 value) -> int32 word adding 0x8000 - T to each lane,
    so that bit 15 of a lane of |w| + word is |x| >= t (|x| > t when STRICT)."""
    k = 0x8000 - (t.to(tl.int32, bitcast=True) >> 16) - STRICT
    return k | (k << 16)


@triton.jit
def _pick(m, a, b):
    """Lane-wise select: a where the lane mask m is all ones, else b."""
    return b ^ ((a ^ b) & m)


@triton.jit
def _encode_words(w, s):
    """w int32 [G, 8] words of two bf16 (low half = even channel), s [G, 1] E4M3 scale values ->
    [G, 8] bytes as int32 0..255 (even channel's E2M1 code in the low nibble), exactly
    `e2m1_code` per channel."""
    mag = w & 0x7FFF7FFF
    b2 = _lane_bits(mag + _lane_const(1.75 * s, 0))
    m2 = b2 * 0xFFFF
    b1 = _lane_bits(mag + _pick(m2, _lane_const(3.5 * s, 0), _lane_const(0.75 * s, 0)))
    m1 = b1 * 0xFFFF
    hi = _pick(m1, _lane_const(5.0 * s, 1), _lane_const(2.5 * s, 1))
    lo = _pick(m1, _lane_const(1.25 * s, 1), _lane_const(0.25 * s, 1))
    b0 = _lane_bits(mag + _pick(m2, hi, lo))
    nonzero = _lane_bits(mag + 0x7FFF7FFF)
    nib = (b2 << 2) | (b1 << 1) | b0 | ((w >> 12) & (nonzero << 3))
    return (nib | (nib >> 12)) & 0xFF


@triton.jit
def _fp4_kv_store_kernel(x_ptr, slot_ptr, code_ptr, scale_ptr, n_groups, n_tiles, num_programs,
                         groups_per_row: tl.constexpr, BLOCK_G: tl.constexpr, BF16_WORDS: tl.constexpr,
                         WIDE: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    pid = tl.program_id(0)
    j = tl.arange(0, 8)
    for t in range(pid, n_tiles, num_programs):
        g = t * BLOCK_G + tl.arange(0, BLOCK_G)
        row = g // groups_per_row
        gi = g - row * groups_per_row
        slot = offsets(tl.load(slot_ptr + row, mask=g < n_groups, other=-1), WIDE)
        gmask = (g < n_groups) & (slot >= 0)
        mask = gmask[:, None]
        if BF16_WORDS:  # x_ptr: int32 words, two bf16 channels each
            w = tl.load(x_ptr + offsets(g, WIDE)[:, None] * 8 + j[None, :], mask=mask, other=0)
            top = tl.max(tl.maximum(w & 0x7FFF, (w >> 16) & 0x7FFF), axis=1)  # |x| bits, max
            c = fp4_scale_code((top << 16).to(tl.float32, bitcast=True))
            byte = _encode_words(w, e4m3_value(c)[:, None])
        else:
            base = offsets(g, WIDE)[:, None] * 16 + 2 * j[None, :]
            x0 = tl.load(x_ptr + base, mask=mask, other=0.0).to(tl.float32)      # even channels
            x1 = tl.load(x_ptr + base + 1, mask=mask, other=0.0).to(tl.float32)  # odd channels
            amax = tl.maximum(tl.max(tl.abs(x0), axis=1), tl.max(tl.abs(x1), axis=1))
            c = fp4_scale_code(amax)
            s = e4m3_value(c)[:, None]
            c0 = e2m1_code(x0, s)
            c1 = e2m1_code(x1, s)
            byte = c0 | (c1 << 4)
        out_row = slot * groups_per_row + gi
        tl.store(code_ptr + out_row[:, None] * 8 + j[None, :], byte_to_int8(byte), mask=mask)
        tl.store(scale_ptr + out_row, c.to(tl.int8), mask=gmask)  # E4M3 codes 0..126: no sign bit


def _words(x: torch.Tensor) -> torch.Tensor | None:
    """Contiguous bf16 rows as int32 words of two channels, or None (other dtypes, odd offset)."""
    if x.dtype != torch.bfloat16 or x.storage_offset() % 2:
        return None
    return x.view(torch.int32)


def fp4_kv_store(x: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *,
                 block_g: int | None = None, num_warps: int | None = None, words: bool | None = None,
                 workers: int | None = None) -> None:
    """Quantise rows x [M, D] to FP4 and write them to codes[slots] ([S, D/2] uint8) and
    scales[slots] ([S, D/16] float8_e4m3fn or uint8), in place. Requires triton. The keyword-only
    arguments are for tuning (tile table and the bf16 word path by default)."""
    from .launch import as_int8, grid_for, interpreting, needs_int64

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
    bg, nw = TILES["cuda"] if x.device.type == "cuda" and not interpreting() else TILES["default"]
    bg, nw = block_g or bg, num_warps or nw
    x = x.contiguous()
    xw = _words(x) if words is not False else None
    n_tiles = -(-n_groups // bg)
    grid = min(n_tiles, workers) if workers else grid_for(n_tiles, x.device)
    kw = {} if interpreting() else {"num_warps": nw}
    _fp4_kv_store_kernel[(grid,)](x if xw is None else xw, slots.contiguous(), as_int8(cv), as_int8(sv), n_groups,
                                  n_tiles, grid, groups_per_row=d // GROUP, BLOCK_G=bg, BF16_WORDS=xw is not None,
                                  WIDE=needs_int64(x, cv), **kw, **pdl_launch(x))


def fp4_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.fp4_quant` on top of the store kernel: [..., D] -> (uint8 [..., D/2], E4M3 [..., D/16];
    its uint8 bytes on an NPU)."""
    from ...backends.platform import storage_dtype

    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    m = x2.shape[0]
    codes = torch.empty(m, d // 2, dtype=torch.uint8, device=x.device)
    # E4M3 scales in the device's storage dtype for them (uint8 bytes on an NPU)
    scales = torch.empty(m, d // GROUP, dtype=storage_dtype(torch.float8_e4m3fn, x.device), device=x.device)
    fp4_kv_store(x2, torch.arange(m, device=x.device), codes, scales)
    return codes.reshape(*x.shape[:-1], d // 2), scales.reshape(*x.shape[:-1], d // GROUP)


OPS = {"fp4_quant": fp4_quant}
