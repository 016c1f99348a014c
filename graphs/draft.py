"""The DSpark draft block captured as one device graph (greedy drafting).

A draft block always has B = `dspark_block_size` rows of one sequence over block tables of a
fixed width, and with greedy choice (`DSpark.draft_block` with `choose` None: argmax on the
device, each row's Markov input the previous row's draft) it reads nothing back to the host, so
the stages, the head, the sequential Markov head and the confidence head are captured once and
replayed with the block's inputs copied into persistent buffers. Sampled drafting (a host-side
`choose`) stays eager.

On CPU there is no graph: the runner runs the same static batch eagerly (which is how its
buffers are tested there). Capture goes through the platform (`torch.cuda.CUDAGraph`;
`torch.npu.NPUGraph` on Ascend, unverified on hardware).
"""

from __future__ import annotations

import torch

from ..backends.platform import platform_for
from ..core.batch import StepBatch
from ..core.cache import KVPool
from ..core.dspark import DSpark, Draft
from .decode import fill_static


class DraftGraph:
    """The greedy draft block of `drafter` over the fixed pools of `pool`, block tables
    `table_blocks` wide (enough for the longest sequence)."""

    def __init__(self, drafter: DSpark, pool: KVPool, table_blocks: int):
        self.drafter, self.pool, self.table_blocks = drafter, pool, table_blocks
        self.device = drafter.model.embed.weight.device
        self.platform = platform_for(self.device)
        b, w, ng = drafter.block_size, table_blocks, max(drafter.cfg.engram_max_ngram_size, 1)
        z = lambda *shape, dt=torch.long: torch.zeros(shape, dtype=dt, device=self.device)  # noqa: E731
        self.static = StepBatch(ids=z(b), positions=torch.arange(b, device=self.device), seq=z(b),
                                swa_tables=(z(1, w),), glob_tables=(z(1, w),), floors=z(1, 3), glob_from=z(1),
                                ngram_ids=z(b, ng) - 1, ngram_image=z(b, ng, dt=torch.bool), is_image=z(b, dt=torch.bool),
                                draft_window=(z(b), z(b) + b - 1))
        self.graph, self.out = None, None

    def capture(self) -> DraftGraph:
        """Warm up (allocations, autotuning) and capture; padding tables hold only the null
        block, so the capture's writes land there."""
        with self.platform.on_capture_stream():  # (per-stream state made eagerly, as DecodeGraphs)
            self.out = self.drafter.draft_block(self.static, self.pool)
        graph_class = self.platform.graph_class()
        if graph_class is not None:
            self.platform.synchronize()
            self.graph = graph_class()
            with self.platform.graph_capture(self.graph, self.platform.graph_pool()):
                self.out = self.drafter.draft_block(self.static, self.pool)
        return self

    def holds(self, batch: StepBatch) -> bool:
        """Whether `batch` fits the captured buffers (B rows, tables no wider)."""
        return batch.num_tokens == self.drafter.block_size and all(
            t.shape[1] <= self.table_blocks for t in (*batch.swa_tables, *batch.glob_tables))

    def run(self, batch: StepBatch) -> Draft:
        """The greedy draft of a block batch (`DSpark._block_batch`), by replaying the graph."""
        if not self.holds(batch):
            raise ValueError(f"not a draft block the graph holds ({batch.num_tokens} rows, tables of "
                             f"{max(t.shape[1] for t in batch.swa_tables)} blocks; captured {self.drafter.block_size} rows, "
                             f"{self.table_blocks} blocks)")
        fill_static(self.static, batch, self.platform)
        if self.graph is None:
            return self.drafter.draft_block(self.static, self.pool)
        self.graph.replay()
        return Draft(self.out.tokens.clone(), self.out.logits.clone(), self.out.confidence.clone())
