"""Engram row gather: hashed row ids [T, R] -> dequantised bf16 [T, R * Dh] (op `engram_lookup`).

Tables: FP8 E4M3 [rows, Dh] (torch.float8_e4m3fn, or its uint8 bytes: the NPU storage) with E8M0
scales [rows, Dh/32] (float8_e8m0fnu or its uint8 bytes) or plain fp32/bf16/fp16 scales [rows, Dh/32]; or INT8 [rows, Dh] with
one fp32 scale per row ([rows] or [rows, 1]). Every gathered row is one contiguous load of Dh
bytes; the table may be a device tensor or, on CUDA, pinned host memory (read through its
device-visible address; unverified at the model level, kernel tested on an H200).

Bit-exact with `engram_lookup_ref`: E4M3 bytes are decoded with integer ops (sign, 4-bit
exponent with bias 7, 3-bit mantissa, subnormals m * 2^-9, 0x7F/0xFF NaN) to their exact fp32
values, the E8M0 byte b to the fp32 2^(b-127) (b = 0: 2^-127, b = 255: inf, as the reference's
ldexp gives), and the fp32 product (the reference's own fp32 multiply) is rounded to bf16
to nearest-even on the bits (the Triton interpreter's bf16 cast truncates).
Tiles: BLOCK_R gathered rows x BLOCK_D (Dh rounded up to a power of two), held as
[BLOCK_R, BLOCK_D / 32, 32] so each scale is loaded once per 32-column group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends.reference.basic import engram_lookup as engram_lookup_ref  # noqa: F401  (the oracle)
from ...backends.reference.basic import gather_rows_to

from .pdl import pdl_launch, pdl_start
from .fp4_common import as_cmp, offsets

BLOCK_R = 16  # gathered rows per tile
BLOCK_R_NPU = 8  # Ascend: 8 x 256-wide rows keep ~6 live tiles inside half the 192 KB unified buffer
NUM_WARPS = 4
MODE_FP8_E8M0, MODE_FP8_F32, MODE_INT8 = 0, 1, 2


def ub_tiles(block_r: int, dh: int) -> dict[str, tuple[int, ...]]:
    """Live tiles of one program at its peak (the FP8 path): the gathered bytes, exponent,
    mantissa, magnitude and value tiles [BLOCK_R, BLOCK_D], the scales and the bf16 bits out."""
    bd = max(32, 1 << max(0, dh - 1).bit_length())
    t = (block_r, bd)
    return {"byte": t, "e": t, "mantissa": t, "mag": t, "value": t, "bits": t, "scales": (block_r, bd // 32)}


@triton.jit
def _bf16_bits(v):
    """fp32 -> bf16 bits (int16), round to nearest even (NaN stays NaN: quiet bit kept)."""
    b = v.to(tl.int32, bitcast=True)
    nan = v != v  # a float compare (Ascend vectorises those; an int compare here would not be exact in fp32)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = tl.where(nan, (b >> 16) | 0x40, r)
    return r.to(tl.int16)


@triton.jit
def _engram_kernel(tab_ptr, sc_ptr, rows_ptr, out_ptr, n_rows, DH, n_tiles, num_programs,
                   MODE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, WIDE: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    pid = tl.program_id(0)
    # columns as [groups of 32, 32]: one scale per group, loaded once and broadcast
    gg = tl.arange(0, BLOCK_D // 32)
    ee = tl.arange(0, 32)
    cols = (gg * 32)[:, None] + ee[None, :]
    cm = cols < DH
    for t in range(pid, n_tiles, num_programs):
        r = t * BLOCK_R + tl.arange(0, BLOCK_R)
        rm = r < n_rows
        idx = offsets(tl.load(rows_ptr + r, mask=rm, other=0), WIDE)
        m2 = rm[:, None, None] & cm[None, :, :]
        src = idx[:, None, None] * DH + cols[None, :, :]
        if MODE == 2:  # INT8 rows, one fp32 scale per row
            q = tl.load(tab_ptr + src, mask=m2, other=0).to(tl.float32)
            s = tl.load(sc_ptr + idx, mask=rm, other=0.0).to(tl.float32)[:, None, None]
            v = q * s
        else:  # FP8 E4M3 bytes (loaded through an int8 pointer), one scale per 32 columns
            byte = tl.load(tab_ptr + src, mask=m2, other=0).to(tl.int32) & 0xFF
            e = (byte >> 3) & 15
            mt = byte & 7
            mag_bits = ((e + 120) << 23) | (mt << 20)  # normal: 2^(e-7) * (1 + mt/8)
            ef, mf = as_cmp(e), as_cmp(mt)  # fp32 compares (Ascend); bytes are exact
            mag = tl.where(ef == 0.0, mf * 0.001953125,  # subnormal: mt * 2^-9
                           mag_bits.to(tl.float32, bitcast=True))
            mag = tl.where((ef == 15.0) & (mf == 7.0), float("nan"), mag)
            sign = (byte & 0x80) << 24  # set the sign bit directly: -x would be 0 - x (loses -0.0)
            q = (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
            sidx = idx[:, None] * (DH // 32) + gg[None, :]
            gm = rm[:, None] & (gg * 32 < DH)[None, :]
            if MODE == 0:  # E8M0 byte b -> 2^(b - 127)
                sb = tl.load(sc_ptr + sidx, mask=gm, other=127).to(tl.int32) & 0xFF
                s = tl.where(as_cmp(sb) == 0.0, 5.877471754111438e-39, (sb << 23).to(tl.float32, bitcast=True))
            else:
                s = tl.load(sc_ptr + sidx, mask=gm, other=0.0).to(tl.float32)
            v = q * s[:, :, None]
        dst = offsets(r, WIDE)[:, None, None] * DH + cols[None, :, :]
        tl.store(out_ptr + dst, _bf16_bits(v), mask=m2)


def engram_lookup(table: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor, *,
                  block_r: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """`ops.engram_lookup`: gather rows [T, R] of `table` and dequantise them to bf16
    [T, R * Dh] on rows' device. On CUDA a page-locked host table is read in place; any other
    table off rows' device (host memory on Ascend, or not page-locked) has the step's rows
    gathered where it is and copied over first (`gather_rows_to`)."""
    from .launch import grid_for, interpreting, needs_int64

    in_place = table.device == rows.device or (rows.device.type == "cuda" and table.is_pinned() and scale.is_pinned())
    if not in_place:
        table, scale, rows = gather_rows_to(table, scale, rows)

    if rows.dim() != 2:
        raise ValueError(f"rows must be [T, R], got {tuple(rows.shape)}")
    if table.dim() != 2:
        raise ValueError(f"table must be [rows, Dh], got {tuple(table.shape)}")
    n_tab, dh = table.shape
    if table.dtype == torch.int8:
        mode = MODE_INT8
        if scale.numel() != n_tab or scale.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"an INT8 table needs one float scale per row ([{n_tab}] or [{n_tab}, 1])")
        tab, sc = table, scale.reshape(n_tab)
    elif table.dtype in (torch.float8_e4m3fn, torch.uint8):  # uint8: E4M3 bytes (NPU storage)
        if dh % 32 or scale.shape != (n_tab, dh // 32):
            raise ValueError(f"an FP8 table [{n_tab}, {dh}] needs scales [{n_tab}, {dh // 32}], got {tuple(scale.shape)}")
        if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):  # uint8: E8M0 bytes (NPU storage)
            mode, sc = MODE_FP8_E8M0, scale.view(torch.int8)  # int8 pointers: no uint8 loads on Atlas A2/A3
        elif scale.dtype in (torch.float32, torch.bfloat16, torch.float16):
            mode, sc = MODE_FP8_F32, scale  # plain multipliers, as the reference reads them
        else:
            raise ValueError(f"unsupported FP8 scale dtype {scale.dtype}")
        tab = table.view(torch.int8)
    else:
        raise ValueError(f"unsupported table dtype {table.dtype}")
    if not (tab.is_contiguous() and sc.is_contiguous()):
        raise ValueError("table and scale must be contiguous")  # no silent copy of a huge table
    t, r = rows.shape
    out = torch.empty(t, r * dh, dtype=torch.bfloat16, device=rows.device)
    n_rows = t * r
    if n_rows == 0:
        return out
    br = block_r or (BLOCK_R_NPU if rows.device.type == "npu" else BLOCK_R)
    n_tiles = -(-n_rows // br)
    grid = grid_for(n_tiles, rows.device)
    kw = {} if interpreting() else {"num_warps": num_warps or NUM_WARPS}
    _engram_kernel[(grid,)](tab, sc, rows.contiguous(), out.view(torch.int16), n_rows, dh, n_tiles, grid,
                            MODE=mode, BLOCK_R=br, BLOCK_D=max(32, triton.next_power_of_2(dh)),
                            WIDE=needs_int64(tab, out), **kw, **pdl_launch(tab))
    return out


OPS = {"engram_lookup": engram_lookup}
