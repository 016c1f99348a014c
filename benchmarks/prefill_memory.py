"""Where a long prefill's peak device memory goes: `python benchmarks/prefill_memory.py --preset mini`.

Prefills one random prompt (exact and / or CED, at the given tokens per step or the engine's
default from its memory budget), times it (the faster of two warm runs), reports the allocator's
peak against weights + KV, then repeats it with CUDA's allocator history on, replays the
allocation trace to the moment of the peak, and prints the blocks live then,
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


def parse_chunks(s: str) -> list[int]:
    """`--chunk`: a comma list of tokens per step; 0 (or `auto`) is the engine's default."""
    out = []
    for v in s.split(","):
        v = v.strip()
        if v in ("0", "auto"):
            out.append(0)
        elif v.isdigit() and int(v) > 0:
            out.append(int(v))
        else:
            raise argparse.ArgumentTypeError(f"--chunk takes positive token counts or 'auto', got {v!r}")
    return out


def measure(model, cfg, args, mode: str, chunk: int, dev, log) -> dict:
    """One (mode, chunk): a compile run, two timed runs (the faster counts, peak from the
    allocator), then one run with the allocator history for the breakdown."""
    import time

    from dsv41.core import memory
    from dsv41.core.engine import Engine, SamplingParams
    from dsv41.deploy.device_numerics import random_text_ids

    engine = Engine(model, prefill_mode=mode, max_batch=1, max_tokens_per_step=chunk or None,
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
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        seq, logits, _ = engine.prefill_alone(prompt, SamplingParams(max_new_tokens=1))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        engine.finish(seq)
    measured = torch.cuda.max_memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    seq, _, _ = engine.prefill_alone(prompt, SamplingParams(max_new_tokens=1))
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    engine.finish(seq)
    trace = snap["device_traces"][dev.index or 0]
    peak, at_peak = live_at_peak(trace, base)
    w, kv = memory.weight_bytes(model), engine.pool.nbytes()
    row = dict(mode=mode, chunk=engine.max_tokens_per_step, auto=chunk == 0, peak=measured, replayed=peak, base=base,
               weights=w, kv=kv, s=min(times), finite=bool(torch.isfinite(logits).all()), groups=grouped(at_peak),
               full=len(trace) >= 2_000_000)
    del engine
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> None:
    from dsv41.core.config import preset
    from dsv41.core.weights import build_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--prompt", type=int, default=32768, help="prompt tokens")
    ap.add_argument("--chunk", type=parse_chunks, default=[0],
                    help="tokens per prefill step, a comma list; 0 or 'auto': the engine's default (from its "
                         "memory budget)")
    ap.add_argument("--mode", default="exact", help="exact, ced or a comma list of both")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--top", type=int, default=12, help="rows printed per breakdown")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    modes = [m for m in args.mode.split(",") if m]
    if not modes or any(m not in ("exact", "ced") for m in modes):
        sys.exit(f"--mode takes exact, ced or both, got {args.mode!r}")
    if not torch.cuda.is_available():
        sys.exit("prefill_memory.py needs a CUDA device (the allocator history is CUDA's)")
    dev = torch.device("cuda")
    cfg = preset(args.preset)
    model = build_model(cfg, seed=args.seed, device=dev, with_drafter=False, draw_device=dev)
    rows = []
    for mode in modes:
        for chunk in args.chunk:
            r = measure(model, cfg, args, mode, chunk, dev, print)
            rows.append(r)
            print(f"\n{args.preset}, {mode} prefill of {args.prompt} tokens in chunks of {r['chunk']}"
                  f"{' (engine default)' if r['auto'] else ''}: {args.prompt / r['s']:.0f} tok/s, peak "
                  f"{r['peak'] / 2**30:.2f} GiB by the allocator ({r['replayed'] / 2**30:.2f} replayed), "
                  f"{r['base'] / 2**30:.2f} GiB before the prefill; weights {r['weights'] / 1e9:.2f} GB + KV "
                  f"{r['kv'] / 1e9:.2f} GB: peak / (weights + KV) = {r['peak'] / (r['weights'] + r['kv']):.3f}"
                  f"{'' if r['finite'] else ' (NON-FINITE logits)'}", flush=True)
            print("| allocated at | GiB live at the peak | blocks |\n|---|---|---|")
            print(f"| before the prefill | {r['base'] / 2**30:.3f} | |")
            for where, b, n in r["groups"][:args.top]:
                print(f"| {where} | {b / 2**30:.3f} | {n} |")
            if r["full"]:
                print("(the trace filled its 2M entries: the earliest events are missing)", file=sys.stderr)
    print("\n| mode | tokens per step | tok/s | peak GB | weights + KV GB | peak / (weights + KV) |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['chunk']}{' (default)' if r['auto'] else ''} | {args.prompt / r['s']:.0f} | "
              f"{r['peak'] / 1e9:.2f} | {(r['weights'] + r['kv']) / 1e9:.2f} | "
              f"{r['peak'] / (r['weights'] + r['kv']):.3f} |")


if __name__ == "__main__":
    main()
