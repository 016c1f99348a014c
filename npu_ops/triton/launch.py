"""Launch helpers shared by the Triton kernels in this folder (imports triton lazily)."""

from __future__ import annotations

import os

import torch

INTERPRETER_WORKERS = 4  # programs per launch under TRITON_INTERPRET=1 (keeps CPU runs fast)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def num_workers(device: torch.device | str | None = None) -> int:
    """Program count for a 1-D persistent launch: the device platform's worker count (SMs on
    CUDA, vector cores on Ascend), or a small constant under the interpreter."""
    if interpreting():
        return INTERPRETER_WORKERS
    dev = torch.device(device if device is not None else "cuda")
    key = (dev.type, dev.index)
    n = _WORKERS.get(key)
    if n is None:  # a device property query per launch is measurable next to a small kernel
        from ...backends.platform import platform_for

        n = _WORKERS[key] = platform_for(dev).num_workers()
    return n


_WORKERS: dict[tuple[str, int | None], int] = {}


# Resident programs per worker for a persistent launch. On CUDA one program per SM leaves too
# few loads in flight to approach HBM bandwidth (measured on the H200: a memory-bound kernel at
# 3% of copy bandwidth with one program per SM); several resident programs per SM hide memory
# latency. Ascend binds one program to one core, so there it stays 1.
PROGRAMS_PER_WORKER = {"cuda": 8}


def grid_for(n_tiles: int, device: torch.device | str | None = None) -> int:
    kind = torch.device(device).type if device is not None and not isinstance(device, str) else \
        (device.split(":")[0] if device else "cuda")
    per = 1 if interpreting() else PROGRAMS_PER_WORKER.get(kind, 1)
    return max(1, min(n_tiles, num_workers(device) * per))
