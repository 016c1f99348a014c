"""Grouped routed-expert GEMMs on tensor cores (the `moe_experts` path for 5.. tokens and prefill).

Per call, with R = T * k routed rows (token t, slot j -> flat row t * k + j):
1. Align (`_count_kernel` when R spans several chunks, then `_place_kernel`): the flat rows are
   ordered by expert (stable: ascending flat row inside an expert; ids < 0 and >= E dropped) and
   each expert's segment is padded to a multiple of BM, so every BM-row block belongs to one
   expert. Outputs: `rows` (flat row of each padded position), and per block its expert (-1:
   unused) and its count of real rows. All on the device, no host sync: capturable in graphs.
   The grid is sized for the worst case, cdiv(R, BM) + min(E, R) blocks.
2. `_gate_up_kernel`, one program per (block, BN columns of the intermediate width): the block's
   token rows of the activation (FP8 quantise-dequantise values, bf16: exact), times the
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
fp32 summation order differs from the reference (as the per-32-block kernels before).
- Activations: FP8 E4M3 codes times 2^e with e = ceil(log2(max(amax, 1e-4) / 448)) >= -22, so
  |values| >= 2^-31: normal in bf16 (same exponent range as fp32), never rounded.
- FP4 weights: an E2M1 value (0, 0.5 .. 6) times the E8M0 scale 2^(byte - 127) has at most two
  significant bits, so it is exact in bf16 whenever it is a normal fp32 number. The kernel builds
  the fp32 bit pattern directly (exponent field = byte - 1 + (magnitude >> 1)); products below
  2^-126 (scale bytes 0 and 1 with small codes) read as 0 (the earlier kernels read scale byte 0
  as 0 outright); bytes 253 / 254 with |code| >= 4 give weights >= 2^128, beyond fp32 and bf16:
  out of contract, as for any fp32 implementation. Checkpoint scales sit far inside
  (about 2^-20 .. 2^0); tests/test_triton_moe_grouped.py checks bytes 1..252 bit-exactly.
- FP8 weights (E8M0 per 32x32 block): E4M3 value times the scale in fp32, exact when the result
  is normal (same range caveats); bf16 weights are taken as they are.
- Under TRITON_INTERPRET=1 (no bf16 arithmetic there) the same values go through fp32 "ieee" dots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_scaled import W_DENSE, W_FP4, W_FP8, bf16_bits16, e8m0_value, fp8_qdq_groups
from .swiglu import swiglu_tile

# Tiles per token range (H200 choices: see benchmarks/RESULTS.md, "MoE grouped path").
TILES = {"decode": {"bm": 16, "bn_up": 64, "bn_down": 64, "bk": 128, "num_warps": 4, "num_stages": 3},
         "mid": {"bm": 32, "bn_up": 64, "bn_down": 64, "bk": 128, "num_warps": 4, "num_stages": 3},
         "prefill": {"bm": 128, "bn_up": 64, "bn_down": 128, "bk": 64, "num_warps": 8, "num_stages": 3,
                     "group_m": 8},
         "interp": {"bm": 16, "bn_up": 32, "bn_down": 32, "bk": 64}}
DECODE_MAX_ROWS = 64 * 8  # routed rows up to which every block of a column tile runs side by side


def _buffer(shape, dtype, device) -> torch.Tensor:
    """Scratch and output allocation (one place, so tests can poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


# ---- 1. align: rows ordered by expert, padded to BM per expert ----------------------------------

@triton.jit
def _count_kernel(ids_ptr, cnt_ptr, R, E, CH: tl.constexpr, EP: tl.constexpr):
    """cnt[c, e] = rows of chunk c (CH flat rows) routed to expert e."""
    c = tl.program_id(0)
    f = c * CH + tl.arange(0, CH)
    ex = tl.arange(0, EP)
    ids = tl.load(ids_ptr + f, mask=f < R, other=-1).to(tl.int32)
    onehot = (ids[:, None] == ex[None, :]) & (ex[None, :] < E)
    tl.store(cnt_ptr + c * EP + ex, tl.sum(onehot.to(tl.int32), axis=0))


@triton.jit
def _place_kernel(ids_ptr, cnt_ptr, rows_ptr, bexp_ptr, bcnt_ptr, R, E, n_chunks, n_blocks,
                  CH: tl.constexpr, EP: tl.constexpr, NCB: tl.constexpr, BM: tl.constexpr, BB: tl.constexpr,
                  ONE: tl.constexpr):
    """Each program places its chunk's rows at their padded positions; program 0 also writes the
    block table. Expert e's segment starts at the sum of the padded counts of the experts below
    it; inside it, rows keep their flat order (chunks below, then the rank inside the chunk)."""
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


def align_rows(flat_ids: torch.Tensor, n_exp: int, bm: int, chunk: int | None = None):
    """(rows int32 [n_blocks * bm], block expert int32 [n_blocks], block row count int32
    [n_blocks]) for flat expert ids [R] (see the module docstring; entries of `rows` past a
    block's count are unset)."""
    r = flat_ids.numel()
    dev = flat_ids.device
    n_blocks = -(-r // bm) + min(n_exp, r)
    ep = triton.next_power_of_2(max(n_exp, 2))
    ch = chunk or max(16, min(1024, triton.next_power_of_2(r), 8192 // ep))
    n_chunks = -(-r // ch)
    rows = _buffer((n_blocks * bm,), torch.int32, dev)
    bexp = _buffer((n_blocks,), torch.int32, dev)
    bcnt = _buffer((n_blocks,), torch.int32, dev)
    one = n_chunks == 1
    cnt = rows if one else _buffer((n_chunks, ep), torch.int32, dev)
    if not one:
        _count_kernel[(n_chunks,)](flat_ids, cnt, r, n_exp, CH=ch, EP=ep)
    ncb = max(2, min(triton.next_power_of_2(n_chunks), 8192 // ep))
    _place_kernel[(n_chunks,)](flat_ids, cnt, rows, bexp, bcnt, r, n_exp, n_chunks, n_blocks, CH=ch, EP=ep, NCB=ncb,
                               BM=bm, BB=max(2, min(256, triton.next_power_of_2(n_blocks))), ONE=one)
    return rows, bexp, bcnt


# ---- 2./3. the expert GEMMs ----------------------------------------------------------------------

@triton.jit
def e2m1_scaled_f32(c, sb):
    """E2M1 nibbles c (int32 0..15) times 2^(sb - 127) for E8M0 bytes sb (int32, broadcast), as
    fp32 built from bits: exponent field sb - 1 + (magnitude >> 1), mantissa bit for 1.5 / 3 / 6.
    Exact for results >= 2^-126; smaller ones read as 0 (see the module docstring)."""
    mag = c & 7
    ef = sb - 1 + (mag >> 1)
    bits = (ef << 23) | (((mag & 1) & (mag > 2).to(tl.int32)) << 22)
    bits = tl.where((mag == 0) | (ef < 1), 0, bits) | ((c & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def dequant_tile(w_ptr, s_ptr, rn, nmask, k0, k_hi, w_stride, s_stride, W_KIND: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, LOWP: tl.constexpr):
    """Rows `rn` [BN] x columns k0 .. k0 + BK of a weight as exact values with the scale folded
    in (0 outside nmask or at / past k_hi): bf16 on devices (LOWP), fp32 under the interpreter.
    W_KIND 2: packed FP4 bytes [N, K/2] (element 2j in the low nibble), E8M0 [N, K/32];
    1: FP8 E4M3 [N, K], E8M0 per 32x32 block; 0: bf16 / fp32. Strides in elements (bytes for FP4)."""
    NB: tl.constexpr = BK // 32
    rn64 = rn.to(tl.int64)
    kb = k0 // 32 + tl.arange(0, NB)
    bok = nmask[:, None] & (kb[None, :] * 32 < k_hi)
    if W_KIND == 2:
        j = tl.arange(0, 16)
        byt = tl.load(w_ptr + rn64[:, None, None] * w_stride + kb[None, :, None] * 16 + j[None, None, :],
                      mask=bok[:, :, None], other=0).to(tl.int32)
        sb = tl.load(s_ptr + rn64[:, None] * s_stride + kb[None, :], mask=bok, other=0).to(tl.int32)[:, :, None]
        lo = e2m1_scaled_f32(byt & 15, sb)
        hi = e2m1_scaled_f32((byt >> 4) & 15, sb)
        if LOWP:
            lo = lo.to(tl.bfloat16)
            hi = hi.to(tl.bfloat16)
        return tl.reshape(tl.interleave(lo, hi), (BN, BK))
    else:
        kk = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + rn64[:, None] * w_stride + kk[None, :], mask=nmask[:, None] & (kk[None, :] < k_hi),
                    other=0.0)
        if W_KIND == 1:
            sb = tl.load(s_ptr + (rn64 // 32)[:, None] * s_stride + kb[None, :], mask=bok, other=0).to(tl.int32)
            w = tl.reshape(tl.reshape(w.to(tl.float32), (BN, NB, 32)) * e8m0_value(sb)[:, :, None], (BN, BK))
        if LOWP:
            return w.to(tl.bfloat16)
        else:
            return w.to(tl.float32)


@triton.jit
def _dot_t(a, w, acc, LOWP: tl.constexpr):
    """acc + a [BM, BK] @ w [BN, BK]^T: bf16 tensor-core dot on devices, fp32 "ieee" dot under
    the interpreter (exact products either way)."""
    if LOWP:
        return tl.dot(a, tl.trans(w), acc)
    else:
        return tl.dot(a.to(tl.float32), tl.trans(w), acc, input_precision="ieee")


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


@triton.jit
def _gate_up_kernel(a_ptr, rows_ptr, bexp_ptr, bcnt_ptr, wts_ptr, w_base, s_base, table_ptr, h_ptr,
                    K, I, w_stride, s_stride, limit, n_blocks, GROUP_M,
                    TOPK: tl.constexpr, W_KIND: tl.constexpr, LOWP: tl.constexpr, ALIGN: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    blk, pn = _tile_of(tl.program_id(0), n_blocks, tl.cdiv(I, BN), GROUP_M)
    e = tl.load(bexp_ptr + blk)
    if e >= 0:
        r = tl.arange(0, BM)
        rmask = r < tl.load(bcnt_ptr + blk)
        f = tl.load(rows_ptr + blk * BM + r, mask=rmask, other=0)
        arow = (f // TOPK).to(tl.int64) * K
        rn = pn * BN + tl.arange(0, BN)
        nmask = rn < I
        w1, s1 = _expert_ptrs(w_base, s_base, table_ptr, e, 0, ALIGN)
        w3, s3 = _expert_ptrs(w_base, s_base, table_ptr, e, 1, ALIGN)
        acc1 = tl.zeros((BM, BN), dtype=tl.float32)
        acc3 = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            a = tl.load(a_ptr + arow[:, None] + kk[None, :], mask=rmask[:, None] & (kk[None, :] < K), other=0.0)
            acc1 = _dot_t(a, dequant_tile(w1, s1, rn, nmask, k0, K, w_stride, s_stride, W_KIND, BN, BK, LOWP), acc1,
                          LOWP)
            acc3 = _dot_t(a, dequant_tile(w3, s3, rn, nmask, k0, K, w_stride, s_stride, W_KIND, BN, BK, LOWP), acc3,
                          LOWP)
        h = swiglu_tile(acc1, acc3, limit) * tl.load(wts_ptr + f, mask=rmask, other=0.0)[:, None]
        if W_KIND != 0:  # the w2 input's FP8 quantisation (BN % 32 == 0: whole groups); exact in bf16
            h = fp8_qdq_groups(h, BM, BN)
        p = (blk * BM + r).to(tl.int64)
        tl.store(h_ptr + p[:, None] * I + rn[None, :], bf16_bits16(h), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _down_kernel(h_ptr, rows_ptr, bexp_ptr, bcnt_ptr, w_base, s_base, table_ptr, y_ptr, I, D, w_stride, s_stride,
                 n_blocks, GROUP_M, W_KIND: tl.constexpr, LOWP: tl.constexpr, ALIGN: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    blk, pn = _tile_of(tl.program_id(0), n_blocks, tl.cdiv(D, BN), GROUP_M)
    e = tl.load(bexp_ptr + blk)
    if e >= 0:
        r = tl.arange(0, BM)
        rmask = r < tl.load(bcnt_ptr + blk)
        p = (blk * BM + r).to(tl.int64)
        rn = pn * BN + tl.arange(0, BN)
        nmask = rn < D
        w2, s2 = _expert_ptrs(w_base, s_base, table_ptr, e, 2, ALIGN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, I, BK):
            kk = k0 + tl.arange(0, BK)
            a = tl.load(h_ptr + p[:, None] * I + kk[None, :], mask=rmask[:, None] & (kk[None, :] < I), other=0.0)
            acc = _dot_t(a, dequant_tile(w2, s2, rn, nmask, k0, I, w_stride, s_stride, W_KIND, BN, BK, LOWP), acc,
                         LOWP)
        f = tl.load(rows_ptr + blk * BM + r, mask=rmask, other=0).to(tl.int64)
        tl.store(y_ptr + f[:, None] * D + rn[None, :], acc, mask=rmask[:, None] & nmask[None, :])


def tiles_for(t: int, topk: int, interp: bool) -> dict:
    """The default tiles for T tokens of top-k routing."""
    if interp:
        return TILES["interp"]
    r = t * topk
    return TILES["decode" if r <= 128 else ("mid" if r <= DECODE_MAX_ROWS else "prefill")]


def grouped_moe(x, weights, ids, table_args, limit, out, *, bm=None, bn_up=None, bn_down=None, bk=None,
                bk_down=None, group_m=None, num_warps=None, num_stages=None, chunk=None):
    """The grouped path of `moe_experts` (module docstring): out [T, d] fp32 <- x [T, d]."""
    from .fp8_quant import fp8_qdq_bf16
    from .launch import interpreting
    from .moe_experts import _combine_kernel

    w_base, s_base, table, kind, inter, d, (s_up, s_down), align = table_args
    n_exp = table.shape[0]
    interp = interpreting()
    t, topk = ids.shape
    r = t * topk
    tl_ = tiles_for(t, topk, interp)
    bm = bm or tl_["bm"]
    bn_up, bn_down = bn_up or tl_["bn_up"], bn_down or tl_["bn_down"]
    bk_up = bk or tl_["bk"]
    bk_down = bk_down or bk_up
    if bn_up % 32 or inter % 32 or d % 32 or bk_up % 32 or bk_down % 32 or bm < 16:
        raise ValueError("moe_experts grouped path: widths, BN and BK must be multiples of 32, BM >= 16")
    kw = {} if interp else {"num_warps": num_warps or tl_["num_warps"], "num_stages": num_stages or tl_["num_stages"]}
    flat_ids = ids.contiguous().reshape(-1)
    rows, bexp, bcnt = align_rows(flat_ids, n_exp, bm, chunk)
    n_blocks = bexp.numel()
    gm = group_m or tl_.get("group_m") or n_blocks
    a = fp8_qdq_bf16(x) if kind != W_DENSE else x.to(torch.bfloat16).contiguous()
    h = _buffer((n_blocks * bm, inter), torch.bfloat16, x.device)
    y = _buffer((r, d), torch.float32, x.device)

    def w_row(k_in):  # a weight row in storage elements (bytes for packed FP4)
        return k_in // 2 if kind == W_FP4 else k_in

    _gate_up_kernel[(n_blocks * -(-inter // bn_up),)](
        a, rows, bexp, bcnt, weights.float().contiguous().reshape(-1), w_base, s_base, table, h.view(torch.int16),
        d, inter, w_row(d), s_up, float(limit), n_blocks, gm, TOPK=topk, W_KIND=kind, LOWP=not interp, ALIGN=align,
        BM=bm, BN=bn_up, BK=bk_up, **kw)
    _down_kernel[(n_blocks * -(-d // bn_down),)](
        h, rows, bexp, bcnt, w_base, s_base, table, y, inter, d, w_row(inter), s_down, n_blocks, gm, W_KIND=kind,
        LOWP=not interp, ALIGN=align, BM=bm, BN=bn_down, BK=bk_down, **kw)
    cb = min(1024, triton.next_power_of_2(d))
    _combine_kernel[(t, -(-d // cb))](y, flat_ids, out, d, TOPK=topk, BLOCK=cb)
    return out
