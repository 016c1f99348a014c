"""Routed (and shared) experts as grouped kernels over the active experts (op `moe_experts`).

Paths (`moe_experts` picks one; `path=` overrides): on CUDA, FP4 experts at 1..64 tokens take
`moe_fold` (tensor cores, weights read as int32 words), one FP8 expert routed top-1 (the shared
expert) the dense FP8 linears (`_one_expert_linears`); the kernels below serve the other formats
and sizes (GEMV at a few tokens, the tiled kernels described next), and prefill-sized FP4 calls
take `moe_grouped` on a bf16 scratch.

Per call, with R = T * k routed rows (token t, slot j -> flat row t * k + j):
1. Rows are sorted by expert (`moe_grouped.sort_rows`: one launch up to 1024 routed rows, two
   above, in place of a torch stable sort + searchsorted + fills; ids < 0 left out; no host
   sync, so the call can be captured), and x is FP8-quantised once (`fp8_quant`).
2. `_gate_up_kernel`, grid (experts, I / 32, row-tile slots): each program walks its expert's
   rows in BM-row tiles, gathers the token rows of the quantised x, streams its 32 columns of w1
   and w3 one 32-wide scale block at a time (`scaled_block_step`: FP8 or E2M1 straight into the
   dot, both scales on the block's partial sum), and in the epilogue applies the clamped SwiGLU,
   the routing weight, and the FP8 quantisation of the w2 input (its 32 columns are one group):
   codes [R, I] and E8M0 scales [R, I / 32], written once, in expert order.
3. `_down_kernel`, grid (experts, d / BN, slots): h rows times w2, each expert's output row
   written in fp32 to its flat row (t * k + j).
4. `_combine_kernel`: out[t] = sum over the slots j with ids >= 0, in slot order, fp32.
Each expert's weights are read once per call for up to BM rows (decode: one slot, so a program
walks all its expert's row tiles), which is the weight-read floor for 1..64 tokens. Expert
weights stay the model's own tensors: the kernels reach expert e's tensors through a table of
element offsets from the first expert's tensors (built once per set of experts and cached), so
nothing is stacked or copied. bf16 experts take plain bf16 dots and a bf16 w2 input.

Numerics as block_linear (exact bf16 operands, fp32 sums), rounded to bf16 where the official
expert rounds (`swiglu.expert_act`, and each expert's output): the reference's official-mode
values up to fp32 summation order and the device exp in SiLU. Output fp32 (also for out_dtype float64: no fp64 on
devices). Expert weights: FP4 (int8 [N, K/2] + E8M0 [N, K/32]), FP8 (+ E8M0 32x32 blocks) or
bf16; all experts of a call share one format and shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends.reference.moe import moe_experts as moe_experts_ref  # noqa: F401  (the oracle)
from .pdl import pdl_launch, pdl_start
from .block_linear import DECODE_MAX_M, tile_k_range, weight_kind
from .block_scaled import (W_DENSE, W_FP4, W_FP8, bf16_bits16, bf16_round, fp8_code, fp8_exponent, fp8_qdq_groups,
                           gemv_acc, gemv_load_w, load_weight_tile, pow2, scaled_block_step)
from .fp4_common import split_dot_acc
from .launch import tile_counters
from .moe_fold import MAX_SCALE_BYTE
from .moe_grouped import sort_rows
from .swiglu import expert_act

# Tiles: BN columns of the expert's intermediate width (gate/up) or of d (down), BK along K.
TILES = {"cuda": {"bn_up": 32, "bn_down": 64, "bk": 128, "num_warps": 4, "num_stages": 4},
         "cuda_prefill": {"bm": 64, "bn_up": 32, "bn_down": 128, "bk": 64, "num_warps": 4, "num_stages": 3},
         "interp": {"bm": 16, "bn_up": 32, "bn_down": 32, "bk": 64}}


@triton.jit
def _gate_up_range(acc1, acc3, x_ptr, q_ptr, qs_ptr, tok, rmask, w1, s1, w3, s3, rn, nmask, k_lo, k_hi, K, I,
                   s_stride, W_KIND: tl.constexpr, LOWP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """acc1 / acc3 [BM, BN] + the rows' products with w1 / w3 over K range [k_lo, k_hi)."""
    for k0 in range(k_lo, k_hi, BK):
        if W_KIND == 0:
            kk = k0 + tl.arange(0, BK)
            a = tl.load(x_ptr + tok[:, None] * K + kk[None, :], mask=rmask[:, None] & (kk[None, :] < k_hi),
                        other=0.0).to(tl.float32)
            acc1 = split_dot_acc(acc1, a, tl.trans(load_weight_tile(w1, s1, rn, k0, I, K, s_stride, BN, BK, W_KIND)), 1,
                                 LOWP)
            acc3 = split_dot_acc(acc3, a, tl.trans(load_weight_tile(w3, s3, rn, k0, I, K, s_stride, BN, BK, W_KIND)), 1,
                                 LOWP)
        else:
            for kb in tl.static_range(BK // 32):
                acc1 = scaled_block_step(acc1, q_ptr, qs_ptr, tok, rmask, w1, s1, rn, nmask, k0 + kb * 32, k_hi, K,
                                         s_stride, W_KIND, LOWP)
                acc3 = scaled_block_step(acc3, q_ptr, qs_ptr, tok, rmask, w3, s3, rn, nmask, k0 + kb * 32, k_hi, K,
                                         s_stride, W_KIND, LOWP)
    return acc1, acc3


@triton.jit
def _slice_partial(part_ptr, acc, offs, omask, which, SPLIT_K: tl.constexpr, slice_stride):
    """Store this program's K slice (program_id 2) partial of accumulator `which` ([which, slice]
    blocks of slice_stride floats)."""
    tl.store(part_ptr + (which * SPLIT_K + tl.program_id(2)) * slice_stride + offs, acc, mask=omask)


@triton.jit
def _slice_last(count_ptr, counter, SPLIT_K: tl.constexpr):
    """After this program's partials are stored: whether it is the tile's last slice (it then adds
    the partials and resets the counter)."""
    tl.debug_barrier()  # every thread's partial is stored before the counter moves
    return tl.atomic_add(count_ptr + counter, 1, sem="acq_rel") == SPLIT_K - 1


@triton.jit
def _slices_sum(part_ptr, offs, omask, which, SPLIT_K: tl.constexpr, slice_stride, BM: tl.constexpr,
                BN: tl.constexpr):
    """Accumulator `which`'s partials added in slice order from zero (".cg": from L2)."""
    tot = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(SPLIT_K):
        tot += tl.load(part_ptr + (which * SPLIT_K + k) * slice_stride + offs, mask=omask, other=0.0,
                       cache_modifier=".cg")
    return tot


@triton.jit
def _gate_up_kernel(x_ptr, q_ptr, qs_ptr, perm_ptr, bounds_ptr, wts_ptr, w_base, s_base, table_ptr,
                    hq_ptr, hs_ptr, hb_ptr, part_ptr, count_ptr, R, K, I, s_stride, limit, k_per_split,
                    TOPK: tl.constexpr, W_KIND: tl.constexpr, LOWP: tl.constexpr, ALIGN: tl.constexpr,
                    SPLIT_K: tl.constexpr, SERIAL: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = 0):
    """Grid (experts, I / BN, row-tile slots, or with SPLIT_K > 1 the K slices: each program takes
    every row tile of its expert over its slice, and the tile's last slice adds the partials in
    slice order). SERIAL: each row tile's K slices of k_per_split in turn, each summed from zero and added
    in slice order (the split launch's fp32 operations in one program)."""
    pdl_start(PDL)
    e = tl.program_id(0)
    pn = tl.program_id(1)
    rn = pn * BN + tl.arange(0, BN)
    nmask = rn < I
    start = tl.load(bounds_ptr + e)
    end = tl.load(bounds_ptr + e + 1)
    w1 = w_base + tl.multiple_of(tl.load(table_ptr + e * 6 + 0), ALIGN)
    w3 = w_base + tl.multiple_of(tl.load(table_ptr + e * 6 + 1), ALIGN)
    s1 = s_base + tl.multiple_of(tl.load(table_ptr + e * 6 + 3), ALIGN)
    s3 = s_base + tl.multiple_of(tl.load(table_ptr + e * 6 + 4), ALIGN)
    if SPLIT_K > 1:
        first, step = start, BM
        k_lo = tl.program_id(2) * k_per_split
        k_hi = tl.minimum(K, k_lo + k_per_split)
    else:  # program (e, pn, slot) takes row tiles slot, slot + n_slots, ... of its expert's segment
        first, step = start + tl.program_id(2) * BM, BM * tl.num_programs(2)
        k_lo, k_hi = 0, K
    for m0 in range(first, end, step):
        rows = m0 + tl.arange(0, BM)
        rmask = rows < end
        f = tl.load(perm_ptr + rows, mask=rmask, other=0).to(tl.int64)
        tok = f // TOPK
        rows64 = rows.to(tl.int64)
        omask = rmask[:, None] & nmask[None, :]
        zero = tl.zeros((BM, BN), dtype=tl.float32)
        if SERIAL:
            acc1, acc3 = zero, zero
            for s0 in range(0, K, k_per_split):
                p1, p3 = _gate_up_range(zero, zero, x_ptr, q_ptr, qs_ptr, tok, rmask, w1, s1, w3, s3, rn, nmask, s0,
                                        tl.minimum(K, s0 + k_per_split), K, I, s_stride, W_KIND, LOWP, BN, BK)
                acc1 += p1
                acc3 += p3
            done = True
        else:
            acc1, acc3 = _gate_up_range(zero, zero, x_ptr, q_ptr, qs_ptr, tok, rmask, w1, s1, w3, s3, rn, nmask,
                                        k_lo, k_hi, K, I, s_stride, W_KIND, LOWP, BN, BK)
            done = True
            if SPLIT_K > 1:
                offs = rows64[:, None] * I + rn[None, :]
                _slice_partial(part_ptr, acc1, offs, omask, 0, SPLIT_K, R * I)
                _slice_partial(part_ptr, acc3, offs, omask, 1, SPLIT_K, R * I)
                done = _slice_last(count_ptr, m0 * tl.num_programs(1) + pn, SPLIT_K)
                if done:
                    acc1 = _slices_sum(part_ptr, offs, omask, 0, SPLIT_K, R * I, BM, BN)
                    acc3 = _slices_sum(part_ptr, offs, omask, 1, SPLIT_K, R * I, BM, BN)
                    tl.atomic_xchg(count_ptr + m0 * tl.num_programs(1) + pn, 0)
        if done:
            h = expert_act(acc1, acc3, tl.load(wts_ptr + f, mask=rmask, other=0.0)[:, None], limit)
            if W_KIND == 0:  # bf16 experts: the w2 input rounded to bf16
                tl.store(hb_ptr + rows64[:, None] * I + rn[None, :], bf16_bits16(h), mask=omask)
            else:  # FP8-quantise the w2 input: this tile's BN = 32 columns are one group
                ex = fp8_exponent(tl.max(tl.abs(h), axis=1))
                tl.store(hq_ptr + rows64[:, None] * I + rn[None, :], fp8_code(h * pow2(-ex)[:, None]).to(tl.uint8),
                         mask=omask)
                tl.store(hs_ptr + rows64 * (I // 32) + pn, tl.minimum(tl.maximum(ex + 127, 0), 254).to(tl.uint8),
                         mask=rmask)


@triton.jit
def _down_kernel(hb_ptr, hq_ptr, hs_ptr, perm_ptr, bounds_ptr, w_base, s_base, table_ptr, y_ptr, part_ptr, count_ptr,
                 R, I, D, s_stride, k_per_split,
                 W_KIND: tl.constexpr, LOWP: tl.constexpr, ALIGN: tl.constexpr, SPLIT_K: tl.constexpr,
                 SERIAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = 0):
    """Grid and K slices as `_gate_up_kernel`."""
    pdl_start(PDL)
    e = tl.program_id(0)
    pn = tl.program_id(1)
    rn = pn * BN + tl.arange(0, BN)
    nmask = rn < D
    start = tl.load(bounds_ptr + e)
    end = tl.load(bounds_ptr + e + 1)
    w2 = w_base + tl.multiple_of(tl.load(table_ptr + e * 6 + 2), ALIGN)
    s2 = s_base + tl.multiple_of(tl.load(table_ptr + e * 6 + 5), ALIGN)
    if SPLIT_K > 1:
        first, step = start, BM
        k_lo = tl.program_id(2) * k_per_split
        k_hi = tl.minimum(I, k_lo + k_per_split)
    else:
        first, step = start + tl.program_id(2) * BM, BM * tl.num_programs(2)
        k_lo, k_hi = 0, I
    for m0 in range(first, end, step):
        rows = m0 + tl.arange(0, BM)
        rmask = rows < end
        rows64 = rows.to(tl.int64)
        omask = rmask[:, None] & nmask[None, :]
        zero = tl.zeros((BM, BN), dtype=tl.float32)
        if SERIAL:
            acc = zero
            for s0 in range(0, I, k_per_split):
                acc += tile_k_range(zero, hb_ptr, hq_ptr, hs_ptr, w2, s2, rows64, rmask, rn, nmask, s0,
                                    tl.minimum(I, s0 + k_per_split), D, I, s_stride, W_KIND, 1, LOWP, BN, BK)
            done = True
        else:
            acc = tile_k_range(zero, hb_ptr, hq_ptr, hs_ptr, w2, s2, rows64, rmask, rn, nmask, k_lo, k_hi, D, I,
                               s_stride, W_KIND, 1, LOWP, BN, BK)
            done = True
            if SPLIT_K > 1:
                offs = rows64[:, None] * D + rn[None, :]
                _slice_partial(part_ptr, acc, offs, omask, 0, SPLIT_K, R * D)
                done = _slice_last(count_ptr, m0 * tl.num_programs(1) + pn, SPLIT_K)
                if done:
                    acc = _slices_sum(part_ptr, offs, omask, 0, SPLIT_K, R * D, BM, BN)
                    tl.atomic_xchg(count_ptr + m0 * tl.num_programs(1) + pn, 0)
        if done:
            f = tl.load(perm_ptr + rows, mask=rmask, other=0).to(tl.int64)
            tl.store(y_ptr + f[:, None] * D + rn[None, :], bf16_round(acc), mask=omask)


@triton.jit
def _combine_kernel(y_ptr, ids_ptr, add_ptr, out_ptr, D, TOPK: tl.constexpr, BLOCK: tl.constexpr,
                    ADD: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr = 0):
    """out[t] = sum of y's slot rows j with ids >= 0 in slot order, fp32 (+ add[t] in fp32 when
    ADD), rounded to bf16 (ties to even) when ROUND, stored in out's dtype."""
    pdl_start(PDL)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < D
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(TOPK):
        ok = tl.load(ids_ptr + t * TOPK + j) >= 0
        acc += tl.load(y_ptr + (t.to(tl.int64) * TOPK + j) * D + cols, mask=m & ok, other=0.0)
    if ADD:
        acc += tl.load(add_ptr + t.to(tl.int64) * D + cols, mask=m, other=0.0).to(tl.float32)
    if ROUND:
        acc = bf16_round(acc)  # (then the store's cast is exact)
    tl.store(out_ptr + t.to(tl.int64) * D + cols, acc, mask=m)


def combine(y: torch.Tensor, flat_ids: torch.Tensor, out: torch.Tensor, add: torch.Tensor | None = None,
            join=None) -> torch.Tensor:
    """Every path's last launch: `out` [T, d] = the sum of y's [T * k, d] slot rows (slots with
    ids < 0 skipped), + `add` [T, d] (read after `join()`, `ops.moe_experts_add`) when given."""
    t, d = out.shape
    if add is not None:
        if add.shape != out.shape:
            raise ValueError(f"moe_experts_add: add {tuple(add.shape)} must be [{t}, {d}]")
        if join is not None:
            join()
        add = add.contiguous()  # (after the join: a copy would read `add`)
    cb = min(1024, triton.next_power_of_2(d))
    _combine_kernel[(t, -(-d // cb))](y, flat_ids, out if add is None else add, out, d, TOPK=flat_ids.numel() // t,
                                      BLOCK=cb, ADD=add is not None, ROUND=out.dtype == torch.bfloat16, **pdl_launch(y))
    return out


# ---- decode path: 1..GEMV_MAX_T tokens, scaled experts --------------------------------------------
# With T tokens an expert has at most T rows, so each program takes all rows of one active expert
# at once (RB = next power of two >= T) and streams its weights exactly once, GEMV-style
# (block_scaled.gemv_load_w / gemv_acc: no tensor cores, block sums in registers). Nothing is sorted: each program
# finds its expert and rows from `ids` itself (slot s = the s-th smallest distinct expert id; the
# grid has min(E, T * k) slots, the slots past the active experts do nothing). x goes in as its
# FP8 quantise-dequantise values (one `fp8_qdq_bf16` pass: the values `fp8_quant` gives), and the
# FP8-quantised w2 input between the kernels as its exact fp32 values, [T * k, I], by flat row
# t * k + j.

GEMV_MAX_T = 4  # the most tokens the gemv path takes
# The most tokens it takes by default, per expert format. H200 2026-11-30, graph replay, 16 FP4
# experts 5120 x 2304, top-6: T=1 102.6 us against 224.5 us tiled, T=2 221 against 334, T=4 411
# against 428; the FP8 shared expert at T=1 35.2 against 57.6 (FP8 at 4 rows: the gemv linear
# was slower than the tiled kernel, so FP8 experts take it at T=1 only). On CUDA the shared expert
# itself now takes the dense linears (`linears_pay`: 25.7 us at T=1); this serves other FP8 experts.
GEMV_DEFAULT_T = {W_FP4: 4, W_FP8: 1}


@triton.jit
def _slot_rows(ids_ptr, R, RP2: tl.constexpr, RB: tl.constexpr):
    """(active?, expert id, flat rows [RB], row mask [RB]) of this program's slot (program_id 0)."""
    s = tl.program_id(0)
    fa = tl.arange(0, RP2)
    ka = tl.load(ids_ptr + fa, mask=fa < R, other=-1)
    kb = tl.load(ids_ptr + fa, mask=fa < R, other=-1)
    ka2 = ka[:, None]
    kb2 = kb[None, :]
    same = (ka2 == kb2) & (ka2 >= 0)
    earlier = fa[None, :] < fa[:, None]
    first = (ka >= 0) & (tl.sum((same & earlier).to(tl.int32), axis=1) == 0)
    # distinct ids below each entry's id: entries that are first of their id and smaller
    below = tl.sum((first[None, :] & (kb2 < ka2) & (kb2 >= 0)).to(tl.int32), axis=1)
    pick = first & (below == s)
    active = tl.sum(pick.to(tl.int32), axis=0) > 0
    e = tl.sum(tl.where(pick, ka, 0), axis=0)
    mine = (ka == e) & active
    pos = tl.cumsum(mine.to(tl.int32), axis=0) - 1
    r = tl.arange(0, RB)
    hit = mine[None, :] & (pos[None, :] == r[:, None])
    rows = tl.sum(tl.where(hit, fa[None, :], 0), axis=1)
    rmask = tl.sum(hit.to(tl.int32), axis=1) > 0
    return active, e, rows, rmask


@triton.jit
def _expert_matrix(w_base, s_base, table_ptr, e, which: tl.constexpr, ALIGN: tl.constexpr):
    """Expert e's weight and scale pointers for matrix `which` (0: w1, 1: w3, 2: w2) from the
    table of offsets (`_expert_table`)."""
    w = w_base + tl.multiple_of(tl.load(table_ptr + e * 6 + which), ALIGN)
    s = s_base + tl.multiple_of(tl.load(table_ptr + e * 6 + 3 + which), ALIGN)
    return w, s


@triton.jit
def _gate_up_gemv_kernel(x_ptr, x_stride, ids_ptr, wts_ptr, w_base, s_base, table_ptr, h_ptr, R, K, I, w_stride,
                         s_stride, limit, TOPK: tl.constexpr, W_KIND: tl.constexpr, ALIGN: tl.constexpr,
                         RP2: tl.constexpr, RB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    NB: tl.constexpr = BK // 32
    active, e, rows, rmask = _slot_rows(ids_ptr, R, RP2, RB)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = rn < I
    w1, s1 = _expert_matrix(w_base, s_base, table_ptr, e, 0, ALIGN)
    w3, s3 = _expert_matrix(w_base, s_base, table_ptr, e, 1, ALIGN)
    tok = rows // TOPK
    acc1 = tl.zeros((RB, BN, NB), dtype=tl.float32)
    acc3 = tl.zeros((RB, BN, NB), dtype=tl.float32)
    k_end = tl.where(active, K, 0)
    # the next step's weight tiles are loaded before the current ones are used (two in flight)
    a1, c1 = gemv_load_w(w1, w_stride, s1, s_stride, rn, nmask, 0, k_end, W_KIND, BN, NB)
    a3, c3 = gemv_load_w(w3, w_stride, s3, s_stride, rn, nmask, 0, k_end, W_KIND, BN, NB)
    for k0 in range(0, k_end, BK):
        n1, d1 = gemv_load_w(w1, w_stride, s1, s_stride, rn, nmask, k0 + BK, k_end, W_KIND, BN, NB)
        n3, d3 = gemv_load_w(w3, w_stride, s3, s_stride, rn, nmask, k0 + BK, k_end, W_KIND, BN, NB)
        acc1 = gemv_acc(acc1, a1, c1, x_ptr, tok, rmask, x_stride, k0, K, W_KIND, RB, NB, ASM)
        acc3 = gemv_acc(acc3, a3, c3, x_ptr, tok, rmask, x_stride, k0, K, W_KIND, RB, NB, ASM)
        a1, c1, a3, c3 = n1, d1, n3, d3
    wt = tl.load(wts_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    h = expert_act(tl.sum(acc1, axis=2), tl.sum(acc3, axis=2), wt[:, None], limit)
    h = fp8_qdq_groups(h, RB, BN)  # the w2 input's FP8 quantisation (BN % 32 == 0: whole groups)
    tl.store(h_ptr + rows.to(tl.int64)[:, None] * I + rn[None, :], h, mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _down_gemv_kernel(h_ptr, ids_ptr, w_base, s_base, table_ptr, y_ptr, R, I, D, w_stride, s_stride,
                      W_KIND: tl.constexpr, ALIGN: tl.constexpr, RP2: tl.constexpr, RB: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    NB: tl.constexpr = BK // 32
    active, e, rows, rmask = _slot_rows(ids_ptr, R, RP2, RB)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = rn < D
    w2, s2 = _expert_matrix(w_base, s_base, table_ptr, e, 2, ALIGN)
    acc = tl.zeros((RB, BN, NB), dtype=tl.float32)
    k_end = tl.where(active, I, 0)
    a2, c2 = gemv_load_w(w2, w_stride, s2, s_stride, rn, nmask, 0, k_end, W_KIND, BN, NB)
    for k0 in range(0, k_end, BK):
        n2, d2 = gemv_load_w(w2, w_stride, s2, s_stride, rn, nmask, k0 + BK, k_end, W_KIND, BN, NB)
        acc = gemv_acc(acc, a2, c2, h_ptr, rows, rmask, I, k0, I, W_KIND, RB, NB, ASM)
        a2, c2 = n2, d2
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * D + rn[None, :], bf16_round(tl.sum(acc, axis=2)),
             mask=rmask[:, None] & nmask[None, :])


GEMV_TILES = {"cuda": {"bn_up": 32, "bn_down": 32, "bk": 256, "num_warps": 4, "num_stages": 1},
              "interp": {"bn_up": 32, "bn_down": 32, "bk": 64}}


def _moe_gemv(x, weights, ids, topk, n_exp, table_args, limit, out, *, bn_up=None, bn_down=None, bk=None,
              num_warps=None, num_stages=None, add=None, join=None):
    """The decode path (T <= GEMV_MAX_T, scaled experts): x's FP8 quantise-dequantise pass, then
    the gate/up, down and combine kernels."""
    from .fp8_quant import fp8_qdq_bf16
    from .launch import interpreting

    w_base, s_base, table, kind, inter, d, (s_up, s_down), align = table_args
    interp = interpreting()
    tiles = GEMV_TILES["interp" if interp else "cuda"]
    bn_up, bn_down, bk = bn_up or tiles["bn_up"], bn_down or tiles["bn_down"], bk or tiles["bk"]
    if bn_up % 32 or inter % 32 or d % 32 or bk % 32:
        raise ValueError("moe_experts decode path: widths and tiles must be multiples of 32")
    bk_up, bk_down = min(bk, triton.next_power_of_2(d)), min(bk, triton.next_power_of_2(inter))
    x = fp8_qdq_bf16(x)
    kw = {} if interp else {"num_warps": num_warps or tiles["num_warps"], "num_stages": num_stages or tiles["num_stages"]}
    def w_row(k_in):  # a weight row in storage elements (bytes for packed FP4)
        return k_in // 2 if kind == W_FP4 else k_in

    t = x.shape[0]
    r = t * topk
    rb = triton.next_power_of_2(t)
    rp2 = max(2, triton.next_power_of_2(r))
    slots = min(n_exp, r)
    flat_ids = ids.contiguous().reshape(-1)
    h = torch.empty(r, inter, dtype=torch.float32, device=x.device)
    y = torch.empty(r, d, dtype=torch.float32, device=x.device)
    _gate_up_gemv_kernel[(slots, -(-inter // bn_up))](
        x, x.stride(0), flat_ids, weights.contiguous().reshape(-1), w_base, s_base, table, h, r, d, inter, w_row(d),
        s_up, float(limit), TOPK=topk, W_KIND=kind, ALIGN=align, RP2=rp2, RB=rb, BN=bn_up, BK=bk_up, ASM=not interp,
        **kw, **pdl_launch(x))
    _down_gemv_kernel[(slots, -(-d // bn_down))](
        h, flat_ids, w_base, s_base, table, y, r, inter, d, w_row(inter), s_down, W_KIND=kind, ALIGN=align, RP2=rp2, RB=rb,
        BN=bn_down, BK=bk_down, ASM=not interp, **kw, **pdl_launch(h))
    return combine(y, flat_ids, out, add, join)


# ---- launcher -----------------------------------------------------------------------------------

_TABLES: dict[tuple, tuple] = {}


def _expert_table(experts: list, device: torch.device):
    """(weight base, scale base, int64 [E, 6] element offsets of (w1, w3, w2, s1, s3, s2) from the
    bases, kind, (I, K)); cached per set of expert tensors (keyed by their addresses)."""
    key = _key(experts)
    hit = _TABLES.get(key)
    if hit is not None:
        return hit
    (w1, s1), (w2, s2), (w3, s3) = experts[0]
    kind = weight_kind(w1, s1)
    if kind == W_DENSE and w1.dtype != torch.bfloat16:
        raise TypeError(f"moe_experts kernel: unscaled expert weights must be bf16, got {w1.dtype}")
    inter = w1.shape[0]
    dim = w2.shape[0]
    w_base = w1.view(torch.uint8) if kind == W_FP4 else w1
    s_base = s1.view(torch.uint8) if s1 is not None else w_base
    esz = w_base.element_size()
    rows = []
    for i, ex in enumerate(experts):
        (a1, b1), (a2, b2), (a3, b3) = ex
        if a1.shape != w1.shape or a3.shape != w1.shape or a2.shape != w2.shape or a1.dtype != w1.dtype:
            raise ValueError(f"moe_experts kernel: expert {i} differs in shape or format from expert 0")
        if any(t.device != device or not t.is_contiguous() for t in (a1, a2, a3)):
            raise ValueError(f"moe_experts kernel: expert {i}'s weights must be contiguous on {device}")
        offs = [(t.data_ptr() - w_base.data_ptr()) // esz for t in (a1, a3, a2)]
        offs += [(t.data_ptr() - s_base.data_ptr()) if t is not None else 0 for t in (b1, b3, b2)]
        rows.append(offs)
    table = torch.tensor(rows, dtype=torch.int64, device=device)
    # The offsets come from memory, so the compiler cannot see that the tensors are aligned: say
    # so (16 elements) when it is true, or every weight load is split into single-byte loads.
    align = 16 if all(o % 16 == 0 for r in rows for o in r) else 1
    k_in = w1.shape[1] * (2 if kind == W_FP4 else 1)
    hit = _TABLES[key] = (w_base, s_base, table, kind, inter, k_in,
                          (s1.shape[1] if s1 is not None else 0, s2.shape[1] if s2 is not None else 0), align)
    # FP4 experts whose scale bytes all fit the folded conversion (moe_fold.MAX_SCALE_BYTE): one
    # reduction per set of experts, when its table is built (before any graph capture)
    _FOLDABLE[key] = (kind == W_FP4 and all(o % 4 == 0 for r in rows for o in r)  # int32 word loads
                      and max(int(b.view(torch.uint8).max()) for ex in experts for _, b in ex) <= MAX_SCALE_BYTE)
    _WORD_ALIGNED[key] = kind == W_FP4 and all(o % 4 == 0 for r in rows for o in r[:3])  # the rows path's words
    return hit


_FOLDABLE: dict[tuple, bool] = {}
_WORD_ALIGNED: dict[tuple, bool] = {}


def _key(experts: list) -> tuple:
    """The cache key of a set of experts (their tensors' addresses)."""
    return tuple(t.data_ptr() if t is not None else 0 for ex in experts for pair in ex for t in pair)


def foldable(experts: list) -> bool:
    """Whether the set of experts (table already built) can take the folded FP4 path."""
    return _FOLDABLE.get(_key(experts), False)


def word_aligned(experts: list) -> bool:
    """Whether the set of experts (table already built) is FP4 with 4-byte aligned weight tensors
    (the rows path reads them as int32 words)."""
    return _WORD_ALIGNED.get(_key(experts), False)


def scratch_pays(device: torch.device, kind: str, rows: int, n_exp: int, inter: int, d: int) -> bool:
    """Whether the default path is the grouped one on a bf16 scratch of the experts: prefill-sized
    calls of FP4 experts on CUDA (5x the tiled kernels at 8192 tokens on the H200; not compiled
    for Ascend yet). Decode sizes keep the GEMV / tiled kernels: the scratch would cost a bf16
    copy of every expert in decode."""
    from .launch import interpreting
    from .moe_grouped import predequant_pays

    return device.type == "cuda" and not interpreting() and predequant_pays(kind, rows, n_exp, inter, d)


# The most tokens the folded FP4 path (moe_fold) takes by default. H200 2026-12-01, graph replay,
# 16 FP4 experts 5120 x 2304, top-6 (benchmarks/RESULTS.md, "MoE at decode sizes"): fold (its
# shipped tiles) against the old default, T=1 98.8 / 106.9 us (gemv), 2 158.8 / 201.4 (gemv),
# 4 183.2 / 400.6 (gemv), 8 234.7 / 446.5 (tiled), 16 234.0 / 448.2, 32 377.9 / 455.8,
# 64 460.0 / 1099.1.
FOLD_MAX_T = 64


def fold_pays(device: torch.device, t: int, experts: list, inter: int, d: int) -> bool:
    """Whether the default path is the folded one (`moe_fold`): FP4 experts whose scale bytes it
    takes, widths its tiles divide, 1..FOLD_MAX_T tokens, on CUDA (measured faster than the GEMV
    and tiled kernels at every such T on the H200; the interpreters keep the old default)."""
    from .launch import interpreting
    from .moe_fold import fold_fits, fold_tiles

    c = fold_tiles(t)
    return (device.type == "cuda" and not interpreting() and t <= FOLD_MAX_T and foldable(experts)
            and fold_fits(inter, d, c["bn_up"], c["bn_down"], c["bk"], c["split"]))


# The most tokens the rows path (moe_rows: CUDA cores, whole weight rows) takes by default, on CUDA.
# H200 2026-12-01, graph replay, 16 FP4 experts 5120 x 2304, top-6 (benchmarks/RESULTS.md, "FP4
# experts at one token: the rows path"): T=1 rows 94.2 / 93.5 us against fold 96.8 / 96.6 (two
# runs); T=2 rows 172.0 against fold 142.6 (each token's experts read separately). With the MMA
# variant (`moe_rows_mma`, the rows path's CUDA default since 2026-12-01 ~20:15 UTC): T=1 76.1 us
# against rows 94.2 / fold 97.2, T=2 137.0 against rows 177.7 / fold 192.1 (12 experts; 129.3
# against fold 153.8 with 10); from 3 tokens a program per expert (its rows as MMA columns): T=3 /
# 4 / 8 163.7 / 166.2 / 189.9 us against fold 188.5 / 181.1 / 230.5 (~20:35 UTC): benchmarks/RESULTS.md,
# "register-fed MMAs". Up to 8 tokens (the MMA's n) when the MMA variant takes the widths.
ROWS_DEFAULT_T = 8


def rows_pays(device: torch.device, t: int, experts: list, inter: int, d: int) -> bool:
    """Whether the default path is the rows one (`moe_rows`, on CUDA by default its MMA variant):
    FP4 experts read as int32 words, widths its kernels take (the CUDA-core kernels' up to
    ROWS_MAX_T tokens, the MMA variant's up to MMA_MAX_T), 1..ROWS_DEFAULT_T tokens, on CUDA (the
    interpreters keep the old default)."""
    from .launch import interpreting
    from .moe_rows import ROWS_MAX_T, rows_fits
    from .moe_rows_mma import MMA_MAX_T, mma_fits

    return (device.type == "cuda" and not interpreting() and t <= ROWS_DEFAULT_T and word_aligned(experts)
            and ((t <= ROWS_MAX_T and rows_fits(inter, d)) or (t <= MMA_MAX_T and mma_fits(inter, d))))


# ---- one FP8 expert as dense linears (the shared expert) ---------------------------------------

def linears_pay(device: torch.device, n_exp: int, topk: int, kind: int) -> bool:
    """Whether the default path is "linears": one FP8 expert routed top-1 (the shared expert:
    every row's id 0, weight 1) on CUDA. The grouped kernels spread a call over its experts, so
    one expert got 72 programs (gate/up) on 132 SMs; the dense FP8 linears spread the same
    weights over the whole GPU (the one-row kernel, the decode table, cuBLAS at prefill sizes)."""
    from .launch import interpreting

    return device.type == "cuda" and not interpreting() and n_exp == 1 and topk == 1 and kind == W_FP8


@triton.jit
def _act_rows_kernel(g_ptr, u_ptr, gu_stride, wts_ptr, ids_ptr, h_ptr, I, limit, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = 0):
    """h[t] = bf16(clamped SwiGLU(g[t], u[t]) * weight[t]) (`expert_act`), 0 where id[t] < 0; g and
    u rows `gu_stride` apart (views of one stacked output: 2 I)."""
    pdl_start(PDL)
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < I
    row = t.to(tl.int64) * I
    g = tl.load(g_ptr + t.to(tl.int64) * gu_stride + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + t.to(tl.int64) * gu_stride + c, mask=m, other=0.0).to(tl.float32)
    wt = tl.load(wts_ptr + t).to(tl.float32)
    h = tl.where(tl.load(ids_ptr + t) >= 0, expert_act(g, u, wt, limit), 0.0)
    tl.store(h_ptr + row + c, h.to(tl.bfloat16), mask=m)


def _one_expert_linears(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, expert,
                        limit: float) -> torch.Tensor:
    """T rows through one FP8 expert (top-1) as the official expert computes it: w1 and w3 as
    FP8 linears (x FP8-quantised per 32 channels inside, bf16 outputs; one launch for both,
    `linear_pair`, where the model stacked them), the clamped SwiGLU times the routing weight
    rounded to bf16, w2 as an FP8 linear (h FP8-quantised inside), returned as w2's bf16 output:
    one expert's sum is its output, a bf16 value, so widening it to fp32 would change nothing and
    cost a launch (3.2 us a layer at one token on the H200; the MoE's final add takes the bf16
    rows as they are). The grouped kernels' values up to fp32 summation order."""
    from .block_linear import linear, linear_pair

    (w1, s1), (w2, s2), (w3, s3) = expert
    t, inter = x.shape[0], w1.shape[0]
    g, u = linear_pair(x, w1, s1, w3, s3)  # (views of one output where w1 and w3 are stacked)
    if g.stride(-1) != 1 or u.stride(-1) != 1 or g.stride(0) != u.stride(0):
        g, u = g.contiguous(), u.contiguous()
    h = torch.empty(t, inter, dtype=torch.bfloat16, device=x.device)
    block = min(1024, triton.next_power_of_2(inter))
    _act_rows_kernel[(t, -(-inter // block))](g, u, g.stride(0), weights.contiguous(), ids.contiguous(), h, inter,
                                              float(limit), BLOCK=block, **pdl_launch(g))
    return linear(h, w2, s2)


def _k_slices(k: int, bk: int, want: int) -> tuple[int, int]:
    """(slices, K per slice) for `want` slices of whole BK steps over K (fewer when they do not
    divide: the same rule as block_linear's split-K)."""
    k_steps = -(-k // bk)
    per = bk * -(-k_steps // max(1, want))
    return -(-k // per), per


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: list, limit: float,
                out_dtype: torch.dtype = torch.float32, *, bm: int | None = None, bn_up: int | None = None,
                bn_down: int | None = None, bk: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None, path: str | None = None, k_split: tuple[int, int] = (1, 1),
                serial: bool = False, add: torch.Tensor | None = None, join=None, **grouped) -> torch.Tensor:
    """`ops.moe_experts` on a device: x [T, d], weights / ids [T, k] -> [T, d] fp32 (float64
    requested: fp32; the "linears" path's one expert: bf16, its exact value). Keyword tile
    parameters are for tuning (defaults: TILES / GEMV_TILES); `path` ("linears" / "rows" / "fold"
    / "gemv" / "tiled" / "grouped") overrides the choice of path (tests, sweeps);
    "linears" is one FP8 expert routed top-1 (the shared expert) as dense FP8 linears, its CUDA
    default at every T (`linears_pay`);
    "rows" is `moe_rows.rows_moe` (FP4 experts at 1..2 tokens on the CUDA cores, taking the
    keywords rs_up / rs_down / rpp_down / num_warps in `grouped`); "fold" is `moe_fold.fold_moe`
    (FP4 experts at decode sizes, weights read as int32 words); "grouped"
    is `moe_grouped.grouped_moe` (bf16 tensor-core dots with the scales folded into the weight
    tiles), which takes the extra keywords in `grouped` (swap, bk_down, group_m, chunk,
    predequant). Default: the rows path for FP4 experts at 1..ROWS_DEFAULT_T tokens on CUDA
    (`rows_pays`), the fold path for FP4 experts at 1..FOLD_MAX_T tokens on CUDA (`fold_pays`),
    else GEMV at a few tokens, the grouped path on a bf16 scratch of the experts
    for prefill-sized FP4 calls (`moe_grouped.predequant_pays`), the tiled kernels between (on
    the H200 the grouped path without the scratch did not beat them: benchmarks/RESULTS.md).
    `k_split` (tiled path): the K slice counts of the gate/up and down kernels, run as programs of
    their own whose partials the tile's last slice adds in slice order, or with `serial` inside each
    program in the same order (one result either way). `add` [T, d]: `ops.moe_experts_add` (the
    sum + add in fp32, bf16 out; read after `join()`), in the combine launch where the path ends
    in one, else one add after the path."""
    from .fp8_quant import fp8_quant
    from .launch import interpreting

    t, d = x.shape
    topk = ids.shape[1]
    if t == 0:
        return torch.empty(t, d, dtype=torch.float32 if add is None else torch.bfloat16, device=x.device)
    if ids.shape != weights.shape or ids.shape[0] != t:
        raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be [{t}, k]")
    n_exp = len(experts)
    w_base, s_base, table, kind, inter, k_in, (s_up, s_down), align = _expert_table(experts, x.device)
    if k_in != d:
        raise ValueError(f"expert input width {k_in} != x width {d}")
    if path is None:
        path = ("linears" if linears_pay(x.device, n_exp, topk, kind) else
                "rows" if rows_pays(x.device, t, experts, inter, k_in) else
                "fold" if fold_pays(x.device, t, experts, inter, k_in) else
                "gemv" if t <= GEMV_DEFAULT_T.get(kind, 0) else
                "grouped" if scratch_pays(x.device, kind, t * topk, n_exp, inter, k_in) else "tiled")
        if path == "grouped":  # chosen for the scratch: say so (the interpreters never default to it)
            grouped = dict(grouped, predequant=True)
    if add is not None and path in ("linears", "grouped"):  # (no combine of theirs takes the add: one after)
        y = moe_experts(x, weights, ids, experts, limit, bm=bm, bn_up=bn_up, bn_down=bn_down, bk=bk,
                        num_warps=num_warps, num_stages=num_stages, path=path, **grouped)
        if join is not None:
            join()
        return torch.add(y, add, out=torch.empty(t, d, dtype=torch.bfloat16, device=x.device))
    if path == "linears":
        if n_exp != 1 or topk != 1 or kind != W_FP8:
            raise ValueError("moe_experts: the linears path takes one FP8 expert routed top-1")
        return _one_expert_linears(x, weights, ids, experts[0], limit)
    # (after "linears", which returns its own)
    out = torch.empty(t, d, dtype=torch.float32 if add is None else torch.bfloat16, device=x.device)
    fin = {} if add is None else {"add": add, "join": join}
    if path == "grouped":
        from .moe_grouped import grouped_moe

        return grouped_moe(x if x.stride(-1) == 1 else x.contiguous(), weights, ids,
                           (w_base, s_base, table, kind, inter, k_in, (s_up, s_down), align), limit, out, bm=bm,
                           bn_up=bn_up, bn_down=bn_down, bk=bk, num_warps=num_warps, num_stages=num_stages,
                           **grouped)
    if path == "fold":
        from .moe_fold import fold_moe

        if not foldable(experts):
            raise ValueError("moe_experts: the fold path takes FP4 experts with 4-byte aligned tensors and scale "
                             f"bytes <= {MAX_SCALE_BYTE}")
        return fold_moe(x if x.stride(-1) == 1 else x.contiguous(), weights, ids,
                        (w_base, s_base, table, kind, inter, k_in, (s_up, s_down), align), limit, out,
                        rb=bm, bn_up=bn_up, bn_down=bn_down, bk=bk, num_warps=num_warps, num_stages=num_stages,
                        **fin, **grouped)
    if path == "rows":
        from .moe_rows import rows_moe

        if not word_aligned(experts):
            raise ValueError("moe_experts: the rows path takes FP4 experts with 4-byte aligned weight tensors")
        return rows_moe(x.contiguous(), weights, ids, (w_base, s_base, table, kind, inter, k_in, (s_up, s_down), align),
                        limit, out, num_warps=num_warps, **fin, **grouped)
    if path == "gemv":
        if kind == W_DENSE or t > GEMV_MAX_T:
            raise ValueError(f"moe_experts: the gemv path takes scaled experts and <= {GEMV_MAX_T} tokens")
        x_rows = x if x.stride(-1) == 1 else x.contiguous()
        return _moe_gemv(x_rows, weights, ids, topk, n_exp,
                         (w_base, s_base, table, kind, inter, k_in, (s_up, s_down), align), limit, out,
                         bn_up=bn_up, bn_down=bn_down, bk=bk, num_warps=num_warps, num_stages=num_stages, **fin)
    interp = interpreting()
    tiles = TILES["interp" if interp else ("cuda" if t <= DECODE_MAX_M else "cuda_prefill")]
    r = t * topk
    per_expert = r / min(n_exp, r)  # rows of an active expert, on average
    bm = bm or tiles.get("bm") or (16 if per_expert <= 16 else (32 if per_expert <= 32 else 64))
    bn_up, bn_down, bk = bn_up or tiles["bn_up"], bn_down or tiles["bn_down"], bk or tiles["bk"]
    kw = {} if interp else {"num_warps": num_warps or tiles["num_warps"], "num_stages": num_stages or tiles["num_stages"]}

    perm, bounds = sort_rows(ids.contiguous().reshape(-1), n_exp)

    xc = x.contiguous()
    if kind == W_DENSE:
        q = qs = xc  # unused placeholders
        hb = torch.empty(r, inter, dtype=torch.bfloat16, device=x.device)
        hq = hs = hb
    else:
        if bn_up != 32 or inter % 32:
            raise ValueError("moe_experts kernel: quantised experts need bn_up = 32 (one FP8 group per tile)")
        q, qs = fp8_quant(xc)
        qs = qs.view(torch.uint8)
        hq = torch.empty(r, inter, dtype=torch.float8_e4m3fn, device=x.device)
        hs = torch.empty(r, inter // 32, dtype=torch.uint8, device=x.device)
        hb = hq
    y = torch.empty(r, d, dtype=torch.float32, device=x.device)
    # row-tile slots per expert: 1 (each program walks all of its expert's tiles) for decode;
    # for prefill, enough that each program takes about two tiles
    slots = 1 if t <= DECODE_MAX_M or interp else max(1, -(-r // (bm * min(n_exp, r) * 2)))
    (split_up, kps_up), (split_down, kps_down) = (_k_slices(d, bk, k_split[0]), _k_slices(inter, bk, k_split[1]))
    n_up, n_down = -(-inter // bn_up), -(-d // bn_down)
    counts = part_up = part_down = y  # unused placeholders without a split launch
    if not serial and max(split_up, split_down) > 1:
        counts = tile_counters(x.device, r * max(n_up, n_down))
        part_up = torch.empty(2 * split_up * r * inter if split_up > 1 else 1, dtype=torch.float32, device=x.device)
        part_down = torch.empty(split_down * r * d if split_down > 1 else 1, dtype=torch.float32, device=x.device)
    grid = lambda split: slots if serial or split == 1 else split  # noqa: E731
    _gate_up_kernel[(n_exp, n_up, grid(split_up))](
        xc, q, qs, perm, bounds, weights.float().contiguous().reshape(-1), w_base, s_base, table,
        hq.view(torch.uint8) if kind != W_DENSE else hq, hs, hb.view(torch.int16) if kind == W_DENSE else hb,
        part_up, counts, r, d, inter, s_up, float(limit), kps_up, TOPK=topk, W_KIND=kind, LOWP=not interp, ALIGN=align,
        SPLIT_K=1 if serial else split_up, SERIAL=serial and split_up > 1, BM=bm, BN=bn_up, BK=bk, **kw, **pdl_launch(xc))
    _down_kernel[(n_exp, n_down, grid(split_down))](
        hb, hq, hs, perm, bounds, w_base, s_base, table, y, part_down, counts, r, inter, d, s_down, kps_down,
        W_KIND=kind, LOWP=not interp, ALIGN=align, SPLIT_K=1 if serial else split_down,
        SERIAL=serial and split_down > 1, BM=bm, BN=bn_down, BK=bk, **kw, **pdl_launch(hb))
    return combine(y, ids.contiguous().reshape(-1), out, add, join)


def moe_experts_add(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: list, limit: float,
                    add: torch.Tensor, join=None) -> torch.Tensor:
    """`ops.moe_experts_add` on a device: the routed experts' fp32 sum + `add` rounded to bf16 in
    the path's combine launch (the MoE's final add without a launch of its own: 3.5 us a layer
    on the H200 at one token); the value of `backends.fused.moe_experts_add`."""
    return moe_experts(x, weights, ids, experts, limit, add=add, join=join)


OPS = {"moe_experts": moe_experts, "moe_experts_add": moe_experts_add}
