"""sparse_attention at prefill shapes on a CUDA GPU: tile variants of the whole-row kernel, of
the MQA kernel (each gathered entry decoded once per token and used by all 64 heads as K and V)
and of the rows form (each pool row decoded once per launch into a bf16 table, then bf16
gathers), each checked against the reference, then timed.

    python benchmarks/sparse_prefill.py --check mqa_n16_w8_s2,shipped   # compile + check (warms the cache)
    python benchmarks/sparse_prefill.py --time all                   # time the variants one after another
    python benchmarks/sparse_prefill.py --bisect 0                   # the MQA kernel at tiny widths

"rows_table" (time only) is the rows form's table step alone.
`--check` compares each variant with the reference op (fp64 on the GPU) at T=256 and with the
previous whole-row table at T=1792 (relative max error). `--time` prints kernel time (median of
CUDA-event timed calls; prefill launches take milliseconds, so launch overhead is noise) and
TFLOP/s at T=1792 and 8192 tokens over 8K and 32K contexts. `--bisect N` runs group N of tiny
MQA configurations (warps, stages, loads ahead, lazy rescale, head block) on three
input kinds (window + global, window only, global only) and prints each max error relative to
max |reference|: the search for the cause of the 4-warp wrong results.
"""

from __future__ import annotations

import argparse
import sys

import torch
from dsv41.backends import (
    ops,  # noqa: F401  (registers the reference ops)
    registry,
)
from dsv41.core.config import ModelConfig
from ops import sparse_attention_args, timeit

CFG = ModelConfig()
D, H, W, TOPK = CFG.head_dim, CFG.num_attention_heads, CFG.sliding_window, CFG.index_topk

# (label -> launch keywords); "shipped" is whatever `sparse_attention` dispatches to, "cuda_whole"
# the prefill table (CONFIGS["cuda"], the whole-row kernel), the base every variant is compared with
def _variants():
    from dsv41.npu_ops.triton import sparse_attention as sa

    mqa = sa.CONFIGS["cuda_mqa"]
    rows = sa.CONFIGS["cuda_prefill"]
    return {
        "rows": rows,
        "rows_n32_s2": dict(rows, num_stages=2),
        "rows_n64_s2": dict(rows, BLOCK_N=64, num_stages=2),
        "rows_n16_s4": dict(rows, BLOCK_N=16, num_stages=4),
        "rows_n32_s4": dict(rows, num_stages=4),
        "rows_n64_s2_w16": dict(rows, BLOCK_N=64, num_stages=2, num_warps=16),
        "rows_n128_s1": dict(rows, BLOCK_N=128, num_stages=1),
        "rows_n32_s2_w16": dict(rows, num_stages=2, num_warps=16),
        "rows_n64_s3": dict(rows, BLOCK_N=64, num_stages=3),
        "cuda_whole": sa.CONFIGS["cuda"],
        "cuda_whole_s3": dict(sa.CONFIGS["cuda"], num_stages=3),
        "mqa_n16_w8_s2_lazy8": dict(mqa, BLOCK_N=16, num_warps=8, num_stages=2, LAZY=8.0),
        "mqa_n16_w8_s2": dict(mqa, BLOCK_N=16, num_warps=8, num_stages=2, LAZY=0.0),
        "mqa_n16_w8_s2_lazy8_inplace": dict(mqa, BLOCK_N=16, num_warps=8, num_stages=2, LAZY=8.0, AHEAD=False),
        "mqa_n16_w8_s3_lazy8": dict(mqa, BLOCK_N=16, num_warps=8, num_stages=3, LAZY=8.0),
        "mqa_n32_w8_s2_lazy8": dict(mqa, BLOCK_N=32, num_warps=8, num_stages=2, LAZY=8.0),
        "mqa_n32_w8_s2": dict(mqa, BLOCK_N=32, num_warps=8, num_stages=2, LAZY=0.0),
        "mqa_n16_w16_s2_lazy8": dict(mqa, BLOCK_N=16, num_warps=16, num_stages=2, LAZY=8.0),
        "mqa_n32_w16_s2_lazy8": dict(mqa, BLOCK_N=32, num_warps=16, num_stages=2, LAZY=8.0),
    }


VARIANTS = _variants()


def rel_err(out, ref) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def launch(name, args):
    from dsv41.npu_ops.triton import sparse_attention as sa

    if name == "shipped":
        return sa.sparse_attention(*args)
    if name == "rows_table":  # the rows form's first step alone: the dense bf16 table and entry lists
        from dsv41.npu_ops.triton.sparse_attention_rows import dense_table

        return dense_table(*args[1:7])
    return sa.sparse_attention_launch(*args, **VARIANTS[name])


def check(names):
    """Compile each variant and compare it with the reference (T=256, 8K context) and with the
    previous whole-row table (T=1792, 32K context): relative max error."""
    torch.manual_seed(0)
    ref_fn = registry.resolve("sparse_attention", "reference")[0]
    small, _ = sparse_attention_args(256, 8192, "cuda", masked_fraction=0.05)
    ref = ref_fn(*small)
    big, _ = sparse_attention_args(1792, 32768, "cuda", masked_fraction=0.05)
    base = launch("cuda_whole", big)
    for name in names:
        try:
            e_ref = rel_err(launch(name, small), ref)
            e_big = rel_err(launch(name, big), base)
            torch.cuda.synchronize()
            ok = e_ref < 1e-2 and e_big < 1e-2
            verdict = "ok" if ok else "WRONG"
            print(f"| check {name} | vs reference {e_ref:.2e} | vs cuda_whole T=1792 {e_big:.2e} | {verdict} |",
                  flush=True)
        except Exception as e:  # noqa: BLE001  (a variant that fails is a row; a fault ends the process)
            print(f"| check {name} | failed: {type(e).__name__}: {str(e)[:160]} |", flush=True)


def time_all(names, tokens=(1792, 8192), contexts=(8192, 32768)):
    """Median kernel time and TFLOP/s of each variant at each (tokens, context)."""
    torch.manual_seed(0)
    for n in contexts:
        for t in tokens:
            args, _ = sparse_attention_args(t, n, "cuda", masked_fraction=0.0)
            flops = 4 * t * H * D * (TOPK + W)
            base = launch("cuda_whole", args)
            for name in names:
                try:
                    err = rel_err(launch(name, args), base) if name != "rows_table" else float("nan")
                    s = timeit(lambda: launch(name, args), iters=10, warmup=2)
                    print(f"| time {name} | T={t} ctx={n // 1024}K | {s * 1e3:.3f} ms | {flops / s / 1e12:.1f} TFLOP/s "
                          f"| vs cuda_whole {err:.1e} |", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"| time {name} | T={t} ctx={n // 1024}K | failed: {type(e).__name__}: {str(e)[:120]} |",
                          flush=True)


# tiny MQA configurations for the bisection: (warps, stages, AHEAD, LAZY, BLOCK_H, BLOCK_N). On
# 2026-12-01 (H200, triton 3.6) the earlier MQA kernel (channel-order decode: FP4 nibbles joined
# and reshaped back into channel order) gave wrong global-entry results (error = max |ref|) with
# its loads in the loop (AHEAD False) at 4 and 8 warps and every stage count, and right ones with
# AHEAD; window-only inputs were right everywhere.
BISECT = [
    [(4, 3, True, 0.0, 16, 16), (4, 3, False, 0.0, 16, 16), (4, 1, False, 0.0, 16, 16), (4, 3, True, 2.0, 16, 16)],
    [(8, 3, True, 0.0, 16, 16), (8, 2, False, 0.0, 16, 16), (8, 2, True, 2.0, 64, 16), (4, 3, False, 0.0, 64, 32)],
]


def bisect(group: int):
    """Max error / max |reference| of tiny MQA launches (H=4, D=64, as the skipped tests), per
    configuration and input kind; the whole-row kernel at 4 warps as a control."""
    sys.path.insert(0, "tests")
    from test_triton_sparse_attention import make_inputs, to

    from dsv41.npu_ops.triton import sparse_attention as sa

    g = torch.Generator().manual_seed(0)
    t, h, d, s, n, k = 3, 4, 64, 40, 60, 50
    full = make_inputs(g, t, h, d, s, n, k, dead_rows=(2,))
    win = make_inputs(g, t, h, d, s, n, k, glob=False, dead_rows=(2,))
    glob = list(full)
    glob[3] = torch.full_like(full[3], -1)
    kinds = {"win+glob": full, "win": win, "glob": glob}
    refs = {kind: sa.sparse_attention_ref(*a, d ** -0.5).float() for kind, a in kinds.items()}
    cfgs = [dict(BLOCK_H=bh, BLOCK_N=bn, BLOCK_D=None, BLOCK_DV=None, MQA=True, AHEAD=ahead, LAZY=lazy,
                 num_warps=w, num_stages=st) for w, st, ahead, lazy, bh, bn in BISECT[group]]
    if group == 0:
        cfgs.insert(0, dict(BLOCK_H=16, BLOCK_N=16, BLOCK_D=None, BLOCK_DV=None, num_warps=4, num_stages=3))
    for cfg in cfgs:
        errs = []
        for kind, a in kinds.items():
            for n_split in (1, 2):
                out = sa.sparse_attention_launch(*to("cuda", a), d ** -0.5, n_split=n_split, **cfg)
                torch.cuda.synchronize()
                err = (out.float().cpu() - refs[kind]).abs().max().item() / refs[kind].abs().max().item()
                errs.append(f"{kind} s{n_split} {err:.2g}")
        label = " ".join(f"{key}={cfg[key]}" for key in ("MQA", "num_warps", "num_stages", "AHEAD", "LAZY",
                                                         "BLOCK_H", "BLOCK_N") if key in cfg)
        print(f"| bisect {label} | {' | '.join(errs)} |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", help="comma-separated variants (or 'all') to compile and check")
    ap.add_argument("--time", help="comma-separated variants (or 'all') to time")
    ap.add_argument("--bisect", type=int, help="group of tiny MQA configurations to run")
    ap.add_argument("--tokens", default="1792,8192")
    ap.add_argument("--contexts", default="8192,32768")
    a = ap.parse_args()
    pick = lambda s: list(VARIANTS) if s == "all" else s.split(",")  # noqa: E731
    if a.bisect is not None:
        bisect(a.bisect)
    if a.check:
        check(pick(a.check))
    if a.time:
        time_all(pick(a.time), tuple(int(x) for x in a.tokens.split(",")),
                 tuple(int(x) for x in a.contexts.split(",")))


if __name__ == "__main__":
    main()
