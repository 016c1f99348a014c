"""Block-table address arithmetic, the one place it is written (the core's pools, the reference
ops and the vLLM plugin all address rows through it).

`table_rows` is op `table_rows` (`backends.ops`): the torch arithmetic below is its
implementation on every backend without a kernel (the reference among them); CUDA does it in one
Triton launch (`npu_ops/triton/table_rows.py`) instead of ten small kernels.
"""

from __future__ import annotations

import torch

from .registry import dispatch, register_composite

NULL_BLOCK = 0  # block 0 of every pool never holds a sequence's data


def table_rows(block_table: torch.Tensor, per_block: int, index: torch.Tensor, *,
               null_invalid: bool = False) -> torch.Tensor:
    """Op `table_rows` on block_table's backend (see `table_rows_torch`)."""
    return dispatch("table_rows", block_table.device)(block_table, per_block, index, null_invalid=null_invalid)


@register_composite("table_rows")
def table_rows_torch(block_table: torch.Tensor, per_block: int, index: torch.Tensor, *,
                     null_invalid: bool = False) -> torch.Tensor:
    """Pool rows of logical indices (token positions of a window pool, entries of a global
    pool): index j of the sequence whose table row is block_table[t] sits at row
    block_table[t, j // per_block] * per_block + j % per_block. block_table [T, nb], index
    [T, ...]; a negative index (and, with `null_invalid`, one whose block is the null block)
    maps to -1."""
    ok = index >= 0
    j = index.clamp_min(0)
    flat = j.reshape(j.shape[0], -1)
    blk = block_table.gather(1, (flat // per_block).clamp_max(block_table.shape[1] - 1)).view_as(j)
    if null_invalid:
        ok = ok & (blk != NULL_BLOCK)
    rows = blk.clamp_min(0) * per_block + j % per_block
    return torch.where(ok, rows, torch.full_like(rows, -1))


def window_rows(block_table: torch.Tensor, per_block: int, lo: torch.Tensor, hi: torch.Tensor, floor: torch.Tensor,
                width: int) -> torch.Tensor:
    """Op `window_rows` on block_table's backend (see `window_rows_torch`)."""
    return dispatch("window_rows", block_table.device)(block_table, per_block, lo, hi, floor, width)


@register_composite("window_rows")
def window_rows_torch(block_table: torch.Tensor, per_block: int, lo: torch.Tensor, hi: torch.Tensor,
                      floor: torch.Tensor, width: int) -> torch.Tensor:
    """Pool rows [T, width] of positions lo[t] .. lo[t] + width - 1 of each row's sequence (its
    table row block_table[t]), oldest first; -1 for a position outside [floor[t], hi[t]] or in
    the null block (a query's sliding window)."""
    kpos = lo.unsqueeze(1) + torch.arange(width, device=lo.device)
    ok = (kpos >= floor.unsqueeze(1)) & (kpos <= hi.unsqueeze(1))
    return table_rows(block_table, per_block, torch.where(ok, kpos, -1), null_invalid=True)


def compress_rows(pos: torch.Tensor, glob_from: torch.Tensor, glob_table: torch.Tensor, entries_per_block: int,
                  swa_table: torch.Tensor, swa_block: int, ratio: int) -> tuple:
    """Op `compress_rows` on pos's backend (see `compress_rows_torch`)."""
    return dispatch("compress_rows", pos.device)(pos, glob_from, glob_table, entries_per_block, swa_table, swa_block,
                                                 ratio)


@register_composite("compress_rows")
def compress_rows_torch(pos: torch.Tensor, glob_from: torch.Tensor, glob_table: torch.Tensor, entries_per_block: int,
                        swa_table: torch.Tensor, swa_block: int, ratio: int) -> tuple:
    """Where a compressing layer's rows go, for rows at positions pos [T] (tables [T, nb]):
    (write [T] bool: the row at p completes entry p // ratio, (p + 1) % ratio == 0, and that
    entry is not held yet, p >= glob_from; slots [T]: the entry's global pool row, 0 (the null
    row) where nothing is written; positions [T] of the entries, (p // ratio) * ratio, where
    their RoPE puts them; group rows [T * ratio]: the window pool rows of positions p - ratio + 1
    .. p (clamped at 0), oldest first, where their compressor rows are kept; None at ratio 1)."""
    entry = torch.div(pos, ratio, rounding_mode="floor")
    write = ((pos + 1) % ratio == 0) & (pos >= glob_from)
    slots = torch.where(write, table_rows(glob_table, entries_per_block, entry.unsqueeze(1))[:, 0], 0)
    group_rows = None
    if ratio > 1:
        group = pos.unsqueeze(1) - torch.arange(ratio - 1, -1, -1, device=pos.device)  # [T, r] oldest first
        group_rows = table_rows(swa_table, swa_block, group.clamp_min(0)).flatten()
    return write, slots, entry * ratio, group_rows


def write_rows(pools: tuple[torch.Tensor, ...], rows: torch.Tensor, values: tuple[torch.Tensor, ...]) -> None:
    """values[i] [T, ...] into pools[i] at pool rows `rows` [T], byte for byte (index_copy has
    no float8 kernels: the bytes go through uint8 views)."""
    for pool, v in zip(pools, values):
        pool.view(torch.uint8).index_copy_(0, rows, v.view(torch.uint8))
