"""CPU reference speed: tiny preset, a 256-token prefill then 64 decode steps on 2 CPU threads,
and decode throughput at batch 1 and batch 16 through the continuous-batching engine.

Targets: the whole single-prompt generate call under 10 s (CI stays fast); batch-16 decode at
least 6x the tokens/s of batch 1 (the per-step overhead is amortised over the batch). Prints one
table; exits 1 when a target is missed.
    python benchmarks/cpu_reference.py [--prefill 256] [--decode 64] [--threads 2] [--batch 16]
"""

import argparse
import sys
import time

import torch

from dsv41.core.config import preset
from dsv41.core.engine import Engine, SamplingParams
from dsv41.core.weights import build_model
from decode_engine import rate as decode_rate  # (this folder: benchmarks/decode_engine.py)

TARGET_S = 10.0
TARGET_BATCH_RATIO = 6.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mode", choices=["ced", "exact"], default="ced")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--batch-prompt", type=int, default=64, help="prompt length of the batched decode runs")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = preset("tiny")
    t0 = time.perf_counter()
    model = build_model(cfg, seed=0)
    build_s = time.perf_counter() - t0
    prompt = torch.randint(5, cfg.vocab_size, (a.prefill,), generator=torch.Generator().manual_seed(0)).tolist()
    engine = Engine(model, prefill_mode=a.mode)
    t1 = time.perf_counter()
    res = engine.generate(prompt, SamplingParams(max_new_tokens=a.decode))
    total = time.perf_counter() - t1
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, cfg.vocab_size, (a.batch_prompt,), generator=gen).tolist() for _ in range(a.batch)]
    steps = max(4, a.decode // 4)
    r1 = decode_rate(Engine(model, prefill_mode=a.mode), prompts[:1], steps)
    rb = decode_rate(Engine(model, prefill_mode=a.mode, max_batch=a.batch), prompts, steps)
    ratio = rb / r1
    rows = [
        ("model build (random weights)", f"{build_s:.2f} s", ""),
        (f"prefill {a.prefill} tokens ({a.mode})", f"{res.prefill_s:.2f} s", f"{res.prefill_tokens_per_s:.1f} tok/s"),
        (f"decode {len(res.token_ids) - 1} steps", f"{res.decode_s:.2f} s", f"{res.decode_tokens_per_s:.1f} tok/s"),
        ("prefill + decode", f"{total:.2f} s", f"target < {TARGET_S:.0f} s: {'met' if total < TARGET_S else 'MISSED'}"),
        ("decode, batch 1", f"{steps} steps", f"{r1:.1f} tok/s"),
        (f"decode, batch {a.batch}", f"{steps} steps", f"{rb:.1f} tok/s = {ratio:.1f}x batch 1 (target >= "
         f"{TARGET_BATCH_RATIO:.0f}x: {'met' if ratio >= TARGET_BATCH_RATIO else 'MISSED'})"),
    ]
    print(f"| step | time | rate |  (tiny preset, {a.threads} threads, torch {torch.__version__})")
    print("|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0 if total < TARGET_S and ratio >= TARGET_BATCH_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
