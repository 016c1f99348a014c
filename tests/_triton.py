"""Shared set-up of the Triton kernel tests: import this before anything imports triton.

Without a CUDA device it sets TRITON_INTERPRET=1 (kernels then run on CPU tensors in Triton's
interpreter); without triton installed (the main CPU test env) the importing module is skipped.
`DEVICES` parametrises a test over the interpreter and the compiled (`gpu`-marked) variant.
"""

import importlib
import importlib.metadata
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

triton = pytest.importorskip("triton")

from dsv41.npu_ops.triton.launch import interpreting  # noqa: E402

DEVICES = [
    pytest.param("cpu", id="interp",
                 marks=pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", id="gpu",
                 marks=[pytest.mark.gpu,
                        pytest.mark.skipif(not torch.cuda.is_available() or interpreting(),
                                           reason="needs CUDA and compiled Triton (TRITON_INTERPRET unset)")]),
]


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


# triton-ascend's front end (the `triton_ascend` nox session) vets the portable kernels only; the
# CUDA-only ones (npu_ops.triton.CUDA_KERNELS: fp8 loads, interleave) are skipped there.
ASCEND_TRITON = _installed("triton-ascend")
cuda_only = pytest.mark.skipif(ASCEND_TRITON, reason="CUDA-only kernels; triton-ascend vets the portable ones")


def cuda_only_ops() -> set[str]:
    """Ops implemented by CUDA-only kernel modules or by the CUDA backend's torch sequences."""
    from dsv41.backends.cuda import TORCH_OPS
    from dsv41.npu_ops.triton import CUDA_KERNELS

    ops = set(TORCH_OPS)
    for mod in CUDA_KERNELS:
        ops |= set(importlib.import_module(f"dsv41.npu_ops.triton.{mod}").OPS)
    return ops
