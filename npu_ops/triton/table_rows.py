"""Block-table address arithmetic in one launch (ops `table_rows`, `window_rows`, `compress_rows`):
index j of row t sits at pool
row block_table[t, j // per_block] * per_block + j % per_block; a negative index (and, with
`null_invalid`, one whose block is the null block 0) gives -1. Integer arithmetic only; equal to
the torch version (`backends.paging.table_rows_torch`, the oracle), which launches about ten
small kernels per call (compare, clamps, divide, gather, multiply, remainder, add, fill, select).
`window_rows` forms the window positions (lo[t] + s, masked outside [floor[t], hi[t]]) in the
same launch (the torch version: eight more); `compress_rows` a compressing layer's write mask,
entry slots, entry positions and compressor group rows (the torch version: about twenty).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_start

from ...backends.paging import table_rows_torch as table_rows_ref  # noqa: F401  (the oracle)
from ...backends.paging import compress_rows_torch as compress_rows_ref  # noqa: F401  (the oracle)
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
                       NULL_INVALID: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < total
    j = tl.load(idx_ptr + offs, mask=m, other=-1).to(tl.int64)
    tl.store(out_ptr + offs, _rows(tab_ptr, offs // n_per_row, j, m, nb, tab_stride, per_block, NULL_INVALID), mask=m)


@triton.jit
def _window_rows_kernel(tab_ptr, lo_ptr, hi_ptr, floor_ptr, floor_stride, out_ptr, width, nb, tab_stride, per_block,
                        total, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < total
    t = offs // width
    kpos = tl.load(lo_ptr + t, mask=m, other=0).to(tl.int64) + offs % width
    ok = (kpos >= tl.load(floor_ptr + t * floor_stride, mask=m, other=0)) & (kpos <= tl.load(hi_ptr + t, mask=m, other=0))
    j = tl.where(ok, kpos, -1)
    tl.store(out_ptr + offs, _rows(tab_ptr, t, j, m, nb, tab_stride, per_block, True), mask=m)


@triton.jit
def _compress_rows_kernel(pos_ptr, from_ptr, gtab_ptr, stab_ptr, write_ptr, slots_ptr, epos_ptr, group_ptr, T,
                          g_nb, g_stride, per_entry_block, s_nb, s_stride, swa_block, ratio,
                          RP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = t < T
    p = tl.load(pos_ptr + t, mask=m, other=0).to(tl.int64)
    entry = p // ratio
    entry = entry - ((entry * ratio != p) & (p < 0)).to(tl.int64)  # floor division (// truncates)
    write = ((p + 1) % ratio == 0) & (p >= tl.load(from_ptr + t, mask=m, other=0))
    slot = tl.where(write, _rows(gtab_ptr, t, entry, m, g_nb, g_stride, per_entry_block, False), 0)
    tl.store(write_ptr + t, write.to(tl.int8), mask=m)
    tl.store(slots_ptr + t, slot, mask=m)
    tl.store(epos_ptr + t, entry * ratio, mask=m)
    if RP > 1:  # the group's window rows, oldest first
        i = tl.arange(0, RP)
        gm = m[:, None] & (i[None, :] < ratio)
        j = tl.maximum(p[:, None] - (ratio - 1 - i[None, :]), 0)
        rows = _rows(stab_ptr, t[:, None], j, gm, s_nb, s_stride, swa_block, False)
        tl.store(group_ptr + t[:, None] * ratio + i[None, :], rows, mask=gm)


def compress_rows(pos: torch.Tensor, glob_from: torch.Tensor, glob_table: torch.Tensor, entries_per_block: int,
                  swa_table: torch.Tensor, swa_block: int, ratio: int) -> tuple:
    """`ops.compress_rows` in one launch."""
    t = pos.shape[0]
    if pos.dim() != 1 or glob_from.shape != (t,) or glob_table.dim() != 2 or glob_table.shape[0] != t \
            or swa_table.dim() != 2 or swa_table.shape[0] != t or ratio < 1 or entries_per_block <= 0 or swa_block <= 0:
        raise ValueError(f"compress_rows: positions {tuple(pos.shape)}, tables {tuple(glob_table.shape)} / "
                         f"{tuple(swa_table.shape)}, ratio {ratio} do not fit together")
    dev = pos.device
    write = torch.empty(t, dtype=torch.int8, device=dev)
    slots = torch.empty(t, dtype=torch.long, device=dev)
    epos = torch.empty(t, dtype=torch.long, device=dev)
    group = torch.empty(t * ratio, dtype=torch.long, device=dev) if ratio > 1 else None
    if t:
        if glob_table.shape[1] == 0 or swa_table.shape[1] == 0:
            raise ValueError("compress_rows: a block table has no columns")
        gt = glob_table if glob_table.stride(1) == 1 else glob_table.contiguous()
        st = swa_table if swa_table.stride(1) == 1 else swa_table.contiguous()
        rp = triton.next_power_of_2(ratio) if ratio > 1 else 1
        bt = max(1, min(BLOCK // rp, triton.next_power_of_2(t)))
        _compress_rows_kernel[(-(-t // bt),)](pos.contiguous(), glob_from.contiguous(), gt, st, write, slots, epos,
                                             group if group is not None else slots, t, gt.shape[1], gt.stride(0),
                                             entries_per_block, st.shape[1], st.stride(0), swa_block, ratio,
                                             RP=rp, BLOCK=bt, **pdl_launch(gt))
    return write.view(torch.bool), slots, epos, group


def table_rows(block_table: torch.Tensor, per_block: int, index: torch.Tensor, *,
               null_invalid: bool = False) -> torch.Tensor:
    """`ops.table_rows`: block_table [T, nb], index [T, ...] -> pool rows [T, ...] long."""
    if block_table.dim() != 2 or index.dim() < 1 or index.shape[0] != block_table.shape[0] or per_block <= 0:
        raise ValueError(f"table_rows: block table {tuple(block_table.shape)} and index {tuple(index.shape)} "
                         f"(per block {per_block}) do not fit together")
    idx = index.contiguous()
    return _rows_out("table_rows", block_table, index.shape, index.device, lambda tab, out, total: _table_rows_kernel[
        (-(-total // BLOCK),)](tab, idx, out, total // index.shape[0], tab.shape[1], tab.stride(0), per_block, total,
                               NULL_INVALID=bool(null_invalid), BLOCK=BLOCK, **pdl_launch(tab)))


def _rows_out(op: str, block_table: torch.Tensor, shape, device, launch) -> torch.Tensor:
    """A long tensor of `shape` filled by `launch(table, out, numel)` (not called when empty),
    the table's rows addressed by stride."""
    out = torch.empty(shape, dtype=torch.long, device=device)
    total = out.numel()
    if total:
        if block_table.shape[1] == 0:
            raise ValueError(f"{op}: the block table has no columns")
        launch(block_table if block_table.stride(1) == 1 else block_table.contiguous(), out, total)
    return out


def window_rows(block_table: torch.Tensor, per_block: int, lo: torch.Tensor, hi: torch.Tensor, floor: torch.Tensor,
                width: int) -> torch.Tensor:
    """`ops.window_rows`: block_table [T, nb], lo / hi / floor [T] -> pool rows [T, width] long."""
    t = lo.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != t or hi.shape != (t,) or floor.shape != (t,) or width < 0 \
            or per_block <= 0:
        raise ValueError(f"window_rows: block table {tuple(block_table.shape)}, lo {tuple(lo.shape)}, hi "
                         f"{tuple(hi.shape)}, floor {tuple(floor.shape)}, width {width} do not fit together")
    return _rows_out("window_rows", block_table, (t, width), lo.device, lambda tab, out, total: _window_rows_kernel[
        (-(-total // BLOCK),)](tab, lo.contiguous(), hi.contiguous(), floor, floor.stride(0), out, width, tab.shape[1],
                               tab.stride(0), per_block, total, BLOCK=BLOCK, **pdl_launch(tab)))


OPS = {"table_rows": table_rows, "window_rows": window_rows, "compress_rows": compress_rows}
