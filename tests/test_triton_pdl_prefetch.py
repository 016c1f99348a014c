"""The weight ranges the prefetching PDL starts ask the L2 for (npu_ops/triton/pdl.py,
`prefetch_row_ranges` / `prefetch_range_pieces`): a bulk prefetch needs a 16-byte aligned start
and a size in whole 16-byte units, and must stay inside the weight. Each probe program computes
its ranges as the decode linears' programs do (a tile's rows and K slice; a run of whole rows)
and the test checks them against the tile's own bytes, at random shapes (seed printed on
failure). Under the interpreter and compiled; the prefetch itself (inline PTX) runs only on a
GPU (tests/test_triton_pdl.py's decode-graph test)."""

import pytest
import torch
from _triton import DEVICES, triton  # noqa: F401  (sets TRITON_INTERPRET; skips without triton)

from dsv41.npu_ops.triton.pdl import prefetch_range_pieces, prefetch_row_ranges  # noqa: E402

tl = triton.language


@triton.jit
def _tile_ranges_probe(off_ptr, size_ptr, N, K, k_per_split, pre_bytes, BN: tl.constexpr):
    """Program (n, k): the ranges of tile rows n * BN .. and K slice k (as `_fold_tm_kernel`)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    off, n = prefetch_row_ranges(rn.to(tl.int64), rn < N, K, k_lo, k_hi, pre_bytes, BN)
    slot = (pid_n * tl.num_programs(1) + pid_k) * BN + tl.arange(0, BN)
    tl.store(off_ptr + slot, off)
    tl.store(size_ptr + slot, n)


@triton.jit
def _run_ranges_probe(off_ptr, size_ptr, N, row_bytes, rows_per_prog, pre_bytes, NT: tl.constexpr):
    """Program p: the pieces of its run of whole rows (as `_row_gemv_kernel`)."""
    n_lo = tl.program_id(0) * rows_per_prog
    n_hi = tl.minimum(n_lo + rows_per_prog, N)
    off, n = prefetch_range_pieces(n_lo.to(tl.int64) * row_bytes, tl.minimum((n_hi - n_lo) * row_bytes, pre_bytes),
                                   NT)
    slot = tl.program_id(0) * NT + tl.arange(0, NT)
    tl.store(off_ptr + slot, off)
    tl.store(size_ptr + slot, n)


def _check_ranges(off, size, total_bytes, tag):
    live = size > 0
    assert (size >= 0).all() and (size % 16 == 0).all(), tag
    assert (off[live] % 16 == 0).all() and (off[live] >= 0).all(), tag
    assert (off[live] + size[live] <= total_bytes).all(), tag


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", range(6))
def test_tile_prefetch_ranges_stay_in_their_tiles(dev, case, fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed + case)
    bn = (32, 64, 128)[case % 3]
    n = int(torch.randint(1, 5 * bn, (1,), generator=g))
    k = 16 * int(torch.randint(1, 400, (1,), generator=g))
    bk = 128
    k_steps = -(-k // bk)
    split = int(torch.randint(1, min(k_steps, 6) + 1, (1,), generator=g))
    per = bk * -(-k_steps // split)
    split = -(-k // per)
    pre = 16 * int(torch.randint(0, 4096, (1,), generator=g)) if case else 0
    n_n = -(-n // bn)
    off = torch.full((n_n * split * bn,), -1, dtype=torch.int64, device=dev)
    size = torch.full((n_n * split * bn,), -1, dtype=torch.int32, device=dev)
    _tile_ranges_probe[(n_n, split)](off, size, n, k, per, pre, BN=bn)
    off, size = off.cpu().view(n_n, split, bn), size.cpu().view(n_n, split, bn)
    tag = f"seed {fresh_seed + case}: n {n} k {k} bn {bn} split {split} pre {pre}"
    _check_ranges(off, size, n * k, tag)
    rows = torch.arange(n_n * bn).view(n_n, 1, bn)
    lo = (torch.arange(split) * per).view(1, split, 1)
    hi = torch.clamp(lo + per, max=k)
    live = size > 0
    # each live range starts at its row's slice and ends inside it (rows past N ask for nothing);
    # a tile asks for at most pre
    assert torch.equal(off[live], (rows * k + lo).expand_as(off)[live]), tag
    assert (size <= (hi - lo)).all() and (size.sum(-1) <= pre).all(), tag
    want = torch.minimum(hi - lo, torch.full_like(hi, pre // bn // 16 * 16)).expand_as(size)
    assert torch.equal(size, torch.where(rows < n, want, 0)), tag


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", range(6))
def test_run_prefetch_pieces_cover_the_run(dev, case, fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed + 100 + case)
    nt = (32, 128)[case % 2]
    rpp = (1, 2, 8, 32)[case % 4]
    n = int(torch.randint(1, 200, (1,), generator=g))
    row_bytes = 16 * int(torch.randint(1, 700, (1,), generator=g))
    pre = 16 * int(torch.randint(0, 3000, (1,), generator=g)) if case else 1 << 30
    grid = -(-n // rpp)
    off = torch.full((grid * nt,), -1, dtype=torch.int64, device=dev)
    size = torch.full((grid * nt,), -1, dtype=torch.int32, device=dev)
    _run_ranges_probe[(grid,)](off, size, n, row_bytes, rpp, pre, NT=nt)
    off, size = off.cpu().view(grid, nt), size.cpu().view(grid, nt)
    tag = f"seed {fresh_seed + 100 + case}: n {n} row_bytes {row_bytes} rpp {rpp} nt {nt} pre {pre}"
    _check_ranges(off, size, n * row_bytes, tag)
    for p in range(grid):
        start, run = p * rpp * row_bytes, min(rpp, n - p * rpp) * row_bytes
        want = min(run, pre)
        live = size[p] > 0
        got = sorted(zip(off[p][live].tolist(), size[p][live].tolist()))
        # the pieces tile [start, start + want) without gaps or overlaps
        at = start
        for o, s in got:
            assert o == at, tag
            at += s
        assert at == start + want, tag
