"""FP4 routed experts at 1-8 tokens with the multiply-adds on the tensor cores, fed from
registers (`rows_moe(..., mma=...)`, the rows path's MMA variant and its CUDA default; `row_mma`'s
scheme for E2M1 weights). H200, mini widths: 59.7-62.1 us per layer at one token (the
block-diagonal operand below) against 94.2 for the CUDA-core rows kernels, 106.7 against 177.7 at
two, 173.9 against fold's 227.1 at eight (benchmarks/RESULTS.md, "FP4 experts at one and two
tokens on register-fed MMAs", sessions fifteen and sixteen).

The rows kernels (`moe_rows`) spend about 4.5 instructions per weight on the CUDA cores (bit
placement, an fp16 -> fp32 widening and an FMA per weight). Here each lane builds f16x2 registers
from its weight word with the same bit placement (value * 2^-14, exact for every code: 13
instructions per 8 weights) and hands them to `mma.sync.m16n8k16` (fp32 accumulation), so a
weight costs about 2 instructions.

Per call, R = T * k routed rows (token t, slot j -> flat row f = t * k + j; expert ids[f]). A
program owns an expert and up to 8 columns (the MMA's n): below GROUPED_MIN_T tokens one routed
row (program f: expert ids[f], one column), from there one expert with all its routed rows
(program e: rows perm[bounds[e] : bounds[e + 1]] of `moe_grouped.sort_rows`; a token's experts are
distinct, so at most T <= MMA_MAX_T rows), so each expert's weight is read once for all of them
(an expert with more rows, from ids repeated inside a token, takes a pass per 8 of them).
1. `row_mma._x_codes_kernel` (PERM): x's FP8 codes as f16, each group of 8 columns stored in the
   order 0, 2, 4, 6, 1, 3, 5, 7 (the pairs the placement yields), and its power-of-two block scales.
2. `_mma_up_kernel`, grid (programs, I / 32, K slices), 4 warps: warps 0 / 1 take rows 32c ..
   32c + 15 / + 31 of the expert's w1, warps 2 / 3 the same rows of w3. Lane (g, t) of a warp
   holds rows g and g + 8 of its 16: per 32-wide block one int32 word of each (codes 8t .. 8t + 7)
   and column g's x codes 8t .. 8t + 7 (one 16-byte load); two MMAs give the block's exact sums
   D[g | g + 8, 2t | 2t + 1], each times its column's factor (x's scale times the row's E8M0
   scale, times 2^14) into fp32 accumulators. The sums go to a scratch [R, 2, I] by flat row;
   after a CTA barrier the program applies the official epilogue (`swiglu.expert_act`) to its 32
   columns for each of its rows and stores the w2 input's FP8 codes (f16, the same column order)
   and block scale.
3. `_mma_down_kernel`, grid (programs, D / (16 NW), K slices): the same over w2 with h, each
   expert output rounded to bf16 into y [R, D]; `moe_experts._combine_kernel` sums a token's slots.
At a program per routed row (one activation column) the MMA's other 7 columns would repeat it;
DIAG (`_diag_step_sums`) uses them instead: lane (g, t) keeps its 16 loaded bytes (block b0 + t
of its rows whole), and the B operand is block diagonal (column n: x's codes of block b0 + n in
lane (n, n), zero elsewhere), so D's column n sums one block and a 4-block step's 8 MMAs chain in
the tensor core's accumulator; no transpose, and the scale factors once a step. The row sums are
totalled across each quad at the end. The gate/up loop went from 286 to 167 sm_90a instructions
a step (72 to 42 a block), down from 279 to 180. The gate/up kernel's weight loads ask L2 for
the 256-byte block around them (`ld.global.L2::256B`, MMA_TILES["l2_hint"]), so three of every
four steps of a row slice find their bytes in L2: the op at one token 62 -> 58 us on the H200.
Both kernels can split K (`MMA_SPLITS` by token count): each slice stores fp32 partials and the
tile's last slice (a counter of `launch.tile_counters`) adds them in slice order before the
epilogue (deterministic). At one token the split doubles the warps streaming weights, which is
what the unsplit kernels lacked.
Slots with ids < 0 do nothing (their rows are skipped by the masks).

Numerics: the rows kernels' class (exact products, fp32 sums, bf16 rounding where the official
expert rounds). Under TRITON_INTERPRET=1 the MMA is emulated lane by lane (`_mma4_emulated`).
CUDA only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_start
from .block_scaled import bf16_round, e2m1_value, e8m0_value, fp8_exponent, fp8_round, pow2
from . import moe_rows
from .moe_rows import GROUP, _row_ptrs
from .row_mma import _cols4, _diag_factors, _pick, _pick4, _quad_total, _x_column, lane_words, mma_asm, x_codes
from .swiglu import expert_act

# scale_words: a loop step's four scale bytes of a row in one int32 load (`_cols_sums`' SW). H200
# 2026-12-02 ~02:51 UTC, mini widths, graph us (sweep_kernels.py --only moe_rows): T=1 split 2 / 2
# 77.0 -> 76.9, split 3 / 3 76.7 -> 70.7; T=2 (12 experts) 136.0 (no split) -> 131.6 (3 / 3 with
# words); T=8 (grouped) 193.4 -> 182.5: the kernels are bound partly by load instructions (a byte
# load per row and block reads 8 rows' lines a warp), not by their latency (loading the next
# step's words ahead in registers: T=1 76.9, T=2 143.3, T=8 203.0 against 76-77 / 132.6 / 186.2).
# vec_words (gate/up, down): each lane loads 16 bytes of its row a step and the quad's transpose
# hands out the words (`_cols_sums`' VEC). H200 2026-12-02 ~03:02 UTC: the whole op with both
# kernels so T=1 72.8 us (70.1 without), T=2 122.7 (127.9), T=8 173.9 (183.5); in the mini decode
# step (graph, 6 layers) the gate/up kernel 294.7 -> 273.4 us at batch 1 and 706.7 -> 645.2 at
# batch 8, the down kernel 151.1 -> 172.5 at batch 1 (336.7 / 336.3 at batch 8): gate/up only.
# diag (`_diag_step_sums`, at one column a program), H200 2026-12-02 06:13 UTC, whole op: T=1 62.1
# us (71.5 without), T=2 106.7 (120.4); kernels at T=1 gate/up 35.3 us (44-45 before), down 21.4
# (25.7); the mini decode step (graph) 1.959 -> 1.902 ms at batch 1. (The 16-byte loads alone with
# the step's x scales in one load and 2^14 once per block: T=1 71.5 / T=2 120.4, the VEC row.)
# l2_hint (`_diag_sums`' L2, `row_mma.lane_words`) and variants not kept, H200 2026-12-04 ~16:38 UTC,
# whole op at T=1 (graph us, two alternated passes, K split 3 / 2): none 61.6 / 62.2; factors one step ahead
# 64.4 / 64.8, factors and words 62.9 / 63.5 (ptxas sinks the early loads back to the step's end);
# L2::256B on both kernels' weight loads 58.3 / 58.8 (gate/up 39.8 -> 34.8 us, down 18.8 -> 19.9),
# an L2 prefetch 256 bytes ahead 74.2 / 74.8. The mini decode step at batch 1 (graph, 4K, 16:40,
# alternated) with L2::256B on both kernels: 1.676 / 1.684 -> 1.669 / 1.666 ms. Gate/up only (the
# default, ~16:45): 57.7 / 58.1 against 64.9 / 64.7 without, 58.7 / 58.8 on both.
MMA_TILES = {"num_warps_down": 4, "bb": 4, "scale_words": True, "vec_words": (True, False), "diag": True,
             "l2_hint": (True, False)}
# K slices (gate/up, down) by token count. H200 2026-12-01 ~20:10 UTC, graph replay, 16 FP4 experts
# 5120 x 2304, top-6 (benchmarks/RESULTS.md, "FP4 experts at one and two tokens on register-fed MMAs"):
# T=1 no split 92.5 us, up 2 80.9, down 2 88.0, 2 / 2 76.1, 3 / 3 78.2, 4 / 2 82.4 (rows kernels
# 94.2); T=2 (12 experts) no split 137.0, 2 / 2 150.1, 3 / 3 138.0 (rows 177.7, fold 192.1). A
# program per expert (GROUPED_MIN_T..MMA_MAX_T tokens), ~20:35 UTC: T=3 no split 184.4, 2 / 2 169.0,
# 3 / 3 163.7 (fold 188.5); T=4 183.5, 169.0, 166.2 (fold 181.1); T=8 223.6, 197.5, 189.9 (fold
# 230.5); one program per routed row instead: 187.6 / 251.4 / 422.3.
# With scale words (2026-12-02): T=1 3 / 3 70.7 us against 2 / 2 76.9; T=2 3 / 3 131.6 against 1 / 1 136.1.
# With diag (06:13): T=1 3 / 2 59.7 us against 3 / 3 62.1, 2 / 2 62.7, 4 / 4 67.7 (the down kernel's
# 50 registers allow 9 programs an SM: 3 slices of 480 programs are 1.21 waves, 2 fit in one);
# T=2 3 / 3 106.7 against 3 / 2 107.3, 4 / 4 110.1.
# With the gate/up kernel's L2 hint (l2_hint (True, False), 2026-12-04 ~16:45 UTC, two alternated
# passes): T=1 2 / 2 56.7 / 57.2 us against 3 / 2 57.7 / 58.1, 4 / 2 56.9 / 56.9, 4 / 3 58.3 / 58.1 alone; but in
# the mini decode step (graph, batch 1, 4K, 16:51-16:52 UTC, alternated) 2 / 2 read 1.700 / 1.709 ms
# against 1.669 / 1.673 for 3 / 2, so 3 / 2 stays.
MMA_SPLITS = {1: (3, 2), 2: (3, 3), 3: (3, 3), 4: (3, 3), 5: (3, 3), 6: (3, 3), 7: (3, 3), 8: (3, 3)}
MMA_MAX_T = 8  # the MMA's n: an expert's rows in one pass (the routed experts of a token are distinct)
GROUPED_MIN_T = 3  # from here a program per expert (its rows as MMA columns), below one per routed row


def mma_fits(inter: int, d: int, num_warps_down: int = MMA_TILES["num_warps_down"]) -> bool:
    """Whether the kernels take the expert widths: whole 32-row groups of the intermediate width,
    d whole down programs of 16 rows a warp."""
    return inter > 0 and d > 0 and inter % GROUP == 0 and d % (16 * num_warps_down) == 0

# $4 / $5: the words of rows g / g + 8 (E2M1 codes 8t .. 8t + 7 of the block, element i in bits
# 4i .. 4i + 3); $6 .. $9: x's f16 pairs in the placement's order. The placement (moe_rows'
# `_E2M1_ASM`): l holds the fp16 high bytes of the even elements, h of the odd ones; prmt 0x1404
# pairs bytes 0, 1 and 0x3424 bytes 2, 3, giving (0, 2), (4, 6) from l and (1, 3), (5, 7) from h.
# Outputs: D[g, 2t], D[g, 2t + 1], D[g + 8, 2t], D[g + 8, 2t + 1].
_MMA4_BODY = """
.reg .b32 a, b, l, h, p0, p1, p2, p3, q0, q1, q2, q3;
shl.b32 a, $4, 1; and.b32 a, a, 0x0E0E0E0E; shl.b32 b, $4, 4; and.b32 b, b, 0x80808080; or.b32 l, a, b;
shr.b32 a, $4, 3; and.b32 a, a, 0x0E0E0E0E; and.b32 b, $4, 0x80808080; or.b32 h, a, b;
prmt.b32 p0, l, 0, 0x1404; prmt.b32 p1, l, 0, 0x3424; prmt.b32 p2, h, 0, 0x1404; prmt.b32 p3, h, 0, 0x3424;
shl.b32 a, $5, 1; and.b32 a, a, 0x0E0E0E0E; shl.b32 b, $5, 4; and.b32 b, b, 0x80808080; or.b32 l, a, b;
shr.b32 a, $5, 3; and.b32 a, a, 0x0E0E0E0E; and.b32 b, $5, 0x80808080; or.b32 h, a, b;
prmt.b32 q0, l, 0, 0x1404; prmt.b32 q1, l, 0, 0x3424; prmt.b32 q2, h, 0, 0x1404; prmt.b32 q3, h, 0, 0x3424;
mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0, d1, d2, d3}, {p0, q0, p1, q1}, {$6, $7}, {d0, d1, d2, d3};
mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0, d1, d2, d3}, {p2, q2, p3, q3}, {$8, $9}, {d0, d1, d2, d3};
mov.b32 $0, d0; mov.b32 $1, d1; mov.b32 $2, d2; mov.b32 $3, d3;
}"""
_MMA4_ASM = mma_asm(_MMA4_BODY)
_MMA4C_ASM = mma_asm(_MMA4_BODY, 10)  # the same onto D given in $10 .. $13 (`_diag_step_sums`' chain)


@triton.jit
def _pos8(i):
    """The position of element i (0..7) of a group of 8 in the order 0, 2, 4, 6, 1, 3, 5, 7."""
    return i // 2 + 4 * (i % 2)


@triton.jit
def _mma4_emulated(wg, w8, x0, x1, x2, x3, NW: tl.constexpr):
    """What `_MMA4_ASM` returns, from the same lane registers: D[r, j] = the sum over the lanes t
    of row r's 8 values times column j's 8 values, with the weights' true values (the asm's
    carry 2^-14; the caller's factor has 2^14 for both)."""
    dg = tl.zeros((NW, 8, 8), dtype=tl.float32)  # [warp, row g, column j]
    d8 = tl.zeros((NW, 8, 8), dtype=tl.float32)
    for i in tl.static_range(8):
        bx = _x_column(x0, x1, x2, x3, i // 2 + 4 * (i % 2), NW)  # element i sits at position _pos8(i)
        dg += tl.sum(tl.reshape(e2m1_value((wg >> (4 * i)) & 15) * 6.103515625e-05, (NW, 8, 1, 4)) * bx, axis=3)
        d8 += tl.sum(tl.reshape(e2m1_value((w8 >> (4 * i)) & 15) * 6.103515625e-05, (NW, 8, 1, 4)) * bx, axis=3)
    return _pick(dg, NW, 0), _pick(dg, NW, 1), _pick(d8, NW, 0), _pick(d8, NW, 1)


# A quad's 4 x 4 transpose of words (lanes 4g .. 4g + 3, two butterfly rounds): $4 .. $7 are the
# lane's words 0 .. 3 of its own block (b0 + t); $0 .. $3 become word t of blocks b0 .. b0 + 3.
# Round 1 (lanes t and t ^ 2) swaps the off-diagonal 2 x 2 blocks, round 2 (t and t ^ 1) the
# off-diagonal words inside them.
_QUAD_T_ASM = tl.constexpr("""{
.reg .b32 l, ra, rb, sa, sb, w0, w1, w2, w3;
.reg .pred p;
mov.u32 l, %laneid; and.b32 l, l, 2; setp.ne.u32 p, l, 0;
selp.b32 sa, $4, $6, p; selp.b32 sb, $5, $7, p;
shfl.sync.bfly.b32 ra, sa, 2, 0x1f, 0xffffffff; shfl.sync.bfly.b32 rb, sb, 2, 0x1f, 0xffffffff;
selp.b32 w0, ra, $4, p; selp.b32 w1, rb, $5, p; selp.b32 w2, $6, ra, p; selp.b32 w3, $7, rb, p;
mov.u32 l, %laneid; and.b32 l, l, 1; setp.ne.u32 p, l, 0;
selp.b32 sa, w0, w1, p; selp.b32 sb, w2, w3, p;
shfl.sync.bfly.b32 ra, sa, 1, 0x1f, 0xffffffff; shfl.sync.bfly.b32 rb, sb, 1, 0x1f, 0xffffffff;
selp.b32 $0, ra, w0, p; selp.b32 $1, w1, ra, p; selp.b32 $2, rb, w2, p; selp.b32 $3, w3, rb, p;
}""")


@triton.jit
def _quad_words(v, NW: tl.constexpr, ASM: tl.constexpr):
    """v [NW * 32, 4]: each lane's 16 bytes of its row (the 4 words of block b0 + t). Returns the
    4 lane tensors u_i = word t of block b0 + i (the per-block words of the MMA's lane layout),
    by `_QUAD_T_ASM`; under the interpreter by a transpose of the [quad, t, word] view."""
    if not ASM:
        v = tl.reshape(tl.permute(tl.reshape(v, (NW * 8, 4, 4)), (0, 2, 1)), (NW * 32, 4))
    v0, v1, v2, v3 = _cols4(v, NW)
    if ASM:
        v0, v1, v2, v3 = tl.inline_asm_elementwise(
            _QUAD_T_ASM, "=r,=r,=r,=r,r,r,r,r", [v0, v1, v2, v3],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    return v0, v1, v2, v3


@triton.jit
def _block_words(wg_rows, w8_rows, sg_rows, s8_rows, okr, bl, b_hi, t, sgw, s8w, i: tl.constexpr, SW: tl.constexpr):
    """Block bl's weight words of rows g / g + 8 (code quarter t) and their E8M0 scale bytes as
    int32 (zeros past b_hi): SW, byte i of the step's scale words sgw / s8w, else loaded."""
    ok = okr & (bl < b_hi)
    wg = tl.load(wg_rows + 4 * bl + t, mask=ok, other=0)
    w8 = tl.load(w8_rows + 4 * bl + t, mask=ok, other=0)
    if SW:
        return wg, w8, tl.where(ok, (sgw >> (8 * i)) & 255, 0), tl.where(ok, (s8w >> (8 * i)) & 255, 0)
    else:
        return (wg, w8, tl.load(sg_rows + bl, mask=ok, other=0).to(tl.int32),
                tl.load(s8_rows + bl, mask=ok, other=0).to(tl.int32))


@triton.jit
def _mma_block(acc0, acc1, acc2, acc3, wg, w8, xq, fg, f8, fbg, fb8, NW: tl.constexpr, ONE: tl.constexpr,
               ASM: tl.constexpr):
    """The accumulators plus one block's MMA sums of the words wg / w8 with the lane's x codes xq
    [NW * 32, 4] (int32 f16 pairs), times the factors of (row g, row g + 8) x (column 2t, 2t + 1)."""
    x0, x1, x2, x3 = _cols4(xq, NW)
    if ASM:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            _MMA4_ASM, "=r,=r,=r,=r,r,r,r,r,r,r", [wg, w8, x0, x1, x2, x3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        c0, c1, c2, c3 = _mma4_emulated(wg, w8, x0, x1, x2, x3, NW)
    acc0 += c0 * fg
    acc2 += c2 * f8
    if not ONE:
        acc1 += c1 * fbg
        acc3 += c3 * fb8
    return acc0, acc1, acc2, acc3


@triton.jit
def _block_sums(acc0, acc1, acc2, acc3, wg, w8, sgb, s8b, xrow, xfa, xfb, bl, b_hi, NW: tl.constexpr,
                ONE: tl.constexpr, ASM: tl.constexpr):
    """The accumulators plus block bl's sums (`_block_words`' values) times their factors."""
    bok = bl < b_hi
    xq = tl.load(xrow[:, None] + 16 * bl + tl.arange(0, 4)[None, :], mask=bok, other=0)
    sg = e8m0_value(sgb) * 16384.0
    s8 = e8m0_value(s8b) * 16384.0
    fa = tl.load(xfa + bl, mask=bok, other=0.0)
    fb = fa
    if not ONE:
        fb = tl.load(xfb + bl, mask=bok, other=0.0)
    return _mma_block(acc0, acc1, acc2, acc3, wg, w8, xq, fa * sg, fa * s8, fb * sg, fb * s8, NW, ONE, ASM)


@triton.jit
def _vec_step_sums(acc0, acc1, acc2, acc3, wg_rows, w8_rows, sg_rows, s8_rows, okr, xrow, xfa, xfb, b0, t,
                   NW: tl.constexpr, ONE: tl.constexpr, ASM: tl.constexpr):
    """VEC: the accumulators plus blocks b0 .. b0 + 3, a slice's whole step (the launcher's
    condition, so no block of it lies past the slice). Each lane loads 16 bytes of its row (block
    b0 + t whole) and the quad's transpose (`_quad_words`) hands every lane word t of each block;
    a row's 4 scale bytes come as one int32 and x's 4 block scales as one 16-byte load (2^14, the
    placement's factor, multiplied in once per block for both rows); x's codes load unmasked."""
    four = tl.arange(0, 4)
    pg = tl.multiple_of(wg_rows + 4 * (b0 + t), 16)  # (16-byte rows: the launcher's condition)
    p8 = tl.multiple_of(w8_rows + 4 * (b0 + t), 16)
    qg = _quad_words(tl.load(pg[:, None] + four[None, :], mask=okr[:, None], other=0), NW, ASM)
    q8 = _quad_words(tl.load(p8[:, None] + four[None, :], mask=okr[:, None], other=0), NW, ASM)
    # masked rows read scale 0 (e8m0_value: 0.0) beside zero words: no per-block select
    sgw = tl.load((sg_rows + b0).to(tl.pointer_type(tl.int32)), mask=okr, other=0)
    s8w = tl.load((s8_rows + b0).to(tl.pointer_type(tl.int32)), mask=okr, other=0)
    fa = _cols4(tl.load(tl.multiple_of(xfa + b0, 16)[:, None] + four[None, :]) * 16384.0, NW)
    fb = fa
    if not ONE:
        fb = _cols4(tl.load(tl.multiple_of(xfb + b0, 16)[:, None] + four[None, :]) * 16384.0, NW)
    for i in tl.static_range(4):
        sg = e8m0_value((sgw >> (8 * i)) & 255)
        s8 = e8m0_value((s8w >> (8 * i)) & 255)
        fai = _pick4(fa[0], fa[1], fa[2], fa[3], i)
        fbi = _pick4(fb[0], fb[1], fb[2], fb[3], i)
        xq = tl.load(xrow[:, None] + 16 * (b0 + i) + four[None, :])
        acc0, acc1, acc2, acc3 = _mma_block(acc0, acc1, acc2, acc3, _pick4(qg[0], qg[1], qg[2], qg[3], i),
                                            _pick4(q8[0], q8[1], q8[2], q8[3], i), xq, fai * sg, fai * s8,
                                            fbi * sg, fbi * s8, NW, ONE, ASM)
    return acc0, acc1, acc2, acc3


@triton.jit
def _diag_scales(sg_rows, s8_rows, okr, xfa, b0, NW: tl.constexpr):
    """DIAG's factors of step b0: the 4 scale bytes of rows g / g + 8 as one int32 each (masked
    rows: 0, which `e8m0_value` reads as 0.0 beside their zero words) and x's 4 block scales times
    2^14 (the placement's factor)."""
    four = tl.arange(0, 4)
    sgw = tl.load((sg_rows + b0).to(tl.pointer_type(tl.int32)), mask=okr, other=0)
    s8w = tl.load((s8_rows + b0).to(tl.pointer_type(tl.int32)), mask=okr, other=0)
    fa = _cols4(tl.load(tl.multiple_of(xfa + b0, 16)[:, None] + four[None, :]), NW)
    return sgw, s8w, fa[0] * 16384.0, fa[1] * 16384.0, fa[2] * 16384.0, fa[3] * 16384.0


@triton.jit
def _diag_words(wg_rows, w8_rows, okr, b0, t, NW: tl.constexpr, L2: tl.constexpr = False):
    """DIAG's weights of step b0: lane (g, t)'s 16 bytes of rows g / g + 8 (block b0 + t whole)
    as 4 + 4 int32 words (masked rows: zeros); L2: `row_mma.lane_words`' L2 hint (CUDA asm only)."""
    pg = tl.multiple_of(wg_rows + 4 * (b0 + t), 16)  # (16-byte rows: the launcher's condition)
    p8 = tl.multiple_of(w8_rows + 4 * (b0 + t), 16)
    g0, g1, g2, g3 = lane_words(pg, okr, L2, NW)
    e0, e1, e2, e3 = lane_words(p8, okr, L2, NW)
    return g0, g1, g2, g3, e0, e1, e2, e3


@triton.jit
def _diag_step_sums(acc0, acc1, acc2, acc3, wg, w8, sgw, s8w, fa16, xblk, b0, g, t, NW: tl.constexpr,
                    ASM: tl.constexpr):
    """DIAG (one column, VEC's conditions): the accumulators plus blocks b0 .. b0 + 3 with the
    MMA's unused columns separating the blocks instead of a transpose. Lane (g, t) keeps its 16
    bytes of row g / g + 8 as they load (block b0 + t whole, 4 words: `_diag_words`), and the B
    operand is block diagonal: column n holds x's codes of block b0 + n at the K positions of
    lane t = n (lane (n, n) loads them; every other lane's B is zero). So each MMA's column n sums
    lane n's products only, one block each, and a step's 8 MMAs chain in the tensor core's fp32
    accumulator: D[r, n] = block b0 + n's 32-product sum for row r. Lane (g, t < 2) gets columns
    2t, 2t + 1 (lanes t >= 2: columns 4..7, zero), times their factors (`_diag_scales`: sgw, s8w,
    fa16) into the accumulators. xblk: column 0's codes (int32 f16 pairs) at block 0."""
    four = tl.arange(0, 4)
    xw = xblk + 16 * (b0 + t)  # lane (n, n): block b0 + n's codes, word w at 4w
    d0 = tl.zeros((NW * 32,), dtype=tl.float32)
    d1 = tl.zeros((NW * 32,), dtype=tl.float32)
    d2 = tl.zeros((NW * 32,), dtype=tl.float32)
    d3 = tl.zeros((NW * 32,), dtype=tl.float32)
    for w in tl.static_range(4):
        x0, x1, x2, x3 = _cols4(tl.load(xw[:, None] + 4 * w + four[None, :], mask=(g == t)[:, None], other=0), NW)
        a = _pick4(wg[0], wg[1], wg[2], wg[3], w)
        b = _pick4(w8[0], w8[1], w8[2], w8[3], w)
        if ASM:
            d0, d1, d2, d3 = tl.inline_asm_elementwise(
                _MMA4C_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r", [a, b, x0, x1, x2, x3, d0, d1, d2, d3],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
        else:
            c0, c1, c2, c3 = _mma4_emulated(a, b, x0, x1, x2, x3, NW)
            d0 += c0
            d1 += c1
            d2 += c2
            d3 += c3
    return _diag_factors(acc0, acc1, acc2, acc3, d0, d1, d2, d3, fa16, sgw, s8w, t)


@triton.jit
def _diag_sums(wg_rows, w8_rows, sg_rows, s8_rows, okr, xblk, xfa, b_lo, b_hi, g, t, NW: tl.constexpr,
               ASM: tl.constexpr, L2: tl.constexpr):
    """DIAG's loop over blocks b_lo .. b_hi in 4-block steps (`_diag_step_sums`), returning the
    four accumulators. L2: the weight loads ask L2 for the 256-byte block around them
    (`row_mma.lane_words`), so the next 3 steps of a row slice wait on L2, not DRAM. (ptxas sinks
    a step's scale loads below its fifth MMA, and loads written one step ahead back to the step's
    end, so a step waits on its weights, then on its scales: benchmarks/RESULTS.md, "A lead for
    batch 1's routed experts" and "Session twenty-nine".)"""
    acc0 = tl.zeros((NW * 32,), dtype=tl.float32)
    acc1 = tl.zeros((NW * 32,), dtype=tl.float32)
    acc2 = tl.zeros((NW * 32,), dtype=tl.float32)
    acc3 = tl.zeros((NW * 32,), dtype=tl.float32)
    for b0 in range(b_lo, b_hi, 4):
        sgw, s8w, f0, f1, f2, f3 = _diag_scales(sg_rows, s8_rows, okr, xfa, b0, NW)
        g0, g1, g2, g3, e0, e1, e2, e3 = _diag_words(wg_rows, w8_rows, okr, b0, t, NW, L2)
        acc0, acc1, acc2, acc3 = _diag_step_sums(acc0, acc1, acc2, acc3, (g0, g1, g2, g3), (e0, e1, e2, e3), sgw,
                                                 s8w, (f0, f1, f2, f3), xblk, b0, g, t, NW, ASM)
    return acc0, acc1, acc2, acc3


@triton.jit
def _cols_sums(wg_rows, w8_rows, sg_rows, s8_rows, okr, xrow, xfa, xfb, b_lo, b_hi, g, t, NW: tl.constexpr,
               BB: tl.constexpr, ONE: tl.constexpr, ASM: tl.constexpr, SW: tl.constexpr = False,
               VEC: tl.constexpr = False, DIAG: tl.constexpr = False, L2: tl.constexpr = False):
    """Per lane (g, t) the fp32 dots of rows g and g + 8 (word pointers wg_rows / w8_rows at their
    first word, scale bytes sg_rows / s8_rows) with the activations of columns 2t and 2t + 1 over
    blocks b_lo .. b_hi: (row g col 2t, row g col 2t + 1, row g + 8 col 2t, row g + 8 col 2t + 1).
    xrow: per lane, column g's codes as int32 pairs from the lane's first pair (4t); xfa / xfb:
    the block scales of columns 2t / 2t + 1. ONE: a single column (the second pair stays 0).
    BB blocks a step. SW (BB == 4, the rows' scale bytes 4-aligned at every step): a step's four
    scale bytes of a row come in one int32 load, not four byte loads. VEC (SW, and slices of whole
    steps over 16-byte rows): `_vec_step_sums`; DIAG (VEC's conditions and ONE): `_diag_sums` (L2:
    its L2 hint; the other forms ignore L2), and the row sums are totalled across each quad at the
    end. (Loading a step's words and scales one step ahead, carried in registers, measured no
    faster on the H200, before DIAG and with it: benchmarks/RESULTS.md, sessions fifteen and
    twenty-nine.)"""
    if DIAG:  # a row's blocks are spread over its quad's columns: each lane gets the row's total
        acc0, acc1, acc2, acc3 = _diag_sums(wg_rows, w8_rows, sg_rows, s8_rows, okr, xrow - 4 * t, xfa, b_lo, b_hi, g,
                                            t, NW, ASM, L2)
        return _quad_total(acc0 + acc1, NW), acc1, _quad_total(acc2 + acc3, NW), acc3
    acc0 = tl.zeros((NW * 32,), dtype=tl.float32)
    acc1 = tl.zeros((NW * 32,), dtype=tl.float32)
    acc2 = tl.zeros((NW * 32,), dtype=tl.float32)
    acc3 = tl.zeros((NW * 32,), dtype=tl.float32)
    for b0 in range(b_lo, b_hi, BB):
        if VEC:
            acc0, acc1, acc2, acc3 = _vec_step_sums(acc0, acc1, acc2, acc3, wg_rows, w8_rows, sg_rows, s8_rows, okr,
                                                    xrow, xfa, xfb, b0, t, NW, ONE, ASM)
        else:
            sgw = 0
            s8w = 0
            if SW:
                ok0 = okr & (b0 < b_hi)
                sgw = tl.load((sg_rows + b0).to(tl.pointer_type(tl.int32)), mask=ok0, other=0)
                s8w = tl.load((s8_rows + b0).to(tl.pointer_type(tl.int32)), mask=ok0, other=0)
            for i in tl.static_range(BB):
                wg, w8, sgb, s8b = _block_words(wg_rows, w8_rows, sg_rows, s8_rows, okr, b0 + i, b_hi, t, sgw, s8w, i,
                                                SW)
                acc0, acc1, acc2, acc3 = _block_sums(acc0, acc1, acc2, acc3, wg, w8, sgb, s8b, xrow, xfa, xfb, b0 + i,
                                                     b_hi, NW, ONE, ASM)
    return acc0, acc1, acc2, acc3


@triton.jit
def _lanes(NW: tl.constexpr):
    """Per lane: warp, g (row in the warp's 8; the MMA column it feeds), t (K quarter)."""
    lane = tl.arange(0, NW * 32)
    return lane // 32, (lane % 32) // 4, lane % 4


@triton.jit
def _columns(p0, ids_ptr, perm_ptr, bounds_ptr, GROUPED: tl.constexpr):
    """A program's expert and columns: GROUPED, expert p0 and its flat rows perm[start : start +
    cnt] (`moe_grouped.sort_rows`); else flat row p0 alone and its expert. (expert, active, start,
    cnt)."""
    if GROUPED:
        start = tl.load(bounds_ptr + p0)
        cnt = tl.load(bounds_ptr + p0 + 1) - start
        return p0.to(tl.int64), cnt > 0, start, cnt
    else:
        e = tl.load(ids_ptr + p0)
        return tl.maximum(e, 0).to(tl.int64), e >= 0, p0, 1


@triton.jit
def _flat_row(perm_ptr, start, cnt, col, GROUPED: tl.constexpr):
    """The flat row of column `col` (clamped into 0 .. cnt - 1: the extra columns repeat the last)."""
    c = tl.maximum(tl.minimum(col, cnt - 1), 0)
    if GROUPED:  # an expert without rows reads nothing (perm past its valid rows is unset): row 0
        return tl.load(perm_ptr + start + c, mask=cnt > 0, other=0).to(tl.int64)
    else:
        return (start + 0 * c).to(tl.int64)


@triton.jit
def _k_range(NBK, bps):
    """Blocks b_lo .. b_hi of K slice program_id(2) (bps blocks a slice)."""
    b_lo = tl.program_id(2) * bps
    return b_lo, tl.minimum(NBK, b_lo + bps)


@triton.jit
def _last_slice(count_ptr, tile, SPLIT: tl.constexpr, SLICED: tl.constexpr):
    """After this program's partials are stored: whether it is the tile's last K slice (then it
    finishes the tile; the counter is reset for the next call). Always true without a split
    (SLICED: SPLIT > 1, a boolean flag that tests/test_kernel_barriers.py follows)."""
    if not SLICED:
        return True
    else:
        tl.debug_barrier()  # every lane's partial is stored before the counter moves
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        last = done == SPLIT - 1
        if last:
            tl.atomic_xchg(count_ptr + tile, 0)
        return last


@triton.jit
def _mma_up_kernel(xq_ptr, xf_ptr, ids_ptr, perm_ptr, bounds_ptr, wts_ptr, w_base, s_base, table_ptr, part_ptr,
                   count_ptr, hq_ptr, hf_ptr, K, I, R, s_stride, bps, limit, TOPK: tl.constexpr, ALIGN: tl.constexpr,
                   BB: tl.constexpr, SPLIT: tl.constexpr, SLICED: tl.constexpr, GROUPED: tl.constexpr,
                   ASM: tl.constexpr, SW: tl.constexpr = False, VEC: tl.constexpr = False,
                   DIAG: tl.constexpr = False, L2: tl.constexpr = False, PDL: tl.constexpr = 0):
    """Gate / up sums of rows 32c .. 32c + 31 (c = program_id(1)) for the program's columns
    (`_columns`, 8 at a time) over K slice program_id(2), into part [SPLIT, R, 2, I] by flat row;
    the tile's last slice adds the slices in order and applies the epilogue into h's codes
    (module docstring). 4 warps."""
    pdl_start(PDL)
    p0 = tl.program_id(0)
    n0 = tl.program_id(1) * 32
    e, active, start, cnt = _columns(p0, ids_ptr, perm_ptr, bounds_ptr, GROUPED)
    warp, g, t = _lanes(4)
    which = warp // 2  # 0: w1, 1: w3
    rg = n0 + 16 * (warp % 2) + g
    KW = K // 8
    NBK = K // 32
    wg_rows, sg_rows = _row_ptrs(w_base, s_base, table_ptr, e, which, rg, KW, s_stride, ALIGN)
    w8_rows, s8_rows = _row_ptrs(w_base, s_base, table_ptr, e, which, rg + 8, KW, s_stride, ALIGN)
    okr = (g >= 0) & active
    b_lo, b_hi = _k_range(NBK, bps)
    # at most 8 columns a pass: an expert routed more rows (not from distinct experts per token)
    # takes more passes over its weights
    for c0 in range(0, cnt, 8):
        cn = tl.minimum(cnt - c0, 8)
        fr_g = _flat_row(perm_ptr, start + c0, cn, g, GROUPED)
        fr_a = _flat_row(perm_ptr, start + c0, cn, 2 * t, GROUPED)
        fr_b = _flat_row(perm_ptr, start + c0, cn, 2 * t + 1, GROUPED)
        acc0, acc1, acc2, acc3 = _cols_sums(wg_rows, w8_rows, sg_rows, s8_rows, okr,
                                            xq_ptr + (fr_g // TOPK) * (K // 2) + 4 * t, xf_ptr + (fr_a // TOPK) * NBK,
                                            xf_ptr + (fr_b // TOPK) * NBK, b_lo, b_hi, g, t, 4, BB, not GROUPED, ASM,
                                            SW, VEC, DIAG, L2)
        va = okr & (2 * t < cn)
        vb = okr & (2 * t + 1 < cn)
        pa = part_ptr + (tl.program_id(2) * R + fr_a) * 2 * I + which * I
        pb = part_ptr + (tl.program_id(2) * R + fr_b) * 2 * I + which * I
        tl.store(pa + rg, acc0, mask=va)
        tl.store(pa + rg + 8, acc2, mask=va)
        if GROUPED:
            tl.store(pb + rg, acc1, mask=vb)
            tl.store(pb + rg + 8, acc3, mask=vb)
    if not SLICED:
        tl.debug_barrier()  # every lane's sums are stored before they are read back across the CTA
    if _last_slice(count_ptr, p0 * tl.num_programs(1) + tl.program_id(1), SPLIT, SLICED) & active:
        j = tl.arange(0, 8)
        r = tl.arange(0, 32)
        pos = (r // 8) * 8 + _pos8(r % 8)
        for c0 in range(0, cnt, 8):
            cn = tl.minimum(cnt - c0, 8)
            fr = _flat_row(perm_ptr, start + c0, cn, j, GROUPED)  # [8] the columns' flat rows
            ok = (j < cn)[:, None]
            gs = tl.zeros((8, 32), dtype=tl.float32)
            us = tl.zeros((8, 32), dtype=tl.float32)
            for sl in range(SPLIT):  # the slices in order
                base = part_ptr + ((sl * R + fr) * 2 * I)[:, None] + n0 + r[None, :]
                gs += tl.load(base, mask=ok, other=0.0, cache_modifier=".cg")
                us += tl.load(base + I, mask=ok, other=0.0, cache_modifier=".cg")
            h = expert_act(gs, us, tl.load(wts_ptr + fr)[:, None], limit)
            eh = fp8_exponent(tl.max(tl.abs(h), axis=1))
            code = fp8_round(h * pow2(-eh)[:, None])
            tl.store(hq_ptr + (fr * I)[:, None] + n0 + pos[None, :], code.to(tl.float16), mask=ok)
            tl.store(hf_ptr + fr * (I // 32) + n0 // 32, pow2(eh), mask=j < cn)


@triton.jit
def _down_out(y_ptr, part_ptr, sl, R, D, fr, rg, acc, acc8, ok, FINAL: tl.constexpr):
    """Rows rg / rg + 8 of flat row fr: the bf16-rounded output (FINAL) or slice sl's partial."""
    if FINAL:
        tl.store(y_ptr + fr * D + rg, bf16_round(acc), mask=ok)
        tl.store(y_ptr + fr * D + rg + 8, bf16_round(acc8), mask=ok)
    else:
        tl.store(part_ptr + (sl * R + fr) * D + rg, acc, mask=ok)
        tl.store(part_ptr + (sl * R + fr) * D + rg + 8, acc8, mask=ok)


@triton.jit
def _mma_down_kernel(hq_ptr, hf_ptr, ids_ptr, perm_ptr, bounds_ptr, w_base, s_base, table_ptr, part_ptr, count_ptr,
                     y_ptr, I, D, R, s_stride, bps, ALIGN: tl.constexpr, NW: tl.constexpr, BB: tl.constexpr,
                     SPLIT: tl.constexpr, SLICED: tl.constexpr, GROUPED: tl.constexpr, ASM: tl.constexpr,
                     SW: tl.constexpr = False, VEC: tl.constexpr = False, DIAG: tl.constexpr = False,
                     L2: tl.constexpr = False, PDL: tl.constexpr = 0):
    """y[flat row, rows of this program] = bf16(h[flat row] @ w2 rows) for the program's columns
    (8 at a time), 16 rows a warp, K slice program_id(2) (partials [SPLIT, R, D] added in slice
    order by the tile's last slice; module docstring)."""
    pdl_start(PDL)
    p0 = tl.program_id(0)
    e, active, start, cnt = _columns(p0, ids_ptr, perm_ptr, bounds_ptr, GROUPED)
    warp, g, t = _lanes(NW)
    rg = tl.program_id(1) * (16 * NW) + 16 * warp + g
    KW = I // 8
    wg_rows, sg_rows = _row_ptrs(w_base, s_base, table_ptr, e, 2, rg, KW, s_stride, ALIGN)
    w8_rows, s8_rows = _row_ptrs(w_base, s_base, table_ptr, e, 2, rg + 8, KW, s_stride, ALIGN)
    okr = (g >= 0) & active
    b_lo, b_hi = _k_range(I // 32, bps)
    for c0 in range(0, cnt, 8):
        cn = tl.minimum(cnt - c0, 8)
        fr_g = _flat_row(perm_ptr, start + c0, cn, g, GROUPED)
        fr_a = _flat_row(perm_ptr, start + c0, cn, 2 * t, GROUPED)
        fr_b = _flat_row(perm_ptr, start + c0, cn, 2 * t + 1, GROUPED)
        acc0, acc1, acc2, acc3 = _cols_sums(wg_rows, w8_rows, sg_rows, s8_rows, okr, hq_ptr + fr_g * (I // 2) + 4 * t,
                                            hf_ptr + fr_a * (I // 32), hf_ptr + fr_b * (I // 32), b_lo, b_hi, g, t, NW,
                                            BB, not GROUPED, ASM, SW, VEC, DIAG, L2)
        # the slice's partials (SLICED), else the outputs (one slice: program_id(2) is 0)
        _down_out(y_ptr, part_ptr, tl.program_id(2), R, D, fr_a, rg, acc0, acc2, okr & (2 * t < cn), not SLICED)
        if GROUPED:
            _down_out(y_ptr, part_ptr, tl.program_id(2), R, D, fr_b, rg, acc1, acc3, okr & (2 * t + 1 < cn),
                      not SLICED)
    if SLICED:
        if _last_slice(count_ptr, p0 * tl.num_programs(1) + tl.program_id(1), SPLIT, SLICED):
            for c0 in range(0, cnt, 8):  # the slices in order, per column
                cn = tl.minimum(cnt - c0, 8)
                for half in tl.static_range(2 if GROUPED else 1):
                    fr = _flat_row(perm_ptr, start + c0, cn, 2 * t + half, GROUPED)
                    ok = okr & (2 * t + half < cn)
                    tot = tl.zeros((NW * 32,), dtype=tl.float32)
                    tot8 = tl.zeros((NW * 32,), dtype=tl.float32)
                    for sl in range(SPLIT):
                        tot += tl.load(part_ptr + (sl * R + fr) * D + rg, mask=ok, other=0.0, cache_modifier=".cg")
                        tot8 += tl.load(part_ptr + (sl * R + fr) * D + rg + 8, mask=ok, other=0.0,
                                        cache_modifier=".cg")
                    _down_out(y_ptr, part_ptr, 0, R, D, fr, rg, tot, tot8, ok, True)


def mma_moe(x, flat_ids, wts, table_args, limit, topk, *, num_warps_down=None, bb=None, split_up=None,
            split_down=None, grouped=None, scale_words=None, vec_words=None, diag=None, l2_hint=None):
    """Steps 1-3 of the module docstring for x [T, d] (T <= MMA_MAX_T a program per routed row; any T
    grouped, an expert's rows 8 columns a pass): y [R, d] fp32 (each expert
    output rounded to bf16), for `moe_rows.rows_moe` to combine. Widths: `mma_fits`. split_up /
    split_down: K slices of the two kernels (default `MMA_SPLITS`); grouped: a program per expert
    with its rows as MMA columns (default from GROUPED_MIN_T tokens) instead of one per routed row;
    scale_words: a step's scale bytes in one int32 load per row where the layout allows it
    (`_cols_sums`' SW; default MMA_TILES["scale_words"]); vec_words: 16-byte weight loads and the
    quad transpose where the layout allows it (`_cols_sums`' VEC), a bool for both kernels or
    (gate/up, down) (default MMA_TILES["vec_words"]); diag: at a program per routed row, the
    block-diagonal B operand in place of the transpose where VEC's layout conditions hold
    (`_diag_sums`; default MMA_TILES["diag"]); l2_hint: DIAG's weight loads asking L2 for the
    256-byte block around them (a bool or (gate/up, down); default MMA_TILES["l2_hint"]; CUDA asm,
    off under the interpreter)."""
    from .launch import interpreting, tile_counters
    from .moe_grouped import sort_rows

    w_base, s_base, table, kind, inter, d, (s_up, s_down), align = table_args
    nwd = num_warps_down or MMA_TILES["num_warps_down"]
    bb = bb or MMA_TILES["bb"]
    sw = MMA_TILES["scale_words"] if scale_words is None else bool(scale_words)
    vec = MMA_TILES["vec_words"] if vec_words is None else vec_words
    vec = (bool(vec), bool(vec)) if isinstance(vec, bool) else tuple(map(bool, vec))
    r = flat_ids.numel()
    t = r // topk
    grouped = t >= GROUPED_MIN_T if grouped is None else grouped
    if not mma_fits(inter, d, nwd) or (t > MMA_MAX_T and not grouped):
        raise ValueError(f"moe_experts rows path (mma): widths ({inter}, {d}) need {GROUP} | {inter} and "
                         f"{16 * nwd} | {d}, and at most {MMA_MAX_T} tokens a program per routed row (got {t})")
    interp = interpreting()
    n_exp = table.numel() // 6
    if grouped:
        perm, bounds = sort_rows(flat_ids, n_exp)
        n0 = n_exp
    else:
        perm = bounds = flat_ids  # (unused)
        n0 = r
    # K slices of whole loop steps (so the split actually used can be smaller than asked)
    t_split = MMA_SPLITS.get(t, (1, 1))
    bps_up = bb * triton.cdiv(triton.cdiv(d // 32, bb), split_up or t_split[0])
    su = triton.cdiv(d // 32, bps_up)
    bps_down = bb * triton.cdiv(triton.cdiv(inter // 32, bb), split_down or t_split[1])
    sd = triton.cdiv(inter // 32, bps_down)
    n_up, n_down = inter // GROUP, d // (16 * nwd)
    counts = tile_counters(x.device, n0 * max(n_up, n_down)) if max(su, sd) > 1 else flat_ids
    xq, xf = x_codes(x, perm=True)
    part = moe_rows._buffer((su, r, 2, inter), torch.float32, x.device)
    hq = moe_rows._buffer((r, inter), torch.float16, x.device)
    hf = moe_rows._buffer((r, inter // 32), torch.float32, x.device)
    y = moe_rows._buffer((r, d), torch.float32, x.device)
    part_y = moe_rows._buffer((sd, r, d), torch.float32, x.device) if sd > 1 else y
    # scale words: 4-block steps, every row's and slice's first scale byte 4-aligned (the table's
    # offsets 16-aligned, rows and slices of whole steps)
    sw_up = sw and bb == 4 and align >= 4 and s_up % 4 == 0 and (d // 32) % 4 == 0
    sw_down = sw and bb == 4 and align >= 4 and s_down % 4 == 0 and (inter // 32) % 4 == 0
    # 16-byte word loads: scale words' conditions (4-block steps, rows and slices of whole steps)
    # and the matrices 16-byte aligned (table offsets)
    vec_up = vec[0] and sw_up and align >= 16
    vec_down = vec[1] and sw_down and align >= 16
    diag = (MMA_TILES["diag"] if diag is None else diag) and not grouped
    diag_up = diag and sw_up and align >= 16
    diag_down = diag and sw_down and align >= 16
    l2h = MMA_TILES["l2_hint"] if l2_hint is None else l2_hint
    l2h = (bool(l2h), bool(l2h)) if isinstance(l2h, (bool, int)) else tuple(map(bool, l2h))
    if len(l2h) != 2:
        raise ValueError(f"moe_experts rows path (mma): l2_hint is a bool or a (gate/up, down) pair, got {l2_hint!r}")
    l2h = (False, False) if interp else l2h
    kw = {} if interp else {"num_warps": 4}
    _mma_up_kernel[(n0, n_up, su)](xq.view(torch.int32), xf, flat_ids, perm, bounds, wts, w_base, s_base, table, part,
                                   counts, hq, hf, d, inter, r, s_up, bps_up, float(limit), TOPK=topk, ALIGN=align,
                                   BB=bb, SPLIT=su, SLICED=su > 1, GROUPED=grouped, ASM=not interp, SW=sw_up, VEC=vec_up,
                                   DIAG=diag_up, L2=l2h[0], **kw, **pdl_launch(xf))
    kw = {} if interp else {"num_warps": nwd}
    _mma_down_kernel[(n0, n_down, sd)](hq.view(torch.int32), hf, flat_ids, perm, bounds, w_base, s_base, table, part_y,
                                       counts, y, inter, d, r, s_down, bps_down, ALIGN=align, NW=nwd, BB=bb, SPLIT=sd,
                                       SLICED=sd > 1, GROUPED=grouped, ASM=not interp, SW=sw_down, VEC=vec_down,
                                       DIAG=diag_down, L2=l2h[1], **kw, **pdl_launch(hf))
    return y
