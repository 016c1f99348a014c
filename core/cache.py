"""Per-sequence caches in their real storage formats (MODEL.md section 4).

- Global KV per KV-source layer: packed E2M1 bytes + one E4M3 scale per 16 channels (288 B per
  512-wide entry) and the MXFP4 indexer key (64 B + 4 E8M0 scales); one entry per `ratio` tokens.
- SWA: an FP8 E4M3 ring of `sliding_window` slots per layer (slot = pos % window) with an E8M0
  scale per 32 channels; never persisted, rebuilt by bounded replay.
- Compressor state: the carried partial group (fp32 kv and score rows) per ratio-2 Full layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import ModelConfig


@dataclass
class GlobalKV:
    """Compressed entries of one KV source layer."""

    ratio: int
    kv_codes: torch.Tensor  # [cap, D/2] uint8
    kv_scale: torch.Tensor  # [cap, D/16] float8_e4m3fn
    key_codes: torch.Tensor  # [cap, Di/2] uint8
    key_scale: torch.Tensor  # [cap, Di/32] float8_e8m0fnu
    n: int = 0  # entries written
    tokens: int = 0  # tokens consumed (n * ratio + rows in the carried group)
    # carried partial group (ratio 2): fp32 rows of kv and score not yet pooled
    carry_kv: torch.Tensor | None = None
    carry_score: torch.Tensor | None = None
    # while a speculative checkpoint is open: (first token, kv rows, score rows) of the last
    # chunk's un-pooled rows (carried rows included), so a rollback can rebuild the carry
    keep_rows: bool = False
    rows: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def state(self) -> tuple:
        """The scalar state and carry (entries are append-only: [0, n) never change)."""
        return self.n, self.tokens, self.carry_kv, self.carry_score

    def rollback(self, saved: tuple, n_tokens: int) -> None:
        """Back to the state after the first `n_tokens` tokens, where `saved` is `state()` at
        the checkpoint and n_tokens lies between it and now. Entries below n_tokens // ratio are
        already right; a partial group is rebuilt from the recorded un-pooled rows."""
        if n_tokens == saved[1]:
            self.n, self.tokens, self.carry_kv, self.carry_score = saved
            return
        rem = n_tokens % self.ratio
        self.n, self.tokens = n_tokens // self.ratio, n_tokens
        self.carry_kv = self.carry_score = None
        if rem:
            first, kv, score = self.rows
            i = n_tokens - rem - first
            self.carry_kv, self.carry_score = kv[i:i + rem], score[i:i + rem]

    def reserve(self, m: int) -> torch.Tensor:
        """Slots for the next `m` entries (written by the caller), as a long tensor."""
        if self.n + m > self.kv_codes.shape[0]:
            raise RuntimeError(
                f"global KV cache overflow: {self.n + m} entries > capacity {self.kv_codes.shape[0]}"
            )
        slots = torch.arange(self.n, self.n + m, device=self.kv_codes.device)
        self.n += m
        return slots

    def append(self, kv_codes, kv_scale, key_codes, key_scale) -> None:
        sl = slice(self.n, self.n + kv_codes.shape[0])
        self.reserve(kv_codes.shape[0])
        self.kv_codes[sl], self.kv_scale[sl] = kv_codes, kv_scale
        self.key_codes[sl], self.key_scale[sl] = key_codes, key_scale

    def snapshot(self, n_tokens: int) -> "GlobalKV":
        """A copy of the state after the first `n_tokens` tokens, taken at a group boundary
        (n_tokens % ratio == 0, so no partial group is carried)."""
        if n_tokens % self.ratio or n_tokens > self.tokens:
            raise ValueError(f"cannot snapshot {n_tokens} tokens (ratio {self.ratio}, {self.tokens} consumed)")
        n = n_tokens // self.ratio
        cl = lambda t: t[:n].clone()  # noqa: E731
        return GlobalKV(self.ratio, cl(self.kv_codes), cl(self.kv_scale), cl(self.key_codes), cl(self.key_scale),
                        n, n_tokens)

    def restore_into(self, dst: "GlobalKV", n_tokens: int) -> None:
        """Copy the state after the first `n_tokens` (a group boundary) into `dst`."""
        if n_tokens % self.ratio or n_tokens > self.tokens:
            raise ValueError(f"cannot restore {n_tokens} tokens (ratio {self.ratio}, {self.tokens} stored)")
        n = n_tokens // self.ratio
        dst.n = 0
        dst.append(self.kv_codes[:n], self.kv_scale[:n], self.key_codes[:n], self.key_scale[:n])
        dst.tokens = n_tokens
        dst.carry_kv = dst.carry_score = None

    def nbytes_per_entry(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in (self.kv_codes, self.kv_scale, self.key_codes, self.key_scale))


@dataclass
class SWARing:
    """FP8 ring of one layer: slot = pos % window."""

    q: torch.Tensor  # [W, D] float8_e4m3fn
    scale: torch.Tensor  # [W, D/32] float8_e8m0fnu

    def window(self, start: int, floor: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Entries for positions [max(floor, start - W + 1), start) in position order:
        (fp8 values, scales, positions)."""
        w = self.q.shape[0]
        lo = max(floor, start - w + 1, 0)
        pos = torch.arange(lo, start, device=self.q.device)
        slots = pos % w
        return self.q[slots], self.scale[slots], pos

    def write(self, pos: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
        w = self.q.shape[0]
        keep = slice(max(0, pos.shape[0] - w), None)  # only the newest W entries survive
        slots = pos[keep] % w
        self.q[slots] = q[keep]
        # index_put has no E8M0 kernel: write the scale bytes through a uint8 view
        self.scale.view(torch.uint8)[slots] = scale[keep].view(torch.uint8)


@dataclass
class CacheCheckpoint:
    """What a multi-token verification may overwrite: the SWA ring rows of the slots its
    positions map to (every layer) and the global KV sources' scalar state and carry."""

    length: int
    slots: torch.Tensor  # ring slots of positions length .. length + n_ahead - 1
    swa: list[tuple[torch.Tensor, torch.Tensor]]  # their previous (fp8 rows, scale bytes) per layer
    glob: dict[int, tuple]


@dataclass
class SequenceCache:
    """Everything one sequence carries between forward calls."""

    swa: list[SWARing]
    glob: dict[int, GlobalKV]
    tokens: list[int] = field(default_factory=list)  # ids seen so far (Engram hashing)
    is_image: list[bool] = field(default_factory=list)
    length: int = 0  # tokens whose global state is in the cache
    # per-layer lowest position a SWA query may see (bounded replay truncates the window)
    swa_floor: list[int] = field(default_factory=list)

    @classmethod
    def allocate(cls, cfg: ModelConfig, max_tokens: int, device: torch.device | str = "cpu") -> "SequenceCache":
        if max_tokens > cfg.max_position_embeddings:
            raise ValueError(
                f"sequence of {max_tokens} tokens exceeds max_position_embeddings ({cfg.max_position_embeddings})"
            )
        d, di, w = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window
        swa = [
            SWARing(torch.zeros(w, d, dtype=torch.float8_e4m3fn, device=device),
                    torch.full((w, d // 32), 127, dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu))
            for _ in range(cfg.num_hidden_layers)
        ]
        glob = {}
        for src in cfg.kv_source_layer_ids:
            r = cfg.compress_ratios[src]
            cap = max(1, -(-max_tokens // r))
            glob[src] = GlobalKV(
                r,
                torch.zeros(cap, d // 2, dtype=torch.uint8, device=device),
                torch.zeros(cap, d // 16, dtype=torch.float8_e4m3fn, device=device),
                torch.zeros(cap, di // 2, dtype=torch.uint8, device=device),
                torch.full((cap, di // 32), 127, dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu),
            )
        return cls(swa=swa, glob=glob, swa_floor=[0] * cfg.num_hidden_layers)

    # -- speculative decoding: checkpoint before a verification, roll back rejected tokens --
    def checkpoint(self, n_ahead: int) -> CacheCheckpoint:
        """Save what feeding the next `n_ahead` tokens may overwrite (n_ahead <= window)."""
        w = self.swa[0].q.shape[0] if self.swa else 1
        if not 0 < n_ahead <= w:
            raise ValueError(f"can checkpoint 1..{w} tokens ahead (the SWA window), got {n_ahead}")
        dev = self.swa[0].q.device if self.swa else "cpu"
        slots = torch.arange(self.length, self.length + n_ahead, device=dev) % w
        saved = [(r.q[slots], r.scale.view(torch.uint8)[slots]) for r in self.swa]  # (indexing copies)
        for g in self.glob.values():
            g.keep_rows, g.rows = True, None
        return CacheCheckpoint(self.length, slots, saved, {s: g.state() for s, g in self.glob.items()})

    def rollback(self, cp: CacheCheckpoint, n_tokens: int) -> None:
        """Forget every token from position `n_tokens` on (cp.length <= n_tokens <= length):
        the result equals having fed only the first `n_tokens` tokens. Closes the checkpoint."""
        if not cp.length <= n_tokens <= self.length:
            raise ValueError(f"cannot roll back to {n_tokens} tokens (checkpoint {cp.length}, now {self.length})")
        k, m = n_tokens - cp.length, self.length - n_tokens
        if m > cp.slots.shape[0] - k:
            raise ValueError("the checkpoint does not cover the tokens fed since it was taken")
        slots = cp.slots[k:k + m]
        for ring, (q, sc) in zip(self.swa, cp.swa):
            ring.q[slots] = q[k:k + m]
            ring.scale.view(torch.uint8)[slots] = sc[k:k + m]
        del self.tokens[n_tokens:], self.is_image[n_tokens:]
        self.length = n_tokens
        for s, g in self.glob.items():
            g.rollback(cp.glob[s], n_tokens)
        self.release(cp)

    def release(self, cp: CacheCheckpoint) -> None:
        """Close a checkpoint whose tokens were all kept."""
        for g in self.glob.values():
            g.keep_rows, g.rows = False, None


def kv_bytes_per_token(cfg: ModelConfig) -> float:
    """Persistent global KV bytes per token: sum over KV sources of (main + indexer key) / ratio."""
    main = cfg.head_dim // 2 + cfg.head_dim // 16  # E2M1 bytes + E4M3 scales per 16
    key = cfg.index_head_dim // 2 + cfg.index_head_dim // 32  # MXFP4 bytes + E8M0 per 32
    return sum((main + key) / cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids)


def swa_bytes_per_sequence(cfg: ModelConfig) -> int:
    """FP8 ring bytes of one sequence: every backbone layer keeps `sliding_window` slots of
    head_dim E4M3 bytes + one E8M0 scale per 32 channels."""
    return cfg.num_hidden_layers * cfg.sliding_window * (cfg.head_dim + cfg.head_dim // 32)
