"""Per-backend device facts, imported lazily so `import dsv41` never touches torch_npu or triton."""

from __future__ import annotations

import torch


def cuda_unavailable_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    return None


def npu_unavailable_reason() -> str | None:
    """None when an Ascend NPU is usable through torch_npu, else one sentence saying why not."""
    try:
        import torch_npu  # noqa: F401  (registers the 'npu' device with torch)
    except Exception as e:  # ImportError, or CANN's shared libraries missing (OSError)
        return f"torch_npu not importable: {type(e).__name__}: {e}".strip()
    if not torch.npu.is_available():  # type: ignore[attr-defined]
        return "torch_npu is installed but no NPU is visible"
    return None


def triton_unavailable_reason() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as e:
        return f"triton not importable: {type(e).__name__}: {e}"
    return None
