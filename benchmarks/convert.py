"""Benchmark `dsv41 convert`: throughput (MB/s) and peak resident memory vs the largest tensor.

    python benchmarks/convert.py [--gb 2] [--mp 4] [--workdir DIR] [--keep]

Builds a random checkpoint of about --gb GB (a tiny-shaped model widened until it is that big;
the tensor bytes are random, written one tensor at a time, in chunks, with the converter's own
streaming writer), then converts it to --mp shards in a CHILD process, so that the child's
`resource.getrusage(RUSAGE_SELF).ru_maxrss` measures the conversion alone. Reported: MB/s (source
bytes / wall time), the child's peak RSS, its RSS baseline just before `convert` (interpreter,
torch, the meta-device model used to check names), the largest source tensor, and the target
peak < baseline + 2 x largest tensor.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def bench_config(gb: float):
    from dsv41.core.config import preset

    cfg = preset("tiny").replace(
        hidden_size=1024, num_attention_heads=8, head_dim=128, qk_rope_head_dim=32, q_lora_rank=256,
        o_groups=4, o_lora_rank=256, index_n_heads=8, index_head_dim=64, vocab_size=131072,
        moe_intermediate_size=512, n_routed_experts=16, dspark_n_routed_experts=4,
    )
    # widen the expert count until the checkpoint is about `gb` GB
    for n in (16, 32, 64, 128, 256, 512, 1024):
        c = cfg.replace(n_routed_experts=n)
        if _size(c) >= gb * 1e9 * 0.9:
            return c
    return c


def _tensors(cfg):
    from dsv41.deploy.convert import TORCH_TO_ST, expected_tensors

    return [(k, TORCH_TO_ST[dt], shape) for k, (shape, dt) in expected_tensors(cfg).items()]


def _size(cfg) -> int:
    from dsv41.deploy.convert import ITEMSIZE

    return sum(math.prod(s) * ITEMSIZE[d] for _, d, s in _tensors(cfg))


def make_checkpoint(cfg, src: Path, shard_bytes: int = 512 << 20, chunk: int = 32 << 20) -> None:
    from dsv41.deploy.convert import OutTensor, ShardWriter

    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    gen = torch.Generator().manual_seed(0)
    groups, cur, size = [], [], 0
    for t in _tensors(cfg):
        cur.append(t)
        size += math.prod(t[2]) * torch.empty(0, dtype=torch.uint8).element_size()
        if size >= shard_bytes:
            groups.append(cur)
            cur, size = [], 0
    if cur:
        groups.append(cur)
    wmap = {}
    for i, g in enumerate(groups):
        fn = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        outs = [OutTensor(n, d, tuple(s)) for n, d, s in g]
        w = ShardWriter(src / fn, outs)
        for o in outs:
            left = o.nbytes
            while left:
                n = min(left, chunk)
                w.write(o.name, torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen))
                left -= n
        w.close()
        wmap.update({o.name: fn for o in outs})
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))


def _child(src: str, dst: str, mp: int) -> None:
    from dsv41.core.config import load_config
    from dsv41.deploy import convert as cv

    cv.expected_tensors(load_config(src))   # warm the same imports/model build the converter does
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rep = cv.convert(src, dst, mp, progress=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"baseline_rss": base, "peak_rss": peak, "report": rep}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--mp", type=int, default=4)
    ap.add_argument("--workdir")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        _child(a.child[0], a.child[1], int(a.child[2]))
        return 0
    work = Path(a.workdir or tempfile.mkdtemp(prefix="dsv41-convert-bench-"))
    src, dst = work / "src", work / f"mp{a.mp}"
    try:
        cfg = bench_config(a.gb)
        t0 = time.perf_counter()
        make_checkpoint(cfg, src)
        gen_s = time.perf_counter() - t0
        out = subprocess.run([sys.executable, __file__, "--child", str(src), str(dst), str(a.mp)],
                             check=True, stdout=subprocess.PIPE, text=True).stdout
        res = json.loads(out.strip().splitlines()[-1])
        rep = res["report"]
        largest = rep["largest_source_tensor_bytes"]
        base, peak = res["baseline_rss"], res["peak_rss"]
        mb = 1e6
        print(f"checkpoint: {rep['source_bytes'] / mb:.0f} MB, {rep['source_tensors']} tensors "
              f"(n_routed_experts={cfg.n_routed_experts}, generated in {gen_s:.1f} s)")
        print(f"convert to mp={a.mp}: {rep['seconds']:.2f} s, {rep['mb_per_s']:.0f} MB/s, "
              f"{rep['bytes_written'] / mb:.0f} MB written")
        print(f"peak RSS {peak / mb:.0f} MB; baseline before convert {base / mb:.0f} MB; "
              f"growth {(peak - base) / mb:.0f} MB; largest tensor {largest / mb:.0f} MB")
        target = base + 2 * largest
        print(f"target peak < baseline + 2 x largest = {target / mb:.0f} MB: {'OK' if peak < target else 'MISSED'}")
        return 0 if peak < target else 1
    finally:
        if not a.keep and not a.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
