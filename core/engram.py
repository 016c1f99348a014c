"""Engram token-side math (spec section 3, "Engram"): table primes, hash multipliers, the
token compression map, and the hashed row ids of every position. No nn.Modules here; the
embedding lookup, `wkv` and the gates live with the model.

Readings of the spec made here (each verified against the published numbers where one is
given; see the function docstrings):

* primes: one running sequence of consecutive primes strictly above `engram_vocab_size`,
  shared by all layers in `engram_layer_ids` order, no prime reused (reproduces 16000057,
  16000477 and `engram_num_embeddings` = [384006168, 384016682]);
* multipliers: `np.random.default_rng(10007 * layer).integers(0, bound, size=max_ngram,
  dtype=np.int64) * 2 + 1` with `bound = (INT64_MAX // compressed_vocab) // 2`
  (reproduces 76632096046245 / 67716810739261 with compressed vocab 99092);
* compression: the normaliser sequence NFKC, NFD, StripAccents, Lowercase, collapse
  `[ \\t\\r\\n]+` to one space, lone space -> sentinel, Strip, sentinel -> space.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np
import torch

INT64_MAX = int(np.iinfo(np.int64).max)
ENGRAM_SEED_PRIME = 10007
# Private-use character that shields a token that is exactly one space from Strip().
LONE_SPACE_SENTINEL = "\ue000"

_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (bases 2..37: exact for every n < 3.3e24, so all int64)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x == 1 or x == n - 1:
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(cfg: Any) -> list[list[int]]:
    """Per Engram layer (in `cfg.engram_layer_ids` order), the table size of each hash head.

    Layer k gets `(engram_max_ngram_size - 1) * engram_n_heads` primes, ordered n-gram order
    first (2, 3, ..., max), then head. All primes come from ONE running sequence of
    consecutive primes: the search starts strictly above `engram_vocab_size` (a prime equal to
    it would not be taken), every order and head takes the next prime, and layer k continues
    after layer k-1's last prime (no prime is shared between heads or layers). This is the
    reading that reproduces the published numbers: for the full config layer 1 starts at
    16000057 and layer 14 at 16000477, and each layer's primes sum to
    `engram_num_embeddings` = [384006168, 384016682] (the rows of its concatenated table;
    head j of order n uses rows [offset, offset + prime) with offset = sum of the earlier
    primes of the same layer).
    """
    per_layer = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    cand = int(cfg.engram_vocab_size)
    out: list[list[int]] = []
    for _ in cfg.engram_layer_ids:
        primes: list[int] = []
        while len(primes) < per_layer:
            cand += 1
            if is_prime(cand):
                primes.append(cand)
        out.append(primes)
    return out


def engram_multipliers(cfg: Any, layer_id: int, compressed_vocab_size: int | None = None) -> np.ndarray:
    """The `engram_max_ngram_size` odd int64 hash multipliers of Engram layer `layer_id`.

    Exactly: `rng = np.random.default_rng(10007 * layer_id)`,
    `v = rng.integers(0, bound, size=engram_max_ngram_size, dtype=np.int64)`,
    `bound = (INT64_MAX // compressed_vocab_size) // 2` (at least 1), result `2 * v + 1`.
    `layer_id` is the backbone layer number (1 and 14 in the full model), not the index into
    `engram_layer_ids`. With compressed vocab 99092 this gives 76632096046245 first for layer 1
    and 67716810739261 for layer 14. The bound keeps every `token * multiplier` product of a
    compressed id below INT64_MAX, so only the XOR mixes bits.

    `compressed_vocab_size` defaults to `cfg.engram_compressed_vocab_size`, which must equal the
    count `build_compression_map` returns for the model's tokenizer (`check_compressed_vocab`).
    """
    cv = int(cfg.engram_compressed_vocab_size if compressed_vocab_size is None else compressed_vocab_size)
    if cv <= 0:
        raise ValueError(
            "engram_multipliers needs the compressed vocabulary size: the config has "
            f"engram_compressed_vocab_size={cv}; pass compressed_vocab_size= (from build_compression_map)"
        )
    bound = max(1, (INT64_MAX // cv) // 2)
    rng = np.random.default_rng(ENGRAM_SEED_PRIME * int(layer_id))
    v = rng.integers(0, bound, size=(int(cfg.engram_max_ngram_size),), dtype=np.int64)
    return v * 2 + 1


def _compression_normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), LONE_SPACE_SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(LONE_SPACE_SENTINEL, " "),
    ])


def normalize_token_text(text: str) -> str:
    """The compression key normaliser applied to one decoded token (may return "")."""
    return _compression_normalizer().normalize_str(text)


def build_compression_map(
    tokenizer: Any, vocab_size: int | None = None, pad_token_id: int = 2
) -> tuple[np.ndarray, int]:
    """Map every token id to its Engram compressed id; returns (map int64 [V], n_compressed).

    For token ids 0..T-1 (T = the tokenizer's size with added tokens), in id order:
    `text = decode([id], skip_special_tokens=False)`;
    * if `text` contains U+FFFD (a partial UTF-8 byte token) the key is the raw token string
      (`id_to_token`);
    * else the key is the normalised text: NFKC, NFD, strip accents (tokenizers'
      StripAccents: drop combining marks), lowercase, collapse runs of `[ \\t\\r\\n]` to one
      space, then a text that is exactly one space is protected by a sentinel while leading /
      trailing whitespace is stripped, and restored to " " (so " ", "\\n", "\\u00a0" (NFKC ->
      " ") all key to " ", while " Hello" and "hello" both key to "hello");
    * a token whose normalised text is empty is keyed by its decoded text.
    Compressed ids are assigned in first-seen order of the keys. The collapse set
    `[ \\t\\r\\n]` and the Strip step are the Engram reference normaliser's (the spec's
    "collapse whitespace, sentinel for a lone space": the sentinel only matters with a strip).

    `tokenizer`: a `tokenizers.Tokenizer` or anything with a `backend_tokenizer` (HF fast).
    `vocab_size`: length of the returned map (default T). Model ids >= T (embedding padding,
    never produced by the tokenizer) and holes in the id space add no compressed ids: they map
    to the compressed id of `pad_token_id` (pass `cfg.engram_pad_token_id`; 0 if that id is
    itself missing). The Engram pad value is `map[engram_pad_token_id]`.
    """
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    n_tok = backend.get_vocab_size(with_added_tokens=True)
    V = n_tok if vocab_size is None else int(vocab_size)
    norm = _compression_normalizer()
    key_to_new: dict[str, int] = {}
    lookup = np.full(V, -1, dtype=np.int64)
    for tid in range(min(n_tok, V)):
        raw = backend.id_to_token(tid)
        if raw is None:  # a hole in the id space
            continue
        text = backend.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = raw
        else:
            key = norm.normalize_str(text) or text
        new = key_to_new.get(key)
        if new is None:
            new = len(key_to_new)
            key_to_new[key] = new
        lookup[tid] = new
    missing = lookup < 0
    if missing.any():
        fill = lookup[pad_token_id] if 0 <= pad_token_id < V and lookup[pad_token_id] >= 0 else 0
        lookup[missing] = fill
    return lookup, len(key_to_new)


def check_compressed_vocab(cfg: Any, n_compressed: int) -> None:
    """Raise ValueError unless the config's `engram_compressed_vocab_size` equals the size of the
    token map built from the tokenizer (the hash multipliers depend on it, so a mismatch would
    silently hash every n-gram to other rows)."""
    if cfg.engram_layer_ids and int(cfg.engram_compressed_vocab_size) != int(n_compressed):
        raise ValueError(
            f"engram_compressed_vocab_size is {cfg.engram_compressed_vocab_size} in the config, but the "
            f"tokenizer's Engram token map has {n_compressed} entries: the config and the tokenizer do not "
            "belong together")


def engram_row_ids(
    comp_ids: torch.Tensor,
    is_image: torch.Tensor | None,
    start: int,
    multipliers: Sequence[int] | np.ndarray | torch.Tensor,
    primes: Sequence[int],
    pad_id: int,
    max_ngram: int,
    n_heads: int,
) -> torch.Tensor:
    """Row ids into one layer's concatenated Engram table, for positions start..N-1.

    `comp_ids` [N] are compressed token ids of the whole sequence so far (positions before
    `start` are history that only feeds the n-grams); `is_image` [N] bool or None.
    For position p, slot s (0..max_ngram-1) holds `comp_ids[p - s]`, except that it holds
    `pad_id` when p - s < 0 or when any position in p-s..p is an image token (a slot on an
    image token and every older slot behind it are pad; an image token at p makes all its
    slots pad). For each order n = 2..max_ngram:
        hash_n = XOR_{s=0}^{n-1} (slot_s * multipliers[s])   (int64, wrapping)
    and for each head h: row = hash_n mod primes[(n-2)*n_heads + h] (non-negative, Python
    modulo) + sum(primes[:(n-2)*n_heads + h]).
    Returns int64 [N - start, (max_ngram-1)*n_heads], columns ordered order first, then head.
    `pad_id` is the compressed id of token `engram_pad_token_id`. Fully vectorised.
    """
    if comp_ids.dim() != 1:
        raise ValueError(f"comp_ids must be 1-D [N], got shape {tuple(comp_ids.shape)}")
    n_rows = (max_ngram - 1) * n_heads
    if len(primes) != n_rows:
        raise ValueError(f"expected {n_rows} primes ((max_ngram-1)*n_heads), got {len(primes)}")
    N = comp_ids.shape[0]
    if not 0 <= start <= N:
        raise ValueError(f"start {start} outside 0..{N}")
    dev = comp_ids.device
    tok = comp_ids.to(torch.int64)
    pos = torch.arange(start, N, device=dev)  # [M]
    # last image position at or before each position (-1 if none)
    if is_image is not None:
        img_idx = torch.where(is_image.to(device=dev, dtype=torch.bool),
                              torch.arange(N, device=dev), torch.full((N,), -1, device=dev))
        last_img = torch.cummax(img_idx, dim=0).values[start:]
    else:
        last_img = torch.full((N - start,), -1, device=dev, dtype=torch.int64)
    s = torch.arange(max_ngram, device=dev)
    src = pos[:, None] - s[None, :]  # [M, max_ngram]
    valid = (src >= 0) & (src > last_img[:, None])
    return engram_window_row_ids(tok[src.clamp(min=0)], valid, multipliers, primes, pad_id, n_heads)


def engram_window_row_ids(comp: torch.Tensor, valid: torch.Tensor, multipliers, primes: Sequence[int],
                          pad_id: int, n_heads: int) -> torch.Tensor:
    """Row ids from per-position n-gram windows: comp [M, N] compressed ids at p, p-1, ..,
    p-N+1 and valid [M, N] (False slots hash as `pad_id`). The hash of `engram_row_ids`,
    for callers that know each position's window (a batch of many sequences)."""
    dev, max_ngram = comp.device, comp.shape[1]
    slots = torch.where(valid, comp.to(torch.int64), torch.full_like(comp, int(pad_id), dtype=torch.int64))
    if isinstance(multipliers, torch.Tensor):
        mult = multipliers.to(device=dev, dtype=torch.int64)[:max_ngram]
    else:
        mult = torch.as_tensor(np.asarray(multipliers, dtype=np.int64)[:max_ngram], device=dev)
    if mult.numel() != max_ngram:
        raise ValueError(f"need {max_ngram} multipliers, got {mult.numel()}")
    prod = slots * mult[None, :]  # int64 wraparound
    hashes = []
    h = prod[:, 0]
    for n in range(2, max_ngram + 1):
        h = torch.bitwise_xor(h, prod[:, n - 1])
        hashes.append(h)
    hash_cols = torch.stack(hashes, dim=1).repeat_interleave(n_heads, dim=1)  # [M, n_rows]
    p_t = primes.to(dev) if isinstance(primes, torch.Tensor) else \
        torch.tensor([int(p) for p in primes], dtype=torch.int64, device=dev)
    offsets = torch.cumsum(p_t, 0) - p_t
    return torch.remainder(hash_cols, p_t[None, :]) + offsets[None, :]


class EngramPrefetch:
    """Engram rows of host-held tables fetched ahead of their layers (host offload, gather path).

    Before a step's device work starts, the host hashes every Engram layer's row ids from the
    n-gram token ids it already holds (`StepBatch.ngram_host`), gathers those rows from each
    host table into page-locked staging buffers (`gather`), and the forward then issues one
    non-blocking copy per layer on a side stream, each followed by an event (`issue`). A layer
    waits only on its own event, on the device (`wait`): no layer waits on the host, and the
    copies overlap the embedding and the layers before them. Works for page-locked and pageable
    tables alike: the copies always read the page-locked staging buffers, never the table.

    Decode graphs capture the copies from the staging buffers, which are fixed per size class
    (the next power of two of the token count); before each replay the graph runner calls
    `gather` for the new batch, which refills the same buffers. A buffer is refilled only after
    the copy that last read it has completed (its event), except while capturing.

    Device streams and events come from the platform (`backends/platform.py`); on CPU the
    copies are plain copies. Unverified on NPUs (tested on CPU; CUDA on an H200)."""

    def __init__(self, layers: dict, engram_map: torch.Tensor, pad_id: int, device: torch.device):
        from ..backends.platform import platform_for

        # layer id -> (table, scale, multipliers [N] int64, primes [R] int64, n_heads), on the host
        self.layers = layers
        self.engram_map = engram_map.cpu()
        self.pad_id = int(pad_id)
        self.device = torch.device(device)
        self.platform = platform_for(self.device)
        self.side = self.platform.stream()
        self.staging: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, object]] = {}
        self.filled: dict[int, int] = {}  # layer -> token rows gathered for the coming step

    def _buffers(self, layer: int, n_tokens: int):
        """The (values, scales, event) staging of `layer` for `n_tokens` tokens' size class."""
        size = 1 << max(0, n_tokens - 1).bit_length()
        key = (layer, size)
        if key not in self.staging:
            table, scale = self.layers[layer][:2]
            r = self.layers[layer][3].numel()
            vals = self.platform.pinned_empty((size * r, *table.shape[1:]), torch.uint8)
            sc = self.platform.pinned_empty((size * r, *scale.shape[1:]), _byte_dtype(scale))
            self.staging[key] = (vals, sc, None)
        return key, self.staging[key]

    def gather(self, ngram_ids: torch.Tensor, ngram_image: torch.Tensor) -> None:
        """Host side of a step: row ids from the n-gram inputs ([T, N] host tensors) and the
        rows of every layer gathered into its staging buffers."""
        ids = ngram_ids.cpu()
        valid = (ids >= 0) & torch.cumprod((~ngram_image.cpu()).to(torch.int32), 1).bool()
        comp = self.engram_map[ids.clamp_min(0)]
        capturing = self.platform.is_capturing()
        t = ids.shape[0]
        for layer, (table, scale, mult, primes, n_heads) in self.layers.items():
            rows = engram_window_row_ids(comp, valid, mult, primes, self.pad_id, n_heads).reshape(-1)
            key, (vals, sc, event) = self._buffers(layer, t)
            if event is not None and not capturing:
                event.synchronize()  # the copy that last read these buffers is done
            n = rows.numel()
            torch.index_select(table.view(torch.uint8), 0, rows, out=vals[:n])
            torch.index_select(scale.view(sc.dtype), 0, rows, out=sc[:n])
            self.filled[layer] = t

    def issue(self) -> dict[int, tuple]:
        """Device side: one non-blocking copy per layer of its gathered rows on the side stream,
        each followed by an event. Returns layer -> (values, scales, local row ids, event)."""
        out = {}
        capturing = self.platform.is_capturing()
        cur = self.platform.current_stream()
        self.side.wait_stream(cur)  # the destinations' memory is free once cur's earlier work is done
        for layer, t in self.filled.items():
            table, scale, _, primes, _ = self.layers[layer]
            key, (vals, sc, _) = self._buffers(layer, t)
            n = t * primes.numel()
            dst_v = torch.empty((n, *table.shape[1:]), dtype=torch.uint8, device=self.device)
            dst_s = torch.empty((n, *scale.shape[1:]), dtype=sc.dtype, device=self.device)
            event = self.platform.event()
            with self.platform.use_stream(self.side):
                dst_v.copy_(vals[:n], non_blocking=True)
                dst_s.copy_(sc[:n], non_blocking=True)
                event.record(self.side)
            # an event recorded while capturing is a dependency inside the graph, not one the
            # host can wait on (CUDA refuses): the graph runner waits for its replays instead
            self.staging[key] = (vals, sc, None if capturing else event)
            local = torch.arange(n, device=self.device).view(t, -1)
            out[layer] = FetchedRows(dst_v.view(table.dtype), dst_s.view(scale.dtype), local, event, self.platform)
        self.filled = {}
        return out


@dataclass
class FetchedRows:
    """One layer's rows copied ahead: values / scales of the step's T x R gathered rows, the
    row ids [T, R] into them, and the event that marks the copy done."""

    values: torch.Tensor
    scales: torch.Tensor
    rows: torch.Tensor
    event: object
    platform: object

    def ready(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(values, scales, row ids), with the current stream waiting on the device for the copy."""
        self.platform.current_stream().wait_event(self.event)
        return self.values, self.scales, self.rows

    def select(self, index: torch.Tensor) -> "FetchedRows":
        """The same rows for a subset of the tokens (CED: the decoder's rows)."""
        return replace(self, rows=self.rows[index])


@dataclass
class EngramValues:
    """One layer's Engram values [T, (n + 1) d] (its rows looked up and projected by `wkv`),
    forked on the platform's side lane ENGRAM_LANE at the step's start (`Transformer.forward`
    under `overlap_streams`' "engram"): they read only the token ids, so they are made beside the
    layers before theirs."""

    kv: torch.Tensor
    platform: Any

    def ready(self) -> torch.Tensor:
        """The values, with the current stream joined to the lane they were made on."""
        from ..backends.platform import ENGRAM_LANE

        self.platform.join(lane=ENGRAM_LANE, out=self.kv)
        return self.kv

    def select(self, index: torch.Tensor) -> "EngramValues":
        """The values of a subset of the tokens (CED: the decoder's rows), read after the join."""
        return replace(self, kv=self.ready()[index])


def _byte_dtype(t: torch.Tensor) -> torch.dtype:
    """A same-width dtype `index_select` handles on the host (1-byte floats as uint8)."""
    return torch.uint8 if t.element_size() == 1 else t.dtype
