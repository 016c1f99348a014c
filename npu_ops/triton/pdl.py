"""Programmatic dependent launch (PDL, CUDA compute capability >= 9): a kernel may be scheduled
before the kernel ahead of it in the stream has finished, and waits on the device until it has.
On by default in the "chain" mode (measured below).

A decode step is a chain of about 190 launches at batch 1 (mini preset), most of a few
microseconds; in a captured graph each dependent launch leaves about a microsecond of idle SMs
between kernels. Each kernel here starts with `pdl_start(PDL)`, which under PDL waits
(`gdc_wait`) until the kernel ahead has finished and its writes are visible: nothing is read or
written before it, so the memory effects keep the plain stream order and only the launch and
scheduling overlap. Three modes (`DSV41_PDL`, or `set_pdl`):
- "wait" (PDL=1): the next kernel is scheduled when every program of this one has exited;
- "trigger" (PDL=2): each program first calls `gdc_launch_dependents`, so the next kernel is
  scheduled as soon as every program of this one has started (its programs then sit in their
  wait). Each of those then triggers at once, so a whole chain of later kernels can be scheduled
  ahead and hold SM slots while they wait;
- "chain" (PDL=3): each program triggers right after its wait, so at most the next kernel is
  scheduled ahead of the one running.
Safe in every mode: a kernel's wait covers the whole of the kernel ahead, whatever its trigger.

Measured (H200, 2026-12-03 09:31-09:35 UTC, `benchmarks/e2e.py --pdl`, mini, 4K context, graph
replay; the logits bit-identical in all four modes): batch 1 off 1.794 ms, "wait" 1.693 (-5.7%),
"trigger" 1.861 (+3.7%), "chain" 1.684 (-6.2%); batch 8 2.757 / 2.642 / 2.798 / 2.639 ms. The
early trigger loses (a run of later kernels parked on the SMs, holding their slots); "chain" is
the default where PDL applies (`DSV41_PDL=off` turns it off).

Weight prefetch (`DSV41_PDL_PREFETCH=MiB`, default 0 = off; written 2026-12-07, not yet run on a
GPU): a kernel that streams a weight may start with `pdl_prefetch_rows_start` /
`pdl_prefetch_range_start` instead, which with PDL's PREFETCH_BIT first ask the L2 for its first
weight bytes (`cp.async.bulk.prefetch.L2`, up to its launch's share of the budget) and then wait
as `pdl_start`. Under "chain" the kernel is scheduled while the one ahead runs, so the bytes
stream in during it. Only weights are named (no kernel of a step writes them), and before that
start a kernel computes only its ids and ranges: tests/test_triton_pdl.py checks both rules.
Launches of such kernels ask `pdl_prefetch_launch(t, programs)` for their keywords and share.

Host side: `pdl_launch(t)` gives the launch arguments, `{"PDL": mode, "launch_pdl": True}` where
PDL is on and applies (a CUDA tensor on a device of capability >= 9, Triton with `gdc_wait`,
not the interpreter), else `{}` (the kernels' `PDL` defaults to 0: the interpreters,
triton-ascend and older GPUs never see the CUDA-only calls, which sit in constexpr-false
branches). A kernel launched with `launch_pdl` must call `pdl_start(PDL)` first:
tests/test_triton_pdl.py checks that every kernel taking `PDL` does and every launch of one asks
`pdl_launch`. `benchmarks/pdl_probe.py` times chains of dependent launches under each mode.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .launch import interpreting

try:  # CUDA builds of Triton: tl.extra.cuda.gdc_* (pdl_start's constexpr-true branches only)
    from triton.language.extra import cuda as _tl_cuda
except ImportError:
    _tl_cuda = None
_HAS_GDC = hasattr(_tl_cuda, "gdc_wait") and hasattr(_tl_cuda, "gdc_launch_dependents")


# PDL's bit for the weight prefetch ahead of the wait (`pdl_prefetch_rows_start`, `pdl_prefetch_launch`)
PREFETCH_BIT = tl.constexpr(4)


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """First statement of a kernel launched with `pdl_launch`: under "trigger" let the next kernel
    be scheduled, then (every mode) wait for the one ahead, its writes visible, before touching
    memory; under "chain" let the next kernel be scheduled only after that wait. (PDL's bit
    PREFETCH_BIT is the weight prefetch's, `pdl_prefetch_rows_start`; the mode is the low two bits.)"""
    if PDL % 4 == 2:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL % 4 >= 1:
        tl.extra.cuda.gdc_wait()
    if PDL % 4 == 3:
        tl.extra.cuda.gdc_launch_dependents()


# One L2 prefetch of nbytes ($2, a multiple of 16; 0: none) from the 16-byte aligned address $1
# (the bulk-copy unit's prefetch, sm_90: the request returns at once, the lines arrive in the L2).
_PREFETCH_L2_ASM = tl.constexpr("""{
.reg .pred p;
setp.gt.s32 p, $2, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.u32 $0, 0;
}""")


@triton.jit
def _prefetch_l2(ptrs, nbytes):
    """One L2 prefetch per element: [ptrs, ptrs + nbytes) (16-byte aligned, nbytes a multiple of
    16; 0: none)."""
    tl.inline_asm_elementwise(_PREFETCH_L2_ASM, "=r,l,r", [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_row_ranges(rows, ok, row_bytes, lo, hi, pre_bytes, R: tl.constexpr):
    """Byte offsets [R] (int64) and sizes [R] of bytes lo .. hi of the rows `rows` [R] (int64;
    size 0 where not ok) of a matrix of row stride row_bytes, at most pre_bytes in all
    (pre_bytes / R a row, whole 16-byte units)."""
    per_row = pre_bytes // R // 16 * 16
    return rows * row_bytes + lo, tl.where(ok, tl.minimum(hi - lo, per_row), 0)


@triton.jit
def prefetch_range_pieces(offset, nbytes, NT: tl.constexpr):
    """Byte offsets [NT] and sizes [NT] of the range offset .. offset + nbytes (nbytes a multiple
    of 16) cut into NT pieces of whole 16-byte units (the last ones may be empty)."""
    seg = (nbytes // 16 + NT - 1) // NT * 16
    off = tl.arange(0, NT) * seg
    return offset + off, tl.maximum(tl.minimum(seg, nbytes - off), 0)


@triton.jit
def pdl_prefetch_rows_start(PDL: tl.constexpr, w_ptr, rows, ok, row_bytes, lo, hi, pre_bytes, R: tl.constexpr):
    """`pdl_start` for a kernel that streams a weight in tiles: with PDL's PREFETCH_BIT first ask
    the L2 for bytes lo .. hi of its rows `rows` [R] (int64, where ok) of the weight at w_ptr
    (row stride row_bytes; all multiples of 16), at most pre_bytes in all
    (`prefetch_row_ranges`), then wait as `pdl_start`. Under "chain" a kernel is scheduled while
    the one ahead still runs, so its first weight bytes stream in during that kernel instead of
    after it. Only memory no kernel of a step writes (weights) may be named: the prefetch runs
    before the wait for the kernel ahead. (CUDA sm_90 only: PDL is 0 elsewhere, and nothing here
    is computed without the bit.)"""
    if PDL >= PREFETCH_BIT:
        off, n = prefetch_row_ranges(rows, ok, row_bytes, lo, hi, pre_bytes, R)
        _prefetch_l2(w_ptr.to(tl.pointer_type(tl.int8), bitcast=True) + off, n)
    pdl_start(PDL)


@triton.jit
def pdl_prefetch_range_start(PDL: tl.constexpr, w_ptr, offset, nbytes, NT: tl.constexpr):
    """`pdl_prefetch_rows_start` for one contiguous range of a weight: bytes offset .. offset +
    nbytes from w_ptr (16-byte aligned, a multiple of 16), asked for as NT pieces
    (`prefetch_range_pieces`)."""
    if PDL >= PREFETCH_BIT:
        off, n = prefetch_range_pieces(offset, nbytes, NT)
        _prefetch_l2(w_ptr.to(tl.pointer_type(tl.int8), bitcast=True) + off, n)
    pdl_start(PDL)


MODES = {"0": 0, "off": 0, "wait": 1, "trigger": 2, "chain": 3}
_NAMES = {0: "off", 1: "wait", 2: "trigger", 3: "chain"}
_BY_DEVICE: dict[int, bool] = {}


def _mode_of(value: str) -> int:
    if value not in MODES:
        raise ValueError(f"DSV41_PDL={value!r}: choose one of {sorted(MODES)}")
    return MODES[value]


DEFAULT = "chain"
_mode = _mode_of(os.environ.get("DSV41_PDL", DEFAULT))


def set_pdl(mode: str | None) -> None:
    """PDL mode for later launches: "off", "wait", "trigger" or "chain" (None: `DSV41_PDL` again, default
    DEFAULT). Graphs captured before keep their launches."""
    global _mode
    _mode = _mode_of(os.environ.get("DSV41_PDL", DEFAULT) if mode is None else mode)


def pdl_mode() -> str:
    return _NAMES[_mode]


def _supported(index: int) -> bool:
    ok = _BY_DEVICE.get(index)
    if ok is None:
        ok = _BY_DEVICE[index] = _HAS_GDC and torch.cuda.get_device_capability(index)[0] >= 9
    return ok


_LAUNCH = {m: {"PDL": m, "launch_pdl": True} for m in _NAMES if m}
_PREFETCH_LAUNCH = {m: {"PDL": m | PREFETCH_BIT.value, "launch_pdl": True} for m in _NAMES if m}
_OFF: dict = {}


def pdl_launch(t: torch.Tensor) -> dict:
    """Keyword arguments for a launch of a `pdl_start` kernel on t's device (see the module)."""
    if not _mode or t.device.type != "cuda" or interpreting():
        return _OFF
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _LAUNCH[_mode] if _supported(index) else _OFF


# The weight bytes a kernel's programs ask the L2 for before their wait, in all (a kernel's
# share per program is this over its programs): MiB from DSV41_PDL_PREFETCH, 0 = no prefetch.
# Off by default: written 2026-12-07 and not yet run on a GPU (benchmarks/e2e.py --prefetch
# compares budgets; a budget up to about half the H100 / H200's 50 MB L2 keeps the prefetched
# bytes from pushing each other out before use).
PREFETCH_MIB_DEFAULT = 0
_prefetch_mib = None


def set_pdl_prefetch(mib: int | None) -> None:
    """The prefetch budget in MiB for later launches (None: DSV41_PDL_PREFETCH again, default
    PREFETCH_MIB_DEFAULT; 0: off). Graphs captured before keep their launches."""
    global _prefetch_mib
    if mib is None:
        raw = os.environ.get("DSV41_PDL_PREFETCH", str(PREFETCH_MIB_DEFAULT)).strip()
        try:
            mib = int(raw)
        except ValueError:
            raise ValueError(f"DSV41_PDL_PREFETCH={raw!r}: give the prefetch budget in MiB (0: off)") from None
    if mib < 0:
        raise ValueError(f"the PDL prefetch budget must be >= 0 MiB, got {mib}")
    _prefetch_mib = mib


def pdl_prefetch_launch(t: torch.Tensor, programs: int, *, aligned: bool = True) -> tuple[dict, int]:
    """(launch keywords, bytes per program) for a launch of `programs` programs of a prefetching
    kernel (`pdl_prefetch_rows_start` / `pdl_prefetch_range_start`) on t's device: `pdl_launch`'s
    keywords with PREFETCH_BIT where PDL applies and the budget is on, and each program's share of
    the budget (a multiple of 16; 0: no prefetch).
    `aligned`: the weight's rows are whole 16-byte units (else no prefetch: the bulk prefetch
    needs 16-byte aligned ranges)."""
    kw = pdl_launch(t)
    if _prefetch_mib is None:
        set_pdl_prefetch(None)
    if not kw or not _prefetch_mib or not aligned:
        return kw, 0
    share = (_prefetch_mib << 20) // max(1, programs) // 16 * 16
    return (_PREFETCH_LAUNCH[kw["PDL"]], share) if share else (kw, 0)
