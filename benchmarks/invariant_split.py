"""The batch-invariant mode's decode step with and without its K splits (DSV41_BATCH_INVARIANT=1,
npu_ops/triton/batch_invariant.py), beside the default mode, in one process.

For each mode -- `default`, `invariant-1` (the mode before its splits: one K slice per linear and
expert kernel, no fold path for the experts, one split per attention query, the mHC table's d
split) and `invariant` (the splits set by the shapes) -- a
fresh engine captures the decode graphs, `--batches` sequences of `--ctx` positions are placed in
the caches (random pool content, as benchmarks/e2e.py), and the graph step is timed per batch
size. In the invariant modes, row 0 of the largest batch's logits must equal the one-row step's
bit for bit (the same sequence decoded beside other rows). `--profile` lists the top kernels of
the one-row graph replay per mode (torch.profiler); `--prefill N` also times an exact prefill of
an N-token prompt per mode (the faster of two warm runs, as benchmarks/e2e.py). An invariant mode
may carry overrides of the invariant linear's CUDA tile table: `invariant:bm=16+group_m=8`.

    python benchmarks/invariant_split.py --preset mini --ctx 4096 --batches 1,64 --profile
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import tempfile
import time
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e import Clock, decode_batch, fill_sequences, parse_ints, randomise_pool  # noqa: E402

from dsv41.core.engine import SamplingParams  # noqa: E402
from dsv41.deploy.device_numerics import random_text_ids  # noqa: E402

from dsv41.backends import registry  # noqa: E402
from dsv41.core.config import preset  # noqa: E402
from dsv41.core.engine import Engine  # noqa: E402
from dsv41.core.weights import build_model  # noqa: E402
from dsv41.graphs import decode as decode_graphs  # noqa: E402
from dsv41.npu_ops.triton import batch_invariant as bi  # noqa: E402

MODES = ("default", "invariant-1", "invariant")


@contextlib.contextmanager
def linear_tiles(spec: str):
    """The invariant linear's CUDA tiles with "key=value+..." overrides, restored after."""
    saved = dict(bi.LINEAR_TILES["cuda"])
    try:
        for item in filter(None, spec.split("+")):
            k, _, v = item.partition("=")
            if k not in saved or not v.isdigit():
                raise SystemExit(f"linear tile override {item!r}: keys {', '.join(saved)}, integer values")
            bi.LINEAR_TILES["cuda"][k] = int(v)
        yield
    finally:
        bi.LINEAR_TILES["cuda"] = saved


@contextlib.contextmanager
def one_slice():
    """The invariant ops without their splits (the mode as it was before them): the linear and the
    tiled experts with one K slice (the split tables' program target 1), every expert on the tiled
    kernels, one entry-block split per attention query, the mHC table's d split; restored after."""
    tables = (bi.LINEAR_SPLIT, bi.MOE_SPLIT, bi.ATTN_SPLIT, bi.MOE_FOLD_TILES, bi.MHC_CHUNK)
    saved = [(t, t["cuda"]) for t in tables]
    try:
        bi.LINEAR_SPLIT["cuda"] = dict(bi.LINEAR_SPLIT["cuda"], programs=1)
        bi.MOE_SPLIT["cuda"] = dict(bi.MOE_SPLIT["cuda"], programs=1)
        bi.ATTN_SPLIT["cuda"] = dict(bi.ATTN_SPLIT["cuda"], blocks=1 << 30)
        bi.MOE_FOLD_TILES["cuda"] = bi.MHC_CHUNK["cuda"] = None
        yield
    finally:
        for t, old in saved:
            t["cuda"] = old


def kernel_times(run, reps: int) -> Counter:
    """Device microseconds per call of `run` by kernel name (torch.profiler's trace, `reps` calls)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    out = Counter()
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            out[e["name"][:70]] += e.get("dur", 0) / reps
    return out


def run_mode(model, mode: str, args, clock: Clock) -> list[str]:
    """Timing lines (and the bitwise check, the profile) for one mode."""
    lines = []
    kind, _, tiles = mode.partition(":")
    with contextlib.ExitStack() as stack:
        if kind != "default":
            stack.enter_context(registry.batch_invariant_mode())
            stack.enter_context(linear_tiles(tiles))
        if kind == "invariant-1":
            stack.enter_context(one_slice())
        bmax = max(args.batches)
        engine = Engine(model, max_batch=bmax, graphs=True, max_model_len=args.ctx + 64, block_size=16,
                        max_tokens_per_step=256)
        seqs = fill_sequences(engine, bmax, args.ctx, torch.Generator().manual_seed(args.seed))
        randomise_pool(engine.pool, args.seed)
        first_row = {}
        for b in args.batches:
            batch = decode_batch(engine, seqs[:b])
            graph = lambda: engine.graphs.run(batch)  # noqa: E731
            first_row[b] = graph()[0].float().clone()
            t = clock.per_call(graph, args.reps)
            lines.append(f"| {mode} | {b} | {args.ctx} | {t * 1e3:.3f} |")
            print(lines[-1], flush=True)
            if args.profile and b == min(args.batches):
                top = kernel_times(graph, 5)
                print(f"  {mode} b={b}: kernels {sum(top.values()):.1f} us per step; top:", flush=True)
                for name, us in top.most_common(14):
                    print(f"    {us:8.1f} {name}", flush=True)
        if kind != "default" and len(first_row) > 1:
            same = torch.equal(first_row[min(args.batches)], first_row[bmax])
            print(f"  {mode}: row 0 of batch {bmax} == the one-row step bit for bit: {same}", flush=True)
            if not same:
                lines.append(f"FAILED: {mode}: row 0 differs between batch {min(args.batches)} and {bmax}")
        for s in seqs:
            engine.finish(s)
        del engine, seqs
        if args.prefill:
            lines.append(time_prefill(model, mode, args, clock))
            print(lines[-1], flush=True)
    return lines


def time_prefill(model, mode: str, args, clock: Clock) -> str:
    """One exact prefill of `args.prefill` tokens in `mode` (the caller's context): the faster of
    two runs after a first (compiling) one, as a table line."""
    n = args.prefill
    engine = Engine(model, prefill_mode="exact", max_batch=1, max_tokens_per_step=n, block_size=16,
                    max_model_len=n + 8, prefix_cache=False)
    prompt = random_text_ids(model.cfg, n, torch.Generator().manual_seed(args.seed + 1))
    runs = []
    for _ in range(3):
        clock.sync()
        t = time.perf_counter()
        seq, _, _ = engine.prefill_alone(prompt, SamplingParams(max_new_tokens=1))
        clock.sync()
        runs.append(time.perf_counter() - t)
        engine.finish(seq)
    del engine
    return f"| {mode} | prefill {n} tokens | - | {min(runs[1:]) * 1e3:.1f} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--batches", type=parse_ints, default=[1, 64])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--prefill", type=int, default=0, help="also time an exact prefill of this many tokens")
    args = ap.parse_args()
    modes = args.modes.split(",")
    bad = [m for m in modes if m.partition(":")[0] not in MODES or (m.startswith("default:"))]
    if bad:
        raise SystemExit(f"--modes: unknown {bad} (choose from {', '.join(MODES)}; tiles only on invariant modes)")
    dev = torch.device("cuda")
    clock = Clock(dev)
    model = build_model(preset(args.preset), seed=args.seed, device=dev, with_drafter=False, draw_device=dev)
    decode_graphs.BUCKETS = tuple(sorted(set(args.batches)))
    print(f"{torch.cuda.get_device_name(dev)}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{args.preset}, graph step (ms)\n| mode | batch | context | graph step ms |\n|---|---|---|---|", flush=True)
    lines = []
    for mode in modes:
        lines += run_mode(model, mode, args, clock)
    failed = [x for x in lines if x.startswith("FAILED")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
