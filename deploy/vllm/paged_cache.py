"""Our caches as vLLM's block manager sees them, and the adapter between vLLM's pages and the
per-sequence `SequenceCache` that `dsv41.core` computes with.

Cache layers (one `AttentionLayerBase` each, so vLLM allocates, frees and prefix-caches them):
- `GlobalKVCacheLayer` per KV-source layer: one record per `ratio` tokens (`tokens_per_state`),
  prefix-cacheable. Record = E2M1 latent (D/2 B) + E4M3 scales (D/16) + MXFP4 indexer key
  (Di/2) + E8M0 key scales (Di/32) + the `ratio` token ids of the group (int32; Engram hashing
  needs the ids before a chunk, and a prefix hit must bring them along).
- `SWACacheLayer` per backbone layer: a sliding-window cache with bounded replay
  (`SlidingWindowMLASpec(bounded_replay=True)`), so vLLM never prefix-caches it and, on a hit,
  rewinds the computed-token count by the replay length and recomputes those tokens. Record =
  FP8 latent (D) + E8M0 scales (D/32) + int32 position + 1 (0 = never written) + int32 token
  id + the compressor's carried fp32 row pair (kv, score; used by ratio-2 KV sources, whose
  partial group must survive between steps).

Validity: a window position is read only when its page is a real block (not vLLM's null block
0) and its record carries that position. A prefix hit's replay start H - R is block-aligned
(H is a multiple of the block size and so must be R, checked at start-up), so the positions
before it sit in null blocks: the window is truncated there exactly as the reference engine's
bounded replay truncates it (`SequenceCache.swa_floor`).

Every page is padded to one size (vLLM's hybrid allocator wants one page size); on the tiny
model that costs memory, not correctness (see the README's vLLM section).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec, SlidingWindowMLASpec

from ...core.cache import SequenceCache
from ...core.config import ModelConfig
from .backend import Dsv41PagedBackend

NULL_BLOCK = 0  # vLLM's null block: never holds a request's data


@dataclass(frozen=True)
class GlobalRecord:
    """Byte layout of one global KV entry (one per `ratio` tokens)."""

    d: int
    di: int
    ratio: int

    @property
    def fields(self) -> list[tuple[str, int]]:
        return [("kv_codes", self.d // 2), ("kv_scale", self.d // 16), ("key_codes", self.di // 2),
                ("key_scale", self.di // 32), ("token_ids", 4 * self.ratio), ("chain", 8)]

    @property
    def size(self) -> int:
        return sum(n for _, n in self.fields)


@dataclass(frozen=True)
class SWARecord:
    """Byte layout of one SWA ring entry (one per token)."""

    d: int
    carry: bool  # room for the compressor's carried (kv, score) fp32 rows

    @property
    def fields(self) -> list[tuple[str, int]]:
        return [("q", self.d), ("scale", self.d // 32), ("pos1", 4), ("token", 4),
                ("carry", 8 * self.d if self.carry else 0)]

    @property
    def size(self) -> int:
        return sum(n for _, n in self.fields)


def _split(raw: torch.Tensor, fields) -> dict[str, torch.Tensor]:
    out, o = {}, 0
    for name, n in fields:
        out[name] = raw[:, o:o + n]
        o += n
    return out


def chain_hash(prev: bytes, group_tokens: list[int]) -> bytes:
    """8-byte hash of a global entry's whole token prefix: the previous entry's hash + this
    entry's token ids (like vLLM's block hashes, per entry). A record whose stored hash equals
    ours was computed for the same prefix, so its value is ours too (the model is causal)."""
    import hashlib

    return hashlib.blake2b(prev + torch.tensor(group_tokens, dtype=torch.int32).numpy().tobytes(),
                           digest_size=8).digest()


def _as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret [n, k] record bytes (a strided slice of the pages) as `dtype` [n, k / size]."""
    return raw.new_empty(raw.shape).copy_(raw).view(dtype)


def _i32_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.int32).contiguous().view(torch.uint8).view(x.shape[0], -1)


class PagedLayer(nn.Module, AttentionLayerBase):
    """A cache owner registered in vLLM's forward context under `prefix`."""

    def __init__(self, prefix: str, spec: KVCacheSpec):
        super().__init__()
        self.prefix, self.spec = prefix, spec
        self.kv_cache = torch.tensor([])
        ctx = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"duplicate cache layer name: {prefix}")
        ctx[prefix] = self

    def get_attn_backend(self):
        return Dsv41PagedBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return self.spec

    def pages(self, size: int) -> torch.Tensor:
        """[num_blocks, states per block, size] uint8 view of this layer's pages."""
        kv = self.kv_cache
        if kv.dim() == 4:  # vLLM's [blocks, heads=1, states, bytes] view
            kv = kv[:, 0]
        return kv.view(torch.uint8)[..., :size]


class PagedCaches(nn.Module):
    """The cache layers of one model and the gather / scatter between pages and a
    `SequenceCache` for one request's chunk."""

    def __init__(self, cfg: ModelConfig, vllm_config: VllmConfig, prefix: str, replay_tokens: int):
        super().__init__()
        self.cfg = cfg
        bs = vllm_config.cache_config.block_size
        self.block_size = bs
        ratios = sorted({cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids})
        problems = [f"the block size ({bs}) must be a multiple of every compress ratio ({ratios})"
                    for r in ratios if bs % r][:1]
        if replay_tokens % bs:
            problems.append(f"the SWA replay length ({replay_tokens} tokens) must be a multiple of the block size "
                            f"({bs}); pass --block-size {_largest_divisor(replay_tokens, bs)}")
        if problems:
            raise ValueError("dsv41 vLLM plugin: " + "; ".join(problems))
        d, di = cfg.head_dim, cfg.index_head_dim
        self.glob_rec = {r: GlobalRecord(d, di, r) for r in ratios}
        self.swa_rec = SWARecord(d, carry=any(r > 1 for r in ratios))
        page = max([bs * self.swa_rec.size] + [bs // r * g.size for r, g in self.glob_rec.items()])
        common = dict(block_size=bs, num_kv_heads=1, dtype=torch.uint8, head_size_v=0, page_size_padded=page)
        self.glob = nn.ModuleDict({
            str(s): PagedLayer(f"{prefix}.global_kv.{s}", FullAttentionSpec(
                head_size=self.glob_rec[cfg.compress_ratios[s]].size,
                tokens_per_state=cfg.compress_ratios[s], **common))
            for s in cfg.kv_source_layer_ids})
        self.swa = nn.ModuleList(
            PagedLayer(f"{prefix}.swa.{i}", SlidingWindowMLASpec(
                head_size=self.swa_rec.size, sliding_window=replay_tokens, bounded_replay=True, **common))
            for i in range(cfg.num_hidden_layers))
        self.page_bytes = page

    # -- page addressing --
    def _where(self, row: torch.Tensor, token_pos: torch.Tensor, ratio: int):
        bs = self.block_size
        return row[torch.div(token_pos, bs, rounding_mode="floor")].long(), torch.remainder(token_pos, bs) // ratio

    def load(self, meta: dict, i: int, start: int, ids: torch.Tensor) -> SequenceCache:
        """A `SequenceCache` holding request i's state before position `start`, with room up to
        `end`: global entries and token ids from the global pages, window entries, the carried
        compressor rows and the window floor from the SWA pages."""
        cfg, w = self.cfg, self.cfg.sliding_window
        device, end = ids.device, start + ids.shape[0]
        cache = SequenceCache.allocate(cfg, end, device)
        cache.length = start
        loaded = cache.paged_loaded = {}  # source -> entries present in the pages before the chunk
        for s, layer in self.glob.items():
            s = int(s)
            g, r = cache.glob[s], cfg.compress_ratios[s]
            n_old = start // r + self._cached_entries(meta, layer, i, start, ids, r)
            if n_old:
                blk, st = self._where(self._row(meta, layer, i), torch.arange(n_old, device=device) * r, r)
                f = _split(layer.pages(self.glob_rec[r].size)[blk, st], self.glob_rec[r].fields)
                g.kv_codes[:n_old] = f["kv_codes"]
                g.kv_scale.view(torch.uint8)[:n_old] = f["kv_scale"]
                g.key_codes[:n_old] = f["key_codes"]
                g.key_scale.view(torch.uint8)[:n_old] = f["key_scale"]
            # after a prefix hit the entries of the hit's replayed tail are reused, not recomputed
            g.n, g.tokens = n_old, max(start, n_old * r)
            loaded[s] = n_old
        floor_all = []
        for li, layer in enumerate(self.swa):
            pos = torch.arange(max(0, start - w + 1), start, device=device)
            f, valid = self._swa_records(meta, layer, i, pos)
            # the window starts after the newest position this request does not hold
            bad = (~valid).nonzero()
            floor = int(pos[bad[-1, 0]]) + 1 if bad.numel() else 0
            keep = pos >= floor
            ring = cache.swa[li]
            slots = torch.remainder(pos[keep], w)
            ring.q.view(torch.uint8)[slots] = f["q"][keep]
            ring.scale.view(torch.uint8)[slots] = f["scale"][keep]
            cache.swa_floor[li] = floor
            floor_all.append(floor)
            src_ratio = cfg.compress_ratios[li] if li in cfg.kv_source_layer_ids else 0
            m = start % src_ratio if src_ratio > 1 else 0
            if m:
                if not bool(valid[-m:].all()):
                    raise RuntimeError(f"layer {li}: the compressor's carried rows before position {start} are missing")
                carry = _as(f["carry"][-m:], torch.float32).view(m, 2, cfg.head_dim)
                g = cache.glob[li]
                g.carry_kv, g.carry_score = carry[:, 0].clone(), carry[:, 1].clone()
        cache.tokens = self._history(meta, i, start, device)
        cache.is_image = [cfg.vision is not None and t == cfg.image_token_id for t in cache.tokens]
        return cache

    def store(self, meta: dict, i: int, start: int, cache: SequenceCache, ids: torch.Tensor) -> None:
        """Write back what the chunk [start, cache.length) added: new global entries (with their
        token ids), the window entries, and the carried compressor rows."""
        cfg, w, end = self.cfg, self.cfg.sliding_window, cache.length
        device = ids.device
        tokens = torch.tensor(cache.tokens, dtype=torch.int32, device=device)  # positions [0, end)
        for s, layer in self.glob.items():
            s = int(s)
            g, r = cache.glob[s], cfg.compress_ratios[s]
            n_old = cache.paged_loaded[s]
            if g.n > n_old:
                j = torch.arange(n_old, g.n, device=device)
                blk, st = self._where(self._row(meta, layer, i), j * r, r)
                tok = tokens[(j * r).unsqueeze(1) + torch.arange(r, device=device)]
                h, chain = self._chain_before(meta, layer, i, n_old, r), []
                for group in tok.tolist():
                    h = chain_hash(h, group)
                    chain.append(torch.frombuffer(bytearray(h), dtype=torch.uint8))
                rec = torch.cat((g.kv_codes[n_old:g.n], g.kv_scale[n_old:g.n].view(torch.uint8),
                                 g.key_codes[n_old:g.n], g.key_scale[n_old:g.n].view(torch.uint8),
                                 _i32_bytes(tok), torch.stack(chain).to(device)), 1)
                layer.pages(self.glob_rec[r].size)[blk, st] = rec
        pos = torch.arange(max(start, end - w), end, device=device)
        for li, layer in enumerate(self.swa):
            ring = cache.swa[li]
            slots = torch.remainder(pos, w)
            carry = torch.zeros(pos.shape[0], 8 * cfg.head_dim if self.swa_rec.carry else 0,
                                dtype=torch.uint8, device=device)
            g = cache.glob.get(li)
            if g is not None and g.carry_kv is not None:
                m = g.carry_kv.shape[0]
                rows = torch.stack((g.carry_kv, g.carry_score), 1).contiguous().view(torch.uint8).view(m, -1)
                carry[-m:] = rows
            rec = torch.cat((ring.q.view(torch.uint8)[slots], ring.scale.view(torch.uint8)[slots],
                             _i32_bytes(pos + 1), _i32_bytes(tokens[pos]), carry), 1)
            blk, st = self._where(self._row(meta, layer, i), pos, 1)
            layer.pages(self.swa_rec.size)[blk, st] = rec

    # -- helpers --
    def _chain_before(self, meta, layer, i: int, n: int, r: int) -> bytes:
        """The stored chain hash of entry n - 1 (8 zero bytes before the first entry)."""
        if n == 0:
            return bytes(8)
        blk, st = self._where(self._row(meta, layer, i), torch.tensor([(n - 1) * r]), r)
        rec = _split(layer.pages(self.glob_rec[r].size)[blk, st], self.glob_rec[r].fields)
        return bytes(rec["chain"][0].tolist())

    def _cached_entries(self, meta, layer, i: int, start: int, ids: torch.Tensor, r: int) -> int:
        """How many entries from `start` on are already in the pages for this very prefix: after
        a prefix hit of H tokens vLLM rewinds to H - R to replay the window, while the global
        entries of [H - R, H) sit in the hit's cached blocks (checked by chain hash)."""
        if start % r or start == 0:
            return 0  # replay starts are block-aligned and follow a hit
        h, n = self._chain_before(meta, layer, i, start // r, r), 0
        row, toks = self._row(meta, layer, i), ids.tolist()
        size = self.glob_rec[r].size
        for j in range(start // r, (start + len(toks)) // r):
            blk, st = self._where(row, torch.tensor([j * r]), r)
            if int(blk) == NULL_BLOCK:
                break
            h = chain_hash(h, toks[j * r - start:(j + 1) * r - start])
            stored = _split(layer.pages(size)[blk, st], self.glob_rec[r].fields)["chain"][0]
            if bytes(stored.tolist()) != h:
                break
            n += 1
        return n

    def _row(self, meta: dict, layer: PagedLayer, i: int) -> torch.Tensor:
        return meta[layer.prefix].block_table[i]

    def _swa_records(self, meta, layer, i, pos):
        blk, st = self._where(self._row(meta, layer, i), pos, 1)
        f = _split(layer.pages(self.swa_rec.size)[blk, st], self.swa_rec.fields)
        pos1 = _as(f["pos1"], torch.int32).view(-1)
        valid = (blk != NULL_BLOCK) & (pos1 == pos.to(torch.int32) + 1)
        return f, valid

    def _history(self, meta, i: int, start: int, device) -> list[int]:
        """Token ids of positions [0, start) as a list, exact over the Engram n-gram reach
        [start - (n - 1), start) (the only part read; older slots hold the pad id)."""
        cfg = self.cfg
        lo = max(0, start - (cfg.engram_max_ngram_size - 1))
        pos = torch.arange(lo, start, device=device)
        out = torch.full((start,), cfg.engram_pad_token_id, dtype=torch.int32, device=device)
        if pos.numel() == 0:
            return out.tolist()
        f, valid = self._swa_records(meta, self.swa[0], i, pos)
        got = _as(f["token"], torch.int32).view(-1)
        first = min(self.glob, key=int)
        r = cfg.compress_ratios[int(first)]
        layer = self.glob[first]
        blk, st = self._where(self._row(meta, layer, i), pos - torch.remainder(pos, r), r)
        g = _split(layer.pages(self.glob_rec[r].size)[blk, st], self.glob_rec[r].fields)
        from_glob = _as(g["token_ids"], torch.int32).view(-1, r)
        from_glob = from_glob.gather(1, torch.remainder(pos, r).unsqueeze(1)).view(-1)
        in_glob = pos < start // r * r  # complete groups are in the (possibly prefix-cached) global pages
        if not bool((valid | in_glob).all()):
            raise RuntimeError(f"token ids before position {start} are missing from the caches")
        out[lo:] = torch.where(valid, got, from_glob)
        return out.tolist()


def _largest_divisor(n: int, at_most: int) -> int:
    return max(k for k in range(1, at_most + 1) if n % k == 0)
