"""Our caches as vLLM's block manager sees them, and the adapter between vLLM's pages and the
block pools that `dsv41.core` computes with.

Interim (until the plugin hands vLLM's pages to the ops in place): every request scheduled in a
vLLM step has its state gathered from its pages into ONE private `KVPool` shared by the step (one
`SequenceState` per request, `RequestCache`), the core runs ONE batched forward over all of their
chunks (prefill chunks and decodes mixed), and what each chunk added is written back to its pages
(`PagedCaches.run_step`). The copies in and out are the interim part: they cost host time per
request and step, proportional to the window and the chunk.

Cache layers (vLLM `AttentionLayerBase`s (`layers.PagedLayer`), so vLLM allocates,
frees and prefix-caches them; this module itself needs no vLLM, so it is tested on any device):
- `GlobalKVCacheLayer` per KV-source layer: one record per `ratio` tokens (`tokens_per_state`),
  prefix-cacheable. Record = E2M1 latent (D/2 B) + E4M3 scales (D/16) + MXFP4 indexer key
  (Di/2) + E8M0 key scales (Di/32) + the `ratio` token ids of the group (int32; Engram hashing
  needs the ids before a chunk, and a prefix hit must bring them along).
- `SWACacheLayer` per backbone layer: a sliding-window cache with bounded replay
  (`SlidingWindowMLASpec(bounded_replay=True)`), so vLLM never prefix-caches it and, on a hit,
  rewinds the computed-token count by the replay length and recomputes those tokens. Record =
  FP8 latent (D) + E8M0 scales (D/32) + int32 position + 1 (0 = never written) + int32 token
  id + content digest, and in the layers of ratio-2 KV sources the compressor's carried fp32
  row pair (kv, score), whose partial group must survive between steps.

Validity: a window position is read only when its page is a real block (not vLLM's null block
0) and its record carries that position. A prefix hit's replay start H - R is block-aligned
(H is a multiple of the block size and so must be R, checked at start-up), so the positions
before it sit in null blocks: the window is truncated there exactly as the reference engine's
bounded replay truncates it (the sequence's window floors).

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

import functools
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ...core.cache import FLOOR_DECODER, FLOOR_ENCODER, KVPool, SequenceState
from ...core.config import ModelConfig

NULL_BLOCK = 0  # vLLM's null block: never holds a request's data
RECORD_ALIGN = 64  # SWA record bytes are rounded up to this, so the page splits into many sizes
MAX_BLOCK_SCALE = 16  # a global layer's block is at most this many SWA blocks (prefix-hit grain)


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
        return [("q", self.d), ("scale", self.d // 32), ("pos1", 4), ("token", 4), ("digest", 8),
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


def chain_hash(prev: bytes, group_digests: list[bytes]) -> bytes:
    """8-byte hash of a global entry's whole input prefix: the previous entry's hash + the
    content digests of this entry's positions (like vLLM's block hashes, per entry). A record
    whose stored hash equals ours was computed for the same inputs, so its value is ours too
    (the model is causal)."""
    return hashlib.blake2b(prev + b"".join(group_digests), digest_size=8).digest()


@functools.lru_cache(maxsize=1 << 18)
def _token_digest(tok: int) -> bytes:
    return hashlib.blake2b(b"t%d" % tok, digest_size=8).digest()


def content_digests(ids: torch.Tensor, is_image: torch.Tensor, image_rows: torch.Tensor | None) -> list[bytes]:
    """Per position, 8 bytes naming what the model saw there: the token id, or for an image
    position its embedding row (image tokens share one id, so the id alone would let two
    different images of one size look alike). Token digests are cached per id."""
    out, rows = [], iter(image_rows.cpu().contiguous().view(torch.uint8) if image_rows is not None else ())
    for tok, img in zip(ids.tolist(), is_image.tolist()):
        if img and image_rows is not None:
            out.append(hashlib.blake2b(b"i" + next(rows).numpy().tobytes(), digest_size=8).digest())
        else:
            out.append(_token_digest(tok))
    return out


def _as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret [n, k] record bytes (a strided slice of the pages) as `dtype` [n, k / size]."""
    return raw.new_empty(raw.shape).copy_(raw).view(dtype)


def _i32_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.int32).contiguous().view(torch.uint8).view(x.shape[0], -1)


def pages(layer, size: int) -> torch.Tensor:
    """[num_blocks, states per block, size] uint8 view of a cache layer's pages (its `kv_cache`:
    vLLM binds [blocks, heads=1, states, bytes])."""
    kv = layer.kv_cache
    if kv.dim() == 4:
        kv = kv[:, 0]
    return kv.view(torch.uint8)[..., :size]


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


@dataclass
class ScheduledChunk:
    """One request's part of a vLLM step: row `index` of the step's block tables, its tokens
    `ids` at positions start.., and its image rows (`is_image` marks the image positions)."""

    index: int
    start: int
    ids: torch.Tensor
    image_rows: torch.Tensor | None = None
    is_image: torch.Tensor | None = None


class PagedCaches(nn.Module):
    """The cache layers of one model and the gather / scatter between pages and the step's
    private pool (`RequestCache` per request; interim, see the module docstring)."""

    def __init__(self, cfg: ModelConfig, block_size: int, prefix: str, replay_tokens: int,
                 make_layer: Callable[[LayerRequest], nn.Module]):
        super().__init__()
        self.cfg = cfg
        bs = self.block_size = block_size
        ratios = sorted({cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids})
        problem = block_size_problem(cfg, bs, replay_tokens)
        if problem:
            raise ValueError("dsv41 vLLM plugin: " + problem)
        d, di = cfg.head_dim, cfg.index_head_dim
        self.glob_rec = {r: GlobalRecord(d, di, r) for r in ratios}
        # only the ratio-2 KV sources carry compressor rows between chunks
        carried = {s for s in cfg.kv_source_layer_ids if cfg.compress_ratios[s] > 1}
        self.swa_recs = [SWARecord(d, carry=li in carried) for li in range(cfg.num_hidden_layers)]
        page = self.page_bytes = bs * max(-(-r.size // RECORD_ALIGN) * RECORD_ALIGN for r in self.swa_recs)
        reqs = []
        for s in cfg.kv_source_layer_ids:
            r = cfg.compress_ratios[s]
            block, slot = fill_layout(page, bs, r, self.glob_rec[r].size)
            reqs.append(LayerRequest(f"{prefix}.global_kv.{s}", "global", slot, r, block, 0, page))
        for li, rec in enumerate(self.swa_recs):
            # a window block must divide the replay length: the replay start is block-aligned
            block, slot = fill_layout(page, bs, 1, rec.size, divides=replay_tokens)
            reqs.append(LayerRequest(f"{prefix}.swa.{li}", "swa", slot, 1, block, replay_tokens, page))
        self.block_sizes = {q.prefix: q.block_size for q in reqs}  # tokens per block, per layer
        self.glob = nn.ModuleDict({q.prefix.rsplit(".", 1)[1]: make_layer(q) for q in reqs if q.kind == "global"})
        self.swa = nn.ModuleList(make_layer(q) for q in reqs if q.kind == "swa")

    # -- page addressing --
    def _where(self, layer, row: torch.Tensor, token_pos: torch.Tensor, ratio: int):
        """(block id, state index in the block) of each token position in `layer`'s pages."""
        bs = self.block_sizes[layer.prefix]
        return row[torch.div(token_pos, bs, rounding_mode="floor")].long(), torch.remainder(token_pos, bs) // ratio

    def load(self, meta: dict, i: int, start: int, ids: torch.Tensor, image_rows: torch.Tensor | None = None,
             is_image: torch.Tensor | None = None, pool: KVPool | None = None,
             windows: bool = True) -> "RequestCache":
        """Request i's state before position `start`, in `pool` (the step's private pool; a new
        one when None) with blocks up to the chunk's end: global entries and token ids from the
        global pages, and (`windows`; else the caller runs `_load_windows` for the whole step)
        window entries, the carried compressor rows and the window floor from the SWA pages."""
        cfg = self.cfg
        device, end = ids.device, start + ids.shape[0]
        rc = RequestCache.allocate(cfg, start, end, device, pool)
        if is_image is None:
            is_image = torch.zeros_like(ids, dtype=torch.bool)
        rc.digests = content_digests(ids, is_image, image_rows)  # the chunk's positions
        glob_from = end
        for s, layer in self.glob.items():
            s = int(s)
            g, r = rc.pool.glob[s], cfg.compress_ratios[s]
            n_old = start // r + self._cached_entries(meta, layer, i, start, rc.digests, r)
            if n_old:
                blk, st = self._where(layer, self._row(meta, layer, i), torch.arange(n_old, device=device) * r, r)
                f = _split(pages(layer, self.glob_rec[r].size)[blk, st], self.glob_rec[r].fields)
                rows = rc.entry_rows(s, n_old)
                g.kv_codes[rows] = f["kv_codes"]
                g.kv_scale.view(torch.uint8)[rows] = f["kv_scale"]
                g.key_codes[rows] = f["key_codes"]
                g.key_scale.view(torch.uint8)[rows] = f["key_scale"]
            # after a prefix hit the entries of the hit's replayed tail are reused, not recomputed
            glob_from = min(glob_from, max(start, n_old * r))
            rc.loaded[s] = n_old
        rc.state.glob_from = glob_from
        if windows:
            self._load_windows(meta, [(i, start, rc)])
        rc.state.tokens = self._history(meta, i, start, device)
        rc.state.is_image = [cfg.vision is not None and t == cfg.image_token_id for t in rc.state.tokens]
        return rc

    def _load_windows(self, meta: dict, items: list[tuple[int, int, "RequestCache"]]) -> None:
        """For each (request i, chunk start, its RequestCache): the window entries before
        `start`, the carried compressor rows and the window floors, from the SWA pages (one
        gather per layer for all the requests)."""
        cfg, w = self.cfg, self.cfg.sliding_window
        device = items[0][2].pool.device
        pos, req, rows = [], [], []
        for k, (_, start, rc) in enumerate(items):
            p = torch.arange(max(0, start - w + 1), start, device=device)
            pos.append(p)
            req.append(torch.full_like(p, k))
            rows.append(rc.swa_rows(p))
        pos, req, rows = torch.cat(pos), torch.cat(req), torch.cat(rows)
        table_row = torch.tensor([i for i, _, _ in items], device=device)[req]
        starts = torch.tensor([start for _, start, _ in items], device=device)
        floors = torch.zeros(len(self.swa), len(items), dtype=torch.long, device=device)
        for li, layer in enumerate(self.swa):
            f, valid = self._swa_records_many(meta, layer, table_row, pos)
            # a request's window starts after the newest position it does not hold
            floor = torch.zeros(len(items), dtype=torch.long, device=device).scatter_reduce(
                0, req, torch.where(valid, 0, pos + 1), "amax")
            keep = pos >= floor[req]
            ring = items[0][2].pool.swa[li]
            ring.kv.view(torch.uint8)[rows[keep]] = f["q"][keep]
            ring.scale.view(torch.uint8)[rows[keep]] = f["scale"][keep]
            floors[li] = floor
            src_ratio = cfg.compress_ratios[li] if li in cfg.kv_source_layer_ids else 0
            if src_ratio > 1:  # the rows of the group each request's chunk starts inside of
                carried = pos >= (starts - starts % src_ratio)[req]
                if not bool(valid[carried].all()):
                    first = int(req[carried & ~valid][0])
                    raise RuntimeError(f"layer {li}: the compressor's carried rows before position "
                                       f"{items[first][1]} are missing")
                if bool(carried.any()):
                    carry = _as(f["carry"][carried], torch.float32).view(-1, 2, cfg.head_dim)
                    items[0][2].pool.carry[li][rows[carried]] = carry
        dec, n_layers = cfg.decoder_start, len(self.swa)
        enc_floor = floors[:dec].amax(0).tolist() if dec else [0] * len(items)
        dec_floor = floors[dec:].amax(0).tolist() if dec < n_layers else [0] * len(items)
        for k, (_, _, rc) in enumerate(items):
            rc.state.floors[FLOOR_ENCODER], rc.state.floors[FLOOR_DECODER] = enc_floor[k], dec_floor[k]

    def run_step(self, model, meta: dict, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """One vLLM step: every request's state loaded into one private pool, ONE forward of the
        core model over all chunks (collapsed final streams of every row, in chunk order), then
        each request's additions stored back to its pages."""
        from ...core.batch import Chunk, build_step

        if not chunks:
            raise ValueError("a step needs at least one chunk")
        device = chunks[0].ids.device
        pool = step_pool(self.cfg, [c.start + c.ids.shape[0] for c in chunks], device)
        rcs = [self.load(meta, c.index, c.start, c.ids, c.image_rows, c.is_image, pool, windows=False) for c in chunks]
        self._load_windows(meta, [(c.index, c.start, rc) for c, rc in zip(chunks, rcs)])
        image_token = self.cfg.image_token_id if self.cfg.vision is not None else None
        batch = build_step(self.cfg, pool, [Chunk(rc.state, c.ids.tolist(), 0, "all", c.image_rows)
                                            for rc, c in zip(rcs, chunks)], device, image_token)
        h = model(batch, pool, return_hidden=True, check=False)
        for rc, c in zip(rcs, chunks):
            self.store(meta, c.index, c.start, rc, c.ids)
        return h

    def run_chunk(self, model, meta: dict, i: int, start: int, ids: torch.Tensor,
                  image_rows: torch.Tensor | None = None, is_image: torch.Tensor | None = None) -> torch.Tensor:
        """A step of one request: request i's chunk `ids` at positions start.. (`run_step`)."""
        return self.run_step(model, meta, [ScheduledChunk(i, start, ids, image_rows, is_image)])

    def store(self, meta: dict, i: int, start: int, rc: "RequestCache", ids: torch.Tensor) -> None:
        """Write back what the chunk [start, end) added: new global entries (with their token
        ids), the window entries, and the compressor rows of ratio-2 sources."""
        cfg, w, end = self.cfg, self.cfg.sliding_window, rc.state.length
        device = ids.device
        tokens = torch.tensor(rc.state.tokens[:end], dtype=torch.int32, device=device)  # positions [0, end)
        for s, layer in self.glob.items():
            s = int(s)
            g, r = rc.pool.glob[s], cfg.compress_ratios[s]
            n_old, n_new = rc.loaded[s], end // r
            if n_new > n_old:
                j = torch.arange(n_old, n_new, device=device)
                blk, st = self._where(layer, self._row(meta, layer, i), j * r, r)
                tok = tokens[(j * r).unsqueeze(1) + torch.arange(r, device=device)]
                h, chain = self._chain_before(meta, layer, i, n_old, r), []
                for jj in j.tolist():
                    h = chain_hash(h, [self._digest(meta, i, p, start, rc) for p in range(jj * r, (jj + 1) * r)])
                    chain.append(torch.frombuffer(bytearray(h), dtype=torch.uint8))
                rows = rc.entry_rows(s, n_new)[n_old:]
                rec = torch.cat((g.kv_codes[rows], g.kv_scale[rows].view(torch.uint8),
                                 g.key_codes[rows], g.key_scale[rows].view(torch.uint8),
                                 _i32_bytes(tok), torch.stack(chain).to(device)), 1)
                pages(layer, self.glob_rec[r].size)[blk, st] = rec
        pos = torch.arange(max(start, end - w), end, device=device)
        rows = rc.swa_rows(pos)
        digests = b"".join(rc.digests[p - start] for p in range(int(pos[0]), end)) if pos.numel() else b""
        # the record's tail after the latent is the same in every layer (carry aside)
        tail = torch.cat((_i32_bytes(pos + 1), _i32_bytes(tokens[pos]),
                          torch.frombuffer(bytearray(digests), dtype=torch.uint8).view(-1, 8).to(device)), 1)
        for li, layer in enumerate(self.swa):
            ring, rec_layout = rc.pool.swa[li], self.swa_recs[li]
            parts = [ring.kv.view(torch.uint8)[rows], ring.scale.view(torch.uint8)[rows], tail]
            if rec_layout.carry:
                parts.append(rc.pool.carry[li][rows].contiguous().view(torch.uint8).view(pos.shape[0], -1))
            blk, st = self._where(layer, self._row(meta, layer, i), pos, 1)
            pages(layer, rec_layout.size)[blk, st] = torch.cat(parts, 1)

    # -- helpers --
    def _chain_before(self, meta, layer, i: int, n: int, r: int) -> bytes:
        """The stored chain hash of entry n - 1 (8 zero bytes before the first entry)."""
        if n == 0:
            return bytes(8)
        row = self._row(meta, layer, i)
        blk, st = self._where(layer, row, torch.tensor([(n - 1) * r], device=row.device), r)
        rec = _split(pages(layer, self.glob_rec[r].size)[blk, st], self.glob_rec[r].fields)
        return bytes(rec["chain"][0].tolist())

    def _digest(self, meta, i: int, p: int, start: int, rc: "RequestCache") -> bytes:
        """Content digest of position p: this chunk's, or (the first position of a ratio-2 group
        begun in the previous chunk) the one stored in layer 0's window record."""
        if p >= start:
            return rc.digests[p - start]
        f, valid = self._swa_records(meta, self.swa[0], i, torch.tensor([p], device=rc.pool.device))
        if not bool(valid.all()):
            raise RuntimeError(f"the content digest of position {p} is missing from the window pages")
        return bytes(f["digest"][0].tolist())

    def _cached_entries(self, meta, layer, i: int, start: int, digests: list[bytes], r: int) -> int:
        """How many entries from `start` on are already in the pages for this very prefix: after
        a prefix hit of H tokens vLLM rewinds to H - R to replay the window, while the global
        entries of [H - R, H) sit in the hit's cached blocks (checked by chain hash)."""
        if start % self.block_size or start == 0:
            return 0  # replay starts are block-aligned (and multiples of r) and follow a hit
        h, n = self._chain_before(meta, layer, i, start // r, r), 0
        row = self._row(meta, layer, i)
        size = self.glob_rec[r].size
        for j in range(start // r, (start + len(digests)) // r):
            blk, st = self._where(layer, row, torch.tensor([j * r], device=row.device), r)
            if int(blk) == NULL_BLOCK:
                break
            h = chain_hash(h, digests[j * r - start:(j + 1) * r - start])
            stored = _split(pages(layer, size)[blk, st], self.glob_rec[r].fields)["chain"][0]
            if bytes(stored.tolist()) != h:
                break
            n += 1
        return n

    def _row(self, meta: dict, layer, i: int) -> torch.Tensor:
        return meta[layer.prefix].block_table[i]

    def _swa_records(self, meta, layer, i: int, pos: torch.Tensor):
        """(record fields, valid) of request i's window records at positions `pos`."""
        return self._swa_records_many(meta, layer, torch.full_like(pos, i), pos)

    def _swa_records_many(self, meta, layer, table_row: torch.Tensor, pos: torch.Tensor):
        """(record fields, valid) of window records at positions `pos`, each of the request
        whose block-table row is `table_row`; valid: a real block holding that very position."""
        rec = self.swa_recs[int(layer.prefix.rsplit(".", 1)[1])]
        bs = self.block_sizes[layer.prefix]
        table = meta[layer.prefix].block_table
        blk = table[table_row, torch.div(pos, bs, rounding_mode="floor")].long()
        f = _split(pages(layer, rec.size)[blk, torch.remainder(pos, bs)], rec.fields)
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
        blk, st = self._where(layer, self._row(meta, layer, i), pos - torch.remainder(pos, r), r)
        g = _split(pages(layer, self.glob_rec[r].size)[blk, st], self.glob_rec[r].fields)
        from_glob = _as(g["token_ids"], torch.int32).view(-1, r)
        from_glob = from_glob.gather(1, torch.remainder(pos, r).unsqueeze(1)).view(-1)
        # complete groups are in the (possibly prefix-cached) global pages
        in_glob = (pos < start // r * r) & (blk != NULL_BLOCK)
        if not bool((valid | in_glob).all()):
            raise RuntimeError(f"token ids before position {start} are missing from the caches")
        out[lo:] = torch.where(valid, got, from_glob)
        return out.tolist()


def private_block_size(cfg: ModelConfig) -> int:
    """Block size of the step's private pool (any multiple of every compress ratio works)."""
    return math.lcm(16, *(cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids))


def step_pool(cfg: ModelConfig, ends: list[int], device) -> KVPool:
    """A private pool with room for every request of a step up to its chunk's end (the null
    block included), so no block is taken by growing the pool mid-load."""
    bs = private_block_size(cfg)
    n = sum(-(-end // bs) for end in ends) + 1
    return KVPool(cfg, block_size=bs, swa_blocks=n, global_blocks=n, device=device, drafter=False)


@dataclass
class RequestCache:
    """One request's state gathered from vLLM's pages into a private pool (the step's, shared
    with the step's other requests) whose blocks cover its positions 0 .. end, and what the
    adapter needs to write the chunk back."""

    pool: KVPool
    state: SequenceState
    loaded: dict  # KV source -> entries present in the pages before the chunk
    digests: list

    @classmethod
    def allocate(cls, cfg: ModelConfig, start: int, end: int, device, pool: KVPool | None = None) -> "RequestCache":
        if pool is None:
            pool = step_pool(cfg, [end], device)
        state = SequenceState()
        state.ensure_blocks(pool, end)
        state.length = start
        return cls(pool, state, {}, [])

    def entry_rows(self, src: int, n: int) -> torch.Tensor:
        """Pool rows of global entries 0 .. n-1 of KV source `src`."""
        e = self.pool.glob[src].entries_per_block
        j = torch.arange(n, device=self.pool.device)
        return torch.tensor(self.state.glob_blocks, device=self.pool.device)[j // e] * e + j % e

    def swa_rows(self, pos: torch.Tensor) -> torch.Tensor:
        """Pool rows of window / compressor entries at positions `pos`."""
        bs = self.pool.block_size
        return torch.tensor(self.state.swa_blocks, device=pos.device)[pos // bs] * bs + pos % bs


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
