"""Programmatic dependent launch (PDL) in a captured CUDA graph: what a chain of dependent Triton
launches gains when each kernel may be scheduled before its predecessor finishes.

A decode step is a chain of ~190 launches at batch 1 (mini, H200), most of a few microseconds;
the graph's replay still leaves about a microsecond between dependent kernels. With
`launch_pdl=True` a kernel is scheduled once every program of the one before it has called
`gdc_launch_dependents` (or exited), and waits in `gdc_wait` until that kernel has finished and
its writes are visible, so its launch and setup overlap the predecessor's tail.
(A first version of this probe, one program holding a 1024 x 1024 tile, did not compile within
its 40 s on the H200, 2026-12-03: no numbers from it yet.)

Chains of N dependent GEMV kernels (each reads the previous output and its own weight; a
one-program 64 x 64 kernel, launch-bound, and a 256-program 4096 x 4096 one), captured under
each mode of npu_ops/triton/pdl.py: off, "wait", "trigger" and "chain". Each mode's final output is checked
bit for bit against the first's (outputs poisoned before the checked replay). Needs CUDA
(compute capability >= 9).

    python benchmarks/pdl_probe.py [--chain 100] [--replays 50]
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from dsv41.npu_ops.triton.pdl import pdl_launch, pdl_start, set_pdl


@triton.jit
def _step_kernel(x_ptr, w_ptr, y_ptr, K, ROWS: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = 0):
    """y[r] = sum_k w[r, k] * x[k] for this program's ROWS rows (bf16 weight, fp32 sums)."""
    pdl_start(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    acc = tl.zeros([ROWS], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :])
        acc += tl.sum(w.to(tl.float32) * tl.load(x_ptr + cols)[None, :], axis=1)
    tl.store(y_ptr + rows, acc)


def _chain(xs, ws, rows_per_program):
    n = xs[0].numel()
    for i, w in enumerate(ws):
        _step_kernel[(n // rows_per_program,)](xs[i], w, xs[i + 1], n, ROWS=rows_per_program, BK=64,
                                               **pdl_launch(w))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chain", type=int, default=100)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        print("pdl_probe.py needs a CUDA device of compute capability >= 9", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    print(f"seed {args.seed}, chain {args.chain}, {torch.cuda.get_device_name()}, triton {triton.__version__}")
    print("| kernel | programs | off us | wait us | trigger us | chain us | per launch saved us | bit-equal |")
    print("|---|---|---|---|---|---|---|---|")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    # a one-program 64 x 64 step (launch-bound) and a 256-program 4096 x 4096 one (a 32 MB weight)
    for n, rows in ((64, 64), (4096, 16)):
        ws = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) * n ** -0.5 for _ in range(args.chain)]
        xs = [torch.randn(n, device="cuda")] + [torch.empty(n, device="cuda") for _ in range(args.chain)]
        times, equal, want = [], [], None
        try:
            for mode in ("off", "wait", "trigger", "chain"):
                set_pdl(mode)
                _chain(xs, ws, rows)  # compiles outside the capture
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    _chain(xs, ws, rows)
                for t in xs[1:]:
                    t.fill_(float("nan"))  # every output must be written again by the replay
                g.replay()
                torch.cuda.synchronize()
                want = xs[-1].clone() if want is None else want
                equal.append(bool(torch.equal(xs[-1], want)) and not bool(xs[-1].isnan().any()))
                samples = []
                for _ in range(5):
                    start.record()
                    for _ in range(max(1, args.replays // 5)):
                        g.replay()
                    end.record()
                    end.synchronize()
                    samples.append(start.elapsed_time(end) * 1e3 / max(1, args.replays // 5))
                times.append(sorted(samples)[2])
        finally:
            set_pdl(None)
        saved = (times[0] - min(times[1:])) / args.chain
        print(f"| {n} x {n} bf16 | {n // rows} | {times[0]:.1f} | {times[1]:.1f} | {times[2]:.1f} | {times[3]:.1f} | {saved:.2f} | "
              f"{all(equal)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
