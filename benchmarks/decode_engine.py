"""Engine decode throughput at batch 1 and batch N, eager and with decode graphs, on one
device (tiny preset by default; random weights with realistic statistics).

    python benchmarks/decode_engine.py [--device cuda] [--preset tiny] [--batch 16] [--steps 32]

Prints one table: tokens/s per (batch, mode) and the graph speed-up. On CPU only the eager rows
run (there is no graph to capture)."""

import argparse
import time

import torch

from dsv41.backends.platform import platform_for
from dsv41.core.config import preset
from dsv41.core.engine import Engine, SamplingParams
from dsv41.core.weights import build_model


def rate(engine: Engine, prompts, steps: int, sync=lambda: None) -> float:
    """Decode tokens/s with every prompt decoding: prefill and one warm step untimed, then
    `steps` steps that each decode one token of every sequence."""
    for p in prompts:
        engine.add(p, SamplingParams(max_new_tokens=steps + 2))
    while engine.waiting or any(s.prefilling or not s.out for s in engine.running):
        engine.step()
    engine.step()  # one warm step (first replay / allocations)
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    out = len(prompts) * steps / (time.perf_counter() - t)
    while engine.has_work():
        engine.step()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    a = ap.parse_args()
    cfg = preset(a.preset)
    dev = torch.device(a.device)
    sync = platform_for(dev).synchronize
    model = build_model(cfg, seed=0, device=dev)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, cfg.vocab_size, (a.prompt,), generator=gen).tolist() for _ in range(a.batch)]
    max_len = a.prompt + a.steps + 8
    rows = []
    for n in (1, a.batch):
        eager = rate(Engine(model, max_batch=n, max_model_len=max_len), prompts[:n], a.steps, sync)
        graph = None
        if dev.type != "cpu":
            graph = rate(Engine(model, max_batch=n, graphs=True, max_model_len=max_len), prompts[:n], a.steps, sync)
        rows.append((n, eager, graph))
    print(f"| batch | eager tok/s | graph tok/s | graph / eager |  ({a.preset}, {dev}, {a.steps} steps)")
    print("|---|---|---|---|")
    for n, e, g in rows:
        print(f"| {n} | {e:.1f} | {'-' if g is None else f'{g:.1f}'} | {'-' if g is None else f'{g / e:.2f}x'} |")


if __name__ == "__main__":
    main()
