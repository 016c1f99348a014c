"""FP8 linears at 1..8 activation rows on the tensor cores, fed from registers: each lane's
weight words go through the hardware E4M3 -> f16x2 conversion straight into `mma.sync`
m16n8k16 (f16 operands, fp32 accumulation), with no trip through shared memory and no layout
conversion (the `linear` FP8 decode path "rowmma", `DSV41_FP8_DECODE=rowmma`).

Why: the one-row kernels that stream weights on the CUDA cores (`block_linear._row_gemv_kernel`,
`moe_rows`) spend about one fp16 -> fp32 widening and one FMA per weight and reach about 9.3
weights per SM clock (58% of the H200's copy bandwidth for FP8 at best, far less for small
matrices); the tiled tensor-core kernels convert each weight tile through shared memory. Here a
weight costs half a conversion instruction and 1/16 of an MMA; the MMA does the multiply-adds.

Work split (module constants / launcher): a program of NW warps owns 16 * NW consecutive output
rows (features); warp w owns rows 16w .. 16w + 15 of them, which lie in one 32-row scale block.
Lane l = 4g + t (g = l // 4, t = l % 4) loads, per 32-wide K block bl, the 8 codes 8t .. 8t + 7
of the block for rows g and g + 8 (two int32 words each) and x's f16 codes 8t .. 8t + 7 of
activation row (token) min(g, M - 1). In the m16n8k16 fragment layout that makes the lane's
A registers rows g / g + 8 at K slots 2t, 2t + 1, 2t + 8, 2t + 9 and its B registers column g at
the same slots; two MMAs cover the block's 32 columns (K is permuted inside the block
identically for A and B, so the dot is unchanged). Column j of the result is token min(j, M - 1),
so every token up to 8 shares one read of the weight. Lane (g, t) receives D[g, 2t], D[g, 2t + 1],
D[g + 8, 2t], D[g + 8, 2t + 1]: the block's exact sums for its rows and tokens 2t, 2t + 1, which
it multiplies by the block's factor (x's FP8 block scale times the weight's E8M0 block scale,
both powers of two) into its fp32 accumulators. K is cut into SPLIT_K slices when there are too
few row tiles to fill the device; the slice partials are added in slice order by the program
that completes a tile (the counters of `launch.tile_counters`; deterministic).

One token (DIAG, `_diag_step`; K in whole 4-block steps): the MMA's 7 other columns would repeat
the token, so they separate K blocks instead: lane (g, t) loads block b0 + t of its two rows whole
(two 16-byte loads each) and the B operand is block diagonal (column n holds block b0 + n's x
codes in lane (n, n), zero elsewhere); column n of D then sums block b0 + n alone, a step's 8 MMAs
chain in the tensor core's accumulator, and each lane scales its two columns once a step; the
quads total their rows at the end. sm_90a loop: 104 instructions a 4-block step against 172
(32 of them the E4M3 conversions). H200, one row in the mini decode step: wo_b 5120x8192 15.5 us
(+1.1 for the x-codes launch) against 20.0 on xscale, 25600x6144 46.7 against 50.5 on the
CUDA-core rows kernel; so `linear` takes it at one row from block_linear.ROWMMA_MIN_K.

Numerics: x is FP8-quantised per 32 columns (`_x_codes_kernel`: the E4M3 values of
`fp8_qdq_groups` before their power-of-two scale, exact in f16; one launch per call), weights are
E4M3 (exact in f16), every product is exact in the MMA, the block sums are fp32 (tensor-core
accumulation), then scaled exactly and summed in fp32: the class of `scaled_block_step` (exact
products, fp32 sums), the reference's value up to the fp32 summation order.

Under TRITON_INTERPRET=1 (no inline PTX) the MMA is emulated on the same lane registers: D[r, j]
is the sum over the four lanes t of row r's fragment times column j's fragment, so the lane /
fragment bookkeeping is what the interpreter tests check. CUDA only (sm_80+ for the MMA, sm_89+
for the E4M3 conversion); not an Ascend path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_prefetch_launch, pdl_prefetch_rows_start, pdl_start
from .block_scaled import bf16_bits16, e4m3_byte, e8m0_value, fp8_exponent, fp8_round, pow2
from .launch import interpreting, num_workers, tile_counters

MAX_M = 8  # the MMA's n: tokens that share one read of the weight
# Launch settings: warps per program (16 rows each), K blocks per loop step, programs per SM; the
# K loop unrolled (`tl.range`'s loop_unroll_factor: several steps' loads in one basic block). H200
# 2026-12-02 (benchmarks/RESULTS.md, "Session seventeen"), one row, graph, unroll 1 / 4: wo_b
# 5120x8192 13.0 / 12.4 us, 25600x6144 47.9 / 47.2, 32768x1280 11.8 / 11.2; outputs bit-equal.
# l2_hint (`lane_words`, the diag step's weight loads), H200 2026-12-04 ~16:45 UTC, one row, graph us,
# two alternated passes: Engram's wkv 25600x6144 46.5 / 46.4 -> 45.2 / 44.9; wo_b 5120x8192 12.7 /
# 12.6 -> 12.4 / 12.9; bit-equal outputs (an L2 prefetch 256 bytes ahead instead, not kept: 59.4 /
# 59.3 and 12.8 / 14.5). The mini decode step at batch 1 (graph, 4K, off / on alternated, 16:47):
# 1.675 / 1.666 -> 1.671 / 1.660 ms.
TILES = {"num_warps": 4, "bb": 4, "waves": 4, "diag": True, "unroll": 4, "l2_hint": True}
X_BLOCKS = 16  # 32-wide blocks of x per program of `_x_codes_kernel`

# Per lane: $4 / $5 the words of row g (codes 8t .. 8t + 3, 8t + 4 .. 8t + 7 of the block), $6 / $7
# those of row g + 8, $8 .. $11 x's f16 pairs (8t, 8t + 1) .. (8t + 6, 8t + 7) of column g's token.
# cvt.rn.f16x2.e4m3x2 puts the low byte in the low half: a0 = row g codes (8t, 8t + 1), etc. The
# first MMA takes K slots 2t, 2t + 1 <- elements 8t, 8t + 1 and slots 2t + 8, 2t + 9 <- 8t + 2,
# 8t + 3; the second the elements 8t + 4 .. 8t + 7 in the same way.
_MMA_BODY = """
.reg .b16 l, h;
.reg .b32 a0, a1, a2, a3, b0, b1, b2, b3;
mov.b32 {l, h}, $4; cvt.rn.f16x2.e4m3x2 a0, l; cvt.rn.f16x2.e4m3x2 a1, h;
mov.b32 {l, h}, $5; cvt.rn.f16x2.e4m3x2 a2, l; cvt.rn.f16x2.e4m3x2 a3, h;
mov.b32 {l, h}, $6; cvt.rn.f16x2.e4m3x2 b0, l; cvt.rn.f16x2.e4m3x2 b1, h;
mov.b32 {l, h}, $7; cvt.rn.f16x2.e4m3x2 b2, l; cvt.rn.f16x2.e4m3x2 b3, h;
mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0, d1, d2, d3}, {a0, b0, a1, b1}, {$8, $9}, {d0, d1, d2, d3};
mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0, d1, d2, d3}, {a2, b2, a3, b3}, {$10, $11}, {d0, d1, d2, d3};
mov.b32 $0, d0; mov.b32 $1, d1; mov.b32 $2, d2; mov.b32 $3, d3;
}"""


def mma_asm(body: str, d_in: int | None = None) -> tl.constexpr:
    """An inline-PTX block for `tl.inline_asm_elementwise`: the accumulator registers d0 .. d3
    zeroed (d_in None) or taken from operands $d_in .. $d_in + 3 (a chain of MMAs across calls),
    then `body` (its MMAs into d0 .. d3, the outputs $0 .. $3, the closing brace)."""
    start = ("mov.f32 d0, 0f00000000; mov.f32 d1, 0f00000000; mov.f32 d2, 0f00000000; mov.f32 d3, 0f00000000;"
             if d_in is None else " ".join(f"mov.b32 d{i}, ${d_in + i};" for i in range(4)))
    return tl.constexpr("{\n.reg .f32 d0, d1, d2, d3;\n" + start + body)


_MMA_ASM = mma_asm(_MMA_BODY)
_MMAC_ASM = mma_asm(_MMA_BODY, 12)  # the same onto D given in $12 .. $15 (`_diag_step`'s chain)


@triton.jit
def _x_codes_kernel(x_ptr, xq_ptr, xf_ptr, K, x_stride, NBB: tl.constexpr, PERM: tl.constexpr, PDL: tl.constexpr = 0):
    """x [M, K] -> its FP8 codes' values as f16 xq [M, K] and the power-of-two block scales xf
    [M, K / 32] (fp32): qdq(x) = xq * xf per 32 columns, the values of `fp8_qdq_groups`. PERM:
    each group of 8 columns stored in the order 0, 2, 4, 6, 1, 3, 5, 7 (`moe_rows_mma`)."""
    pdl_start(PDL)
    m = tl.program_id(0)
    b = tl.program_id(1) * NBB + tl.arange(0, NBB)
    j = tl.arange(0, 32)
    kk = b[:, None] * 32 + j[None, :]
    ok = kk < K
    x = tl.load(x_ptr + m * x_stride + kk, mask=ok, other=0.0).to(tl.float32)
    e = fp8_exponent(tl.max(tl.abs(x), axis=1))
    if PERM:
        kk = b[:, None] * 32 + ((j // 8) * 8 + (j % 8) // 2 + 4 * (j % 2))[None, :]
    tl.store(xq_ptr + m * K + kk, fp8_round(x * pow2(-e)[:, None]).to(tl.float16), mask=ok)
    tl.store(xf_ptr + m * (K // 32) + b, pow2(e), mask=b * 32 < K)


@triton.jit
def _f16_half(xw, hi: tl.constexpr):
    """The low (hi=False) or high f16 of int32 words as fp32."""
    v = (xw >> 16) if hi else xw
    return (v & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _x_column(x0, x1, x2, x3, p: tl.constexpr, NW: tl.constexpr):
    """Element p (0..7) of the lanes' four f16-pair registers as fp32, shaped [NW, 1, 8, 4]
    (warp, -, the column g it feeds, t): the B operand of the emulated MMA."""
    if p // 2 == 0:
        xw = x0
    elif p // 2 == 1:
        xw = x1
    elif p // 2 == 2:
        xw = x2
    else:
        xw = x3
    return tl.reshape(_f16_half(xw, (p % 2) == 1), (NW, 1, 8, 4))


@triton.jit
def _pick(d, NW: tl.constexpr, ODD: tl.constexpr):
    """Lane (g, t)'s entry D[g, 2t + ODD] of d [NW, 8 rows, 8 columns], as a [NW * 32] lane tensor."""
    j = tl.arange(0, 8)[None, None, :, None]
    t2 = 2 * tl.arange(0, 4)[None, None, None, :] + ODD
    return tl.reshape(tl.sum(tl.where(j == t2, d[:, :, :, None], 0.0), axis=2), (NW * 32,))


@triton.jit
def _pick4(a, b, c, d, i: tl.constexpr):
    """a, b, c or d by the compile-time index i."""
    if i == 0:
        return a
    elif i == 1:
        return b
    elif i == 2:
        return c
    else:
        return d


@triton.jit
def _cols4(v, NW: tl.constexpr):
    """The 4 columns of a lane tensor v [NW * 32, 4]."""
    a, b = tl.split(tl.reshape(v, (NW * 32, 2, 2)))
    v0, v2 = tl.split(a)
    v1, v3 = tl.split(b)
    return v0, v1, v2, v3


@triton.jit
def _quad_total(v, NW: tl.constexpr):
    """Every lane of a quad gets the sum of the quad's 4 values of v [NW * 32]."""
    tot = tl.sum(tl.reshape(v, (NW * 8, 4)), axis=1)
    return tl.reshape(tl.broadcast_to(tot[:, None], (NW * 8, 4)), (NW * 32,))


@triton.jit
def _diag_factors(acc0, acc1, acc2, acc3, d0, d1, d2, d3, fa, sgw, s8w, t):
    """The block-diagonal step's sums into the accumulators: lane (g, t) holds D's columns 2u,
    2u + 1 (u = t & 1; the columns of lanes t >= 2 are zero), blocks b0 + 2u and b0 + 2u + 1 of
    the step, times x's block scale (fa: the step's 4) and the rows' E8M0 scale bytes (sgw / s8w:
    the step's 4 of row g / g + 8, one int32 each)."""
    odd = (t & 1) == 1
    sh = 16 * (t & 1)  # (u keeps the shifts in range)
    f0 = tl.where(odd, fa[2], fa[0])
    f1 = tl.where(odd, fa[3], fa[1])
    acc0 += d0 * (f0 * e8m0_value((sgw >> sh) & 255))
    acc1 += d1 * (f1 * e8m0_value((sgw >> (sh + 8)) & 255))
    acc2 += d2 * (f0 * e8m0_value((s8w >> sh) & 255))
    acc3 += d3 * (f1 * e8m0_value((s8w >> (sh + 8)) & 255))
    return acc0, acc1, acc2, acc3


# A lane's 16 weight bytes with an L2 prefetch of the 256-byte block around them (the next steps
# of its row slice then wait on L2, not DRAM); masked lanes get zeros.
_LD_L2_256B_ASM = tl.constexpr("""{
.reg .pred p;
setp.ne.b32 p, $5, 0;
mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;
@p ld.global.L2::256B.v4.b32 {$0, $1, $2, $3}, [$4];
}""")


@triton.jit
def lane_words(p, ok, L2: tl.constexpr, NW: tl.constexpr):
    """The 4 int32 words at p (16-byte aligned) per lane, zeros where not ok; L2: the load asks
    L2 for the 256-byte block around them (`_LD_L2_256B_ASM`; PTX, CUDA only)."""
    if L2:
        w0, w1, w2, w3 = tl.inline_asm_elementwise(
            _LD_L2_256B_ASM, "=r,=r,=r,=r,l,r", [p, ok.to(tl.int32)],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
        return w0, w1, w2, w3
    else:
        four = tl.arange(0, 4)
        w = _cols4(tl.load(p[:, None] + four[None, :], mask=ok[:, None], other=0), NW)
        return w[0], w[1], w[2], w[3]


@triton.jit
def _diag_step(acc0, acc1, acc2, acc3, wg_row, w8_row, okg, ok8, xq_ptr, xf_ptr, s_row, b0, g, t,
               NW: tl.constexpr, ASM: tl.constexpr, L2: tl.constexpr = False):
    """DIAG (one token): blocks b0 .. b0 + 3 of rows g / g + 8 with the MMA's unused columns
    separating the blocks. Lane (g, t) loads block b0 + t of both rows whole (32 bytes each) and
    the B operand is block diagonal: column n holds x's codes of block b0 + n at the K slots of
    lane t = n (lane (n, n) loads them, every other lane's B is zero), so column n of D sums lane
    n's products only, and the step's 8 MMAs chain in the tensor core's fp32 accumulator: D[r, n]
    = block b0 + n's 32-product sum of row r. Rows g and g + 8 share one 32-row scale block.
    L2: the weight loads' L2 hint (`lane_words`)."""
    four = tl.arange(0, 4)
    pg = tl.multiple_of(wg_row + 8 * (b0 + t), 16)
    p8 = tl.multiple_of(w8_row + 8 * (b0 + t), 16)
    # words 0-3 and 4-7 of each row's block as two 16-byte loads (one [lanes, 8] load would be
    # split through shared memory)
    ga = lane_words(pg, okg, L2, NW)
    gb = lane_words(pg + 4, okg, L2, NW)
    ea = lane_words(p8, ok8, L2, NW)
    eb = lane_words(p8 + 4, ok8, L2, NW)
    sw = tl.load(tl.multiple_of(s_row + b0, 4).to(tl.pointer_type(tl.int32)), mask=okg, other=0)
    fa = _cols4(tl.load(tl.multiple_of(xf_ptr + b0, 16) + (0 * t)[:, None] + four[None, :]), NW)
    xw = xq_ptr + 16 * (b0 + t)  # lane (n, n): block b0 + n's x codes, words 2j, 2j + 1 at 4j
    d0 = tl.zeros((NW * 32,), dtype=tl.float32)
    d1 = tl.zeros((NW * 32,), dtype=tl.float32)
    d2 = tl.zeros((NW * 32,), dtype=tl.float32)
    d3 = tl.zeros((NW * 32,), dtype=tl.float32)
    for j in tl.static_range(4):
        x0, x1, x2, x3 = _cols4(tl.load(xw[:, None] + 4 * j + four[None, :], mask=(g == t)[:, None], other=0), NW)
        a0 = _pick4(ga[0], ga[2], gb[0], gb[2], j)  # words 2j, 2j + 1 of row g
        a1 = _pick4(ga[1], ga[3], gb[1], gb[3], j)
        b0w = _pick4(ea[0], ea[2], eb[0], eb[2], j)  # and of row g + 8
        b1w = _pick4(ea[1], ea[3], eb[1], eb[3], j)
        if ASM:
            d0, d1, d2, d3 = tl.inline_asm_elementwise(
                _MMAC_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r", [a0, a1, b0w, b1w, x0, x1, x2, x3, d0, d1, d2, d3],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
        else:
            c0, c1, c2, c3 = _mma_emulated(a0, a1, b0w, b1w, x0, x1, x2, x3, NW)
            d0 += c0
            d1 += c1
            d2 += c2
            d3 += c3
    return _diag_factors(acc0, acc1, acc2, acc3, d0, d1, d2, d3, fa, sw, sw, t)


@triton.jit
def _mma_emulated(wg0, wg1, w80, w81, x0, x1, x2, x3, NW: tl.constexpr):
    """What `_MMA_ASM` returns, from the same lane registers: D[r, j] = sum over the lanes t of
    row r's 8 values times column j's 8 values; lane (g, t) gets D[g, 2t], D[g, 2t + 1],
    D[g + 8, 2t], D[g + 8, 2t + 1]."""
    dg = tl.zeros((NW, 8, 8), dtype=tl.float32)  # [w, row g, column j]
    d8 = tl.zeros((NW, 8, 8), dtype=tl.float32)
    for i in tl.static_range(8):
        if i < 4:
            ag = e4m3_byte(wg0, i)
            a8 = e4m3_byte(w80, i)
        else:
            ag = e4m3_byte(wg1, i - 4)
            a8 = e4m3_byte(w81, i - 4)
        bx = _x_column(x0, x1, x2, x3, i, NW)
        dg += tl.sum(tl.reshape(ag, (NW, 8, 1, 4)) * bx, axis=3)
        d8 += tl.sum(tl.reshape(a8, (NW, 8, 1, 4)) * bx, axis=3)
    return _pick(dg, NW, 0), _pick(dg, NW, 1), _pick(d8, NW, 0), _pick(d8, NW, 1)


@triton.jit
def _finish_lanes(v, tok, row, ok, out_ptr, part_ptr, pid_k, M, N, SPLIT_K: tl.constexpr, SLICED: tl.constexpr,
                  OUT_BF16: tl.constexpr, FINISH: tl.constexpr):
    """One of a lane's four outputs (token tok, feature row): without FINISH it stores it (not
    SLICED) or its slice partial; FINISH (the tile's last slice) adds the partials in slice order
    and stores. (Boolean flags: tests/test_kernel_barriers.py follows them.)"""
    o = tok.to(tl.int64) * N + row
    if not FINISH:
        if not SLICED:
            if OUT_BF16:
                tl.store(out_ptr + o, bf16_bits16(v), mask=ok)
            else:
                tl.store(out_ptr + o, v, mask=ok)
        else:
            tl.store(part_ptr + pid_k * M * N + o, v, mask=ok)
    else:
        tot = tl.zeros(v.shape, dtype=tl.float32)
        for s in range(SPLIT_K):
            tot += tl.load(part_ptr + s * M * N + o, mask=ok, other=0.0, cache_modifier=".cg")
        if OUT_BF16:
            tl.store(out_ptr + o, bf16_bits16(tot), mask=ok)
        else:
            tl.store(out_ptr + o, tot, mask=ok)


@triton.jit
def _row_mma_kernel(xq_ptr, xf_ptr, w_ptr, s_ptr, out_ptr, part_ptr, count_ptr, M, N, K, s_stride, blocks_per_split,
                    pre_bytes,
                    SPLIT_K: tl.constexpr, SLICED: tl.constexpr, OUT_BF16: tl.constexpr, ONE: tl.constexpr,
                    NW: tl.constexpr,
                    BB: tl.constexpr, ASM: tl.constexpr, PANEL: tl.constexpr = False, DIAG: tl.constexpr = False,
                    UF: tl.constexpr = 1, L2: tl.constexpr = False, PDL: tl.constexpr = 0):
    """out [M, N] = x @ W^T for the program's 16 * NW rows and K slice program_id(1) (module
    docstring). xq: x's f16 codes as int32 pairs [M, K / 2]; xf [M, K / 32] their block scales;
    w: E4M3 codes as int32 words [N, K / 4]; s: E8M0 [ceil(N / 32), s_stride]. ONE: M == 1.
    DIAG (ONE, BB == 4, 16-byte rows and slices of whole steps): `_diag_step`, the row sums
    totalled across each quad at the end (L2: its weight loads' L2 hint, `lane_words`). UF:
    the K loop's unroll factor. The program's first `pre_bytes` weight bytes are asked of the
    L2 before the wait (row-major weights; the launcher passes 0 for PANEL)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pre_rows = pid_n * (16 * NW) + tl.arange(0, 16 * NW)
    pre_lo = pid_k * blocks_per_split * 32
    pdl_prefetch_rows_start(PDL, w_ptr, pre_rows.to(tl.int64), pre_rows < N, K, pre_lo,
                            tl.minimum(K, pre_lo + blocks_per_split * 32), pre_bytes, 16 * NW)
    lane = tl.arange(0, NW * 32)
    warp = lane // 32
    g = (lane % 32) // 4
    t = lane % 4
    base = pid_n * (16 * NW) + 16 * warp
    rg = base + g
    r8 = rg + 8
    okg = rg < N
    ok8 = r8 < N
    KW = K // 4
    NBK = K // 32
    if PANEL:  # [N / 16, K / 32, 16, 32] bytes: a warp's block is one run of 512 bytes
        wg_ptr = w_ptr + (base // 16).to(tl.int64) * (NBK * 128) + 8 * g + 2 * t
        w8_ptr = wg_ptr + 64
    else:
        wg_ptr = w_ptr + rg.to(tl.int64) * KW + 2 * t
        w8_ptr = w_ptr + r8.to(tl.int64) * KW + 2 * t
    WSTEP: tl.constexpr = 128 if PANEL else 8  # words from one 32-wide block of a row to the next
    s_row = s_ptr + (base // 32).to(tl.int64) * s_stride
    xtok = tl.minimum(g, M - 1)  # column g's token
    x_row = xq_ptr + xtok.to(tl.int64) * (K // 2) + 4 * t
    ta = tl.minimum(2 * t, M - 1)  # the tokens of the lane's result columns 2t, 2t + 1
    tb = tl.minimum(2 * t + 1, M - 1)
    two = tl.arange(0, 2)
    four = tl.arange(0, 4)
    acc0 = tl.zeros((NW * 32,), dtype=tl.float32)
    acc1 = tl.zeros((NW * 32,), dtype=tl.float32)
    acc2 = tl.zeros((NW * 32,), dtype=tl.float32)
    acc3 = tl.zeros((NW * 32,), dtype=tl.float32)
    b_lo = pid_k * blocks_per_split
    b_hi = tl.minimum(NBK, b_lo + blocks_per_split)
    for b0 in tl.range(b_lo, b_hi, BB, loop_unroll_factor=UF):
        if DIAG:
            acc0, acc1, acc2, acc3 = _diag_step(acc0, acc1, acc2, acc3, wg_ptr - 2 * t, w8_ptr - 2 * t, okg, ok8, xq_ptr,
                                                xf_ptr, s_row, b0, g, t, NW, ASM, L2)
        else:
            for i in tl.static_range(BB):
                bl = b0 + i
                bok = bl < b_hi
                # one 8-byte load per row and one 16-byte load of x per lane (each lane's words are
                # contiguous: [lanes, 2] / [lanes, 4] tiles, split back into one register per lane)
                wg0, wg1 = tl.split(tl.load(wg_ptr[:, None] + WSTEP * bl + two[None, :], mask=(okg & bok)[:, None], other=0))
                w80, w81 = tl.split(tl.load(w8_ptr[:, None] + WSTEP * bl + two[None, :], mask=(ok8 & bok)[:, None], other=0))
                xa, xb = tl.split(tl.reshape(tl.load(x_row[:, None] + 16 * bl + four[None, :], mask=bok, other=0),
                                             (NW * 32, 2, 2)))
                x0, x2 = tl.split(xa)
                x1, x3 = tl.split(xb)
                sw = e8m0_value(tl.load(s_row + bl, mask=bok, other=0).to(tl.int32))
                fa = tl.load(xf_ptr + ta * NBK + bl, mask=bok, other=0.0) * sw
                if ASM:
                    c0, c1, c2, c3 = tl.inline_asm_elementwise(
                        _MMA_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [wg0, wg1, w80, w81, x0, x1, x2, x3],
                        dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
                else:
                    c0, c1, c2, c3 = _mma_emulated(wg0, wg1, w80, w81, x0, x1, x2, x3, NW)
                acc0 += c0 * fa
                acc2 += c2 * fa
                if not ONE:
                    fb = tl.load(xf_ptr + tb * NBK + bl, mask=bok, other=0.0) * sw
                    acc1 += c1 * fb
                    acc3 += c3 * fb
    if DIAG:  # a row's blocks are spread over its quad's columns: each lane gets the row's total
        acc0 = _quad_total(acc0 + acc1, NW)
        acc2 = _quad_total(acc2 + acc3, NW)
    # lane (g, t) holds tokens 2t, 2t + 1 of rows g, g + 8; with one token only t = 0 stores
    va = (2 * t) < M
    vb = (2 * t + 1) < M
    _finish_lanes(acc0, ta, rg, okg & va, out_ptr, part_ptr, pid_k, M, N, SPLIT_K, SLICED, OUT_BF16, False)
    _finish_lanes(acc2, ta, r8, ok8 & va, out_ptr, part_ptr, pid_k, M, N, SPLIT_K, SLICED, OUT_BF16, False)
    if not ONE:
        _finish_lanes(acc1, tb, rg, okg & vb, out_ptr, part_ptr, pid_k, M, N, SPLIT_K, SLICED, OUT_BF16, False)
        _finish_lanes(acc3, tb, r8, ok8 & vb, out_ptr, part_ptr, pid_k, M, N, SPLIT_K, SLICED, OUT_BF16, False)
    if SLICED:
        tl.debug_barrier()  # every lane's partial is stored before the counter moves
        done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLIT_K - 1:  # the tile's last slice: add the partials in slice order
            _finish_lanes(acc0, ta, rg, okg & va, out_ptr, part_ptr, pid_k, M, N, SPLIT_K, SLICED, OUT_BF16, True)
            _finish_lanes(acc2, ta, r8, ok8 & va, out_ptr, part_ptr, pid_k, M, N, SPLIT_K, SLICED, OUT_BF16, True)
            if not ONE:
                _finish_lanes(acc1, tb, rg, okg & vb, out_ptr, part_ptr, pid_k, M, N, SPLIT_K, SLICED, OUT_BF16, True)
                _finish_lanes(acc3, tb, r8, ok8 & vb, out_ptr, part_ptr, pid_k, M, N, SPLIT_K, SLICED, OUT_BF16, True)
            tl.atomic_xchg(count_ptr + pid_n, 0)


def x_codes(x2: torch.Tensor, perm: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [M, K] (K % 32 == 0) -> (f16 codes [M, K], fp32 block scales [M, K / 32]); `perm`: the
    columns of each 8 in `moe_rows_mma`'s order."""
    m, k = x2.shape
    xq = torch.empty(m, k, dtype=torch.float16, device=x2.device)
    xf = torch.empty(m, k // 32, dtype=torch.float32, device=x2.device)
    _x_codes_kernel[(m, triton.cdiv(k // 32, X_BLOCKS))](x2, xq, xf, k, x2.stride(0), NBB=X_BLOCKS, PERM=perm, **pdl_launch(x2))
    return xq, xf


def launch_row_mma(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, *,
                   num_warps: int | None = None, bb: int | None = None, waves: int | None = None,
                   split_k: int | None = None, panel: bool = False, diag: bool | None = None,
                   unroll: int | None = None, l2_hint: bool | None = None) -> None:
    """out [M, N] (bf16 or fp32) = x2 [M, K] @ dequant(weight)^T for FP8 E4M3 weight [N, K] with
    E8M0 32x32 block scales, M <= MAX_M, K % 32 == 0 (module docstring). diag: one token's
    block-diagonal operand (`_diag_step`; default TILES["diag"] where its layout holds); unroll: the
    K loop's unroll factor (default TILES["unroll"]; 1 under the interpreter); l2_hint: the diag
    step's weight loads asking L2 for the 256-byte block around them (`lane_words`; default
    TILES["l2_hint"]; off under the interpreter)."""
    m, k = x2.shape
    n = weight.shape[0]
    if m > MAX_M or k % 32 or weight.shape[1] != k or not weight.is_contiguous():
        raise ValueError(f"rowmma path: x [{m}, {k}] and weight {tuple(weight.shape)} need M <= {MAX_M}, "
                         f"K % 32 == 0 and a contiguous [N, K] weight")
    nw = num_warps or TILES["num_warps"]
    bb = bb or TILES["bb"]
    interp = interpreting()
    xq, xf = x_codes(x2)
    n_tiles = triton.cdiv(n, 16 * nw)
    nbk = k // 32
    if split_k is None:
        want = (waves or TILES["waves"]) * (1 if interp else num_workers(x2.device))
        split_k = max(1, min(triton.cdiv(nbk, bb), triton.cdiv(want, n_tiles)))
    per = bb * triton.cdiv(triton.cdiv(nbk, bb), split_k)  # whole loop steps per slice
    split_k = triton.cdiv(nbk, per)
    # the block-diagonal step: one token, 4-block steps over 16-byte rows, a row's 4 scale bytes
    # of a step one aligned int32
    diag = (TILES["diag"] if diag is None else diag) and m == 1 and bb == 4 and nbk % 4 == 0 and not panel \
        and weight.data_ptr() % 16 == 0 and scale.shape[1] % 4 == 0 and scale.data_ptr() % 4 == 0
    if split_k > 1:
        part = torch.empty(split_k, m, n, dtype=torch.float32, device=x2.device)
        counts = tile_counters(x2.device, n_tiles)
    else:
        part = counts = out
    out_arg = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    kw = {} if interp else {"num_warps": nw}
    uf = 1 if interp else int(unroll or TILES["unroll"])
    l2h = not interp and bool(TILES["l2_hint"] if l2_hint is None else l2_hint)
    pdl_kw, pre = pdl_prefetch_launch(xf, n_tiles * split_k,
                                      aligned=k % 16 == 0 and weight.data_ptr() % 16 == 0 and not panel)
    _row_mma_kernel[(n_tiles, split_k)](
        xq.view(torch.int32), xf, weight.view(torch.int32), scale.view(torch.uint8), out_arg, part, counts, m, n, k,
        scale.shape[1], per, pre, SPLIT_K=split_k, SLICED=split_k > 1, OUT_BF16=out.dtype == torch.bfloat16,
        ONE=m == 1, NW=nw, BB=bb, ASM=not interp, PANEL=panel, DIAG=diag, UF=uf, L2=l2h, **kw, **pdl_kw)


def panel_weight(weight: torch.Tensor) -> torch.Tensor:
    """An FP8 weight [N, K] (N % 16 == 0) stored as 16-row panels [N / 16, K / 32, 16, 32] (the
    `panel=True` layout), returned with the original shape's byte count as [N, K]."""
    n, k = weight.shape
    return weight.view(n // 16, 16, k // 32, 32).permute(0, 2, 1, 3).contiguous().view(n, k)
