"""A decode step's greedy tokens with its finiteness check in one launch (op `greedy_pick`), and
the next step's device-fed input ids in one launch (op `feed_tokens`).

After every decode step the engine needs each row's argmax (the greedy token, and the next
step's input id in the overlapped loop) and whether the logits are finite (a broken step is an
error, not a token). In torch that is `argmax`, then `isfinite`, `all`, `not`, `long` and a
`cat` for the read-back: six launches outside the captured step, two of them passes over
the logits ([64, 129280] fp32 is 33 MB at batch 64). `_greedy_pick_kernel` reads the logits
once: a row is split over SPLIT programs (enough to fill the SMs at one row), each keeps the
first maximum of its slice and whether it saw a NaN or an infinity, and the program that
finishes its row last (a self-resetting counter, `launch.tile_counters`) takes the first
maximum over the slices in slice order, so the token is `torch.argmax`'s (the first of equal
maxima) whichever program finishes last. NaNs are left out of the maximum, so a broken row's
token is still an id in [0, V).

`feed_tokens` runs first in a captured decode step: rows whose input id is -1 - r take row r
of the previous step's picks (after the sampler patched its drawn rows) as their id and their
n-gram's own token, so the overlapped loop's device-side input ids need no copies before the
replay.

Measured (H100, 2026-12-07): the kernel 3.4 / 4.2 / 13.6 us at 1 / 8 / 64 rows against 53.4 /
48.0 / 115.8 for the torch ops (graph replay; tile notes at BLOCK). Moving the picks and the fed
ids into the captured step took the overlapped engine's step at 4K from 1.93 / 2.96 / 4.45 to
1.86 / 2.87 / 4.36 ms at batch 1 / 8 / 64 (`e2e.py`, processes alternated, the kernel at 4 warps
then; the graph replay, which now includes them, +10 / +0 / +25-65 us); benchmarks/RESULTS.md,
"Session fifty".

CUDA only for now (the Ascend backend runs the reference ops: argmax and the rest in torch;
unverified on hardware). The references are `backends/reference/sampling.py`'s;
tests/test_triton_greedy_pick.py compares under the interpreter and on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends.reference.sampling import feed_tokens as feed_tokens_ref  # noqa: F401  (the oracle)
from ...backends.reference.sampling import greedy_pick as greedy_pick_ref  # noqa: F401  (the oracle)
from .launch import interpreting, num_workers, tile_counters
from .pdl import pdl_launch, pdl_start

# Logits a program loads at once, and its warps (8: 8 fp32 a thread, two 16-byte loads). H100
# 2026-12-07 (`sweep_kernels.py --only greedy_pick`, graph us at 1 / 8 / 64 rows of the 129280-token
# vocabulary; every variant the reference's picks): 4 warps 3.8 / 5.0 / 21.4, 8 warps 3.4 / 4.2 /
# 13.6, BLOCK 4096 (4 warps) 3.5 / 4.4 / 14.2, BLOCK 1024 3.8 / 4.6 / 21.5; 8 slices a row 9.0 /
# 9.3 / 16.6, one slice 52.4 / 52.5 / 80.5; the torch ops the engine ran before 53.4 / 48.0 /
# 115.8 (the read floor at 64 rows: 11.2).
BLOCK = 2048
NUM_WARPS = 8
INTERPRETER_BLOCK = 256
# slices a row: about SM_FILL programs an SM over all rows, at most MAX_SPLIT a row
SM_FILL = 2
MAX_SPLIT = 64


@triton.jit
def _greedy_pick_kernel(lg_ptr, stride, part_v_ptr, part_i_ptr, count_ptr, out_ptr, out_stride, V, span, n_split,
                        BLOCK: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr = 0):
    """Program (row, slice): the first maximum of logits[row, slice] (NaNs left out) and whether
    the slice holds a non-finite value; the row's last program combines the slices in order."""
    pdl_start(PDL)
    row = tl.program_id(0)
    s = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    base = lg_ptr + row.to(tl.int64) * stride
    lo = s * span
    hi = tl.minimum(V, lo + span)
    # per lane over the slice's blocks (reduced once at the end): the lane's first maximum, its
    # column, and whether it saw a non-finite value
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    arg = lo + offs
    bad = tl.zeros((BLOCK,), tl.int32)
    for c in range(lo, hi, BLOCK):
        cols = c + offs
        m = cols < hi
        x = tl.load(base + cols, mask=m, other=float("-inf")).to(tl.float32)
        nan = x != x
        bad = tl.maximum(bad, (m & (nan | (tl.abs(x) == float("inf")))).to(tl.int32))
        take = tl.where(nan, float("-inf"), x) > best  # strictly: a later equal value is not the first
        best = tl.where(take, x, best)
        arg = tl.where(take, cols, arg)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, arg, V), axis=0)  # the first column holding the maximum
    bad = tl.max(bad, axis=0)
    orow = out_ptr + row.to(tl.int64) * out_stride
    if n_split == 1:
        tl.store(orow, first.to(tl.int64))
        tl.store(orow + 1, bad.to(tl.int64))
    else:
        p = row * n_split + s
        tl.store(part_v_ptr + p, top)
        tl.store(part_i_ptr + 2 * p, first)
        tl.store(part_i_ptr + 2 * p + 1, bad)
        tl.debug_barrier()  # every thread's stores are issued before the release below
        done = tl.atomic_add(count_ptr + row, 1, sem="acq_rel")
        if done == n_split - 1:  # the row's last slice: combine every slice in slice order
            sp = tl.arange(0, SPLITS)
            ok = sp < n_split
            q = row * n_split + sp
            v = tl.load(part_v_ptr + q, mask=ok, other=float("-inf"), cache_modifier=".cg")
            i = tl.load(part_i_ptr + 2 * q, mask=ok, other=0, cache_modifier=".cg")
            b = tl.load(part_i_ptr + 2 * q + 1, mask=ok, other=0, cache_modifier=".cg")
            # the first slice holding the maximum (slices in column order)
            tl.store(orow, tl.min(tl.where((v == tl.max(v, axis=0)) & ok, i, V), axis=0).to(tl.int64))
            tl.store(orow + 1, tl.max(b, axis=0).to(tl.int64))
            # the row's counter back to zero for the next call (`tile_counters`): every slice
            # of the row has counted, so nothing else touches it in this launch
            tl.store(count_ptr + row, 0)


@triton.jit
def _feed_tokens_kernel(ids_ptr, ng_ptr, ng_stride, picked_ptr, picked_stride, T, R, BLOCK: tl.constexpr,
                        PDL: tl.constexpr = 0):
    pdl_start(PDL)
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = t < T
    v = tl.load(ids_ptr + t, mask=m, other=0)
    fed = m & (v < 0)
    r = tl.minimum(tl.maximum(-1 - v, 0), R - 1)
    tok = tl.load(picked_ptr + r * picked_stride, mask=fed, other=0)
    tl.store(ids_ptr + t, tok, mask=fed)
    tl.store(ng_ptr + t.to(tl.int64) * ng_stride, tok, mask=fed)


def pick_splits(rows: int, v: int, device, block: int, want: int | None = None) -> tuple[int, int]:
    """(slices a row, logits a slice) for `want` slices a row (default: about SM_FILL programs an
    SM over all rows), each a whole number of blocks."""
    blocks = -(-v // block)
    if want is None:
        want = -(-SM_FILL * num_workers(device) // max(rows, 1))
    span = block * -(-blocks // max(1, min(MAX_SPLIT, blocks, want)))
    return -(-v // span), span


def greedy_pick(logits: torch.Tensor, out: torch.Tensor | None = None, *, splits: int | None = None,
                block: int | None = None, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """`ops.greedy_pick`: logits [R, V] (fp32 or bf16, rows contiguous) -> int64 [R, 2] (into
    `out` when given). `splits` (slices a row; default `pick_splits`), `block`, `num_warps`:
    tests and sweeps."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"greedy_pick: logits must be [rows, vocabulary], got {tuple(logits.shape)}")
    r, v = logits.shape
    dev = logits.device
    if out is None:
        out = torch.empty(r, 2, dtype=torch.long, device=dev)
    elif out.shape != (r, 2) or out.dtype != torch.long or out.stride(1) != 1:
        raise ValueError(f"greedy_pick: out must be int64 [{r}, 2] with contiguous rows, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if r == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block = block or (INTERPRETER_BLOCK if interpreting() else BLOCK)
    n_split, span = pick_splits(r, v, dev, block, splits)
    part_v = torch.empty(r * n_split if n_split > 1 else 1, dtype=torch.float32, device=dev)
    part_i = torch.empty(2 * r * n_split if n_split > 1 else 2, dtype=torch.int32, device=dev)
    counts = tile_counters(dev, r) if n_split > 1 else part_i
    extra = {} if interpreting() else {"num_warps": num_warps}
    _greedy_pick_kernel[(r, n_split)](logits, logits.stride(0), part_v, part_i, counts, out, out.stride(0), v, span,
                                      n_split, BLOCK=block, SPLITS=triton.next_power_of_2(n_split), **extra,
                                      **pdl_launch(logits))
    return out


def feed_tokens(ids: torch.Tensor, ngram_ids: torch.Tensor, picked: torch.Tensor) -> None:
    """`ops.feed_tokens` in one launch."""
    t = ids.shape[0]
    if ids.dim() != 1 or ngram_ids.dim() != 2 or ngram_ids.shape[0] != t or picked.dim() != 2 \
            or picked.shape[1] != 2 or not ids.is_contiguous():
        raise ValueError(f"feed_tokens: ids {tuple(ids.shape)}, n-grams {tuple(ngram_ids.shape)} and picks "
                         f"{tuple(picked.shape)} do not fit together")
    if t == 0 or picked.shape[0] == 0:
        return
    block = min(1024, triton.next_power_of_2(t))
    _feed_tokens_kernel[(-(-t // block),)](ids, ngram_ids, ngram_ids.stride(0), picked, picked.stride(0), t,
                                          picked.shape[0], BLOCK=block, **pdl_launch(ids))


OPS = {"greedy_pick": greedy_pick, "feed_tokens": feed_tokens}
