"""Where a long prefill's peak device memory goes: `python benchmarks/prefill_memory.py --preset mini`.

Prefills one random prompt (exact or CED, the engine's chunking) with CUDA's allocator history
on, replays the allocation trace to the moment of the peak, and prints the blocks live then,
grouped by the innermost project source line that allocated them (weights and the KV pool,
allocated before the trace starts, are one "before the prefill" row). Random weights with
realistic statistics, as `benchmarks/e2e.py`; CUDA only (the CPU has no allocator history).
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch

PROJECT_DIRS = ("core", "backends", "npu_ops", "graphs", "deploy")


def project_frame(frames: list[dict]) -> str:
    """The innermost frame in the project's own code, as `dir/file.py:line (function)`."""
    for f in frames:
        parts = f.get("filename", "").replace("\\", "/").split("/")
        for i, p in enumerate(parts[:-1]):
            if p in PROJECT_DIRS:
                return f"{'/'.join(parts[i:])}:{f.get('line')} ({f.get('name')})"
    return "(outside the project)"


def live_at_peak(trace: list[dict], base: int) -> tuple[int, dict[int, tuple[int, str]]]:
    """Replay allocator events: (peak bytes, {address: (size, where)} live at the peak). `base` is
    what was allocated before the trace began."""
    live: dict[int, tuple[int, str]] = {}
    cur = peak = base
    at_peak: dict[int, tuple[int, str]] = {}
    for ev in trace:
        action, addr, size = ev.get("action"), ev.get("addr"), ev.get("size", 0)
        if action == "alloc":
            live[addr] = (size, project_frame(ev.get("frames", [])))
            cur += size
            if cur > peak:
                peak, at_peak = cur, dict(live)
        elif action == "free_completed" and addr in live:
            cur -= live.pop(addr)[0]
    return peak, at_peak


def grouped(at_peak: dict[int, tuple[int, str]]) -> list[tuple[str, int, int]]:
    """(where, bytes, blocks) per allocating line, largest first."""
    by: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, where in at_peak.values():
        by[where][0] += size
        by[where][1] += 1
    return sorted(((w, b, n) for w, (b, n) in by.items()), key=lambda r: -r[1])


def main(argv=None) -> None:
    from dsv41.core.config import preset
    from dsv41.core.engine import Engine, SamplingParams
    from dsv41.core.weights import build_model
    from dsv41.deploy.device_numerics import random_text_ids

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--prompt", type=int, default=32768, help="prompt tokens")
    ap.add_argument("--chunk", type=int, default=8192, help="tokens per prefill step")
    ap.add_argument("--mode", choices=("exact", "ced"), default="exact")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--top", type=int, default=20, help="rows printed")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("prefill_memory.py needs a CUDA device (the allocator history is CUDA's)")
    dev = torch.device("cuda")
    cfg = preset(args.preset)
    model = build_model(cfg, seed=args.seed, device=dev, with_drafter=False, draw_device=dev)
    engine = Engine(model, prefill_mode=args.mode, max_batch=1, max_tokens_per_step=args.chunk,
                    block_size=args.block_size, max_model_len=args.prompt + 8, prefix_cache=False)
    blocks = -(-(args.prompt + 1) // args.block_size) + 2
    engine.pool.grow(blocks, blocks)
    prompt = random_text_ids(cfg, args.prompt, torch.Generator().manual_seed(args.seed + 1))
    seq, _, _ = engine.prefill_alone(prompt, SamplingParams(max_new_tokens=1))  # compile, warm caches
    engine.finish(seq)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    seq, _, _ = engine.prefill_alone(prompt, SamplingParams(max_new_tokens=1))
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][dev.index or 0]
    peak, at_peak = live_at_peak(trace, base)
    measured = torch.cuda.max_memory_allocated()
    print(f"{args.preset}, {args.mode} prefill of {args.prompt} tokens in chunks of {args.chunk}: "
          f"peak {peak / 2**30:.2f} GiB replayed ({measured / 2**30:.2f} GiB by the allocator), "
          f"{base / 2**30:.2f} GiB before the prefill (weights, KV pool)")
    print("| allocated at | GiB live at the peak | blocks |\n|---|---|---|")
    print(f"| before the prefill | {base / 2**30:.3f} | |")
    for where, b, n in grouped(at_peak)[:args.top]:
        print(f"| {where} | {b / 2**30:.3f} | {n} |")
    if len(trace) >= 2_000_000:
        print("(the trace filled its 2M entries: the earliest events are missing)", file=sys.stderr)


if __name__ == "__main__":
    main()
