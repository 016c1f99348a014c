"""Per-backend device facts behind one interface, so callers need no `if cuda / if npu` branches.

`platform_for(device)` returns a `Platform`: device kind, worker count for persistent kernels
(SM count on CUDA; vector-core and AI-core counts on Ascend, read at run time), streams and
events, the graph-capture class (`torch.cuda.CUDAGraph` / `torch.npu.NPUGraph`), pinned host
allocation and synchronize. The CPU platform implements streams and graphs as no-ops.

torch_npu is imported lazily, only by the Ascend platform; `import dsv41` never touches it.
The Ascend platform is written against torch_npu's documented API and is unverified on
hardware (no NPU was available to this project yet).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

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


class _NoStream:
    """CPU stand-in for a device stream: work runs in order on the calling thread."""

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _NoEvent:
    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _NoGraph:
    """CPU stand-in for a captured graph: `replay` must re-run the captured callable, so the
    CPU graph runner keeps the callable and this class only marks the capture region."""

    def replay(self) -> None:
        raise RuntimeError("CPU has no graph capture; the graph runner runs eagerly on CPU")


@dataclass
class Platform:
    """What a backend's device offers; `kind` is 'cpu', 'cuda' or 'npu'."""

    kind: str
    device: torch.device

    @property
    def backend(self) -> str:
        return {"cpu": "reference", "cuda": "cuda", "npu": "ascend"}[self.kind]

    def num_workers(self) -> int:
        """Programs for a persistent kernel: SMs, vector cores, or 1 on CPU."""
        return 1

    def cube_workers(self) -> int:
        """Programs for a matmul-heavy (cube) kernel; equal to num_workers outside Ascend."""
        return self.num_workers()

    def stream(self):
        return _NoStream()

    def current_stream(self):
        return _NoStream()

    def use_stream(self, stream):
        return contextlib.nullcontext()

    def event(self):
        return _NoEvent()

    def graph_class(self):
        return None

    def graph_capture(self, graph, pool=None):
        """Context manager capturing the work issued inside it into `graph`."""
        raise RuntimeError("this device has no graph capture")

    def graph_pool(self):
        """A memory pool handle the graphs of one runner share (None where there is none)."""
        return None

    def pinned_empty(self, shape, dtype) -> torch.Tensor:
        """Host memory the device can read directly (page-locked where a device exists)."""
        return torch.empty(shape, dtype=dtype)

    def synchronize(self) -> None:
        pass

    def is_capturing(self) -> bool:
        """Whether the current stream is capturing a graph (host waits are not allowed then)."""
        return False


class CudaPlatform(Platform):
    def num_workers(self) -> int:
        return torch.cuda.get_device_properties(self.device).multi_processor_count

    def stream(self):
        return torch.cuda.Stream(self.device)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def use_stream(self, stream):
        return torch.cuda.stream(stream)

    def event(self):
        return torch.cuda.Event()

    def graph_class(self):
        return torch.cuda.CUDAGraph

    def graph_capture(self, graph, pool=None):
        return torch.cuda.graph(graph, pool=pool)

    def graph_pool(self):
        return torch.cuda.graph_pool_handle()

    def pinned_empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def is_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()


class AscendPlatform(Platform):
    """torch_npu's device API (unverified on hardware). Vector-core and AI-core counts come from
    the device properties at run time; Atlas A2 parts have 20-24 AI cores with 2 vector cores
    each, which is what the fallback assumes when a property is missing."""

    def _props(self):
        return torch.npu.get_device_properties(self.device)  # type: ignore[attr-defined]

    def num_workers(self) -> int:
        props = self._props()
        for name in ("vector_core_num", "num_vector_cores"):
            if hasattr(props, name):
                return int(getattr(props, name))
        try:  # triton-ascend's driver reports the core counts too
            import triton

            info = triton.runtime.driver.active.utils.get_device_properties(self.device.index or 0)
            if info.get("num_vectorcore"):
                return int(info["num_vectorcore"])
        except Exception:  # noqa: BLE001  (no triton-ascend: fall back to the A2 layout)
            pass
        return 2 * self.cube_workers()

    def cube_workers(self) -> int:
        props = self._props()
        for name in ("cube_core_num", "ai_core_num", "multi_processor_count"):
            if hasattr(props, name):
                return int(getattr(props, name))
        return 24

    def stream(self):
        return torch.npu.Stream(self.device)  # type: ignore[attr-defined]

    def current_stream(self):
        return torch.npu.current_stream(self.device)  # type: ignore[attr-defined]

    def use_stream(self, stream):
        return torch.npu.stream(stream)  # type: ignore[attr-defined]

    def event(self):
        return torch.npu.Event()  # type: ignore[attr-defined]

    def graph_class(self):
        return torch.npu.NPUGraph  # type: ignore[attr-defined]

    def graph_capture(self, graph, pool=None):
        return torch.npu.graph(graph, pool=pool)  # type: ignore[attr-defined]

    def graph_pool(self):
        return torch.npu.graph_pool_handle()  # type: ignore[attr-defined]

    def pinned_empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def synchronize(self) -> None:
        torch.npu.synchronize(self.device)  # type: ignore[attr-defined]

    def is_capturing(self) -> bool:
        return bool(torch.npu.is_current_stream_capturing())  # type: ignore[attr-defined]


def platform_for(device: torch.device | str) -> Platform:
    """The platform of a device; raises with the reason when its backend is unavailable."""
    kind = device.split(":")[0] if isinstance(device, str) else torch.device(device).type
    if kind == "npu":
        why = npu_unavailable_reason()
        if why:
            raise RuntimeError(f"npu: {why}")
        return AscendPlatform("npu", torch.device(device))
    dev = torch.device(device)
    if dev.type == "cuda":
        why = cuda_unavailable_reason()
        if why:
            raise RuntimeError(f"cuda: {why}")
        return CudaPlatform("cuda", dev)
    return Platform("cpu", dev)
