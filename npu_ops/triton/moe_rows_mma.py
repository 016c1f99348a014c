"""FP4 routed experts at one and two tokens with the multiply-adds on the tensor cores, fed from
registers (`rows_moe(..., mma=...)`, the rows path's MMA variant and its CUDA default; `row_mma`'s
scheme for E2M1 weights). H200, mini widths: 76.1 us per layer at one token (K split in two)
against 94.2 for the CUDA-core rows kernels, 137.0 against 177.7 at two (benchmarks/RESULTS.md,
"FP4 experts at one and two tokens on register-fed MMAs").

The rows kernels (`moe_rows`) spend about 4.5 instructions per weight on the CUDA cores (bit
placement, an fp16 -> fp32 widening and an FMA per weight). Here each lane builds f16x2 registers
from its weight word with the same bit placement (value * 2^-14, exact for every code: 13
instructions per 8 weights) and hands them to `mma.sync.m16n8k16` (fp32 accumulation), so a
weight costs about 2 instructions.

Per call, R = T * k routed rows (token t, slot j -> flat row f = t * k + j; expert ids[f]):
1. `row_mma._x_codes_kernel` (PERM): x's FP8 codes as f16, each group of 8 columns stored in the
   order 0, 2, 4, 6, 1, 3, 5, 7 (the pairs the placement yields), and its power-of-two block scales.
2. `_mma_up_kernel`, grid (R, I / 32), 4 warps: warps 0 / 1 take rows 32c .. 32c + 15 / + 31 of
   expert ids[f]'s w1, warps 2 / 3 the same rows of w3. Lane (g, t) of a warp holds rows g and
   g + 8 of its 16: per 32-wide block one int32 word of each (codes 8t .. 8t + 7) and x's f16
   codes 8t .. 8t + 7 (one 16-byte load); two MMAs give the block's exact sums, times the
   block's factor (x's scale times the row's E8M0 scale, times 2^14) into fp32 accumulators. The
   sums go to a scratch [R, 2, I]; after a CTA barrier the program applies the official epilogue
   (`swiglu.expert_act`) to its 32 columns and stores the w2 input's FP8 codes (f16, the same
   column order) and block scale.
3. `_mma_down_kernel`, grid (R, D / (16 NW)): the same over w2 with h, each expert output rounded
   to bf16 into y [R, D]; `moe_experts._combine_kernel` sums a token's slots.
Both kernels can split K (grid axis 2, `MMA_SPLITS` by token count): each slice stores fp32
partials and the tile's last slice (a counter of `launch.tile_counters`) adds them in slice order
before the epilogue (deterministic). At one token the split doubles the warps streaming weights,
which is what the unsplit kernels lacked.
Slots with ids < 0 do nothing (their rows are skipped by the masks).

Numerics: the rows kernels' class (exact products, fp32 sums, bf16 rounding where the official
expert rounds). Under TRITON_INTERPRET=1 the MMA is emulated lane by lane (`_mma4_emulated`).
CUDA only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_scaled import bf16_round, e8m0_value, fp8_exponent, fp8_round, pow2
from . import moe_rows
from .moe_rows import GROUP, _row_ptrs
from .row_mma import _f16_half, x_codes
from .swiglu import expert_act

MMA_TILES = {"num_warps_down": 4, "bb": 4}
# K slices (gate/up, down) by token count. H200 2026-12-01 ~20:10 UTC, graph replay, 16 FP4 experts
# 5120 x 2304, top-6 (benchmarks/RESULTS.md, "FP4 experts at one and two tokens on register-fed MMAs"):
# T=1 no split 92.5 us, up 2 80.9, down 2 88.0, 2 / 2 76.1, 3 / 3 78.2, 4 / 2 82.4 (rows kernels
# 94.2); T=2 (12 experts) no split 137.0, 2 / 2 150.1, 3 / 3 138.0 (rows 177.7, fold 192.1).
MMA_SPLITS = {1: (2, 2), 2: (1, 1)}


def mma_fits(inter: int, d: int, num_warps_down: int = MMA_TILES["num_warps_down"]) -> bool:
    """Whether the kernels take the expert widths: whole 32-row groups of the intermediate width,
    d whole down programs of 16 rows a warp."""
    return inter > 0 and d > 0 and inter % GROUP == 0 and d % (16 * num_warps_down) == 0

# $2 / $3: the words of rows g / g + 8 (E2M1 codes 8t .. 8t + 7 of the block, element i in bits
# 4i .. 4i + 3); $4 .. $7: x's f16 pairs in the placement's order. The placement (moe_rows'
# `_E2M1_ASM`): l holds the fp16 high bytes of the even elements, h of the odd ones; prmt 0x1404
# pairs bytes 0, 1 and 0x3424 bytes 2, 3, giving (0, 2), (4, 6) from l and (1, 3), (5, 7) from h.
_MMA4_ASM = tl.constexpr("""{
.reg .b32 a, b, l, h, p0, p1, p2, p3, q0, q1, q2, q3;
.reg .f32 d0, d1, d2, d3, z;
mov.f32 z, 0f00000000;
shl.b32 a, $2, 1; and.b32 a, a, 0x0E0E0E0E; shl.b32 b, $2, 4; and.b32 b, b, 0x80808080; or.b32 l, a, b;
shr.b32 a, $2, 3; and.b32 a, a, 0x0E0E0E0E; and.b32 b, $2, 0x80808080; or.b32 h, a, b;
prmt.b32 p0, l, 0, 0x1404; prmt.b32 p1, l, 0, 0x3424; prmt.b32 p2, h, 0, 0x1404; prmt.b32 p3, h, 0, 0x3424;
shl.b32 a, $3, 1; and.b32 a, a, 0x0E0E0E0E; shl.b32 b, $3, 4; and.b32 b, b, 0x80808080; or.b32 l, a, b;
shr.b32 a, $3, 3; and.b32 a, a, 0x0E0E0E0E; and.b32 b, $3, 0x80808080; or.b32 h, a, b;
prmt.b32 q0, l, 0, 0x1404; prmt.b32 q1, l, 0, 0x3424; prmt.b32 q2, h, 0, 0x1404; prmt.b32 q3, h, 0, 0x3424;
mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0, d1, d2, d3}, {p0, q0, p1, q1}, {$4, $5}, {z, z, z, z};
mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0, d1, d2, d3}, {p2, q2, p3, q3}, {$6, $7}, {d0, d1, d2, d3};
mov.b32 $0, d0; mov.b32 $1, d2;
}""")
# element i of a word sits at position POS(i) of the placement's order 0, 2, 4, 6, 1, 3, 5, 7


@triton.jit
def _pos8(i):
    """The position of element i (0..7) of a group of 8 in the order 0, 2, 4, 6, 1, 3, 5, 7."""
    return i // 2 + 4 * (i % 2)


@triton.jit
def _e2m1_nibble(wd, i: tl.constexpr):
    """Element i of int32 words of 8 E2M1 codes as fp32 (the interpreter's decode)."""
    c = (wd >> (4 * i)) & 15
    m = c & 7
    mag = tl.where(m < 2, m.to(tl.float32) * 0.5, pow2(m // 2 - 1) * (1.0 + (m & 1).to(tl.float32) * 0.5))
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def _mma4_emulated(wg, w8, x0, x1, x2, x3, NW: tl.constexpr):
    """What `_MMA4_ASM` returns (D[g, 2t], D[g + 8, 2t]) from the same lane registers, with the
    weights' true values (the asm's carry 2^-14; the caller's factor has 2^14 for both)."""
    dg = tl.zeros((NW, 8, 8), dtype=tl.float32)
    d8 = tl.zeros((NW, 8, 8), dtype=tl.float32)
    for i in tl.static_range(8):
        p = i // 2 + 4 * (i % 2)
        if p // 2 == 0:
            xw = x0
        elif p // 2 == 1:
            xw = x1
        elif p // 2 == 2:
            xw = x2
        else:
            xw = x3
        bx = tl.reshape(_f16_half(xw, (p % 2) == 1), (NW, 1, 8, 4))
        dg += tl.sum(tl.reshape(_e2m1_nibble(wg, i) * 6.103515625e-05, (NW, 8, 1, 4)) * bx, axis=3)
        d8 += tl.sum(tl.reshape(_e2m1_nibble(w8, i) * 6.103515625e-05, (NW, 8, 1, 4)) * bx, axis=3)
    # every column holds the same token here: column 0's sums
    c0 = tl.reshape(tl.broadcast_to(tl.sum(tl.where(tl.arange(0, 8)[None, None, :] == 0, dg, 0.0), axis=2)[:, :, None],
                                    (NW, 8, 4)), (NW * 32,))
    c2 = tl.reshape(tl.broadcast_to(tl.sum(tl.where(tl.arange(0, 8)[None, None, :] == 0, d8, 0.0), axis=2)[:, :, None],
                                    (NW, 8, 4)), (NW * 32,))
    return c0, c2


@triton.jit
def _rows_sums(wg_rows, w8_rows, sg_rows, s8_rows, okg, ok8, xrow, xfrow, b_lo, b_hi, t, NW: tl.constexpr,
               BB: tl.constexpr, ASM: tl.constexpr):
    """Per lane the fp32 dot of rows g and g + 8 (word pointers wg_rows / w8_rows at their
    first word, scale bytes sg_rows / s8_rows) with x's codes (xrow: per lane, its token's int32
    pairs from the lane's first pair, 4t; xfrow: the token's block scales) over blocks b_lo .. b_hi."""
    four = tl.arange(0, 4)
    accg = tl.zeros((NW * 32,), dtype=tl.float32)
    acc8 = tl.zeros((NW * 32,), dtype=tl.float32)
    for b0 in range(b_lo, b_hi, BB):
        for i in tl.static_range(BB):
            bl = b0 + i
            bok = bl < b_hi
            wg = tl.load(wg_rows + 4 * bl + t, mask=okg & bok, other=0)
            w8 = tl.load(w8_rows + 4 * bl + t, mask=ok8 & bok, other=0)
            xa, xb = tl.split(tl.reshape(tl.load(xrow[:, None] + 16 * bl + four[None, :], mask=bok, other=0),
                                         (NW * 32, 2, 2)))
            x0, x2 = tl.split(xa)
            x1, x3 = tl.split(xb)
            xf = tl.load(xfrow + bl, mask=bok, other=0.0) * 16384.0
            fg = xf * e8m0_value(tl.load(sg_rows + bl, mask=okg & bok, other=0).to(tl.int32))
            f8 = xf * e8m0_value(tl.load(s8_rows + bl, mask=ok8 & bok, other=0).to(tl.int32))
            if ASM:
                cg, c8 = tl.inline_asm_elementwise(_MMA4_ASM, "=r,=r,r,r,r,r,r,r", [wg, w8, x0, x1, x2, x3],
                                                   dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
            else:
                cg, c8 = _mma4_emulated(wg, w8, x0, x1, x2, x3, NW)
            accg += cg * fg
            acc8 += c8 * f8
    return accg, acc8


@triton.jit
def _lanes(NW: tl.constexpr):
    """Per lane: warp, g (row in the warp's 8), t (K quarter)."""
    lane = tl.arange(0, NW * 32)
    return lane // 32, (lane % 32) // 4, lane % 4


@triton.jit
def _k_range(NBK, bps):
    """Blocks b_lo .. b_hi of K slice program_id(2) (bps blocks a slice)."""
    b_lo = tl.program_id(2) * bps
    return b_lo, tl.minimum(NBK, b_lo + bps)


@triton.jit
def _last_slice(count_ptr, tile, SPLIT: tl.constexpr):
    """After this program's partials are stored: whether it is the tile's last K slice (then it
    finishes the tile and resets the counter). Always true without a split."""
    if SPLIT == 1:
        return True
    else:
        tl.debug_barrier()  # every lane's partial is stored before the counter moves
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        last = done == SPLIT - 1
        if last:
            tl.atomic_xchg(count_ptr + tile, 0)
        return last


@triton.jit
def _mma_up_kernel(xq_ptr, xf_ptr, ids_ptr, wts_ptr, w_base, s_base, table_ptr, part_ptr, count_ptr, hq_ptr, hf_ptr, K,
                   I, R, s_stride, bps, limit, TOPK: tl.constexpr, ALIGN: tl.constexpr, BB: tl.constexpr,
                   SPLIT: tl.constexpr, ASM: tl.constexpr):
    """Gate / up sums of rows 32c .. 32c + 31 (c = program_id(1)) of flat row f = program_id(0)
    over K slice program_id(2), into part [SPLIT, R, 2, I]; the tile's last slice adds the
    slices in order and applies the epilogue into h's codes (module docstring). 4 warps."""
    f = tl.program_id(0)
    n0 = tl.program_id(1) * 32
    e = tl.load(ids_ptr + f)
    active = e >= 0
    e = tl.maximum(e, 0).to(tl.int64)
    warp, g, t = _lanes(4)
    which = warp // 2  # 0: w1, 1: w3
    rg = n0 + 16 * (warp % 2) + g
    KW = K // 8
    wg_rows, sg_rows = _row_ptrs(w_base, s_base, table_ptr, e, which, rg, KW, s_stride, ALIGN)
    w8_rows, s8_rows = _row_ptrs(w_base, s_base, table_ptr, e, which, rg + 8, KW, s_stride, ALIGN)
    tok = (f // TOPK).to(tl.int64)
    okr = (g >= 0) & active
    b_lo, b_hi = _k_range(K // 32, bps)
    accg, acc8 = _rows_sums(wg_rows, w8_rows, sg_rows, s8_rows, okr, okr, xq_ptr + tok * (K // 2) + 4 * t,
                            xf_ptr + tok * (K // 32), b_lo, b_hi, t, 4, BB, ASM)
    row_out = part_ptr + (tl.program_id(2) * R + f).to(tl.int64) * 2 * I + which * I
    tl.store(row_out + rg, accg, mask=t == 0)
    tl.store(row_out + rg + 8, acc8, mask=t == 0)
    if SPLIT == 1:
        tl.debug_barrier()  # every lane's sums are stored before they are read back across the CTA
    if _last_slice(count_ptr, f * tl.num_programs(1) + tl.program_id(1), SPLIT) & active:
        j = tl.arange(0, 32)
        gs = tl.zeros((32,), dtype=tl.float32)
        us = tl.zeros((32,), dtype=tl.float32)
        for sl in range(SPLIT):  # the slices in order
            base = part_ptr + (sl * R + f).to(tl.int64) * 2 * I + n0 + j
            gs += tl.load(base, cache_modifier=".cg")
            us += tl.load(base + I, cache_modifier=".cg")
        h = expert_act(gs, us, tl.load(wts_ptr + f), limit)
        eh = fp8_exponent(tl.max(tl.abs(h), axis=0))
        code = fp8_round(h * pow2(-eh))
        pos = (j // 8) * 8 + _pos8(j % 8)
        tl.store(hq_ptr + f.to(tl.int64) * I + n0 + pos, code.to(tl.float16))
        tl.store(hf_ptr + f.to(tl.int64) * (I // 32) + n0 // 32, pow2(eh))


@triton.jit
def _mma_down_kernel(hq_ptr, hf_ptr, ids_ptr, w_base, s_base, table_ptr, part_ptr, count_ptr, y_ptr, I, D, R, s_stride,
                     bps, ALIGN: tl.constexpr, NW: tl.constexpr, BB: tl.constexpr, SPLIT: tl.constexpr,
                     ASM: tl.constexpr):
    """y[f, rows of this program] = bf16(h[f] @ w2 rows), 16 rows a warp, K slice program_id(2)
    (partials [SPLIT, R, D] added in slice order by the tile's last slice; module docstring)."""
    f = tl.program_id(0)
    e = tl.load(ids_ptr + f)
    active = e >= 0
    e = tl.maximum(e, 0).to(tl.int64)
    warp, g, t = _lanes(NW)
    rg = tl.program_id(1) * (16 * NW) + 16 * warp + g
    KW = I // 8
    wg_rows, sg_rows = _row_ptrs(w_base, s_base, table_ptr, e, 2, rg, KW, s_stride, ALIGN)
    w8_rows, s8_rows = _row_ptrs(w_base, s_base, table_ptr, e, 2, rg + 8, KW, s_stride, ALIGN)
    okr = (g >= 0) & active
    b_lo, b_hi = _k_range(I // 32, bps)
    accg, acc8 = _rows_sums(wg_rows, w8_rows, sg_rows, s8_rows, okr, okr, hq_ptr + f.to(tl.int64) * (I // 2) + 4 * t,
                            hf_ptr + f.to(tl.int64) * (I // 32), b_lo, b_hi, t, NW, BB, ASM)
    yrow = y_ptr + f.to(tl.int64) * D
    st = (t == 0) & active
    if SPLIT == 1:
        tl.store(yrow + rg, bf16_round(accg), mask=st)
        tl.store(yrow + rg + 8, bf16_round(acc8), mask=st)
    else:
        prow = part_ptr + (tl.program_id(2) * R + f).to(tl.int64) * D
        tl.store(prow + rg, accg, mask=st)
        tl.store(prow + rg + 8, acc8, mask=st)
        if _last_slice(count_ptr, f * tl.num_programs(1) + tl.program_id(1), SPLIT):
            tg = tl.zeros((NW * 32,), dtype=tl.float32)
            t8 = tl.zeros((NW * 32,), dtype=tl.float32)
            for sl in range(SPLIT):
                prow = part_ptr + (sl * R + f).to(tl.int64) * D
                tg += tl.load(prow + rg, mask=st, other=0.0, cache_modifier=".cg")
                t8 += tl.load(prow + rg + 8, mask=st, other=0.0, cache_modifier=".cg")
            tl.store(yrow + rg, bf16_round(tg), mask=st)
            tl.store(yrow + rg + 8, bf16_round(t8), mask=st)


def mma_moe(x, flat_ids, wts, table_args, limit, topk, *, num_warps_down=None, bb=None, split_up=None,
            split_down=None):
    """Steps 1-3 of the module docstring for x [T, d]: y [R, d] fp32 (each expert output rounded to
    bf16), for `moe_rows.rows_moe` to combine. Widths: d % (16 * num_warps_down) == 0, the
    intermediate width % 32 == 0. split_up / split_down: K slices of the two kernels."""
    from .launch import interpreting, tile_counters

    w_base, s_base, table, kind, inter, d, (s_up, s_down), align = table_args
    nwd = num_warps_down or MMA_TILES["num_warps_down"]
    bb = bb or MMA_TILES["bb"]
    if not mma_fits(inter, d, nwd):
        raise ValueError(f"moe_experts rows path (mma): widths ({inter}, {d}) need {GROUP} | {inter} and "
                         f"{16 * nwd} | {d}")
    interp = interpreting()
    r = flat_ids.numel()
    # K slices of whole loop steps (so the split actually used can be smaller than asked)
    t_split = MMA_SPLITS.get(r // topk, (1, 1))
    bps_up = bb * triton.cdiv(triton.cdiv(d // 32, bb), split_up or t_split[0])
    su = triton.cdiv(d // 32, bps_up)
    bps_down = bb * triton.cdiv(triton.cdiv(inter // 32, bb), split_down or t_split[1])
    sd = triton.cdiv(inter // 32, bps_down)
    n_up, n_down = inter // GROUP, d // (16 * nwd)
    counts = tile_counters(x.device, r * max(n_up, n_down)) if max(su, sd) > 1 else flat_ids
    xq, xf = x_codes(x, perm=True)
    part = moe_rows._buffer((su, r, 2, inter), torch.float32, x.device)
    hq = moe_rows._buffer((r, inter), torch.float16, x.device)
    hf = moe_rows._buffer((r, inter // 32), torch.float32, x.device)
    y = moe_rows._buffer((r, d), torch.float32, x.device)
    part_y = moe_rows._buffer((sd, r, d), torch.float32, x.device) if sd > 1 else y
    kw = {} if interp else {"num_warps": 4}
    _mma_up_kernel[(r, n_up, su)](xq.view(torch.int32), xf, flat_ids, wts, w_base, s_base, table, part, counts, hq, hf,
                                  d, inter, r, s_up, bps_up, float(limit), TOPK=topk, ALIGN=align, BB=bb, SPLIT=su,
                                  ASM=not interp, **kw)
    kw = {} if interp else {"num_warps": nwd}
    _mma_down_kernel[(r, n_down, sd)](hq.view(torch.int32), hf, flat_ids, w_base, s_base, table, part_y, counts, y,
                                      inter, d, r, s_down, bps_down, ALIGN=align, NW=nwd, BB=bb, SPLIT=sd,
                                      ASM=not interp, **kw)
    return y
