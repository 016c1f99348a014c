"""The batch-1 decode step's largest kernels at mini widths, each launched once inside a profiler
window, for Nsight Compute's hardware counters: one MoE layer at one token (the routed FP4 MMA
kernels: 16 experts 5120 x 2304, top-6), five FP8 linears at one row (wo_b 5120x8192, wq_b
32768x1280, Engram's wkv 25600x6144, the shared expert's 2304x5120 and 5120x2304), and ("attn")
the two ops with T=1 targets at a 64K context: `sparse_attention` (window 128 + top-512) and
`indexer_topk` (the sweep's inputs, benchmarks/ops.py); ("b64") the batch-64 step's largest
kernels: one MoE layer at 64 tokens on the fold path (routing skewed as the mini model's decode
batches, `sweep_kernels.skewed_ids` sigma 0.5), the FP8 linears `wq_b` 32768x1280 and the shared
expert's 2304x5120 at 64 rows, and sparse attention at T=64 over a 4K context. Every call runs twice first (compiles,
counters), then once between cudaProfilerStart / Stop:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section SchedulerStats \\
        --kernel-name regex:"_mma_up|_mma_down|_row_gemv|_row_mma|_fold_xs" python benchmarks/ncu_probe.py [moe] [lin] [attn]

Random weights (seed 0); needs a CUDA device. Timings without ncu: sweep_kernels.py, e2e.py.
"""

from __future__ import annotations

import sys

import torch


def main() -> int:
    from dsv41.backends.reference import quant
    from dsv41.npu_ops.triton import block_linear as bl
    from dsv41.npu_ops.triton import moe_experts as me

    if not torch.cuda.is_available():
        print("benchmarks/ncu_probe.py needs a CUDA device", file=sys.stderr)
        return 2
    which = sys.argv[1:] or ["moe", "lin"]
    bad = set(which) - {"moe", "lin", "attn", "b64"}
    if bad:
        print(f"ncu_probe.py: unknown part(s) {sorted(bad)} (moe, lin, attn, b64)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    calls = []
    if "moe" in which:
        d, inter, n_exp = 5120, 2304, 16
        experts = [tuple(quant.fp4_weight_quant(torch.randn(a, b, device="cuda") * b ** -0.5)
                         for a, b in ((inter, d), (d, inter), (inter, d))) for _ in range(n_exp)]
        x = torch.randn(1, d, device="cuda").to(torch.bfloat16)
        ids = torch.randperm(n_exp, device="cuda")[:6][None]
        wts = torch.rand(1, 6, device="cuda")
        calls.append(lambda: me.moe_experts(x, wts, ids, experts, 10.0, path="rows", mma=True))
    if "lin" in which:
        for n, k in ((5120, 8192), (32768, 1280), (25600, 6144), (2304, 5120), (5120, 2304)):
            w, s = quant.fp8_block_quant(torch.randn(n, k, device="cuda") * k ** -0.5)
            xk = torch.randn(1, k, device="cuda").to(torch.bfloat16)
            calls.append(lambda xk=xk, w=w, s=s: bl.linear(xk, w, s))
    if "attn" in which:
        from ops import DI, HI, TOPK, paged_index_keys, sparse_attention_args  # benchmarks/ops.py: the sweep's inputs

        from dsv41.npu_ops.triton import indexer_topk as itk
        from dsv41.npu_ops.triton import sparse_attention as sa

        args, _ = sparse_attention_args(1, 65536, "cuda", masked_fraction=0.05)
        calls.append(lambda: sa.sparse_attention(*args))
        kc, ks, table, e = paged_index_keys(65536, "cuda")
        q = quant.mxfp4_qdq(torch.randn(1, HI, DI, device="cuda"))
        w = torch.randn(1, HI, device="cuda") * DI ** -0.5 * HI ** -0.5
        vis = torch.full((1,), 65536, dtype=torch.long, device="cuda")
        calls.append(lambda: itk.indexer_topk(q, w, kc, ks, table, e, vis, TOPK))
    if "b64" in which:
        from ops import sparse_attention_args
        from sweep_kernels import _fp4_experts, skewed_ids

        from dsv41.npu_ops.triton import sparse_attention as sa

        d, inter, n_exp, t = 5120, 2304, 16, 64
        experts = _fp4_experts(n_exp, d, inter)
        x = torch.randn(t, d, device="cuda").to(torch.bfloat16)
        ids = skewed_ids(t, n_exp, 6, 0.5)
        wts = torch.rand(t, 6, device="cuda")
        calls.append(lambda: me.moe_experts(x, wts, ids, experts, 10.0, path="fold"))
        for n, k in ((32768, 1280), (2304, 5120)):
            w, s = quant.fp8_block_quant(torch.randn(n, k, device="cuda") * k ** -0.5)
            xk = torch.randn(t, k, device="cuda").to(torch.bfloat16)
            calls.append(lambda xk=xk, w=w, s=s: bl.linear(xk, w, s))
        args64, _ = sparse_attention_args(t, 4096, "cuda", masked_fraction=0.05)
        calls.append(lambda: sa.sparse_attention(*args64))
    for c in calls:
        c()
        c()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for c in calls:
        c()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
