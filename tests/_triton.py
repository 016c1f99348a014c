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


def _patch_language_once_per_launch() -> None:
    """Make the interpreter patch `triton.language` once per launch instead of once per call.

    Both interpreters (upstream Triton 3.7, triton-ascend 3.2) re-run `_patch_lang` on every call
    of a nested @triton.jit function: an `inspect.getmembers` walk over the language modules,
    about 2 ms, that finds them already patched by the launch. Measured on the 2-core CI class of
    machine that walk was 13% of tests/test_triton_fused.py and 37% of an `mhc_mix` call (the
    Sinkhorn chain calls `_norm4` 160 times). Within one launch a nested function whose language
    modules the launch already patched is skipped; anything else takes the interpreter's own path.
    Nothing the kernels compute changes: the skipped calls re-patched nothing."""
    from triton.runtime import interpreter

    patch, launch = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if patch is None or launch is None or getattr(patch, "dsv41_once", False):
        return
    tl = triton.language
    active: list[set[int]] = []  # per launch in progress: the language modules it patched

    def langs(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    def patch_lang(fn):
        mods = langs(fn)
        if active and mods <= active[-1]:
            scope = getattr(interpreter, "_LangPatchScope", None)  # 3.7 restores a scope; 3.2 keeps none
            return scope() if scope is not None else None
        out = patch(fn)
        if active:
            active[-1] |= mods
        return out

    def run(self, *args, __run=launch.__call__, **kwargs):
        active.append(set())
        try:
            return __run(self, *args, **kwargs)
        finally:
            active.pop()

    patch_lang.dsv41_once = True
    interpreter._patch_lang = patch_lang
    launch.__call__ = run


if interpreting():
    _patch_language_once_per_launch()

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
