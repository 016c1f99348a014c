"""Grouped routed-expert GEMMs on tensor cores (the `moe_experts` path for 5.. tokens and prefill).

Per call, with R = T * k routed rows (token t, slot j -> flat row t * k + j):
1. Align (`_count_kernel` when R spans several chunks, then `_place_kernel`): the flat rows are
   ordered by expert (stable: ascending flat row inside an expert; ids < 0 and >= E dropped) and
   each expert's segment is padded to a multiple of BM, so every BM-row block belongs to one
   expert. Outputs: `rows` (flat row of each padded position), and per block its expert (-1:
   unused) and its count of real rows. All on the device, no host sync: capturable in graphs.
   The grid is sized for the worst case, cdiv(R, BM) + min(E, R) blocks.
2. `_gate_up_kernel`, one program per (block, BN columns of the intermediate width): the block's
   token rows of the activation (FP8 quantise-dequantise values, bf16: exact; FP4 experts: in the
   chunk-permuted column order below), times the
   expert's w1 and w3 tiles dequantised to bf16 WITH their power-of-two scale folded in, as
   tensor-core bf16 dots with fp32 accumulation over BK-wide K steps. Epilogue: clamped SwiGLU,
   routing weight, FP8 quantise-dequantise of the w2 input per 32 columns (bf16 for bf16
   experts), stored as bf16 at the block's padded positions.
3. `_down_kernel`, one program per (block, BN columns of d): h rows (contiguous) times w2, fp32
   rows written to their flat rows; `moe_experts._combine_kernel` sums a token's slots in order.
Programs are ordered so that the blocks of a group of GROUP_M blocks run side by side over the
N columns: at decode (GROUP_M = all blocks) every block of an expert reads the same weight tile
at the same time (one HBM read, the rest from L2); in prefill a group's activation rows and its
expert's weights stay in L2.

Numerics: every operand is an exact bf16 value, so each product is exact in fp32 and only the
fp32 summation order differs from the reference (as the per-32-block kernels before); the w1 / w3 sums, the weighted SwiGLU product and each expert's
output are then rounded to bf16 where the official expert rounds (`swiglu.expert_act`; the
reference's official mode, which the tests compare with).
- Activations: FP8 E4M3 codes times 2^e with e = ceil(log2(max(amax, 1e-4) / 448)) >= -22, so
  |values| >= 2^-31: normal in bf16 (same exponent range as fp32), never rounded.
- FP4 weights: an E2M1 value (0, 0.5 .. 6) times the E8M0 scale 2^(byte - 127) has at most two
  significant bits, so it is exact in bf16 whenever it is a normal number. The kernel takes the
  E2M1 value times 2^-14 (`e2m1_pairs_f32`, exact) times 2^(byte - 127 + 14) in fp32, then bf16:
  exact for every result >= 2^-126 with scale bytes 1..240. Outside that: byte 0 reads as 0 (as
  in the other kernels), results below 2^-126 are subnormal and may round or flush, and bytes
  >= 241 overflow the fp32 factor (weights >= 2^114: far beyond any checkpoint, whose scales sit
  around 2^-20 .. 2^0). tests/test_triton_moe_grouped.py checks bytes 1..240 bit-exactly.
- FP8 weights (E8M0 per 32x32 block): E4M3 value times the scale in fp32, exact when the result
  is normal (same range caveats); bf16 weights are taken as they are.
- Under TRITON_INTERPRET=1 (no bf16 arithmetic there) the same values go through fp32 "ieee" dots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_start
from .block_scaled import W_DENSE, W_FP4, bf16_bits16, bf16_round, e2m1_pairs_f32, e8m0_value, fp8_qdq_groups
from .swiglu import expert_act

# Tiles per routed-row range: the best measured on the H200 (benchmarks/RESULTS.md, "MoE: the
# grouped tensor-core path": T=8 swap off 980 us, T=64 swap + BK 256 999 us). Prefill (the bf16
# scratch, experts two at a time; H200 2026-12-04, `moe_experts` CUDA-event time, 16 FP4 experts
# at the mini widths, top-6): BN 128 for gate/up and BK 64 2.556 ms at T=1792 (one engine step)
# and 9.697 ms at T=8192 against 2.941 / 11.423 for BN 64 / BK 128 (the same bits: a wgmma chain
# adds K in the same order whatever BK); 4 stages, BN 256 for down, BM 64 or GROUP_M 4 / 16
# within 5% or slower; four experts a scratch fill 2.500 ms (not taken: twice the scratch).
# BM 64 made the down GEMM 861 against 1056 us at T=1792 but gate/up 1496 against 1201 (H200,
# 2026-12-04, the same bits): `down_split` 2 runs the down GEMM over each 128-row block as two
# 64-row halves (a half without rows returns at once), keeping BM 128 for gate/up and the layout.
TILES = {"decode": {"bm": 16, "bn_up": 64, "bn_down": 64, "bk": 128, "num_warps": 4, "num_stages": 3},
         "mid": {"bm": 32, "bn_up": 64, "bn_down": 64, "bk": 256, "num_warps": 4, "num_stages": 3, "swap": True},
         "prefill": {"bm": 128, "bn_up": 128, "bn_down": 128, "bk": 64, "num_warps": 8, "num_stages": 3,
                     "group_m": 8, "down_split": 2},
         "interp": {"bm": 16, "bn_up": 32, "bn_down": 32, "bk": 64}}
DECODE_MAX_ROWS = 64 * 8  # routed rows up to which every block of a column tile runs side by side


def _buffer(shape, dtype, device) -> torch.Tensor:
    """Scratch and output allocation (one place, so tests can poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


# ---- 1. align: rows ordered by expert, padded to BM per expert ----------------------------------

@triton.jit
def _count_kernel(ids_ptr, cnt_ptr, R, E, CH: tl.constexpr, EP: tl.constexpr, PDL: tl.constexpr = 0):
    """cnt[c, e] = rows of chunk c (CH flat rows) routed to expert e."""
    pdl_start(PDL)
    c = tl.program_id(0)
    f = c * CH + tl.arange(0, CH)
    ex = tl.arange(0, EP)
    ids = tl.load(ids_ptr + f, mask=f < R, other=-1).to(tl.int32)
    onehot = (ids[:, None] == ex[None, :]) & (ex[None, :] < E)
    tl.store(cnt_ptr + c * EP + ex, tl.sum(onehot.to(tl.int32), axis=0))


@triton.jit
def _place_kernel(ids_ptr, cnt_ptr, rows_ptr, bexp_ptr, bcnt_ptr, bounds_ptr, R, E, n_chunks, n_blocks,
                  CH: tl.constexpr, EP: tl.constexpr, NCB: tl.constexpr, BM: tl.constexpr, BB: tl.constexpr,
                  ONE: tl.constexpr, BLOCKS: tl.constexpr, PDL: tl.constexpr = 0):
    """Each program places its chunk's rows at their padded positions; program 0 also writes the
    segment bounds (bounds[e] .. bounds[e + 1]: expert e's padded segment) and, with BLOCKS, the
    block table. Expert e's segment starts at the sum of the padded counts of the experts below
    it; inside it, rows keep their flat order (chunks below, then the rank inside the chunk)."""
    pdl_start(PDL)
    c = tl.program_id(0)
    f = c * CH + tl.arange(0, CH)
    ex = tl.arange(0, EP)
    ids = tl.load(ids_ptr + f, mask=f < R, other=-1).to(tl.int32)
    onehot = ((ids[:, None] == ex[None, :]) & (ex[None, :] < E)).to(tl.int32)  # [CH, EP]
    if ONE:  # a single chunk: its own counts are the totals
        total = tl.sum(onehot, axis=0)
        before = tl.zeros((EP,), dtype=tl.int32)
    else:
        total = tl.zeros((EP,), dtype=tl.int32)
        before = tl.zeros((EP,), dtype=tl.int32)
        for c0 in range(0, n_chunks, NCB):
            ch = c0 + tl.arange(0, NCB)
            cnt = tl.load(cnt_ptr + ch[:, None] * EP + ex[None, :], mask=ch[:, None] < n_chunks, other=0)
            total += tl.sum(cnt, axis=0)
            before += tl.sum(tl.where(ch[:, None] < c, cnt, 0), axis=0)
    padded = (total + BM - 1) // BM * BM
    pend = tl.cumsum(padded, axis=0)
    pstart = pend - padded
    rank = tl.cumsum(onehot, axis=0) - onehot  # rows of the same expert earlier in the chunk
    pos = tl.sum(onehot * (pstart + before)[None, :] + onehot * rank, axis=1)
    tl.store(rows_ptr + pos, f, mask=tl.sum(onehot, axis=1) > 0)
    if c == 0:
        tl.store(bounds_ptr + 1 + ex, pend, mask=ex < E)
        tl.store(bounds_ptr, 0)
    if BLOCKS:
        if c == 0:
            for b0 in range(0, n_blocks, BB):
                b = b0 + tl.arange(0, BB)
                first = b * BM
                # the expert whose padded segment holds row `first`: experts ending at or before it
                eb = tl.sum(((pend[None, :] <= first[:, None]) & (ex[None, :] < E)).to(tl.int32), axis=1)
                hit = ex[None, :] == eb[:, None]
                real = tl.sum(tl.where(hit, pstart + total, 0), axis=1) - first
                used = eb < E
                tl.store(bexp_ptr + b, tl.where(used, eb, -1), mask=b < n_blocks)
                tl.store(bcnt_ptr + b, tl.where(used, tl.minimum(real, BM), 0), mask=b < n_blocks)


def _align(flat_ids: torch.Tensor, n_exp: int, bm: int, chunk: int | None, blocks: bool):
    """Launch the align kernels: (rows, block expert, block row count, bounds)."""
    r = flat_ids.numel()
    dev = flat_ids.device
    n_blocks = -(-r // bm) + min(n_exp, r) if blocks else 1
    ep = triton.next_power_of_2(max(n_exp, 2))
    ch = chunk or max(16, min(1024, triton.next_power_of_2(r), 8192 // ep))
    n_chunks = -(-r // ch)
    rows = _buffer((n_blocks * bm if blocks else r,), torch.int32, dev)
    bexp = _buffer((n_blocks,), torch.int32, dev)
    bcnt = _buffer((n_blocks,), torch.int32, dev)
    bounds = _buffer((n_exp + 1,), torch.int32, dev)
    one = n_chunks == 1
    cnt = rows if one else _buffer((n_chunks, ep), torch.int32, dev)
    if not one:
        _count_kernel[(n_chunks,)](flat_ids, cnt, r, n_exp, CH=ch, EP=ep, **pdl_launch(flat_ids))
    ncb = max(2, min(triton.next_power_of_2(n_chunks), 8192 // ep))
    _place_kernel[(n_chunks,)](flat_ids, cnt, rows, bexp, bcnt, bounds, r, n_exp, n_chunks, n_blocks, CH=ch, EP=ep,
                               NCB=ncb, BM=bm, BB=max(2, min(256, triton.next_power_of_2(n_blocks))), ONE=one,
                               BLOCKS=blocks, **pdl_launch(flat_ids))
    return rows, bexp, bcnt, bounds


def align_rows(flat_ids: torch.Tensor, n_exp: int, bm: int, chunk: int | None = None):
    """(rows int32 [n_blocks * bm], block expert int32 [n_blocks], block row count int32
    [n_blocks]) for flat expert ids [R] (see the module docstring; entries of `rows` past a
    block's count are unset)."""
    return _align(flat_ids, n_exp, bm, chunk, True)[:3]


def sort_rows(flat_ids: torch.Tensor, n_exp: int, chunk: int | None = None):
    """(perm int32 [R], bounds int32 [E + 1]): the flat rows ordered by expert (stable; ids < 0
    and >= E left out: entries past bounds[E] are unset) and expert e's rows at
    perm[bounds[e]:bounds[e + 1]]. What a stable sort plus a searchsorted give, in one launch
    for up to 1024 rows (two above), without a host sync."""
    rows, _, _, bounds = _align(flat_ids, n_exp, 1, chunk, False)
    return rows, bounds


# ---- 2./3. the expert GEMMs ----------------------------------------------------------------------
# FP4 weights are dequantised as two [BN, BK/2] tiles, the low nibbles (elements 2j) and the high
# nibbles (2j + 1), and multiplied with the activation columns of the same parity: two dots of
# BK/2. So that those are contiguous loads, the activation of an FP4 GEMM is stored with its
# columns permuted inside each BK-wide chunk, evens first, then odds (`perm_cols`; x by a torch
# copy after its quantisation, the w2 input by the gate/up epilogue). Every tile is 2-d: no
# reshape or interleave between a load and a dot, which Triton's Hopper pipeline needs (a 3-d
# byte tile there failed to compile).

@triton.jit
def perm_cols(n, P: tl.constexpr):
    """Position of column n in the chunk-permuted layout (chunks of P: evens, then odds)."""
    r = n % P
    return n - r + (r % 2) * (P // 2) + r // 2


def perm_cols_torch(x: torch.Tensor, p: int) -> torch.Tensor:
    """x [R, C] (C % p == 0) with its columns permuted as `perm_cols` (a contiguous copy)."""
    r, c = x.shape
    return x.reshape(r, c // p, p // 2, 2).transpose(-1, -2).reshape(r, c)


@triton.jit
def fp4_tiles(w_ptr, s_ptr, rn, nmask, k0, k_hi, w_stride, s_stride, BN: tl.constexpr, BK: tl.constexpr,
              LOWP: tl.constexpr, EVEN: tl.constexpr = False):
    """Rows `rn` x columns k0 .. k0 + BK of a packed FP4 weight (bytes [N, K/2], element 2j in the
    low nibble, E8M0 [N, K/32]) as (even columns, odd columns) [BN, BK/2] with the scale folded
    in: bf16 on devices (LOWP), fp32 under the interpreter. Zero outside nmask / at or past k_hi,
    unless EVEN (the caller knows every row and column is inside: no masks).
    Exact where the result is >= 2^-126 and the scale byte <= 240 (module docstring)."""
    NB: tl.constexpr = BK // 32
    rn64 = rn.to(tl.int64)
    j = tl.arange(0, BK // 2)
    kb = k0 // 32 + tl.arange(0, NB)
    wp = w_ptr + rn64[:, None] * w_stride + (k0 // 2 + j)[None, :]
    sp = s_ptr + rn64[:, None] * s_stride + kb[None, :]
    if EVEN:
        byt = tl.load(wp)
        sb = tl.load(sp)
    else:
        byt = tl.load(wp, mask=nmask[:, None] & (k0 + 2 * j[None, :] < k_hi), other=0)
        sb = tl.load(sp, mask=nmask[:, None] & (kb[None, :] * 32 < k_hi), other=0)
    # one scale per 16 bytes (32 values): E8M0 -> fp32 once, then spread over its 16 columns
    sc = e8m0_value(sb.to(tl.int32)) * 16384.0  # e2m1_pairs_f32 gives the value times 2^-14
    sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BN, NB, 16)), (BN, BK // 2))
    lo, hi = e2m1_pairs_f32(byt, LOWP)
    lo = lo * sc
    hi = hi * sc
    if LOWP:
        return lo.to(tl.bfloat16), hi.to(tl.bfloat16)
    else:
        return lo, hi


@triton.jit
def dense_tile(w_ptr, s_ptr, rn, nmask, k0, k_hi, w_stride, s_stride, W_KIND: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, LOWP: tl.constexpr):
    """Rows `rn` x columns k0 .. k0 + BK of an FP8 weight with E8M0 scales per 32x32 block
    (W_KIND 1; scale folded in, exact where normal) or a bf16 / fp32 weight (0), as bf16 on
    devices (LOWP) or fp32. Zero outside nmask / at or past k_hi."""
    rn64 = rn.to(tl.int64)
    kk = k0 + tl.arange(0, BK)
    m = nmask[:, None] & (kk[None, :] < k_hi)
    w = tl.load(w_ptr + rn64[:, None] * w_stride + kk[None, :], mask=m, other=0.0)
    if W_KIND == 1:
        sb = tl.load(s_ptr + (rn64 // 32)[:, None] * s_stride + (kk // 32)[None, :], mask=m, other=0)
        w = w.to(tl.float32) * e8m0_value(sb.to(tl.int32))
    if LOWP:
        return w.to(tl.bfloat16)  # bf16 weights: as loaded (the load feeds the dot directly)
    else:
        return w.to(tl.float32)


@triton.jit
def _mma(a, w, acc, SWAP: tl.constexpr, LOWP: tl.constexpr):
    """acc + a [BM, K] @ w [BN, K]^T (acc [BM, BN]), or with SWAP acc^T + w @ a^T (acc [BN, BM]:
    the weight tile is the dot's first operand, the form Hopper takes from registers).
    bf16 tensor-core dots on devices; fp32 "ieee" dots under the interpreter (exact products)."""
    if not LOWP:
        a = a.to(tl.float32)
    if SWAP:
        if LOWP:
            return tl.dot(w, tl.trans(a), acc)
        else:
            return tl.dot(w, tl.trans(a), acc, input_precision="ieee")
    else:
        if LOWP:
            return tl.dot(a, tl.trans(w), acc)
        else:
            return tl.dot(a, tl.trans(w), acc, input_precision="ieee")


@triton.jit
def _gemm_step(acc, a_ptr, arow, rmask, k0, K, w_ptr, s_ptr, rn, nmask, w_stride, s_stride,
               W_KIND: tl.constexpr, SWAP: tl.constexpr, LOWP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               EVEN: tl.constexpr):
    """One BK step of rows `arow` (element offsets of the activation rows) times a weight tile."""
    if W_KIND == 2:  # activation columns chunk-permuted: this step's evens, then its odds
        j = tl.arange(0, BK // 2)
        am = rmask[:, None] & (k0 + 2 * j[None, :] < K)
        a_lo = tl.load(a_ptr + arow[:, None] + (k0 + j)[None, :], mask=am, other=0.0)
        a_hi = tl.load(a_ptr + arow[:, None] + (k0 + BK // 2 + j)[None, :], mask=am, other=0.0)
        w_lo, w_hi = fp4_tiles(w_ptr, s_ptr, rn, nmask, k0, K, w_stride, s_stride, BN, BK, LOWP, EVEN)
        acc = _mma(a_lo, w_lo, acc, SWAP, LOWP)
        acc = _mma(a_hi, w_hi, acc, SWAP, LOWP)
    else:
        kk = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + arow[:, None] + kk[None, :], mask=rmask[:, None] & (kk[None, :] < K), other=0.0)
        acc = _mma(a, dense_tile(w_ptr, s_ptr, rn, nmask, k0, K, w_stride, s_stride, W_KIND, BN, BK, LOWP), acc,
                   SWAP, LOWP)
    return acc


@triton.jit
def _tile_of(pid, n_blocks, n_cols, GROUP_M):
    """(block, column tile) of program pid: GROUP_M blocks side by side over all column tiles."""
    width = GROUP_M * n_cols
    first = (pid // width) * GROUP_M
    size = tl.minimum(n_blocks - first, GROUP_M)
    inner = pid % width
    return first + inner % size, inner // size


@triton.jit
def _expert_ptrs(w_base, s_base, table_ptr, e, which: tl.constexpr, ALIGN: tl.constexpr):
    """Expert e's weight and scale pointers for matrix `which` (0: w1, 1: w3, 2: w2)."""
    w = w_base + tl.multiple_of(tl.load(table_ptr + e * 6 + which), ALIGN)
    s = s_base + tl.multiple_of(tl.load(table_ptr + e * 6 + 3 + which), ALIGN)
    return w, s


@triton.jit(do_not_specialize=["e_lo", "e_hi"])
def _gate_up_kernel(a_ptr, rows_ptr, bexp_ptr, bcnt_ptr, wts_ptr, w_base, s_base, table_ptr, h_ptr,
                    K, I, w_stride, s_stride, limit, n_blocks, GROUP_M, e_lo, e_hi,
                    TOPK: tl.constexpr, W_KIND: tl.constexpr, LOWP: tl.constexpr, ALIGN: tl.constexpr,
                    SWAP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, P_OUT: tl.constexpr,
                    QUANT_H: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    blk, pn = _tile_of(tl.program_id(0), n_blocks, tl.cdiv(I, BN), GROUP_M)
    e = tl.load(bexp_ptr + blk)
    if (e >= e_lo) & (e < e_hi):  # (unused blocks hold -1; e_lo >= 0)
        r = tl.arange(0, BM)
        rmask = r < tl.load(bcnt_ptr + blk)
        f = tl.load(rows_ptr + blk * BM + r, mask=rmask, other=0)
        arow = (f // TOPK).to(tl.int64) * K
        rn = pn * BN + tl.arange(0, BN)
        nmask = rn < I
        w1, s1 = _expert_ptrs(w_base, s_base, table_ptr, e, 0, ALIGN)
        w3, s3 = _expert_ptrs(w_base, s_base, table_ptr, e, 1, ALIGN)
        if SWAP:
            acc1 = tl.zeros((BN, BM), dtype=tl.float32)
            acc3 = tl.zeros((BN, BM), dtype=tl.float32)
        else:
            acc1 = tl.zeros((BM, BN), dtype=tl.float32)
            acc3 = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            acc1 = _gemm_step(acc1, a_ptr, arow, rmask, k0, K, w1, s1, rn, nmask, w_stride, s_stride, W_KIND, SWAP,
                              LOWP, BN, BK, EVEN)
            acc3 = _gemm_step(acc3, a_ptr, arow, rmask, k0, K, w3, s3, rn, nmask, w_stride, s_stride, W_KIND, SWAP,
                              LOWP, BN, BK, EVEN)
        if SWAP:
            acc1 = tl.trans(acc1)
            acc3 = tl.trans(acc3)
        h = expert_act(acc1, acc3, tl.load(wts_ptr + f, mask=rmask, other=0.0)[:, None], limit)
        if QUANT_H:  # the w2 input's FP8 quantisation (BN % 32 == 0: whole groups); exact in bf16
            h = fp8_qdq_groups(h, BM, BN)
        if P_OUT > 0:  # w2 is FP4: its input goes in chunk-permuted
            cols = perm_cols(rn, P_OUT)
        else:
            cols = rn
        p = (blk * BM + r).to(tl.int64)
        tl.store(h_ptr + p[:, None] * I + cols[None, :], bf16_bits16(h), mask=rmask[:, None] & nmask[None, :])


@triton.jit(do_not_specialize=["e_lo", "e_hi"])
def _down_kernel(h_ptr, rows_ptr, bexp_ptr, bcnt_ptr, w_base, s_base, table_ptr, y_ptr, I, D, w_stride, s_stride,
                 n_blocks, GROUP_M, e_lo, e_hi, W_KIND: tl.constexpr, LOWP: tl.constexpr, ALIGN: tl.constexpr,
                 SWAP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr,
                 SPLIT: tl.constexpr = 1, PDL: tl.constexpr = 0):
    """y rows of each block = h rows @ its expert's w2^T. SPLIT > 1: each of the n_blocks blocks
    of the layout (SPLIT * BM rows) is taken as SPLIT sub-blocks of BM rows (tiles hb), a
    sub-block past the block's rows doing nothing; every row's sums are the same either way."""
    pdl_start(PDL)
    hb, pn = _tile_of(tl.program_id(0), n_blocks * SPLIT, tl.cdiv(D, BN), GROUP_M)
    blk = hb // SPLIT
    e = tl.load(bexp_ptr + blk)
    cnt = tl.load(bcnt_ptr + blk) - (hb - blk * SPLIT) * BM  # this sub-block's rows (<= 0: none)
    if (e >= e_lo) & (e < e_hi) & (cnt > 0):
        r = tl.arange(0, BM)
        rmask = r < cnt
        arow = (hb * BM + r).to(tl.int64) * I
        rn = pn * BN + tl.arange(0, BN)
        nmask = rn < D
        w2, s2 = _expert_ptrs(w_base, s_base, table_ptr, e, 2, ALIGN)
        if SWAP:
            acc = tl.zeros((BN, BM), dtype=tl.float32)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, I, BK):
            acc = _gemm_step(acc, h_ptr, arow, rmask, k0, I, w2, s2, rn, nmask, w_stride, s_stride, W_KIND, SWAP,
                             LOWP, BN, BK, EVEN)
        f = tl.load(rows_ptr + hb * BM + r, mask=rmask, other=0).to(tl.int64)
        if SWAP:
            tl.store(y_ptr + f[None, :] * D + rn[:, None], bf16_round(acc), mask=rmask[None, :] & nmask[:, None])
        else:
            tl.store(y_ptr + f[:, None] * D + rn[None, :], bf16_round(acc), mask=rmask[:, None] & nmask[None, :])


# ---- prefill: the experts dequantised once per pass ------------------------------------------------
# With hundreds of rows per expert, dequantising inside the GEMM loop (once per row block) costs
# more than the dots. Instead the FP4 experts are written out as bf16 (scales folded: exact, as
# above) into a scratch [G, 3, ., .] (w1 [I, d], w3 [I, d], w2 [d, I]) a group of G experts at a
# time, and the same GEMM kernels run on it as bf16 experts over the blocks of that group's
# experts (the loads feed the dots directly), keeping the FP8 quantisation of x and of the w2
# input. Groups bound the scratch (all 16 mini experts at once: 1.13 GB; a group of 2: 0.14 GB);
# every block is still computed by the same kernel and tiles, so the grouping changes no bit.
PREDEQUANT_MIN_ROWS = 256  # routed rows per expert (on average) from which it pays (estimate)
PREDEQUANT_MAX_BYTES = 4 << 30  # the bf16 scratch of every expert may take at most this much
PREDEQUANT_GROUP = 2  # experts per scratch fill (the scratch's size; no effect on the numerics)
# Tokens per pass of a long call over the reused buffers (x quantised, h, the fp32 [rows x top-k,
# d] expert outputs: 1 GB at 8192 mini tokens whole, 0.25 GB a 2048-token pass). Each pass fills
# the scratch again (about 0.35 ms for the 16 mini experts on the H200), so passes stay long.
PREFILL_SLICE_TOKENS = 2048
_SCRATCH_TABLES: dict[tuple, torch.Tensor] = {}


@triton.jit
def _fp4_to_bf16_kernel(w_base, s_base, table_ptr, out_ptr, I, D, e_lo, BN: tl.constexpr, BK: tl.constexpr,
                        LOWP: tl.constexpr, EVEN: tl.constexpr = False, PDL: tl.constexpr = 0):
    """Program (expert e_lo + i, matrix m, tile): a [BN, BK] tile of matrix m (0: w1, 1: w3, 2: w2)
    of that expert dequantised to bf16 into out [G, 3, I * D] at slot i (EVEN: the tiles divide
    both matrices, no masks)."""
    pdl_start(PDL)
    i = tl.program_id(0)
    e = e_lo + i
    m = tl.program_id(1)
    n_rows = tl.where(m == 2, D, I)
    k = tl.where(m == 2, I, D)
    n_kt = k // BK
    pn = tl.program_id(2) // n_kt
    pk = tl.program_id(2) - pn * n_kt
    w = w_base + tl.load(table_ptr + e * 6 + m)
    sc = s_base + tl.load(table_ptr + e * 6 + 3 + m)
    rn = pn * BN + tl.arange(0, BN)
    lo, hi = fp4_tiles(w, sc, rn, rn < n_rows, pk * BK, k, k // 2, k // 32, BN, BK, LOWP, EVEN)
    kk = pk * BK + tl.arange(0, BK)
    dst = out_ptr + (i * 3 + m).to(tl.int64) * I * D + rn.to(tl.int64)[:, None] * k + kk[None, :]
    if EVEN:
        tl.store(dst, tl.interleave(lo, hi))
    else:
        tl.store(dst, tl.interleave(lo, hi), mask=(rn < n_rows)[:, None])


# The scratch fill's tiles on devices: (BN rows, BK columns, warps); both matrices' widths must be
# multiples of BN and BK (else 32 x 32 tiles). H200 2026-12-04 (16 mini experts, two a fill, CUDA
# events; the same bytes every time): 32 x 256 0.441 ms (3.25 TB/s of reads + writes), 64 x 128
# 0.448, 16 x 256 0.449, 32 x 128 0.452, 64 x 64 (before) 0.467, 64 x 64 on 8 warps 0.541, 128 x
# 128 on 8 warps 0.533.
FILL_TILE = (32, 256, 4)


def predequant_pays(kind: str, rows: int, n_exp: int, inter: int, d: int) -> bool:
    """Whether `rows` routed rows of FP4 experts go through the bf16 scratch: enough rows per
    expert that one dequantisation per call beats one per row block, within the scratch bound.
    On the H200 (2026-11-30, mini widths, 16 experts, 8192 tokens x top-6) this path took 7.1 ms
    against 37.4 ms for the per-block tiled kernels (benchmarks/RESULTS.md)."""
    return (kind == W_FP4 and rows >= PREDEQUANT_MIN_ROWS * n_exp
            and n_exp * 3 * inter * d * 2 <= PREDEQUANT_MAX_BYTES)


def predequantised(table_args, interp: bool, experts: tuple[int, int] | None = None, out=None):
    """(bf16 scratch [G, 3, I * D], its table args as bf16 experts) for FP4 experts e_lo .. e_hi - 1
    (`experts`; default all), written at scratch slots 0 .. G - 1 (`out`: a scratch of at least G
    slots to reuse). Table entries of experts outside the range point at slot 0: the GEMMs skip
    their blocks (`e_lo` / `e_hi`)."""
    w_base, s_base, table, kind, inter, d, _, align = table_args
    n_exp = table.shape[0]
    e_lo, e_hi = experts or (0, n_exp)
    bn, bk, warps = FILL_TILE
    if inter % bn or d % bn or inter % bk or d % bk:
        bn, bk = 32, 32  # (the widths are multiples of 32: FP4 scale blocks)
    if out is None:
        out = _buffer((e_hi - e_lo, 3, inter * d), torch.bfloat16, w_base.device)
    # (w1 / w3 [I, d] and w2 [d, I] have the same number of tiles, I * d / (BN * BK))
    _fp4_to_bf16_kernel[(e_hi - e_lo, 3, (inter // bn) * (d // bk))](
        w_base, s_base, table, out, inter, d, e_lo, BN=bn, BK=bk, LOWP=not interp,
        EVEN=all(w % t == 0 for w in (inter, d) for t in (bn, bk)),
        **({} if interp else {"num_warps": warps}), **pdl_launch(w_base))
    key = (n_exp, inter, d, e_lo, e_hi, w_base.device)
    tab = _SCRATCH_TABLES.get(key)
    if tab is None:
        slot = torch.arange(n_exp, dtype=torch.int64) - e_lo
        e = torch.where((slot >= 0) & (slot < e_hi - e_lo), slot, 0) * 3 * inter * d
        tab = torch.stack([e, e + inter * d, e + 2 * inter * d] + [torch.zeros_like(e)] * 3, dim=1)
        tab = _SCRATCH_TABLES[key] = tab.to(w_base.device)
    return out, (out, out, tab, W_DENSE, inter, d, (0, 0), 16)


def tiles_for(t: int, topk: int, interp: bool) -> dict:
    """The default tiles for T tokens of top-k routing."""
    if interp:
        return TILES["interp"]
    r = t * topk
    return TILES["decode" if r <= 128 else ("mid" if r <= DECODE_MAX_ROWS else "prefill")]


def _fit_bk(bk: int, width: int) -> int:
    """The largest power-of-two BK <= bk dividing `width` (a multiple of 32): the FP4 column
    permutation works in whole BK chunks."""
    while width % bk:
        bk //= 2
    return bk


def grouped_moe(x, weights, ids, table_args, limit, out, *, bm=None, bn_up=None, bn_down=None, bk=None,
                bk_down=None, group_m=None, swap=None, num_warps=None, num_stages=None, chunk=None,
                predequant=None, slice_tokens=None, expert_group=None, down_split=None):
    """The grouped path of `moe_experts` (module docstring): out [T, d] fp32 <- x [T, d].
    `predequant`: FP4 experts dequantised to a bf16 scratch first (default: from
    PREDEQUANT_MIN_ROWS rows per expert on devices, within PREDEQUANT_MAX_BYTES), `expert_group`
    experts at a time (default PREDEQUANT_GROUP). Tokens go through in passes of at most
    `slice_tokens` (default PREFILL_SLICE_TOKENS) over one set of reused buffers; the tiles are
    those of the whole call, so the result is the same bits for any slicing and grouping.
    `down_split`: the down GEMM's sub-blocks per row block (default the tiles'; same bits)."""
    from .fp8_quant import fp8_qdq_bf16
    from .launch import interpreting

    w_base, s_base, table, kind, inter, d, (s_up, s_down), align = table_args
    n_exp = table.shape[0]
    interp = interpreting()
    t, topk = ids.shape
    if predequant is None:
        predequant = not interp and predequant_pays(kind, t * topk, n_exp, inter, d)
    predequant = predequant and kind == W_FP4
    cfg = tiles_for(t, topk, interp)  # one tile table for every pass (numerics independent of slicing)
    bm = bm or cfg["bm"]
    bn_up, bn_down = bn_up or cfg["bn_up"], bn_down or cfg["bn_down"]
    if bn_up % 32 or inter % 32 or d % 32 or bm < 16 or bn_down < 16 or (bk or 32) % 32 or (bk_down or 32) % 32:
        raise ValueError("moe_experts grouped path: widths, BN (gate/up) and BK must be multiples of 32, "
                         "BM and BN (down) at least 16")
    split = down_split or cfg.get("down_split", 1)
    if split < 1 or bm % split or (not interp and bm // split < 16):
        raise ValueError(f"down_split {split} must divide BM {bm} into sub-blocks of at least 16 rows")
    s_tok = slice_tokens or PREFILL_SLICE_TOKENS
    g_exp = (expert_group or PREDEQUANT_GROUP) if predequant else n_exp
    if s_tok < 1 or g_exp < 1:
        raise ValueError(f"slice_tokens ({s_tok}) and expert_group ({g_exp}) must be >= 1")
    g_exp = min(g_exp, n_exp)
    plan = dict(bm=bm, bn_up=bn_up, bn_down=bn_down, bk_up=_fit_bk(bk or cfg["bk"], d),
                bk_down=_fit_bk(bk_down or bk or cfg["bk"], inter),
                swap=cfg.get("swap", False) if swap is None else swap, group_m=group_m or cfg.get("group_m"),
                down_split=split,
                kw={} if interp else {"num_warps": num_warps or cfg["num_warps"],
                                      "num_stages": num_stages or cfg["num_stages"]})
    # the activation formats come from the experts' own kind: the scratch is bf16, but x and the
    # w2 input stay FP8-quantised as for the FP4 weights it holds
    quant = kind != W_DENSE
    s_len = min(t, s_tok)
    r_max = s_len * topk
    nb_max = -(-r_max // bm) + min(n_exp, r_max)
    bufs = dict(h=_buffer((nb_max * bm, inter), torch.bfloat16, x.device),
                y=_buffer((r_max, d), torch.float32, x.device),
                scratch=_buffer((g_exp, 3, inter * d), torch.bfloat16, x.device) if predequant else None)
    wts = weights.float().contiguous()
    for t0 in range(0, t, s_tok):
        t1 = min(t, t0 + s_tok)
        a = x[t0:t1].to(torch.bfloat16).contiguous() if not quant else fp8_qdq_bf16(x[t0:t1])
        if kind == W_FP4 and not predequant:
            a = perm_cols_torch(a, plan["bk_up"])
        _grouped_pass(a, wts[t0:t1].reshape(-1), ids[t0:t1].contiguous(), table_args, limit, out[t0:t1], plan,
                      quant, predequant, g_exp, chunk, interp, bufs)
    return out


def _grouped_pass(a, wts, ids, table_args, limit, out, plan, quant, predequant, g_exp, chunk, interp, bufs):
    """One pass of `grouped_moe` over a slice of tokens: align its rows, then per expert group
    (the bf16 scratch refilled with the group first when predequantised) the gate/up and down
    GEMMs over that group's blocks, then the ordered combine into `out` (the slice's rows)."""
    from .moe_experts import combine

    w_base, s_base, table, kind, inter, d, (s_up, s_down), align = table_args
    n_exp = table.shape[0]
    t, topk = ids.shape
    r = t * topk
    bm = plan["bm"]
    flat_ids = ids.reshape(-1)
    rows, bexp, bcnt = align_rows(flat_ids, n_exp, bm, chunk)
    n_blocks = bexp.numel()
    gm = plan["group_m"] or n_blocks
    h = bufs["h"][:n_blocks * bm]
    y = bufs["y"][:r]
    for e_lo in range(0, n_exp, g_exp):
        e_hi = min(n_exp, e_lo + g_exp)
        args = table_args
        if predequant:
            _, args = predequantised(table_args, interp, (e_lo, e_hi), bufs["scratch"])
        wb, sb, tab, k_now, _, _, (su, sd), al = args

        def w_row(k_in):  # a weight row in storage elements (bytes for packed FP4)
            return k_in // 2 if k_now == W_FP4 else k_in

        _gate_up_kernel[(n_blocks * -(-inter // plan["bn_up"]),)](
            a, rows, bexp, bcnt, wts, wb, sb, tab, h.view(torch.int16), d, inter, w_row(d), su, float(limit),
            n_blocks, gm, e_lo, e_hi, TOPK=topk, W_KIND=k_now, LOWP=not interp, ALIGN=al, SWAP=plan["swap"], BM=bm,
            BN=plan["bn_up"], BK=plan["bk_up"], P_OUT=plan["bk_down"] if k_now == W_FP4 else 0, QUANT_H=quant,
            EVEN=inter % plan["bn_up"] == 0 and d % plan["bk_up"] == 0, **plan["kw"], **pdl_launch(a))
        split = plan["down_split"]  # (GROUP_M in sub-blocks: the same rows side by side)
        _down_kernel[(n_blocks * split * -(-d // plan["bn_down"]),)](
            h, rows, bexp, bcnt, wb, sb, tab, y, inter, d, w_row(inter), sd, n_blocks, gm * split, e_lo, e_hi,
            W_KIND=k_now, LOWP=not interp, ALIGN=al, SWAP=plan["swap"], BM=bm // split, BN=plan["bn_down"],
            BK=plan["bk_down"], EVEN=d % plan["bn_down"] == 0 and inter % plan["bk_down"] == 0, SPLIT=split,
            **plan["kw"], **pdl_launch(h))
    combine(y, flat_ids, out)
