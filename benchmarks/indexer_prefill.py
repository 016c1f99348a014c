"""The indexer's scores kernel at prefill shapes on a CUDA GPU: query groups of 1-16 sub-tiles
(`_indexer_scores_kernel`'s QSUB: a key block loaded and decoded once for the group), each
checked bit-equal to the ungrouped tiles, then timed; and the whole op by the default dispatch.

    python benchmarks/indexer_prefill.py [--tokens 1792] [--entries 2048,8192] [--qsub 1,2,4,8,16]

Inputs as a prefill chunk of one sequence at the end of its prompt: T queries (MXFP4
quantise-dequantised) whose visible entries rise by one every 4 tokens up to all N entries
(a ratio-4 compressor), the N keys scattered over pool blocks, one block table for all. Time =
median of CUDA-event timed calls; FLOPs = 2 x visible entries x index heads x index head dim.
Run from the repository root (imports benchmarks/ops.py).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ops import DI, HI, TOPK, paged_index_keys, timeit  # noqa: E402

from dsv41.backends.reference import quant  # noqa: E402


def run(t: int, n: int, qsubs: list[int], seed: int) -> None:
    from dsv41.npu_ops.triton import indexer_topk as itk

    g = torch.Generator(device="cuda").manual_seed(seed)
    kc, ks, table, e = paged_index_keys(n, "cuda")
    q = quant.mxfp4_qdq(torch.randn(t, HI, DI, device="cuda", generator=g))
    w = torch.randn(t, HI, device="cuda", generator=g) * DI ** -0.5 * HI ** -0.5
    nv = (n - (t - 1 - torch.arange(t, device="cuda")) // 4).clamp(min=1)
    tab = table.expand(t, -1).contiguous()
    flops = 2 * float(nv.sum()) * HI * DI
    base_cfg = itk._config(t, HI, tab.shape[1] * e, False, "cuda")
    base = None
    for qsub in qsubs:
        cfg = base_cfg[:5] + (qsub,)

        def scores(cfg=cfg):
            return itk.indexer_scores(q, w, kc, ks, tab, e, nv, _cfg=cfg, rows=False)

        try:
            s = scores()
            base = s if base is None else base
            same = bool(torch.equal(s, base))
            sec = timeit(scores, iters=10, warmup=2)
            print(f"| scores QSUB {qsub} {cfg} | T={t} N={n} | {sec * 1e3:.3f} ms | {flops / sec / 1e12:.1f} TFLOP/s "
                  f"| equal to QSUB {qsubs[0]}: {same} |", flush=True)
        except Exception as ex:  # noqa: BLE001  (a variant that fails is a row)
            print(f"| scores QSUB {qsub} | T={t} N={n} | failed: {type(ex).__name__}: {str(ex)[:120]} |", flush=True)
    sec = timeit(lambda: itk.indexer_topk(q, w, kc, ks, tab, e, nv, TOPK), iters=10, warmup=2)
    print(f"| whole op, default dispatch {base_cfg} | T={t} N={n} | {sec * 1e3:.3f} ms | |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1792")
    ap.add_argument("--entries", default="2048,8192")
    ap.add_argument("--qsub", default="1,2,4,8,16")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    qsubs = [int(x) for x in a.qsub.split(",")]
    if not qsubs or min(qsubs) < 1:
        ap.error(f"--qsub takes positive integers, got {a.qsub!r}")
    for t in (int(x) for x in a.tokens.split(",")):
        for n in (int(x) for x in a.entries.split(",")):
            run(t, n, qsubs, a.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
