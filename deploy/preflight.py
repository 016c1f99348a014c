"""Checks made before slow work: will the weights fit in memory?

`check_memory` estimates the bytes a command is about to allocate from the meta-device model
(exact storage bytes of every checkpoint tensor, this rank's shard under model parallelism;
on the reference backend also its cache of dequantised weights) and compares them with what is free: on CPU the host's available memory (`MemAvailable`, capped
by a cgroup limit when one is set), on an accelerator its free device memory (and host memory
for Engram tables kept there by `--engram-offload`). When the weights cannot fit it raises one
`InsufficientMemory` saying how much is needed and how much is available, instead of a
traceback from an allocation minutes later. `DSV41_SKIP_MEMORY_CHECK=1` skips the check (an
estimate can be wrong, e.g. with swap).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

SKIP_ENV = "DSV41_SKIP_MEMORY_CHECK"
# Headroom on top of the weights: activations and caches of a short run, allocator slack.
HEADROOM_BYTES = 512 << 20
HEADROOM_FRACTION = 0.05


class InsufficientMemory(RuntimeError):
    """The weights of a command do not fit in the memory that is free."""


def _cgroup_free() -> int | None:
    """Bytes left under this process's cgroup memory limit (v2, else v1), None when unlimited."""
    for limit_f, usage_f in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                             ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                              "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_f).read_text().strip()
            usage = int(Path(usage_f).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 1 << 60:  # v1 writes "unlimited" as a huge number
            return None
        return max(0, int(limit) - usage)
    return None


def host_available_bytes() -> int | None:
    """Host memory a new allocation can use: `MemAvailable`, capped by the cgroup limit."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    cg = _cgroup_free()
    if avail is None:
        return cg
    return avail if cg is None else min(avail, cg)


def device_available_bytes(device: torch.device) -> int | None:
    """Free memory of an accelerator (None when it cannot be asked)."""
    try:
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[0]
        if device.type == "npu":
            return torch.npu.mem_get_info(device)[0]  # type: ignore[attr-defined]
    except (RuntimeError, AttributeError):
        return None
    return None


@dataclass
class MemoryNeed:
    """Bytes to allocate on the device and on the host."""

    device: int
    host: int


def weights_need(cfg, device: torch.device, *, with_drafter: bool, engram_offload: bool,
                 random_weights: bool, group=None) -> MemoryNeed:
    """Bytes the weights take where they live, plus host temporaries: for random weights the
    largest tensor other than the Engram tables (drawn in row chunks) as its fp32 draw and its
    converted copy, about 6 bytes per value; for a checkpoint the largest tensor read in and
    the masks of its NaN check."""
    from ..core.model import EngramEmbed, Transformer
    from ..core.parallel import SINGLE

    with torch.device("meta"):
        model = Transformer(cfg, group or SINGLE, with_drafter=with_drafter)
    engram = {f"{n}.{k}" for n, m in model.named_modules() if isinstance(m, EngramEmbed) for k in m.state_dict()}
    dev = host = largest = largest_bytes = 0
    for k, t in model.state_dict().items():
        n = t.numel() * t.element_size()
        largest_bytes = max(largest_bytes, n)
        if k not in engram:
            largest = max(largest, t.numel())
        if k in engram and engram_offload:
            host += n
        else:
            dev += n
    dev += _reference_dequant_bytes(model, device)
    if random_weights:
        host += 6 * largest
    else:  # a checkpoint tensor read into memory, and the NaN check's masks over it
        host += 3 * largest_bytes
    dev += int(dev * HEADROOM_FRACTION) + HEADROOM_BYTES
    if device.type == "cpu":
        return MemoryNeed(0, dev + host)
    return MemoryNeed(dev, host)


def _reference_dequant_bytes(model, device: torch.device) -> int:
    """The reference backend keeps the Linear weights it has used dequantised in its
    accumulation dtype (`backends/reference/basic.dequant_weight`, fp64: 8 bytes per value,
    8x an FP8 weight, 16x a packed FP4 byte), up to its bound (`DSV41_REFERENCE_CACHE_GB`).
    Counted when ops on `device` resolve to the reference (CPU, or DSV41_BACKEND=reference);
    the vision tower runs only with images and is left out."""
    from ..backends.reference.basic import ACCUM_DTYPE, DEQUANT_CACHE_BYTES
    from ..backends.registry import backend_for_device
    from ..core.model import Linear

    if backend_for_device(device) != "reference":
        return 0
    per_value = torch.empty((), dtype=ACCUM_DTYPE).element_size()
    full = per_value * sum(m.out_features * m.in_features for name, m in model.named_modules()
                           if isinstance(m, Linear) and not name.startswith(("vision.", "aligner.")))
    return min(full, DEQUANT_CACHE_BYTES)  # the memo is bounded (least recently used first out)


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def check_memory(cfg, device: torch.device | str, *, with_drafter: bool, engram_offload: bool = False,
                 random_weights: bool, group=None, what: str = "the model") -> MemoryNeed:
    """Raise `InsufficientMemory` when the weights cannot fit (see the module docstring)."""
    device = torch.device(device)
    need = weights_need(cfg, device, with_drafter=with_drafter, engram_offload=engram_offload,
                        random_weights=random_weights, group=group)
    if os.environ.get(SKIP_ENV) == "1":
        return need
    checks = [(need.host, host_available_bytes(), "host memory")]
    if need.device:
        checks.insert(0, (need.device, device_available_bytes(device), f"{device} memory"))
    for n, avail, where in checks:
        if avail is not None and n > avail:
            offload = "" if device.type == "cpu" or engram_offload else "--engram-offload, "
            raise InsufficientMemory(f"{what} needs about {_gb(n)} of {where} but {_gb(avail)} is available "
                                     f"(try a smaller preset, {offload}or a bigger machine; "
                                     f"{SKIP_ENV}=1 skips this check)")
    return need
