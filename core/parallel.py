"""Model-parallel process groups: the only place the model learns its rank and reaches the others.

The model needs three things from a group: its `rank` and `world_size` (to build the shard
shapes of `dsv41 convert --model-parallel N`), `all_reduce_sum` (row-parallel partial sums,
expert combine, vocabulary-parallel embedding, Engram rows, indexer scores) and `all_gather`
(vocabulary-parallel logits). `SINGLE` is the one-process group whose collectives are no-ops;
`TorchGroup` runs them through `torch.distributed` (gloo on CPU, NCCL on CUDA, HCCL on NPU); a
serving engine (the vLLM plugin) can back the same interface with its own tensor-parallel group.

Exactness: callers hand `all_reduce_sum` unrounded partial sums and round once afterwards. Their
dtype comes from `dsv41.backends.ops.partial_sum_dtype(device)`: fp64 on the CPU reference (an
N-way run reproduces the one-process run up to fp64 rounding), fp32 on CUDA and NPU (HCCL on
Atlas A2/A3 reduces fp32 / bf16 / integers only; the official code rounds to bf16 anyway).
"""

from __future__ import annotations

import os

import torch

# torch.distributed backend per device type (the device of the model's tensors).
DIST_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


class Group:
    """A single process: rank 0 of 1; every collective returns its input unchanged."""

    rank: int = 0
    world_size: int = 1

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise sum of `x` over the ranks (every rank gets the same bits)."""
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenation of every rank's `x` along `dim`, in rank order."""
        return x

    # -- shard arithmetic shared by the model and its loaders --
    def split(self, n: int, what: str = "size") -> int:
        """This rank's part of `n` split evenly (n must divide by the world size)."""
        if n % self.world_size:
            raise ValueError(f"{what} {n} does not divide into {self.world_size} model-parallel ranks")
        return n // self.world_size

    def even_range(self, n: int) -> tuple[int, int]:
        """[lo, hi) of this rank in an even split of n (experts, vocabulary rows)."""
        per = self.split(n)
        return self.rank * per, (self.rank + 1) * per

    def ceil_range(self, n: int) -> tuple[int, int]:
        """[lo, hi) of this rank in pieces of ceil(n / world) (Engram rows; the last piece may be
        shorter or empty), as `dsv41 convert` writes them."""
        c = -(-n // self.world_size)
        return min(n, self.rank * c), min(n, (self.rank + 1) * c)


SINGLE = Group()


class TorchGroup(Group):
    """`torch.distributed` collectives over the default process group (or `pg`)."""

    def __init__(self, pg=None):
        import torch.distributed as dist

        self._dist, self._pg = dist, pg
        self.rank = dist.get_rank(pg)
        self.world_size = dist.get_world_size(pg)

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64 and x.device.type == "npu":
            raise ValueError("an fp64 all-reduce on NPU tensors: HCCL has no fp64 sum; take the partial sums' "
                             "dtype from dsv41.backends.ops.partial_sum_dtype(device) (float32 on the NPU)")
        out = x.contiguous().clone()
        self._dist.all_reduce(out, op=self._dist.ReduceOp.SUM, group=self._pg)
        return out

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self._dist.all_gather(parts, x, group=self._pg)
        return torch.cat(parts, dim=dim)


def launched_distributed() -> bool:
    """True under a launcher that sets RANK and WORLD_SIZE (torchrun) with more than one rank."""
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def local_device(device: torch.device) -> torch.device:
    """The accelerator of this rank (LOCAL_RANK) for cuda / npu; CPU stays CPU."""
    if device.type in ("cuda", "npu") and device.index is None:
        return torch.device(device.type, int(os.environ.get("LOCAL_RANK", "0")))
    return device


def init_distributed(device: torch.device) -> TorchGroup:
    """Join the process group the launcher describes (env:// rendezvous), with the collective
    backend of `device`'s type, and return it as a `TorchGroup`."""
    import torch.distributed as dist

    backend = DIST_BACKENDS.get(device.type)
    if backend is None:
        raise ValueError(f"no model-parallel backend for device type {device.type!r}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type == "npu":
        torch.npu.set_device(device)  # torch.npu exists once torch_npu is imported (the platform does)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return TorchGroup()


def destroy(group: Group) -> None:
    """Leave the process group (no-op for `SINGLE`)."""
    if isinstance(group, TorchGroup) and group._dist.is_initialized():
        group._dist.destroy_process_group()
