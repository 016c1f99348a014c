"""Benchmark Engram host offload: the per-step cost of a lookup from a host table.

    python benchmarks/engram_offload.py [--rows 4194304] [--device cpu|cuda|npu] [--repeats 20]

An FP8 (E4M3 + E8M0 per 32) and an INT8 (+ fp32 per row) table of --rows rows x `engram_head_dim`
live in host memory (page-locked on a device); for T tokens x 24 random row ids per step it
times, median over --repeats:
- on-device lookup (table copied to --device first; the baseline the offload replaces);
- "gather": ids to the host, gather there, copy the rows over, dequantise on the device;
- "direct" (CUDA only): the lookup kernel reading the page-locked table in place.
Every path is checked bit for bit against the on-device lookup. On the CPU "gather" is the host
gather and the lookup with no copy, which bounds the host side of the Ascend path.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
    elif device == "npu":
        torch.npu.synchronize()  # type: ignore[attr-defined]


def median_s(fn, device: str, repeats: int) -> float:
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    from dsv41.backends.platform import platform_for
    from dsv41.backends.reference import quant
    from dsv41.core.config import ModelConfig
    from dsv41.core.model import EngramEmbed

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
    fp8 = quant.fp8_quant(src)
    amax = src.abs().amax(-1, keepdim=True).clamp_min(1e-12)
    int8 = ((src / amax * 127).round().to(torch.int8), (amax / 127).float())
    del src
    modes = ["gather"] + (["direct"] if a.device == "cuda" else [])
    print(f"device {a.device}, table {a.rows} rows x {dh} B, {r} rows per token")
    print("| table | tokens | on device | " + " | ".join(modes) + " | checked |")
    print("|---|---|---|" + "---|" * len(modes) + "---|")
    for name, (table, scale) in (("fp8", fp8), ("int8", int8)):
        on_dev = EngramEmbed(1, dh, name)
        on_dev.weight, on_dev.scale = table.to(a.device), scale.to(a.device)
        hosts = {}
        for mode in modes:
            e = EngramEmbed(1, dh, name)
            e.to_host(mode, platform)
            e.weight = platform.pinned_empty(table.shape, table.dtype).copy_(table)
            e.scale = platform.pinned_empty(scale.shape, scale.dtype).copy_(scale)
            hosts[mode] = e
        for t in (1, 64, 256, 4096):
            ids = torch.randint(0, a.rows, (t, r), generator=gen).to(a.device)
            want = on_dev.lookup(ids)
            ok = all(torch.equal(e.lookup(ids).view(torch.int16), want.view(torch.int16)) for e in hosts.values())
            cols = [median_s(lambda: on_dev.lookup(ids), a.device, a.repeats)]
            cols += [median_s(lambda e=e: e.lookup(ids), a.device, a.repeats) for e in hosts.values()]
            print(f"| {name} | {t} | " + " | ".join(f"{c * 1e6:.0f} us" for c in cols) + f" | {'exact' if ok else 'MISMATCH'} |")
            if not ok:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
