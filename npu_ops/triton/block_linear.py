"""The low-precision linear (op `linear`): y = x @ W^T with the weight dequantised inside the
kernel, for FP8 E4M3 weights with E8M0 32x32 block scales, packed FP4 weights with E8M0 scales
per 32 along K, and plain bf16 / fp32 weights. Matches `linear_ref` (= the reference op).

Numerics (MODEL.md, "Low-precision linears"), for scaled weights: x is FP8-quantised in groups of
32 (`fp8_quant`, one pass; bit-exact with the reference); then per 32-wide K block the fp32 partial
sum of the unscaled E4M3 x E4M3 (or E4M3 x E2M1) products, times both power-of-two scales, is
added to the fp32 accumulator (`block_scaled.scaled_block_step`). The products are exact (fp16
operands: E4M3 and E2M1 values are fp16-exact), so the result is the reference's value up to the
fp32 summation order; no fp64 anywhere. The weight goes from its load straight into the dot
(hardware E4M3 -> fp16; E2M1 by placing its bits into an fp16), never scaled element by element.
Output bf16 (rounded once, to nearest even), or fp32 for `out_dtype` float32 / float64 (the
device returns fp32 for the float64 request: row-parallel partial sums are added in fp32 on
devices). Plain bf16 weights (the head with fp32 logits) take bf16 dots of BK-wide steps.

For M >= CUBLAS_MIN_M with bf16 output the weight is dequantised to bf16 once (exact) and x
quantised through FP8 to bf16 (exact), and cuBLAS multiplies (fp32 accumulation): prefill is
matrix-bound, and cuBLAS's bf16 GEMM ran at twice this kernel's rate there.

FP8 weights at M <= FOLD_MAX_M (decode) take the fold kernels instead: the E8M0 scales are
powers of two and x's FP8 quantise-dequantise values are bf16-exact, so the weight tile with its
block scales multiplied in (or, for 32-row tiles, x's 32-wide K blocks times the weight scale)
is an exact bf16 operand, and one bf16 tensor-core dot with fp32 accumulation covers a whole
BK = 128 step (exact products, fp32 sums: the same class as above). `_fold_linear_kernel` puts
the weight on the dot's wide side (acc [BN, BM], M padded to 16; at M = 1 each program quantises
x's row itself); `_fold_tm_kernel` the tokens (acc [BM, BN], both operands from shared memory),
the default at 9..64 rows except for large weights that need a K split (`fold_tm_tiles`). By
default (DSV41_FP8_DECODE, below) one row at K < ROWS_MAX_K takes `_row_gemv_kernel` (whole
weight rows streamed on the CUDA cores, same numerics class) and 2-8 rows `_fold_xs_kernel`.
W8A8 weights (int8 [N, K], one fp32 scale per output channel) take `int8_linear` (exact int32
sums).

Work split: output tiles BM x BN; the K range is cut into SPLIT_K slices for small M (decode:
M = 1..64 is weight-read bound and needs every SM streaming weights). Each slice writes its fp32
partial; after a CTA barrier it bumps its tile's int32 counter (atomic, acq_rel); the program that
completes a tile adds the SPLIT_K partials in slice order (".cg" loads: from L2, never a stale L1)
and writes the output, then resets the counter (which stays zero between calls: one buffer per
device and stream, no memset per call). Deterministic: every partial is read in a fixed order.

Interpreter: bf16 / fp16 dots are unreliable there, so the dots run in fp32 ("ieee"), on the same
exact operand values. Compiled (CUDA): fp16 dots for the scaled kinds, bf16 dots for plain bf16
weights (an fp32 x split into three bf16 terms, hi + mid + lo, so the products stay exact).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends.fused import stacked_pair
from ...backends.reference import quant
from ...backends.reference.basic import linear as linear_ref  # noqa: F401  (the oracle)
from .pdl import pdl_launch, pdl_prefetch_launch, pdl_prefetch_range_start, pdl_prefetch_rows_start, pdl_start
from .block_scaled import (W_DENSE, W_FP4, W_FP8, bf16_bits16, e4m3_byte, e8m0_value, fp8_exponent, fp8_qdq_groups,
                           fp8_round, gemv_acc, gemv_load_w, load_weight_tile, pow2, scaled_block_step)
from .fp4_common import split_dot_acc
from . import row_mma
from .launch import tile_counters


@triton.jit
def _store_out(out_ptr, acc, rm, rn, M, N, OUT_BF16: tl.constexpr):
    offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if OUT_BF16:
        tl.store(out_ptr + offs, bf16_bits16(acc), mask=mask)
    else:
        tl.store(out_ptr + offs, acc, mask=mask)


@triton.jit
def tile_k_range(acc, x_ptr, q_ptr, qs_ptr, w_ptr, s_ptr, rm64, mmask, rn, nmask, k_lo, k_hi, N, K, s_stride,
                  W_KIND: tl.constexpr, A_TERMS: tl.constexpr, LOWP: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr):
    """acc [BM, BN] + rows `rm64` of x (or of its FP8 codes q / scales qs) times weight rows `rn`
    over K range [k_lo, k_hi), BK per step (also the tiled experts' down product)."""
    for k0 in range(k_lo, k_hi, BK):
        if W_KIND == 0:  # plain weight: x as it is, BK-wide dots
            kk = k0 + tl.arange(0, BK)
            a = tl.load(x_ptr + rm64[:, None] * K + kk[None, :], mask=mmask[:, None] & (kk[None, :] < k_hi),
                        other=0.0).to(tl.float32)
            w = load_weight_tile(w_ptr, s_ptr, rn, k0, N, K, s_stride, BN, BK, W_KIND)
            acc = split_dot_acc(acc, a, tl.trans(w), A_TERMS, LOWP)
        else:  # scaled weight: one dot per 32-wide scale block, rescaled into acc
            for kb in tl.static_range(BK // 32):
                acc = scaled_block_step(acc, q_ptr, qs_ptr, rm64, mmask, w_ptr, s_ptr, rn, nmask, k0 + kb * 32,
                                        k_hi, K, s_stride, W_KIND, LOWP)
    return acc


@triton.jit
def _block_linear_kernel(x_ptr, q_ptr, qs_ptr, w_ptr, s_ptr, out_ptr, part_ptr, count_ptr,
                         M, N, K, s_stride, k_per_split,
                         W_KIND: tl.constexpr, SPLIT_K: tl.constexpr, SERIAL: tl.constexpr,
                         A_TERMS: tl.constexpr, LOWP: tl.constexpr, OUT_BF16: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr = 0):
    """One [BM, BN] output tile over one K slice (grid (tiles, SPLIT_K): the slices' partials are
    added in slice order by `_finish_tile`), or with SERIAL over every K slice of k_per_split in
    turn, each summed from zero and added to the tile's total in slice order: the same fp32
    operations as the split launch, in one program (no partials, no counters)."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    # grouped order: GROUP_M row tiles share each weight tile while it is in L2
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mmask = rm < M
    nmask = rn < N
    rm64 = rm.to(tl.int64)
    if SERIAL:
        tot = tl.zeros((BM, BN), dtype=tl.float32)
        for s0 in range(0, K, k_per_split):
            part = tile_k_range(tl.zeros((BM, BN), dtype=tl.float32), x_ptr, q_ptr, qs_ptr, w_ptr, s_ptr, rm64,
                                 mmask, rn, nmask, s0, tl.minimum(K, s0 + k_per_split), N, K, s_stride, W_KIND,
                                 A_TERMS, LOWP, BN, BK)
            tot += part
        _store_out(out_ptr, tot, rm, rn, M, N, OUT_BF16)
    else:
        k_lo, k_hi = _k_slice(pid_k, k_per_split, K)
        acc = tile_k_range(tl.zeros((BM, BN), dtype=tl.float32), x_ptr, q_ptr, qs_ptr, w_ptr, s_ptr, rm64, mmask,
                            rn, nmask, k_lo, k_hi, N, K, s_stride, W_KIND, A_TERMS, LOWP, BN, BK)
        _finish_tile(acc, out_ptr, part_ptr, count_ptr, pid_m * n_n + pid_n, pid_k, rm, rn, M, N, SPLIT_K, OUT_BF16)


@triton.jit
def _finish_tile(acc, out_ptr, part_ptr, count_ptr, tile, pid_k, rm, rn, M, N, SPLIT_K: tl.constexpr,
                 OUT_BF16: tl.constexpr):
    """Store a [BM, BN] output tile, or (SPLIT_K > 1) its K slice's partial; the program that
    completes the tile adds the partials in slice order and stores the output."""
    if SPLIT_K == 1:
        _store_out(out_ptr, acc, rm, rn, M, N, OUT_BF16)
    else:
        rm64 = rm.to(tl.int64)
        po = (pid_k * M + rm64)[:, None] * N + rn[None, :]
        pmask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(part_ptr + po, acc, mask=pmask)
        tl.debug_barrier()  # every thread's partial is stored before the counter moves
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if done == SPLIT_K - 1:  # the last slice of this tile: reduce in slice order
            tot = tl.zeros(acc.shape, dtype=tl.float32)
            for s in range(SPLIT_K):
                so = (s * M + rm64)[:, None] * N + rn[None, :]
                tot += tl.load(part_ptr + so, mask=pmask, other=0.0, cache_modifier=".cg")
            _store_out(out_ptr, tot, rm, rn, M, N, OUT_BF16)
            tl.atomic_xchg(count_ptr + tile, 0)


@triton.jit
def _gemv_linear_kernel(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, count_ptr, M, N, K, x_stride, w_stride, s_stride,
                        k_per_split, W_KIND: tl.constexpr, SPLIT_K: tl.constexpr, OUT_BF16: tl.constexpr,
                        RB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr = 0):
    """The scaled linear for M <= GEMV_MAX_M rows (all in one program, RB >= M; x already holds
    its FP8 quantise-dequantise values): BN weight rows streamed once over a K slice, the next
    BK step's weight tile loaded before the current one is used (two tiles in flight)."""
    pdl_start(PDL)
    NB: tl.constexpr = BK // 32
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, RB)
    mmask = rm < M
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = rn < N
    acc = tl.zeros((RB, BN, NB), dtype=tl.float32)
    k_lo, k_hi = _k_slice(pid_k, k_per_split, K)
    w, s = gemv_load_w(w_ptr, w_stride, s_ptr, s_stride, rn, nmask, k_lo, k_hi, W_KIND, BN, NB)
    for k0 in range(k_lo, k_hi, BK):
        w_next, s_next = gemv_load_w(w_ptr, w_stride, s_ptr, s_stride, rn, nmask, k0 + BK, k_hi, W_KIND, BN, NB)
        acc = gemv_acc(acc, w, s, x_ptr, rm, mmask, x_stride, k0, k_hi, W_KIND, RB, NB, ASM)
        w, s = w_next, s_next
    _finish_tile(tl.sum(acc, axis=2), out_ptr, part_ptr, count_ptr, pid_n, pid_k, rm, rn, M, N, SPLIT_K, OUT_BF16)


@triton.jit
def _fold_dot(acc, a, b, LOWP: tl.constexpr):
    """acc + a @ b for exact bf16-representable fp32 operands: a bf16 tensor-core dot with fp32
    accumulation on devices, an fp32 "ieee" dot under the interpreter (same operand values)."""
    if LOWP:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _k_slice(pid_k, k_per_split, K):
    """The K range [k_lo, k_hi) of split-K slice pid_k."""
    k_lo = pid_k * k_per_split
    return k_lo, tl.minimum(K, k_lo + k_per_split)


@triton.jit
def _decode_tile_ids(M, N, BM: tl.constexpr, BN: tl.constexpr):
    """A decode program's place in its (N tiles, M tiles, K slices) grid: its ids, output columns
    and rows (int32 and int64) and their masks."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = pid_m * BM + tl.arange(0, BM)
    return pid_n, pid_m, pid_k, rn, rm, rn < N, rm < M, rn.to(tl.int64), rm.to(tl.int64)


@triton.jit
def _fold_scale_bytes(s_ptr, pid_n, rn64, nmask, k0, k_hi, s_stride, SCALE_X: tl.constexpr, BN: tl.constexpr,
                      NB: tl.constexpr):
    """`_fold_linear_kernel`'s E8M0 weight scale bytes of the BK step at k0 (zero past k_hi): the
    tile's one scale row-block [NB] with SCALE_X (BN == 32), else each weight row's [BN, NB]."""
    kb = k0 // 32 + tl.arange(0, NB)
    bmask = kb * 32 < k_hi
    if SCALE_X:
        return tl.load(s_ptr + (pid_n * (BN // 32)) * s_stride + kb, mask=bmask, other=0)
    else:
        return tl.load(s_ptr + (rn64 // 32)[:, None] * s_stride + kb[None, :], mask=nmask[:, None] & bmask[None, :],
                       other=0)


@triton.jit
def _fold_linear_kernel(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, count_ptr, M, N, K, x_stride, s_stride, k_per_split,
                        pre_bytes, SPLIT_K: tl.constexpr, OUT_BF16: tl.constexpr, QDQ_ROW: tl.constexpr,
                        SCALE_X: tl.constexpr, LOWP: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = 0):
    """The FP8 (E4M3, E8M0 per 32x32 block) linear at decode sizes on the tensor cores, the
    weight as the dot's wide side: acc [BN, BM] += W tile [BN, BK] @ x tile^T [BK, BM].

    The power-of-two block scales are folded into exact bf16 operands, so one dot covers BK
    (not one per 32-wide block): x holds its FP8 quantise-dequantise values (bf16-exact); with
    SCALE_X (BN == 32, one scale row-block per program) the weight scale of each 32-wide K block
    multiplies that block of x; else it multiplies the weight tile ([BN, BK/32, 32] view). Either
    way every product is exact and the sums are fp32 (the tiled kernel's numerics class).
    QDQ_ROW (M == 1, BM padded): x's single row is quantise-dequantised here (no separate pass).
    The tile's first `pre_bytes` weight bytes are asked of the L2 before the wait."""
    pid_n, pid_m, pid_k, rn, rm, nmask, mmask, rn64, rm64 = _decode_tile_ids(M, N, BM, BN)
    k_lo, k_hi = _k_slice(pid_k, k_per_split, K)
    pdl_prefetch_rows_start(PDL, w_ptr, rn64, nmask, K, k_lo, k_hi, pre_bytes, BN)
    NB: tl.constexpr = BK // 32
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    sb = _fold_scale_bytes(s_ptr, pid_n, rn64, nmask, k_lo, k_hi, s_stride, SCALE_X, BN, NB)
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < k_hi
        # the next step's scale bytes, a step ahead (1-byte loads: the compiler's pipeline does
        # not stage them, and loaded in their own step they stalled it on the round trip)
        sb_next = _fold_scale_bytes(s_ptr, pid_n, rn64, nmask, k0 + BK, k_hi, s_stride, SCALE_X, BN, NB)
        w = tl.load(w_ptr + rn64[:, None] * K + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        if QDQ_ROW:  # one activation row: quantise it here, place it in column 0 of the [BK, BM] operand
            xr = tl.load(x_ptr + kk[None, :], mask=kmask[None, :], other=0.0).to(tl.float32)
            xq = tl.trans(fp8_qdq_groups(xr, 1, BK))  # [BK, 1]
            xt = tl.where((tl.arange(0, BM) == 0)[None, :], xq, 0.0)
        else:
            xt = tl.load(x_ptr + rm64[None, :] * x_stride + kk[:, None], mask=kmask[:, None] & mmask[None, :],
                         other=0.0).to(tl.float32)
        if SCALE_X:
            xs = tl.reshape(tl.reshape(xt, (NB, 32, BM)) * e8m0_value(sb.to(tl.int32))[:, None, None], (BK, BM))
            if LOWP:
                acc = _fold_dot(acc, w.to(tl.bfloat16), xs, LOWP)
            else:
                acc = _fold_dot(acc, w.to(tl.float32), xs, LOWP)
        else:
            wf = tl.reshape(tl.reshape(w.to(tl.float32), (BN, NB, 32)) * e8m0_value(sb.to(tl.int32))[:, :, None],
                            (BN, BK))
            acc = _fold_dot(acc, wf, xt, LOWP)
        sb = sb_next
    _finish_tile(tl.trans(acc), out_ptr, part_ptr, count_ptr, pid_m * tl.num_programs(0) + pid_n, pid_k, rm, rn,
                 M, N, SPLIT_K, OUT_BF16)


@triton.jit
def _fold_tm_kernel(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, count_ptr, M, N, K, x_stride, s_stride, k_per_split,
                    pre_bytes, SPLIT_K: tl.constexpr, OUT_BF16: tl.constexpr, LOWP: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = 0):
    """The FP8 linear at 9..64 rows, token-major: acc [BM, BN] += x tile [BM, BK] @ W'^T [BK, BN],
    W' the weight tile with its power-of-two block scales multiplied in (exact bf16 operands and
    fp32 sums, as `_fold_linear_kernel`). With the tokens on the MMA's 64-row side both operands
    come from shared memory, so a K step's MMAs issue back to back and are waited on once (with
    the weight on the register side each MMA is waited on before the next conversion). The next
    step's scale bytes are loaded a step ahead: the compiler's pipeline takes the weight and x
    tiles but not the scales, whose load otherwise stalls every step. x holds its FP8
    quantise-dequantise values (bf16). The tile's first `pre_bytes` weight bytes are asked of the
    L2 before the wait."""
    pid_n, pid_m, pid_k, rn, rm, nmask, mmask, rn64, rm64 = _decode_tile_ids(M, N, BM, BN)
    k_lo, k_hi = _k_slice(pid_k, k_per_split, K)
    pdl_prefetch_rows_start(PDL, w_ptr, rn64, nmask, K, k_lo, k_hi, pre_bytes, BN)
    NB: tl.constexpr = BK // 32
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    s_rows = s_ptr + (rn64 // 32)[:, None] * s_stride
    kb = k_lo // 32 + tl.arange(0, NB)
    s = tl.load(s_rows + kb[None, :], mask=nmask[:, None] & (kb * 32 < k_hi)[None, :], other=0)
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < k_hi
        w = tl.load(w_ptr + rn64[:, None] * K + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        x = tl.load(x_ptr + rm64[:, None] * x_stride + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        kb_next = (k0 + BK) // 32 + tl.arange(0, NB)
        s_next = tl.load(s_rows + kb_next[None, :], mask=nmask[:, None] & (kb_next * 32 < k_hi)[None, :], other=0)
        wf = tl.reshape(tl.reshape(w.to(tl.float32), (BN, NB, 32)) * e8m0_value(s.to(tl.int32))[:, :, None], (BN, BK))
        acc = _fold_dot(acc, x.to(tl.float32), tl.trans(wf), LOWP)
        s = s_next
    _finish_tile(acc, out_ptr, part_ptr, count_ptr, pid_m * tl.num_programs(0) + pid_n, pid_k, rm, rn,
                 M, N, SPLIT_K, OUT_BF16)


# E4M3 bytes -> bf16 by bit placement, 4 bytes per 32-bit register (two bf16x2 results), on the
# integer ALUs instead of the conversion unit: each bf16 is the E4M3 value times 2^-120 (the
# 4 exponent and 3 mantissa bits land in bf16's low exponent and high mantissa bits; E4M3
# subnormals become bf16 subnormals of the same scaled value), exact for every finite code. The
# two NaN codes (0x7F / 0xFF) are caught bytewise (low 7 bits + 1 carries into bit 7 only for
# 0x7F) and get an all-ones exponent: bf16 NaN, as the hardware conversion gives. Per byte: low
# bf16 byte = (code & 0x0F) << 4, high byte = sign | (code >> 4 & 7) (| 0x78 for NaN); prmt
# interleaves them.
_E4M3_BF16_ASM = tl.constexpr("""
{
.reg .b32 m, n, u, sh, lo, hi;
and.b32 m, $2, 0x7F7F7F7F;
add.u32 n, m, 0x01010101;
and.b32 n, n, 0x80808080;
shr.b32 u, n, 4;
sub.u32 u, n, u;
shl.b32 lo, $2, 4;
and.b32 lo, lo, 0xF0F0F0F0;
shr.b32 sh, $2, 4;
and.b32 sh, sh, 0x07070707;
and.b32 hi, $2, 0x80808080;
or.b32 hi, hi, sh;
or.b32 hi, hi, u;
prmt.b32 $0, lo, hi, 0x5140;
prmt.b32 $1, lo, hi, 0x7362;
}
""")
# The power of two the placed weights carry (2^-120), split so that neither operand nor the
# accumulator leaves the normal range: x's operand takes 2^64, the finished sums 2^56.
PLACE_X_SCALE = tl.constexpr(2.0 ** 64)
PLACE_ACC_SCALE = tl.constexpr(2.0 ** 56)


@triton.jit
def e4m3_placed(w, ASM: tl.constexpr):
    """E4M3 codes (uint8 tensor) -> their values times 2^-120: bf16 from the packed PTX above
    (ASM, CUDA), else fp32 from the same bit pattern built with integer ops (the interpreter;
    fp32 holds the bf16 pattern exactly: bits << 16)."""
    if ASM:
        return tl.inline_asm_elementwise(_E4M3_BF16_ASM, "=r,=r,r", [w], dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        c = w.to(tl.int32)
        bits = ((c & 0x80) << 8) | ((c & 0x7F) << 4)
        bits = tl.where((c & 0x7F) == 0x7F, bits | 0x7FF0, bits)
        return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def _xs_scale_bytes(s_ptr, srow, sok, k0, k_hi, s_stride, NB: tl.constexpr):
    """`_fold_xs_kernel`'s E8M0 weight scale bytes of the BK step at k0 (zero past k_hi), laid out
    as its X' columns: [NB, BX], column c holding its scale row srow[c]."""
    kb = k0 // 32 + tl.arange(0, NB)
    return tl.load(s_ptr + srow[None, :] * s_stride + kb[:, None], mask=sok[None, :] & (kb[:, None] * 32 < k_hi),
                   other=0)


@triton.jit
def _fold_xs_kernel(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, count_ptr, M, N, K, x_stride, s_stride, k_per_split,
                    pre_bytes, SPLIT_K: tl.constexpr, OUT_BF16: tl.constexpr, QDQ_ROW: tl.constexpr,
                    PLACE: tl.constexpr,
                    LOWP: tl.constexpr, MP: tl.constexpr, BX: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = 0):
    """The FP8 linear for M <= MP rows (decode, batch 1..8) with the weight scales on x's side,
    so the weight goes from its load through one conversion into the dot (no per-element scale
    product): acc [BN, BX] += W tile [BN, BK] @ X' [BK, BX], where the G = BN / 32 scale rows of
    the tile each own MP columns of X': X'[k, g * MP + m] = x[m, k] * scale[g, k / 32] (exact
    bf16: FP8-dequantised x times a power of two), and row n of the output is read from its own
    scale row's columns at the end. PLACE: the weight by bit placement (`e4m3_placed`, times
    2^-120; X' carries 2^64 and the sums 2^56 back), else the hardware E4M3 -> bf16 conversion.
    Exact operands and fp32 sums, as `_fold_linear_kernel` (exact while |x| * scale < 2^63 with
    PLACE). QDQ_ROW (M == 1): x's row is FP8-quantised here (no separate pass). BX >= G * MP
    (at least 16, the dot's minimum width); unused columns are zero. The tile's first
    `pre_bytes` weight bytes are asked of the L2 before the wait."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = rn < N
    rn64 = rn.to(tl.int64)
    k_lo, k_hi = _k_slice(pid_k, k_per_split, K)
    pdl_prefetch_rows_start(PDL, w_ptr, rn64, nmask, K, k_lo, k_hi, pre_bytes, BN)
    NB: tl.constexpr = BK // 32
    G: tl.constexpr = BN // 32
    col = tl.arange(0, BX)
    grp = col // MP
    mcol = pid_m * MP + col % MP
    cok = (col < G * MP) & (mcol < M)
    srow = pid_n * G + grp
    sok = cok & (srow * 32 < N)
    acc = tl.zeros((BN, BX), dtype=tl.float32)
    sb = _xs_scale_bytes(s_ptr, srow, sok, k_lo, k_hi, s_stride, NB)
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < k_hi
        # the next step's scale bytes, a step ahead (as `_fold_linear_kernel`: 1-byte loads are
        # not staged by the compiler's pipeline, and in their own step they waited a round trip)
        sb_next = _xs_scale_bytes(s_ptr, srow, sok, k0 + BK, k_hi, s_stride, NB)
        woffs = w_ptr + rn64[:, None] * K + kk[None, :]
        if PLACE:  # uint8 codes (code 0 is +0)
            w = tl.load(woffs, mask=nmask[:, None] & kmask[None, :], other=0)
        else:
            w = tl.load(woffs, mask=nmask[:, None] & kmask[None, :], other=0.0)
        if QDQ_ROW:  # one activation row: quantise it here, repeat it in the G scale-row columns
            xr = tl.load(x_ptr + kk[None, :], mask=kmask[None, :], other=0.0).to(tl.float32)
            xq = tl.trans(fp8_qdq_groups(xr, 1, BK))  # [BK, 1]
            xt = tl.where(cok[None, :], xq, 0.0)
        else:
            xt = tl.load(x_ptr + mcol.to(tl.int64)[None, :] * x_stride + kk[:, None],
                         mask=kmask[:, None] & cok[None, :], other=0.0).to(tl.float32)
        sw = e8m0_value(sb.to(tl.int32))  # [NB, BX]
        if PLACE:
            sw = sw * PLACE_X_SCALE
        xs = tl.reshape(tl.reshape(xt, (NB, 32, BX)) * sw[:, None, :], (BK, BX))
        if PLACE:
            wb = e4m3_placed(w, LOWP)
        elif LOWP:  # through fp32: E4M3 -> f16x2 -> fp32 (FMA pipe) -> packed bf16, not Triton's direct
            wb = w.to(tl.float32).to(tl.bfloat16)  # cast, which adds a per-element F2F (conversion pipe)
        else:
            wb = w.to(tl.float32)
        acc = _fold_dot(acc, wb, xs, LOWP)
        sb = sb_next
    if PLACE:
        acc = acc * PLACE_ACC_SCALE
    # row n's sums sit in the MP columns of its scale row (n % BN) // 32
    acc4 = tl.reshape(acc, (G, 32, BX // MP, MP))
    gsel = tl.arange(0, BX // MP)[None, None, :, None] == tl.arange(0, G)[:, None, None, None]
    res = tl.reshape(tl.sum(tl.where(gsel, acc4, 0.0), axis=2), (BN, MP))
    rm = pid_m * MP + tl.arange(0, MP)
    _finish_tile(tl.trans(res), out_ptr, part_ptr, count_ptr, pid_m * tl.num_programs(0) + pid_n, pid_k, rm, rn,
                 M, N, SPLIT_K, OUT_BF16)


# E4M3 bytes -> fp32, one 32-bit word of 4 codes per call: two packed hardware conversions to
# f16x2 and four f16 -> f32 widenings (exact; the NaN codes give NaN). Output j is byte j.
_E4M3X4_F32_ASM = tl.constexpr("""
{
.reg .b16 lo, hi, a, b, c, d;
.reg .b32 h0, h1;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.e4m3x2 h0, lo;
cvt.rn.f16x2.e4m3x2 h1, hi;
mov.b32 {a, b}, h0;
mov.b32 {c, d}, h1;
cvt.f32.f16 $0, a;
cvt.f32.f16 $1, b;
cvt.f32.f16 $2, c;
cvt.f32.f16 $3, d;
}
""")


@triton.jit
def _e4m3x4_f32(wd, ASM: tl.constexpr):
    """int32 words of 4 E4M3 codes -> their 4 fp32 values (byte 0 first): the PTX above on
    devices (Triton's own byte-wise fp8 cast re-packs every byte, about 3 PRMT / LOP3 per weight
    in the sm_90a SASS), else byte extraction and the fp8 cast (the interpreter)."""
    if ASM:
        return tl.inline_asm_elementwise(_E4M3X4_F32_ASM, "=r,=r,=r,=r,r", [wd],
                                         dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True,
                                         pack=1)
    else:
        return e4m3_byte(wd, 0), e4m3_byte(wd, 1), e4m3_byte(wd, 2), e4m3_byte(wd, 3)


@triton.jit
def _row_words(w_ptr, rows, rok, c0, KW, BW: tl.constexpr):
    """The weight words (4 codes each) of `rows` [RS] x words c0 .. c0 + BW: one contiguous run per row."""
    cw = c0 + tl.arange(0, BW)
    return tl.load(w_ptr + rows.to(tl.int64)[:, None] * KW + cw[None, :], mask=rok[:, None] & (cw < KW)[None, :],
                   other=0)


@triton.jit
def _row_xs(x_ptr, sw_row_ptr, c0, BW: tl.constexpr):
    """x' over words c0 .. c0 + BW as 4 [1, BW] tensors (x'_j[c] = x'[4c + j]), x' = qdq(x) times
    the weight's block scale: each 32-wide group (8 words) quantised with its own exponent, as
    `fp8_qdq_groups`."""
    cw = c0 + tl.arange(0, BW)
    x0 = tl.load(x_ptr + 4 * cw[None, :]).to(tl.float32)
    x1 = tl.load(x_ptr + 4 * cw[None, :] + 1).to(tl.float32)
    x2 = tl.load(x_ptr + 4 * cw[None, :] + 2).to(tl.float32)
    x3 = tl.load(x_ptr + 4 * cw[None, :] + 3).to(tl.float32)
    amax = tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3)))
    e = fp8_exponent(tl.max(tl.reshape(amax, (1, BW // 8, 8)), axis=2))  # [1, BW / 8]
    inv = tl.reshape(tl.broadcast_to(pow2(-e)[:, :, None], (1, BW // 8, 8)), (1, BW))
    sw = e8m0_value(tl.load(sw_row_ptr + cw // 8).to(tl.int32))[None, :]
    back = tl.reshape(tl.broadcast_to(pow2(e)[:, :, None], (1, BW // 8, 8)), (1, BW)) * sw
    return (fp8_round(x0 * inv) * back, fp8_round(x1 * inv) * back, fp8_round(x2 * inv) * back,
            fp8_round(x3 * inv) * back)


@triton.jit
def _row_dot(wd, xs0, xs1, xs2, xs3, ASM: tl.constexpr):
    """Per row of the word tile wd [RS, BW]: the fp32 sum of its 4 * BW exact products with x'."""
    w0, w1, w2, w3 = _e4m3x4_f32(wd, ASM)
    return tl.sum(w0 * xs0 + w1 * xs1 + w2 * xs2 + w3 * xs3, axis=1)


@triton.jit
def _row_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, N, KW, s_stride, rows_per_prog, pre_bytes,
                     OUT_BF16: tl.constexpr, RS: tl.constexpr, BWA: tl.constexpr, BWB: tl.constexpr,
                     ASM: tl.constexpr, PDL: tl.constexpr = 0):
    """The FP8 linear at one activation row, streaming whole weight rows: program p owns the
    `rows_per_prog` consecutive rows from p * rows_per_prog (a divisor of 32, so all of them share
    one row of 32x32 block scales) and reads them RS rows per step, each step one contiguous run
    of RS * K bytes (long DRAM bursts, unlike a [BN, BK] tile's BN separate runs of BK bytes). The
    weight is read as int32 words of 4 codes (KW = K / 4 per row) split into two power-of-two
    parts, KW = BWA + BWB (5120 / 4 = 1024 + 256, 1280 / 4 = 256 + 64, ...; BWB = 0: none), so no
    lane is padding. x's row is FP8-quantised once per program and the block scales of its
    scale row moved onto it: x'[k] = qdq(x)[k] * scale[g, k / 32] (exact: 4 significant bits
    times a power of two), held in registers; each output is the fp32 sum of the exact products
    E4M3 value x x'[k] (at most 8 significant bits) -- the fold kernels' class (exact products,
    fp32 sums), on the CUDA cores: no split-K, no partials, no counters. The next step's rows
    are loaded before this step's are used (two steps in flight). (`linear_pair`'s two weights
    run through it as one: stacked at load, `core.weights.stack_linears`.) The first `pre_bytes`
    of the program's rows are asked of the L2 before the wait (`pdl_prefetch_rows_start`)."""
    n_lo = tl.program_id(0) * rows_per_prog
    n_hi = tl.minimum(n_lo + rows_per_prog, N)
    pdl_prefetch_range_start(PDL, w_ptr, n_lo.to(tl.int64) * KW * 4, tl.minimum((n_hi - n_lo) * KW * 4, pre_bytes), 128)
    sw_row = s_ptr + (n_lo // 32) * s_stride
    rr = tl.arange(0, RS)
    rows = n_lo + rr
    # the first step's weight loads go out before x's quantisation (its latency hides behind them)
    wa = _row_words(w_ptr, rows, rows < n_hi, 0, KW, BWA)
    if BWB > 0:
        wb = _row_words(w_ptr, rows, rows < n_hi, BWA, KW, BWB)
        xb0, xb1, xb2, xb3 = _row_xs(x_ptr, sw_row, BWA, BWB)
    xa0, xa1, xa2, xa3 = _row_xs(x_ptr, sw_row, 0, BWA)
    for n0 in range(n_lo, n_hi, RS):
        nxt = n0 + RS + rr
        wa_next = _row_words(w_ptr, nxt, nxt < n_hi, 0, KW, BWA)
        y = _row_dot(wa, xa0, xa1, xa2, xa3, ASM)  # [RS]
        if BWB > 0:
            wb_next = _row_words(w_ptr, nxt, nxt < n_hi, BWA, KW, BWB)
            y += _row_dot(wb, xb0, xb1, xb2, xb3, ASM)
            wb = wb_next
        rows = n0 + rr
        if OUT_BF16:
            tl.store(out_ptr + rows, bf16_bits16(y), mask=rows < n_hi)
        else:
            tl.store(out_ptr + rows, y, mask=rows < n_hi)
        wa = wa_next


@triton.jit
def _dense_row_kernel(x_ptr, w_ptr, out_ptr, N, K, rows_per_prog, pre_bytes,
                      OUT_BF16: tl.constexpr, RS: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = 0):
    """A plain bf16 weight at one activation row (`dense_row_fits`: the compressor's stacked wkv /
    wgate with fp32 outputs, the indexer's weights_proj and wk, which cuBLAS ran as split-K GEMMs
    with a reduction each): program p owns `rows_per_prog` rows. Each output is the fp32 sum of
    exact bf16 x bf16 products (cuBLAS's class, another order). The first `pre_bytes` of the
    program's rows are asked of the L2 before the wait."""
    n_lo = tl.program_id(0) * rows_per_prog
    n_hi = tl.minimum(n_lo + rows_per_prog, N)
    pdl_prefetch_range_start(PDL, w_ptr, n_lo.to(tl.int64) * K * 2, tl.minimum((n_hi - n_lo) * K * 2, pre_bytes), 128)
    rr = tl.arange(0, RS)
    for n0 in range(n_lo, n_hi, RS):
        rows = n0 + rr
        rok = rows < n_hi
        acc = tl.zeros((RS, BK), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            kok = kk < K
            w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :], mask=rok[:, None] & kok[None, :],
                        other=0.0)
            xv = tl.load(x_ptr + kk, mask=kok, other=0.0)
            acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        if OUT_BF16:
            tl.store(out_ptr + rows, bf16_bits16(y), mask=rok)
        else:
            tl.store(out_ptr + rows, y, mask=rok)


@triton.jit
def _fp8_mma_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, part_ptr, count_ptr, M, N, K, s_stride, k_per_split,
                    SPLIT_K: tl.constexpr, OUT_BF16: tl.constexpr, QDQ_ROW: tl.constexpr, LOWP: tl.constexpr,
                    F16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = 0):
    """The FP8 linear at decode sizes on the FP8 tensor cores: no weight conversion at all. Per
    32-wide K block one dot of the raw E4M3 weight tile [BN, 32] with x's E4M3 codes [32, BM]
    (fp32 out), times the weight's and x's power-of-two block scales, added to the fp32
    accumulator [BN, BM] -- MODEL.md's form (block partial sum of unscaled products, times both
    scales) with the block sum taken by the tensor core. The products are exact; the FP8 MMA's
    internal accumulation of the 32 products is narrower than IEEE fp32 (on Hopper about 2^-13 of
    the block's largest term), so this path is a numerics class of its own: benchmarks/dense_ab.py
    reports its fp32-output error beside the others. x: E4M3 codes [M, K] and E8M0 scales [M, K/32]
    (`fp8_quant`), or with QDQ_ROW (M == 1) the bf16 row, quantised here. Under the interpreter
    the dot runs in fp32 ("ieee") on the same code values.

    F16: the same block dots as fp16 MMAs instead (the codes widened by the hardware's packed
    E4M3 -> f16x2 conversion, one instruction per two weights and nothing else): exact products
    and the fp16 MMA's fp32 accumulation, the tiled kernel's numerics class (`scaled_block_step`)."""
    pdl_start(PDL)
    NB: tl.constexpr = BK // 32
    pid_n, pid_m, pid_k, rn, rm, nmask, mmask, rn64, rm64 = _decode_tile_ids(M, N, BM, BN)
    j = tl.arange(0, 32)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    k_lo, k_hi = _k_slice(pid_k, k_per_split, K)
    for k0 in range(k_lo, k_hi, BK):
        for kb in tl.static_range(NB):
            kc = k0 + kb * 32
            kok = kc < k_hi
            w = tl.load(w_ptr + rn64[:, None] * K + (kc + j)[None, :], mask=nmask[:, None] & kok, other=0.0)
            sw = e8m0_value(tl.load(s_ptr + (rn64 // 32) * s_stride + kc // 32, mask=nmask & kok, other=0).to(tl.int32))
            if QDQ_ROW:  # x's one row: this block's exponent and E4M3 codes, in column 0
                xr = tl.load(x_ptr + kc + j, mask=kok, other=0.0).to(tl.float32)
                e = fp8_exponent(tl.max(tl.abs(xr), axis=0))
                xq = fp8_round(xr * pow2(-e))
                xt = tl.where((tl.arange(0, BM) == 0)[None, :], xq[:, None], 0.0)
                sx = tl.where(tl.arange(0, BM) == 0, pow2(e), 0.0)
            else:
                xt = tl.load(x_ptr + rm64[None, :] * K + (kc + j)[:, None], mask=mmask[None, :] & kok, other=0.0)
                sx = e8m0_value(tl.load(xs_ptr + rm64 * (K // 32) + kc // 32, mask=mmask & kok, other=0).to(tl.int32))
            if LOWP and F16:
                part = tl.dot(w.to(tl.float16), xt.to(tl.float16))
            elif LOWP:
                part = tl.dot(w, xt.to(tl.float8e4nv))
            else:
                part = tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
            acc += part * sw[:, None] * sx[None, :]
    _finish_tile(tl.trans(acc), out_ptr, part_ptr, count_ptr, pid_m * tl.num_programs(0) + pid_n, pid_k, rm, rn,
                 M, N, SPLIT_K, OUT_BF16)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, s_stride, W_KIND: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = 0):
    """A scaled weight [N, K] -> its exact values as bf16 (the large-M path's cuBLAS operand)."""
    pdl_start(PDL)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * BK
    kk = k0 + tl.arange(0, BK)
    w = load_weight_tile(w_ptr, s_ptr, rn, k0, N, K, s_stride, BN, BK, W_KIND)
    tl.store(out_ptr + rn.to(tl.int64)[:, None] * K + kk[None, :], bf16_bits16(w),
             mask=(rn[:, None] < N) & (kk[None, :] < K))


# ---- launcher -----------------------------------------------------------------------------------

# Tiles. Decode (M <= 64) streams the weight: small row tiles, split K to occupy every SM; larger M
# a conventional 128x128 GEMM tile (BK counts K per loop step: BK / 32 scale blocks). H200 sweep
# (M=1, K=5120, N=6144): BN 64 / BK 128 / 4 warps / 4 stages 19.3 us; BN 32 26.7; 8 warps 27.9;
# split-K 4 18.5, 10 21.4, none 27.6 (the default, 4 waves of programs, picks 6).
DECODE = {"bn": 64, "bk": 128, "num_warps": 4, "num_stages": 4, "waves": 4}
PREFILL = {"bm": 128, "bn": 128, "bk": 64, "num_warps": 8, "num_stages": 3, "group_m": 8}
INTERP = {"bn": 32, "bk": 64}
DECODE_MAX_M = 64
# M <= GEMV_MAX_M: `_gemv_linear_kernel` (a few rows: CUDA cores, the weight streamed once; by
# default for M <= GEMV_DEFAULT_M). H200 2026-11-30, K=5120 N=6144, graph replay: M=1 15.8 us
# (BN 16) / 16.3-20.8 (other tiles) against 19.4 us for the tiled kernel; M=4 30-47 against 21.2.
GEMV_MAX_M = 4
GEMV_DEFAULT_M = 1
GEMV = {"bn": 16, "bk": 256, "num_warps": 4, "num_stages": 1, "waves": 4}
GEMV_INTERP = {"bn": 32, "bk": 64, "num_warps": 4, "num_stages": 1}

# FP8 weights at M <= FOLD_MAX_M: `_fold_linear_kernel` (tensor cores, scales folded into bf16
# operands, BM = M rounded up to a power of two >= 16, at most bm_max; bn 32 folds the weight
# scale into x, wider bn into the weight tile).
FOLD_MAX_M = 64
# H200 2026-11-30 (benchmarks/sweep_kernels.py --only dense, graph replay, split-K for ~4 programs
# per SM): bn 64 / bk 128 (wgmma, weight scale folded into the weight tile) against bn 32 / bk 256
# (mma.sync, scale folded into x): M=1 wq_a 7.4 vs 9.3 us, wo_b 20.4 vs 32.7 us (gemv 8.0 / 22.5);
# M=64 wq_a 25.5 vs 33.1 us, wo_b 41.7 vs 111.4 us (tiled 29.8 / 57.6); bn 128 / 8 warps 40.2 /
# 54.3 us at M=64; 8 warps at M=1 14.7 / 58.4 us.
FOLD = {"bn": 64, "bm_max": 64, "bk": 128, "num_warps": 4, "num_stages": 4, "waves": 4, "qdq_row": True}
FOLD_INTERP = {"bn": 32, "bm_max": 16, "bk": 64, "qdq_row": True}

def _split_k_buffers(m, n, k, bk, k_steps, split_k, n_tiles, out):
    """(split_k, K per slice, fp32 partials [split_k, M, N], tile counters) for a split-K launch;
    slices are whole BK steps, so the split actually used can be smaller than asked. Without a
    split the partials and counters are unused (`out` stands in)."""
    k_per_split = bk * -(-k_steps // split_k)
    split_k = -(-k // k_per_split)
    if split_k == 1:
        return split_k, k_per_split, out, out
    return (split_k, k_per_split, torch.empty(split_k, m, n, dtype=torch.float32, device=out.device),
            tile_counters(out.device, n_tiles))


def _waves_split(waves: int, device, tiles: int, k_steps: int) -> int:
    """The K split that gives about `waves` programs per SM over `tiles` output tiles (at least 1,
    at most one slice per K step): the decode launches' rule."""
    from .launch import num_workers

    return max(1, min(k_steps, -(-waves * num_workers(device) // tiles)))


def weight_kind(weight: torch.Tensor, scale: torch.Tensor | None) -> int:
    """W_DENSE / W_FP8 / W_FP4 from the storage dtypes (the checkpoint's formats)."""
    if scale is None:
        return W_DENSE
    if weight.dtype == torch.float8_e4m3fn:
        return W_FP8
    if weight.dtype in (torch.int8, torch.uint8):
        return W_FP4
    raise TypeError(f"unsupported quantised weight dtype {weight.dtype}")


def fold_tm_tiles(n: int, k: int, workers: int) -> dict | None:
    """The token-major kernel's settings for an FP8 weight [n, k] at 9..64 rows (see FOLD_TM), or
    None where `_fold_linear_kernel` stays ahead (a large weight whose 64-row tiles need a K split
    to occupy the `workers` SMs)."""
    if n * k <= FOLD_TM_SMALL_BYTES:
        return dict(FOLD_TM_SMALL)
    if FOLD_TM_LARGE_BYTES and n * k >= FOLD_TM_LARGE_BYTES:
        return dict(FOLD_TM_LARGE)
    if -(-n // FOLD_TM["bn"]) >= 2 * workers:
        return {}
    return None


def fp8_default_path(m: int, k: int, n: int = 0, workers: int = 0) -> tuple[str, dict]:
    """The path `launch_linear` takes for an FP8 weight [n, k] at m <= FOLD_MAX_M rows on a device
    of `workers` SMs, and its tiles: the DSV41_FP8_DECODE choice (`fp8_decode_mode`), then the
    widths and row counts each kernel takes. Above
    XS_MAX_M rows every mode but "fold" and the MMA ones takes `fold_tm_tiles`' choice."""
    path, xs_tiles = fp8_decode_mode()
    xs_tiles = dict(xs_tiles)
    if path == "rowdiag":  # one row: the block-diagonal MMA kernel where K is whole 4-block steps
        path = "rowmma" if m == 1 and k % 128 == 0 else "rows"
    max_m = xs_tiles.pop("max_m", row_mma.MAX_M if path == "rowmma" else
                         FOLD_MAX_M if path.endswith("mma") else XS_MAX_M)
    if m > max_m or (m > XS_MAX_M and path in ("xscale", "place", "rows")):
        tm = None if path == "fold" or path.endswith("mma") or not n else fold_tm_tiles(n, k, workers)
        return ("fold", {}) if tm is None else ("foldtm", tm)
    if path == "rowmma" and (m > row_mma.MAX_M or k % 32):
        return "xscale", {}
    if path == "rows" and m == 1 and k >= ROWMMA_MIN_K and k % 128 == 0:
        return "rowmma", {}
    if path == "rows" and (m > 1 or not rows_fit(k) or k >= ROWS_MAX_K):
        return "xscale", {}
    if path == "rows":
        return path, dict(rows_tiles(k), **xs_tiles)
    return path, xs_tiles


def launch_linear(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, out: torch.Tensor, *,
                  bm: int | None = None, bn: int | None = None, bk: int | None = None, split_k: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None, path: str | None = None,
                  qdq_row: bool | None = None, group_m: int | None = None, serial: bool = False) -> None:
    """out [M, N] (bf16 or fp32) = x2 [M, K] @ dequant(weight)^T; with a scaled weight x2 is
    FP8-quantised first (`fp8_quant`, one pass; in the kernel on the gemv path). The keyword tile
    parameters are for tuning (defaults: the tables above); `path` ("fold" / "foldtm" / "gemv" /
    "tiled") overrides the choice of path (FP8 at M <= FOLD_MAX_M: `fp8_default_path`, i.e. at
    M <= XS_MAX_M the DSV41_FP8_DECODE choice, above it foldtm or fold by weight shape
    (`fold_tm_tiles`); other scaled weights at M <= GEMV_DEFAULT_M: gemv;
    else tiled); `qdq_row` (fold / xscale / place, M = 1) quantises x in the kernel. `serial`
    (tiled path): each program sums the `split_k` K slices itself in slice order, the same
    result as the split launch (grid (tiles, 1), no partials)."""
    from .fp8_quant import fp8_quant
    from .launch import interpreting, num_workers

    m, k = x2.shape
    kind = weight_kind(weight, scale)
    n = weight.shape[0]
    if kind != W_DENSE and k % 32:
        raise ValueError(f"in_features {k} is not a multiple of 32 (the FP8 activation group)")
    want_k = k if kind != W_FP4 else k // 2
    if weight.shape[1] != want_k:
        raise ValueError(f"weight {tuple(weight.shape)} does not match in_features {k}")
    interp = interpreting()
    xs_tiles = {}
    if path is None:
        if kind == W_FP8 and m <= FOLD_MAX_M:
            path, xs_tiles = fp8_default_path(m, k, n, num_workers(x2.device))
        else:
            path = "gemv" if kind != W_DENSE and m <= GEMV_DEFAULT_M else "tiled"
    if path in ("xscale", "place", "fp8mma", "fp16mma", "rows", "rowmma"):
        if kind != W_FP8:
            raise ValueError(f"linear: the {path} path takes FP8 weights")
        if path == "rowmma":
            extra = set(xs_tiles) - {"num_warps", "bb", "waves"}
            if extra:
                raise ValueError(f"DSV41_FP8_DECODE: the rowmma path takes warps, bb and waves, not {sorted(extra)}")
            row_mma.launch_row_mma(x2, weight, scale, out, **dict(xs_tiles, **({"num_warps": num_warps} if num_warps else {})))
            return
        if path == "rows":
            _launch_row_gemv(x2, weight, scale, out, **dict(xs_tiles, **({"num_warps": num_warps} if num_warps else {})))
            return
        given = {"bn": bn, "bk": bk, "split_k": split_k, "num_warps": num_warps, "num_stages": num_stages}
        xs_tiles = dict(xs_tiles, **{a: b for a, b in given.items() if b is not None})
        if path.endswith("mma"):
            _launch_fp8_mma(x2, weight, scale, out, f16=path == "fp16mma", bm=bm, qdq_row=qdq_row, **xs_tiles)
        else:
            _launch_fold_xs(x2, weight, scale, out, place=path == "place", qdq_row=qdq_row, **xs_tiles)
        return
    if path == "foldtm":
        if kind != W_FP8:
            raise ValueError("linear: the foldtm path takes FP8 weights")
        given = {"bm": bm, "bn": bn, "bk": bk, "split_k": split_k, "num_warps": num_warps, "num_stages": num_stages}
        _launch_fold_tm(x2, weight, scale, out, **dict(xs_tiles, **{a: b for a, b in given.items() if b is not None}))
        return
    if path == "fold":
        if kind != W_FP8:
            raise ValueError("linear: the fold path takes FP8 weights")
        _launch_fold(x2, weight, scale, out, bm=bm, bn=bn, bk=bk, split_k=split_k, num_warps=num_warps,
                     num_stages=num_stages, qdq_row=qdq_row)
        return
    if path == "gemv":
        if kind == W_DENSE or m > GEMV_MAX_M:
            raise ValueError(f"linear: the gemv path takes scaled weights and <= {GEMV_MAX_M} rows")
        _launch_gemv(x2, weight, scale, out, kind, bn=bn, bk=bk, split_k=split_k, num_warps=num_warps,
                     num_stages=num_stages)
        return
    small = m <= DECODE_MAX_M
    if interp:
        cfg = {"bm": 16, "bn": INTERP["bn"], "bk": INTERP["bk"], "group_m": 1}
    elif small:
        cfg = dict(DECODE, bm=16 if m <= 16 else (32 if m <= 32 else 64), group_m=1)
    else:
        cfg = dict(PREFILL)
    bm, bn, bk = bm or cfg["bm"], bn or cfg["bn"], bk or cfg["bk"]
    n_tiles = -(-m // bm) * -(-n // bn)
    k_steps = -(-k // bk)
    if split_k is None:
        if small and not interp:
            split_k = max(1, min(k_steps // 2, -(-DECODE["waves"] * num_workers(x2.device) // n_tiles)))
        else:
            split_k = 1 if not interp else min(2, k_steps)
    if serial:
        k_per_split = bk * -(-k_steps // split_k)
        split_k, part, counts = 1, out, out
    else:
        split_k, k_per_split, part, counts = _split_k_buffers(m, n, k, bk, k_steps, split_k, n_tiles, out)
    if kind == W_DENSE:
        q = qs = s = x2  # unused placeholders
    else:
        q, qs = fp8_quant(x2)
        qs, s = qs.view(torch.uint8), scale.view(torch.uint8)
    w = weight.view(torch.uint8) if kind == W_FP4 else weight
    a_terms = 1 if x2.dtype == torch.bfloat16 else 3
    out_arg = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    kw = {} if interp else {"num_warps": num_warps or cfg.get("num_warps", 4),
                            "num_stages": num_stages or cfg.get("num_stages", 3)}
    _block_linear_kernel[(n_tiles, split_k)](
        x2, q, qs, w, s, out_arg, part, counts, m, n, k, s.shape[1] if scale is not None else 0, k_per_split,
        W_KIND=kind, SPLIT_K=split_k, SERIAL=serial, A_TERMS=a_terms, LOWP=not interp,
        OUT_BF16=out.dtype == torch.bfloat16, BM=bm, BN=bn, BK=bk, GROUP_M=group_m or cfg["group_m"], **kw, **pdl_launch(x2))


def _launch_gemv(x2, weight, scale, out, kind, *, bn=None, bk=None, split_k=None, num_warps=None, num_stages=None):
    """The M <= GEMV_MAX_M launch of `_gemv_linear_kernel` (split-K to give every SM work), after
    one `fp8_qdq_bf16` pass over x."""
    from .fp8_quant import fp8_qdq_bf16
    from .launch import interpreting

    m, k = x2.shape
    n = weight.shape[0]
    interp = interpreting()
    cfg = GEMV_INTERP if interp else GEMV
    bn, bk = bn or cfg["bn"], bk or cfg["bk"]
    bk = min(bk, max(32, triton.next_power_of_2(k)))
    x2 = fp8_qdq_bf16(x2)
    n_tiles = -(-n // bn)
    k_steps = -(-k // bk)
    if split_k is None:
        split_k = 1 if interp else _waves_split(GEMV["waves"], x2.device, n_tiles, k_steps)
    split_k, k_per_split, part, counts = _split_k_buffers(m, n, k, bk, k_steps, split_k, n_tiles, out)
    w = weight.view(torch.uint8) if kind == W_FP4 else weight
    out_arg = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    kw = {} if interp else {"num_warps": num_warps or cfg["num_warps"], "num_stages": num_stages or cfg["num_stages"]}
    _gemv_linear_kernel[(n_tiles, split_k)](
        x2, w, scale.view(torch.uint8), out_arg, part, counts, m, n, k, x2.stride(0), weight.stride(0), scale.shape[1],
        k_per_split,
        W_KIND=kind, SPLIT_K=split_k, OUT_BF16=out.dtype == torch.bfloat16, RB=max(1, triton.next_power_of_2(m)),
        BN=bn, BK=bk, ASM=not interp, **kw, **pdl_launch(x2))


def _launch_fold(x2, weight, scale, out, *, bm=None, bn=None, bk=None, split_k=None, num_warps=None,
                 num_stages=None, qdq_row=None):
    """The FP8 launch of `_fold_linear_kernel`: grid (N tiles, M tiles, K slices), split-K so that
    about FOLD["waves"] programs per SM stream the weight. x goes through one `fp8_qdq_bf16` pass
    first unless M == 1 (then each program quantises the row itself)."""
    from .fp8_quant import fp8_qdq_bf16
    from .launch import interpreting

    m, k = x2.shape
    n = weight.shape[0]
    interp = interpreting()
    cfg = FOLD_INTERP if interp else FOLD
    bn = bn or cfg["bn"]
    bm = bm or max(16, min(cfg["bm_max"], triton.next_power_of_2(m)))
    bk = min(bk or cfg["bk"], max(32, triton.next_power_of_2(k)))
    if bn % 32 or bk % 32:
        raise ValueError(f"fold path: bn {bn} and bk {bk} must be multiples of 32 (the scale block)")
    if qdq_row is None:
        qdq_row = m == 1 and cfg["qdq_row"]
    if qdq_row and m != 1:
        raise ValueError("fold path: the in-kernel activation quantisation takes one row")
    if not qdq_row:
        x2 = fp8_qdq_bf16(x2)
    n_n, n_m = -(-n // bn), -(-m // bm)
    k_steps = -(-k // bk)
    if split_k is None:
        split_k = 1 if interp else _waves_split(cfg["waves"], x2.device, n_n * n_m, k_steps)
    split_k, k_per_split, part, counts = _split_k_buffers(m, n, k, bk, k_steps, split_k, n_n * n_m, out)
    out_arg = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    kw = {} if interp else {"num_warps": num_warps or cfg["num_warps"], "num_stages": num_stages or cfg["num_stages"]}
    pdl_kw, pre = pdl_prefetch_launch(x2, n_n * n_m * split_k, aligned=k % 16 == 0 and weight.data_ptr() % 16 == 0)
    _fold_linear_kernel[(n_n, n_m, split_k)](
        x2, weight, scale.view(torch.uint8), out_arg, part, counts, m, n, k, x2.stride(0), scale.shape[1], k_per_split,
        pre, SPLIT_K=split_k, OUT_BF16=out.dtype == torch.bfloat16, QDQ_ROW=qdq_row, SCALE_X=bn == 32,
        LOWP=not interp, BM=bm, BN=bn, BK=bk, **kw, **pdl_kw)


def _launch_fold_tm(x2, weight, scale, out, *, bm=None, bn=None, bk=None, split_k=None, num_warps=None,
                    num_stages=None, waves=None):
    """The FP8 launch of `_fold_tm_kernel` (grid (N tiles, M tiles, K slices)) after one
    `fp8_qdq_bf16` pass over x; split-K so that about `waves` programs per SM stream the weight
    (defaults: FOLD_TM; `fold_tm_tiles` picks the settings per weight shape)."""
    from .fp8_quant import fp8_qdq_bf16
    from .launch import interpreting

    m, k = x2.shape
    n = weight.shape[0]
    interp = interpreting()
    cfg = FOLD_TM_INTERP if interp else FOLD_TM
    bn, bk = bn or cfg["bn"], min(bk or cfg["bk"], max(32, triton.next_power_of_2(k)))
    bm = bm or max(16, min(cfg["bm_max"], triton.next_power_of_2(m)))
    if bn % 32 or bk % 32:
        raise ValueError(f"foldtm path: bn {bn} and bk {bk} must be multiples of 32 (the scale block)")
    x2 = fp8_qdq_bf16(x2)
    n_n, n_m = -(-n // bn), -(-m // bm)
    k_steps = -(-k // bk)
    if split_k is None:
        split_k = 1 if interp else _waves_split(waves or cfg["waves"], x2.device, n_n * n_m, k_steps)
    split_k, k_per_split, part, counts = _split_k_buffers(m, n, k, bk, k_steps, split_k, n_n * n_m, out)
    out_arg = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    kw = {} if interp else {"num_warps": num_warps or cfg["num_warps"], "num_stages": num_stages or cfg["num_stages"]}
    pdl_kw, pre = pdl_prefetch_launch(x2, n_n * n_m * split_k, aligned=k % 16 == 0 and weight.data_ptr() % 16 == 0)
    _fold_tm_kernel[(n_n, n_m, split_k)](
        x2, weight, scale.view(torch.uint8), out_arg, part, counts, m, n, k, x2.stride(0), scale.shape[1], k_per_split,
        pre, SPLIT_K=split_k, OUT_BF16=out.dtype == torch.bfloat16, LOWP=not interp, BM=bm, BN=bn, BK=bk,
        **kw, **pdl_kw)


# `_fold_tm_kernel` (FP8 at 9..64 rows by default, `fold_tm_tiles`). H200 2026-12-04
# (benchmarks/fp8_batch_sweep.py, graph replay, weights cycled past the L2; the mini preset's seven
# per-layer linears, us at 64 rows, fold in brackets): bn 64 / 3 stages / one wave of programs
# wq_b 32768x1280 31.7 (46.7); bn 32 / two waves for weights up to 16 MB: wq_a 15.2 (26.3), wkv
# 13.3 (25.2), idx_wq_b 12.0 (15.1), shared w1 / w3 18.8 (25.4), w2 16.8 (21.0); wo_b 5120x8192,
# whose 80 tiles need a K split, stayed ahead on fold (42.6 against 42.4-45.2; at 16 / 32 rows
# 27.9 / 35.3 against 37-47). Seven-linear sums at 64 / 32 / 16 rows, this default against fold:
# 150 / 132 / 95 against 202 / 150 / 116 us; Engram's 25600x6144 wkv (bn 64, no split) 121 / 97 /
# 68 against 136 / 101 / 79. Slower: 4 stages, 8 waves, bn 128 with 4 or 8 warps, bk 256, bk 64,
# the FP8 MMA per 32-wide block in this orientation (182-248 at 64 rows), and the scale load left
# to the compiler (172 -> 181 us: it is not pipelined and stalls every step).
# Up to 24 MB (16 before) since the shared expert's w1 and w3 run stacked (`linear_pair`: one
# 4608x5120 weight, 23.6 MB, which the rule then sent to fold). H100 2026-12-06 (session
# forty-two, fp8_batch_sweep.py --m 64 --pairs): the stacked pair 28.0 us here against 33.5 on
# fold and 30.7 at bn 64; in the mini decode step at 4K (alternated processes, graph ms) stacked
# with 16 MB 2.932 / 3.964 / 4.488 at batch 8 / 32 / 64, with 24 MB 2.935 / 3.722 / 4.450 (the
# fold launch beside the routed experts at 32 tokens cost 0.25 ms), the pairs apart 2.976 / 3.711
# / 4.574.
FOLD_TM = {"bn": 64, "bm_max": 64, "bk": 128, "num_warps": 4, "num_stages": 3, "waves": 1}
FOLD_TM_SMALL = {"bn": 32, "waves": 2}
FOLD_TM_SMALL_BYTES = 24 << 20
# weights from FOLD_TM_LARGE_BYTES (Engram's 25600x6144 wkv, 157 MB; no other mini linear is
# past 42 MB): 128-wide tiles on 8 warps in a K split of about 4 waves. H100 2026-12-06
# (fp8_batch_sweep.py --m 64 --engram, one run): 106.4 us against 124.1 for bn 64 / one wave
# (113.6 at 2 stages / 2 waves); on the seven per-layer linears the same tiles lost (wq_b 45.2
# against 33.0), so only this size takes them. In the mini batch-64 step (two Engram layers,
# alternated processes) 4.980 / 4.970 -> 4.964 / 4.960 ms at 4K, 5.399 / 5.395 -> 5.417 / 5.386
# at 32K: a few us, within the spread at 32K. 0 turns the rule off.
FOLD_TM_LARGE = {"bn": 128, "num_warps": 8, "waves": 4}
FOLD_TM_LARGE_BYTES = 96 << 20
FOLD_TM_INTERP = {"bn": 32, "bm_max": 16, "bk": 64, "waves": 1}


# The FP8 decode path, chosen once per process from the environment: DSV41_FP8_DECODE = "fold"
# (`_fold_linear_kernel`), "rows" (the default, see ROWS: one row at K < ROWS_MAX_K, else as
# "xscale"), at M <= XS_MAX_M "xscale" (`_fold_xs_kernel`, hardware
# conversion) or "place" (`_fold_xs_kernel`, bit placement), at M <= FOLD_MAX_M "fp8mma"
# (`_fp8_mma_kernel`, FP8 tensor cores) or "fp16mma" (the same, fp16 MMAs), optionally followed by tile settings and a row limit
# (more rows take "fold"), e.g. "place:bn=128,waves=8,stages=3,warps=4" or "fp8mma:maxm=8". "xscale" (the
# fold kernel above XS_MAX_M rows; the default before "rows" and its path at 2-8 rows): the H200 A/B (benchmarks/dense_ab.py, 2026-12-01) summed the seven mini decode
# linears at 1 / 4 / 8 rows to 280 us against 324 for "fold", 353 "place", 354 "fp8mma" (whose fp32 outputs also
# carry a 4.5e-5 error against 1.2e-7), 432 "fp16mma"; at 64 rows "fold" 205 against 324 for "fp8mma".
XS_MAX_M = 8
XS = {"bn": 64, "bk": 128, "num_warps": 4, "num_stages": 4, "waves": 4}
XS_INTERP = {"bn": 64, "bk": 64}
FP8_DECODE_MODES = ("fold", "xscale", "place", "fp8mma", "fp16mma", "rows", "rowmma", "rowdiag")
# "rows" (`_row_gemv_kernel`, the default; M == 1 and K < ROWS_MAX_K only, else "xscale" up to 8
# rows; from ROWMMA_MIN_K "rowmma" at one row): whole weight rows streamed on the CUDA cores.
# Tiles (`rows_tiles`): rows per step and
# programs per SM by K, from the H200 A/B (benchmarks/dense_ab.py --rows, 2026-12-01, graph time,
# one row; xscale in brackets): K = 1280: 4 rows a step, 4 waves -- wq_b 32768x1280 17.0 us
# (23.3), idx_wq_b 4096x1280 4.9 (7.0); K = 2304: 2 rows, 8 waves -- 5120x2304 8.4 (10.0);
# K = 5120: 2 rows, 4 waves -- wq_a 1280x5120 6.9 (7.7), wkv 512x5120 4.7 (5.9), 2304x5120 9.2
# (10.1). At K = 8192 (wo_b 5120x8192) every rows setting lost: 25.9-32.4 us against 22.3.
ROWS = {"step_bytes": 8192, "waves": 4, "num_warps": 4}
# The interpreter's cost is per loop step (a few ms of Python each), not per byte: 4 KB steps (1 row
# a step at 256 B made this kernel a third of the model test's interpreter time); the step / tail
# logic at many steps is covered by test_triton_block_linear's explicit rows-per-step cases.
ROWS_INTERP = {"step_bytes": 4096, "waves": 4}
ROWS_MAX_K = 8192
# From this K on, one row in "rows" mode takes the register-fed MMA kernel with its block-diagonal
# operand (`row_mma`, `_diag_step`; "rowdiag" takes it at every K % 128 == 0). H200 2026-12-02,
# the mini decode step at batch 1 (graph, per launch; the rowmma figure adds its x-codes launch,
# ~1.2 us): wo_b 5120x8192 15.5 + 1.1 us against 20.0 on xscale, Engram's wkv 25600x6144 46.7 +
# 1.2 against 50.5 on rows; below it rows stayed ahead or even (wq_b 32768x1280 14.0 + 1.1
# against 15.1, wkv 512x5120 5.7 + 1.3 against 4.3, the shared expert's 2304x5120 16.4 + 1.4
# against 13.6), so "rowdiag" everywhere took 1.892 ms a step against 1.879.
ROWMMA_MIN_K = 6144


def rows_tiles(k: int) -> dict:
    """The rows kernel's measured settings for in_features k (see ROWS): {"rs", "waves"}, or {} for
    the defaults (rows per step from ROWS["step_bytes"], ROWS["waves"])."""
    if 2048 < k < 4096:
        return {"rs": 2, "waves": 8}
    if 4096 <= k < ROWS_MAX_K:
        return {"rs": 2}
    return {}
# "fp8mma" (`_fp8_mma_kernel`, M <= FOLD_MAX_M): the FP8 tensor cores on the raw codes;
# "fp16mma": the same kernel with fp16 MMAs on the widened codes (fp32-class sums).
F8 = {"bn": 64, "bk": 128, "num_warps": 4, "num_stages": 4, "waves": 4}
F8_INTERP = {"bn": 32, "bk": 64}
_FP8_DECODE: list = []


def parse_fp8_decode(spec: str) -> tuple[str, dict]:
    """"MODE[:key=value,...]" -> (mode, tile overrides for `_launch_fold_xs`); one clear error for
    an unknown mode or key."""
    mode, _, rest = spec.strip().partition(":")
    mode = mode or "fold"
    if mode not in FP8_DECODE_MODES:
        raise ValueError(f"DSV41_FP8_DECODE: unknown mode {mode!r} (one of {', '.join(FP8_DECODE_MODES)})")
    keys = {"bn": "bn", "bk": "bk", "waves": "waves", "stages": "num_stages", "warps": "num_warps", "maxm": "max_m",
            "rs": "rs", "rpp": "rpp", "bb": "bb"}
    tiles = {}
    for item in filter(None, rest.split(",")):
        k, _, v = item.partition("=")
        if k not in keys or not v.isdigit():
            raise ValueError(f"DSV41_FP8_DECODE: bad setting {item!r} (keys {', '.join(keys)}, integer values)")
        tiles[keys[k]] = int(v)
    return mode, tiles


def fp8_decode_mode() -> tuple[str, dict]:
    """The DSV41_FP8_DECODE choice, read once per process."""
    import os

    if not _FP8_DECODE:
        _FP8_DECODE.append(parse_fp8_decode(os.environ.get("DSV41_FP8_DECODE", "rows")))
    return _FP8_DECODE[0]


def _launch_fold_xs(x2, weight, scale, out, *, place: bool, bn=None, bk=None, split_k=None, num_warps=None,
                    num_stages=None, waves=None, qdq_row=None):
    """The launch of `_fold_xs_kernel` (M <= XS_MAX_M): grid (N tiles, M tiles of MP rows, K
    slices), split-K so that about `waves` programs per SM stream the weight; x through one
    `fp8_qdq_bf16` pass unless M == 1 (then each program quantises the row; at 8 rows, each
    program quantising its rows cost 2.856 -> 3.192 ms a batch-8 step on the H200, 2026-12-02)."""
    from .fp8_quant import fp8_qdq_bf16
    from .launch import interpreting

    m, k = x2.shape
    n = weight.shape[0]
    interp = interpreting()
    cfg = XS_INTERP if interp else XS
    bn = bn or cfg["bn"]
    bk = min(bk or cfg["bk"], max(32, triton.next_power_of_2(k)))
    if bn % 32 or bk % 32 or bn & (bn - 1) or bk & (bk - 1):
        raise ValueError(f"xscale path: bn {bn} and bk {bk} must be powers of two >= 32 (the scale block)")
    mp = triton.next_power_of_2(m)
    g = bn // 32
    if m > XS_MAX_M or g * mp > 64:
        raise ValueError(f"xscale path: {m} rows do not fit bn {bn} (rows <= {XS_MAX_M}, bn / 32 * rows <= 64)")
    bx = max(16, g * mp)
    if qdq_row is None:
        qdq_row = m == 1
    if qdq_row and m != 1:
        raise ValueError("xscale path: the in-kernel activation quantisation takes one row")
    if not qdq_row:
        x2 = fp8_qdq_bf16(x2)
    n_n = -(-n // bn)
    k_steps = -(-k // bk)
    if split_k is None:
        per_sm = waves or cfg.get("waves", 4)
        split_k = 1 if interp else _waves_split(per_sm, x2.device, n_n, k_steps)
    split_k, k_per_split, part, counts = _split_k_buffers(m, n, k, bk, k_steps, split_k, n_n, out)
    out_arg = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    kw = {} if interp else {"num_warps": num_warps or cfg["num_warps"], "num_stages": num_stages or cfg["num_stages"]}
    pdl_kw, pre = pdl_prefetch_launch(x2, n_n * split_k, aligned=k % 16 == 0 and weight.data_ptr() % 16 == 0)
    _fold_xs_kernel[(n_n, 1, split_k)](
        x2, weight.view(torch.uint8) if place else weight, scale.view(torch.uint8), out_arg, part, counts, m, n, k,
        x2.stride(0), scale.shape[1], k_per_split, pre,
        SPLIT_K=split_k, OUT_BF16=out.dtype == torch.bfloat16, QDQ_ROW=qdq_row, PLACE=place, LOWP=not interp,
        MP=mp, BX=bx, BN=bn, BK=bk, **kw, **pdl_kw)


def rows_fit(k: int) -> bool:
    """Whether the rows path takes in_features k: a multiple of 32 whose K / 4 words are a sum of two
    powers of two (the kernel's two register parts; every mini / full width is: 5120, 1280, 8192, 2304)."""
    kw = k // 4
    rest = kw - (1 << (kw.bit_length() - 1)) if kw else 1
    return k > 0 and k % 32 == 0 and rest & (rest - 1) == 0 and not 0 < rest < 8


def _launch_row_gemv(x2, weight, scale, out, *, rs=None, rpp=None, waves=None, num_warps=None):
    """The M == 1 launch of `_row_gemv_kernel`: one program per `rpp` consecutive weight rows (a
    power of two dividing 32, at least `rs`; by default the least giving at most `waves` programs
    per SM), `rs` rows per step (default: about ROWS["step_bytes"] of K padded to a power of two)."""
    from .launch import interpreting, num_workers

    m, k = x2.shape
    n = weight.shape[0]
    if m != 1:
        raise ValueError(f"rows path: takes one activation row, got {m}")
    interp = interpreting()
    cfg = ROWS_INTERP if interp else ROWS
    kw = k // 4
    bwa = 1 << (kw.bit_length() - 1)  # K / 4 words = BWA + BWB, both powers of two (BWB may be 0)
    bwb = kw - bwa
    if not rows_fit(k):
        raise ValueError(f"rows path: in_features {k} must be a multiple of 32 and 4 x a sum of two powers of "
                         f"two >= 8")
    rs = rs or min(32, 1 << (max(1, cfg["step_bytes"] // k).bit_length() - 1))
    if not rpp:
        per_sm = waves or cfg["waves"]
        rpp = min(32, max(rs, triton.next_power_of_2(-(-n // (per_sm * num_workers(x2.device))))))
    if rs & (rs - 1) or rpp & (rpp - 1) or rpp > 32 or rpp < rs:
        raise ValueError(f"rows path: rows per step {rs} and per program {rpp} must be powers of two, "
                         f"rs <= rpp <= 32 (one row of 32x32 scale blocks per program)")
    out_arg = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    kw_opts = {} if interp else {"num_warps": num_warps or cfg["num_warps"], "num_stages": 1}
    grid = -(-n // rpp)
    pdl_kw, pre = pdl_prefetch_launch(x2, grid, aligned=k % 16 == 0 and weight.data_ptr() % 16 == 0)
    _row_gemv_kernel[(grid,)](x2, weight.view(torch.int32), scale.view(torch.uint8), out_arg, n, kw,
                              scale.shape[1], rpp, pre, OUT_BF16=out.dtype == torch.bfloat16, RS=rs, BWA=bwa,
                              BWB=bwb, ASM=not interp, **kw_opts, **pdl_kw)


def _launch_fp8_mma(x2, weight, scale, out, *, f16: bool = False, bm=None, bn=None, bk=None, split_k=None,
                    num_warps=None, num_stages=None, waves=None, qdq_row=None):
    """The launch of `_fp8_mma_kernel` (M <= FOLD_MAX_M): grid (N tiles, M tiles, K slices), split-K
    so that about `waves` programs per SM stream the weight; x through `fp8_quant` (codes and
    scales) also at M == 1 by default: the in-kernel quantisation (`qdq_row=True`) redoes each
    32-block's max and rounding in every program, about twice the loop's instructions (sm_90a
    SASS, 826 against 433 per 128-wide step), for one launch less."""
    from .fp8_quant import fp8_quant
    from .launch import interpreting

    m, k = x2.shape
    n = weight.shape[0]
    interp = interpreting()
    cfg = F8_INTERP if interp else F8
    bn = bn or cfg["bn"]
    bm = bm or max(16, min(64, triton.next_power_of_2(m)))
    bk = min(bk or cfg["bk"], max(32, triton.next_power_of_2(k)))
    if bn % 16 or bk % 32 or bk & (bk - 1):
        raise ValueError(f"fp8mma path: bn {bn} must be a multiple of 16 and bk {bk} a power of two >= 32")
    qdq_row = bool(qdq_row)
    if qdq_row and m != 1:
        raise ValueError("fp8mma path: the in-kernel activation quantisation takes one row")
    if qdq_row:
        xq, xs = x2, x2
    else:
        xq, xs = fp8_quant(x2)
        xs = xs.view(torch.uint8)
    n_n, n_m = -(-n // bn), -(-m // bm)
    k_steps = -(-k // bk)
    if split_k is None:
        per_sm = waves or cfg.get("waves", 4)
        split_k = 1 if interp else _waves_split(per_sm, x2.device, n_n * n_m, k_steps)
    split_k, k_per_split, part, counts = _split_k_buffers(m, n, k, bk, k_steps, split_k, n_n * n_m, out)
    out_arg = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    # 64-row tiles: 4 warps spill (acc and the block partial, 64 x 64 fp32 each; sm_90a ptxas)
    kw = {} if interp else {"num_warps": num_warps or (8 if bm >= 64 else cfg["num_warps"]),
                            "num_stages": num_stages or cfg["num_stages"]}
    _fp8_mma_kernel[(n_n, n_m, split_k)](
        xq, xs, weight, scale.view(torch.uint8), out_arg, part, counts, m, n, k, scale.shape[1], k_per_split,
        SPLIT_K=split_k, OUT_BF16=out.dtype == torch.bfloat16, QDQ_ROW=qdq_row, LOWP=not interp, F16=f16, BM=bm, BN=bn,
        BK=bk, **kw, **pdl_launch(xq))


def dequant_bf16(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A scaled weight's exact values as a bf16 [N, K] tensor (one pass)."""
    kind = weight_kind(weight, scale)
    n = weight.shape[0]
    k = weight.shape[1] * (2 if kind == W_FP4 else 1)
    out = torch.empty(n, k, dtype=torch.bfloat16, device=weight.device)
    bn, bk = 32, 128
    _dequant_kernel[(-(-n // bn), -(-k // bk))](weight.view(torch.uint8) if kind == W_FP4 else weight,
                                                scale.view(torch.uint8), out.view(torch.int16), n, k, scale.shape[1],
                                                W_KIND=kind, BN=bn, BK=bk, **pdl_launch(out))
    return out


# From this many rows on, a scaled linear with bf16 output dequantises its weight to bf16 (one
# pass, ~N*K*3 bytes) and multiplies in cuBLAS: H200, K=5120, N=6144, M=4096: 358 us in all
# (719 TFLOP/s) against 1224 us for this kernel, whose per-block rescale halves the matrix rate
# (benchmarks/sweep_kernels.py --only linear, 2026-11-30).
CUBLAS_MIN_M = 1024


# cuBLASLt's int8 GEMM (torch._int_mm) takes more than this many rows; fewer are padded with zeros.
INT_MM_MIN_M = 17


def int8_linear(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, odt: torch.dtype) -> torch.Tensor:
    """W8A8 (int8 weight [N, K], fp32 scale per output channel): x [M, K] int8-quantised per token
    as the reference does (`quant.int8_token_qdq`, fp32 torch ops on x rounded to bf16), the
    integer dot products summed exactly in int32 (`torch._int_mm`: cuBLASLt on CUDA; |sum| <=
    127^2 K < 2^31), then x_scale[m] * w_scale[n] in fp32 and one rounding to `odt`."""
    k = x2.shape[1]
    if weight.shape[1] != k:
        raise ValueError(f"weight {tuple(weight.shape)} does not match in_features {k}")
    if x2.device.type == "cuda" and (k % 8 or weight.shape[0] % 8):
        raise ValueError(f"W8A8 linear: cuBLASLt's int8 GEMM needs K and N multiples of 8, got "
                         f"{tuple(weight.shape)}")
    q, xs = quant.int8_token_qdq(x2.to(torch.bfloat16).float())
    q = q.to(torch.int8)
    m = q.shape[0]
    if q.device.type == "cuda" and m < INT_MM_MIN_M:
        q = torch.cat([q, q.new_zeros(INT_MM_MIN_M - m, k)])
    acc = torch._int_mm(q, weight.t())[:m]
    return (acc.float() * xs.reshape(m, 1) * scale.float().reshape(1, -1)).to(odt)


# From this many rows on, bf16 x bf16 with fp32 output (the head's logits) goes to cuBLAS through
# torch.mm(..., out_dtype=torch.float32) (bf16 products, fp32 accumulation and output: the
# kernel's numerics class); below it to `_block_linear_kernel`, at its weight-read floor for M = 1
# on the head. Smaller bf16 weights (at most MM_FP32_OUT_MAX_BYTES: the compressors' wkv / wgate,
# the indexer's weights_proj) go to cuBLAS at one row as well: `_block_linear_kernel`'s split-K
# grid took 5-8.6 us for their 0.3-5 MB in the mini decode step (H200, graph replay, 2026-12-01).
MM_FP32_OUT_MIN_M = 2
MM_FP32_OUT_MAX_BYTES = 64 << 20
_MM_FP32_OUT: dict[str, bool] = {}


def _mm_fp32_out_works(x: torch.Tensor) -> bool:
    """Whether this torch takes `out_dtype` in torch.mm on x's device (probed once per device
    type, on a tiny product outside any graph capture: the first call of an op is eager)."""
    key = x.device.type
    ok = _MM_FP32_OUT.get(key)
    if ok is None:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=x.device)
        try:
            ok = torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
        except (TypeError, RuntimeError, NotImplementedError):
            ok = False
        _MM_FP32_OUT[key] = ok
    return ok


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
           out_dtype: torch.dtype = torch.bfloat16, **tiles) -> torch.Tensor:
    """`ops.linear` on a device: x [..., K] -> [..., N] in `out_dtype` (float64 gives fp32: no
    fp64 on devices). One bf16 row with a small bf16 weight goes to `_dense_row_kernel`
    (`dense_row_fits`); other bf16 x and weights with bf16 output, and fp32 weights, go to torch's matmul
    (cuBLAS, fp32 accumulation), as do scaled weights at M >= CUBLAS_MIN_M with bf16 output (the
    weight dequantised exactly to bf16, x quantised through FP8 to bf16: exact operands); the
    rest (decode, fp32 outputs, the bf16 head's fp32 logits) to the kernel above."""
    from .fp8_quant import fp8_qdq_bf16
    from .launch import interpreting

    if out_dtype not in (torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"linear: unsupported out_dtype {out_dtype}")
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    m = x2.shape[0]
    odt = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
    if quant.is_int8_channel_weight(weight, scale):
        return int8_linear(x2, weight, scale, odt).reshape(*lead, n)
    if dense_row_fits(x2, weight, scale) and not tiles:  # one row, a small bf16 weight: one launch
        out = torch.empty(1, n, dtype=odt, device=x.device)
        _launch_dense_row(x2, weight, out)
        return out.reshape(*lead, n)
    if not interpreting() and not tiles:
        if scale is None and odt == weight.dtype == x2.dtype:  # bf16 x bf16 -> bf16 (or fp32 throughout)
            return torch.matmul(x2, weight.t()).reshape(*lead, n)
        if scale is None and odt == torch.float32 and x2.dtype == weight.dtype == torch.bfloat16 \
                and (m >= MM_FP32_OUT_MIN_M or weight.numel() * 2 <= MM_FP32_OUT_MAX_BYTES) \
                and _mm_fp32_out_works(x2):  # the head's fp32 logits at several rows; small weights
            return torch.mm(x2, weight.t(), out_dtype=torch.float32).reshape(*lead, n)
        if scale is None and weight.dtype != torch.bfloat16:  # fp32 weights: an fp32 GEMM (TF32 off)
            return torch.matmul(x2.float(), weight.float().t()).to(odt).reshape(*lead, n)
        if scale is not None and odt == torch.bfloat16 and m >= CUBLAS_MIN_M:
            if k % 32:
                raise ValueError(f"in_features {k} is not a multiple of 32 (the FP8 activation group)")
            return torch.matmul(fp8_qdq_bf16(x2), dequant_bf16(weight, scale).t()).reshape(*lead, n)
    out = torch.empty(m, n, dtype=odt, device=x.device)
    if m:
        launch_linear(x2, weight, scale, out, **tiles)
    return out.reshape(*lead, n)


# The dense row kernel's tiles: rows per step, K per step, and about DENSE_ROW["waves"] programs
# per SM (the interpreter: small steps). H200 2026-12-02 (graph time, the compressor's wkv / wgate,
# 2 x 512 x 5120 bf16, fp32 out, one row, then as two weights in one launch; since 2026-12-06 they
# are one stacked weight): 3.89 us here against 12.47 for cuBLAS's two split-K GEMMs with their
# reductions; whole rows a step (bk 8192, 1 row, 4 or 8 waves) 4.8, bk 2048 4.0, 8 warps 5.7-4.9.
# In the decode step it runs beside wq_b on the other stream: 8.8-9.8 us there.
DENSE_ROW = {"rs": 2, "bk": 1024, "waves": 4, "num_warps": 4}
DENSE_ROW_INTERP = {"rs": 2, "bk": 64, "waves": 1}
# one bf16 row with one bf16 weight up to this size takes the same kernel (`dense_row_fits`): in
# the mini decode step at batch 1 the indexer's weights_proj (32 x 5120, fp32 out), the ratio-1
# compressor's wkv (512 x 5120) and the indexer's wk ran as cuBLAS split-K GEMMs with a reduction
# (and casts): 3.2-9.4 us each on the H100 (2026-12-06), on the indexer's critical path; with
# this kernel 3.7-6.2 us, and the batch-1 step 2.003 / 1.998 -> 1.989 / 1.989 ms at 4K, 2.036 /
# 2.029 -> 2.020 / 2.015 at 32K (H100, alternated processes). 0: off.
DENSE_ROW_MAX_BYTES = 64 << 20


def dense_row_fits(x2: torch.Tensor, weight: torch.Tensor, scale) -> bool:
    """Whether `linear` takes one row through `_dense_row_kernel` with this weight: plain
    bf16 x and weight (contiguous), at most DENSE_ROW_MAX_BYTES (the head stays on its own path)."""
    return (DENSE_ROW_MAX_BYTES > 0 and x2.shape[0] == 1 and scale is None
            and x2.dtype == weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.is_contiguous()
            and weight.shape[1] == x2.shape[1] and weight.numel() * 2 <= DENSE_ROW_MAX_BYTES)


def _launch_dense_row(x2, weight, out, **tiles):
    """The launch of `_dense_row_kernel`: `rpp` rows per program (the least giving at most
    `waves` programs per SM), `rs` rows and `bk` columns per step (DENSE_ROW; `tiles` override)."""
    from .launch import interpreting, num_workers

    interp = interpreting()
    cfg = dict(DENSE_ROW_INTERP if interp else DENSE_ROW, **tiles)
    n = weight.shape[0]
    rs = cfg["rs"]
    rpp = max(rs, -(-n // (cfg["waves"] * num_workers(x2.device))))
    bk = min(cfg["bk"], triton.next_power_of_2(x2.shape[1]))
    kw = {} if interp else {"num_warps": cfg["num_warps"]}
    out_arg = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    grid = -(-n // rpp)
    pdl_kw, pre = pdl_prefetch_launch(x2, grid, aligned=x2.shape[1] % 8 == 0 and weight.element_size() == 2
                                      and weight.data_ptr() % 16 == 0)
    _dense_row_kernel[(grid,)](x2, weight, out_arg, n, x2.shape[1], rpp, pre, OUT_BF16=out.dtype == torch.bfloat16,
                               RS=rs, BK=bk, **kw, **pdl_kw)


def linear_pair(x: torch.Tensor, weight_a: torch.Tensor, scale_a: torch.Tensor | None, weight_b: torch.Tensor,
                scale_b: torch.Tensor | None, out_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.linear_pair` on a device. Weights stacked at load (`core.weights.stack_linears`: the
    attention's wq_a and wkv, the shared expert's w1 and w3, the compressor's wkv and wgate) run
    as one `linear` over the stacked rows below CUBLAS_MIN_M rows (`backends.fused.stacked_pair`):
    one launch and one quantisation of x instead of two, the outputs views of its output (row
    stride the stacked width). Otherwise (prefill, or weights not stacked: a module built by hand)
    the two linears. At one row each stacked output row is computed as its own `linear` computes
    it (the same kernel steps per weight row): the results are identical; at 2..64 rows the
    stacked width may choose other tiles (a K split) than either weight alone, so sums can differ
    in fp32 order."""
    k = x.shape[-1]
    stacked = stacked_pair(weight_a, scale_a, weight_b, scale_b)
    # (from CUBLAS_MIN_M rows cuBLAS takes each weight dequantised: one launch more is nothing
    # there, and the stacked weight's bf16 copy would raise the prefill's peak memory)
    if stacked is not None and x.numel() < CUBLAS_MIN_M * k:
        y = linear(x, *stacked, out_dtype)
        return y[..., :weight_a.shape[0]], y[..., weight_a.shape[0]:]
    return linear(x, weight_a, scale_a, out_dtype), linear(x, weight_b, scale_b, out_dtype)


OPS = {"linear": linear, "linear_pair": linear_pair}
