"""DeepSeek-V4.1-Flash text backbone: CED (causal encoder-decoder) + CSA2 + single-pass mHC +
Engram + MoE, written once for every backend.

Every device-specific computation goes through `dsv41.backends.ops`; this file holds the model's
structure and the math that is plain tensor algebra. Weights are held as buffers in their
checkpoint storage formats (FP8 + E8M0 block scales, packed FP4 experts, FP8 Engram rows), under
the checkpoint's native names, so `state_dict()` is a checkpoint.

The forward processes one `StepBatch` (core/batch.py): a flat batch of tokens from many
sequences (prefill chunks, decode tokens, replay spans after prefix-cache hits, verification
blocks, mixed freely), reading and writing the paged pools of `cache.KVPool` in place through the
batch's block tables. Nothing in it asks the host for a value.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from ..backends import ops
from ..backends.paging import table_rows
from ..backends.platform import ENGRAM_LANE, join_mhc_coef, mhc_coef_lane_scope, overlap, platform_for
from .batch import Rows, StepBatch
from .cache import FLOOR_DECODER, FLOOR_DRAFT, FLOOR_ENCODER, KVPool
from .config import ModelConfig, yarn_inv_freq
from .engram import EngramPrefetch, EngramValues, FetchedRows, engram_multipliers, engram_primes
from .parallel import SINGLE, Group

BF16 = torch.bfloat16


# ---- building blocks --------------------------------------------------------------------------

class Linear(nn.Module):
    """A linear layer stored as the checkpoint stores it.

    storage: "fp8" (E4M3 weight + E8M0 scale per 32x32 block; activations FP8-quantised per 32),
    "fp4" (int8 bytes holding two E2M1 values + E8M0 scale per 32 along K), "int8" (W8A8: int8
    weight + one fp32 scale per output channel [N, 1]; activations int8-quantised per token at
    run time, as `dsv41 convert --linear-dtype int8` writes for Atlas A2/A3), "bf16" or "fp32".
    """

    def __init__(self, in_features: int, out_features: int, storage: str):
        super().__init__()
        self.in_features, self.out_features, self.storage = in_features, out_features, storage
        n, k = out_features, in_features
        if storage == "fp8":
            self.register_buffer("weight", torch.empty(n, k, dtype=torch.float8_e4m3fn))
            self.register_buffer("scale", torch.empty(-(-n // 32), -(-k // 32), dtype=torch.float8_e8m0fnu))
        elif storage == "fp4":
            self.register_buffer("weight", torch.empty(n, k // 2, dtype=torch.int8))
            self.register_buffer("scale", torch.empty(n, k // 32, dtype=torch.float8_e8m0fnu))
        elif storage == "int8":
            self.register_buffer("weight", torch.empty(n, k, dtype=torch.int8))
            self.register_buffer("scale", torch.empty(n, 1, dtype=torch.float32))
        else:
            self.register_buffer("weight", torch.empty(n, k, dtype=BF16 if storage == "bf16" else torch.float32))
            self.scale = None

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype = BF16) -> torch.Tensor:
        return ops.linear(x, self.weight, self.scale, out_dtype)


class RMSNorm(nn.Module):
    """RMSNorm with fp32 math (eps is 1e-20 in the text model: fp32 is required)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.empty(dim, dtype=BF16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, R/2] for absolute positions (`ops.rope_tables`: positions reach 1M)."""
    return ops.rope_tables(inv_freq, positions)


def read_counts(parts: list[tuple[str, torch.Tensor]]) -> Counter:
    """(name, 0-d device tensor) pairs summed per name, in one read from the device."""
    out = Counter({name: 0 for name, _ in parts})
    for (name, _), v in zip(parts, torch.stack([t for _, t in parts]).tolist() if parts else []):
        out[name] += v
    return out


@dataclass
class ForwardContext:
    """State shared by the layers of one forward call."""

    cache: KVPool | None = None
    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # index-source layer -> [T, K] entry ids
    pool: torch.Tensor | None = None  # hierarchical candidate pool of the decoder's KV source (block ids)
    # work counts: name -> what `count` was given (reduced and read only by `counts`)
    counters: dict[str, list] = field(default_factory=dict)
    # DSpark: when a dict, the forward stores here the mean over the mHC streams at the input of
    # each `dspark_target_layer_ids` layer ([rows, d], the rows the decoder processed)
    features: dict[int, torch.Tensor] | None = None
    precompressed: set[int] = field(default_factory=set)  # KV sources already fed this step (CED)
    # index-source layer -> (its top-k, table group, entries per block, the pool rows of that
    # top-k): Reuse layers attend the rows their source already addressed
    glob_rows: dict[int, tuple] = field(default_factory=dict)

    def global_rows(self, source: int, idx: torch.Tensor, rows: Rows, g) -> torch.Tensor:
        """Pool rows [T, K] of global pool `g` holding the entries `idx` (the top-k of layer
        `source`), addressed once per step for every layer that attends that top-k."""
        hit = self.glob_rows.get(source)
        if hit is not None and hit[0] is idx and hit[1:3] == (g.table, g.entries_per_block):
            return hit[3]
        out = table_rows(rows.glob_table(g), g.entries_per_block, idx)
        self.glob_rows[source] = (idx, g.table, g.entries_per_block, out)
        return out

    def count(self, name: str, n) -> None:
        """Add `n` to counter `name`: an int, a tensor whose elements are added up, or a
        function giving one. Tensors and functions are kept and reduced when the counters are
        read (`counts`): a step that nobody reads the counters of launches nothing for them."""
        self.counters.setdefault(name, []).append(n)

    def count_parts(self) -> tuple[Counter, list[tuple[str, torch.Tensor]]]:
        """The counters reduced without reading the device: (plain ints, (name, 0-d int64 device
        tensor) pairs still to be read). Drops nothing the forward holds: the tensors are new."""
        out, parts = Counter(), []
        for name, items in self.counters.items():
            out[name] += 0
            for n in items:
                n = n() if callable(n) else n
                if isinstance(n, torch.Tensor):
                    parts.append((name, n.sum().long()))
                else:
                    out[name] += int(n)
        return out, parts

    def counts(self) -> Counter:
        """The counters as plain ints (one read from the device for all of them)."""
        out, parts = self.count_parts()
        out.update(read_counts(parts))  # (update adds and keeps zero counts; `+` would drop them)
        return out


# ---- attention (CSA2) ---------------------------------------------------------------------------

class Compressor(nn.Module):
    """Full layers: token rows -> compressed latents (ratio 2: softmax pooling of pairs over
    `wgate` scores in fp32, then RMSNorm; ratio 1: norm(wkv(x)) as a plain bf16 matmul)."""

    def __init__(self, cfg: ModelConfig, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.wkv = Linear(cfg.hidden_size, cfg.head_dim, "bf16")
        if ratio > 1:
            self.wgate = Linear(cfg.hidden_size, cfg.head_dim, "bf16")
            self.stacked_linears = (("wkv", "wgate"),)  # both read x: one launch (`weights.stack_linears`)
        self.norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class Indexer(nn.Module):
    """CSA2 indexer: 32 heads x 128 scoring the MXFP4 keys of the latest KV source.

    Full layers own the key path (`wk`, `k_norm`); Reindex layers own only `wq_b` and
    `weights_proj` and re-score inside the decoder's candidate pool. RoPE (the layer's table)
    rotates the LAST `qk_rope_head_dim` channels of each 128-wide indexer head, as in attention
    (the spec does not say which channels; this is our reading, one place to change).
    """

    def __init__(self, cfg: ModelConfig, owns_keys: bool, group: Group = SINGLE):
        super().__init__()
        # Model parallel: this rank's heads only; the per-head score sums are added across
        # ranks (`reduce_scores`) before top-k. The weight scale counts every head.
        self.n_heads, self.head_dim = group.split(cfg.index_n_heads, "index_n_heads"), cfg.index_head_dim
        self.weight_scale = cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * cfg.index_head_dim, _dense(cfg))
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, "bf16")
        if owns_keys:
            self.wk = Linear(cfg.head_dim, cfg.index_head_dim, "bf16")
            self.k_norm = RMSNorm(cfg.index_head_dim, cfg.rms_norm_eps)

    def queries(self, x, qr, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """(MXFP4 quantise-dequantised RoPE'd queries [T, Hi, Di], head weights [T, Hi])."""
        # independent pieces: on Ascend the weights projection (a matmul) runs on a second stream
        # beside the query projection (platform `overlap`); elsewhere one after the other. Then
        # RoPE, MXFP4 and the weight scale in one pass (`indexer_queries`).
        w, q = overlap(x.device, lambda: self.weights_proj(x, torch.float32),
                       lambda: self.wq_b(qr).view(-1, self.n_heads, self.head_dim))
        return ops.indexer_queries(q, cos, sin, w, self.weight_scale)


def _dense(cfg: ModelConfig) -> str:
    """Storage of the dense quantised linears: the checkpoint's FP8, W8A8 INT8, or bf16."""
    return cfg.weight_dtype if cfg.weight_dtype in ("fp8", "int8") else "bf16"


class Attention(nn.Module):
    """One query per head over [SWA window entries, selected global entries], one softmax with a
    sink, K = V = one 512-wide latent; grouped low-rank output projection."""

    def __init__(self, cfg: ModelConfig, layer_id: int, group: Group = SINGLE):
        super().__init__()
        self.cfg, self.layer_id, self.group = cfg, layer_id, group
        self.kind = cfg.layer_kind(layer_id)
        self.ratio = cfg.compress_ratios[layer_id]
        # Model parallel: column-parallel wq_b (this rank's heads, their sinks), wo_a on this
        # rank's head groups, row-parallel wo_b (partial sums added across ranks).
        h, d, dense = group.split(cfg.num_attention_heads, "num_attention_heads"), cfg.head_dim, _dense(cfg)
        self.n_heads, self.head_dim = h, d
        self.o_groups = group.split(cfg.o_groups, "o_groups")
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank, dense)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, h * d, dense)
        self.wkv = Linear(cfg.hidden_size, d, dense)
        self.stacked_linears = (("wq_a", "wkv"),)  # both read x: one allocation, one launch (`weights.stack_linears`)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.wo_a = Linear(cfg.num_attention_heads * d // cfg.o_groups, self.o_groups * cfg.o_lora_rank, "bf16")
        self.wo_b = Linear(self.o_groups * cfg.o_lora_rank, cfg.hidden_size, dense)
        self.register_buffer("attn_sink", torch.empty(h, dtype=torch.float32))
        if self.kind == "full":
            self.compressor = Compressor(cfg, self.ratio)
        if self.kind in ("full", "reindex"):
            self.indexer = Indexer(cfg, owns_keys=self.kind == "full", group=group)
        # which window floor applies (bounded replay and CED truncate windows per layer group)
        self.floor_group = (FLOOR_DRAFT if layer_id >= cfg.num_hidden_layers
                            else FLOOR_DECODER if layer_id >= cfg.decoder_start else FLOOR_ENCODER)
        self.register_buffer("inv_freq", torch.tensor(yarn_inv_freq(cfg, self.ratio), dtype=torch.float32), persistent=False)
        # run the indexer (this layer's top-k) on a second stream beside the query / KV projections,
        # and a Full layer's compressor on a third one from the layer input (`forward`;
        # `Transformer.overlap_streams`; None: the platform's default, `Platform.overlap_indexer_tokens`)
        self.overlap_indexer: bool | None = None

    # -- global KV (Full layers) --
    def update_global(self, x: torch.Tensor, rows: Rows, ctx: ForwardContext) -> None:
        """Compress the rows into cache entries: latent -> (indexer key, un-rotated) -> RoPE at
        position j*ratio -> FP4 -> cache. Every row is a candidate group end (fixed shapes): a
        row at p completes entry p // ratio when (p + 1) % ratio == 0, from the compressor rows
        of positions p-ratio+1 .. p (this step's, or kept from earlier steps at their positions);
        rows completing nothing, or whose entry exists already (a shared prefix), write to the
        null block."""
        comp, r = self.compressor, self.ratio
        g = ctx.cache.glob[self.layer_id]
        swa = ctx.cache.swa[self.layer_id]  # (the compressor rows sit at the window's rows)
        write, slots, cos, sin, group_rows = rows.memo(
            ("compress", r, g.table, g.entries_per_block, swa.table, swa.block_size),
            lambda: self._compress_plan(rows, g, swa))
        if r == 1:
            # a plain bf16 matmul, no activation quantisation (compress_kv widens the rows itself)
            kv, score = comp.wkv(x), None
        else:
            carry = ctx.cache.carry[self.layer_id]
            kv_gate = ops.linear_pair(x, comp.wkv.weight, None, comp.wgate.weight, None, torch.float32)
            carry.index_copy_(0, rows.swa_rows(swa), torch.stack(kv_gate, 1))
            rows_g = carry[group_rows]  # [T * r, 2, D]
            kv, score = rows_g[:, 0], rows_g[:, 1]
        lat = ops.compress_kv(kv, score, r, comp.norm.weight, comp.norm.eps, cos, sin, g.kv_codes, g.kv_scale, slots)
        k_norm = self.indexer.k_norm
        ops.rope_store_key(self.indexer.wk(lat), k_norm.weight, k_norm.eps, cos, sin, g.key_codes, g.key_scale, slots)
        ctx.count(f"compressed_entries.{self.layer_id}", write)

    def _compress_plan(self, rows: Rows, g, swa) -> tuple:
        """What `update_global` needs besides the activations, the same for every KV source of
        this ratio and these pools in a step: (write mask [T], entry slots [T], cos / sin of the
        entries' positions, compressor rows [T * r] of each row's group, oldest first; None at
        ratio 1)."""
        write, slots, entry_pos, group_rows = ops.compress_rows(
            rows.pos, rows.glob_from, rows.glob_table(g), g.entries_per_block, rows.swa_tables[swa.table],
            swa.block_size, self.ratio)
        cos, sin = rope_tables(self.inv_freq, entry_pos)  # entry j sits at position j*ratio
        return write, slots, cos, sin, group_rows

    def rope_tables(self, rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin of the rows' positions for this layer's frequencies, made once per step
        for all layers of the same compression ratio (their `inv_freq` is a function of it)."""
        return rows.memo(("rope", self.ratio), lambda: rope_tables(self.inv_freq, rows.pos))

    # -- top-k selection --
    def select(self, x, qr, rows: Rows, cos, sin, ctx: ForwardContext, keys_ready=None) -> torch.Tensor:
        """Global entry ids each query attends: own indexer (Full), re-scored pool (Reindex) or
        the latest index source's choice (Reuse). `keys_ready()` runs between the queries and
        the scores (the wait for a compressor on another stream)."""
        cfg = self.cfg
        if self.kind == "reuse":
            return ctx.topk[cfg.index_source_of(self.layer_id)]
        g = ctx.cache.glob[cfg.kv_source_of(self.layer_id)]
        n_vis = rows.memo(("visible", self.ratio), lambda: torch.div(rows.pos + 1, self.ratio, rounding_mode="floor"))
        q, w = self.indexer.queries(x, qr, cos, sin)
        if keys_ready is not None:
            keys_ready()
        keys = (g.key_codes, g.key_scale, rows.glob_table(g), g.entries_per_block)
        reduce = self.group.all_reduce_sum if self.group.world_size > 1 else None
        if self.kind == "full":
            is_pool_source = self.layer_id == cfg.candidate_source_layer_id
            idx, pool = ops.indexer_topk(
                q, w, *keys, n_vis, cfg.index_topk,
                pool_blocks=cfg.candidate_topk_blocks if is_pool_source else 0,
                pool_block_size=cfg.candidate_block_size, reduce_scores=reduce)
            if is_pool_source:
                ctx.pool = pool
            ctx.count(f"indexer_scored.{self.layer_id}", n_vis)
        else:
            assert ctx.pool is not None, "Reindex layer without a candidate pool"
            b = cfg.candidate_block_size
            idx, _ = ops.indexer_topk(q, w, *keys, n_vis, cfg.index_topk, candidates=ctx.pool, reduce_scores=reduce,
                                      candidate_block_size=b)
            pool = ctx.pool  # block ids: a block's entries below n_vis are scored
            ctx.count(f"indexer_scored.{self.layer_id}",
                      lambda: torch.where(pool >= 0, (n_vis.unsqueeze(1) - pool.long() * b).clamp(0, b), 0))
        ctx.topk[self.layer_id] = idx
        return idx

    def forward(self, x: torch.Tensor, rows: Rows, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        cos, sin = self.rope_tables(rows)
        swa = ctx.cache.swa[self.layer_id]
        own = rows.swa_rows(swa)  # (made here, before any fork: every stream below reads it)
        indexed = self.ratio > 0 and self.kind != "reuse"  # this layer scores its own top-k
        compress = self.kind == "full" and self.layer_id not in ctx.precompressed
        on, plat = False, None
        if indexed:
            plat = module_platform(self, x.device)
            on = self.overlap_indexer
            if on is None:  # the platform's default: where it was measured to pay (one rank: the
                # indexer's cross-rank score sum on the second stream is not measured)
                on = t <= plat.overlap_indexer_tokens and self.group.world_size == 1
        if on and compress:
            # the compressor reads only x: from the layer input on a second side stream (lane 1),
            # beside the projections and the indexer's queries; the scores wait for its keys
            plat.fork(lambda: self.update_global(x, rows, ctx), lane=1)
        # wq_a and wkv read the same x: one launch for both where the device has a kernel for it
        q_lat, kv = ops.linear_pair(x, self.wq_a.weight, self.wq_a.scale, self.wkv.weight, self.wkv.scale)
        qr = self.q_norm(q_lat)

        def project():
            """The RoPE'd query, and this step's SWA entries (normed, RoPE'd, FP8) written into
            the pool first (positions address them, so nothing older is overwritten): every
            query then reads its window from the pool."""
            return ops.rope_store_kv(self.wq_b(qr).view(t, self.n_heads, self.head_dim), kv,
                                     self.kv_norm.weight, self.kv_norm.eps, cos, sin, swa.kv, swa.scale, own)

        idx = None
        if on:  # the top-k on a side stream (lane 0) beside the projections: no data passes between them
            keys_ready = (lambda: plat.join(lane=1)) if compress else None
            idx = plat.fork(lambda: self.select(x, qr, rows, cos, sin, ctx, keys_ready))
            q = project()
            rows.window(swa, self.floor_group)  # (made on this stream while the top-k runs)
            plat.join(out=(idx, ctx.pool))  # (the pool, where this layer made it, is read later)
        elif indexed:
            if compress:
                self.update_global(x, rows, ctx)
            idx = self.select(x, qr, rows, cos, sin, ctx)
            q = project()
        else:
            q = project()
            if self.ratio > 0:  # a Reuse layer: its source layer's top-k
                idx = self.select(x, qr, rows, cos, sin, ctx)
        win = rows.window(swa, self.floor_group)
        g = None
        if self.ratio > 0:
            g = ctx.cache.glob[self.cfg.kv_source_of(self.layer_id)]
            source = self.cfg.index_source_of(self.layer_id) if self.kind == "reuse" else self.layer_id
            glob = (g.kv_codes, g.kv_scale, ctx.global_rows(source, idx, rows, g))
        else:
            glob = (None, None, None)
        o = ops.sparse_attention(q, swa.kv, swa.scale, win, *glob, self.attn_sink, self.head_dim ** -0.5,
                                 rows_bound=rows.rows_bound(swa, g))
        # rotated back, then wo_a: each group of heads (group g = heads g*H/G .. ) maps to o_lora_rank
        o = ops.unrope_grouped_linear(o, cos, sin, self.wo_a.weight, self.o_groups)
        if self.group.world_size == 1:
            return self.wo_b(o)
        # Row-parallel wo_b: unrounded partial sums, added across ranks, rounded once as the
        # one-process linear rounds (fp32, then bf16).
        return self.group.all_reduce_sum(self.wo_b(o, ops.partial_sum_dtype(o.device))).float().to(BF16)


# ---- MoE --------------------------------------------------------------------------------------

class Expert(nn.Module):
    """Clamped SwiGLU expert: w2(silu(min(w1 x, 10)) * clamp(w3 x, -10, 10))."""

    def __init__(self, dim: int, inter: int, storage: str):
        super().__init__()
        self.w1 = Linear(dim, inter, storage)
        self.w2 = Linear(inter, dim, storage)
        self.w3 = Linear(dim, inter, storage)

    def parts(self):
        return tuple((w.weight, w.scale) for w in (self.w1, self.w2, self.w3))


class Gate(nn.Module):
    """sqrtsoftplus router; `bias` picks experts for text tokens, `bias_vl` for image tokens."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.register_buffer("weight", torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=BF16))
        self.register_buffer("bias", torch.empty(cfg.n_routed_experts, dtype=torch.float32))
        if cfg.vision is not None:
            self.register_buffer("bias_vl", torch.empty(cfg.n_routed_experts, dtype=torch.float32))


class MoE(nn.Module):
    """Top-k routed experts (FP4) plus one shared expert (FP8); outputs summed in fp32. The
    routing weights are normalised over the chosen experts only with `norm_topk_prob`."""

    def __init__(self, cfg: ModelConfig, group: Group = SINGLE):
        super().__init__()
        self.cfg, self.group = cfg, group
        self.gate = Gate(cfg)
        # Model parallel: this rank holds the contiguous expert range [lo, hi), keyed by global
        # expert id (the checkpoint's names); routing is replicated.
        lo, hi = group.even_range(cfg.n_routed_experts)
        self.expert_lo = lo
        self.experts = nn.ModuleDict(
            {str(e): Expert(cfg.hidden_size, cfg.moe_intermediate_size, cfg.expert_dtype) for e in range(lo, hi)}
        )
        self.shared_experts = Expert(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, _dense(cfg))
        # w1 and w3 read the same rows: one allocation, one launch (`weights.stack_linears`; the routed
        # experts run as grouped kernels over their own tables)
        self.shared_experts.stacked_linears = (("w1", "w3"),)
        # run the shared expert on a second stream beside the routed ones (`Transformer.overlap_streams`;
        # None: the platform's default, `Platform.overlap_shared_tokens`)
        self.overlap_shared: bool | None = None

    def forward(self, x: torch.Tensor, is_image: torch.Tensor | None) -> torch.Tensor:
        cfg = self.cfg
        # image tokens choose with bias_vl (selected inside the router: no [T, E] bias per layer)
        vl = is_image is not None and hasattr(self.gate, "bias_vl")
        # Expert outputs are summed unrounded (`partial_sum_dtype`: fp64 on the reference; the
        # shared expert on rank 0 only) and rounded once, after the cross-rank sum: on the
        # reference an N-way run equals the one-process run bit for bit.
        acc = ops.partial_sum_dtype(x.device)

        def route() -> tuple[torch.Tensor, torch.Tensor]:
            """The router's weights and expert ids (local slots on a rank of several)."""
            w, ids = ops.moe_route(x, self.gate.weight, self.gate.bias, cfg.num_experts_per_tok,
                                   cfg.routed_scaling_factor, cfg.gate_temp, cfg.norm_topk_prob,
                                   image_bias=self.gate.bias_vl if vl else None, is_image=is_image if vl else None)
            if self.group.world_size > 1:  # local slots; experts of other ranks are skipped (-1)
                mine = (ids >= self.expert_lo) & (ids < self.expert_lo + len(self.experts))
                ids = torch.where(mine, ids - self.expert_lo, -1)
            return w, ids

        def routed(chosen: tuple | None = None) -> torch.Tensor:
            """The routed experts' partial sums (routing first unless `chosen` gives it)."""
            w, ids = chosen if chosen is not None else route()
            return ops.moe_experts(x, w, ids, [e.parts() for e in self.experts.values()], cfg.swiglu_limit, acc)

        def routed_plus(shared: torch.Tensor, join=None, chosen: tuple | None = None) -> torch.Tensor:
            """The MoE's output on one rank summing in fp32: the routed experts' sum + the shared
            expert's output, rounded to bf16 once, in the routed path's last launch (`join`: the
            wait for the stream the shared expert ran on, just before that launch)."""
            w, ids = chosen if chosen is not None else route()
            return ops.moe_experts_add(x, w, ids, [e.parts() for e in self.experts.values()], cfg.swiglu_limit,
                                       shared, join)

        if self.group.rank != 0:
            return self.group.all_reduce_sum(routed()).float().to(BF16)
        fused_add = self.group.world_size == 1 and acc == torch.float32
        plat = module_platform(self, x.device)
        on = self.overlap_shared
        if on is None:  # the platform's default: where it was measured to pay (decode sizes on CUDA)
            on = x.shape[0] <= plat.overlap_shared_tokens
        if on:  # the shared expert on a second stream beside the routed experts, and from two tokens
            # beside the router too (it needs x only). H200, mini decode step at 4K (graph): batch
            # 64 6.29 -> 6.10 ms, batch 8 within the spread (2.97-2.99); at one token the router's
            # latency-bound launch, slowed by the expert's weight reads beside it (6 -> 14 us),
            # cost more than it hid (1.86 -> 1.88 ms), so one token routes first.
            chosen = route() if x.shape[0] == 1 else None
            if fused_add:
                return plat.overlap(lambda: self.shared(x, acc),
                                    lambda shared, join: routed_plus(shared, join, chosen), joined=True)[1]
            shared, y = plat.overlap(lambda: self.shared(x, acc), lambda: routed(chosen))
        elif fused_add:
            return routed_plus(self.shared(x, acc))
        else:
            y, shared = routed(), self.shared(x, acc)
        return self.group.all_reduce_sum(y + shared).float().to(BF16)

    def shared(self, x: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
        """The shared expert's output (unrounded partial sums, `acc`)."""
        ones, zeros = _shared_route(x.shape[0], x.device)
        return ops.moe_experts(x, ones, zeros, [self.shared_experts.parts()], self.cfg.swiglu_limit, acc)


def module_platform(module: nn.Module, device: torch.device):
    """The platform of `device`, looked up once per module (this runs in every layer's forward)."""
    plat = getattr(module, "_plat", None)
    if plat is None or plat.device != device:
        plat = module._plat = platform_for(device)
    return plat


_CONSTANT_ROWS: dict[tuple, torch.Tensor] = {}
# buffers `constant_rows` outgrew: kept for the life of the process, because graphs captured
# before the growth read them by address (a freed buffer's memory is handed out again, and a
# replay then read whatever was written there: the shared expert's ids became garbage and the
# MoE kernel faulted on the H200 after a long prefill grew the buffers past the captured size)
_OUTGROWN_ROWS: list[torch.Tensor] = []


def constant_rows(name: str, t: int, device: torch.device, make) -> torch.Tensor:
    """Rows [:t] of the constant `make(n, device)` (rows all alike), a view of a per-device buffer
    made once: no fill kernels per layer and step. Never written through. The buffer grows only
    outside graph capture (a fill captured into a graph would run only at replay): a capture
    needing more rows than were ever made gets its own tensor. It grows at least twofold, and an
    outgrown buffer is never freed (`_OUTGROWN_ROWS`)."""
    key = (name, device)
    hit = _CONSTANT_ROWS.get(key)
    if hit is None or hit.shape[0] < t:
        if platform_for(device).is_capturing():
            return make(t, device)
        made = make(max(t, 2 * hit.shape[0]) if hit is not None else t, device)
        if hit is not None:
            _OUTGROWN_ROWS.append(hit)
        hit = _CONSTANT_ROWS[key] = made
    return hit[:t]


def _shared_route(t: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared expert's constant routing for t tokens: (weights [t, 1] fp32 ones, ids [t, 1]
    long zeros)."""
    return (constant_rows("shared_w", t, device, lambda n, d: torch.ones(n, 1, dtype=torch.float32, device=d)),
            constant_rows("shared_id", t, device, lambda n, d: torch.zeros(n, 1, dtype=torch.long, device=d)))


def _first_stream(n: int, device: torch.device, streams: int) -> torch.Tensor:
    """[n, streams] fp32 one-hot rows [1, 0, ..]: the model entry's collapse weights."""
    pre = torch.zeros(n, streams, dtype=torch.float32, device=device)
    pre[:, 0] = 1.0
    return pre


# ---- Engram -----------------------------------------------------------------------------------

class EngramEmbed(nn.Module):
    """Engram rows as stored: "fp8" (E4M3 + E8M0 scale per 32) or "int8" (+ one fp32 scale per
    row, `dsv41 convert --engram-dtype int8`); `ops.engram_lookup` dequantises either.

    Host offload (`Transformer.offload_engram`; the full model's tables are 203 GB of its 512 GB
    and do not fit beside the experts on one A2 / A3, docs/serving.md): the tables live in host memory
    (page-locked when the model runs on an accelerator) and stay there whatever device or dtype
    the model is moved to. A lookup then either reads the rows in place from the device
    ("direct": CUDA's Triton kernel on page-locked memory) or gathers the step's rows on the
    host and copies only those over ("gather": any other device or table; the Ascend path). The
    backend's `engram_lookup` picks the path from where the table is; both return exactly the
    on-device lookup's values (the same op on the same rows). Tested on CPU; unverified on
    hardware at the model level on CUDA and NPU (the CUDA kernel's in-place read of a page-locked
    table is tested on an H200)."""

    def __init__(self, rows: int, dim: int, storage: str = "fp8"):
        super().__init__()
        if storage == "int8":
            self.register_buffer("weight", torch.empty(rows, dim, dtype=torch.int8))
            self.register_buffer("scale", torch.empty(rows, 1, dtype=torch.float32))
        else:
            self.register_buffer("weight", torch.empty(rows, dim, dtype=torch.float8_e4m3fn))
            self.register_buffer("scale", torch.empty(rows, dim // 32, dtype=torch.float8_e8m0fnu))
        self.offloaded, self.pinned = False, False

    def to_host(self, pinned: bool) -> None:
        """Keep the tables in host memory from now on, page-locked when `pinned` (a model on an
        accelerator)."""
        self.offloaded, self.pinned = True, pinned
        for name, buf in self._buffers.items():
            if buf is not None and not buf.is_meta and buf.device.type != "cpu":
                self._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=pinned).copy_(buf)

    def _apply(self, fn, recurse=True):
        # `.to(device)`, `.to_empty(...)`, `.half()` ... reach buffers through `_apply`: offloaded
        # tables keep their host storage and dtype (meta ones get host storage allocated)
        if not self.offloaded:
            return super()._apply(fn, recurse)
        for name, buf in self._buffers.items():
            if buf is not None and buf.is_meta:
                self._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=self.pinned)
        return self


class Engram(nn.Module):
    """Hashed n-gram memory added into every mHC stream before its block.

    rows (24 per token) -> FP8 rows dequantised -> concat -> `wkv` -> 4 keys + 1 value; per stream
    s, gate_s = sigmoid(sign(dot_s) sqrt(max(|dot_s|, 1e-6))) with dot_s the RMS-normalised key
    s . stream s product weighted by `k_weight[s]` * `q_weight[s]` and scaled by d^-0.5; stream s
    += gate_s * value. `q_weight` / `k_weight` are [hc_mult, d]: one row per mHC stream (the
    official checkpoints hold distinct rows). Gate 0 on image tokens.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, rows: int, group: Group = SINGLE):
        super().__init__()
        self.cfg, self.layer_id, self.group = cfg, layer_id, group
        n, d = cfg.hc_mult, cfg.hidden_size
        # Model parallel: this rank holds table rows [row_lo, row_hi) (pieces of ceil(rows/N)).
        self.row_lo, row_hi = group.ceil_range(rows)
        self.embed = EngramEmbed(row_hi - self.row_lo, cfg.engram_head_dim, cfg.engram_dtype)
        self.wkv = Linear(cfg.n_engram_rows_per_token * cfg.engram_head_dim, (n + 1) * d, _dense(cfg))
        self.register_buffer("q_weight", torch.empty(n, d, dtype=BF16))
        self.register_buffer("k_weight", torch.empty(n, d, dtype=BF16))
        self.primes = engram_primes(cfg)[cfg.engram_layer_ids.index(layer_id)]
        self.register_buffer("multipliers", torch.zeros(cfg.engram_max_ngram_size, dtype=torch.long),
                             persistent=False)

    def set_compressed_vocab(self, n_compressed: int) -> None:
        m = engram_multipliers(self.cfg, self.layer_id, n_compressed)
        self.multipliers = torch.from_numpy(m).to(self.multipliers.device)

    def window_row_ids(self, ngram_ids: torch.Tensor, ngram_image: torch.Tensor, token_map: torch.Tensor,
                       pad_id: int) -> torch.Tensor:
        """Row ids [T, 24] from the token ids at p, p-1, .. [T, N] (-1 before the start) and
        whether they are image tokens (a slot on or behind an image hashes as the pad id)."""
        # the primes as a tensor on the ids' device, made once (nothing crosses the bus in a step)
        if getattr(self, "_primes_t", None) is None or self._primes_t.device != ngram_ids.device:
            self._primes_t = torch.tensor(self.primes, dtype=torch.int64, device=ngram_ids.device)
        return ops.engram_hash(ngram_ids, ngram_image, token_map, self.multipliers, self._primes_t, pad_id,
                               self.cfg.engram_n_heads)

    def forward(self, x: torch.Tensor, rows, is_image: torch.Tensor) -> torch.Tensor:
        """`rows`: row ids [T, 24] into the table, the step's rows already fetched from a host
        table (`FetchedRows`: looked up once their copy is done, on the device), or this layer's
        values made ahead on a side lane (`EngramValues`: read once the lane is joined)."""
        kv = rows.ready() if isinstance(rows, EngramValues) else self.values(rows)
        return self.gate(x, kv, is_image)

    def values(self, rows) -> torch.Tensor:
        """The values [T, (n + 1) d]: the rows looked up and projected by `wkv` (4 keys + 1 value).
        They read only the token ids, not the streams (`Transformer.overlap_streams`' "engram")."""
        if isinstance(rows, FetchedRows):
            e = ops.engram_lookup(*rows.ready())
        elif self.group.world_size == 1:
            e = ops.engram_lookup(self.embed.weight, self.embed.scale, rows)
        else:
            e = self.sharded_lookup(rows)
        return self.wkv(e)

    def gate(self, x: torch.Tensor, kv: torch.Tensor, is_image: torch.Tensor) -> torch.Tensor:
        """Every stream plus its gate times the value (gate 0 on image tokens)."""
        t, n, d = x.shape
        k, v = kv[:, : n * d].reshape(t, n, d), kv[:, n * d:]  # (engram_gate widens them, reading in place)
        return ops.engram_gate(x, k, v, self.q_weight, self.k_weight, self.cfg.rms_norm_eps, is_image)


    def sharded_lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """Model-parallel lookup: rows of this rank's piece are read, the others are zero, and
        the ranks' results are summed (exact: each row has one nonzero term)."""
        t, r = rows.shape
        n_local = self.embed.weight.shape[0]
        mine = (rows >= self.row_lo) & (rows < self.row_lo + n_local)
        if n_local:
            local = torch.where(mine, rows - self.row_lo, 0)
            e = ops.engram_lookup(self.embed.weight, self.embed.scale, local).view(t, r, -1)
        else:  # the last piece may be empty
            e = torch.zeros(t, r, self.cfg.engram_head_dim, dtype=BF16, device=rows.device)
        e = e.masked_fill(~mine.unsqueeze(-1), 0)
        return self.group.all_reduce_sum(e.float()).to(BF16).view(t, -1)


def embed_rows(weight: torch.Tensor, ids: torch.Tensor, group: Group) -> torch.Tensor:
    """Rows `ids` of a table whose rows are split evenly over `group` (vocabulary-parallel):
    each rank reads the ids in its rows, the others give zero, and the ranks' rows are summed
    (exact: one nonzero term)."""
    if group.world_size == 1:
        return weight[ids]
    lo = group.rank * weight.shape[0]
    mine = (ids >= lo) & (ids < lo + weight.shape[0])
    x = weight[torch.where(mine, ids - lo, 0)].masked_fill(~mine.unsqueeze(-1), 0)
    return group.all_reduce_sum(x.float()).to(weight.dtype)


# ---- block and model ----------------------------------------------------------------------------

@dataclass
class Streams:
    """The mHC state between sublayers: the n streams, the next sublayer's input (collapsed with
    the previous sublayer's `pre`) and the next sublayer's own (pre, post, comb)."""

    x: torch.Tensor  # [T, n, d] bf16
    x_hat: torch.Tensor  # [T, d] bf16
    coef: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    # the next sublayer's input already normed (attn_norm(x_hat), made by the mix that made
    # x_hat: `mhc_mix_norm`), or None
    normed: torch.Tensor | None = None

    def select(self, index: torch.Tensor) -> "Streams":
        return Streams(self.x[index], self.x_hat[index], tuple(c[index] for c in self.coef),
                       None if self.normed is None else self.normed[index])


class Block(nn.Module):
    """One backbone layer: [Engram] -> attention sublayer -> FFN sublayer, both wrapped in
    single-pass mHC: a sublayer's input collapses the streams with the PREVIOUS sublayer's
    `pre`, so one fused `mhc_mix` per sublayer updates the streams, produces the next input
    and predicts the next sublayer's coefficients ((2n+2)d activation traffic)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, engram_rows: int | None, group: Group = SINGLE):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        n, d = cfg.hc_mult, cfg.hidden_size
        self.attn = Attention(cfg, layer_id, group)
        self.ffn = MoE(cfg, group)
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps)
        mix = (2 + n) * n
        for sub in ("attn", "ffn"):
            self.register_buffer(f"hc_{sub}_fn", torch.empty(mix, n * d, dtype=torch.float32))
            self.register_buffer(f"hc_{sub}_base", torch.empty(mix, dtype=torch.float32))
            self.register_buffer(f"hc_{sub}_scale", torch.empty(3, dtype=torch.float32))
        self.engram = Engram(cfg, layer_id, engram_rows, group) if engram_rows is not None else None

    def hc(self, sub: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return getattr(self, f"hc_{sub}_fn"), getattr(self, f"hc_{sub}_scale"), getattr(self, f"hc_{sub}_base")

    def mix(self, x, y, coef, nxt: tuple | None, norm: RMSNorm | None = None):
        """Fused residual update with `coef` (post, comb), the next input (collapse with `pre`)
        and, when `nxt` = (fn, scale, base) is given, the next sublayer's coefficients; with
        `norm`, also the next input normed (`mhc_mix_norm`: no launch of its own), a fourth value."""
        cfg = self.cfg
        join_mhc_coef(module_platform(self, x.device), coef)  # (the lane the previous mix's epilogue ran on)
        pre, post, comb = coef
        fn, scale, base = nxt if nxt is not None else (None, None, None)
        if norm is not None:
            return ops.mhc_mix_norm(x, y, post, comb, pre, fn, scale, base, cfg.rms_norm_eps, cfg.hc_eps,
                                    cfg.hc_sinkhorn_iters, norm.weight, norm.eps)
        return ops.mhc_mix(x, y, post, comb, pre, fn, scale, base, cfg.rms_norm_eps, cfg.hc_eps,
                           cfg.hc_sinkhorn_iters)

    def attn_input(self, s: Streams) -> torch.Tensor:
        """The attention sublayer's input: attn_norm(x_hat), made by the previous mix when it could."""
        return s.normed if s.normed is not None else self.attn_norm(s.x_hat)

    def enter(self, x: torch.Tensor, pre_prev: torch.Tensor, engram_rows, is_image) -> Streams:
        """Start this block from plain streams (model entry, or after a block whose last update
        could not be fused because Engram changes the streams in between)."""
        cfg = self.cfg
        if self.engram is not None:
            x = self.engram(x, engram_rows, is_image)
        # the coefficients, the collapsed input and its attn_norm in one pass (`mhc_enter_norm`)
        coef, x_hat, h = ops.mhc_enter_norm(x, pre_prev, *self.hc("attn"), cfg.rms_norm_eps, cfg.hc_eps,
                                            cfg.hc_sinkhorn_iters, self.attn_norm.weight, self.attn_norm.eps)
        return Streams(x, x_hat, coef, h)

    def forward(self, s: Streams, rows: Rows, ctx: ForwardContext, nxt: "Block | None", nxt_engram=None):
        """Attention and FFN; returns the streams ready for `nxt` (or, after the last block,
        with x_hat collapsed for the final norm)."""
        is_image = rows.is_image
        y = self.attn(self.attn_input(s), rows, ctx)
        x, x_hat, coef_f, h = self.mix(s.x, y, s.coef, self.hc("ffn"), self.ffn_norm)
        y = self.ffn(h, is_image)
        if nxt is not None and nxt.engram is None:
            x, x_hat, coef, h = self.mix(x, y, coef_f, nxt.hc("attn"), nxt.attn_norm)
            return Streams(x, x_hat, coef, h)
        x, x_hat, _ = self.mix(x, y, coef_f, None)
        if nxt is None:
            return Streams(x, x_hat, coef_f)
        return nxt.enter(x, coef_f[0], nxt_engram, is_image)


class Transformer(nn.Module):
    """Embedding -> 4 mHC streams -> encoder layers -> decoder layers -> collapse, norm, head."""

    def __init__(self, cfg: ModelConfig, group: Group = SINGLE, with_drafter: bool = True):
        super().__init__()
        cfg.validate()
        self.cfg, self.group = cfg, group
        d = cfg.hidden_size
        # `group` (core/parallel.py) shards the model as `dsv41 convert --model-parallel N` does:
        # vocabulary-parallel embed / head, attention heads, experts, Engram rows; the rest is
        # replicated. The one-process default builds the whole model.
        vocab = group.split(cfg.vocab_size, "vocab_size")
        self.embed = nn.Module()
        self.embed.register_buffer("weight", torch.empty(vocab, d, dtype=BF16))
        rows = dict(zip(cfg.engram_layer_ids, cfg.engram_num_embeddings))
        self.layers = nn.ModuleList(Block(cfg, i, rows.get(i), group) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.head = Linear(d, vocab, "bf16")
        from .dspark import build_stages  # imports this module

        # DSpark drafter stages `mtp.0..` (None without one, or when `with_drafter` is False:
        # a run without speculative decoding never allocates them)
        self.mtp = build_stages(cfg, group) if with_drafter else None
        self.register_buffer("engram_map", torch.zeros(cfg.vocab_size, dtype=torch.long), persistent=False)
        self.engram_pad = 0
        self.engram_fetch, self._prefetch = None, None  # host-offloaded tables (`offload_engram`)
        self.overlap_engram: bool | None = None  # Engram values ahead on a side lane (`overlap_streams`)
        if cfg.vision is not None:  # DeepSeek-ViT + aligner + framing rows (core/vision.py)
            from .vision import (  # imports this module
                IMAGE_FRAME,
                Aligner,
                VisionTransformer,
            )

            self.vision = VisionTransformer(cfg.vision)
            self.aligner = Aligner(cfg.vision, d)
            for name in IMAGE_FRAME:
                self.register_buffer(name, torch.empty(d, dtype=BF16))

    def overlap_streams(self, on: bool | None = True,
                        parts: tuple[str, ...] = ("shared", "indexer", "engram")) -> None:
        """Run work on a second device stream beside independent work (through the platform's
        streams and events; the same arithmetic, so the same logits): "shared", each MoE's shared
        expert beside its routed experts; "indexer", each Full / Reindex layer's compressor and
        top-k beside its query and KV projections; "engram", the Engram layers' values (lookup and
        `wkv`, from the token ids alone) from the step's start beside the layers before theirs.
        None restores the platform's defaults (`Platform.overlap_shared_tokens`,
        `overlap_indexer_tokens`, `overlap_engram_tokens`): shared and indexer on CUDA at decode
        sizes, where the H200 measured them faster (benchmarks/RESULTS-e2e.md), Engram off (it cost
        time at batch 1 on an H100); off on CPU (no streams) and on NPU (unverified on hardware).
        `benchmarks/e2e.py --streams` measures them."""
        bad = set(parts) - {"shared", "indexer", "engram"}
        if bad:
            raise ValueError(f"unknown overlap parts {sorted(bad)}; known: shared, indexer, engram")
        if "engram" in parts:
            self.overlap_engram = on
        for blk in self.layers:
            if "shared" in parts:
                blk.ffn.overlap_shared = on
            if "indexer" in parts:
                blk.attn.overlap_indexer = on

    def offload_engram(self, device: torch.device | str, fetch: str | None = None) -> None:
        """Keep every Engram table in host memory while the rest of the model runs on `device`
        (page-locked when `device` is an accelerator). Call it on the meta-device model, before
        `weights.materialize`, so no table is ever allocated on the device.

        `fetch`: "ahead" gathers each step's rows of every Engram layer on the host before the
        step and copies them on a side stream (`engram.EngramPrefetch`: no layer waits on the
        host); "in_place" leaves it to the backend's `engram_lookup` (CUDA's kernel reads
        page-locked tables in place; other tables are gathered in the lookup, one host read of
        the row ids per layer). None: the device's default (`Platform.engram_fetch`: in place
        on CUDA, ahead elsewhere)."""
        if fetch is None:
            fetch = platform_for(device).engram_fetch
        if fetch not in ("ahead", "in_place"):
            raise ValueError(f"fetch must be 'ahead' or 'in_place', got {fetch!r}")
        pinned = str(device).split(":")[0] != "cpu"  # (torch.device("npu") needs torch_npu)
        for m in self.modules():
            if isinstance(m, EngramEmbed):
                m.to_host(pinned)
        self.engram_fetch = fetch
        self._prefetch = None

    def set_engram_vocab(self, comp_map, n_compressed: int) -> None:
        """Install the token -> compressed-id map (built from the tokenizer) used by Engram."""
        self.engram_map = torch.as_tensor(comp_map, dtype=torch.long, device=self.engram_map.device)
        self.engram_pad = int(self.engram_map[self.cfg.engram_pad_token_id])
        self._prefetch = None  # (hashes changed: built again on the next step)
        for blk in self.layers:
            if blk.engram is not None:
                blk.engram.set_compressed_vocab(n_compressed)

    def image_mask(self, ids: torch.Tensor) -> torch.Tensor:
        tok = self.cfg.image_token_id
        if tok is None or self.cfg.vision is None:
            return torch.zeros_like(ids, dtype=torch.bool)
        return ids == tok

    def check_batch(self, batch: StepBatch) -> None:
        """Token ids inside the vocabulary and positions inside the context (one host read of
        two small reductions; callers that validated their inputs skip it with check=False)."""
        cfg = self.cfg
        ids = batch.ids
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"expected a non-empty 1-D tensor of token ids, got shape {tuple(ids.shape)}")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= cfg.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {cfg.vocab_size})")
        end = int(batch.positions.max()) + 1
        if end > cfg.max_position_embeddings:
            raise ValueError(f"sequence of {end} tokens exceeds max_position_embeddings ({cfg.max_position_embeddings})")

    @torch.no_grad()
    @mhc_coef_lane_scope()  # (every mHC step joins the coefficient lane before reading: `Block.mix`)
    def forward(self, batch: StepBatch, cache: KVPool, *, ctx: ForwardContext | None = None,
                return_hidden: bool = False, check: bool = True) -> torch.Tensor:
        """Run one step and return fp32 logits [n, V] of the batch's `logit_rows` (decoder rows;
        all of them when None), or with `return_hidden` the collapsed final streams of every
        decoder row ([rows, d] bf16, for `logits`).

        CED prefill: rows outside `batch.decoder_rows` run through the encoder only; the
        decoder's KV source compresses every row of the encoder's output first, then the
        decoder runs over its rows (their windows floored by the batch's decoder floors).
        `batch.image_embeds` replace the embeddings of the image positions, in row order."""
        cfg = self.cfg
        if check:
            self.check_batch(batch)
        ctx = ctx or ForwardContext()
        ctx.cache = cache
        rows = Rows.of(batch, cfg)
        t = batch.num_tokens
        x = self.embed_tokens(batch.ids)
        if batch.image_embeds is not None:  # (masked_scatter: no host read of the mask)
            x = x.masked_scatter(batch.is_image.unsqueeze(-1), batch.image_embeds.to(device=x.device, dtype=x.dtype))
        engram = self._engram_rows(batch)  # device row ids, or rows fetched ahead from host tables
        engram = self._engram_ahead(engram, t, x.device)
        x = x.unsqueeze(1).expand(t, cfg.hc_mult, cfg.hidden_size).contiguous()
        # the first sublayer collapses with one-hot [1, 0, 0, 0]
        pre = constant_rows(f"first_stream.{cfg.hc_mult}", t, x.device,
                            lambda n, d: _first_stream(n, d, cfg.hc_mult))
        layers = list(self.layers)
        s = layers[0].enter(x, pre, engram.get(0), rows.is_image)
        ctx.count("encoder_tokens", t)
        for i, blk in enumerate(layers):
            if i == cfg.decoder_start and batch.decoder_rows is not None:
                # CED: the decoder's KV source compresses every row of the encoder's output; the
                # decoder itself runs only over its rows
                blk.attn.update_global(blk.attn_input(s), rows, ctx)
                ctx.precompressed.add(blk.layer_id)
                sel = batch.decoder_rows
                join_mhc_coef(module_platform(self, x.device), s.coef)
                s, rows = s.select(sel), rows.select(sel)
                engram = {k: v.select(sel) if isinstance(v, (FetchedRows, EngramValues)) else v[sel]
                          for k, v in engram.items()}
                if rows.num == 0:
                    break
            if i == cfg.decoder_start:
                ctx.count("decoder_tokens", rows.num)
            if ctx.features is not None and i in cfg.dspark_target_layer_ids:
                ctx.features[i] = s.x.float().mean(1).to(BF16)  # DSpark feature: this layer's input
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            s = blk(s, rows, ctx, nxt, engram.get(i + 1))
        if return_hidden:
            return s.x_hat  # collapsed streams of every row the decoder processed; see `logits`
        h = s.x_hat if batch.logit_rows is None else s.x_hat[batch.logit_rows]
        return self.logits(h)

    def logits(self, x_hat: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, V] of collapsed final streams: final norm, then the head."""
        return self.lm_head(self.norm(x_hat))

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, V] of normed hidden rows (vocabulary-parallel: gathered over ranks)."""
        return self.group.all_gather(self.head(h, torch.float32), -1)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, d] (vocabulary-parallel under model parallelism)."""
        return embed_rows(self.embed.weight, ids, self.group)

    def engram_prefetch(self) -> EngramPrefetch | None:
        """The fetch-ahead of host-held Engram tables (None when the tables are on the device,
        fetched in place, or sharded), built on first use from the tables as loaded."""
        if self.engram_fetch != "ahead" or self.group.world_size > 1:
            return None
        if self._prefetch is None:
            layers = {}
            for blk in self.layers:
                e = blk.engram
                if e is not None and e.embed.offloaded:
                    primes = torch.tensor(e.primes, dtype=torch.long)
                    layers[blk.layer_id] = (e.embed.weight, e.embed.scale, e.multipliers.cpu(), primes,
                                            self.cfg.engram_n_heads)
            self._prefetch = EngramPrefetch(layers, self.engram_map, self.engram_pad, self.embed.weight.device)
        return self._prefetch

    def _engram_ahead(self, engram: dict, t: int, device: torch.device) -> dict:
        """Under `overlap_engram` (None: the platform's default, `Platform.overlap_engram_tokens`),
        the values of every Engram layer but the first block's (read at once, at the model's
        entry) forked on side lane ENGRAM_LANE now, at the step's start: lookup and `wkv` read only
        the token ids, so they run beside the layers before theirs (`EngramValues`; one rank only:
        a sharded lookup sums over ranks; rows fetched from host tables stay on the main stream).
        The same operations on the same inputs, so the same values."""
        plat = module_platform(self, device)
        on = self.overlap_engram
        if on is None:
            on = t <= plat.overlap_engram_tokens
        if not on or self.group.world_size > 1:
            return engram
        entry = self.layers[0].layer_id
        blocks = {blk.layer_id: blk for blk in self.layers}
        # `reads`: nobody holds the row ids after this; the lane must keep their memory until it has
        # read them (without it the lookup gathered with overwritten ids and faulted on an H100)
        return {i: EngramValues(plat.fork(lambda e=blocks[i].engram, r=r: e.values(r), lane=ENGRAM_LANE, reads=(r,)),
                                plat)
                if i != entry and not isinstance(r, FetchedRows) else r for i, r in engram.items()}

    def _engram_rows(self, batch: StepBatch) -> dict:
        """Per Engram layer: hashed row ids [T, 24] from the n-gram inputs the batch carries
        (token ids at p, p-1, ..; a slot before the sequence start or on an image token, and
        every older slot behind it, hashes as the pad id), or for a host-held table fetched
        ahead, its rows gathered on the host and on their way to the device (`FetchedRows`)."""
        if not self.cfg.engram_layer_ids:
            return {}
        fetched = {}
        prefetch = self.engram_prefetch()
        if prefetch is not None and prefetch.layers:
            # (without host copies of the n-grams: one read back for the whole step)
            prefetch.gather(*(batch.ngram_host or (batch.ngram_ids, batch.ngram_image)))
            fetched = prefetch.issue()
        return {blk.layer_id: fetched.get(blk.layer_id)
                or blk.engram.window_row_ids(batch.ngram_ids, batch.ngram_image, self.engram_map, self.engram_pad)
                for blk in self.layers if blk.engram is not None}
