"""Portable Triton kernels (CUDA Triton and triton-ascend from one source).

Each module holds one kernel, its launcher(s), the torch reference it must match, and an
`OPS` dict {op name: launcher} that the CUDA and Ascend backends register. A launcher has
exactly the signature and semantics of the op of the same name in `dsv41.backends.ops`.
"""

# Modules registered by the backends, in order; add a kernel by adding its module here.
KERNELS = ["mxfp4_act_quant", "fp4_kv_store", "sparse_attention", "indexer_topk", "moe_route", "compress_kv", "mega_mhc", "engram_lookup"]

# CUDA-only kernels (fp8 loads, tl.interleave, per-stream split-K counters; registered by the CUDA
# backend alone until the Ascend backend vets them).
CUDA_KERNELS = ["block_linear", "moe_experts", "fp8_quant", "mxfp4_quant", "rms_norm", "rope", "swiglu", "sample_race",
                "mhc_mixes", "engram_gate", "rope_store_kv", "rope_store_key", "unrope_grouped_linear", "table_rows",
                "engram_hash", "mhc_mix_norm", "indexer_queries", "grouped_linear", "greedy_pick"]
