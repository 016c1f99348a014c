"""Shared set-up of the Triton kernel tests: import this before anything imports triton.

Without a CUDA device it sets TRITON_INTERPRET=1 (kernels then run on CPU tensors in Triton's
interpreter); without triton installed (the main CPU test env) the importing module is skipped.
`DEVICES` parametrises a test over the interpreter and the compiled (`gpu`-marked) variant.
"""

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
