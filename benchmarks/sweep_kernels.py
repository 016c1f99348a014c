"""Tile sweep for the memory-bound kernels on a CUDA GPU: each variant is checked against the
reference op on fresh random inputs, then timed (median of CUDA-graph replays, so Python launch
overhead is out of the number, and eagerly, one call between events).

    python benchmarks/sweep_kernels.py [--only sparse_attention,engram_lookup]

Prints one table; the tile tables in `npu_ops/triton/*.py` take their CUDA defaults from it.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from dsv41.backends import (
    ops,  # noqa: F401  (registers the reference ops)
    registry,
)
from dsv41.backends.reference import quant
from dsv41.core.config import ModelConfig

CFG = ModelConfig()
D, H, W, TOPK = CFG.head_dim, CFG.num_attention_heads, CFG.sliding_window, CFG.index_topk


def time_eager(fn, iters=30):
    """Median seconds of one call between two CUDA events (includes launch overhead)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def time_graph(fn, iters=20, per=10):
    """Median seconds per call of a CUDA graph holding `per` calls (launch overhead removed)."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(per):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3 / per)
    return statistics.median(ts)


def copy_gbs():
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / time_eager(lambda: dst.copy_(src), 10) / 1e9


def rel_err(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def sweep_sparse_attention(rows, copy):
    from dsv41.npu_ops.triton import sparse_attention as sa

    variants = [
        {"BLOCK_H": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
        {"BLOCK_H": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2, "DV_HALF": True},
        {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "DV_HALF": True},
        {"BLOCK_H": 64, "BLOCK_N": 16, "num_warps": 8, "num_stages": 2, "DV_HALF": True},
        {"BLOCK_H": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "DV_HALF": True},
        {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "DV_HALF": True},
    ]
    ref_fn = registry.resolve("sparse_attention", "reference")[0]
    n = 65536
    g_codes, g_scale = quant.fp4_quant(torch.randn(n, D, device="cuda"))
    w8, ws = quant.fp8_quant(torch.randn(W, D, device="cuda"))
    for t in (1, 64, 256):
        q = torch.randn(t, H, D, device="cuda").to(torch.bfloat16)
        mask = torch.rand(t, W, device="cuda") < 0.9
        idx = torch.randint(0, n, (t, TOPK), device="cuda")
        idx[torch.rand(t, TOPK, device="cuda") < 0.05] = -1
        sink = torch.randn(H, device="cuda")
        args = (q, w8, ws, mask, g_codes, g_scale, idx, sink, D ** -0.5)
        ref = ref_fn(*args)
        must_read = t * TOPK * (D // 2 + D // 16) + W * (D + D // 32) + 2 * t * H * D * 2
        flops = 4 * t * H * D * (TOPK + W)
        for v in variants:
            cfg = dict(v, BLOCK_D=None, BLOCK_DV=None)
            name = "sa " + " ".join(f"{k}={val}" for k, val in v.items())
            def call(args=args, cfg=cfg):
                return sa.sparse_attention_launch(*args, **cfg)

            try:
                err = rel_err(call(), ref)
                te = time_eager(call)
                tg = time_graph(call)
            except Exception as e:  # noqa: BLE001  (a variant that does not compile is a row, not a crash)
                rows.append(f"| {name} | T={t} | failed: {type(e).__name__}: {str(e)[:80]} |")
                continue
            rows.append(f"| {name} | T={t} 64K | err {err:.2e} | eager {te * 1e6:.1f} us | graph {tg * 1e6:.1f} us | "
                        f"{must_read / tg / 1e9:.0f} GB/s ({100 * must_read / tg / 1e9 / copy:.0f}%) | "
                        f"{flops / tg / 1e12:.1f} TFLOP/s |")
            print(rows[-1], flush=True)


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
                tg = time_graph(call)
                te = time_eager(call)
                rows.append(f"| engram BLOCK_R={br} warps={nw} | T={t} | exact {exact} | eager {te * 1e6:.1f} us | "
                            f"graph {tg * 1e6:.1f} us | {nbytes / tg / 1e9:.0f} GB/s "
                            f"({100 * nbytes / tg / 1e9 / copy:.0f}%) |")
                print(rows[-1], flush=True)


SWEEPS = {"sparse_attention": sweep_sparse_attention, "engram_lookup": sweep_engram}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(SWEEPS), help="comma-separated sweeps to run")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/sweep_kernels.py needs a CUDA device", file=sys.stderr)
        return 2
    copy = copy_gbs()
    rows = [f"copy ceiling {copy:.0f} GB/s"]
    for name in a.only.split(","):
        SWEEPS[name](rows, copy)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
