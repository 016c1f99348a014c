"""The CUDA backend: Triton kernels from `dsv41.npu_ops.triton`, registered on first use.

Importing this module is cheap (no triton): it only hands `load` to the registry, which calls it
the first time an op is dispatched to "cuda" (a CUDA tensor, or `DSV41_BACKEND=cuda`). `load`
imports triton and every kernel module listed in `npu_ops.triton.KERNELS`; each module's
`OPS` dict maps op names to its launchers. When triton is missing the registry records why and
every op falls back to the reference. Under `TRITON_INTERPRET=1` the kernels also run on CPU
tensors (the interpreter tests); without it and without a CUDA device, loading fails on purpose.
"""

from __future__ import annotations

import torch

from .registry import register, register_backend_loader

BACKEND = "cuda"


def register_triton_kernels(backend: str) -> list[str]:
    """Import the portable Triton kernels and register their ops for `backend`."""
    import importlib

    import triton  # noqa: F401  (a missing triton is the usual reason to fall back)

    from ..npu_ops.triton import KERNELS

    names = []
    for mod_name in KERNELS:
        mod = importlib.import_module(f"dsv41.npu_ops.triton.{mod_name}")
        for op, fn in mod.OPS.items():
            register(op, backend)(fn)
            names.append(op)
    return names


def load() -> None:
    from ..npu_ops.triton.launch import interpreting

    if not (torch.cuda.is_available() or interpreting()):
        raise RuntimeError("no CUDA device (set TRITON_INTERPRET=1 to run the Triton kernels on CPU)")
    register_triton_kernels(BACKEND)


register_backend_loader(BACKEND, load)
