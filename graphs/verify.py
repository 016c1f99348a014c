"""Verification graphs: DSpark's verification forward captured once per row count.

A verification step runs the main model over one sequence's last token and its k drafts
(k = 0 .. `dspark_block_size`): k + 1 rows, block tables of a fixed width, every row's logits
and the drafter's target-layer features wanted, then writes the drafter's context KV of every
row (`DSpark.write_context`; the caller keeps the accepted ones, `DSpark.advance`). Like a
decode step it reads nothing back to the host, so each of the block size + 1 row counts is
captured once (`torch.cuda.CUDAGraph`, `torch.npu.NPUGraph`, through the platform) and replayed
with the step's inputs copied into persistent buffers. Without it every verification ran the
model eagerly, tens of times slower than a replayed decode step (README, the draft graph's row).

On CPU there is no graph: the runner runs the same static batch eagerly (which is how its
buffers are tested there). Capture on CUDA / NPU is unverified on hardware.
"""

from __future__ import annotations

import torch

from ..backends.platform import platform_for
from ..core.batch import StepBatch
from ..core.cache import KVPool
from ..core.dspark import DSpark, verify_forward
from ..core.model import Transformer
from .decode import fill_static


class VerifyGraphs:
    """The verification forward of `model` over the fixed pools of `pool`, one capture per row
    count 1 .. `max_rows`, block tables `table_blocks` wide (enough for the longest sequence)."""

    def __init__(self, model: Transformer, pool: KVPool, max_rows: int, table_blocks: int,
                 writer: DSpark | None):
        self.model, self.pool, self.table_blocks = model, pool, table_blocks
        self.device = model.embed.weight.device
        self.platform = platform_for(self.device)
        self.max_rows = max_rows
        self.writer = writer  # the drafter context's writer (`verify_forward`), None without a drafter
        self.graphs: dict[int, tuple] = {}  # rows -> (graph or None, static batch, logits, features)

    def _static(self, t: int) -> StepBatch:
        """Persistent inputs of a t-row verification: one sequence, null-block tables."""
        z = lambda *shape, dt=torch.long: torch.zeros(shape, dtype=dt, device=self.device)  # noqa: E731
        w, ng = self.table_blocks, max(self.model.cfg.engram_max_ngram_size, 1)
        return StepBatch(ids=z(t), positions=torch.arange(t, device=self.device), seq=z(t), swa_tables=(z(1, w),),
                         glob_tables=(z(1, w),), floors=z(1, 3), glob_from=z(1), ngram_ids=z(t, ng) - 1,
                         ngram_image=z(t, ng, dt=torch.bool), is_image=z(t, dt=torch.bool))

    def _step(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """What a replay runs: the eager verification's body (`dspark.verify_forward`)."""
        logits, feats, _ = verify_forward(self.model, self.pool, batch, self.writer)
        return logits, feats

    def capture(self) -> VerifyGraphs:
        """Warm up and capture every row count (largest first, sharing one memory pool); the
        null-block tables take the captures' writes."""
        graph_class = self.platform.graph_class()
        mem = self.platform.graph_pool() if graph_class is not None else None
        for t in range(self.max_rows, 0, -1):
            static = self._static(t)
            with self.platform.on_capture_stream():  # warm-up: allocations, per-stream state
                logits, feats = self._step(static)
            graph = None
            if graph_class is not None:
                self.platform.synchronize()
                graph = graph_class()
                with self.platform.graph_capture(graph, mem):
                    logits, feats = self._step(static)
            self.graphs[t] = (graph, static, logits, feats)
        return self

    def holds(self, batch: StepBatch) -> bool:
        """Whether `batch` is a verification these graphs hold: 1 .. max_rows rows of one
        sequence, every row through the decoder with its logits, no images, tables no wider."""
        tables = (*batch.swa_tables, *batch.glob_tables)
        return (1 <= batch.num_tokens <= self.max_rows and len(tables) == 2 and tables[0].shape[0] == 1
                and all(t.shape[1] <= self.table_blocks for t in tables) and batch.decoder_rows is None
                and batch.logit_rows is None and batch.image_embeds is None and batch.draft_window is None)

    def run(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [t, V], target features [t, n_targets * d]) of a verification batch, by
        replaying its row count's graph. The tensors are the graph's outputs: read them before
        the next replay of the same row count."""
        if not self.holds(batch):
            raise ValueError(f"not a verification the graphs hold ({batch.num_tokens} rows of "
                             f"{batch.swa_tables[0].shape[0]} sequence(s); captured 1..{self.max_rows} rows of one "
                             f"sequence, tables up to {self.table_blocks} blocks, every row's logits)")
        graph, static, logits, feats = self.graphs[batch.num_tokens]
        fill_static(static, batch, self.platform)
        if graph is None:
            return self._step(static)
        graph.replay()
        return logits, feats
