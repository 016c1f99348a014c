"""The k-th largest of one register tile, the primitive under `indexer_topk`'s selects (the split
select's bound over merged chunk maxima, its final select over the survivors, the candidate
pool), timed alone: one program works through ROWS rows one after the other, so the time per
row is the primitive's latency (plus its row's load), as in a decode step where one program does
it on the critical path. Variants: the histogram radix select (`_kth_of_keys`, 4-bit digits, early
stop; the shipped one) and its span form (`_kth_of_keys_span`), each at 4 / 8 / 16 warps. Every
row's threshold (and the radix form's count of equal keys taken) is checked against torch first.
H100 2026-12-06: 2.1-2.8 us a row at 16 warps (benchmarks/RESULTS.md, session forty).

    python benchmarks/select_probe.py [--rows 64] [--seed 0]

Cases: "survivors" (600-1000 of the top scores of a 64K row, k = 512: the split select's final
select), "maxima" (1024 maxima of 4-entry groups, k = 512: its bound), "ties" (bf16-rounded
values: many equal keys). Needs a CUDA device (TRITON_INTERPRET=1 runs the checks on the CPU).
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from dsv41.npu_ops.triton import indexer_topk as itk

BLOCK = 1024
K = 512
MODES = {"radix": 0, "span": 1}


@triton.jit
def _probe_kernel(src, n_ptr, thr_ptr, need_ptr, ROWS, K, BLOCK: tl.constexpr, MODE: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    for r in range(0, ROWS):
        n = tl.load(n_ptr + r)
        m = cols < n
        key = itk._order_key(tl.load(src + r * BLOCK + cols, mask=m, other=0.0))
        if MODE == 0:
            thr, need = itk._kth_of_keys(key, m, K, 4)
        else:
            thr, need = itk._kth_of_keys_span(key, m, K, 4, 32)
        tl.store(thr_ptr + r, thr)
        tl.store(need_ptr + r, need)


def order_keys(x: torch.Tensor) -> torch.Tensor:
    """`_order_key` in torch (int32 keys in the scores' order, -0.0 as +0.0)."""
    b = x.float().view(torch.int32).clone()
    b[b == -2147483648] = 0
    return torch.where(b < 0, b ^ 0x7FFFFFFF, b)


def reference(x: torch.Tensor, n: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the k-th largest key and how many keys equal to it belong to the top k."""
    thr, need = [], []
    for r in range(x.shape[0]):
        key = order_keys(x[r, : int(n[r])])
        t = torch.sort(key, descending=True).values[k - 1]
        thr.append(t)
        need.append(k - int((key > t).sum()))
    return torch.stack(thr).int(), torch.tensor(need, dtype=torch.int32)


def cases(rows: int, gen: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Scores [rows, BLOCK] and valid counts [rows] per case (see the module docstring)."""
    out = {}
    n = torch.randint(600, 1001, (rows,), generator=gen)
    x = torch.zeros(rows, BLOCK)
    for r in range(rows):
        top = torch.randn(65536, generator=gen).topk(int(n[r])).values
        x[r, : int(n[r])] = top[torch.randperm(int(n[r]), generator=gen)]
    out["survivors"] = (x, n)
    mx = torch.randn(rows, BLOCK, 4, generator=gen).amax(-1)
    out["maxima"] = (mx, torch.full((rows,), BLOCK))
    out["ties"] = (torch.randn(rows, BLOCK, generator=gen).bfloat16().float(), torch.full((rows,), BLOCK))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    interp = not torch.cuda.is_available()
    dev = "cpu" if interp else "cuda"
    gen = torch.Generator().manual_seed(a.seed)
    table = []
    for name, (x, n) in cases(a.rows, gen).items():
        want_thr, want_need = reference(x, n, K)
        xs, ns = x.to(dev).contiguous(), n.to(dev, torch.int32)
        for mode, code in MODES.items():
            for warps in ((4,) if interp else (4, 8, 16)):
                thr = torch.full((a.rows,), 7, dtype=torch.int32, device=dev)
                need = torch.full((a.rows,), -7, dtype=torch.int32, device=dev)

                def call(thr=thr, need=need, code=code, warps=warps):
                    kw = {} if interp else {"num_warps": warps}
                    _probe_kernel[(1,)](xs, ns, thr, need, a.rows, K, BLOCK=BLOCK, MODE=code, **kw)

                call()
                ok = torch.equal(thr.cpu(), want_thr) and torch.equal(need.cpu(), want_need)
                if mode == "span":  # the span form's need is its own (a bound's); the threshold must match
                    ok = torch.equal(thr.cpu(), want_thr)
                us = float("nan")
                if not interp:
                    us = triton.testing.do_bench_cudagraph(call, rep=50, return_mode="median") * 1e3 / a.rows
                table.append(f"| {name} | {mode} | {warps} | {'ok' if ok else 'WRONG (seed %d)' % a.seed} | {us:.2f} |")
                print(table[-1], flush=True)
    print("\n| case | select | warps | check | us per row |\n|---|---|---|---|---|")
    print("\n".join(table))
    return 0 if all("WRONG" not in r for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
