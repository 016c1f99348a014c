"""The Ascend backend: torch_npu fused ops where they fit the model's shapes, and the portable
Triton kernels (`npu_ops/triton`, compiled by triton-ascend) elsewhere.

UNVERIFIED ON HARDWARE: written against torch_npu's documented API (`torch_npu.npu_rms_norm(x,
gamma, epsilon) -> (y, rstd)`) and triton-ascend; the Triton kernels are checked under
triton-ascend's front end in CI (the `triton_ascend` nox session), but no NPU has run them.

Importing this module is cheap; `load` (called by the registry on the first NPU tensor or with
`DSV41_BACKEND=ascend`) imports torch_npu and triton lazily. Without torch_npu the registry
records "torch_npu not importable: <reason>" and every op falls back to the reference.
"""

from __future__ import annotations

import torch

from .platform import npu_unavailable_reason, triton_unavailable_reason
from .registry import register, register_backend_loader

BACKEND = "ascend"


def npu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm through torch_npu's fused kernel; gamma must share x's dtype (fp32 math inside)."""
    import torch_npu

    return torch_npu.npu_rms_norm(x, weight.to(x.dtype), epsilon=eps)[0]


def load() -> None:
    why = npu_unavailable_reason()
    if why:
        raise RuntimeError(why)
    register("rms_norm", BACKEND)(npu_rms_norm)
    if triton_unavailable_reason() is None:  # triton-ascend provides the `triton` module
        from .cuda import register_triton_kernels

        register_triton_kernels(BACKEND)


register_backend_loader(BACKEND, load)
