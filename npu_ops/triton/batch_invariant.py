"""Batch-invariant implementations of the CUDA op set (`DSV41_BATCH_INVARIANT=1`, registered by the
CUDA backend through `registry.register_invariant`).

In this mode every row's result is bitwise independent of the number of rows in the call and of
the other rows, so a decode step (1..64 rows) reproduces the same row of an exact prefill (a
chunk of thousands), and greedy decode equals the prefill's argmax at every position. The
default kernels choose their kernel, tiles and K split by the row count (decode is weight-read
bound and splits K over every SM; prefill takes bigger tiles or cuBLAS), and each choice sums a
row's products in another order. Here each op takes ONE kernel with ONE tile configuration for
every row count, no cuBLAS (whose algorithm depends on M), and the reduction order of a row's
dot products is fixed by the weight's (or index row's) shape alone. Slower than the default;
graph-capturable (no host sync, no data-dependent shapes). The same idea as vLLM's
VLLM_BATCH_INVARIANT.

Splits set by shapes, never by the row count: a one-row decode step with one program per output
tile would leave most SMs idle (a 1280-wide output in 64-column tiles is 20 programs on 132
SMs), so the linear, the tiled experts and sparse attention cut a row's reduction into fixed
slices: K slices of whole BK steps whose count follows from (N, K) (`LINEAR_SPLIT`, `MOE_SPLIT`),
entry-block splits whose count follows from the index widths (`ATTN_SPLIT`). Each slice is
summed from zero by the same tiled loop and the slices are added in slice order (the combine
kernels / the tile's last program: fixed order, no atomics on data). How the slices run may
depend on the row count, since it does not change a bit: as programs of their own with fp32
partials (decode) or, for many rows, in turn inside each tile's program with the same adds
(`SERIAL`: no partials, so prefill pays no partial traffic); attention chunks long query
ranges so that the partials stay bounded.

Where the default path depends on the row count M (T tokens), and what this module does:
- `linear` (block_linear.py): FP8 weights take the decode kernels at M <= 64 (by row count:
  rows / xscale / token-major or weight-major fold, split-K by the SM count) and the tiled kernel
  above; FP4 weights the GEMV kernel at M = 1; the tiled kernel's
  tiles (BM 16/32/64 vs 128, GROUP_M) and split-K depend on M; scaled weights go to cuBLAS on a
  bf16 dequantised weight at M >= 1024; bf16 -> bf16 and the head's bf16 -> fp32 logits (M >= 2)
  go to cuBLAS. Here: the tiled kernel, fixed BM / BN / BK / GROUP_M / warps / stages and the K
  slices of `linear_slices(N, K)`, for every weight format and M. (W8A8 int8 stays on
  torch._int_mm: exact int32 sums.)
- `grouped_linear` (cuda.py, torch.bmm / cuBLAS): here one invariant `linear` per group.
- `unrope_grouped_linear` (fused GEMV up to 8 tokens, the composition above): here the
  composition (rope inverse, then the invariant grouped_linear) at every T.
- `mhc_mix_norm`, `mhc_enter_norm` (the norm inside the mHC kernels' coefficient epilogue, whose
  d split depends on T): here the compositions over the invariant `mhc_mix` / `mhc_mixes`.
- `linear_pair` (one launch for two weights at one row, another kernel than a prefill's): here
  the composition, two invariant `linear`s.
- `moe_experts` (moe_experts.py): GEMV at T <= 4 (FP4) / 1 (FP8), the tiled kernels with
  decode or prefill tiles (BM by rows per expert), the bf16-scratch grouped path for prefill FP4.
  Here: FP4 experts the folded kernels take (moe_fold.py; scale bytes and widths permitting) run
  there with one tile table and a 16-row tile for every T (a row is one column of the
  weight-left dot; more rows loop over row tiles); other experts (the FP8 shared expert) take the
  tiled kernels with fixed tiles and the gate/up and down K slices of `moe_slices` (row-tile
  slots only spread work).
- `moe_route` (moe_route.py): BLOCK_T / BLOCK_E by T and K splits below 32 tiles. Here fixed
  tiles, one K slice.
- `mhc_mix` (mega_mhc.py) and `mhc_mixes` (mhc_mixes.py): the d chunks per token tile (whose
  partial sums are added in the coefficient epilogue) grow when few token tiles would leave SMs
  idle, and the coefficient epilogue adds the chunk partials in blocks sized by its tokens per
  tile. Here d chunks set by d alone (`MHC_CHUNK`) and one chunk partial per epilogue step
  (`MHC_COEF_CB`).
- `sparse_attention` (sparse_attention.py): the decode tile table (128-channel blocks) at
  T <= 16, and flash-decoding splits of a query's entry blocks chosen by the tile count
  (merged by `_combine_kernel`). Here the main table and `attention_splits` splits of a query's
  window-then-selected entry blocks, set by the index widths: a query reduces the same blocks
  in the same splits and merge order, whatever else is in the launch.
- `indexer_topk` (indexer_topk.py): queries per tile (BLOCK_T by T) and entry block width, i.e.
  the MMA's M and the head sum's shape. Here one query per tile with its heads padded to at
  least 16 (M = max(heads, 16)), which the per-query path of mixed sequences uses as well. Query
  chunking of long prefills and the selections are row-local.
- `sinkhorn`, `mhc_update` (cuda.py, torch softmax / sums / bmm): here explicit elementwise sums
  in a fixed order.
Row-local as they are (one row's result is computed by one program from that row alone, tile
shapes set by the width, not by T): `ROW_LOCAL_OPS` below.
"""

from __future__ import annotations

import torch

from ...backends import fused, registry
from . import block_linear, mega_mhc
from . import indexer_topk as indexer_mod
from . import mhc_mixes as mhc_mixes_mod
from . import moe_experts as moe_mod
from . import moe_route as route_mod
from . import sparse_attention as attn_mod
from .block_scaled import W_FP4
from .launch import interpreting
from .moe_fold import fold_fits

# One tile configuration per op for every row count (compiled CUDA / the interpreter).
# CUDA tiles are tables the default path already compiles and runs (linear: the decode table at
# 33..64 rows; MoE: the prefill table; route: the > 128-token table).
LINEAR_TILES = {"cuda": dict(bm=64, bn=64, bk=128, group_m=1, num_warps=4, num_stages=4),
                "interp": dict(bm=16, bn=32, bk=64, group_m=1)}
# The K split of the invariant linear, a function of the weight's shape (N, K) alone (never of the
# row count): about `programs` programs over the N tiles, slices of at least `min_steps` BK
# steps. Below `parallel_tiles` output tiles (decode) the slices run as programs of their own and
# the last one of a tile adds the partials in slice order; from there on (prefill) each program
# sums its tile's slices in the same order itself (no partials): one result either way.
LINEAR_SPLIT = {"cuda": dict(programs=528, min_steps=2, parallel_tiles=264),
                "interp": dict(programs=8, min_steps=2, parallel_tiles=4)}
MOE_TILES = {"cuda": dict(bm=64, bn_up=32, bn_down=128, bk=64, num_warps=4, num_stages=3),
             "interp": dict(bm=16, bn_up=32, bn_down=32, bk=64)}
# The experts' K splits, by the expert shape alone (as LINEAR_SPLIT: about `programs` programs per
# expert over its column tiles, slices of at least `min_steps` BK steps); the slices run as
# programs of their own up to `parallel_rows` routed rows (decode), else inside each program.
MOE_SPLIT = {"cuda": dict(programs=256, min_steps=2, parallel_rows=512),
             "interp": dict(programs=32, min_steps=2, parallel_rows=8)}
# FP4 experts the folded kernels take (moe_fold): their one-token tiles with a 16-row tile for
# every token count (a row is one column of the weight-left dot, so its sums do not depend on the
# rows beside it; more rows loop over row tiles), one K slice, weight tiles from int32 words
# (named: the default's choice may depend on the token count). None: every expert on the tiled kernels.
MOE_FOLD_TILES = {"cuda": dict(rb=16, bn_up=64, bn_down=64, bk=128, split=1, w_left=True, byte_tiles=False,
                               num_warps=4, num_stages=3),
                  "interp": dict(rb=16, bn_up=32, bn_down=32, bk=128, split=1, w_left=True, byte_tiles=False)}
# sparse_attention: each query's entry blocks (window blocks, then selected blocks) in splits of
# `blocks` blocks whatever the query count (flash-decoding; the splits merged in a fixed order by
# the combine kernel); the queries go in chunks whose split partials stay under
# `partial_bytes` (prefill), each query computed alike in any chunk.
ATTN_SPLIT = {"cuda": dict(blocks=1, partial_bytes=1 << 29), "interp": dict(blocks=1, partial_bytes=1 << 20)}
# (BLOCK_T, BLOCK_E, BLOCK_K, warps, K slices)
ROUTE_TILES = {"cuda": (64, 32, 128, 4, 1), "interp": (16, 16, 64, 4, 1)}

# CUDA ops whose kernels are row-local already (elementwise, per row or per quantisation group,
# integer index arithmetic, gathers): the default implementation serves this mode.
ROW_LOCAL_OPS = frozenset({
    "fp8_quant", "fp8_dequant", "fp4_quant", "fp4_dequant", "mxfp4_quant", "mxfp4_dequant", "mxfp4_act_quant",
    "rms_norm", "rope", "rope_tables", "swiglu_clamped", "rope_store_kv", "rope_store_key", "compress_kv",
    "mhc_collapse", "engram_gate", "engram_lookup", "engram_hash", "table_rows", "window_rows", "compress_rows",
    "indexer_queries",
    "sample_race",  # every row split over the same programs whatever the row count (tested: alone == batch)
    "greedy_pick", "feed_tokens",  # exact: the first maximum and integer copies, whatever the split
})


def _key(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" and not interpreting() else "interp"


def _slices(k: int, cols: int, bn: int, bk: int, split: dict) -> int:
    """K slices for a product of K = k over `cols` output columns in tiles of bn (`split`:
    programs, min_steps)."""
    return max(1, min(-(-split["programs"] // -(-cols // bn)), -(-k // bk) // split["min_steps"]))


def linear_slices(n: int, k: int, key: str) -> int:
    """The invariant linear's K slice count for an [n, k] weight (`LINEAR_SPLIT`; no row count)."""
    return _slices(k, n, LINEAR_TILES[key]["bn"], LINEAR_TILES[key]["bk"], LINEAR_SPLIT[key])


def linear_serial(m: int, n: int, key: str) -> bool:
    """Whether the slices of an [m rows, n] output run inside each tile's program (many tiles:
    prefill) rather than as programs of their own (decode); the result is the same."""
    tiles = LINEAR_TILES[key]
    return -(-m // tiles["bm"]) * -(-n // tiles["bn"]) >= LINEAR_SPLIT[key]["parallel_tiles"]


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
           out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`ops.linear`, batch-invariant: `block_linear`'s tiled kernel with fixed tiles and a K split
    set by the weight's shape (`linear_slices`) for every row count and weight format (W8A8 keeps
    its exact int32 GEMM; fp32 weights have no invariant kernel on CUDA: the tiled kernel takes
    bf16-exact weights)."""
    key = _key(x.device)
    if scale is None and weight.dtype != torch.bfloat16 and key == "cuda":
        raise NotImplementedError(f"batch-invariant linear: {weight.dtype} weights have no invariant kernel")
    n, k = weight.shape[0], x.shape[-1]
    slices = linear_slices(n, k, key)
    serial = slices > 1 and linear_serial(x.numel() // max(k, 1), n, key)
    return block_linear.linear(x, weight, scale, out_dtype, path="tiled", split_k=slices, serial=serial,
                               **LINEAR_TILES[key])


def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`ops.grouped_linear` (x [T, G, K], weight [G * R, K] -> [T, G * R] bf16), batch-invariant:
    the invariant `linear` per group (bf16 output, fp32 accumulation)."""
    t, g, k = x.shape
    w = weight.view(g, -1, k)
    parts = [linear(x[:, i], w[i]) for i in range(g)]
    return torch.stack(parts, 1).reshape(t, -1)


def moe_slices(inter: int, d: int, key: str) -> tuple[int, int]:
    """The invariant experts' (gate/up, down) K slice counts for experts of intermediate width
    `inter` on hidden width `d` (`MOE_SPLIT`; no token count)."""
    tiles, split = MOE_TILES[key], MOE_SPLIT[key]
    return (_slices(d, inter, tiles["bn_up"], tiles["bk"], split),
            _slices(inter, d, tiles["bn_down"], tiles["bk"], split))


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: list, limit: float,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`ops.moe_experts`, batch-invariant: FP4 experts the folded kernels take go there with
    `MOE_FOLD_TILES` for every token count; the others take the tiled gate/up and down kernels
    with fixed tiles and K splits set by the expert shape (`moe_slices`) for every token count
    (no GEMV, no bf16-scratch grouped path)."""
    key = _key(x.device)
    inter = experts[0][0][0].shape[0]
    fold = MOE_FOLD_TILES[key]
    if fold is not None and x.shape[0] and moe_mod._expert_table(experts, x.device)[3] == W_FP4 \
            and moe_mod.foldable(experts) \
            and fold_fits(inter, x.shape[1], fold["bn_up"], fold["bn_down"], fold["bk"], fold["split"]):
        return moe_mod.moe_experts(x, weights, ids, experts, limit, out_dtype, path="fold", bm=fold["rb"],
                                   **{k: v for k, v in fold.items() if k != "rb"})
    return moe_mod.moe_experts(x, weights, ids, experts, limit, out_dtype, path="tiled",
                               k_split=moe_slices(inter, x.shape[1], key),
                               serial=ids.numel() > MOE_SPLIT[key]["parallel_rows"], **MOE_TILES[key])


def moe_route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, topk: int, route_scale: float,
              gate_temp: float = 1.0, norm_topk_prob: bool = True, image_bias: torch.Tensor | None = None,
              is_image: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.moe_route`, batch-invariant: fixed token / expert / K tiles and one K slice (the
    image bias is chosen per row: row-local)."""
    return route_mod.moe_route(x, gate_weight, bias, topk, route_scale, gate_temp, norm_topk_prob,
                               image_bias=image_bias, is_image=is_image, _cfg=ROUTE_TILES[_key(x.device)])


# mHC: the d chunks per token tile, by the width alone: MHC_CHUNK columns each (None: the table's
# split). 128-column chunks (40 at d = 5120) cut the mode's batch-1 mHC time 586 -> 139 us a step
# on the H200. The coefficient epilogue adds the chunk partials MHC_COEF_CB chunks per step here,
# one: a block's sum (`tl.sum` over [CB, tokens per tile, 32]) is taken in an order that follows
# the tile's layout, and the tokens per tile follow T. With the default block (128 chunks at one
# token, 8 at 16) the 40 chunks broke greedy = prefill on mini (1024-token prompt: 0.83 of
# positions, logits off by 0.29), and a fixed block of 8 still did (0.94; H200, 2026-12-01); one
# chunk per step leaves only elementwise Kahan steps in chunk order.
MHC_CHUNK = {"cuda": 128, "interp": None}
MHC_COEF_CB = 1


def _mhc_d_split(x: torch.Tensor) -> int:
    """The mHC kernels' d chunks for x [T, streams, d]: set by d alone (`MHC_CHUNK`)."""
    key = _key(x.device)
    table = mega_mhc.TILES["cuda" if key == "cuda" else "default"]["d_split"]
    chunk = MHC_CHUNK[key]
    return table if chunk is None else max(table, -(-x.shape[-1] // chunk))


def mhc_mix(x, y, post, comb, pre, fn, scale, base, norm_eps, hc_eps, iters):
    """`ops.mhc_mix`, batch-invariant: the fused kernel with its table's fixed d split."""
    return mega_mhc.mhc_mix(x, y, post, comb, pre, fn, scale, base, norm_eps, hc_eps, iters, d_split=_mhc_d_split(x),
                            chunk_block=MHC_COEF_CB, sized_tiles=False)


def mhc_mixes(x, fn, scale, base, norm_eps, hc_eps, iters):
    """`ops.mhc_mixes`, batch-invariant: the partials kernel with the table's fixed d split."""
    return mhc_mixes_mod.mhc_mixes(x, fn, scale, base, norm_eps, hc_eps, iters, d_split=_mhc_d_split(x),
                                   chunk_block=MHC_COEF_CB, sized_tiles=False)


def attention_splits(win_width: int, glob_width: int, key: str) -> int:
    """Entry-block splits per query for index rows of these widths (`ATTN_SPLIT`; no query count)."""
    bn = attn_mod.CONFIGS[key]["BLOCK_N"]
    return max(1, -(-(-(-win_width // bn) + -(-glob_width // bn)) // ATTN_SPLIT[key]["blocks"]))


def sparse_attention(q, swa_kv, swa_scale, win_idx, glob_kv, glob_scale, glob_idx, sink, softmax_scale,
                     rows_bound=None):
    """`ops.sparse_attention`, batch-invariant: the main tile table (never the decode or prefill one) and
    the entry-block splits of `attention_splits` for every query count, so each query reduces
    over its entries in the same blocks, splits and merge order alone or in a prefill chunk
    (queries chunked to bound the partials)."""
    key = attn_mod._backend_key(q.device)
    cfg = dict(attn_mod.CONFIGS[key])
    cfg.pop("min_blocks_per_split", None)
    k = glob_idx.shape[-1] if glob_idx is not None else 0
    n_split = attention_splits(win_idx.shape[-1], k, key)
    t, h, d = q.shape
    per = max(1, ATTN_SPLIT[key]["partial_bytes"] // (n_split * h * (d + 2) * 4)) if n_split > 1 else max(t, 1)
    parts = []
    for a in range(0, t, per):
        sl = slice(a, a + per)
        parts.append(attn_mod.sparse_attention_launch(q[sl], swa_kv, swa_scale, win_idx[sl], glob_kv, glob_scale,
                                                      None if glob_idx is None else glob_idx[sl], sink,
                                                      softmax_scale, n_split=n_split, **cfg))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def indexer_topk(q, weights, key_codes, key_scale, block_table, entries_per_block, n_visible, topk,
                    candidates=None, pool_blocks=0, pool_block_size=1, reduce_scores=None, candidate_block_size=1):
    """`ops.indexer_topk`, batch-invariant: one query per tile, its heads padded to at least 16
    (the Reindex tile shape) for every T, so a query's scores come from the same MMA shape and
    head sum alone, beside its own sequence's queries, or beside other sequences' (the
    per-query path: also one query, heads padded to 16)."""
    hp, bt, bn = indexer_mod.tile_shape(1, q.shape[1], True, False, interpreting())
    return indexer_mod.indexer_topk(q, weights, key_codes, key_scale, block_table, entries_per_block, n_visible,
                                    topk, candidates, pool_blocks, pool_block_size, reduce_scores,
                                    candidate_block_size, _cfg=(hp, bt, bn, 1, 8))


def _sum_in_order(parts) -> torch.Tensor:
    """parts[0] + parts[1] + ... left to right (elementwise adds: no shape-dependent reduction)."""
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """`ops.sinkhorn` in fp32 with the row / column sums (and the softmax's) as explicit
    elementwise adds in index order."""
    x = logits.float()
    e = torch.exp(x - x.amax(-1, keepdim=True))  # the max is exact in any order
    c = e / _sum_in_order(e.unbind(-1)).unsqueeze(-1) + eps
    c = c / (_sum_in_order(c.unbind(-2)).unsqueeze(-2) + eps)
    for _ in range(iters - 1):
        c = c / (_sum_in_order(c.unbind(-1)).unsqueeze(-1) + eps)
        c = c / (_sum_in_order(c.unbind(-2)).unsqueeze(-2) + eps)
    return c


def mhc_update(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """`ops.mhc_update` (out_j = post[j] * y + sum_i comb[i][j] * x_i, fp32, x's dtype) with the
    sum over streams as elementwise adds in stream order (no batched GEMM)."""
    xf, c = x.float(), comb.float()
    mixed = _sum_in_order([c[:, i, :, None] * xf[:, i, None, :] for i in range(x.shape[1])])
    return (post.float().unsqueeze(-1) * y.float().unsqueeze(1) + mixed).to(x.dtype)


OPS = {"linear": linear, "grouped_linear": grouped_linear, "unrope_grouped_linear": fused.unrope_grouped_linear,
       "moe_experts": moe_experts, "moe_route": moe_route, "mhc_mix": mhc_mix, "mhc_mixes": mhc_mixes,
       "sparse_attention": sparse_attention, "indexer_topk": indexer_topk, "sinkhorn": sinkhorn,
       "mhc_update": mhc_update, "mhc_mix_norm": fused.mhc_mix_norm, "mhc_enter_norm": fused.mhc_enter_norm,
       "linear_pair": fused.linear_pair, "moe_experts_add": fused.moe_experts_add}


def register(backend: str = "cuda") -> None:
    """Register `OPS` as `backend`'s batch-invariant implementations."""
    for name, fn in OPS.items():
        registry.register_invariant(name, backend)(fn)
