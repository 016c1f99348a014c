"""The reference engine: prefill (CED or exact), decode, sampling, and a prefix cache of global
KV with SWA bounded replay. It is what `dsv41 run` uses and the oracle for the vLLM plugin.

Prefill modes
- `exact`: every layer over every prompt token (the official reference's behaviour; oracle).
- `ced` (default): the encoder runs over every prompt token, the decoder's KV source compresses
  every row of the encoder's output, and the decoder runs only over the last `sliding_window`
  prompt tokens with its SWA window truncated there (decoder bounded replay, approximate).

Prefix cache
Global KV + compressor state are snapshotted at block boundaries after each prefill and keyed
by a chain hash of the token blocks. On a hit of H tokens, the global state is restored and the
SWA state is rebuilt by replaying from H - R (R = `sliding_window` by default, or
`sliding_window * num_hidden_layers` with replay="exact", which rebuilds it exactly) with the
SWA window truncated to the replayed span. Cached global KV is reused, never rewritten.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import torch

from .cache import GlobalKV, SequenceCache
from .model import ForwardContext, Transformer


@dataclass
class SamplingParams:
    """Greedy when temperature == 0; otherwise temperature, then top-k, then top-p."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def validate(self) -> "SamplingParams":
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        return self


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    if p.temperature == 0:
        return int(torch.argmax(logits))
    return int(torch.multinomial(sampling_probs(logits, p).cpu(), 1, generator=gen))


def sampling_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws from (temperature > 0): temperature, top-k, top-p."""
    x = logits.float() / p.temperature
    if p.top_k > 0:
        kth = torch.topk(x, min(p.top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, -1)
    if p.top_p < 1:
        sp, si = torch.sort(probs, descending=True)
        drop = sp.cumsum(-1) - sp > p.top_p  # keep the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter(0, si, sp.masked_fill(drop, 0))
        probs = probs / probs.sum()
    return probs


@dataclass
class PrefixEntry:
    tokens: tuple[int, ...]
    glob: dict[int, GlobalKV]


class PrefixCache:
    """Global KV + compressor state keyed by token blocks (chain hash), LRU over snapshots."""

    def __init__(self, block_size: int, capacity: int = 16):
        self.block_size, self.capacity = block_size, capacity
        self.entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # id -> snapshot
        self.index: dict[int, tuple[int, int]] = {}  # chain hash -> (snapshot id, n tokens)
        self.stats = Counter()
        self._next = 0

    def _hashes(self, tokens, n_blocks):
        h, out = 0, []
        for k in range(n_blocks):
            h = hash((h, tuple(tokens[k * self.block_size:(k + 1) * self.block_size])))
            out.append(h)
        return out

    def lookup(self, tokens: list[int], max_tokens: int) -> tuple[PrefixEntry, int] | None:
        """Longest cached prefix of at most `max_tokens` tokens."""
        self.stats["queries"] += 1
        best = None
        for h in self._hashes(tokens, max_tokens // self.block_size):
            hit = self.index.get(h)
            if hit is None or hit[0] not in self.entries:
                break
            entry = self.entries[hit[0]]
            if entry.tokens[: hit[1]] != tuple(tokens[: hit[1]]):
                break  # a hash collision: never serve another prompt's state
            best = (entry, hit[1])
        if best:
            self.entries.move_to_end(next(k for k, v in self.entries.items() if v is best[0]))
            self.stats["hits"] += 1
            self.stats["hit_tokens"] += best[1]
        return best

    def insert(self, tokens: list[int], cache: SequenceCache) -> None:
        n = len(tokens) // self.block_size * self.block_size
        if n == 0:
            return
        sid, self._next = self._next, self._next + 1
        self.entries[sid] = PrefixEntry(tuple(tokens[:n]), {s: g.snapshot(n) for s, g in cache.glob.items()})
        for k, h in enumerate(self._hashes(tokens, n // self.block_size)):
            self.index[h] = (sid, (k + 1) * self.block_size)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
        self.stats["inserts"] += 1


@dataclass
class GenerationResult:
    token_ids: list[int]
    prompt_tokens: int
    prefill_s: float
    decode_s: float
    prefix_hit_tokens: int = 0
    finish_reason: str = "length"
    counters: Counter = field(default_factory=Counter)
    text: str | None = None
    spec: dict | None = None  # speculative decoding statistics (`core/spec_decode.py`)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("inf")

    @property
    def decode_tokens_per_s(self) -> float:
        n = max(len(self.token_ids) - 1, 0)  # the first token comes from the prefill
        return n / self.decode_s if self.decode_s > 0 and n else 0.0


class Engine:
    """Single-sequence reference engine over a `Transformer`."""

    def __init__(self, model: Transformer, *, prefill_mode: str = "ced", replay: str = "window",
                 prefix_cache: bool = False, prefix_block_size: int | None = None, prefix_capacity: int = 16):
        if prefill_mode not in ("ced", "exact"):
            raise ValueError(f"prefill_mode must be 'ced' or 'exact', got {prefill_mode!r}")
        if replay not in ("window", "exact"):
            raise ValueError(f"replay must be 'window' or 'exact', got {replay!r}")
        self.model, self.cfg = model, model.cfg
        self.prefill_mode, self.replay = prefill_mode, replay
        ratio_lcm = 2 if 2 in self.cfg.compress_ratios else 1
        bs = prefix_block_size or max(self.cfg.candidate_block_size, 16)
        if bs % ratio_lcm:
            raise ValueError(f"prefix_block_size ({bs}) must be a multiple of every compress ratio")
        self.prefix = PrefixCache(bs, prefix_capacity) if prefix_cache else None

    @property
    def device(self) -> torch.device:
        return self.model.embed.weight.device

    def replay_length(self) -> int:
        w = self.cfg.sliding_window
        return w * self.cfg.num_hidden_layers if self.replay == "exact" else w

    def prefill(self, prompt: list[int], max_tokens: int,
                image_embeds: torch.Tensor | None = None,
                features: bool = False) -> tuple[SequenceCache, torch.Tensor, ForwardContext, int]:
        """Returns (cache, last logits, context with counters, prefix-hit tokens). With
        `image_embeds` the prefix cache is bypassed (its keys are token ids, and every image's
        placeholder ids look alike) and the whole prompt is one chunk from position 0."""
        cfg, n = self.cfg, len(prompt)
        cache = SequenceCache.allocate(cfg, max_tokens, self.device)
        ctx = ForwardContext(cache, features={} if features else None)
        start, hit = 0, 0
        use_prefix = self.prefix is not None and image_embeds is None
        if use_prefix:
            found = self.prefix.lookup(prompt, n - 1)
            if found is not None:
                entry, hit = found
                for s, g in entry.glob.items():
                    g.restore_into(cache.glob[s], hit)
                start = max(0, hit - self.replay_length())
                cache.length = start
                cache.tokens = list(prompt[:start])
                cache.is_image = self.model.image_mask(torch.tensor(prompt[:start], dtype=torch.long)).tolist()
                cache.swa_floor = [start] * cfg.num_hidden_layers
        ids = torch.tensor(prompt[start:], dtype=torch.long, device=self.device)
        decoder_from = 0
        if self.prefill_mode == "ced":
            decoder_from = max(0, n - cfg.sliding_window - start)
        logits = self.model(ids, cache, decoder_from=decoder_from, ctx=ctx, image_embeds=image_embeds)
        if use_prefix:
            self.prefix.insert(prompt, cache)
        return cache, logits, ctx, hit

    def generate(self, prompt: list[int], params: SamplingParams | None = None,
                 images: list[torch.Tensor] | None = None) -> GenerationResult:
        """`images`: preprocessed pixels (`image_processing.preprocess`), one per image span of
        `prompt` in order (spans from `messages.encode_messages` or `expand_image_placeholders`);
        the vision tower runs once per image and its output replaces those positions."""
        p = (params or SamplingParams()).validate()
        cfg = self.cfg
        if not prompt:
            raise ValueError("the prompt is empty")
        total = len(prompt) + p.max_new_tokens
        if total > cfg.max_position_embeddings:
            raise ValueError(
                f"prompt of {len(prompt)} tokens + max_new_tokens {p.max_new_tokens} exceeds "
                f"max_position_embeddings ({cfg.max_position_embeddings})"
            )
        gen = torch.Generator().manual_seed(p.seed) if p.temperature > 0 else None
        t0 = time.perf_counter()
        image_embeds = None
        if images:
            from .vision import encode_images

            image_embeds = encode_images(self.model, images)
        cache, logits, ctx, hit = self.prefill(prompt, total, image_embeds)
        t1 = time.perf_counter()
        out, reason = [], "length"
        stops = set(p.stop_token_ids)
        while True:
            tok = sample(logits, p, gen)
            out.append(tok)
            if tok in stops:
                reason = "stop"
                break
            if len(out) >= p.max_new_tokens:
                break
            logits = self.model(torch.tensor([tok], dtype=torch.long, device=self.device), cache, ctx=ctx)
        t2 = time.perf_counter()
        return GenerationResult(out, len(prompt), t1 - t0, t2 - t1, hit, reason, ctx.counters)

    def generate_speculative(self, prompt: list[int], params: SamplingParams | None = None, opts=None,
                             images: list[torch.Tensor] | None = None) -> GenerationResult:
        """`generate` with DSpark speculative decoding; `opts` is a `spec_decode.SpecOptions`
        (fixed verify length or the scheduler's choice). Statistics in `result.spec`."""
        from .spec_decode import generate_speculative

        image_embeds = None
        if images:
            from .vision import encode_images

            image_embeds = encode_images(self.model, images)
        return generate_speculative(self, prompt, params, opts, image_embeds)
