"""Tile sweep for the memory-bound kernels on a CUDA GPU: each variant is checked against the
reference op on fresh random inputs, then timed (median of CUDA-graph replays, so Python launch
overhead is out of the number, and eagerly, one call between events).

    python benchmarks/sweep_kernels.py [--only sparse_attention,engram_lookup]

Prints one table; the tile tables in `npu_ops/triton/*.py` take their CUDA defaults from it.
"""

from __future__ import annotations

import argparse
import sys

import torch
from dsv41.backends import (
    ops,  # noqa: F401  (registers the reference ops)
    registry,
)
from dsv41.backends.numerics import numerics
from dsv41.backends.reference import quant
from dsv41.core.config import ModelConfig
from ops import (  # benchmarks/ops.py: one timing method and one input set for the table and the sweep
    copy_gbs,
    graph_time,
    paged_index_keys,
    sparse_attention_args,
    timeit,
)

CFG = ModelConfig()
D, H, W, TOPK = CFG.head_dim, CFG.num_attention_heads, CFG.sliding_window, CFG.index_topk
HI, DI = CFG.index_n_heads, CFG.index_head_dim


def bandwidth_row(rows, name: str, shape: str, check: str, call, nbytes: int, copy: float) -> None:
    """Time `call` (eager and graph-replayed) and append / print its row: GB/s and % of copy."""
    te = timeit(call)
    tg = graph_time(call) or te  # the eager time where the launcher cannot be captured
    rows.append(f"| {name} | {shape} | {check} | eager {te * 1e6:.1f} us | graph {tg * 1e6:.1f} us | "
                f"{nbytes / tg / 1e9:.0f} GB/s ({100 * nbytes / tg / 1e9 / copy:.0f}%) |")
    print(rows[-1], flush=True)


def rel_err(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def checked_err(rows, name: str, shape: str, call, ref) -> float | None:
    """rel_err of `call()` against `ref`, or None after appending a "failed" row (a variant that
    does not compile is a row, not a crash)."""
    try:
        return rel_err(call(), ref)
    except Exception as ex:  # noqa: BLE001
        rows.append(f"| {name} | {shape} | failed: {type(ex).__name__}: {str(ex)[:80]} |")
        print(rows[-1], flush=True)
        return None


# sparse_attention tile variants at decode shapes: (label, launch keywords). T=1 at a 64K context
# tries the decode table's neighbours (entries per block, channel blocks, warps, stages, blocks
# per split); T > 1 (a decode batch at 4K) compares the prefill table with decode-table entries.
SPARSE_DECODE = dict(BLOCK_H=64, BLOCK_N=32, BLOCK_D=128, BLOCK_DV=128, num_warps=4, num_stages=2,
                     min_blocks_per_split=1)
SPARSE_T1 = [("decode (shipped)", {}), ("N16", dict(BLOCK_N=16)), ("N64", dict(BLOCK_N=64)),
             ("N32 2/split", dict(min_blocks_per_split=2)), ("w8", dict(num_warps=8)),
             ("D256 DV128 w8", dict(BLOCK_D=256, num_warps=8)), ("DV256 w8", dict(BLOCK_DV=256, num_warps=8)),
             ("N16 D256 DV256 w8", dict(BLOCK_N=16, BLOCK_D=256, BLOCK_DV=256, num_warps=8))]
# (num_stages=1 is left out: on the H200 (triton 3.6) the decode kernel at BLOCK_N 16 compiled with
# one stage gave wrong results and then an illegal address, 2026-12-01)
SPARSE_TN = [("whole-row table (cuda_whole)", dict(BLOCK_N=32, BLOCK_D=None, BLOCK_DV=None, num_warps=8,
                                              min_blocks_per_split=2)),
             ("decode table", {}), ("decode 4/split", dict(min_blocks_per_split=4)),
             ("decode DV256 w8", dict(BLOCK_DV=256, num_warps=8))]
# the two-pass form (every logit, then the values: sparse_attention_two_pass.py) and its tiles,
# timed at every token count. H100 2026-12-06 (T=64, 4K, graph us; no cap unless named): BLOCK_N 32
# 94.2, BLOCK_N 64 88.3, BLOCK_N 64 with 8 warps 123.7; the default dispatch (BLOCK_N 32, logits
# capped at 168 registers) 87.9; BLOCK_N 64 with the cap 89.2 against 88.6 (2026-12-06, session
# thirty-nine). The values pass's look-ahead (VALUES_AHEAD, the shipped table's since then; the
# rows here without it unless named): 78-79 us against 86-88 at T=64 with the cap
SPARSE_TWO_PASS = [("two-pass", dict(TWO_PASS=True)), ("two-pass N16", dict(TWO_PASS=True, BLOCK_N=16)),
                   ("two-pass 2/split", dict(TWO_PASS=True, min_blocks_per_split=2)),
                   ("two-pass 4/split", dict(TWO_PASS=True, min_blocks_per_split=4)),
                   ("two-pass D256 w8", dict(TWO_PASS=True, BLOCK_D=256, num_warps=8)),
                   ("two-pass DV256 w8", dict(TWO_PASS=True, BLOCK_DV=256, num_warps=8)),
                   ("two-pass D512 DV256 w8", dict(TWO_PASS=True, BLOCK_D=512, BLOCK_DV=256, num_warps=8)),
                   ("two-pass N64", dict(TWO_PASS=True, BLOCK_N=64)),
                   ("two-pass N64 w8", dict(TWO_PASS=True, BLOCK_N=64, num_warps=8)),
                   ("two-pass N64, logits cap 168", dict(TWO_PASS=True, BLOCK_N=64, LOGITS_MAXNREG=168)),
                   ("two-pass, values ahead", dict(TWO_PASS=True, VALUES_AHEAD=True)),
                   ("two-pass, values ahead, logits cap 168", dict(TWO_PASS=True, VALUES_AHEAD=True, LOGITS_MAXNREG=168)),
                   ("two-pass N16, values ahead", dict(TWO_PASS=True, BLOCK_N=16, VALUES_AHEAD=True))]
# the two-pass form's FP4 decode to bf16 pairs (KV_X2: the experts' bf16x2 conversion, every value
# times 2^-64) against the shipped table's fp32 decode, with and without the logits pass's cap
_SHIPPED_TWO_PASS = dict(TWO_PASS=True, VALUES_AHEAD=True)
SPARSE_KV_X2 = [("two-pass fp32 decode, logits cap 168", dict(_SHIPPED_TWO_PASS, LOGITS_MAXNREG=168)),
                ("two-pass KV_X2, logits cap 168", dict(_SHIPPED_TWO_PASS, KV_X2=True, LOGITS_MAXNREG=168)),
                ("two-pass fp32 decode, no cap", dict(_SHIPPED_TWO_PASS)),
                ("two-pass KV_X2, no cap", dict(_SHIPPED_TWO_PASS, KV_X2=True)),
                # at T=1 (64K) the logits pass has one tile per 32-entry block (20): 16-entry blocks
                # halve each tile's decode chain
                ("two-pass KV_X2 N16, logits cap 168", dict(_SHIPPED_TWO_PASS, KV_X2=True, BLOCK_N=16,
                                                            LOGITS_MAXNREG=168)),
                # the logits pass one loop per pool (LOGITS_BLOCK_N; sm_90a, triton 3.6: 298 / 294
                # instructions a 32-entry chunk against 483 for the shared loop, 453 / 464 a 64-entry one)
                ("two-pass KV_X2, logits per pool 32, cap 168", dict(_SHIPPED_TWO_PASS, KV_X2=True,
                                                                     LOGITS_BLOCK_N=32, LOGITS_MAXNREG=168)),
                ("two-pass KV_X2, logits per pool 64, cap 168", dict(_SHIPPED_TWO_PASS, KV_X2=True,
                                                                     LOGITS_BLOCK_N=64, LOGITS_MAXNREG=168)),
                # a logits tile per 128-channel chunk (LOGITS_SPLIT_D): at T=1 four times the logits
                # tiles, each a quarter of the decode chain; the values pass sums the chunks
                ("two-pass KV_X2, logits split over D", dict(_SHIPPED_TWO_PASS, KV_X2=True, LOGITS_SPLIT_D=True)),
                ("two-pass KV_X2, logits split over D, cap 168", dict(_SHIPPED_TWO_PASS, KV_X2=True,
                                                                      LOGITS_SPLIT_D=True, LOGITS_MAXNREG=168)),
                ("two-pass KV_X2, logits split over D, 2 blocks a split", dict(_SHIPPED_TWO_PASS, KV_X2=True,
                                                                               LOGITS_SPLIT_D=True,
                                                                               min_blocks_per_split=2))]
# register caps on the two-pass form's logits pass alone (`--only sparse_two_pass`): the shipped table,
# then the two-pass tiles without a cap and with each cap. Session twenty-seven measured a 168 cap on
# both passes: logits 45.4 -> 38.8 us but values 49.9 -> 54.7 at T=64 (4K)
SPARSE_LOGITS_CAPS = [("two-pass, no cap", dict(TWO_PASS=True, LOGITS_MAXNREG=None))] + [
    (f"two-pass, logits cap {c}", dict(TWO_PASS=True, LOGITS_MAXNREG=c)) for c in (128, 168, 192)]


def sweep_sparse_attention(rows, copy, tokens=(1, 8, 64), check_only=False, mqa=False, variants=None):
    """sparse_attention tiles on paged pools (every variant checked against the reference): T=1
    at a 64K context (flash-decoding splits), T > 1 at 4K (a decode batch); `mqa` adds the
    MQA kernel (the prefill table) last, at these decode shapes; `variants` replaces the tile
    lists (options over the decode entry's)."""
    from dsv41.npu_ops.triton import sparse_attention as sa

    ref_fn = registry.resolve("sparse_attention", "reference")[0]
    for t in tokens:
        n = 65536 if t == 1 else 4096
        args, must_read = sparse_attention_args(t, n, "cuda", masked_fraction=0.05)
        ref = ref_fn(*args)
        flops = 4 * t * H * D * (TOPK + W)
        todo = [(name, dict(SPARSE_DECODE, **v))
                for name, v in variants or (SPARSE_T1 if t == 1 else SPARSE_TN) + SPARSE_TWO_PASS]
        todo.append(("default dispatch", None))
        if mqa:
            todo.append(("mqa (opt-in cuda_mqa table)", dict(sa.CONFIGS["cuda_mqa"])))
        for name, cfg in todo:
            def call(args=args, cfg=cfg):
                if cfg is None:
                    return sa.sparse_attention(*args)
                return sa.sparse_attention_launch(*args, **cfg)

            try:
                err = rel_err(call(), ref)
                tg = None if check_only else graph_time(call)
            except Exception as e:  # noqa: BLE001  (a variant that does not compile is a row, not a crash)
                rows.append(f"| sa {name} | T={t} | failed: {type(e).__name__}: {str(e)[:80]} |")
                print(rows[-1], flush=True)
                continue
            if tg is None:
                rows.append(f"| sa {name} | T={t} {n // 1024}K | err {err:.2e} | (checked only) |")
            else:
                rows.append(f"| sa {name} | T={t} {n // 1024}K | err {err:.2e} | graph {tg * 1e6:.1f} us | "
                            f"{must_read / tg / 1e9:.0f} GB/s ({100 * must_read / tg / 1e9 / copy:.0f}%) | "
                            f"{flops / tg / 1e12:.1f} TFLOP/s |")
            print(rows[-1], flush=True)


# indexer scores at T=1: the multi-query kernel's tiles (HP, BLOCK_T, BLOCK_N, NSUB, num_warps;
# None: the launcher's choice), then the one-query-per-tile kernel (rows=True) with its tiles.
# H200, 2026-12-01 (two calls): rows default (NSUB 2: 256 tiles) 12.4 / 12.7 us, (32, 1, 64, 8, 8)
# 12.4 / 12.6, NSUB 4 (one wave of 128 tiles) 15.3 / 15.4, NSUB 1 18.7 / 19.2; tiles 15.3 / 15.6
INDEXER_SCORE_CFGS = [(None, False), (None, True), ((32, 1, 64, 8, 8), True), ((64, 1, 128, 4, 8), True),
                      ((64, 1, 128, 1, 8), True), ((64, 1, 128, 2, 8), True), ((32, 1, 128, 4, 8), True),
                      ((32, 1, 128, 8, 8), True)]
# whole-op variants: (label, options). block / warps / per_k / bits / sb: the select's tile, warps,
# maxima per k, radix digit width, survivor tile; rows: the rows scores kernel; passes / span: the
# chunk-maxima bound from that many radix passes over the maxima's span (0: exact) and the
# survivors' select over their span; cfg: the scores kernel's tiles (None: the launcher's); min_per_k:
# the fewest maxima per k that still bound the select (default SELECT_MAXIMA_MIN_PER_K).
# (A select fused into the rows scores launch, the query's last tile selecting it after an
# acq_rel counter, was slower on the H200 on 2026-12-01: T=1 47.1 us (3 passes + span: 45.4)
# against 42.0, T=8 145.9 against 107.0, T=64 888.6 against 580.3; not kept.)
# parts: the split select's programs per row (`_split_select_kernel`; 0: one program per row);
# merge: the most neighbouring chunk maxima its bound merges (None: SPLIT_BOUND_MERGE).
# H200, 2026-12-01 14:00 UTC (T=1, whole op): one program 41.8 us; 8 / 16 / 32 parts 40.5 / 39.0 /
# 37.1; 16 with span 39.3, with 8 warps 42.4. T=64: one program 616.6, 2 / 4 parts 639.6 / 657.4.
_SEL = dict(block=4096, warps=16, per_k=8, bits=4, rows=True, sb=1024, passes=0, span=False, cfg=None, parts=0)
INDEXER_SELECTS = [
    ("rows + select (attn8)", dict(_SEL)),
    ("rows + split select, 8 parts", dict(_SEL, parts=8)),
    ("rows + split select, 16 parts", dict(_SEL, parts=16)),
    ("rows + split select, 32 parts", dict(_SEL, parts=32)),
    ("rows + split select, 16 parts, span", dict(_SEL, parts=16, span=True)),
    ("rows + split select, 16 parts, 8 warps", dict(_SEL, parts=16, warps=8)),
    ("rows + split select, 64 parts", dict(_SEL, parts=64)),
    ("rows + split select, 32 parts, 4 maxima per k", dict(_SEL, parts=32, per_k=4)),
    ("rows + split select, 32 parts, 2 maxima per k", dict(_SEL, parts=32, per_k=2, min_per_k=2)),
    ("rows + split select, 32 parts, bound merge 1", dict(_SEL, parts=32, merge=1)),
    ("rows + split select, 32 parts, bound merge 2", dict(_SEL, parts=32, merge=2)),
    ("rows NSUB 4 + split select, 32 parts", dict(_SEL, parts=32, cfg=(32, 1, 128, 4, 8))),
]
# the split select's parts x chunk maxima per k (the `indexer_per_k` sweep); at 4K only 2 per k
# writes maxima (chunks of 2 entries; fewer per k: the direct select, as the one-program row);
# at T=8 against the default dispatch (the one-program select). H200, 2026-12-01 ~16:25 UTC (whole
# op, T=1 at 64K): 16 parts 39.3 / 34.7 / 33.5 us at 8 / 4 / 2 per k, 32 parts 36.9 / 33.3 / 32.3
# (32 x 2 was made the default, then set back to 32 x 8 for the short-row cliff: indexer_topk.py); 4K 20.0-20.6 against the direct select's 19.8; T=8 109.2-118.1 against 111.4
INDEXER_PER_K = [(f"rows + split select, {p} parts, {m} maxima per k", dict(_SEL, parts=p, per_k=m, min_per_k=2))
                 for p in (16, 32) for m in (8, 4, 2)]
INDEXER_PER_K_4K = [INDEXER_SELECTS[0]] + [v for v in INDEXER_PER_K if v[1]["per_k"] == 2]
INDEXER_PER_K_TN = [v for v in INDEXER_PER_K if (v[1]["parts"], v[1]["per_k"]) in ((16, 8), (16, 2), (32, 2))]
# decode batches (T > 1): the one-program-per-row select and the split one at 2-16 parts per row
INDEXER_SELECTS_TN = [INDEXER_SELECTS[0]] + [(f"rows + split select, {p} parts", dict(_SEL, parts=p))
                                             for p in (2, 4, 8, 16)]


def _whole_op_rows(row, rows, variants, shape, args, want):
    """One `row` per whole-op variant ((label, options) as `INDEXER_SELECTS`) on the indexer
    arguments `args` (q, weights, codes, scales, table, entries per block, n_visible), its ids
    checked against `want`; a variant that fails is a row saying so."""
    from dsv41.npu_ops.triton import indexer_topk as itk

    q, w, kc, ks, tab, e, vis = args
    n = tab.shape[1] * e
    for label, o in variants:
        def call(o=o):
            opts = dict(block=o["block"], radix_bits=o["bits"], survivor_block=o["sb"], bound_passes=o["passes"],
                        span=o["span"], parts=o["parts"], min_maxima_per_k=o.get("min_per_k"), merge=o.get("merge"))
            maxg = itk.select_chunk(n, TOPK, 128, o["per_k"])
            s, maxima, maxg = itk._scores(q, w, kc, ks, tab, e, vis, topk=TOPK, rows=o["rows"], maxg=maxg,
                                          _cfg=o["cfg"])
            return itk.topk_select(s, vis, TOPK, maxima, maxg, num_warps=o["warps"], **opts)

        check = _ids_check(rows, f"indexer_topk {label}", shape, call, want)
        if check is not None:
            row(f"indexer_topk {label}", shape, check, call)


def _ids_check(rows, name: str, shape: str, call, want) -> str | None:
    """'equal True/False': `call()`'s ids against `want`; None (and a row saying so) when the
    variant fails to compile or run (a row, not a crash)."""
    try:
        return f"equal {torch.equal(call().cpu(), want.cpu())}"
    except Exception as ex:  # noqa: BLE001
        rows.append(f"| {name} | {shape} | failed: {type(ex).__name__}: {str(ex)[:80]} |")
        print(rows[-1], flush=True)
        return None


def sweep_indexer(rows, copy, tokens=(1, 64), check_only=False):
    """indexer_topk at a 64K context (paged keys): the scores kernels alone (tile variants at
    T=1), then the whole op with select variants (`INDEXER_SELECTS`); each checked against the
    reference (scores relative error, ids equal)."""
    from dsv41.npu_ops.triton import indexer_topk as itk

    n = 65536
    kc, ks, table, e = paged_index_keys(n, "cuda")
    ref_fn = registry.resolve("indexer_topk", "reference")[0]
    nbytes = n * (DI // 2 + DI // 32)

    def row(name, shape, check, call):
        if check_only:
            rows.append(f"| {name} | {shape} | {check} | (checked only) |")
            print(rows[-1], flush=True)
        else:
            bandwidth_row(rows, name, shape, check, call, nbytes, copy)

    for t in tokens:
        q = quant.mxfp4_qdq(torch.randn(t, HI, DI, device="cuda"))
        w = torch.randn(t, HI, device="cuda") * DI ** -0.5 * HI ** -0.5
        vis = torch.full((t,), n, dtype=torch.long, device="cuda")
        # a decode batch: each token its own block order (as tokens of different sequences)
        tab = torch.stack([table[0][torch.randperm(table.shape[1], device="cuda")] for _ in range(t)])
        with numerics("official"):  # the kernels round the head weights where the official code does
            want = ref_fn(q, w, kc, ks, tab, e, vis, TOPK)[0]
            # the reference's scores at T=1; for a batch the multi-query kernel's (the reference's
            # [T, N, d] gather would be gigabytes), the ids below against the reference either way
            s_ref = itk.indexer_scores_ref(q, w, kc, ks, tab, e) if t == 1 else \
                itk.indexer_scores(q, w, kc, ks, tab, e, vis, rows=False)
        for cfg, by_rows in INDEXER_SCORE_CFGS if t == 1 else [(None, True)]:
            def scores(q=q, w=w, tab=tab, vis=vis, cfg=cfg, by_rows=by_rows):
                return itk.indexer_scores(q, w, kc, ks, tab, e, vis, _cfg=cfg, rows=by_rows)

            name = f"indexer scores {'rows' if by_rows else 'tiles'} {cfg or 'default'}"
            err = checked_err(rows, name, f"T={t}", scores, s_ref)
            if err is not None:
                row(name, f"T={t} 64K", f"err {err:.1e}", scores)
        _whole_op_rows(row, rows, INDEXER_SELECTS if t == 1 else INDEXER_SELECTS_TN, f"T={t} 64K",
                       (q, w, kc, ks, tab, e, vis), want)
        if t == 1:  # the select launch alone: the attn8 select, the split one, and a row with k visible
            s1, mx1, g1 = itk._scores(q, w, kc, ks, tab, e, vis, topk=TOPK, rows=True)
            few = torch.full_like(vis, TOPK)
            for label, nv1, parts in (("select alone (attn8)", vis, 0), ("select alone (split, default parts)", vis, None),
                                      ("select alone, k visible (launch floor)", few, 0)):
                row(f"indexer {label}", f"T={t} 64K", "-",
                    lambda s1=s1, mx1=mx1, g1=g1, nv1=nv1, parts=parts: itk.topk_select(s1, nv1, TOPK, mx1, g1,
                                                                                        parts=parts))
            # the split select's stages (16 / 32 parts): the bound alone, bound + slices, all
            for parts in (16, 32):
                for stop, label in ((1, "bound only"), (2, "bound + slices"), (0, "all")):
                    row(f"indexer split select alone, {parts} parts, {label}", f"T={t} 64K", "-",
                        lambda s1=s1, mx1=mx1, g1=g1, parts=parts, stop=stop: itk._split_select(
                            s1, mx1, g1, vis, torch.empty(1, TOPK, dtype=torch.long, device="cuda"), TOPK, parts,
                            itk.SELECT_BLOCK, itk.RADIX_BITS, itk.SPLIT_FINAL_BLOCK, False, None, _stop=stop))
        row("indexer_topk default dispatch", f"T={t} 64K",
            f"equal {torch.equal(itk.indexer_topk(q, w, kc, ks, tab, e, vis, TOPK)[0], want)}",
            lambda q=q, w=w, tab=tab, vis=vis: itk.indexer_topk(q, w, kc, ks, tab, e, vis, TOPK))
        if t == 1:  # the split select's merged bound (SPLIT_BOUND_MERGE) against none, full and part rows
            saved = itk.SPLIT_BOUND_MERGE
            for frac in (1, 2, 4):
                vf = vis // frac
                with numerics("official"):
                    want_f = ref_fn(q, w, kc, ks, tab, e, vf, TOPK)[0]
                for merge in (saved, 1):
                    itk.SPLIT_BOUND_MERGE = merge
                    try:
                        row(f"indexer_topk default dispatch, bound merge {merge}", f"T={t} 64K, 1/{frac} visible",
                            f"equal {torch.equal(itk.indexer_topk(q, w, kc, ks, tab, e, vf, TOPK)[0], want_f)}",
                            lambda q=q, w=w, tab=tab, vf=vf: itk.indexer_topk(q, w, kc, ks, tab, e, vf, TOPK))
                    finally:
                        itk.SPLIT_BOUND_MERGE = saved
    if 1 in tokens:  # a short context (no chunk maxima: the direct select) with the default dispatch
        n4 = 4096
        kc4, ks4, tab4, e4 = paged_index_keys(n4, "cuda")
        q = quant.mxfp4_qdq(torch.randn(1, HI, DI, device="cuda"))
        w = torch.randn(1, HI, device="cuda") * DI ** -0.5 * HI ** -0.5
        vis = torch.full((1,), n4, dtype=torch.long, device="cuda")
        with numerics("official"):
            want = ref_fn(q, w, kc4, ks4, tab4, e4, vis, TOPK)[0]
        row("indexer_topk default dispatch", "T=1 4K",
            f"equal {torch.equal(itk.indexer_topk(q, w, kc4, ks4, tab4, e4, vis, TOPK)[0], want)}",
            lambda q=q, w=w, vis=vis: itk.indexer_topk(q, w, kc4, ks4, tab4, e4, vis, TOPK))


# the rows scores kernel's key decode (`indexer_topk._indexer_rows_kernel`): the shipped byte decode,
# the word decode (`_decode_key_words`) with the keys on the dot's N or M side, and tiles for it:
# (label, words, keys_m, BLOCK_N or None, warps or None); None keeps `_rows_config`'s choice
INDEXER_ROWS = [("bytes (shipped)", False, False, None, None), ("words, keys N", True, False, None, None),
                ("words, keys M", True, True, None, None), ("words, keys M, BN 128 w4", True, True, 128, 4),
                ("words, keys M, BN 64 w4", True, True, 64, 4), ("words, keys M, BN 256 w8", True, True, 256, 8)]


def sweep_indexer_rows(rows, copy, tokens=(1, 8, 64), check_only=False):
    """The indexer's rows scores kernel (decode shapes), `INDEXER_ROWS` variants, at 8K and 64K
    entries a query; each query of a batch reads its own keys (a decode batch of different
    sequences: the keys cross DRAM, not L2). Every variant's scores checked against the reference
    query by query; then `indexer_topk` by the default dispatch with the shipped decode and with
    the word decode (ids against the official-mode reference)."""
    from dsv41.npu_ops.triton import indexer_topk as itk

    ref_fn = registry.resolve("indexer_topk", "reference")[0]
    for n in (65536, 8192):
        for t in tokens:
            kc, ks, table, e = paged_index_keys(n * t, "cuda")
            nb = -(-n // e)
            tab = table[0][: t * nb].view(t, nb)  # query i: its own nb blocks of the pool
            q = quant.mxfp4_qdq(torch.randn(t, HI, DI, device="cuda"))
            w = torch.randn(t, HI, device="cuda") * DI ** -0.5 * HI ** -0.5
            vis = torch.full((t,), n, dtype=torch.long, device="cuda")
            shape = f"T={t} {n // 1024}K"
            nbytes = t * n * (DI // 2 + DI // 32)
            with numerics("official"):
                s_ref = torch.cat([itk.indexer_scores_ref(q[i:i + 1], w[i:i + 1], kc, ks, tab[i:i + 1], e)
                                   for i in range(t)])
            for label, words, keys_m, bn, warps in INDEXER_ROWS:
                cfg = itk._rows_config(t, HI, n, "cuda", block_n=bn, warps=warps)

                def call(q=q, w=w, tab=tab, vis=vis, cfg=cfg, words=words, keys_m=keys_m):
                    return itk.indexer_scores(q, w, kc, ks, tab, e, vis, _cfg=cfg, rows=True, words=words,
                                              keys_m=keys_m)

                name = f"indexer rows scores, {label} {cfg}"
                err = checked_err(rows, name, shape, call, s_ref)
                if err is None:
                    continue
                if check_only:
                    rows.append(f"| {name} | {shape} | err {err:.1e} | (checked only) |")
                    print(rows[-1], flush=True)
                else:
                    bandwidth_row(rows, name, shape, f"err {err:.1e}", call, nbytes, copy)
            with numerics("official"):
                want = ref_fn(q, w, kc, ks, tab, e, vis, TOPK)[0]
            saved = itk.ROWS_WORDS, itk.ROWS_KEYS_M
            for words, keys_m in ((False, False), (True, True)):
                itk.ROWS_WORDS, itk.ROWS_KEYS_M = words, keys_m
                try:
                    eq = torch.equal(itk.indexer_topk(q, w, kc, ks, tab, e, vis, TOPK)[0], want)
                    name = f"indexer_topk default dispatch, words={words} keys_m={keys_m}"
                    if check_only:
                        rows.append(f"| {name} | {shape} | equal {eq} | (checked only) |")
                        print(rows[-1], flush=True)
                    else:
                        bandwidth_row(rows, name, shape, f"equal {eq}", lambda q=q, w=w, tab=tab, vis=vis:
                                      itk.indexer_topk(q, w, kc, ks, tab, e, vis, TOPK), nbytes, copy)
                finally:
                    itk.ROWS_WORDS, itk.ROWS_KEYS_M = saved
            del kc, ks, table


def sweep_indexer_per_k(rows, copy, tokens=(1, 8), check_only=False):
    """indexer_topk's split select by parts x chunk maxima per k (`INDEXER_PER_K`): T=1 at 64K
    (with the scores kernel alone, for the select's share) and 4K, decode batches at 64K, each
    against the default dispatch; every row's ids checked against the official-mode reference."""
    from dsv41.npu_ops.triton import indexer_topk as itk

    ref_fn = registry.resolve("indexer_topk", "reference")[0]
    # 4160: a 65-block table holding a 4K context plus the step's token (4097 visible), past one
    # select tile; the default dispatch gives it SPLIT_SHORT_MAXIMA_PER_K maxima per k
    for n in (65536, 4096, 4160):
        kc, ks, table, e = paged_index_keys(n, "cuda")
        nbytes = n * (DI // 2 + DI // 32)

        def row(name, shape, check, call, nbytes=nbytes):
            if check_only:
                rows.append(f"| {name} | {shape} | {check} | (checked only) |")
                print(rows[-1], flush=True)
            else:
                bandwidth_row(rows, name, shape, check, call, nbytes, copy)

        for t in tokens if n == 65536 else (1,):
            q = quant.mxfp4_qdq(torch.randn(t, HI, DI, device="cuda"))
            w = torch.randn(t, HI, device="cuda") * DI ** -0.5 * HI ** -0.5
            vis = torch.full((t,), 4097 if n == 4160 else n, dtype=torch.long, device="cuda")
            tab = torch.stack([table[0][torch.randperm(table.shape[1], device="cuda")] for _ in range(t)])
            shape = f"T={t} {n // 1024}K" if n % 1024 == 0 else f"T={t} N={n} visible {int(vis[0])}"
            with numerics("official"):  # the kernels round the head weights where the official code does
                want = ref_fn(q, w, kc, ks, tab, e, vis, TOPK)[0]
            if t == 1 and n == 65536:
                row("indexer scores rows default", shape, "-",
                    lambda q=q, w=w, tab=tab, vis=vis: itk.indexer_scores(q, w, kc, ks, tab, e, vis, rows=True))
            row("indexer_topk default dispatch", shape,
                f"equal {torch.equal(itk.indexer_topk(q, w, kc, ks, tab, e, vis, TOPK)[0], want)}",
                lambda q=q, w=w, tab=tab, vis=vis: itk.indexer_topk(q, w, kc, ks, tab, e, vis, TOPK))
            variants = INDEXER_PER_K if t == 1 and n == 65536 else INDEXER_PER_K_4K if t == 1 else INDEXER_PER_K_TN
            _whole_op_rows(row, rows, variants, shape, (q, w, kc, ks, tab, e, vis), want)


# the one-program-per-row select alone at decode sizes without chunk maxima (the direct select of
# a Full layer's 2K / 4K entries, a Reindex layer's 4K candidates): (tile, warps, radix bits)
# variants. H200, 2026-12-01 (T=1 / 8, graph): at 2K / 4K dense 16 or 8 warps with 4-bit digits
# 14.6-15.7 us, 4 warps 18.6-19.3, 8-bit digits 20.8-29.7; 4K candidates in no order 16 warps
# 54.6-62.2, 8 warps 44.8-47.0, 4 warps 65.3-65.7 (before the ascending rows skipped the ranks).
SELECT_SMALL = [(4096, 16, 4), (4096, 8, 4), (8192, 16, 4), (8192, 32, 4)]
# (entries, kind): 4160 = a 4K context plus the step's tokens, past one 4096 tile
SELECT_CASES = [(4096, "dense"), (4160, "dense"), (4096, "reindex"), (4096, "pool"), (4160, "pool")]


def _select_case(t: int, n: int, kind: str, gen: torch.Generator, dev: str = "cuda"):
    """Random fp32 scores [t, n] on the device and the expected ids. kind "dense": all n visible,
    the stable top-k as ascending ids; "reindex": columns are candidate entry ids in no order, 1
    in 8 of them -1 padding scored -inf, the chosen candidates' ids ascending, -1 padded;
    "pool": the same with the candidates ascending and the padding last (the candidate pool's
    order, which the model's Reindex layers see)."""
    from dsv41.npu_ops.triton import indexer_topk as itk

    s = torch.randn(t, n, generator=gen)
    vis = torch.full((t,), n, dtype=torch.long)
    if kind == "dense":
        return s.to(dev), vis.to(dev), None, itk._topk_sorted(s, TOPK, torch.ones_like(s, dtype=torch.bool))
    cand = torch.stack([torch.randperm(4 * n, generator=gen)[:n] for _ in range(t)])
    cand[torch.rand(t, n, generator=gen) < 0.125] = -1
    if kind == "pool":
        cand = torch.where(cand >= 0, cand, torch.full_like(cand, 1 << 62)).sort(-1).values
        cand[cand == 1 << 62] = -1
    s = torch.where(cand >= 0, s, torch.full_like(s, float("-inf")))
    cols = itk._topk_sorted(torch.where(cand >= 0, s, torch.zeros_like(s)), TOPK, cand >= 0)
    ids = torch.where(cols >= 0, cand.gather(1, cols.clamp(min=0)), torch.full_like(cols, 1 << 62))
    ids = ids.sort(-1).values
    want = torch.where(ids == 1 << 62, torch.full_like(ids, -1), ids)
    return s.to(dev), vis.to(dev), cand.to(dev), want


def sweep_select(rows, copy, tokens=(1, 8)):
    """`indexer_topk.topk_select` alone, without chunk maxima, on random scores: a Full layer's
    direct select over ~4K visible entries and a Reindex layer's over ~4K candidates (in no
    order, and in the candidate pool's ascending order; `SELECT_CASES`), by tile x warps x radix
    digit width (`SELECT_SMALL`); every row's ids checked against a torch top-k."""
    from dsv41.npu_ops.triton import indexer_topk as itk

    gen = torch.Generator().manual_seed(0)
    for t in tokens:
        for n, kind in SELECT_CASES:
            s, vis, cand, want = _select_case(t, n, kind, gen)
            shape = f"T={t} N={n} {kind}"
            for block, warps, bits in SELECT_SMALL:
                def call(block=block, warps=warps, bits=bits, s=s, vis=vis, cand=cand):
                    return itk.topk_select(s, None if cand is not None else vis, TOPK, candidates=cand,
                                           block=block, num_warps=warps, radix_bits=bits)
                name = f"select block={block} warps={warps} bits={bits}"
                if block == itk.SELECT_BLOCK and (warps, bits) == (itk.SELECT_WARPS, itk.RADIX_BITS):
                    name += " (default)"
                check = _ids_check(rows, name, shape, call, want)
                if check is not None:
                    bandwidth_row(rows, name, shape, check, call, s.numel() * 4, copy)


def sweep_reindex(rows, copy, tokens=(1,), contexts=(32768, 65536), pool_blocks=CFG.candidate_topk_blocks,
                  pool_block=CFG.candidate_block_size):
    """A decode row's candidate pool and Reindex selection as the mini step makes them (ratio-1
    layers: one entry a position; the pool's `candidate_topk_blocks` blocks of
    `candidate_block_size` entries: 2048 x 8 = 16384 candidates, one block maximum per 8 entries,
    4096 of them at 32K, 8192 at 64K): the pool source's whole `indexer_topk` (scores, top-k
    select, candidate pool) with the pool after the select or beside it (`POOL_BESIDE_SELECT`) at
    `POOL_BLOCK` 4096 and 8192 (and beside it with the merged bound on one 8192 tile,
    `SPLIT_BOUND_WIDE`), then the Reindex layer's whole op over that pool with the one-program
    select and the split select (`SPLIT_CANDIDATES`); ids and pool checked against the reference."""
    for n in contexts:
        _sweep_reindex_at(rows, copy, tokens, n, pool_blocks, pool_block)


def _sweep_reindex_at(rows, copy, tokens, n, pool_blocks, pool_block):
    """`sweep_reindex` at one context of n entries."""
    from dsv41.npu_ops.triton import indexer_topk as itk

    kc, ks, table, e = paged_index_keys(n, "cuda")
    ref_fn = registry.resolve("indexer_topk", "reference")[0]
    for t in tokens:
        q = quant.mxfp4_qdq(torch.randn(t, HI, DI, device="cuda"))
        w = torch.randn(t, HI, device="cuda") * DI ** -0.5 * HI ** -0.5
        q2 = quant.mxfp4_qdq(torch.randn(t, HI, DI, device="cuda"))  # the Reindex layer's own queries
        vis = torch.full((t,), n, dtype=torch.long, device="cuda")
        tab = table.expand(t, -1).contiguous()
        args = (kc, ks, tab, e, vis, TOPK)
        with numerics("official"):
            want_idx, want_pool = ref_fn(q, w, *args, pool_blocks=pool_blocks, pool_block_size=pool_block)
            want_re = ref_fn(q2, w, *args, candidates=want_pool, candidate_block_size=pool_block)[0]
        shape = f"T={t} {n // 1024}K, pool {pool_blocks}x{pool_block}"
        saved = (itk.POOL_BLOCK, itk.SPLIT_CANDIDATES, itk.POOL_BESIDE_SELECT, itk.SPLIT_BOUND_WIDE)
        try:
            for blk, beside, wide in ((4096, False, 4096), (4096, True, 4096), (8192, False, 4096),
                                      (8192, True, 4096), (8192, True, 8192)):
                itk.POOL_BLOCK, itk.POOL_BESIDE_SELECT, itk.SPLIT_BOUND_WIDE = blk, beside, wide
                got = itk.indexer_topk(q, w, *args, pool_blocks=pool_blocks, pool_block_size=pool_block)
                ok = torch.equal(got[0], want_idx) and torch.equal(got[1].long(), want_pool.long())
                bandwidth_row(rows, f"indexer_topk pool source, POOL_BLOCK {blk}, "
                              f"{'beside' if beside else 'after'} the select, SPLIT_BOUND_WIDE {wide}", shape,
                              f"equal {ok}",
                              lambda: itk.indexer_topk(q, w, *args, pool_blocks=pool_blocks, pool_block_size=pool_block),
                              n * (DI // 2 + DI // 32), copy)
                if beside or wide != 4096:
                    continue
                mx = itk._scores(q, w, kc, ks, tab, e, vis, topk=TOPK, maxg=pool_block)[1]
                bandwidth_row(rows, f"pool_select alone, POOL_BLOCK {blk}", shape, "-",
                              lambda mx=mx: itk.pool_select(mx, vis, n, pool_blocks, pool_block), mx.numel() * 4, copy)
            pool = want_pool.to(torch.int32)
            for split in (False, True):
                itk.SPLIT_CANDIDATES = split
                call = lambda: itk.indexer_topk(q2, w, *args, candidates=pool, candidate_block_size=pool_block)  # noqa: E731
                bandwidth_row(rows, f"indexer_topk Reindex, {'split' if split else 'one-program'} select", shape,
                              f"equal {torch.equal(call()[0], want_re)}", call,
                              pool.numel() * pool_block * (DI // 2 + DI // 32), copy)
        finally:
            itk.POOL_BLOCK, itk.SPLIT_CANDIDATES, itk.POOL_BESIDE_SELECT, itk.SPLIT_BOUND_WIDE = saved


def sweep_indexer_bound(rows, copy, contexts=(32768, 65536), rounds=2):
    """The T=1 split select's bound (`indexer_topk.SPLIT_BOUND_HIST_SHIFT`): from the histogram of
    the chunk maxima the scores kernel counts, against the radix passes over the merged (and the
    unmerged) maxima, on the whole op by the default dispatch: dense rows with all, half and a
    quarter of their entries visible, and the pool source (the mini step's 2048 x 8 candidate
    pool beside the select); the variants alternated `rounds` times. Ids (and pool) checked against
    the reference, and the histogram buffer checked zero after the calls."""
    from dsv41.npu_ops.triton import indexer_topk as itk

    ref_fn = registry.resolve("indexer_topk", "reference")[0]
    saved = (itk.SPLIT_BOUND_HIST_SHIFT, itk.SPLIT_BOUND_MERGE)
    variants = (("histogram", saved[0] or itk.HIST_SHIFT_DEFAULT, saved[1]), ("radix, merge 4", 0, 4), ("radix, no merge", 0, 1))
    pools = ((0, 1), (CFG.candidate_topk_blocks, CFG.candidate_block_size))
    try:
        for n in contexts:
            kc, ks, table, e = paged_index_keys(n, "cuda")
            q = quant.mxfp4_qdq(torch.randn(1, HI, DI, device="cuda"))
            w = torch.randn(1, HI, device="cuda") * DI ** -0.5 * HI ** -0.5
            for frac, (pool_blocks, pool_block) in [(f, pools[0]) for f in (1, 2, 4)] + [(1, pools[1])]:
                vis = torch.full((1,), n // frac, dtype=torch.long, device="cuda")
                kw = dict(pool_blocks=pool_blocks, pool_block_size=pool_block)
                with numerics("official"):
                    want = ref_fn(q, w, kc, ks, table, e, vis, TOPK, **kw)
                shape = f"T=1 {n // 1024}K, 1/{frac} visible"
                shape += f", pool {pool_blocks}x{pool_block}" if pool_blocks else ""
                for r in range(rounds):
                    for label, shift, merge in variants:
                        itk.SPLIT_BOUND_HIST_SHIFT, itk.SPLIT_BOUND_MERGE = shift, merge
                        call = lambda kw=kw, vis=vis: itk.indexer_topk(q, w, kc, ks, table, e, vis, TOPK, **kw)  # noqa: E731
                        got = call()
                        ok = torch.equal(got[0], want[0]) and (not pool_blocks or torch.equal(got[1].long(),
                                                                                               want[1].long()))
                        hist = itk.bound_histogram(1, torch.device("cuda"))
                        clean = hist is None or not bool(hist.any())
                        bandwidth_row(rows, f"indexer_topk bound {label} (round {r + 1})", shape,
                                      f"equal {ok}, histogram zero {clean}", call, n * (DI // 2 + DI // 32), copy)
    finally:
        itk.SPLIT_BOUND_HIST_SHIFT, itk.SPLIT_BOUND_MERGE = saved


def sweep_engram(rows, copy):
    from dsv41.npu_ops.triton import engram_lookup as el

    n_tab = 1 << 22
    table, tscale = quant.fp8_quant(torch.randn(n_tab, CFG.engram_head_dim, device="cuda"))
    r = CFG.n_engram_rows_per_token
    ref_fn = registry.resolve("engram_lookup", "reference")[0]
    for t in (256, 4096):
        ids = torch.randint(0, n_tab, (t, r), device="cuda")
        ref = ref_fn(table, tscale, ids)
        nbytes = t * r * (CFG.engram_head_dim * 3 + CFG.engram_head_dim // 32)
        for br in (16, 32, 64):
            for nw in (4, 8):
                def call(ids=ids, br=br, nw=nw):
                    return el.engram_lookup(table, tscale, ids, block_r=br, num_warps=nw)

                exact = torch.equal(call().view(torch.int16), ref.view(torch.int16))
                bandwidth_row(rows, f"engram BLOCK_R={br} warps={nw}", f"T={t}", f"exact {exact}", call, nbytes, copy)


def sweep_fp4_quant(rows, copy):
    from dsv41.npu_ops.triton import fp4_kv_store as fkv

    m = 65536
    x = torch.randn(m, D, device="cuda").to(torch.bfloat16)
    rc, rs = quant.fp4_quant(x)
    nbytes = m * D * 2 + m * (D // 2 + D // 16)
    slots = torch.arange(m, device="cuda")
    codes = torch.empty(m, D // 2, dtype=torch.uint8, device="cuda")
    scales = torch.empty(m, D // 16, dtype=torch.float8_e4m3fn, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    variants = [  # (BLOCK_G, num_warps, word path, programs per SM; None: the launcher's default)
        (256, 4, False, None), (256, 8, True, None), (256, 8, True, 6), (256, 8, True, 4), (256, 8, True, 32),
        (128, 4, True, 16), (512, 8, True, 3),
    ]
    for bg, nw, words, per in variants:
        def call(bg=bg, nw=nw, words=words, per=per):
            fkv.fp4_kv_store(x, slots, codes, scales, block_g=bg, num_warps=nw, words=words,
                             workers=per and per * sms)

        codes.fill_(0xAA)
        call()
        exact = torch.equal(codes, rc) and torch.equal(scales.view(torch.uint8), rs.view(torch.uint8))
        bandwidth_row(rows, f"fp4 BLOCK_G={bg} warps={nw} words={words} per_sm={per}", f"{m}x{D} bf16",
                      f"exact {exact}", call, nbytes, copy)


def mhc_weights():
    """Random mix-projection weights of the mini preset on the GPU: fn [24, 4d] fp32, scale [3],
    base [24]."""
    n, dim = CFG.hc_mult, CFG.hidden_size
    fn = torch.randn((2 + n) * n, n * dim, device="cuda") * (n * dim) ** -0.5
    return fn, torch.rand(3, device="cuda") + 0.5, torch.randn((2 + n) * n, device="cuda") * 0.5


def mhc_activations(t: int):
    """Random mHC step inputs for t tokens: streams x [t, 4, d], sublayer output y [t, d] (bf16),
    post / pre [t, 4] and a row-stochastic comb [t, 4, 4] (fp32)."""
    n, dim = CFG.hc_mult, CFG.hidden_size
    x = torch.randn(t, n, dim, device="cuda").to(torch.bfloat16)
    y = torch.randn(t, dim, device="cuda").to(torch.bfloat16)
    post = torch.rand(t, n, device="cuda") * 2
    comb = torch.softmax(torch.randn(t, n, n, device="cuda"), -1)
    return x, y, post, comb, torch.rand(t, n, device="cuda")


def sweep_mhc_mix(rows, copy, tokens=(64, 4096)):
    """`mhc_mix` with the next sublayer's coefficients (fn) at T tokens, tile variants against the
    fp64-accumulating oracle; at decode batches (T <= 64) also wider token tiles and fewer d
    chunks."""
    from dsv41.backends.reference.basic import fp32_accumulation
    from dsv41.npu_ops.triton import mega_mhc as mm

    n, dim = CFG.hc_mult, CFG.hidden_size
    fn, scale, base = mhc_weights()
    ref_fn = registry.resolve("mhc_mix", "reference")[0]
    variants = [  # (block_t, block_d, num_warps, num_stages, d_split; None: the launcher's rule)
        (16, 64, 4, 2, None), (16, 64, 4, 3, None), (16, 64, 4, 2, 16), (16, 128, 4, 2, None), (32, 64, 4, 2, None),
    ]
    decode = [(32, 64, 4, 2, 16), (64, 64, 4, 2, None), (64, 64, 8, 2, None), (16, 64, 4, 2, 32), (16, 128, 4, 2, 16),
              (16, 64, 4, 1, None)]
    # the transposed projection on fn's bf16 parts (mega_mhc.TDOT_M): wgmma, no replicated update
    tdot = [(16, 64, 4, 2, None, True), (16, 64, 4, 1, None, True), (16, 32, 4, 2, None, True),
            (16, 32, 4, 1, None, True), (32, 64, 4, 1, None, True), (32, 32, 4, 2, None, True)]
    for t in tokens:
        x, y, post, comb, pre = mhc_activations(t)
        args = (x, y, post, comb, pre, fn, scale, base, 1e-20, 1e-6, CFG.hc_sinkhorn_iters)
        want = ref_fn(*args)  # the fp64-accumulating oracle
        with fp32_accumulation():  # the unfused torch sequence the kernel replaces
            t_ref = timeit(lambda args=args: ref_fn(*args), iters=5)
        nbytes = t * (2 * n + 2) * dim * 2 + fn.numel() * 4
        for bt, bd, nw, ns, ds, *td in variants + (decode if t <= 64 else []) + tdot:
            def call(args=args, bt=bt, bd=bd, nw=nw, ns=ns, ds=ds, td=bool(td and td[0])):
                return mm.mhc_mix(*args, block_t=bt, block_d=bd, num_warps=nw, num_stages=ns, d_split=ds, tdot=td)

            name = f"mhc T={bt} D={bd} w={nw} s={ns} split={ds}" + (" tdot" if td and td[0] else "")
            try:
                got = call()
                frac = (got[0] != want[0]).float().mean().item()
                err = max((a - b).abs().max().item() for a, b in zip(got[2], want[2]))
                te = timeit(call)
                tg = graph_time(call)
            except Exception as e:  # noqa: BLE001  (a variant that does not compile is a row, not a crash)
                rows.append(f"| {name} | T={t} | failed: {type(e).__name__}: {str(e)[:80]} |")
                print(rows[-1], flush=True)
                continue
            rows.append(f"| {name} | T={t} | x_new differ {frac:.1e}, coef err {err:.1e} | eager {te * 1e6:.1f} us | "
                        f"graph {tg * 1e6:.1f} us | {nbytes / tg / 1e9:.0f} GB/s ({100 * nbytes / tg / 1e9 / copy:.0f}%) | "
                        f"torch {t_ref * 1e6:.0f} us, {t_ref / te:.1f}x eager |")
            print(rows[-1], flush=True)


def _variant_row(rows, name, shape, call, want, nbytes, flops, copy, timed=None):
    """Check `call` against `want` (relative error in norm), time it (or `timed`: the same op on
    inputs cycled past the L2), append / print its row."""
    try:
        got = call()
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        te = timeit(timed or call)
        tg = graph_time(timed or call) or te
    except Exception as e:  # noqa: BLE001  (a variant that does not compile is a row, not a crash)
        rows.append(f"| {name} | {shape} | failed: {type(e).__name__}: {str(e)[:100]} |")
        print(rows[-1], flush=True)
        return
    rows.append(f"| {name} | {shape} | err {err:.1e} | eager {te * 1e6:.1f} us | graph {tg * 1e6:.1f} us | "
                f"{nbytes / tg / 1e9:.0f} GB/s ({100 * nbytes / tg / 1e9 / copy:.0f}%) | {flops / tg / 1e12:.0f} TFLOP/s |")
    print(rows[-1], flush=True)


def sweep_linear(rows, copy):
    """The FP8 block-scaled linear at K=5120, N=6144: decode tiles (M = 1, 64) and prefill tiles
    (M = 4096), against the fp32-accumulating torch reference; plus cuBLAS bf16 on the same
    (pre-dequantised) operands as the prefill yardstick."""
    from dsv41.backends.reference.basic import fp32_accumulation
    from dsv41.backends.reference.basic import linear as linear_ref
    from dsv41.npu_ops.triton import block_linear as bl

    k, n = 5120, 6144
    w, s = quant.fp8_block_quant(torch.randn(n, k, device="cuda") * k ** -0.5)
    decode = [dict(bn=64, bk=128, num_warps=4, num_stages=4), dict(bn=32, bk=128, num_warps=4, num_stages=4),
              dict(bn=64, bk=256, num_warps=4, num_stages=3), dict(bn=128, bk=128, num_warps=4, num_stages=4),
              dict(bn=64, bk=128, num_warps=4, num_stages=6), dict(bn=64, bk=128, num_warps=8, num_stages=4),
              dict(bn=64, bk=128, split_k=4), dict(bn=64, bk=128, split_k=10), dict(bn=64, bk=128, split_k=1),
              dict(bn=128, bk=256, num_warps=4, num_stages=3), dict(bn=128, bk=128, num_warps=8, num_stages=4),
              dict(bn=256, bk=128, num_warps=8, num_stages=3), dict(bn=64, bk=64, num_warps=4, num_stages=8)]
    prefill = [dict(), dict(bm=128, bn=128, bk=64, num_warps=8, num_stages=3), dict(bm=128, bn=128, bk=64, num_warps=8, num_stages=4),
               dict(bm=128, bn=256, bk=64, num_warps=8, num_stages=3), dict(bm=64, bn=128, bk=64, num_warps=4, num_stages=4),
               dict(bm=128, bn=128, bk=128, num_warps=8, num_stages=3), dict(bm=256, bn=128, bk=64, num_warps=8, num_stages=3)]
    for m, variants in ((1, decode), (64, decode), (4096, prefill)):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        with fp32_accumulation():
            want = linear_ref(x, w, s)
        nbytes = n * k * (1 + 1 / 1024) + m * k * 2 + m * n * 2
        for v in variants:
            name = "linear fp8 " + " ".join(f"{a}={b}" for a, b in v.items())
            _variant_row(rows, name, f"M={m} K={k} N={n}", lambda x=x, v=v: bl.linear(x, w, s, **v), want, nbytes,
                         2 * m * n * k, copy)
        if m == 4096:
            wb = quant.fp8_block_dequant(w, s).to(torch.bfloat16)
            _variant_row(rows, "cuBLAS bf16 (weight pre-dequantised)", f"M={m} K={k} N={n}", lambda x=x: x @ wb.t(),
                         want, nbytes, 2 * m * n * k, copy)


def _fp4_experts(n_exp, d, inter):
    """n_exp random FP4 experts (w1 [inter, d], w2 [d, inter], w3 [inter, d]) on the GPU."""
    return [tuple(quant.fp4_weight_quant(torch.randn(a, b, device="cuda") * b ** -0.5)
                  for a, b in ((inter, d), (d, inter), (inter, d))) for _ in range(n_exp)]


def _moe_case(t, experts, d, inter, n_exp, topk, moe_ref, fp32_accumulation):
    """Random routing of t tokens: (x, ids, weights, the fp32-accumulating reference output,
    distinct active experts, bytes = their weights read once plus activations)."""
    x = torch.randn(t, d, device="cuda").to(torch.bfloat16)
    ids = torch.stack([torch.randperm(n_exp, device="cuda")[:topk] for _ in range(t)])
    wts = torch.rand(t, topk, device="cuda")
    with fp32_accumulation():
        want = moe_ref(x, wts, ids, experts, 10.0)
    active = int(torch.unique(ids).numel())
    return x, ids, wts, want, active, active * 3 * inter * d * (0.5 + 1 / 32) + t * d * 6


def sweep_moe(rows, copy, tokens=(1, 8, 64, 8192)):
    """The FP4 routed experts (mini preset: 16 experts, d 5120, width 2304, top-6): the grouped
    tensor-core path's tile variants against the GEMV path (T <= 4) and the per-32-block tiled
    kernels (T <= 64); bytes = the active experts' weights read once."""
    from dsv41.backends.reference.basic import fp32_accumulation
    from dsv41.backends.reference.moe import moe_experts as moe_ref
    from dsv41.npu_ops.triton import moe_experts as me

    d, inter, n_exp, topk = CFG.hidden_size, CFG.moe_intermediate_size, 16, CFG.num_experts_per_tok
    experts = _fp4_experts(n_exp, d, inter)
    g = "grouped"
    small = [dict(path=g, swap=False), dict(path=g, swap=True), dict(path=g, swap=True, bm=16),
             dict(path=g, swap=False, bm=16), dict(path=g, swap=True, bn_up=128, bn_down=128),
             dict(path=g, swap=False, bk=256), dict(path=g, swap=True, bk=256), dict(path=g, swap=True, num_warps=8),
             dict(path=g, swap=False, bk=64)]
    large = [dict(path=g), dict(path=g, predequant=False, swap=False), dict(path=g, predequant=False, swap=True),
             dict(path=g, predequant=True, bm=128, bn_up=128, bn_down=128, bk=64, num_warps=8, num_stages=4),
             dict(path=g, predequant=True, bm=64, bn_up=128, bn_down=128, bk=64, num_warps=4, num_stages=4),
             dict(path=g, predequant=False, swap=False, bm=64, bn_up=64, bn_down=128, bk=128, num_warps=4, num_stages=3),
             dict(path=g, predequant=False, swap=True, bm=64, bn_up=128, bn_down=128, bk=128, num_warps=8, num_stages=3),
             dict(path=g, predequant=False, swap=True, bm=128, bn_up=64, bn_down=128, bk=128, num_warps=8, num_stages=2),
             dict(path=g, predequant=False, swap=False, bm=128, bn_up=128, bn_down=128, bk=128, num_warps=8, num_stages=2)]
    for t in tokens:
        x, ids, wts, want, active, nbytes = _moe_case(t, experts, d, inter, n_exp, topk, moe_ref, fp32_accumulation)
        flops = 2 * t * topk * 3 * inter * d
        variants = ([dict(path="gemv")] if t <= me.GEMV_MAX_T else []) + \
            ([dict(path="tiled")] if t == 64 else []) + (small if t == 64 else small[:3] if t <= 64 else large)
        if t == 1:
            variants = variants[:3]
        for v in variants:
            name = "moe fp4 " + " ".join(f"{a}={b}" for a, b in v.items())
            _variant_row(rows, name, f"T={t} {active} experts", lambda x=x, ids=ids, wts=wts, v=v:
                         me.moe_experts(x, wts, ids, experts, 10.0, **v), want, nbytes, flops, copy)


def sweep_moe_decode(rows, copy, tokens=(1, 2, 4, 8, 16, 32, 64)):
    """The FP4 routed experts at decode sizes (mini preset: 16 experts, d 5120, width 2304,
    top-6): the GEMV / tiled kernels against the folded tensor-core path (`moe_fold`: int32
    weight words, bf16 by bit placement) and its variants (dot orientation, warps, K slices of
    the gate/up at T <= 16); bytes = the active experts' weights read once."""
    from dsv41.backends.reference.basic import fp32_accumulation
    from dsv41.backends.reference.moe import moe_experts as moe_ref
    from dsv41.npu_ops.triton import moe_experts as me

    d, inter, n_exp, topk = CFG.hidden_size, CFG.moe_intermediate_size, 16, CFG.num_experts_per_tok
    experts = _fp4_experts(n_exp, d, inter)
    f = "fold"
    fold = [dict(path=f), dict(path=f, w_left=False), dict(path=f, num_warps=8),
            dict(path=f, w_left=False, num_warps=8)]
    small = [dict(path=f, split=2), dict(path=f, split=4), dict(path=f, split=4, w_left=False, num_warps=8)]
    for t in tokens:
        x, ids, wts, want, active, nbytes = _moe_case(t, experts, d, inter, n_exp, topk, moe_ref, fp32_accumulation)
        old = [dict(path="gemv" if t <= me.GEMV_DEFAULT_T[me.W_FP4] else "tiled")]
        for v in old + fold + (small if t <= 16 else [dict(path=f, bk=256)] if t == 64 else []):
            name = "moe fp4 " + " ".join(f"{a}={b}" for a, b in v.items())
            _variant_row(rows, name, f"T={t} {active} experts", lambda x=x, ids=ids, wts=wts, v=v:
                         me.moe_experts(x, wts, ids, experts, 10.0, **v), want, nbytes, 2 * t * topk * 3 * inter * d,
                         copy)
        if t in (1, 64):  # where the time goes: the default fold path's kernels
            rows.append(f"| moe fold kernels | T={t} | " + kernel_times(
                lambda x=x, ids=ids, wts=wts: me.moe_experts(x, wts, ids, experts, 10.0, path=f)) + " |")
            print(rows[-1], flush=True)


def sweep_moe_bytes(rows, copy, tokens=(1, 8, 16, 64)):
    """The folded FP4 decode path (`moe_fold`, mini preset: 16 experts, d 5120, width 2304, top-6)
    with its weight tiles built from int32 words (`fp4_tile_bf16`) against tiles built from bytes
    (`byte_tiles=True`, `fp4_bytes_bf16`: each thread loads the bytes of its own wgmma operand
    fragment, no shared-memory round trip of the converted tile) and that variant's tiles; where
    the time goes (both variants' kernels) at T = 8 and 64."""
    from dsv41.backends.reference.basic import fp32_accumulation
    from dsv41.backends.reference.moe import moe_experts as moe_ref
    from dsv41.npu_ops.triton import moe_experts as me

    d, inter, n_exp, topk = CFG.hidden_size, CFG.moe_intermediate_size, 16, CFG.num_experts_per_tok
    experts = _fp4_experts(n_exp, d, inter)
    f = "fold"
    for t in tokens:
        x, ids, wts, want, active, nbytes = _moe_case(t, experts, d, inter, n_exp, topk, moe_ref, fp32_accumulation)
        extra = ([dict(split=1), dict(split=2)] if t == 8 else [dict(bm=64), dict(num_stages=4)] if t == 64 else
                 [dict(num_stages=4)] if t == 1 else [])
        for v in [dict(path=f, byte_tiles=False), dict(path=f, byte_tiles=True)] + \
                [dict(v, path=f, byte_tiles=True) for v in extra]:
            name = "moe fp4 " + " ".join(f"{a}={b}" for a, b in v.items())
            _variant_row(rows, name, f"T={t} {active} experts", lambda x=x, ids=ids, wts=wts, v=v:
                         me.moe_experts(x, wts, ids, experts, 10.0, **v), want, nbytes, 2 * t * topk * 3 * inter * d,
                         copy)
        if t in (8, 64):
            for byte_tiles in (False, True):
                rows.append(f"| moe fold byte_tiles={byte_tiles} kernels | T={t} | " + kernel_times(
                    lambda x=x, ids=ids, wts=wts, b=byte_tiles: me.moe_experts(x, wts, ids, experts, 10.0, path=f,
                                                                               byte_tiles=b)) + " |")
                print(rows[-1], flush=True)


def skewed_ids(t, n_exp, topk, sigma, seed=1):
    """t tokens' distinct top-k experts drawn by popularity exp(sigma * N(0, 1)) per expert (the
    uneven routing of the mini model's decode batches: sigma 0.5 gives ~12..51 rows an expert at
    T=64, as e2e's batches); sigma 0: uniform."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pop = torch.exp(torch.randn(n_exp, device="cuda", generator=g) * sigma)
    return torch.stack([torch.multinomial(pop, topk, replacement=False, generator=g) for _ in range(t)])


def sweep_moe_slots(rows, copy, tokens=(33, 64), sigmas=(0.0, 0.5, 1.0)):
    """The folded FP4 path at 17..64 tokens (mini preset widths, 16 experts, top-6) under uniform
    and skewed routing (`skewed_ids`): the default (row tiles in slots, the gate/up kernel capped
    at 168 registers) against one program per (expert, column tile) without the cap (the default
    before 2026-12-04) and each change alone; bytes = the active experts' weights read once."""
    from dsv41.backends.reference.basic import fp32_accumulation
    from dsv41.backends.reference.moe import moe_experts as moe_ref
    from dsv41.npu_ops.triton import moe_experts as me

    d, inter, n_exp, topk = CFG.hidden_size, CFG.moe_intermediate_size, 16, CFG.num_experts_per_tok
    experts = _fp4_experts(n_exp, d, inter)
    variants = [("default", {}), ("one slot, no cap (before)", dict(slots=1, maxnreg=255)),
                ("slots alone", dict(maxnreg=255)), ("cap alone", dict(slots=1))]
    for t in tokens:
        x = torch.randn(t, d, device="cuda").to(torch.bfloat16)
        wts = torch.rand(t, topk, device="cuda")
        for sigma in sigmas:
            ids = skewed_ids(t, n_exp, topk, sigma)
            counts = torch.bincount(ids.flatten(), minlength=n_exp)
            with fp32_accumulation():
                want = moe_ref(x, wts, ids, experts, 10.0)
            active = int((counts > 0).sum())
            nbytes = active * 3 * inter * d * (0.5 + 1 / 32) + t * d * 6
            shape = f"T={t} sigma {sigma}: {int(counts.min())}..{int(counts.max())} rows"
            for name, v in variants:
                _variant_row(rows, f"moe fold {name}", shape, lambda x=x, ids=ids, wts=wts, v=v:
                             me.moe_experts(x, wts, ids, experts, 10.0, path="fold", **v), want, nbytes,
                             2 * t * topk * 3 * inter * d, copy)


# The rows path's tile variants (moe_rows.ROWS_TILES holds the default): rows per step of w1 / w3
# and of w2, w2 rows per program, warps.
# H200 2026-12-01 11:18 UTC, T=1 / 2, graph us: default 94.2 / 172.0, rs_up 1 108.0 / 173.3, rs_up 4
# 192.3 / 352.6, rs_down 8 rpp_down 64 96.0 / 174.9, rs_down 8 rpp_down 32 101.1 / 182.8, rs_down 16
# rpp_down 32 150.5 / 264.0, 8 warps 130.9 / 225.9; fold 96.8 / 142.6.
ROWS_VARIANTS = [dict(rs_up=1), dict(rs_up=4), dict(rs_down=8, rpp_down=64), dict(rs_down=8, rpp_down=32),
                 dict(rs_down=16, rpp_down=32), dict(num_warps=8)]


# The rows path's MMA variant (`moe_rows_mma`; MMA_TILES holds the default): K blocks per loop step,
# warps of the down kernel.
# H200 2026-12-01 ~20:35 UTC, graph us, T=1 / 2 (12 experts): default 96.6 / 134.1, bb 2 113.7 / 145.2, bb 8
# 96.2 / 133.4, bb 16 96.2 / 134.9, down warps 8 95.7 / 133.7, down warps 2 95.7 / 134.4; rows 95.2 / 176.4.
# 2026-12-02 ~03:02 UTC (scale words and K split 3 / 3 the default then): T=1 / 2 / 8 default 70.1 /
# 127.9 / 183.5, without scale words 77.6 / 139.7 / 195.5, 16-byte words in both kernels 72.8 / 122.7 /
# 173.9 (then made the gate/up kernel's default: moe_rows_mma.MMA_TILES).
# 2026-12-02 06:13 UTC (the block-diagonal operand at one column a program, `mma_diag`): T=1 / 2
# default 62.1 / 106.7, diag off 71.5 / 120.4, split 3 / 2 59.7 / 107.3 (then the T=1 default),
# 2 / 2 62.7 / 116.5, 4 / 4 67.7 / 110.1.
MMA_VARIANTS = [dict(mma_bb=8, mma_warps_down=8), dict(mma_split_up=2), dict(mma_split_up=4), dict(mma_split_down=2),
                dict(mma_split_up=2, mma_split_down=2), dict(mma_split_up=4, mma_split_down=2),
                dict(mma_split_up=3, mma_split_down=3), dict(mma_scale_words=False),
                dict(mma_scale_words=False, mma_split_up=2, mma_split_down=2), dict(mma_vec_words=True),
                dict(mma_vec_words=False), dict(mma_vec_words=True, mma_split_up=2, mma_split_down=2),
                dict(mma_diag=False), dict(mma_diag=False, mma_vec_words=True), dict(mma_split_up=4, mma_split_down=4),
                dict(mma_split_up=4, mma_split_down=3), dict(mma_l2_hint=False), dict(mma_l2_hint=True),
                dict(mma_split_up=2, mma_split_down=2), dict(mma_split_up=4, mma_split_down=2)]
# 2026-12-04 ~16:38-16:45 UTC (the L2 hint on the gate/up kernel's weight loads the default since):
# T=1 default 57.7 / 58.1, hint off 64.9 / 64.7, on both kernels 58.7 / 58.8, 2 / 2 56.7 / 57.2
# (slower in the decode step: moe_rows_mma.MMA_SPLITS), 4 / 2 56.9 / 56.9.


# At 3..8 tokens (a program per expert by default): the other layout, K slices.
MMA_GROUPED_VARIANTS = [dict(mma_grouped=False), dict(mma_split_up=2), dict(mma_split_down=2),
                        dict(mma_split_up=2, mma_split_down=2), dict(mma_split_up=3, mma_split_down=3),
                        dict(mma_scale_words=False), dict(mma_vec_words=True), dict(mma_vec_words=False)]


def sweep_moe_rows(rows, copy, tokens=(1, 2), check_only=False):
    """The FP4 routed experts at one and two tokens (mini preset: 16 experts, d 5120, width 2304,
    top-6, each token's 6 experts distinct): the fold path against the rows path (`moe_rows`: CUDA
    cores, whole weight rows as int32 words), its MMA variant (`moe_rows_mma`) and its tile variants; where the time goes at T=1
    (both paths' kernels); bytes = the active experts' weights read once. check_only: compile and
    check every variant, time none (warms the cache from a second process)."""
    from dsv41.backends.reference.basic import fp32_accumulation
    from dsv41.backends.reference.moe import moe_experts as moe_ref
    from dsv41.npu_ops.triton import moe_experts as me

    d, inter, n_exp, topk = CFG.hidden_size, CFG.moe_intermediate_size, 16, CFG.num_experts_per_tok
    experts = _fp4_experts(n_exp, d, inter)
    for t in tokens:
        x, ids, wts, want, active, nbytes = _moe_case(t, experts, d, inter, n_exp, topk, moe_ref, fp32_accumulation)
        if t > 2:  # the CUDA-core rows kernels stop at 2 tokens: fold against the MMA variant's layouts
            # (past 8 tokens only the grouped layout: an expert's rows 8 columns a pass)
            variants = [dict(path="fold"), dict(path="rows", mma=True)] + \
                [dict(v, path="rows", mma=True) for v in MMA_GROUPED_VARIANTS if t <= 8 or v.get("mma_grouped", True)]
        else:
            variants = [dict(path="fold"), dict(path="rows"), dict(path="rows", mma=True)] + \
                [dict(v, path="rows", mma=True) for v in MMA_VARIANTS] + [dict(v, path="rows") for v in ROWS_VARIANTS]
        for v in variants:
            name = "moe fp4 " + " ".join(f"{a}={b}" for a, b in v.items())
            call = (lambda x=x, ids=ids, wts=wts, v=v: me.moe_experts(x, wts, ids, experts, 10.0, **v))
            if check_only:
                err = rel_err(call(), want)
                rows.append(f"| {name} | T={t} | err {err:.1e} (check only) |")
                print(rows[-1], flush=True)
                continue
            _variant_row(rows, name, f"T={t} {active} experts", call, want, nbytes, 2 * t * topk * 3 * inter * d, copy)
        if t == 1 and not check_only:
            for path, kw in (("fold", {}), ("rows", {}), ("rows", {"mma": True})):
                rows.append(f"| moe {path} {' '.join(kw)} kernels | T={t} | " + kernel_times(
                    lambda x=x, ids=ids, wts=wts, path=path, kw=kw: me.moe_experts(x, wts, ids, experts, 10.0,
                                                                                   path=path, **kw)) + " |")
                print(rows[-1], flush=True)


def sweep_moe_shared(rows, copy, tokens=(1, 8, 64, 1792)):
    """The shared expert (one FP8 expert, d 5120, width 2304, routed top-1 with weight 1): the
    dense FP8 linears ("linears", its CUDA default) against the grouped kernels it took before
    (GEMV at one token, the tiled kernels above); bytes = its weights read once."""
    from dsv41.backends.reference.basic import fp32_accumulation
    from dsv41.backends.reference.moe import moe_experts as moe_ref
    from dsv41.npu_ops.triton import moe_experts as me

    d, inter = CFG.hidden_size, CFG.moe_intermediate_size
    expert = [tuple(quant.fp8_block_quant(torch.randn(a, b, device="cuda") * b ** -0.5)
                    for a, b in ((inter, d), (d, inter), (inter, d)))]
    nbytes = 3 * inter * d * (1 + 1 / 1024)
    for t in tokens:
        x = torch.randn(t, d, device="cuda").to(torch.bfloat16)
        ids = torch.zeros(t, 1, dtype=torch.long, device="cuda")
        wts = torch.ones(t, 1, device="cuda")
        with fp32_accumulation():
            want = moe_ref(x, wts, ids, expert, 10.0)
        for v in [dict(path="linears"), dict(path="gemv" if t == 1 else "tiled")]:
            _variant_row(rows, f"moe shared fp8 path={v['path']}", f"T={t}",
                         lambda x=x, ids=ids, wts=wts, v=v: me.moe_experts(x, wts, ids, expert, 10.0, **v), want,
                         nbytes + t * d * 6, 2 * t * 3 * inter * d, copy)


def sweep_decode(rows, copy):
    """The GEMV-style decode paths (a few rows, CUDA cores, weights streamed once) against the tiled
    kernels: the FP8 linear (K=5120, N=6144) at M = 1, 4 and the FP4 experts at T = 1, 2, 4."""
    from dsv41.backends.reference.basic import fp32_accumulation
    from dsv41.backends.reference.basic import linear as linear_ref
    from dsv41.backends.reference.moe import moe_experts as moe_ref
    from dsv41.npu_ops.triton import block_linear as bl
    from dsv41.npu_ops.triton import moe_experts as me

    k, n = 5120, 6144
    w, s = quant.fp8_block_quant(torch.randn(n, k, device="cuda") * k ** -0.5)
    lin = [dict(path="tiled"), dict(path="gemv"), dict(path="gemv", bk=128), dict(path="gemv", bk=512),
           dict(path="gemv", bn=64), dict(path="gemv", bn=16), dict(path="gemv", num_warps=2),
           dict(path="gemv", num_warps=8), dict(path="gemv", split_k=1), dict(path="gemv", split_k=2),
           dict(path="gemv", split_k=8)]
    for m in (1, 4):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        with fp32_accumulation():
            want = linear_ref(x, w, s)
        nbytes = n * k * (1 + 1 / 1024) + m * k * 2 + m * n * 2
        for v in lin:
            name = "linear fp8 " + (" ".join(f"{a}={b}" for a, b in v.items()) or "default")
            _variant_row(rows, name, f"M={m} K={k} N={n}", lambda x=x, v=v: bl.linear(x, w, s, **v), want, nbytes,
                         2 * m * n * k, copy)
    d, inter, n_exp, topk = CFG.hidden_size, CFG.moe_intermediate_size, 16, CFG.num_experts_per_tok
    experts = _fp4_experts(n_exp, d, inter)
    moe = [dict(path="tiled"), dict(path="gemv"), dict(path="gemv", bk=128), dict(path="gemv", bk=512),
           dict(path="gemv", bn_up=64), dict(path="gemv", bn_down=64), dict(path="gemv", bn_down=16),
           dict(path="gemv", num_warps=2), dict(path="gemv", num_warps=8), dict(path="gemv", bk=128, num_warps=2)]
    for t in (1, 2, 4):
        x, ids, wts, want, active, nbytes = _moe_case(t, experts, d, inter, n_exp, topk, moe_ref, fp32_accumulation)
        for v in moe if t == 1 else moe[:3]:
            name = "moe fp4 " + (" ".join(f"{a}={b}" for a, b in v.items()) or "default")
            _variant_row(rows, name, f"T={t} {active} experts", lambda x=x, ids=ids, wts=wts, v=v:
                         me.moe_experts(x, wts, ids, experts, 10.0, **v), want, nbytes, 2 * t * topk * 3 * inter * d,
                         copy)
    shared = [tuple(quant.fp8_block_quant(torch.randn(a, b, device="cuda") * b ** -0.5)
                    for a, b in ((inter, d), (d, inter), (inter, d)))]
    x = torch.randn(1, d, device="cuda").to(torch.bfloat16)
    ones, zeros = torch.ones(1, 1, device="cuda"), torch.zeros(1, 1, dtype=torch.long, device="cuda")
    with fp32_accumulation():
        want = moe_ref(x, ones, zeros, shared, 10.0)
    for v in (dict(path="tiled"), dict(path="gemv"), dict(path="gemv", bk=128)):
        name = "moe shared fp8 " + " ".join(f"{a}={b}" for a, b in v.items())
        _variant_row(rows, name, "T=1", lambda v=v: me.moe_experts(x, ones, zeros, shared, 10.0, **v), want,
                     3 * inter * d * (1 + 1 / 1024) + d * 6, 2 * 3 * inter * d, copy)


# The mini preset's dense FP8 linears of one layer, (name, N, K): q down / up projection, the KV
# projection, the output projection's second half, the indexer's query up projection.
DENSE_LINEARS = [("wq_a", CFG.q_lora_rank, CFG.hidden_size), ("wq_b", H * D, CFG.q_lora_rank),
                 ("wkv", D, CFG.hidden_size), ("wo_b", CFG.hidden_size, CFG.o_groups * CFG.o_lora_rank),
                 ("idx_wq_b", HI * DI, CFG.q_lora_rank)]


def kernel_times(call, iters: int = 10) -> str:
    """Device time per call of each kernel `call` launches (torch.profiler over `iters` eager
    calls), as 'name us, ...' sorted by time."""
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                call()
            torch.cuda.synchronize()
        tot: dict[str, float] = {}
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                tot[ev.name[:40]] = tot.get(ev.name[:40], 0.0) + ev.device_time_total / iters
    except Exception as e:  # noqa: BLE001  (the profiler is a diagnostic, not the measurement)
        return f"profiler failed: {type(e).__name__}: {str(e)[:80]}"
    return ", ".join(f"{k} {v:.1f} us" for k, v in sorted(tot.items(), key=lambda kv: -kv[1]))


def sweep_dense(rows, copy, tokens=(1, 8, 64)):
    """The dense FP8 linears at decode sizes (M = 1, 8, 64) at the model's shapes: each against
    the fp32-accumulating reference, the default path and variants of the fold path (tensor
    cores, scales folded into bf16 operands) next to the gemv / tiled paths; one layer's five
    linears back to back in one graph against their weight-read floor; the bf16 head (fp32
    logits); and the mHC coefficient ops fused / unfused at T = 1 and 64."""
    from dsv41.backends.reference.basic import fp32_accumulation
    from dsv41.backends.reference.basic import linear as linear_ref
    from dsv41.npu_ops.triton import block_linear as bl
    from dsv41.npu_ops.triton import mega_mhc as mm
    from dsv41.npu_ops.triton import mhc_mixes as mx

    weights = {name: quant.fp8_block_quant(torch.randn(n, k, device="cuda") * k ** -0.5)
               for name, n, k in DENSE_LINEARS}
    variants = {1: [dict(path="gemv"), dict(path="fold", bn=32, bk=256), dict(path="fold", bk=256, num_stages=3),
                    dict(path="fold", num_stages=6), dict(path="fold", bn=128), dict(path="fold", qdq_row=False),
                    dict(path="fold", split_k=4), dict(path="fold", split_k=16)],
                8: [dict(path="fold", bn=32, bk=256), dict(path="fold", bk=256, num_stages=3), dict(path="fold", bn=128)],
                64: [dict(path="tiled"), dict(path="fold", bn=128), dict(path="fold", bn=128, num_warps=8),
                     dict(path="fold", bn=256, bk=64, num_warps=8), dict(path="fold", bk=64), dict(path="fold", split_k=1)]}
    for m in tokens:
        layer_bytes = 0
        for name, n, k in DENSE_LINEARS:
            w, s = weights[name]
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            with fp32_accumulation():
                want = linear_ref(x, w, s)
            nbytes = n * k * (1 + 1 / 1024) + m * k * 2 + m * n * 2
            layer_bytes += nbytes
            floor = nbytes / (copy * 1e9) * 1e6
            todo = [dict()] + (variants.get(m, []) if name in ("wq_a", "wq_b", "wo_b") else [])
            for v in todo:
                label = f"linear fp8 {name} " + (" ".join(f"{a}={b}" for a, b in v.items()) or "default")
                _variant_row(rows, label, f"M={m} K={k} N={n} floor {floor:.1f} us",
                             lambda x=x, w=w, s=s, v=v: bl.linear(x, w, s, **v), want, nbytes, 2 * m * n * k, copy)
        xs = {name: torch.randn(m, k, device="cuda").to(torch.bfloat16) for name, n, k in DENSE_LINEARS}

        def layer(xs=xs):
            return [bl.linear(xs[name], *weights[name]) for name, _, _ in DENSE_LINEARS]

        tg = graph_time(layer)
        rows.append(f"| one layer's kernels | M={m} | {kernel_times(layer)} |")
        rows.append(f"| one layer's 5 FP8 linears | M={m} | graph {tg * 1e6:.1f} us | floor "
                    f"{layer_bytes / (copy * 1e9) * 1e6:.1f} us | {tg / (layer_bytes / (copy * 1e9)):.2f}x floor |")
        print(rows[-1], flush=True)
    head = (torch.randn(CFG.vocab_size, CFG.hidden_size, device="cuda") * CFG.hidden_size ** -0.5).to(torch.bfloat16)
    for m in (1, 64):
        x = torch.randn(m, CFG.hidden_size, device="cuda").to(torch.bfloat16)
        want = x.double() @ head.double().t()
        nbytes = head.numel() * 2 + m * CFG.vocab_size * 4
        for v in (dict(),):
            _variant_row(rows, "head bf16 -> fp32 " + ("kernel" if v else "default"),
                         f"M={m} floor {nbytes / (copy * 1e9) * 1e6:.0f} us",
                         lambda x=x, v=v: bl.linear(x, head, None, torch.float32, **({"path": "tiled"} if v else {})),
                         want, nbytes, 2 * m * head.numel(), copy)
    n, dim = CFG.hc_mult, CFG.hidden_size
    fn, scale, base = mhc_weights()
    its = CFG.hc_sinkhorn_iters
    for t in (1, 64):
        x, y, post, comb, pre = mhc_activations(t)
        want = registry.resolve("mhc_mix", "reference")[0](x, y, post, comb, pre, fn, scale, base, 1e-20, 1e-6, its)
        for v in (dict(fused=False), dict(fused=True), dict(fused=True, d_split=32), dict(fused=False, d_split=32)):
            def call(v=v, x=x, y=y, post=post, comb=comb, pre=pre):
                return mm.mhc_mix(x, y, post, comb, pre, fn, scale, base, 1e-20, 1e-6, its, **v)[2][2]
            _variant_row(rows, "mhc_mix " + " ".join(f"{a}={b}" for a, b in v.items()), f"T={t}", call, want[2][2],
                         t * (2 * n + 2) * dim * 2 + fn.numel() * 4, 0, copy)
        for v in (dict(fused=False), dict(fused=True)):
            rows.append(f"| mhc_mix kernels {v} | T={t} | " + kernel_times(
                lambda v=v, x=x, y=y, post=post, comb=comb, pre=pre:
                mm.mhc_mix(x, y, post, comb, pre, fn, scale, base, 1e-20, 1e-6, its, **v)) + " |")
            print(rows[-1], flush=True)
        want = registry.resolve("mhc_mixes", "reference")[0](x, fn, scale, base, 1e-20, 1e-6, its)
        for v in (dict(fused=False), dict(fused=True)):
            _variant_row(rows, "mhc_mixes " + " ".join(f"{a}={b}" for a, b in v.items()), f"T={t}",
                         lambda v=v, x=x: mx.mhc_mixes(x, fn, scale, base, 1e-20, 1e-6, its, **v)[2], want[2],
                         t * n * dim * 2 + fn.numel() * 4, 0, copy)


def sweep_sampler(rows, copy, tokens=(1, 8, 64)):
    """`sample_race` at the model's vocabulary: the fused kernel against the reference's torch ops
    (each row at temperature 0.8, top_p 0.95, e2e's sampled setting; top-k 50 as a third case),
    on flat logits (std 0.05, like random weights' head: top-p keeps most of the vocabulary) and
    peaked ones (std 4). Checked: the same tokens (a near-tie may part them: counted)."""
    from dsv41.backends.reference import sampling as ref
    from dsv41.npu_ops.triton import sample_race as sr

    v = CFG.vocab_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    for t in tokens:
        for spread, top_k in ((0.05, 0), (4.0, 0), (4.0, 50)):
            logits = torch.randn(t, v, device="cuda", generator=gen) * spread
            args = (logits, torch.arange(t, device="cuda"), torch.full((t,), 0.8, device="cuda"),
                    torch.full((t,), top_k, device="cuda"), torch.full((t,), 0.95, device="cuda"),
                    torch.randint(0, 2 ** 32, (t,), device="cuda", generator=gen), top_k, True)
            want, got = ref.sample_race(*args), sr.sample_race(*args)
            apart = int((want != got).sum())
            t_ref, t_k = graph_time(lambda: ref.sample_race(*args)), graph_time(lambda: sr.sample_race(*args))
            t_one = graph_time(lambda: sr.sample_race(*args, rounds=1))
            rows.append(f"| sample_race | rows {t}, std {spread}, top_k {top_k}, top_p 0.95 | {apart} of {t} apart | "
                        f"reference {t_ref * 1e6:.1f} us | kernels {t_k * 1e6:.1f} us (1 split round: {t_one * 1e6:.1f}) | "
                        f"{logits.numel() * 4 / t_k / 1e9:.0f} GB/s of logits |")
            print(rows[-1], flush=True)
            if top_k:  # the threshold alone: the radix-select kernel against torch.topk (sr.TOP_K_THRESHOLD)
                th = {m: (lambda m=m: sr.top_k_threshold(*args[:4], top_k, m)) for m in ("radix", "topk")}
                same = torch.equal(th["radix"](), th["topk"]())
                rows.append(f"| top_k_threshold | rows {t}, std {spread}, top_k {top_k} | equal {same} | "
                            f"radix {graph_time(th['radix']) * 1e6:.1f} us | torch.topk {graph_time(th['topk']) * 1e6:.1f} us |")
                print(rows[-1], flush=True)


def sweep_greedy_pick(rows, copy, tokens=(1, 8, 64)):
    """`greedy_pick` at the model's vocabulary: the kernel (default and tile variants) against the
    torch ops the engine ran after every decode replay before it (argmax, then the finiteness
    check: isfinite, all, not, long, cat). Checked: the reference's picks, bit for bit."""
    from dsv41.backends.reference import sampling as ref
    from dsv41.npu_ops.triton import greedy_pick as gp

    v = CFG.vocab_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    variants = {"default": {}, "block 1024": dict(block=1024), "block 4096": dict(block=4096),
                "8 warps": dict(num_warps=8), "block 4096, 8 warps": dict(block=4096, num_warps=8),
                "one slice": dict(splits=1), "8 slices": dict(splits=8)}
    for t in tokens:
        logits = torch.randn(t, v, device="cuda", generator=gen) * 4
        torch_ops = lambda: torch.cat([logits.argmax(-1), (~torch.isfinite(logits).all()).long().view(1)])  # noqa: E731
        want = ref.greedy_pick(logits)
        t_ref = graph_time(torch_ops)
        cells = []
        for name, kw in variants.items():
            same = torch.equal(gp.greedy_pick(logits, **kw), want)
            cells.append(f"{name} {graph_time(lambda kw=kw: gp.greedy_pick(logits, **kw)) * 1e6:.1f}"
                         f"{'' if same else ' WRONG'}")
        rows.append(f"| greedy_pick | rows {t} x {v} fp32 | torch ops {t_ref * 1e6:.1f} us | "
                    f"{' / '.join(cells)} us | read floor {logits.numel() * 4 / copy / 1e3:.1f} us |")
        print(rows[-1], flush=True)


def sweep_grouped_linear(rows, copy, tokens=(2, 4, 8, 16, 32, 64)):
    """`grouped_linear` at the mini width (wo_a: 8 groups of 1024 rows over 4096 channels, 64 MB
    bf16) at decode batches: cuBLAS's batched product against `_grouped_linear_kernel`'s tiles,
    each checked against the reference first; three weight copies cycled (past the L2), so the
    floor is the weight's bytes over the copy rate."""
    from dsv41.backends.reference.basic import grouped_linear as grouped_ref
    from dsv41.npu_ops.triton import grouped_linear as gl

    g, k, r = 8, H * D // 8, CFG.o_lora_rank
    ws = [(torch.randn(g * r, k, device="cuda") * k ** -0.5).to(torch.bfloat16) for _ in range(3)]
    variants = [("cuBLAS bmm", None), ("kernel default", {}), ("kernel bn128 8 warps", dict(bn=128, num_warps=8)),
                ("kernel 3 stages", dict(num_stages=3)), ("kernel 5 stages bk64", dict(bk=64, num_stages=5)),
                ("kernel bk256 3 stages", dict(bk=256, num_stages=3)), ("kernel bn32", dict(bn=32))]
    for t in tokens:
        x = torch.randn(t, g, k, device="cuda").to(torch.bfloat16)
        want = grouped_ref(x.cpu(), ws[0].cpu()).cuda()
        nbytes = ws[0].numel() * 2 + x.numel() * 2 + t * g * r * 2
        for label, v in variants:
            def run(w, v=v, x=x):
                return gl.grouped_linear_bmm(x, w) if v is None else gl.grouped_linear(x, w, **v)

            cycled = iter(range(1 << 30))
            _variant_row(rows, f"grouped_linear {label}", f"T={t} floor {nbytes / (copy * 1e9) * 1e6:.1f} us",
                         lambda run=run: run(ws[0]), want, nbytes, 2 * t * g * r * k, copy,
                         timed=lambda run=run, it=cycled: run(ws[next(it) % len(ws)]))


SWEEPS = {"sparse_attention": sweep_sparse_attention, "indexer_topk": sweep_indexer,
          "indexer_per_k": sweep_indexer_per_k, "indexer_rows": sweep_indexer_rows, "select": sweep_select,
          "reindex": sweep_reindex, "indexer_bound": sweep_indexer_bound, "engram_lookup": sweep_engram,
          "fp4_quant": sweep_fp4_quant, "mhc_mix": sweep_mhc_mix, "linear": sweep_linear, "moe_experts": sweep_moe,
          "moe_decode": sweep_moe_decode, "moe_rows": sweep_moe_rows, "moe_bytes": sweep_moe_bytes,
          "moe_slots": sweep_moe_slots,
          "sparse_two_pass": lambda rows, copy, tokens=(8, 32, 64): sweep_sparse_attention(
              rows, copy, tokens, variants=SPARSE_LOGITS_CAPS),
          "sparse_x2": lambda rows, copy, tokens=(2, 8, 32, 64): sweep_sparse_attention(
              rows, copy, tokens, variants=SPARSE_KV_X2),
          "moe_shared": sweep_moe_shared, "decode": sweep_decode, "dense": sweep_dense, "sampler": sweep_sampler,
          "grouped_linear": sweep_grouped_linear, "greedy_pick": sweep_greedy_pick}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(SWEEPS), help="comma-separated sweeps to run")
    ap.add_argument("--tokens", default=None, help="token counts for the sparse_attention / indexer_topk sweeps")
    ap.add_argument("--check-only", action="store_true",
                    help="sparse_attention / indexer_topk / moe_rows: compile and check every variant, time none "
                         "(warms the cache)")
    ap.add_argument("--mqa", action="store_true", help="sparse_attention: the MQA kernel (prefill table) too (last)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/sweep_kernels.py needs a CUDA device", file=sys.stderr)
        return 2
    copy = copy_gbs()
    rows = [f"copy ceiling {copy:.0f} GB/s"]
    for name in a.only.split(","):
        kw = {}
        if a.tokens and name in ("mhc_mix", "sparse_attention", "sparse_two_pass", "sparse_x2", "indexer_topk", "indexer_per_k", "indexer_rows", "select", "dense", "moe_experts",
                                 "moe_decode", "moe_rows", "moe_bytes", "moe_shared", "moe_slots", "sampler",
                                 "grouped_linear", "greedy_pick"):
            kw["tokens"] = tuple(int(x) for x in a.tokens.split(","))
        if name in ("sparse_attention", "indexer_topk", "indexer_per_k", "indexer_rows", "moe_rows"):
            kw["check_only"] = a.check_only
        if name == "sparse_attention":
            kw["mqa"] = a.mqa
        SWEEPS[name](rows, copy, **kw)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
