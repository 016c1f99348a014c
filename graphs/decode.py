"""Decode graphs: the batched decode step captured once per batch-size bucket.

A decode step's `StepBatch` has fixed shapes for a given number of sequences (one token each,
block tables of a fixed width), and the forward reads nothing back to the host, so the whole
step can be captured as one device graph (`torch.cuda.CUDAGraph`, `torch.npu.NPUGraph`, through
the platform) and replayed with new inputs copied into persistent buffers. A batch is padded
to the next bucket; padding rows are position 0 of an empty sequence whose block tables are all
the null block, so everything they write lands in block 0 and nothing reads it.

On CPU there is no graph: the runner runs the same padded static batch eagerly (which is how
its bookkeeping is tested there). Graph capture on CUDA / NPU is unverified on hardware.
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch

from ..backends import ops
from ..backends.platform import host_to_device, platform_for
from ..core.batch import StepBatch
from ..core.cache import KVPool
from ..core.model import Transformer
from .inputs import PackedInputs

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def fill_static(static: StepBatch, batch: StepBatch, platform=None) -> None:
    """Copy `batch` into the persistent buffers of a captured step with at least as many rows
    (and block tables at least as wide): rows past the batch become padding (ids 0, n-gram ids
    -1, null-block tables), table columns past the batch's point at the null block. `seq`
    stays as captured (row i is sequence i in both). Host fields reach the device without a
    host wait (`host_to_device`)."""
    n = batch.num_tokens
    platform = platform or platform_for(static.ids.device)
    for f in fields(StepBatch):
        dst, src = getattr(static, f.name), getattr(batch, f.name)
        if f.name == "ngram_host":  # host copies of the n-grams (Engram rows fetched ahead)
            if dst is None:
                continue
            ids, img = src if src is not None else (batch.ngram_ids.cpu(), batch.ngram_image.cpu())
            for d, s, pad in ((dst[0], ids, -1), (dst[1], img, False)):
                d[n:].fill_(pad)
                d[:n].copy_(s)
            continue
        if f.name.endswith("_tables"):  # one table per group: columns past the batch's -> null block
            for d, s in zip(dst, src):
                d[n:].fill_(0)
                d[:n, s.shape[1]:].fill_(0)
                host_to_device(d[:n, :s.shape[1]], s, platform)
            continue
        if isinstance(dst, tuple):  # the draft window's (lo, hi)
            for d, s in zip(dst, src):
                host_to_device(d, s, platform)
            continue
        if not isinstance(dst, torch.Tensor) or f.name == "seq":
            continue
        dst[n:].fill_(-1 if f.name == "ngram_ids" else 0)
        host_to_device(dst[:n], src, platform)


class DecodeGraphs:
    """Captured decode steps of `model` over the fixed pools of `pool`, one per bucket up to
    `max_batch` sequences, block tables `table_blocks` wide (enough for the longest sequence)."""

    def __init__(self, model: Transformer, pool: KVPool, max_batch: int, table_blocks: int):
        self.model, self.pool = model, pool
        self.device = model.embed.weight.device
        self.platform = platform_for(self.device)
        self.table_blocks = table_blocks
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.graphs: dict[int, tuple] = {}  # bucket -> (graph or None, packed static inputs, logits)
        self._replayed = None  # event after the last replay (Engram fetch-ahead buffers in use)
        # each row's greedy token and non-finite flag from the last replay (`ops.greedy_pick`,
        # inside the captured step), shared by every bucket: a step's rows can take the step
        # before's tokens as their input ids by row (`run`'s prev_rows, `ops.feed_tokens`)
        self.picked = torch.zeros(self.buckets[-1], 2, dtype=torch.long, device=self.device)

    def _static(self, n: int) -> StepBatch:
        """Persistent input buffers of one bucket, holding padding rows."""
        z = lambda *shape, dt=torch.long: torch.zeros(shape, dtype=dt, device=self.device)  # noqa: E731
        w, ng = self.table_blocks, max(self.model.cfg.engram_max_ngram_size, 1)
        return StepBatch(ids=z(n), positions=z(n), seq=torch.arange(n, device=self.device), swa_tables=(z(n, w),),
                         glob_tables=(z(n, w),), floors=z(n, 3), glob_from=z(n), ngram_ids=z(n, ng) - 1,
                         ngram_image=z(n, ng, dt=torch.bool), is_image=z(n, dt=torch.bool),
                         ngram_host=(torch.full((n, ng), -1, dtype=torch.long), torch.zeros(n, ng, dtype=torch.bool)),
                         rows_are_sequences=True)  # (seq = arange: row i is sequence i)

    def capture(self) -> None:
        """Warm up and capture every bucket (largest first, sharing one memory pool)."""
        graph_class = self.platform.graph_class()
        mem = self.platform.graph_pool() if graph_class is not None else None
        for n in sorted(self.buckets, reverse=True):
            inputs = PackedInputs(self._static(n), self.platform)
            batch = inputs.static
            with self.platform.on_capture_stream():  # warm-up: allocations, per-stream state
                logits = self._step(batch)
            graph = None
            if graph_class is not None:
                self.platform.synchronize()
                graph = graph_class()
                with self.platform.graph_capture(graph, mem):
                    logits = self._step(batch)
            self.graphs[n] = (graph, inputs, logits)

    def _step(self, batch: StepBatch) -> torch.Tensor:
        """What a replay runs: the rows' device-fed input ids put in place, the forward, each
        row's greedy token and finiteness into `picked` (the step's argmax and its check with
        no launches after the replay)."""
        ops.feed_tokens(batch.ids, batch.ngram_ids, self.picked)
        logits = self.model(batch, self.pool, check=False)
        ops.greedy_pick(logits, self.picked[:logits.shape[0]])
        return logits

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def run(self, batch: StepBatch, prev_rows: list[int] | None = None) -> torch.Tensor:
        """Logits [n, V] of a decode batch (one token per sequence, no CED rows, no images),
        by replaying the smallest bucket that holds it; each row's greedy token and non-finite
        flag are in `picked[:n]` after it. `prev_rows`: row i's input token is row prev_rows[i]
        of the replay before's `picked` (its tokens, on the device, not yet read back; the
        sampler may have patched them), in place of `batch.ids` and of the n-grams' current
        token; not with Engram rows fetched ahead on the host."""
        n = batch.num_tokens
        b = self.bucket(n)
        if b is None or batch.decoder_rows is not None or batch.logit_rows is not None or batch.image_embeds is not None:
            raise ValueError(f"not a decode batch the graphs hold ({n} tokens, buckets up to {self.buckets[-1]})")
        tables = (*batch.swa_tables, *batch.glob_tables)
        if len(tables) != 2 or any(t.shape[1] > self.table_blocks for t in tables):
            raise ValueError(f"expected one SWA and one global table at most {self.table_blocks} blocks wide")
        graph, inputs, logits = self.graphs[b]
        static = inputs.static
        prefetch = self.model.engram_prefetch()
        if prev_rows is not None:
            if prefetch is not None and prefetch.layers:
                raise ValueError("device-side input ids need the Engram rows gathered on the device "
                                 "(the fetch-ahead hashes the host's n-grams)")
            if len(prev_rows) != n or not all(0 <= r < len(self.picked) for r in prev_rows):
                raise ValueError(f"prev_rows must name one row of the last replay for each of the {n} rows")
            # -1 - r: `ops.feed_tokens`, first in the step, puts row r's token there and in the
            # n-gram's column 0 (no copies before the replay)
            batch = replace(batch, ids=-1 - torch.as_tensor(prev_rows, dtype=torch.long, device=batch.ids.device))
        inputs.fill(batch)  # (one host-to-device copy)
        if graph is not None and prefetch is not None and prefetch.layers:
            # host-held Engram tables: the graph copies the rows from the fetch-ahead's staging
            # buffers, so the host fills them for this batch (padding rows hash as the pad id)
            if self._replayed is not None:
                self._replayed.synchronize()  # the last replay's copies have read the buffers
            prefetch.gather(*static.ngram_host)
            prefetch.filled = {}  # (the captured copies are the device side)
        if graph is None:
            logits = self._step(static)
        else:
            graph.replay()
            if prefetch is not None:
                self._replayed = self.platform.event()
                self._replayed.record()
        return logits[:n]
