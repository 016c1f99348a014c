"""Paged caches in their real storage formats (MODEL.md section 4), shared by many sequences.

Every cache kind lives in a pool of fixed-size blocks; a sequence reaches its blocks through a
block table (one per kind), as in vLLM. Block 0 of every pool is the null block: it never holds
a sequence's data, table slots that hold nothing point at it, and writes that must not land
anywhere (tokens whose global entries are shared prefix blocks, rows that complete no
compressor group) are sent to it.

- Global KV (`GlobalPool`, per KV-source layer): one entry per `ratio` tokens, packed E2M1 bytes
  + an E4M3 scale per 16 channels (288 B per 512-wide entry) and the MXFP4 indexer key (64 B + 4
  E8M0 scales). A block covers `block_size` tokens, i.e. `block_size / ratio` entries, so one
  global block table addresses every KV source and prefix blocks are shared across all of them.
- SWA (per backbone layer and per DSpark stage): FP8 E4M3 rows + an E8M0 scale per 32 channels,
  addressed by position through the SWA block table. Blocks that fall out of every future window
  are freed by the engine (vLLM's sliding-window allocation), so a chunk of any length writes all
  of its rows before its queries read their windows. Never persisted: rebuilt by bounded replay.
- Compressor rows (per ratio > 1 KV source): each token's fp32 (kv, score) rows at its position,
  through the SWA table: a compressor group that spans two steps finds its earlier rows there.

Host-side bookkeeping (`SequenceState`) holds what the engine knows before a step: token ids,
lengths, block lists and the floors bounded replay and CED put on the window. Rolling back a
speculative verification only moves `length` back: every entry is addressed by position, so
rejected tokens' rows are simply overwritten later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..backends.paging import NULL_BLOCK, write_rows
from ..backends.platform import storage_dtype
from .config import ModelConfig

# window floors are kept per layer group: encoder layers, decoder layers, DSpark stages
FLOOR_ENCODER, FLOOR_DECODER, FLOOR_DRAFT = 0, 1, 2


def pool_zeros(shape, dtype, device) -> torch.Tensor:
    """A zeroed pool tensor of logical dtype `dtype`, held in the device's storage dtype for it
    (uint8 bytes for float8 data on an NPU: `backends.platform.storage_dtype`)."""
    return torch.zeros(shape, dtype=storage_dtype(dtype, device), device=device)


def e8m0_ones(shape, device) -> torch.Tensor:
    """E8M0 scales of 1.0 (byte 127): unwritten rows decode to finite values."""
    ones = torch.full(shape, 127, dtype=torch.uint8, device=device)
    return ones.view(storage_dtype(torch.float8_e8m0fnu, device))


@dataclass
class GlobalPool:
    """Compressed entries of one KV source layer, `entries_per_block` per block, addressed
    through the step's global table number `table`. The tensors may be row-strided views (a
    field of vLLM's page records): only their rows are addressed."""

    ratio: int
    entries_per_block: int
    kv_codes: torch.Tensor  # [blocks * E, D/2] uint8
    kv_scale: torch.Tensor  # [blocks * E, D/16] float8_e4m3fn
    key_codes: torch.Tensor  # [blocks * E, Di/2] uint8
    key_scale: torch.Tensor  # [blocks * E, Di/32] float8_e8m0fnu
    table: int = 0

    def nbytes_per_entry(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in (self.kv_codes, self.kv_scale, self.key_codes, self.key_scale))


@dataclass
class SWAPool:
    """FP8 window rows of one layer, one per token position, `block_size` positions per block,
    addressed through the step's SWA table number `table` (the layer's compressor rows, when it
    is a ratio-2 KV source, use the same addresses). Row-strided views allowed."""

    kv: torch.Tensor  # [blocks * block_size, D] float8_e4m3fn
    scale: torch.Tensor  # [blocks * block_size, D/32] float8_e8m0fnu
    block_size: int = 16
    table: int = 0

    def write(self, rows: torch.Tensor, kv: torch.Tensor, scale: torch.Tensor) -> None:
        write_rows((self.kv, self.scale), rows, (kv, scale))


class KVPool:
    """The block pools of every cache kind, and their free lists (host side).

    Two ways to build one: `KVPool(cfg, block_size=..)` owns its tensors (one block size, one
    table per kind, grown on demand: the reference engine); `KVPool.over(..)` wraps tensors
    someone else allocates and addresses (vLLM's pages: a block size and a table per layer, no
    allocation here)."""

    def __init__(self, cfg: ModelConfig, *, block_size: int = 16, swa_blocks: int = 8, global_blocks: int = 8,
                 device: torch.device | str = "cpu", drafter: bool | None = None):
        ratios = {cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids}
        if any(block_size % r for r in ratios):
            raise ValueError(f"block_size {block_size} must be a multiple of every compress ratio {sorted(ratios)}")
        self.cfg, self.block_size, self.device = cfg, block_size, torch.device(device)
        n_draft = cfg.num_nextn_predict_layers if (drafter is None or drafter) else 0
        self.n_swa_layers = cfg.num_hidden_layers + max(n_draft, 0)
        self.swa: list[SWAPool] = []
        self.carry: dict[int, torch.Tensor] = {}
        self.glob: dict[int, GlobalPool] = {}
        self.swa_capacity = self.global_capacity = 0
        self._free_swa: list[int] = []
        self._free_glob: list[int] = []
        self.glob_refs: list[int] = []  # references per global block (prefix sharing)
        self.fixed = False  # set once captured graphs hold the pool tensors: no more growing
        self.external = False  # tensors owned (and blocks allocated) by someone else
        self.evictor = None  # () -> a cached global block nobody holds, or None (the prefix cache)
        self.grow(swa_blocks, global_blocks)

    @classmethod
    def over(cls, cfg: ModelConfig, swa: list[SWAPool], carry: dict[int, torch.Tensor],
             glob: dict[int, GlobalPool], device: torch.device | str) -> "KVPool":
        """A pool over tensors allocated elsewhere (e.g. strided field views of vLLM's pages),
        each pool with its own block size and table number; the owner allocates blocks, so
        nothing here grows or frees. `carry[s]` [rows, 2, D] fp32 shares layer s's SWA rows."""
        if len(swa) != cfg.num_hidden_layers and len(swa) != cfg.num_hidden_layers + cfg.num_nextn_predict_layers:
            raise ValueError(f"expected a window pool per layer ({cfg.num_hidden_layers}), got {len(swa)}")
        missing = [s for s in cfg.kv_source_layer_ids if s not in glob
                   or (cfg.compress_ratios[s] > 1 and s not in carry)]
        if missing:
            raise ValueError(f"KV source layers {missing} lack their global pool or compressor rows")
        pool = cls.__new__(cls)
        pool.cfg, pool.block_size, pool.device = cfg, None, torch.device(device)
        pool.n_swa_layers, pool.swa, pool.carry, pool.glob = len(swa), swa, carry, glob
        pool.swa_capacity = pool.global_capacity = 0
        pool._free_swa, pool._free_glob, pool.glob_refs = [], [], []
        pool.fixed, pool.external, pool.evictor = True, True, None
        return pool

    # -- memory --
    def nbytes(self) -> int:
        """Bytes of every pool tensor (window rows and scales, compressor rows, global entries)."""
        ts = [p.kv for p in self.swa] + [p.scale for p in self.swa] + list(self.carry.values())
        for g in self.glob.values():
            ts += [g.kv_codes, g.kv_scale, g.key_codes, g.key_scale]
        return sum(t.numel() * t.element_size() for t in ts)

    def _alloc_swa(self, n_blocks: int):
        cfg, rows = self.cfg, n_blocks * self.block_size
        d = cfg.head_dim
        swa = [SWAPool(pool_zeros((rows, d), torch.float8_e4m3fn, self.device),
                       e8m0_ones((rows, d // 32), self.device), self.block_size) for _ in range(self.n_swa_layers)]
        carry = {s: torch.zeros(rows, 2, d, dtype=torch.float32, device=self.device)
                 for s in self.cfg.kv_source_layer_ids if cfg.compress_ratios[s] > 1}
        return swa, carry

    def _alloc_glob(self, n_blocks: int) -> dict[int, GlobalPool]:
        cfg, out = self.cfg, {}
        d, di = cfg.head_dim, cfg.index_head_dim
        for s in cfg.kv_source_layer_ids:
            r = cfg.compress_ratios[s]
            e = self.block_size // r
            n = n_blocks * e
            out[s] = GlobalPool(r, e, torch.zeros(n, d // 2, dtype=torch.uint8, device=self.device),
                                pool_zeros((n, d // 16), torch.float8_e4m3fn, self.device),
                                torch.zeros(n, di // 2, dtype=torch.uint8, device=self.device),
                                e8m0_ones((n, di // 32), self.device))
        return out

    def grow(self, swa_blocks: int, global_blocks: int) -> None:
        """Make room for at least this many blocks of each kind (null block included); existing
        contents are kept. Only between steps: pool tensors are replaced."""
        if self.external and (swa_blocks > self.swa_capacity or global_blocks > self.global_capacity):
            raise RuntimeError("this pool wraps tensors allocated elsewhere: blocks come from their owner")
        if self.fixed and (swa_blocks > self.swa_capacity or global_blocks > self.global_capacity):
            raise RuntimeError(f"out of KV cache blocks ({self.swa_capacity} SWA, {self.global_capacity} global; "
                               "the pools are fixed while decode graphs hold them): lower the batch or the length")
        if swa_blocks > self.swa_capacity:
            swa, carry = self._alloc_swa(swa_blocks)
            for new, old in zip(swa, self.swa):
                new.kv[: old.kv.shape[0]] = old.kv
                new.scale.view(torch.uint8)[: old.scale.shape[0]] = old.scale.view(torch.uint8)
            for s, old in self.carry.items():
                carry[s][: old.shape[0]] = old
            self._free_swa += range(max(self.swa_capacity, 1), swa_blocks)
            self.swa, self.carry, self.swa_capacity = swa, carry, swa_blocks
        if global_blocks > self.global_capacity:
            glob = self._alloc_glob(global_blocks)
            for s, old in self.glob.items():
                for name in ("kv_codes", "kv_scale", "key_codes", "key_scale"):
                    src, dst = getattr(old, name), getattr(glob[s], name)
                    if src.dtype == torch.float8_e8m0fnu:
                        src, dst = src.view(torch.uint8), dst.view(torch.uint8)
                    dst[: src.shape[0]] = src
            self._free_glob += range(max(self.global_capacity, 1), global_blocks)
            self.glob_refs += [0] * (global_blocks - len(self.glob_refs))
            self.glob, self.global_capacity = glob, global_blocks

    # -- blocks --
    def take_swa(self) -> int:
        if not self._free_swa:
            self.grow(max(2, self.swa_capacity * 2), self.global_capacity)
        return self._free_swa.pop()

    def free_swa(self, block: int) -> None:
        if block != NULL_BLOCK:
            self._free_swa.append(block)

    def take_global(self) -> int:
        """A free global block; when none is free, an unreferenced prefix-cached block (LRU),
        and only then more memory."""
        if not self._free_glob and self.evictor is not None:
            b = self.evictor()
            if b is not None:
                self.glob_refs[b] = 1
                return b
        if not self._free_glob:
            self.grow(self.swa_capacity, max(2, self.global_capacity * 2))
        b = self._free_glob.pop()
        self.glob_refs[b] = 1
        return b

    def ref_global(self, block: int) -> None:
        self.glob_refs[block] += 1

    def release_global(self, block: int, keep=None) -> None:
        """Drop one reference; a block nobody holds goes back to the free list unless `keep(block)`
        (the prefix cache keeps it, evictable, until the memory is needed)."""
        if block == NULL_BLOCK:
            return
        self.glob_refs[block] -= 1
        if self.glob_refs[block] == 0 and not (keep is not None and keep(block)):
            self._free_glob.append(block)

    def reclaim_global(self, block: int) -> None:
        """A kept block the prefix cache no longer indexes, back to the free list."""
        if self.glob_refs[block] == 0:
            self._free_glob.append(block)

    @property
    def free_global_blocks(self) -> int:
        return len(self._free_glob)


class BlockTable(list):
    """A block list (logical block -> pool block) that keeps an int64 tensor copy of itself, so
    a step's tables are built from tensors instead of converting every sequence's whole list on
    every step (at a 32K context and 64 sequences that conversion alone took ~15 ms a table).
    Appends and single-element writes update the copy in place; any other change rebuilds it
    on the next `tensor()` / `padded()`. The copy's entries past the list's end are always
    NULL_BLOCK, so equal-width views of several tables stack into a step's padded table.
    `version` counts the changes (any kind), so a step can tell which tables moved since the last."""

    def __init__(self, blocks=()):
        super().__init__(blocks)
        self._buf = torch.tensor(list(self), dtype=torch.long) if len(self) else _null_blocks(16)
        self._valid = True
        self.version = 0

    def __reduce__(self):  # copies and pickles get their own tensor copy, never this one's
        return BlockTable, (list(self),)

    def tensor(self) -> torch.Tensor:
        """The blocks as a 1-D int64 CPU tensor (a view: copy it before keeping it)."""
        return self.padded(len(self))

    def padded(self, width: int) -> torch.Tensor:
        """The blocks as a 1-D int64 CPU tensor view of `width` >= len entries, NULL_BLOCK past
        the end (a view: copy it before keeping it)."""
        n = len(self)
        if width < n:
            raise ValueError(f"a block table of {n} blocks does not fit {width} columns")
        if not self._valid or self._buf.shape[0] < width:
            buf = _null_blocks(max(width, 16))
            buf[:n] = self._buf[:n] if self._valid else torch.tensor(list(self), dtype=torch.long)
            self._buf, self._valid = buf, True
        return self._buf[:width]

    def append(self, block: int) -> None:
        n = len(self)
        super().append(block)
        self.version += 1
        if self._valid:
            if self._buf.shape[0] <= n:  # double the copy's capacity
                self._buf = torch.cat([self._buf[:n], _null_blocks(max(16, n))])
            self._buf[n] = block

    def __setitem__(self, i, value) -> None:
        super().__setitem__(i, value)
        self.version += 1
        if isinstance(i, int) and self._valid:
            self._buf[i + len(self) if i < 0 else i] = value  # (the list's index, not the copy's)
        else:
            self._valid = False


def _null_blocks(n: int) -> torch.Tensor:
    """n int64 NULL_BLOCK entries (a block table copy's spare capacity)."""
    return torch.full((n,), NULL_BLOCK, dtype=torch.long)


def _invalidating(name: str):
    """A list method that changes the list in a way the copy does not follow."""
    base = getattr(list, name)

    def method(self, *args):
        self._valid = False
        self.version += 1
        return base(self, *args)

    method.__name__ = name
    return method


for _name in ("extend", "insert", "pop", "remove", "clear", "sort", "reverse", "__delitem__", "__iadd__",
              "__imul__"):
    setattr(BlockTable, _name, _invalidating(_name))


@dataclass
class SequenceState:
    """What the engine knows about one sequence's cache before a step (host side). Block lists
    assigned to it become `BlockTable`s."""

    tokens: list[int] = field(default_factory=list)  # ids at positions 0 .. (Engram hashing)
    is_image: list[bool] = field(default_factory=list)
    length: int = 0  # positions whose rows are in the caches
    swa_blocks: list[int] = field(default_factory=BlockTable)  # logical SWA block -> pool block (0 = freed)
    glob_blocks: list[int] = field(default_factory=BlockTable)  # logical global block -> pool block
    floors: list[int] = field(default_factory=lambda: [0, 0, 0])  # lowest visible position per layer group
    glob_from: int = 0  # positions below this have their global entries already (shared prefix)
    draft_length: int = 0  # DSpark context positions written (0 .. draft_length - 1)
    swa_freed: int = 0  # SWA blocks below this index are freed (NULL): `free_old_swa` starts here

    def __setattr__(self, name, value) -> None:
        if name in ("swa_blocks", "glob_blocks"):
            if not isinstance(value, BlockTable):
                value = BlockTable(value)
            if name == "swa_blocks":  # a new list: nothing of it is known to be freed
                object.__setattr__(self, "swa_freed", 0)
        object.__setattr__(self, name, value)

    def ensure_blocks(self, pool: KVPool, end: int) -> None:
        """Blocks for every position below `end` (SWA, compressor rows and global entries); an
        external pool's blocks come from its owner, who fills the step's tables."""
        if pool.external:
            return
        n = -(-end // pool.block_size)
        while len(self.swa_blocks) < n:
            self.swa_blocks.append(pool.take_swa())
        while len(self.glob_blocks) < n:
            self.glob_blocks.append(pool.take_global())

    def free_old_swa(self, pool: KVPool, keep_from: int) -> None:
        """Free SWA blocks whose positions all lie below `keep_from` (out of every future window)."""
        last = min(keep_from // pool.block_size, len(self.swa_blocks))  # blocks 0 .. last-1 end at or below keep_from
        for i in range(self.swa_freed, last):  # (those below swa_freed are freed already)
            if self.swa_blocks[i] != NULL_BLOCK:
                pool.free_swa(self.swa_blocks[i])
                self.swa_blocks[i] = NULL_BLOCK
        self.swa_freed = max(self.swa_freed, last)

    def release(self, pool: KVPool, keep=None) -> None:
        """Give every block back (global ones through their reference counts)."""
        for b in self.swa_blocks:
            pool.free_swa(b)
        for b in self.glob_blocks:
            pool.release_global(b, keep)
        self.swa_blocks, self.glob_blocks = BlockTable(), BlockTable()


def kv_bytes_per_token(cfg: ModelConfig) -> float:
    """Persistent global KV bytes per token: sum over KV sources of (main + indexer key) / ratio."""
    main = cfg.head_dim // 2 + cfg.head_dim // 16  # E2M1 bytes + E4M3 scales per 16
    key = cfg.index_head_dim // 2 + cfg.index_head_dim // 32  # MXFP4 bytes + E8M0 per 32
    return sum((main + key) / cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids)


def swa_bytes_per_sequence(cfg: ModelConfig) -> int:
    """FP8 window bytes of one sequence: every backbone layer keeps `sliding_window` rows of
    head_dim E4M3 bytes + one E8M0 scale per 32 channels."""
    return cfg.num_hidden_layers * cfg.sliding_window * (cfg.head_dim + cfg.head_dim // 32)
