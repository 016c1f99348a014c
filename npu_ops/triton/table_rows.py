"""Block-table address arithmetic in one launch (ops `table_rows`, `window_rows`): index j of row t sits at pool
row block_table[t, j // per_block] * per_block + j % per_block; a negative index (and, with
`null_invalid`, one whose block is the null block 0) gives -1. Integer arithmetic only; equal to
the torch version (`backends.paging.table_rows_torch`, the oracle), which launches about ten
small kernels per call (compare, clamps, divide, gather, multiply, remainder, add, fill, select).
`window_rows` forms the window positions (lo[t] + s, masked outside [floor[t], hi[t]]) in the
same launch (the torch version: eight more).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends.paging import table_rows_torch as table_rows_ref  # noqa: F401  (the oracle)
from ...backends.paging import window_rows_torch as window_rows_ref  # noqa: F401  (the oracle)

BLOCK = 1024


@triton.jit
def _rows(tab_ptr, t, j, m, nb, tab_stride, per_block, NULL_INVALID: tl.constexpr):
    """Pool rows of indices j of rows t (-1 where j < 0 or, with NULL_INVALID, in block 0)."""
    ok = j >= 0
    j = tl.maximum(j, 0)
    b = tl.minimum(j // per_block, nb - 1)
    blk = tl.load(tab_ptr + t * tab_stride + b, mask=m, other=0).to(tl.int64)
    if NULL_INVALID:
        ok = ok & (blk != 0)
    return tl.where(ok, tl.maximum(blk, 0) * per_block + j % per_block, -1)


@triton.jit
def _table_rows_kernel(tab_ptr, idx_ptr, out_ptr, n_per_row, nb, tab_stride, per_block, total,
                       NULL_INVALID: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < total
    j = tl.load(idx_ptr + offs, mask=m, other=-1).to(tl.int64)
    tl.store(out_ptr + offs, _rows(tab_ptr, offs // n_per_row, j, m, nb, tab_stride, per_block, NULL_INVALID), mask=m)


@triton.jit
def _window_rows_kernel(tab_ptr, lo_ptr, hi_ptr, floor_ptr, floor_stride, out_ptr, width, nb, tab_stride, per_block,
                        total, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < total
    t = offs // width
    kpos = tl.load(lo_ptr + t, mask=m, other=0).to(tl.int64) + offs % width
    ok = (kpos >= tl.load(floor_ptr + t * floor_stride, mask=m, other=0)) & (kpos <= tl.load(hi_ptr + t, mask=m, other=0))
    j = tl.where(ok, kpos, -1)
    tl.store(out_ptr + offs, _rows(tab_ptr, t, j, m, nb, tab_stride, per_block, True), mask=m)


def table_rows(block_table: torch.Tensor, per_block: int, index: torch.Tensor, *,
               null_invalid: bool = False) -> torch.Tensor:
    """`ops.table_rows`: block_table [T, nb], index [T, ...] -> pool rows [T, ...] long."""
    if block_table.dim() != 2 or index.dim() < 1 or index.shape[0] != block_table.shape[0] or per_block <= 0:
        raise ValueError(f"table_rows: block table {tuple(block_table.shape)} and index {tuple(index.shape)} "
                         f"(per block {per_block}) do not fit together")
    out = torch.empty(index.shape, dtype=torch.long, device=index.device)
    total = index.numel()
    if total == 0:
        return out
    if block_table.shape[1] == 0:
        raise ValueError("table_rows: the block table has no columns")
    tab = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    idx = index.contiguous()
    _table_rows_kernel[(-(-total // BLOCK),)](tab, idx, out, total // index.shape[0], tab.shape[1], tab.stride(0),
                                             per_block, total, NULL_INVALID=bool(null_invalid), BLOCK=BLOCK)
    return out


def window_rows(block_table: torch.Tensor, per_block: int, lo: torch.Tensor, hi: torch.Tensor, floor: torch.Tensor,
                width: int) -> torch.Tensor:
    """`ops.window_rows`: block_table [T, nb], lo / hi / floor [T] -> pool rows [T, width] long."""
    t = lo.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != t or hi.shape != (t,) or floor.shape != (t,) or width < 0 \
            or per_block <= 0:
        raise ValueError(f"window_rows: block table {tuple(block_table.shape)}, lo {tuple(lo.shape)}, hi "
                         f"{tuple(hi.shape)}, floor {tuple(floor.shape)}, width {width} do not fit together")
    out = torch.empty(t, width, dtype=torch.long, device=lo.device)
    total = out.numel()
    if total == 0:
        return out
    if block_table.shape[1] == 0:
        raise ValueError("window_rows: the block table has no columns")
    tab = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    _window_rows_kernel[(-(-total // BLOCK),)](tab, lo.contiguous(), hi.contiguous(), floor, floor.stride(0), out, width,
                                              tab.shape[1], tab.stride(0), per_block, total, BLOCK=BLOCK)
    return out


OPS = {"table_rows": table_rows, "window_rows": window_rows}
