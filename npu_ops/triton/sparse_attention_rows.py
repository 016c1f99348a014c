"""Sparse attention over rows decoded once per launch (the "rows" form, CUDA prefill shapes).

The one-pass kernels (`sparse_attention.py`) decode every gathered FP8 / FP4 entry inside the
attention loop, once per query token: at a prefill chunk the same pool row is decoded again
for every token that selects it (hundreds of times), and the decode's integer work sits on the
loop's critical path between the gather and the tensor cores. This form decodes each pool row
the launch reads once, into a dense bf16 table, and the attention loop then gathers bf16 rows
straight into the MMA (the values are the same: every decoded value is exact in bf16).

Two steps per launch:
1. `dense_table`: the pool rows the queries read, numbered densely: `_mark_kernel` sets a flag
   per pool row an index list names (window rows, then global rows, in one flag array), a prefix
   sum numbers them; `_decode_rows_kernel` decodes every flagged row to bf16 into its slot (FP8
   window rows with E8M0 scales per 32 channels; packed FP4 global rows, element 0 in the low
   nibble, with E4M3 scales per 16), in channel order; `_entries_kernel` rewrites each query's
   window and global lists as table rows. Nothing is read back to the host: the table is sized
   by a bound known before the launch, the least of the pool's rows, the index lists' entries
   and the caller's `rows_bound` (the rows the step's block tables reach). A slot past the
   table (a bound that was too small) is neither written nor read: its entries are masked.
2. `_rows_attn_kernel`: a program per (query, head block); the query's entries are its window
   rows followed by its global rows as dense ids ([T, S + K], -1 = masked). Each block of
   BLOCK_N entries is one gather of bf16 rows (triton pipelines it, cp.async on CUDA), then
   q.k^T, the online softmax of `sparse_attention._online_softmax` (running max from -1e30,
   masked logits -inf, probabilities rounded to bf16 before p.V, fp32 sum) and p.V with the
   same rows as V (K = V); the sink adds exp(sink - max) to the denominator; bf16 out.

The oracle is `sparse_attention_ref`; `tests/test_triton_sparse_attention.py` compares.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_start
from .sparse_attention import RUNNING_MAX_INIT, _e2m1_fast, _e4m3_pos, _e4m3_signed, _online_softmax, \
    _q_in, _rows_view, _to_bf16

DECODE_ROWS = 32  # pool rows per program of the decode kernel
MARK_BLOCK = 1024  # index entries per program of the mark and entry kernels


@triton.jit
def _mark_kernel(idx_ptr, n, flag_ptr, offset, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    """flag[offset + row] = 1 for every row >= 0 among the n indices (every writer stores 1)."""
    pdl_start(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    r = tl.load(idx_ptr + i, mask=i < n, other=-1)
    tl.store(flag_ptr + offset + r, tl.full([BLOCK], 1, tl.int32), mask=r >= 0)


@triton.jit
def _entries_kernel(widx_ptr, gidx_ptr, id_ptr, out_ptr, n, S, K, n_win, cap, BLOCK: tl.constexpr,
                    PDL: tl.constexpr = 0):
    """out [T, S + K] (flat, n elements): window list entries then global list entries as table
    rows (the prefix sum id_ptr over window flags, then global flags, minus one); -1 where
    masked or past the table's cap rows."""
    pdl_start(PDL)
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = e < n
    tq = e // (S + K)
    j = e % (S + K)
    win = j < S
    rw = tl.load(widx_ptr + tq.to(tl.int64) * S + j, mask=live & win, other=-1)
    rg = tl.load(gidx_ptr + tq.to(tl.int64) * K + (j - S), mask=live & (j >= S), other=-1)
    r = tl.where(win, rw, rg)
    slot = tl.load(id_ptr + tl.where(win, rw, rg + n_win), mask=live & (r >= 0), other=0) - 1
    tl.store(out_ptr + e, tl.where((r >= 0) & (slot < cap), slot, -1).to(tl.int32), mask=live)


@triton.jit
def _decode_rows_kernel(kv_ptr, sc_ptr, flag_ptr, id_ptr, out_ptr, n_rows, cap, kv_stride, sc_stride,
                        D: tl.constexpr, IS_GLOB: tl.constexpr, ROWS: tl.constexpr, NATIVE: tl.constexpr,
                        PDL: tl.constexpr = 0):
    """Pool rows pid*ROWS .. : each flagged one decoded to bf16 [D] into out[id - 1] (ids below
    cap only; id = the prefix sum of the flags). Window (FP8)
    rows: byte c is channel c, times 2^(E8M0 byte of c // 32 - 127); global (FP4) rows: channel
    c is nibble c % 2 of byte c // 2, times the E4M3 scale of c // 16."""
    pdl_start(PDL)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = tl.load(flag_ptr + r, mask=r < n_rows, other=0) > 0
    dst = tl.load(id_ptr + r, mask=live, other=0) - 1
    live &= dst < cap
    dst = dst.to(tl.int64)
    c = tl.arange(0, D)
    rr = r.to(tl.int64)[:, None]
    m2 = live[:, None]
    if IS_GLOB:
        b = tl.load(kv_ptr + rr * kv_stride + c[None, :] // 2, mask=m2, other=0).to(tl.int32) & 0xFF
        s = tl.load(sc_ptr + rr * sc_stride + c[None, :] // 16, mask=m2, other=0).to(tl.int32) & 0x7F
        v = _e2m1_fast((b >> ((c[None, :] & 1) * 4)) & 15) * _e4m3_pos(s)
    else:
        b = tl.load(kv_ptr + rr * kv_stride + c[None, :], mask=m2, other=0).to(tl.int32) & 0xFF
        s = tl.load(sc_ptr + rr * sc_stride + c[None, :] // 32, mask=m2, other=0).to(tl.int32) & 0xFF
        v = _e4m3_signed(b) * (s << 23).to(tl.float32, bitcast=True)
    tl.store(out_ptr + dst[:, None] * D + c[None, :], _to_bf16(v, NATIVE), mask=m2)


@triton.jit
def _rows_attn_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, H, E, n_hb, scale,
                      D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
                      DOT_BF16: tl.constexpr, PDL: tl.constexpr = 0):
    """One (query, head block) per program over its E entries (dense bf16 rows, -1 = masked)."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    hb = pid % n_hb
    tq = pid // n_hb
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hok = heads < H
    qrow = (tq * H + heads).to(tl.int64) * D
    c = tl.arange(0, D)
    q = _q_in(tl.load(q_ptr + qrow[:, None] + c[None, :], mask=hok[:, None], other=0.0), DOT_BF16)
    m_i = tl.full([BLOCK_H], RUNNING_MAX_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    base = tq.to(tl.int64) * E
    for e0 in tl.range(0, E, BLOCK_N, num_stages=STAGES):
        j = e0 + tl.arange(0, BLOCK_N)
        r = tl.load(idx_ptr + base + j, mask=j < E, other=-1)
        ok = r >= 0
        k = _q_in(tl.load(kv_ptr + tl.maximum(r, 0).to(tl.int64)[:, None] * D + c[None, :], mask=ok[:, None],
                          other=0.0), DOT_BF16)
        s = tl.dot(q, tl.trans(k))
        m_i, l_i, alpha, pb = _online_softmax(s, ok, m_i, l_i, scale, DOT_BF16)
        acc = tl.dot(pb, k, acc * alpha[:, None])
    sk = tl.load(sink_ptr + heads, mask=hok, other=0.0).to(tl.float32)
    inv = 1.0 / (l_i + tl.exp(sk - m_i))
    tl.store(out_ptr + qrow[:, None] + c[None, :], _to_bf16(acc * inv[:, None], DOT_BF16), mask=hok[:, None])


def dense_table(swa_kv, swa_scale, win_idx, glob_kv=None, glob_scale=None, glob_idx=None,
                rows_bound: tuple[int, int] | None = None):
    """(table [U, D] bf16: every pool row the lists read, decoded once, window rows first;
    entries [T, S + K] int32: each query's window rows then its global rows as table rows, -1 =
    masked). U = the bound described in the module docstring; no host read."""
    from .launch import as_int8, interpreting

    t, s = win_idx.shape
    d = swa_kv.shape[1]
    have_glob = glob_idx is not None and glob_idx.shape[-1] > 0
    k = glob_idx.shape[1] if have_glob else 0
    dev = swa_kv.device
    wk, ws = as_int8(_rows_view(swa_kv)), as_int8(_rows_view(swa_scale))
    wi = win_idx.contiguous()
    nw = wk.shape[0]
    if have_glob:
        gk, gs, gi = as_int8(_rows_view(glob_kv)), as_int8(_rows_view(glob_scale)), glob_idx.contiguous()
    else:
        gk, gs, gi = wk, ws, wi  # placeholders: no global entry (K = 0)
    ng = gk.shape[0] if have_glob else 0
    cap = [min(nw, t * s), min(ng, t * k)]
    if rows_bound is not None:
        cap = [min(c, max(0, int(b))) for c, b in zip(cap, rows_bound)]
    flags = torch.zeros(nw + ng, dtype=torch.int32, device=dev)
    for idx, n, off in ((wi, t * s, 0), (gi, t * k, nw)):
        if n:
            _mark_kernel[(triton.cdiv(n, MARK_BLOCK),)](idx, n, flags, off, BLOCK=MARK_BLOCK, **pdl_launch(swa_kv))
    ids = torch.cumsum(flags, 0, dtype=torch.int32)  # a flagged row's slot is ids - 1
    table = torch.empty(sum(cap), d, dtype=torch.bfloat16, device=dev)
    native = not interpreting()
    for kv, sc, off, n, is_glob in ((wk, ws, 0, nw, False), (gk, gs, nw, ng, True)):
        if n and table.shape[0]:
            _decode_rows_kernel[(triton.cdiv(n, DECODE_ROWS),)](
                kv, sc, flags[off:], ids[off:], table, n, table.shape[0], kv.stride(0), sc.stride(0),
                D=d, IS_GLOB=is_glob, ROWS=DECODE_ROWS, NATIVE=native, **pdl_launch(swa_kv))
    entries = torch.empty(t, s + k, dtype=torch.int32, device=dev)
    if entries.numel():
        _entries_kernel[(triton.cdiv(entries.numel(), MARK_BLOCK),)](
            wi, gi, ids, entries, entries.numel(), s, k, nw, table.shape[0], BLOCK=MARK_BLOCK, **pdl_launch(swa_kv))
    return table, entries


def rows_attention(q, swa_kv, swa_scale, win_idx, glob_kv, glob_scale, glob_idx, sink, softmax_scale, out,
                   *, BLOCK_H: int, BLOCK_N: int, num_warps: int | None = None, num_stages: int | None = None,
                   dot_bf16: bool = True, rows_bound: tuple[int, int] | None = None) -> torch.Tensor:
    """`sparse_attention` in the rows form into `out` [T, H, D] bf16 (shapes checked by the
    caller, `sparse_attention_launch`): the dense bf16 table of the rows read, then one program
    per (query, head block)."""
    from .launch import interpreting

    t, h, d = q.shape
    table, ent = dense_table(swa_kv, swa_scale, win_idx, glob_kv, glob_scale, glob_idx, rows_bound)
    n_hb = -(-h // BLOCK_H)
    kw = {}
    if q.device.type == "cuda" and not interpreting() and num_warps:
        kw["num_warps"] = num_warps
    _rows_attn_kernel[(t * n_hb,)](q, table, ent, sink, out, h, ent.shape[1], n_hb, float(softmax_scale),
                                   D=d, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, STAGES=num_stages or 2,
                                   DOT_BF16=dot_bf16, **kw, **pdl_launch(q))
    return out
