"""Benchmark Engram host offload: the per-step cost of a lookup from a host table.

    python benchmarks/engram_offload.py [--rows 4194304] [--device cpu|cuda|npu] [--repeats 20]

An FP8 (E4M3 + E8M0 per 32) and an INT8 (+ fp32 per row) table of --rows rows x `engram_head_dim`
are looked up for T tokens x 24 random row ids per step (median over --repeats):
- "on device": the table in --device memory (the baseline the offload replaces);
- "gathered": the table in host memory, the step's rows gathered there and copied over
  (`gather_rows_to`, what a lookup does on NPUs), then looked up on the device;
- "in place" (CUDA only): the lookup kernel reading the page-locked host table directly;
- "ahead": the model's default offload path (`core/engram.EngramPrefetch`): row ids hashed on
  the host from the n-gram token ids, rows gathered into page-locked staging, copied on a side
  stream, looked up after an event wait (one Engram layer; the hashing included).
Every path is checked bit for bit against "on device". On the CPU "gathered" is the host gather
plus the lookup with no copy, which bounds the host side of the Ascend path.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def median_s(fn, sync, repeats: int) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    from dsv41.backends import ops
    from dsv41.backends.platform import platform_for
    from dsv41.backends.reference import quant
    from dsv41.backends.reference.basic import gather_rows_to
    from dsv41.core.config import ModelConfig
    from dsv41.core.engram import EngramPrefetch, engram_multipliers, engram_primes, engram_window_row_ids

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1 << 22)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "npu"])
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    cfg = ModelConfig()
    dh, r = cfg.engram_head_dim, cfg.n_engram_rows_per_token
    platform = platform_for(a.device)
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(a.rows, dh, generator=gen)
    tables = {"fp8": quant.fp8_quant(src), "int8": quant.int8_row_quant(src)}
    del src
    paths = ["gathered", "ahead"] + (["in place"] if a.device == "cuda" else [])
    n_gram, heads = cfg.engram_max_ngram_size, cfg.engram_n_heads
    primes = torch.tensor(engram_primes(cfg)[0], dtype=torch.long)
    primes = primes * 0 + a.rows // r  # table-sized heads: every row reachable, the same hash arithmetic
    mult = torch.from_numpy(engram_multipliers(cfg, cfg.engram_layer_ids[0]))
    print(f"device {a.device}, table {a.rows} rows x {dh} B, {r} rows per token")
    print("| table | tokens | on device | " + " | ".join(paths) + " | checked |")
    print("|---|---|---|" + "---|" * len(paths) + "---|")
    for name, (table, scale) in tables.items():
        dev_table, dev_scale = table.to(a.device), scale.to(a.device)
        host = [platform.pinned_empty(x.shape, x.dtype).copy_(x) for x in (table, scale)]
        prefetch = EngramPrefetch({0: (*host, mult, primes, heads)}, torch.arange(cfg.vocab_size), 2, a.device)
        for t in (1, 64, 256, 4096):
            ngrams = torch.randint(0, cfg.vocab_size, (t, n_gram), generator=gen)
            no_image = torch.zeros(t, n_gram, dtype=torch.bool)
            ids = engram_window_row_ids(ngrams, ngrams >= 0, mult, primes, 2, heads).to(a.device)

            def ahead():
                prefetch.gather(ngrams, no_image)
                return ops.engram_lookup(*prefetch.issue()[0].ready())

            calls = {"on device": lambda: ops.engram_lookup(dev_table, dev_scale, ids),
                     "gathered": lambda: ops.engram_lookup(*gather_rows_to(*host, ids)),
                     "ahead": ahead,
                     "in place": lambda: ops.engram_lookup(*host, ids)}
            want = calls["on device"]().view(torch.int16)
            ok = all(torch.equal(calls[p]().view(torch.int16), want) for p in paths)
            cols = [median_s(calls[p], platform.synchronize, a.repeats) for p in ["on device", *paths]]
            print(f"| {name} | {t} | " + " | ".join(f"{c * 1e6:.0f} us" for c in cols) + f" | {'exact' if ok else 'MISMATCH'} |")
            if not ok:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
