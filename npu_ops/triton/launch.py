"""Launch helpers shared by the Triton kernels in this folder (imports triton lazily)."""

from __future__ import annotations

import os

import torch

INTERPRETER_WORKERS = 4  # programs per launch under TRITON_INTERPRET=1 (keeps CPU runs fast)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def num_workers(device: torch.device | str | None = None, cores: str = "vector") -> int:
    """Program count for a 1-D persistent launch: the device platform's worker count (SMs on
    CUDA; on Ascend vector cores, or AI (cube) cores for `cores="cube"` -- kernels using `tl.dot`
    run one program per AI core, as triton-ascend's migration guide says), or a small constant
    under the interpreter."""
    if cores not in ("vector", "cube"):
        raise ValueError(f"cores must be 'vector' or 'cube', got {cores!r}")
    if interpreting():
        return INTERPRETER_WORKERS
    dev = torch.device(device if device is not None else "cuda")
    key = (dev.type, dev.index, cores)
    n = _WORKERS.get(key)
    if n is None:  # a device property query per launch is measurable next to a small kernel
        from ...backends.platform import platform_for

        plat = platform_for(dev)
        n = _WORKERS[key] = plat.cube_workers() if cores == "cube" else plat.num_workers()
    return n


_WORKERS: dict[tuple[str, int | None, str], int] = {}


# Resident programs per worker for a persistent launch. On CUDA one program per SM leaves too
# few loads in flight to approach HBM bandwidth (measured on the H200: a memory-bound kernel at
# 3% of copy bandwidth with one program per SM); several resident programs per SM hide memory
# latency. Ascend binds one program to one core, so there it stays 1.
PROGRAMS_PER_WORKER = {"cuda": 8}


def grid_for(n_tiles: int, device: torch.device | str | None = None, cores: str = "vector") -> int:
    kind = torch.device(device).type if device is not None and not isinstance(device, str) else \
        (device.split(":")[0] if device else "cuda")
    per = 1 if interpreting() else PROGRAMS_PER_WORKER.get(kind, 1)
    return max(1, min(n_tiles, num_workers(device, cores) * per))


def needs_int64(*tensors: torch.Tensor) -> bool:
    """Whether element offsets into any of these tensors (row-strided views included) can pass
    2^31 - 1. Kernels index in
    int32 otherwise: triton-ascend's performance guide says int64 vector index arithmetic falls
    back to scalar code (a constexpr flag picks the width at compile time)."""
    # the largest offset a (possibly row-strided) tensor spans, not its element count
    return any(t.numel() and sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) >= 2**31 - 1
               for t in tensors if t is not None)


def as_int8(t: torch.Tensor) -> torch.Tensor:
    """A byte tensor (uint8 / float8 / int8) viewed as int8: triton-ascend marks uint8 pointer
    loads / stores unsupported on Atlas A2/A3, so byte data crosses the kernel boundary as int8
    (loads are masked back to 0..255 with `& 0xFF`; stores go through `byte_to_int8`)."""
    return t.view(torch.int8)


# Ascend's unified buffer per AI core (Atlas A2 / A3), and the share one program's live tiles may
# take when the compiler double-buffers its loads.
UB_BYTES = 192 * 1024
UB_BUDGET = UB_BYTES // 2


def ub_estimate(tiles: dict[str, tuple[int, ...]], bytes_per_element: int = 4) -> int:
    """Bytes of one program's live tiles at its peak: `tiles` names each live tile's shape (held
    as 32-bit values: the kernels compute in fp32 / int32 right after loading)."""
    total = 0
    for shape in tiles.values():
        n = 1
        for d in shape:
            n *= d
        total += n * bytes_per_element
    return total


_COUNTERS: dict[tuple, torch.Tensor] = {}


def tile_counters(device: torch.device, n: int, purpose: str = "tiles") -> torch.Tensor:
    """Zeroed int32 per-tile counters for "the last program of a tile finishes it" launches on this
    device and stream (each kernel that bumps a counter resets it to 0, so the buffer stays zero
    between calls: no memset per call, and kernels on one stream can share it). `purpose` names a
    buffer of its own for counts that live from one launch into the next (the indexer's bound
    histogram: written by the scores kernel, read and zeroed by the select), which a kernel
    launched in between must not share. Keyed by the
    platform's stream (`Platform.stream_key`), so kernels running at once on two streams (the
    shared expert on the aux stream beside the routed experts) never share counters. Made on a
    stream's first eager call; never inside a graph capture, where the zero fill would only be
    recorded (the graph's first replay, and any other graph or eager call using the buffer
    before it, would count from whatever the memory held): graphs warm up on their capture
    stream first (`Platform.on_capture_stream`)."""
    plat = _platform(device)
    key = (device.type, device.index, plat.stream_key(), purpose)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if plat.is_capturing():  # (asked only when allocating)
            raise RuntimeError(f"tile_counters: no zeroed counters ({n}) for this stream before the graph capture; "
                               "run the captured work once eagerly on the capture stream first")
        if buf is not None:  # graphs captured before may count in it: never freed (`_OUTGROWN`)
            _OUTGROWN.append(buf)
        buf = _COUNTERS[key] = torch.zeros(max(n, 4096, 2 * (buf.numel() if buf is not None else 0)),
                                           dtype=torch.int32, device=device)
    return buf


# counter buffers `tile_counters` outgrew: graphs captured before the growth use them by address,
# so they live as long as the process
_OUTGROWN: list[torch.Tensor] = []


def _platform(device: torch.device):
    """The device's platform, made once (a lookup per kernel launch must stay cheap)."""
    key = (device.type, device.index)
    plat = _PLATFORMS.get(key)
    if plat is None:
        from ...backends.platform import platform_for

        plat = _PLATFORMS[key] = platform_for(device)
    return plat


_PLATFORMS: dict[tuple, object] = {}
