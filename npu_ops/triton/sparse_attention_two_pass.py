"""Sparse attention (CSA2) at decode batches in two passes: every logit first, then the values.

Same op, inputs and numerics class as `sparse_attention.py` (the oracle is
`sparse_attention_ref`); what differs is the work split. The single-pass decode table tiles the
output channels (128 of 512 a tile) and so computes each query's q.k^T over all 512 channels once
per output block, four times in all, with an online softmax along the entries. Here:

- pass 1 (`_logits_kernel`): a tile is (query, entry block, head block); it decodes its
  BLOCK_N entries once, in BLOCK_D-channel chunks, and writes the scaled logits [heads, BLOCK_N]
  (fp32, masked entries -inf) and their per-block maximum. Every (query, block) is its own tile,
  so one token's 20 blocks already fill 20 SMs and a decode batch of 64 gives 1280 tiles;
- pass 2 (`_values_kernel`): a tile is (query, split, head block, output-channel block); it
  takes the exact maximum over the block maxima, then for each of its entry blocks loads the
  logits, p = exp(logit - max) (rounded to bf16 for p.V, summed in fp32: the reference's form,
  with the global maximum rather than a running one), decodes only its BLOCK_DV channels of the
  entries and accumulates p.V. One split writes bf16 directly; several write fp32 partials with
  the same maximum, which `sparse_attention._combine_kernel` adds (its rescaling factors are 1).

So q.k^T is computed once per query and every entry is decoded once for K and once (in slices)
for V; the logits round trip costs H x entries x 8 bytes a query (L2-resident at decode sizes).

KV_X2 (the CUDA decode table's default; `DSV41_SPARSE_KV_X2=0` turns it off): both passes decode the cache rows straight to bf16 pairs,
every value times KV_SHIFT, which the logits pass undoes on its softmax scale and the values pass
on its accumulator (`sparse_attention._kv_decode_x2`, the module docstring there).

LOGITS_BLOCK_N (opt-in, a launch option): the logits pass in `_logits_pools_kernel`, on entry
blocks of its own size with each pool in its own loop (the decode fixed at compile time instead of
both decodes behind a run-time branch), writing the logits at the values pass's positions; only
the block maxima differ in count. Larger logits blocks spread a chunk's fixed work (the q chunk,
the index row, the dot's setup) over more entries: with KV_X2 at sm_90a (triton 3.6) 9.3
instructions an entry and chunk at 32 entries, 7.1-7.3 at 64 (168-register cap, 4 bytes of spill).
H100 2026-12-07 (`sweep_kernels.py --only sparse_x2`, graph us, KV_X2, cap 168): T=64 at 4K 68.6
shared loop, 67.1 per pool at 32, 66.2 at 64; T=1 at 64K 14.8, 18.4, 22.4 (fewer tiles). Gains
of ~2 us a layer at 64 tokens: no table takes it. The values pass keeps BLOCK_N, where 64-entry
blocks cost more per entry.

LOGITS_SPLIT_D (a launch option; one token's decode entry on CUDA since session forty-seven, by
`sparse_attention.config_for`'s default form "split_d"; for one token at a long context, where
the logits pass has one tile per 32-entry block, 20 at 640 entries, each walking all four channel
chunks):
the logits pass takes a tile per BLOCK_D-channel chunk too and writes each chunk's scaled
partial logits (lg [chunks, T, H, entries]); the values pass sums a block's chunks in chunk order,
takes its split's own maximum over its blocks first (no block maxima), and the combine rescales
the splits as the one-pass form's do. The sums differ from the fused form's only in rounding
order. sm_90a (triton 3.6), KV_X2: the split logits kernel 128 registers (4 programs an SM), the
values kernel 226. H100 (2026-12-07), T=1 at 64K: 11.9 us against the one-pass kernel's 14.4; at
T=64 slower (113 against 68 us), so only one token takes it.

Used through `sparse_attention_launch(..., TWO_PASS=True)` (a tile table entry); CUDA timing in
benchmarks/RESULTS.md. Written for CUDA and the interpreters; on Ascend it is unverified on
hardware (no table selects it there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_start
from .sparse_attention import (KV_UNSHIFT, RUNNING_MAX_INIT, _dot_in, _entry_rows, _kv_block, _kv_decode,
                               _kv_decode_x2, _kv_raw, _load_halves, _store_halves, _to_bf16)


@triton.jit
def _entry_block(widx_ptr, gidx_ptr, tq, nb, S, K, n_wb, BLOCK_N: tl.constexpr):
    """Pool rows [BN] (int64, 0 where masked), their validity, and whether entry block nb of query
    tq is a global block (blocks < n_wb are window blocks)."""
    nn = tl.arange(0, BLOCK_N)
    is_glob = nb >= n_wb
    if is_glob:
        k_idx = (nb - n_wb) * BLOCK_N + nn
        idx = tl.load(gidx_ptr + tq.to(tl.int64) * K + k_idx, mask=k_idx < K, other=-1).to(tl.int64)
    else:  # (both branches int64: the two index lists may be int32 and int64)
        s_idx = nb * BLOCK_N + nn
        idx = tl.load(widx_ptr + tq.to(tl.int64) * S + s_idx, mask=s_idx < S, other=-1).to(tl.int64)
    return tl.maximum(idx, 0), idx >= 0, is_glob


@triton.jit
def _entry_cols(win_ptr, wsc_ptr, gkv_ptr, gsc_ptr, rows, ok, is_glob, c0, W: tl.constexpr,
                BLOCK_N: tl.constexpr, w_stride, ws_stride, g_stride, gs_stride, X2: tl.constexpr, ASM: tl.constexpr):
    """Channels c0 .. c0 + W of the block's entries as even / odd halves [BN, W/2] (exact bf16
    values; times KV_SHIFT with X2), from the window (FP8) or the global (FP4) pool."""
    if is_glob:
        e, o = _kv_block(gkv_ptr, gsc_ptr, rows, ok, c0, W, BLOCK_N, True, g_stride, gs_stride, X2, ASM)
    else:
        e, o = _kv_block(win_ptr, wsc_ptr, rows, ok, c0, W, BLOCK_N, False, w_stride, ws_stride, X2, ASM)
    return e, o


@triton.jit
def _qk_add(s, qe, qo, k_e, k_o, DOT_BF16: tl.constexpr):
    """s + q.k^T over one chunk, as the even and the odd channel halves' two dots."""
    s += tl.dot(_dot_in(qe.to(tl.float32), DOT_BF16), tl.trans(_dot_in(k_e, DOT_BF16)))
    return s + tl.dot(_dot_in(qo.to(tl.float32), DOT_BF16), tl.trans(_dot_in(k_o, DOT_BF16)))


@triton.jit
def _logits_kernel(q_ptr, win_ptr, wsc_ptr, widx_ptr, gkv_ptr, gsc_ptr, gidx_ptr, lg_ptr, mb_ptr,
                   H, S, K, n_wb, n_blocks, n_hb, n_tiles, num_programs, scale,
                   w_stride, ws_stride, g_stride, gs_stride,
                   D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   DOT_BF16: tl.constexpr, KV_X2: tl.constexpr = False, ASM: tl.constexpr = False,
                   SPLIT_D: tl.constexpr = False, lg_cstride=0, PDL: tl.constexpr = 0):
    """Pass 1: tile (query, entry block, head block) -> scaled logits lg[query, heads, block's
    entries] (fp32, -inf where masked) and their maximum mb[query, heads, block]. KV_X2: keys
    decoded by `_kv_decode_x2` (times KV_SHIFT), which the softmax scale undoes. SPLIT_D: a tile
    per BLOCK_D-channel chunk as well, writing that chunk's scaled partial logits at lg +
    chunk * lg_cstride (no maxima: the values pass sums the chunks and takes its own)."""
    pdl_start(PDL)
    if KV_X2:
        scale = scale * KV_UNSHIFT
    NC: tl.constexpr = D // BLOCK_D if SPLIT_D else 1
    pid = tl.program_id(0)
    nn = tl.arange(0, BLOCK_N)
    n_e = n_blocks * BLOCK_N
    for tile in range(pid, n_tiles, num_programs):
        ck = tile % NC  # (the chunk innermost: a block's chunk tiles share its index row in L2)
        hb = (tile // NC) % n_hb
        r = tile // NC // n_hb
        nb = r % n_blocks
        tq = r // n_blocks
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hok = heads < H
        qrow = (tq * H + heads).to(tl.int64) * D
        rows, ok, is_glob = _entry_block(widx_ptr, gidx_ptr, tq, nb, S, K, n_wb, BLOCK_N)
        hrow = (tq * H + heads).to(tl.int64)
        if SPLIT_D:  # (its own straight-line body: as a one-trip chunk loop it took 152 registers, not 128)
            c0 = ck * BLOCK_D
            qe, qo = _load_halves(q_ptr, qrow, hok, c0, BLOCK_D, BLOCK_H)
            k_e, k_o = _entry_cols(win_ptr, wsc_ptr, gkv_ptr, gsc_ptr, rows, ok, is_glob, c0, BLOCK_D, BLOCK_N,
                                   w_stride, ws_stride, g_stride, gs_stride, KV_X2, ASM)
            s = _qk_add(tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32), qe, qo, k_e, k_o, DOT_BF16)
            s = tl.where(ok[None, :], s * scale, float("-inf"))
            tl.store(lg_ptr + ck * lg_cstride + hrow[:, None] * n_e + (nb * BLOCK_N + nn)[None, :], s,
                     mask=hok[:, None])
        else:
            s = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
            for c0 in range(0, D, BLOCK_D):
                qe, qo = _load_halves(q_ptr, qrow, hok, c0, BLOCK_D, BLOCK_H)
                k_e, k_o = _entry_cols(win_ptr, wsc_ptr, gkv_ptr, gsc_ptr, rows, ok, is_glob, c0, BLOCK_D, BLOCK_N,
                                       w_stride, ws_stride, g_stride, gs_stride, KV_X2, ASM)
                s = _qk_add(s, qe, qo, k_e, k_o, DOT_BF16)
            s = tl.where(ok[None, :], s * scale, float("-inf"))
            tl.store(lg_ptr + hrow[:, None] * n_e + (nb * BLOCK_N + nn)[None, :], s, mask=hok[:, None])
            tl.store(mb_ptr + hrow * n_blocks + nb, tl.max(s, axis=1), mask=hok)


@triton.jit
def _logits_pool_tiles(q_ptr, kv_ptr, sc_ptr, idx_ptr, lg_ptr, mb_ptr, pid, num_programs, n_tiles, n_lb, n_hb, H, L,
                       pos0, n_pos, mb0, n_e, n_mb, scale, kv_stride, sc_stride,
                       D: tl.constexpr, BLOCK_H: tl.constexpr, LBN: tl.constexpr, BLOCK_D: tl.constexpr,
                       IS_GLOB: tl.constexpr, DOT_BF16: tl.constexpr, KV_X2: tl.constexpr, ASM: tl.constexpr):
    """`_logits_pools_kernel`'s tiles of one pool (IS_GLOB fixed at compile time): tile (query,
    LBN-entry block j, head block) writes the logits of entries j*LBN .. of the query's index list
    (length L) at lg positions pos0 + entry (those below n_pos) and their maximum at mb column
    mb0 + j."""
    nn = tl.arange(0, LBN)
    for tile in range(pid, n_tiles, num_programs):
        hb = tile % n_hb
        r = tile // n_hb
        j = r % n_lb
        tq = r // n_lb
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hok = heads < H
        qrow = (tq * H + heads).to(tl.int64) * D
        rows, ok = _entry_rows(idx_ptr, tq, L, j, True, LBN)
        s = tl.zeros([BLOCK_H, LBN], dtype=tl.float32)
        for c0 in range(0, D, BLOCK_D):
            qe, qo = _load_halves(q_ptr, qrow, hok, c0, BLOCK_D, BLOCK_H)
            k_e, k_o = _kv_block(kv_ptr, sc_ptr, rows, ok, c0, BLOCK_D, LBN, IS_GLOB, kv_stride, sc_stride, KV_X2, ASM)
            s = _qk_add(s, qe, qo, k_e, k_o, DOT_BF16)
        s = tl.where(ok[None, :], s * scale, float("-inf"))
        hrow = (tq * H + heads).to(tl.int64)
        e = j * LBN + nn
        tl.store(lg_ptr + hrow[:, None] * n_e + (pos0 + e)[None, :], s, mask=hok[:, None] & (e < n_pos)[None, :])
        tl.store(mb_ptr + hrow * n_mb + mb0 + j, tl.max(s, axis=1), mask=hok)


@triton.jit
def _logits_pools_kernel(q_ptr, win_ptr, wsc_ptr, widx_ptr, gkv_ptr, gsc_ptr, gidx_ptr, lg_ptr, mb_ptr,
                         H, S, K, n_wpos, n_gpos, n_wl, n_gl, n_hb, n_wtiles, n_gtiles, n_e, num_programs, scale,
                         w_stride, ws_stride, g_stride, gs_stride,
                         D: tl.constexpr, BLOCK_H: tl.constexpr, LBN: tl.constexpr, BLOCK_D: tl.constexpr,
                         DOT_BF16: tl.constexpr, KV_X2: tl.constexpr = False, ASM: tl.constexpr = False,
                         PDL: tl.constexpr = 0):
    """Pass 1 with its own entry blocks (`LOGITS_BLOCK_N`): the window tiles, then the global
    tiles, each pool in its own loop with the pool fixed at compile time (`_logits_kernel` holds
    both decodes behind a run-time branch). The logits land at the values pass's positions
    (window entry e at e, global entry e at n_wpos + e, the pools' padded lengths in BLOCK_N
    blocks), so the values pass is unchanged; the maxima are one per LBN block of each pool."""
    pdl_start(PDL)
    if KV_X2:
        scale = scale * KV_UNSHIFT
    pid = tl.program_id(0)
    n_mb = n_wl + n_gl
    _logits_pool_tiles(q_ptr, win_ptr, wsc_ptr, widx_ptr, lg_ptr, mb_ptr, pid, num_programs, n_wtiles, n_wl, n_hb,
                       H, S, 0, n_wpos, 0, n_e, n_mb, scale, w_stride, ws_stride,
                       D, BLOCK_H, LBN, BLOCK_D, False, DOT_BF16, KV_X2, ASM)
    _logits_pool_tiles(q_ptr, gkv_ptr, gsc_ptr, gidx_ptr, lg_ptr, mb_ptr, pid, num_programs, n_gtiles, n_gl, n_hb,
                       H, K, n_wpos, n_gpos, n_wl, n_e, n_mb, scale, g_stride, gs_stride,
                       D, BLOCK_H, LBN, BLOCK_D, True, DOT_BF16, KV_X2, ASM)


@triton.jit
def _block_logits(lg_ptr, hrow, hok, nb, n_e, lg_cstride, BLOCK_N: tl.constexpr, LG_PARTS: tl.constexpr):
    """Entry block nb's logits [BH, BN] (-inf where masked): the one stored row, or with LG_PARTS
    chunk partials their sum in chunk order."""
    off = hrow[:, None] * n_e + (nb * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    s = tl.load(lg_ptr + off, mask=hok[:, None], other=float("-inf"))
    for c in tl.static_range(1, LG_PARTS):
        s += tl.load(lg_ptr + c * lg_cstride + off, mask=hok[:, None], other=float("-inf"))
    return s


@triton.jit
def _values_range(lg_ptr, hrow, hok, m, l_i, acc_e, acc_o, idx_ptr, tq, L, off, lo, hi, kv_ptr, sc_ptr,
                  kv_stride, sc_stride, dv0, n_e, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
                  IS_GLOB: tl.constexpr, DOT_BF16: tl.constexpr, AHEAD: tl.constexpr, KV_X2: tl.constexpr,
                  ASM: tl.constexpr, LG_PARTS: tl.constexpr = 1, lg_cstride=0):
    """p.V over entry blocks lo .. hi, all from one pool (block nb holds entries (nb - off) * BN ..
    of the query's index list idx_ptr [T, L]): each block's logits loaded, p = exp(logit - m)
    summed into l_i and rounded to bf16, its BLOCK_DV channels decoded and accumulated. AHEAD:
    the next block's index row and bytes are requested before this block's math, so the gather's
    latency (index row, then the rows it names) overlaps the work instead of preceding it.
    KV_X2: values decoded by `_kv_decode_x2` (times KV_SHIFT; the caller undoes it)."""
    if AHEAD:
        rows, ok = _entry_rows(idx_ptr, tq, L, lo - off, lo < hi, BLOCK_N)
        vb, vs = _kv_raw(kv_ptr, sc_ptr, rows, ok, dv0, BLOCK_DV, IS_GLOB, kv_stride, sc_stride)
    for nb in range(lo, hi):
        if AHEAD:
            cb, cs = vb, vs
            rows, ok = _entry_rows(idx_ptr, tq, L, nb + 1 - off, nb + 1 < hi, BLOCK_N)
            vb, vs = _kv_raw(kv_ptr, sc_ptr, rows, ok, dv0, BLOCK_DV, IS_GLOB, kv_stride, sc_stride)
        else:
            rows, ok = _entry_rows(idx_ptr, tq, L, nb - off, True, BLOCK_N)
            cb, cs = _kv_raw(kv_ptr, sc_ptr, rows, ok, dv0, BLOCK_DV, IS_GLOB, kv_stride, sc_stride)
        s = _block_logits(lg_ptr, hrow, hok, nb, n_e, lg_cstride, BLOCK_N, LG_PARTS)
        p = tl.exp(s - m[:, None])
        l_i += tl.sum(p, axis=1)
        pb = _to_bf16(p, DOT_BF16)  # probabilities rounded to bf16 (nearest even) for p.V
        if not DOT_BF16:
            pb = pb.to(tl.float32)
        if KV_X2:  # (masked entries: zero bytes, p = 0)
            v_e, v_o = _kv_decode_x2(cb, cs, BLOCK_DV, BLOCK_N, IS_GLOB, ASM)
        else:
            v_e, v_o = _kv_decode(cb, cs, BLOCK_DV, BLOCK_N, IS_GLOB)
        acc_e = tl.dot(pb, _dot_in(v_e, DOT_BF16), acc_e)
        acc_o = tl.dot(pb, _dot_in(v_o, DOT_BF16), acc_o)
    return l_i, acc_e, acc_o


@triton.jit
def _values_kernel(lg_ptr, mb_ptr, win_ptr, wsc_ptr, widx_ptr, gkv_ptr, gsc_ptr, gidx_ptr, sink_ptr,
                   out_ptr, pacc_ptr, pm_ptr, pl_ptr,
                   H, S, K, n_wb, n_blocks, n_mb, bps, n_split, n_hb, n_dv, n_tiles, num_programs,
                   w_stride, ws_stride, g_stride, gs_stride,
                   D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
                   NB_MAX: tl.constexpr, SPLIT: tl.constexpr, DOT_BF16: tl.constexpr, AHEAD: tl.constexpr = False,
                   KV_X2: tl.constexpr = False, ASM: tl.constexpr = False, LG_PARTS: tl.constexpr = 1,
                   lg_cstride=0, PDL: tl.constexpr = 0):
    """Pass 2: tile (query, split, head block, output-channel block) -> p.V over the split's
    entry blocks with the query's exact maximum (over the logits pass's n_mb block maxima; window
    blocks, then global ones: `_values_range`; LG_PARTS > 1, the logits pass's SPLIT_D: each
    block's logits are the sum of that many chunk partials and the maximum is the split's own,
    taken over its blocks first, the combine rescaling the splits);
    normalised bf16 output, or (SPLIT) the fp32 partial, that maximum and the partial sum for
    `_combine_kernel`. KV_X2: values times KV_SHIFT, undone on the accumulator at the end."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    bb = tl.arange(0, NB_MAX)
    n_e = n_blocks * BLOCK_N
    for tile in range(pid, n_tiles, num_programs):
        dvb = tile % n_dv
        r = tile // n_dv
        hb = r % n_hb
        r = r // n_hb
        sp = r % n_split
        tq = r // n_split
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hok = heads < H
        hrow = (tq * H + heads).to(tl.int64)
        b_lo = sp * bps
        b_hi = tl.minimum(b_lo + bps, n_blocks)
        if LG_PARTS > 1:
            m = tl.full([BLOCK_H], RUNNING_MAX_INIT, dtype=tl.float32)
            for nb in range(b_lo, b_hi):
                m = tl.maximum(m, tl.max(_block_logits(lg_ptr, hrow, hok, nb, n_e, lg_cstride, BLOCK_N, LG_PARTS),
                                         axis=1))
        else:
            mbs = tl.load(mb_ptr + hrow[:, None] * n_mb + bb[None, :], mask=hok[:, None] & (bb < n_mb)[None, :],
                          other=float("-inf"))
            m = tl.maximum(tl.max(mbs, axis=1), RUNNING_MAX_INIT)  # an all-masked row: p = 0 everywhere
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc_e = tl.zeros([BLOCK_H, BLOCK_DV // 2], dtype=tl.float32)
        acc_o = tl.zeros([BLOCK_H, BLOCK_DV // 2], dtype=tl.float32)
        dv0 = dvb * BLOCK_DV
        l_i, acc_e, acc_o = _values_range(lg_ptr, hrow, hok, m, l_i, acc_e, acc_o, widx_ptr, tq, S, 0, b_lo,
                                          tl.minimum(b_hi, n_wb), win_ptr, wsc_ptr, w_stride, ws_stride, dv0, n_e,
                                          BLOCK_N, BLOCK_DV, False, DOT_BF16, AHEAD, KV_X2, ASM, LG_PARTS, lg_cstride)
        l_i, acc_e, acc_o = _values_range(lg_ptr, hrow, hok, m, l_i, acc_e, acc_o, gidx_ptr, tq, K, n_wb,
                                          tl.maximum(b_lo, n_wb), b_hi, gkv_ptr, gsc_ptr, g_stride, gs_stride, dv0,
                                          n_e, BLOCK_N, BLOCK_DV, True, DOT_BF16, AHEAD, KV_X2, ASM, LG_PARTS, lg_cstride)
        if KV_X2:
            acc_e = acc_e * KV_UNSHIFT
            acc_o = acc_o * KV_UNSHIFT
        if SPLIT:
            prow = ((tq * n_split + sp) * H + heads).to(tl.int64)
            _store_halves(pacc_ptr, prow * D, hok, dv0, acc_e, acc_o, BLOCK_DV, BLOCK_H)
            first = hok & (dvb == 0)
            tl.store(pm_ptr + prow, m, mask=first)
            tl.store(pl_ptr + prow, l_i, mask=first)
        else:
            sk = tl.load(sink_ptr + heads, mask=hok, other=0.0).to(tl.float32)
            inv = 1.0 / (l_i + tl.exp(sk - m))
            _store_halves(out_ptr, hrow * D, hok, dv0, _to_bf16(acc_e * inv[:, None], DOT_BF16),
                          _to_bf16(acc_o * inv[:, None], DOT_BF16), BLOCK_DV, BLOCK_H)


def launch_two_pass(qc, wk, ws, wi, gk, gs, gi, sk, out, softmax_scale, *, s: int, k: int, block_h: int,
                    block_n: int, block_d: int, block_dv: int, n_split: int | None, min_blocks_per_split: int,
                    kw: dict, dot_bf16: bool, logits_kw: dict | None = None, values_ahead: bool = False,
                    kv_x2: bool = False, asm: bool = False, logits_block_n: int | None = None,
                    logits_split_d: bool = False):
    """Both passes for `sparse_attention_launch` (inputs already validated and viewed as there;
    `logits_kw`: launch options for the logits pass alone, e.g. a register cap; `values_ahead`:
    the values pass's AHEAD; `kv_x2` / `asm`: the kernels' KV_X2 / ASM; `logits_block_n`: the
    logits pass in `_logits_pools_kernel` on blocks of that many entries; `logits_split_d`: the
    logits pass's SPLIT_D, a tile per channel chunk); returns (n_split,
    pacc, pm, pl) for its combine step (n_split 1: `out` is written)."""
    from .launch import grid_for, num_workers
    from .sparse_attention import _auto_splits, split_buffers

    t, h, d = qc.shape
    dev = qc.device
    n_hb = -(-h // block_h)
    n_wb = -(-s // block_n)
    n_blocks = n_wb + -(-k // block_n)
    n_e = n_blocks * block_n
    n_parts = d // block_d if logits_split_d else 1
    lg = torch.empty(n_parts, t, h, n_e, dtype=torch.float32, device=dev)
    if logits_block_n:
        # every padded position the values pass reads is written (whatever the two block sizes)
        n_wl, n_gl = -(-n_wb * block_n // logits_block_n), -(-(n_e - n_wb * block_n) // logits_block_n)
        n_mb = n_wl + n_gl
        mb = torch.empty(t, h, n_mb, dtype=torch.float32, device=dev)
        n_wt, n_gt = t * n_wl * n_hb, t * n_gl * n_hb
        l_grid = grid_for(max(n_wt, n_gt), dev, cores="cube")
        _logits_pools_kernel[(l_grid,)](qc, wk, ws, wi, gk, gs, gi, lg, mb, h, s, k, n_wb * block_n, n_e - n_wb * block_n,
                                        n_wl, n_gl, n_hb, n_wt, n_gt, n_e, l_grid, float(softmax_scale),
                                        wk.stride(0), ws.stride(0), gk.stride(0), gs.stride(0),
                                        D=d, BLOCK_H=block_h, LBN=logits_block_n, BLOCK_D=block_d, DOT_BF16=dot_bf16,
                                        KV_X2=bool(kv_x2), ASM=bool(asm), **kw, **(logits_kw or {}), **pdl_launch(qc))
    else:
        n_mb = n_blocks
        mb = torch.empty(t, h, n_blocks, dtype=torch.float32, device=dev)
        l_tiles = t * n_blocks * n_hb * n_parts
        l_grid = grid_for(l_tiles, dev, cores="cube")
        _logits_kernel[(l_grid,)](qc, wk, ws, wi, gk, gs, gi, lg, mb, h, s, k, n_wb, n_blocks, n_hb, l_tiles, l_grid,
                                  float(softmax_scale), wk.stride(0), ws.stride(0), gk.stride(0), gs.stride(0),
                                  D=d, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, DOT_BF16=dot_bf16,
                                  KV_X2=bool(kv_x2), ASM=bool(asm), SPLIT_D=n_parts > 1, lg_cstride=lg[0].numel(),
                                  **kw, **(logits_kw or {}), **pdl_launch(qc))
    n_dv = d // block_dv
    base_tiles = t * n_hb * n_dv
    if n_split is None:
        n_split = _auto_splits(base_tiles, n_blocks, num_workers(dev, "cube"), min_blocks_per_split)
    n_split, bps, pacc, pm, pl = split_buffers(out, n_blocks, n_split)
    v_tiles = base_tiles * n_split
    v_grid = grid_for(v_tiles, dev, cores="cube")
    _values_kernel[(v_grid,)](lg, mb, wk, ws, wi, gk, gs, gi, sk, out, pacc, pm, pl,
                              h, s, k, n_wb, n_blocks, n_mb, bps, n_split, n_hb, n_dv, v_tiles, v_grid,
                              wk.stride(0), ws.stride(0), gk.stride(0), gs.stride(0),
                              D=d, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_DV=block_dv,
                              NB_MAX=triton.next_power_of_2(n_mb), SPLIT=n_split > 1, DOT_BF16=dot_bf16,
                              AHEAD=bool(values_ahead), KV_X2=bool(kv_x2), ASM=bool(asm), LG_PARTS=n_parts,
                              lg_cstride=lg[0].numel(), **kw, **pdl_launch(lg))
    return n_split, pacc, pm, pl
