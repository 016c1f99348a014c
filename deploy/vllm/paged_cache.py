"""Our caches as vLLM's block manager sees them, and the step that runs the core model IN PLACE on
vLLM's pages.

vLLM allocates one uint8 page buffer per cache layer; every page is `block_size_layer` records
of `record_bytes`, so a field of a record is a row-strided view of the pages
(`raw[:, offset:offset + n]`, row = block * records per block + record in block, exactly the
address the core computes). `PagedCaches.pool` wraps those views in a `core.cache.KVPool`
(`KVPool.over`: a block size and a block-table number per layer), and `run_step` builds ONE
`StepBatch` from vLLM's per-group block tables and runs ONE `Transformer.forward` over every
scheduled token (prefill chunks and decodes mixed). The ops read and write the pages in place:
no per-request gather or scatter, no host-side request state, and nothing in the step reads a
value back to the host (images aside), so a decode step is capturable.

Cache layers (vLLM `AttentionLayerBase`s (`layers.PagedLayer`), so vLLM allocates,
frees and prefix-caches them; this module itself needs no vLLM, so it is tested on any device).
Their names hold "attn" (`<prefix>.attn.global_kv.<layer>`, `<prefix>.attn.swa.<layer>`):
vllm-ascend's runner allocates KV only for layers so named (docs/serving.md).
- `GlobalKVCacheLayer` per KV-source layer: one record per `ratio` tokens (`tokens_per_state`),
  prefix-cacheable. Record = E2M1 latent (D/2 B) + E4M3 scales (D/16) + MXFP4 indexer key
  (Di/2) + E8M0 key scales (Di/32); the first KV source's record also holds the group's
  `ratio` token ids (int32, first: Engram's n-grams reach up to 3 tokens before a replay start,
  whose window pages are null, and a prefix hit brings them along with the entries).
- `SWACacheLayer` per backbone layer: a sliding-window cache with bounded replay
  (`SlidingWindowMLASpec(bounded_replay=True)`), so vLLM never prefix-caches it and, on a hit,
  rewinds the computed-token count by the replay length and recomputes those tokens. Record =
  [the compressor's fp32 (kv, score) row pair, ratio-2 KV sources only: a group spanning two
  steps finds its first row there] + [layer 0 only: int32 token id (negative: -(id + 1) at an
  image position) and int32 replay start of the request] + FP8 latent (D) + E8M0 scales (D/32).
  The 4-byte fields come first, so their views stay aligned.

What the host used to track, the pages hold (written by the step, read by the next):
- Window validity: a window position is read only when its page is a real block. vLLM gives
  back blocks that left every window, and a prefix hit's replay start H - R is block-aligned
  (H is a multiple of the block size and so must be R, checked at start-up) with the blocks
  before it null: the window is truncated there exactly as the reference engine's bounded
  replay truncates it.
- The replay start F of a request: a chunk whose previous position lies in a null block starts
  at F (vLLM discards hits no longer than the replay, so F > 0 means a hit of F + R tokens);
  later chunks read F back from layer 0's record of their previous position. Global entries of
  positions below F + R are the hit's prefix-cached ones and are never rewritten.
- Engram's n-gram inputs: the token ids at p-1 .. p-3 from layer 0's records, or below F from
  the first KV source's global records.

Page size: vLLM's hybrid allocator wants one page size for every layer. The SWA record of a
ratio-2 KV source (the largest per token, because of the carried compressor rows) is rounded up
to a multiple of `RECORD_ALIGN` bytes and its page (`block_size` records) sets the size; every
other layer takes the largest block of `block_size * 2^k` tokens (k <= 4; for window layers the
block also divides the replay length) whose records, padded to fill the page exactly, still
hold one entry (`fill_layout`). Padding every page to the carry-SWA page instead wasted 12.6x
(ratio 1) and 24.9x (ratio 2) of the full model's global KV at block size 64, and 8.5x of the
other 37 layers' window; now both are at most 1.6x (the window at block sizes that leave room
in the replay length). vLLM schedules on the least common multiple of the block sizes (prefix
hits are multiples of the largest block).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ...backends.paging import table_rows
from ...backends.platform import storage_dtype
from ...core.batch import StepBatch
from ...core.cache import GlobalPool, KVPool, SWAPool
from ...core.config import ModelConfig

RECORD_ALIGN = 64  # SWA record bytes are rounded up to this, so the page splits into many sizes
MAX_BLOCK_SCALE = 16  # a global layer's block is at most this many SWA blocks (prefix-hit grain)


@dataclass(frozen=True)
class GlobalRecord:
    """Byte layout of one global KV entry (one per `ratio` tokens); `tokens`: it also holds the
    group's token ids (the first KV source only)."""

    d: int
    di: int
    ratio: int
    tokens: bool = False

    @property
    def fields(self) -> list[tuple[str, int]]:
        return [("token_ids", 4 * self.ratio if self.tokens else 0), ("kv_codes", self.d // 2),
                ("kv_scale", self.d // 16), ("key_codes", self.di // 2), ("key_scale", self.di // 32)]

    @property
    def size(self) -> int:
        return sum(n for _, n in self.fields)


@dataclass(frozen=True)
class SWARecord:
    """Byte layout of one SWA entry (one per token); `carry`: room for the compressor's carried
    (kv, score) fp32 rows; `request`: the token id and the request's replay start (layer 0)."""

    d: int
    carry: bool
    request: bool = False

    @property
    def fields(self) -> list[tuple[str, int]]:
        return [("carry", 8 * self.d if self.carry else 0), ("token", 4 if self.request else 0),
                ("floor", 4 if self.request else 0), ("kv", self.d), ("scale", self.d // 32)]

    @property
    def size(self) -> int:
        return sum(n for _, n in self.fields)


def record_rows(kv_cache, slot: int) -> tuple[torch.Tensor, int]:
    """(rows [n, slot] uint8, rows per block stride) of a cache layer's pages as the runner binds
    them: vLLM [blocks, heads=1, records, bytes]; vllm-ascend (v0.23.0, `_adjust_kv_layout`) a
    one-tensor list of [blocks, records, heads=1, bytes] with a page-sized block stride, itself
    wrapped in one more list for the `deepseek_v4` model type (and by vLLM versions whose
    `bind_kv_cache` still wraps per virtual engine); any layout (blocks may be
    interleaved with other layers' pages). Record e of block b is row b * stride + e; rows of
    other layers' pages in between are never addressed."""
    kv_cache = _first(kv_cache)
    kv = kv_cache.view(torch.uint8) if kv_cache.dtype != torch.uint8 else kv_cache
    if kv.dim() == 4:  # (the one-head dimension, before or after the records)
        kv = kv[:, 0] if kv.shape[1] == 1 else kv[:, :, 0]
    if kv.dim() != 3 or kv.shape[-1] < slot or kv.stride(-1) != 1:
        raise ValueError(f"dsv41: a cache layer's pages must be [blocks, records, >= {slot} bytes], "
                         f"got shape {tuple(kv.shape)} strides {kv.stride()}")
    row, records = kv.stride(1), kv.shape[1]
    if kv.stride(0) % (row * records):
        raise ValueError(f"dsv41: page stride {kv.stride(0)} is not a whole number of pages of {records} x {row} B")
    stride = kv.stride(0) // row
    n = (kv.shape[0] - 1) * stride + records
    return kv.as_strided((n, slot), (row, 1)), stride


def _first(kv_cache) -> torch.Tensor:
    """The tensor of a cache layer's binding: a tensor, or vllm-ascend's one-tensor list (nested
    once more for its `deepseek_v4` model type); a list of several tensors (a K / V split, or
    vllm-ascend's scale tensor beside the cache) is not our layout."""
    while isinstance(kv_cache, (list, tuple)):
        if len(kv_cache) != 1:
            raise ValueError(f"dsv41: a cache layer is bound to {len(kv_cache)} tensors, expected one")
        kv_cache = kv_cache[0]
    return kv_cache


def fields_of(raw: torch.Tensor, layout) -> dict[str, torch.Tensor]:
    """Row-strided views of each field of the records `raw` [n, slot] (uint8)."""
    out, o = {}, 0
    for name, n in layout.fields:
        out[name] = raw[:, o:o + n]
        o += n
    return out


def _typed(field: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A uint8 field view reinterpreted as `dtype` (4-byte types: the field must be aligned)."""
    size = torch.tensor([], dtype=dtype).element_size()
    if size > 1 and (field.storage_offset() % size or field.stride(0) % size):
        raise ValueError(f"dsv41: a {dtype} field of the pages is not {size}-byte aligned")
    return field.view(dtype)


@dataclass(frozen=True)
class LayerRequest:
    """What a cache layer must be: `kind` "global" (one record per `ratio` tokens, prefix
    cacheable) or "swa" (one record per token, sliding window of `window` tokens, never prefix
    cached, replayed after a hit); every page padded to `page_bytes`."""

    prefix: str
    kind: str
    record_bytes: int
    ratio: int
    block_size: int
    window: int
    page_bytes: int


class PagedCaches(nn.Module):
    """The cache layers of one model, and one step of the core model over their pages in place."""

    def __init__(self, cfg: ModelConfig, block_size: int, prefix: str, replay_tokens: int,
                 make_layer: Callable[[LayerRequest], nn.Module]):
        super().__init__()
        self.cfg, self.replay_tokens = cfg, replay_tokens
        bs = self.block_size = block_size
        problem = block_size_problem(cfg, bs, replay_tokens)
        if problem:
            raise ValueError("dsv41 vLLM plugin: " + problem)
        d, di = cfg.head_dim, cfg.index_head_dim
        self.first_source = cfg.kv_source_layer_ids[0]  # its records hold the token ids
        self.glob_recs = {s: GlobalRecord(d, di, cfg.compress_ratios[s], s == self.first_source)
                          for s in cfg.kv_source_layer_ids}
        # only the ratio-2 KV sources carry compressor rows between chunks
        carried = {s for s in cfg.kv_source_layer_ids if cfg.compress_ratios[s] > 1}
        self.swa_recs = [SWARecord(d, carry=li in carried, request=li == 0) for li in range(cfg.num_hidden_layers)]
        page = self.page_bytes = bs * max(-(-r.size // RECORD_ALIGN) * RECORD_ALIGN for r in self.swa_recs)
        reqs = []
        for s in cfg.kv_source_layer_ids:
            r = cfg.compress_ratios[s]
            block, slot = fill_layout(page, bs, r, self.glob_recs[s].size)
            reqs.append(LayerRequest(f"{prefix}.attn.global_kv.{s}", "global", slot, r, block, 0, page))
        for li, rec in enumerate(self.swa_recs):
            # a window block must divide the replay length: the replay start is block-aligned
            block, slot = fill_layout(page, bs, 1, rec.size, divides=replay_tokens)
            reqs.append(LayerRequest(f"{prefix}.attn.swa.{li}", "swa", slot, 1, block, replay_tokens, page))
        self.requests = {q.prefix: q for q in reqs}
        self.block_sizes = {q.prefix: q.block_size for q in reqs}  # tokens per block, per layer
        self.glob = nn.ModuleDict({q.prefix.rsplit(".", 1)[1]: make_layer(q) for q in reqs if q.kind == "global"})
        self.swa = nn.ModuleList(make_layer(q) for q in reqs if q.kind == "swa")
        self._bound = None  # (key, pool, per-table (layer prefix, block stride), request fields)

    # -- the pool over the pages --
    def _layers(self):
        return [*((int(s), lay) for s, lay in self.glob.items()), *((None, lay) for lay in self.swa)]

    def pool(self, meta: dict) -> tuple[KVPool, dict, dict]:
        """A `KVPool` over the layers' bound pages (built once per binding), the tables it
        addresses through (per kind, in table order: (a layer whose metadata holds the group's
        table, block-number scale)) and the request fields (token ids, replay starts)."""
        layers = self._layers()
        first: dict[int, int] = {}  # which layers share a cache group (one metadata object per group)
        groups = tuple(first.setdefault(id(meta[lay.prefix]), i) for i, (_, lay) in enumerate(layers))
        key = tuple(_first(lay.kv_cache).data_ptr() for _, lay in layers) + groups
        if self._bound is not None and self._bound[0] == key:
            return self._bound[1:]
        cfg = self.cfg
        tables: dict[tuple, int] = {}  # (kind, cache group, block stride / records) -> table number
        table_src: dict[str, list[tuple[str, int]]] = {"swa": [], "global": []}

        def table_of(lay, kind: str, stride: int, records: int) -> int:
            k = (kind, groups[[p for _, p in layers].index(lay)], stride // records)
            if k not in tables:
                tables[k] = len(table_src[kind])
                table_src[kind].append((lay.prefix, stride // records))
            return tables[k]

        glob, swa, carry, req = {}, [], {}, {}
        for s, lay in layers:
            q = self.requests[lay.prefix]
            raw, stride = record_rows(lay.kv_cache, q.record_bytes)
            records = q.block_size // q.ratio
            layout = self.glob_recs[s] if s is not None else self.swa_recs[len(swa)]
            f = fields_of(raw, layout)
            t = table_of(lay, q.kind, stride, records)
            e4m3, e8m0 = (storage_dtype(d, raw.device) for d in (torch.float8_e4m3fn, torch.float8_e8m0fnu))
            if s is not None:
                glob[s] = GlobalPool(q.ratio, records, f["kv_codes"], _typed(f["kv_scale"], e4m3),
                                     f["key_codes"], _typed(f["key_scale"], e8m0), t)
                if layout.tokens:
                    req["glob_tokens"] = _typed(f["token_ids"], torch.int32)  # [rows, ratio]
                continue
            li = len(swa)
            swa.append(SWAPool(_typed(f["kv"], e4m3), _typed(f["scale"], e8m0), q.block_size, t))
            if layout.carry:
                carry[li] = _typed(f["carry"], torch.float32).view(-1, 2, cfg.head_dim)
            if layout.request:
                req["token"] = _typed(f["token"], torch.int32)[:, 0]
                req["floor"] = _typed(f["floor"], torch.int32)[:, 0]
        pool = KVPool.over(cfg, swa, carry, glob, raw.device)
        self._bound = (key, pool, table_src, req)
        return pool, table_src, req

    # -- one step --
    def run_step(self, model, meta: dict, input_ids: torch.Tensor, positions: torch.Tensor,
                 query_start_loc: torch.Tensor, num_reqs: int, is_image: torch.Tensor | None = None,
                 image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """ONE forward of the core model over every scheduled token of a vLLM step, reading and
        writing the pages in place: request b owns tokens query_start_loc[b] .. [b + 1] of
        `input_ids` / `positions`, and row b of each group's block table (`meta[layer].block_table`).
        Tokens past query_start_loc[num_reqs] (graph padding) run as an empty sequence whose
        tables are all the null block. `is_image` marks prompt image positions, whose rows
        `image_embeds` ([image positions, d], in token order) replace their embeddings. Returns
        the collapsed final streams [T, d] of every token."""
        cfg, dev = self.cfg, input_ids.device
        pool, table_src, req = self.pool(meta)
        t = input_ids.shape[0]
        b = num_reqs
        qsl = query_start_loc[: b + 1].to(dev, torch.long)
        pos = positions.to(dev, torch.long)
        ids = input_ids.to(dev, torch.long)
        seq = torch.searchsorted(qsl[1:], torch.arange(t, device=dev), right=True).clamp_max(b)  # b: padding
        tables = {}
        for kind, src in table_src.items():
            tables[kind] = []
            for prefix, scale in src:
                bt = meta[prefix].block_table[:b].to(dev, torch.long)
                tables[kind].append(torch.cat((bt * scale, bt.new_zeros(1, bt.shape[1]))))  # + the padding row
        swa_t, glob_t = tables["swa"], tables["global"]
        img = torch.zeros(t, dtype=torch.bool, device=dev) if is_image is None else is_image.to(dev)
        swa0, glob0 = pool.swa[0], pool.glob[self.first_source]
        row_tab = lambda tab, per, idx: table_rows(tab[seq], per, idx.unsqueeze(1))[:, 0]  # noqa: E731
        # the request's replay start: where its window pages begin (module docstring)
        start = pos.new_full((b + 1,), -1).scatter_reduce(0, seq, pos, "amin", include_self=False).clamp_min(0)
        prev = table_rows(swa_t[swa0.table], swa0.block_size, (start - 1).unsqueeze(1), null_invalid=True)[:, 0]
        floor = torch.where(prev >= 0, req["floor"][prev.clamp_min(0)].long(), start)
        glob_from = torch.where(floor > 0, floor + self.replay_tokens, 0)
        own0 = row_tab(swa_t[swa0.table], swa0.block_size, pos)
        req["floor"].index_copy_(0, own0, floor[seq].to(torch.int32))
        req["token"].index_copy_(0, own0, torch.where(img, -ids - 1, ids).to(torch.int32))
        # the first KV source's records: the token ids of each group completed here
        r = glob0.ratio
        done = ((pos + 1) % r == 0) & (pos >= glob_from[seq])
        entry = row_tab(glob_t[glob0.table], glob0.entries_per_block, torch.div(pos, r, rounding_mode="floor"))
        group = pos.unsqueeze(1) - torch.arange(r - 1, -1, -1, device=dev)
        held = table_rows(swa_t[swa0.table][seq], swa0.block_size, group.clamp_min(0))
        req["glob_tokens"].index_copy_(0, torch.where(done, entry, 0), req["token"][held])
        # Engram n-grams: ids at p, p-1, .. from layer 0's records, below the replay start from
        # the global records (-1 before the sequence start)
        n = max(cfg.engram_max_ngram_size, 1)
        back = pos.unsqueeze(1) - torch.arange(n, device=dev)
        held_back = torch.where(back >= floor[seq].unsqueeze(1), back, -1)
        in_win = table_rows(swa_t[swa0.table][seq], swa0.block_size, held_back)
        ent = table_rows(glob_t[glob0.table][seq], glob0.entries_per_block, torch.div(back, r, rounding_mode="floor"))
        from_glob = req["glob_tokens"][ent.clamp_min(0)].gather(-1, back.clamp_min(0).remainder(r).unsqueeze(-1))
        code = torch.where(in_win >= 0, req["token"][in_win.clamp_min(0)], from_glob[..., 0]).long()
        code = torch.where(back >= 0, code, 0)
        batch = StepBatch(
            ids=ids, positions=pos, seq=seq,
            swa_tables=tuple(swa_t), glob_tables=tuple(glob_t),
            floors=torch.zeros(b + 1, 3, dtype=torch.long, device=dev), glob_from=glob_from,
            ngram_ids=torch.where(back >= 0, torch.where(code < 0, -code - 1, code), -1),
            ngram_image=(back >= 0) & (code < 0), is_image=img, image_embeds=image_embeds)
        return model(batch, pool, return_hidden=True, check=False)


def fill_layout(page: int, block_size: int, ratio: int, record: int, divides: int | None = None) -> tuple[int, int]:
    """(tokens per block, bytes per record slot) of a layer whose pages must be `page` bytes:
    the largest block of `block_size * 2^k` tokens (k <= log2 MAX_BLOCK_SCALE; the block also
    dividing `divides` when given) whose `block / ratio` records divide the page into slots of at
    least `record` bytes. k = 0 always fits: the page holds `block_size` of the largest records."""
    scale = MAX_BLOCK_SCALE
    while scale > 1:
        states = block_size * scale // ratio
        if page % states == 0 and page // states >= record and (divides is None or divides % (block_size * scale) == 0):
            break
        scale //= 2
    states = block_size * scale // ratio
    if page // states < record:
        raise ValueError(f"a record of {record} bytes does not fit a page of {page} bytes")
    return block_size * scale, page // states


def replay_length(cfg: ModelConfig, mode: str) -> int:
    """Tokens recomputed after a prefix-cache hit: the window ("window") or the window of every
    layer ("exact", the same tokens as a cold run)."""
    return cfg.sliding_window * (cfg.num_hidden_layers if mode == "exact" else 1)


def block_size_problem(cfg: ModelConfig, block_size: int, replay_tokens: int) -> str | None:
    """Why `block_size` cannot hold this model's pages (None when it can): it must be a
    multiple of every compress ratio (whole global entries per block) and divide the replay
    length (the replay start is block-aligned), naming the size that fits."""
    ratios = sorted({cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids})
    if block_size > 0 and not any(block_size % r for r in ratios) and replay_tokens % block_size == 0:
        return None
    return (f"block size {block_size} does not fit this model: it must be a multiple of every compress ratio "
            f"({ratios}) and divide the SWA replay length ({replay_tokens} tokens); pass --block-size "
            f"{default_block_size(cfg, replay_tokens)}")


def default_block_size(cfg: ModelConfig, replay_tokens: int, at_most: int = 128) -> int:
    """The block size to use when none is given: the largest power of two up to `at_most`
    (vLLM's default, 128) that fits the page layout, else the largest fitting divisor of the
    replay length (replay lengths are multiples of the window, so one always fits)."""
    step = math.lcm(*{cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids})
    fits = [b for b in range(step, at_most + 1, step) if replay_tokens % b == 0]
    if not fits:  # (a window that is no multiple of the ratios: no block size fits at all)
        raise ValueError(f"no block size fits this model: the SWA replay length ({replay_tokens} tokens) has no "
                         f"divisor that is a multiple of every compress ratio")
    powers = [b for b in fits if b & (b - 1) == 0]
    return max(powers or fits)
