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


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """First statement of a kernel launched with `pdl_launch`: under "trigger" let the next kernel
    be scheduled, then (every mode) wait for the one ahead, its writes visible, before touching
    memory; under "chain" let the next kernel be scheduled only after that wait."""
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL >= 1:
        tl.extra.cuda.gdc_wait()
    if PDL == 3:
        tl.extra.cuda.gdc_launch_dependents()


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
_OFF: dict = {}


def pdl_launch(t: torch.Tensor) -> dict:
    """Keyword arguments for a launch of a `pdl_start` kernel on t's device (see the module)."""
    if not _mode or t.device.type != "cuda" or interpreting():
        return _OFF
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _LAUNCH[_mode] if _supported(index) else _OFF
