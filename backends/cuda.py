"""The CUDA backend: Triton kernels from `dsv41.npu_ops.triton`, and torch's CUDA ops where a
library kernel is the right tool, registered on first use.

Importing this module is cheap (no triton): it only hands `load` to the registry, which calls it
the first time an op is dispatched to "cuda" (a CUDA tensor, or `DSV41_BACKEND=cuda`). `load`
imports triton and every kernel module listed in `npu_ops.triton.KERNELS` and `CUDA_KERNELS`;
each module's `OPS` dict maps op names to its launchers. The ops below are torch sequences with
fp32 math (the Sinkhorn and the residual update outside the fused `mhc_mix`; the dequantisers,
which are plain fp32 torch already): with them every op of the forward has a device
implementation and none computes in fp64. When triton is missing the
registry records why and every op falls back to the reference (or raises under DSV41_STRICT=1).
Under `TRITON_INTERPRET=1` the kernels also run on CPU tensors (the interpreter tests); without
it and without a CUDA device, loading fails on purpose.
"""

from __future__ import annotations

import torch

from .reference import quant
from .registry import register, register_backend_loader

BACKEND = "cuda"


def register_triton_kernels(backend: str, names: list[str] | None = None) -> list[str]:
    """Import the Triton kernel modules `names` (default: the portable ones) and register their
    ops for `backend`."""
    import importlib

    import triton  # noqa: F401  (a missing triton is the usual reason to fall back)

    from ..npu_ops.triton import KERNELS

    ops = []
    for mod_name in KERNELS if names is None else names:
        mod = importlib.import_module(f"dsv41.npu_ops.triton.{mod_name}")
        for op, fn in mod.OPS.items():
            register(op, backend)(fn)
            ops.append(op)
    return ops


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The reference's Sinkhorn normalisation in fp32 (its softmax in fp32, not fp64)."""
    c = torch.softmax(logits.float(), dim=-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def mhc_update(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out_j = post[j] * y + sum_i comb[i][j] * x_i in fp32 (TF32 stays off), x's dtype."""
    mixed = torch.bmm(comb.float().transpose(1, 2), x.float())
    return (post.float().unsqueeze(-1) * y.float().unsqueeze(1) + mixed).to(x.dtype)


TORCH_OPS = {"sinkhorn": sinkhorn, "mhc_update": mhc_update,
             "fp4_dequant": quant.fp4_dequant, "mxfp4_dequant": quant.mxfp4_dequant, "fp8_dequant": quant.fp8_dequant}


def load() -> None:
    from ..npu_ops.triton import CUDA_KERNELS
    from ..npu_ops.triton.launch import interpreting

    if not (torch.cuda.is_available() or interpreting()):
        raise RuntimeError("no CUDA device (set TRITON_INTERPRET=1 to run the Triton kernels on CPU)")
    register_triton_kernels(BACKEND)
    register_triton_kernels(BACKEND, CUDA_KERNELS)
    for op, fn in TORCH_OPS.items():
        register(op, BACKEND)(fn)
    from ..npu_ops.triton import batch_invariant

    batch_invariant.register(BACKEND)  # used under DSV41_BATCH_INVARIANT=1


register_backend_loader(BACKEND, load)
