"""Unified-buffer estimate of every Ascend tile config: one program's live tiles (32-bit values)
at the full model's shapes must fit half of the 192 KB unified buffer (the other half is for the
compiler's double buffering)."""

import _triton  # noqa: F401  (skips without triton; sets TRITON_INTERPRET on CPU)
import pytest

from dsv41.core.config import preset
from dsv41.npu_ops.triton import (compress_kv, engram_lookup, fp4_kv_store, indexer_topk, mega_mhc, moe_route,
                                  mxfp4_act_quant, sparse_attention)
from dsv41.npu_ops.triton.launch import UB_BUDGET, UB_BYTES, ub_estimate

FULL = preset("full")


def _moe_cfg():
    """moe_route's Ascend tile choices (compiled, device "npu") over the token-count buckets."""
    import os

    old = os.environ.pop("TRITON_INTERPRET", None)
    try:
        return sorted({moe_route._config(t, FULL.n_routed_experts, "npu")[:3] for t in (1, 16, 100, 128, 4096)})
    finally:
        if old is not None:
            os.environ["TRITON_INTERPRET"] = old


CONFIGS = {
    "fp4_kv_store": [fp4_kv_store.ub_tiles(fp4_kv_store.TILES["default"][0])],
    "mxfp4_act_quant": [mxfp4_act_quant.ub_tiles()],
    "compress_kv": [compress_kv.ub_tiles(compress_kv.TILES["default"][r][0], FULL.head_dim, r) for r in (1, 2)],
    "engram_lookup": [engram_lookup.ub_tiles(engram_lookup.BLOCK_R_NPU, FULL.engram_head_dim)],
    "mega_mhc": [mega_mhc.ub_tiles(mega_mhc.TILES["default"]["block_t"], mega_mhc.TILES["default"]["block_d"])],
    "moe_route": [moe_route.ub_tiles(bt, be, bk, FULL.n_routed_experts, FULL.num_experts_per_tok)
                  for bt, be, bk in _moe_cfg()],
    "sparse_attention": [sparse_attention.ub_tiles(sparse_attention.CONFIGS["npu"], FULL.head_dim)],
    "indexer_topk": [indexer_topk.ub_tiles(indexer_topk.tile_shape(t, FULL.index_n_heads, gather, True, False),
                                           FULL.index_head_dim, maxg)
                     for t in (1, 4096) for gather, maxg in ((False, 1), (False, 64), (True, 1))]
                    + [indexer_topk.select_ub_tiles(indexer_topk.SELECT_BLOCK_NPU)],
}


@pytest.mark.parametrize("kernel", sorted(CONFIGS))
def test_ascend_tiles_fit_the_unified_buffer(kernel):
    for tiles in CONFIGS[kernel]:
        need = ub_estimate(tiles)
        print(f"{kernel}: {need / 1024:.1f} KB of {UB_BYTES // 1024} KB")
        assert 0 < need <= UB_BUDGET, f"{kernel}: {need} bytes > {UB_BUDGET} ({tiles})"


def test_estimate_catches_an_oversized_tile():
    assert ub_estimate(compress_kv.ub_tiles(64, FULL.head_dim, 2)) > UB_BUDGET
    assert ub_estimate({"t": (2, 3)}) == 24
