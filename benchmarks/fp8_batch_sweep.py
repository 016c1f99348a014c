"""The FP8 linears at batch sizes 9..64 on a CUDA GPU: the default dispatch, the weight-major
kernel (`_fold_linear_kernel`, weight on the MMA's register side) and tile settings of the
token-major kernel (`_fold_tm_kernel`, both operands from shared memory), at the mini preset's
seven per-layer linear shapes. Every variant is first checked against the reference op (bf16
output, the model's bound), then timed as the median of CUDA-graph replays with the weights
cycled past the L2 (as in a decode step); the table gives microseconds per call, the sum over
the shapes, and the weight-read floor (weight bytes / measured copy bandwidth).

    python fp8_batch_sweep.py [--m 16,32,64] [--only default,fold] [--engram] [--pairs] [--seed 0]

Run from benchmarks/ (it imports dense_ab.py beside it).
"""

from __future__ import annotations

import argparse
import sys

import torch
from dense_ab import CFG, D, LINEARS, graph_median, rel_err, weight_copies  # benchmarks/dense_ab.py
from dsv41.backends.reference import quant
from dsv41.npu_ops.triton import block_linear as bl
from ops import timeit  # benchmarks/ops.py: CUDA-event median per call

# (label, launcher, its keyword settings): "default" is `linear`'s own choice (DSV41_FP8_DECODE and
# `fold_tm_tiles` by weight shape), "fold" the weight-major kernel, "tm ..." token-major settings
VARIANTS = [("default", "default", {}), ("fold", "fold", {})] + [
    (f"tm bn{bn} bk{bk} w{w} s{st} v{v}", "tm", dict(bn=bn, bk=bk, num_warps=w, num_stages=st, waves=v))
    for bn, bk, w, st, v in [(64, 128, 4, 3, 1), (64, 128, 4, 3, 2), (32, 128, 4, 3, 2), (32, 128, 4, 3, 1),
                             (64, 128, 4, 4, 4), (64, 128, 4, 2, 2), (64, 64, 4, 4, 2), (128, 64, 4, 3, 2),
                             (128, 128, 4, 3, 4), (128, 128, 8, 3, 4), (64, 256, 4, 3, 4), (32, 256, 4, 3, 2)]]

# `--pairs`: the stacked weights of the two pairs that read one x (rows of the first weight, then the second's)
PAIRS = [("wq_a+wkv", CFG.q_lora_rank + CFG.head_dim, D), ("shared_w1+w3", 2 * CFG.moe_intermediate_size, D)]


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB bf16 device-to-device copy, read + write, timed per eager call as
    benchmarks/e2e.py does (a graph-captured copy read 2.75 against 4.25 TB/s on the H200: the
    captured memcpy node is likely served by the copy engines, not by SM copy kernels)."""
    a = torch.randn(1 << 29, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() * 2 / timeit(lambda: b.copy_(a), iters=10, warmup=2)


def row_counts(spec: str) -> list[int]:
    """--m: comma-separated integers in 1..64 (the fold kernels' range; 9..64 is the default path's)."""
    try:
        ms = [int(v) for v in spec.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{spec!r} is not a comma-separated list of integers") from None
    if not ms or any(not 1 <= m <= bl.FOLD_MAX_M for m in ms):
        raise argparse.ArgumentTypeError(f"row counts must lie in 1..{bl.FOLD_MAX_M}, got {spec!r}")
    return ms


def launcher(kind: str, kw: dict):
    if kind == "default":
        return lambda x, w, s, out: bl.launch_linear(x, w, s, out)
    if kind == "fold":
        return lambda x, w, s, out: bl._launch_fold(x, w, s, out, **kw)
    return lambda x, w, s, out: bl._launch_fold_tm(x, w, s, out, **kw)


def check(run, n: int, k: int, m: int, gen: torch.Generator) -> float:
    """The bf16-output relative error against the fp32-accumulating reference on fresh inputs."""
    from dsv41.backends.reference.basic import fp32_accumulation
    from dsv41.backends.reference.basic import linear as linear_ref

    w, s = quant.fp8_block_quant(torch.randn(n, k, generator=gen).cuda() * k ** -0.5)
    x = (torch.randn(m, k, generator=gen) * 2).to(torch.bfloat16).cuda()
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    run(x, w, s, out)
    with fp32_accumulation():
        want = linear_ref(x, w, s)
    return rel_err(out, want) if torch.isfinite(out).all() else float("inf")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=row_counts, default="16,32,64", help="comma-separated row counts in 1..64 (the default path takes 9..64 on the token-major kernel)")
    ap.add_argument("--only", default="", help="comma-separated label prefixes to run (default all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engram", action="store_true", help="also Engram's value projection (25600 x 6144)")
    ap.add_argument("--pairs", action="store_true", help="also the two pairs `linear_pair` runs as one weight "
                    "(wq_a + wkv, the shared expert's w1 + w3), to set against their separate columns")
    a = ap.parse_args()
    ms = a.m
    only = [p for p in a.only.split(",") if p]
    variants = [v for v in VARIANTS if not only or any(v[0].startswith(p) for p in only)]
    linears = LINEARS + ([("engram_wkv", 25600, 6144)] if a.engram else []) + (PAIRS if a.pairs else [])
    gen = torch.Generator().manual_seed(a.seed)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; seed {a.seed}")
    names = [name for name, _, _ in linears]
    floor = {name: n * k / bw * 1e6 for name, n, k in linears}
    print("| M | variant | " + " | ".join(names) + " | sum us | floor share |")
    print("|---|---|" + "---|" * (len(names) + 2))
    print("| - | floor | " + " | ".join(f"{floor[x]:.1f}" for x in names) + f" | {sum(floor.values()):.1f} | 100% |")
    failed = []
    for m in ms:
        for label, kind, kw in variants:
            run = launcher(kind, kw)
            times = []
            for name, n, k in linears:
                try:
                    err = check(run, n, k, m, gen)
                except Exception as e:  # a setting the compiler refuses (shared memory, registers)
                    err, why = float("inf"), f"{type(e).__name__}: {str(e)[:80]}"
                else:
                    why = f"rel err {err:.2e}"
                if not err < 4e-3:
                    failed.append(f"M={m} {label} {name}: {why}")
                    times.append(float("nan"))
                    continue
                x = (torch.randn(m, k, generator=gen) * 2).to(torch.bfloat16).cuda()
                out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
                times.append(graph_median([lambda w=w, s=s: run(x, w, s, out) for w, s in weight_copies(n, k)]) * 1e6)
            tot = sum(times)
            print(f"| {m} | {label} | " + " | ".join(f"{t:.1f}" for t in times) +
                  f" | {tot:.1f} | {sum(floor.values()) / tot:.0%} |", flush=True)
    for f in failed:
        print("FAILED", f)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
