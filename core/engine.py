"""The reference engine: continuous batching over one paged forward (nano-vllm's scheduler +
model runner, in small). It is what `dsv41 run` uses and the oracle for the vLLM plugin.

Each `step()` runs ONE forward over a flat batch: one token of every decoding sequence plus
prefill chunks of admitted sequences, up to `max_tokens_per_step` tokens and `max_batch`
running sequences. Caches live in the block pools of a `KVPool` shared by every sequence.

Prefill modes
- `exact`: every layer over every prompt token (the official reference's behaviour; oracle).
- `ced` (default): the encoder runs over every prompt token, the decoder's KV source compresses
  every row of the encoder's output, and the decoder runs only over the last `sliding_window`
  prompt tokens with its window floored there (decoder bounded replay, approximate).

Prefix cache (`prefix_cache=True`)
Global KV blocks are shared between sequences: after a prompt's prefill, each full block is
indexed by a chain hash of the prompt's token blocks up to it. A new prompt whose first H tokens
(a multiple of the block size, at most n - 1) hit takes those blocks by reference, and its SWA
state is rebuilt by replaying from H - R (R = `sliding_window`, or `sliding_window *
num_hidden_layers` with replay="exact", which rebuilds it exactly) with every window floored at
the replay start. Shared global entries are never rewritten. Unreferenced cached blocks stay
until their memory is needed (LRU). Prompts with images bypass it.

Overlapped decode (`overlap=True`, the default with decode graphs)
When every running sequence is decoding, `step()` launches the next step before it reads the
current step's tokens back: the next step's input ids are the current step's tokens (argmax, or
drawn on the device from seeded counter-based uniforms: `core/sampling.py`), copied on the
device into the graph's buffers, and everything else the step needs (positions, block tables,
n-grams of earlier tokens, the draws' keys) is known on the host. The host's scheduling, table
building and bookkeeping then run while the device computes, instead of between steps
(vLLM's async scheduling, SGLang's overlap scheduler). The tokens are the same; a sequence that
stops on a stop token has computed one row for nothing. Anything else (a waiting request, a
prefill chunk, recorded logits, Engram rows fetched ahead on the host) first drains the
launched step and then runs the ordinary step.

Batch invariance: the reference backend's arithmetic does not depend on what else is in the
batch (fp64 contractions, per-token ops), so a sequence's greedy tokens and logits are the same
alone or inside any mix of prefill and decode rows.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import torch

from .batch import Chunk, StepBatch, build_step
from .cache import KVPool, SequenceState
from .model import ForwardContext, Transformer, read_counts
from .sampling import RowParams, pick_tokens, sampling_probs


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
        if not self.temperature >= 0 or self.temperature == float("inf"):  # (NaN fails both)
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        return self


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """One token from one row with a torch generator (the speculative decoder's own draws;
    the engine's steps draw through `sample_rows`)."""
    if p.temperature == 0:
        return int(torch.argmax(logits))
    return int(torch.multinomial(sampling_probs(logits, p).cpu(), 1, generator=gen))


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
                pinned_empty=None, picked: torch.Tensor | None = None) -> list[int]:
    """One token for each of the first len(params) rows of `logits` [R, V], row i drawing the
    token at positions[i] of its sequence (`core/sampling.py`: argmax, or the seeded exponential
    race on the device), read back with the finiteness check in one transfer (one device sync
    per step). Non-finite logits are an error. `picked`: the rows' greedy picks already made (a
    captured decode step's, `DecodeGraphs.picked`)."""
    if logits.shape[0] == 0:
        return []
    rp = RowParams.of(params, positions, logits.device, pinned_empty)
    return _checked_tokens(pick_tokens(logits[:len(params)], rp, picked).tolist())


def _checked_tokens(picked: list[list[int]]) -> list[int]:
    """The tokens of read-back picks ([token, non-finite flag] a row); non-finite logits are an error."""
    if any(flag for _, flag in picked):
        raise ValueError("the model produced non-finite logits (NaN or Inf): the weights or the "
                         "device computation are broken")
    return [tok for tok, _ in picked]


class PrefixCache:
    """Global KV blocks indexed by the chain hash of the token blocks up to them; unreferenced
    blocks are kept (LRU, at most `capacity`) until the pool needs the memory."""

    def __init__(self, pool: KVPool, capacity: int = 1024):
        self.pool, self.capacity = pool, capacity
        self.block_of: OrderedDict[bytes, int] = OrderedDict()  # chain hash -> pool block
        self.hash_of: dict[int, bytes] = {}
        self.stats = Counter()
        pool.evictor = self.evict  # cached blocks give way before the pool grows

    def hashes(self, tokens: list[int], n_blocks: int) -> list[bytes]:
        bs, h, out = self.pool.block_size, b"", []
        for k in range(n_blocks):
            blk = tokens[k * bs:(k + 1) * bs]
            h = hashlib.blake2b(h + b",".join(b"%d" % t for t in blk), digest_size=16).digest()
            out.append(h)
        return out

    def lookup(self, tokens: list[int], max_tokens: int) -> list[int]:
        """Pool blocks of the longest cached prefix of at most `max_tokens` tokens (referenced
        for the caller)."""
        self.stats["queries"] += 1
        found = []
        for h in self.hashes(tokens, max_tokens // self.pool.block_size):
            b = self.block_of.get(h)
            if b is None:
                break
            found.append(b)
            self.block_of.move_to_end(h)
        for b in found:
            self.pool.ref_global(b)
        if found:
            self.stats["hits"] += 1
            self.stats["hit_tokens"] += len(found) * self.pool.block_size
        return found

    def insert(self, tokens: list[int], blocks: list[int]) -> None:
        """Index the full blocks of a prefilled prompt (`blocks`: its global blocks in order)."""
        n = len(tokens) // self.pool.block_size
        for h, b in zip(self.hashes(tokens, n), blocks[:n]):
            if h not in self.block_of and b not in self.hash_of:
                self.block_of[h], self.hash_of[b] = b, h
                self.stats["inserts"] += 1
        self._trim()

    def keep(self, block: int) -> bool:
        """Whether a block nobody references stays cached (else it is freed)."""
        return block in self.hash_of

    def evict(self) -> int | None:
        """Forget the least recently used unreferenced block and return it (None: none)."""
        for h, b in self.block_of.items():
            if self.pool.glob_refs[b] == 0:
                del self.block_of[h], self.hash_of[b]
                return b
        return None

    def _trim(self) -> None:
        idle = [b for b in self.block_of.values() if self.pool.glob_refs[b] == 0]
        for _ in range(len(idle) - self.capacity):
            b = self.evict()
            if b is None:
                break
            self.pool.reclaim_global(b)


@dataclass
class GenerationResult:
    token_ids: list[int]
    prompt_tokens: int
    prefill_s: float
    decode_s: float
    prefix_hit_tokens: int = 0
    finish_reason: str = "length"
    counters: Counter = field(default_factory=Counter)  # work of every step the sequence was in
    text: str | None = None
    spec: dict | None = None  # speculative decoding statistics (`core/spec_decode.py`)
    logits: list[torch.Tensor] | None = None  # fp32 [V] per sampled token (Engine(record_logits=True))

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("inf")

    @property
    def decode_tokens_per_s(self) -> float:
        n = max(len(self.token_ids) - 1, 0)  # the first token comes from the prefill
        return n / self.decode_s if self.decode_s > 0 and n else 0.0


@dataclass
class Sequence:
    """One request inside the engine."""

    index: int
    prompt: list[int]
    params: SamplingParams
    state: SequenceState
    image_rows: torch.Tensor | None = None  # vision output for every image position, in order
    fed: int = 0  # prompt tokens sent to the model so far
    decoder_from: int = 0
    hit: int = 0
    out: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    counters: Counter = field(default_factory=Counter)
    pending: list = field(default_factory=list)  # counter parts still on the device (`add_counts`)
    logits: list[torch.Tensor] = field(default_factory=list)  # with Engine(record_logits=True)
    t_admit: float = 0.0
    t_first: float = 0.0
    t_done: float = 0.0

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)

    def accept(self, tok: int, now: float) -> bool:
        """Append a sampled token; True when it ends the sequence (a stop token or
        max_new_tokens reached; the reason and time are recorded)."""
        self.out.append(tok)
        if tok in self.params.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.out) >= self.params.max_new_tokens:
            self.finish_reason = "length"
        if self.finish_reason:
            self.t_done = now
        return self.finish_reason is not None

    def add_counts(self, done: Counter, parts: list) -> None:
        """Add a step's counters (`ForwardContext.count_parts`) without reading the device."""
        self.counters += done
        self.pending = fold_counts(self.pending + parts)

    def read_counts(self) -> Counter:
        """The counters with the parts still on the device read (one read)."""
        self.counters += read_counts(self.pending)
        self.pending = []
        return self.counters

    def result(self) -> GenerationResult:
        self.read_counts()
        return GenerationResult(list(self.out), len(self.prompt), self.t_first - self.t_admit, self.t_done - self.t_first,
                                self.hit, self.finish_reason or "length", self.counters,
                                logits=self.logits or None)


FOLD_COUNTS_AT = 64  # pending counter parts past which they are summed per name on the device


def fold_counts(parts: list) -> list:
    """Pending (name, 0-d device tensor) counter parts, summed per name on the device (no read)
    once there are more than FOLD_COUNTS_AT, so a long run without reads holds a bounded list."""
    if len(parts) <= FOLD_COUNTS_AT:
        return parts
    by_name: dict[str, list[torch.Tensor]] = {}
    for name, t in parts:
        by_name.setdefault(name, []).append(t)
    return [(name, torch.stack(ts).sum()) for name, ts in by_name.items()]


def default_step_tokens(model: Transformer, pool: KVPool) -> int:
    """The step budget when the user gives none. On a device: from the memory budget
    (`memory.default_tokens_per_step`: the prefill's transient memory within 0.15 x (weights + the
    KV pools allocated so far, usually none yet: a conservative budget)). On the CPU (the fp64
    reference, not memory-bound): `memory.CPU_TOKENS_PER_STEP`."""
    from . import memory

    if _on_cpu(model):
        return memory.CPU_TOKENS_PER_STEP
    return memory.default_tokens_per_step(model.cfg, memory.weight_bytes(model), pool.nbytes())


def _on_cpu(model: Transformer) -> bool:
    return model.embed.weight.device.type == "cpu"


@dataclass
class _Launched:
    """A decode step launched by the overlapped loop whose tokens the host has not read yet."""

    seqs: list  # the step's sequences, row order (row i's token: the graphs' picked[i, 0])
    host: torch.Tensor  # host [n, 2] long: the tokens and non-finite flags, copied without a wait
    copied: object  # platform event recorded after that copy


class Engine:
    """Continuous-batching reference engine over a `Transformer`. `max_tokens_per_step`: tokens
    per forward (decode tokens + prefill chunks); None: `default_step_tokens` (on a device, the
    most whose prefill memory stays within 0.15 x (weights + KV))."""

    def __init__(self, model: Transformer, *, prefill_mode: str = "ced", replay: str = "window",
                 prefix_cache: bool = False, prefix_capacity: int = 1024, block_size: int = 16,
                 max_batch: int = 64, max_tokens_per_step: int | None = None, record_logits: bool = False,
                 graphs: bool = False, max_model_len: int | None = None, overlap: bool = True):
        if prefill_mode not in ("ced", "exact"):
            raise ValueError(f"prefill_mode must be 'ced' or 'exact', got {prefill_mode!r}")
        if replay not in ("window", "exact"):
            raise ValueError(f"replay must be 'window' or 'exact', got {replay!r}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_tokens_per_step is not None and max_tokens_per_step < 1:
            raise ValueError(f"max_tokens_per_step must be >= 1, got {max_tokens_per_step}")
        self.model, self.cfg = model, model.cfg
        self.prefill_mode, self.replay = prefill_mode, replay
        self.max_batch, self.max_tokens_per_step = max_batch, max_tokens_per_step
        self.record_logits = record_logits  # keep each sampled row's logits (tests, debugging)
        self.pool = KVPool(self.cfg, block_size=block_size, device=self.device,
                           drafter=getattr(model, "mtp", None) is not None)
        if max_tokens_per_step is None:
            self.max_tokens_per_step = default_step_tokens(model, self.pool)
        self.prefix = PrefixCache(self.pool, prefix_capacity) if prefix_cache else None
        self.max_model_len = max_model_len or self.cfg.max_position_embeddings
        self.graphs = self._capture(max_model_len) if graphs else None
        self._draft_graph = None  # captured on first speculative use (`draft_graph`)
        self._verify_graphs = None  # likewise (`verify_graphs`)
        self._context_writer = None  # a DSpark of the model writing verifications' context (`_writer`)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._counters, self._counter_parts = Counter(), []
        self._next = 0
        # with decode graphs: launch the next decode step before reading this one's tokens
        self.overlap = overlap and self.graphs is not None
        self._launched: _Launched | None = None
        self._graph_picks: torch.Tensor | None = None  # the last `run_chunks` replay's picks

    @property
    def device(self) -> torch.device:
        return self.model.embed.weight.device

    @property
    def counters(self) -> Counter:
        """Every step's counters so far (reading the device once for the parts still there)."""
        self._counters += read_counts(self._counter_parts)
        self._counter_parts = []
        return Counter(self._counters)

    def _capture(self, max_model_len: int | None):
        """Fixed pools sized for `max_batch` sequences of `max_model_len` tokens, and the decode
        step captured per batch-size bucket over them (`graphs/decode.py`)."""
        from ..graphs.decode import DecodeGraphs

        cfg, bs = self.cfg, self.pool.block_size
        if max_model_len is None or not 0 < max_model_len <= cfg.max_position_embeddings:
            raise ValueError(f"decode graphs need max_model_len in 1..{cfg.max_position_embeddings}, got {max_model_len}")
        table = -(-max_model_len // bs) + 1
        live_swa = -(-(2 * cfg.sliding_window + self.max_tokens_per_step) // bs) + 2  # what a sequence keeps
        self.pool.grow(self.max_batch * live_swa + 1, self.max_batch * table + 1)
        self.pool.fixed = True
        graphs = DecodeGraphs(self.model, self.pool, self.max_batch, table)
        graphs.capture()
        return graphs

    def draft_graph(self, drafter):
        """The greedy DSpark draft block captured over this engine's fixed pools (once per
        engine; None without decode graphs): `graphs/draft.py`."""
        if self.graphs is None:
            return None
        if self._draft_graph is None:
            from ..graphs.draft import DraftGraph

            self._draft_graph = DraftGraph(drafter, self.pool, self.graphs.table_blocks).capture()
        return self._draft_graph

    def verify_graphs(self):
        """DSpark's verification forward captured over this engine's fixed pools, once per row
        count up to the draft block + 1 (once per engine; None without decode graphs or while
        Engram rows are fetched ahead on the host, whose host gathers a replay cannot redo):
        `graphs/verify.py`."""
        if self.graphs is None:
            return None
        prefetch = self.model.engram_prefetch()
        if prefetch is not None and prefetch.layers:
            return None
        if self._verify_graphs is None:
            from ..graphs.verify import VerifyGraphs

            self._verify_graphs = VerifyGraphs(self.model, self.pool, self.cfg.dspark_block_size + 1,
                                               self.graphs.table_blocks, self._writer()).capture()
        return self._verify_graphs

    def verify(self, state: SequenceState, ids: list[int]):
        """One DSpark verification forward: `ids` (the last token, then the drafts) at the
        sequence's next positions, every row's logits and the drafter's target features; the
        drafter's context KV of every row is written too, where the model has one
        (`DSpark.write_context`: the caller keeps the accepted rows with `DSpark.advance`). A
        captured graph replays it where the engine has them (`verify_graphs`), else the model
        runs eagerly. Returns (logits [n, V], features [n, n_targets * d], the step's counter
        parts, or None for a replay, which keeps no counters)."""
        from .dspark import verify_forward

        chunk = Chunk(state, ids, 0, "all", text_only=True)
        graphs = self.verify_graphs()
        if graphs is not None:
            batch = build_step(self.cfg, self.pool, [chunk], "cpu", self._image_token())
            logits, feats = graphs.run(batch)
            return logits, feats, None
        batch = build_step(self.cfg, self.pool, [chunk], self.device, self._image_token())
        logits, feats, ctx = verify_forward(self.model, self.pool, batch, self._writer())
        return logits, feats, ctx.count_parts()

    def _writer(self):
        """The engine's one DSpark of its model, writing verifications' drafter context (None
        without a drafter)."""
        if self._context_writer is None and getattr(self.model, "mtp", None) is not None:
            from .dspark import DSpark

            self._context_writer = DSpark(self.model)
        return self._context_writer

    def replay_length(self) -> int:
        w = self.cfg.sliding_window
        return w * self.cfg.num_hidden_layers if self.replay == "exact" else w

    # -- requests --
    def add(self, prompt: list[int], params: SamplingParams | None = None,
            images: list[torch.Tensor] | None = None) -> Sequence:
        """Queue a request. `images`: preprocessed pixels (`image_processing.preprocess`), one
        per image span of `prompt` in order; the vision tower runs once per image."""
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
        if total > self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_new_tokens {p.max_new_tokens} exceeds the "
                             f"engine's max_model_len ({self.max_model_len})")
        bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
        seq = Sequence(self._next, list(prompt), p, SequenceState())
        self._next += 1
        n_img = sum(1 for t in prompt if t == cfg.image_token_id) if cfg.vision is not None else 0
        if images:
            from .vision import encode_images

            seq.image_rows = encode_images(self.model, images)
            if seq.image_rows.shape[0] != n_img:
                raise ValueError(f"the prompt has {n_img} image-token positions but the images give "
                                 f"{seq.image_rows.shape[0]} rows")
        elif n_img:
            raise ValueError(f"the prompt holds {n_img} image-token positions but no image was given")
        self.waiting.append(seq)
        return seq

    def _admit(self, seq: Sequence) -> None:
        """Start a sequence: prefix-cache hit (shared global blocks, replay start) and CED."""
        cfg, n, st = self.cfg, len(seq.prompt), seq.state
        seq.t_admit = time.perf_counter()
        if self.prefix is not None and seq.image_rows is None:
            blocks = self.prefix.lookup(seq.prompt, n - 1)
            if blocks:
                hit = len(blocks) * self.pool.block_size
                start = max(0, hit - self.replay_length())
                st.glob_blocks = list(blocks)
                st.swa_blocks = [0] * (start // self.pool.block_size)
                st.tokens = list(seq.prompt[:start])
                st.is_image = [False] * start
                st.length, st.glob_from, st.floors = start, hit, [start] * 3
                seq.fed, seq.hit = start, hit
        if self.prefill_mode == "ced":
            seq.decoder_from = max(0, n - cfg.sliding_window)
        self.running.append(seq)

    # -- one step --
    def _schedule(self) -> list[tuple[Sequence, list[int], str]]:
        while self.waiting and len(self.running) < self.max_batch:
            self._admit(self.waiting.pop(0))
        work, budget = [], self.max_tokens_per_step
        for seq in self.running:  # decodes first: one token each
            if not seq.prefilling and budget > 0:
                work.append((seq, [seq.out[-1]], "last"))
                budget -= 1
        for seq in self.running:  # then prefill chunks, oldest first
            if seq.prefilling and budget > 0:
                n = min(len(seq.prompt) - seq.fed, budget)
                ids = seq.prompt[seq.fed:seq.fed + n]
                last = seq.fed + n == len(seq.prompt)
                work.append((seq, ids, "last" if last else "none"))
                budget -= n
        return work

    def _image_rows(self, seq: Sequence, start: int, ids: list[int]) -> torch.Tensor | None:
        if seq.image_rows is None:
            return None
        tok = self.cfg.image_token_id
        before = sum(1 for t in seq.prompt[:start] if t == tok)
        here = sum(1 for t in ids if t == tok)
        return seq.image_rows[before:before + here] if here else None

    def run_chunks(self, chunks: list[Chunk], ctx: ForwardContext | None = None, check: bool = False):
        """One forward over `chunks` (a captured decode graph when every chunk is one decode
        token and graphs are on); returns (logits of the requested rows, the context, batch)."""
        ctx = ctx or ForwardContext()
        decode = all(len(c.ids) == 1 and c.logits == "last" and c.image_embeds is None
                     and c.decoder_from <= c.state.length for c in chunks)
        if self.graphs is not None and decode and ctx.features is None and self.graphs.bucket(len(chunks)):
            # built on the host: the graph runner copies it into its persistent device buffers
            # (one copy per field instead of a device tensor per field and then a copy)
            batch = build_step(self.cfg, self.pool, chunks, "cpu", self._image_token())
            logits = self.graphs.run(batch)  # (graph replays keep no counters)
            self._graph_picks = self.graphs.picked[:len(chunks)]
            return logits, ctx, batch
        batch = build_step(self.cfg, self.pool, chunks, self.device, self._image_token())
        logits = self.model(batch, self.pool, ctx=ctx, check=check)
        self._graph_picks = None
        return logits, ctx, batch

    def _image_token(self) -> int | None:
        return self.cfg.image_token_id if self.cfg.vision is not None else None

    def step(self) -> list[Sequence]:
        """Schedule, run one forward, sample; returns the sequences that finished. In the
        overlapped decode loop one call launches a step and reads the one before it."""
        if self._can_overlap():
            return self._overlapped_step()
        if self._launched is not None:  # something the loop cannot launch: read its last step first
            return self.drain()
        work = self._schedule()
        if not work:
            return []
        chunks = []
        for seq, ids, want in work:
            start = seq.state.length
            if seq.prefilling:
                chunks.append(Chunk(seq.state, ids, seq.decoder_from, want, self._image_rows(seq, start, ids)))
            else:  # a generated token is text, whatever its id
                chunks.append(Chunk(seq.state, ids, 0, want, text_only=True))
            if seq.prefilling:
                seq.fed += len(ids)
        logits, ctx, _ = self.run_chunks(chunks)
        wanted = [seq for seq, _, want in work if want != "none"]
        # (each drawn token's position: its sequence's length after this step's tokens)
        tokens = sample_rows(logits, [s.params for s in wanted], [s.state.length for s in wanted],
                             picked=self._graph_picks)
        # counters stay on the device until a result or `counters` reads them: a prefill chunk's
        # step returns without waiting for the device (the host builds the next one meanwhile)
        done, parts = ctx.count_parts()
        self._counters += done
        self._counter_parts = fold_counts(self._counter_parts + parts)
        finished, row = [], 0
        now = time.perf_counter()
        for seq, ids, want in work:
            seq.add_counts(done, parts)
            if want == "none":
                continue
            if self.prefix is not None and seq.image_rows is None and not seq.out:
                self.prefix.insert(seq.prompt, seq.state.glob_blocks)
            tok = tokens[row]
            if self.record_logits:
                seq.logits.append(logits[row].clone())
            row += 1
            if not seq.out:
                seq.t_first = now
            if seq.accept(tok, now):
                finished.append(seq)
        for seq in finished:
            self.finish(seq)
        self._free_old_windows()
        return finished

    def finish(self, seq: Sequence) -> None:
        """Release a sequence's blocks (prefix-cached global blocks stay, evictable)."""
        if self._launched is not None and any(s is seq for s in self._launched.seqs):
            self.drain()  # (the launched step still writes this sequence's cache rows)
        if seq in self.running:
            self.running.remove(seq)
        seq.state.release(self.pool, self.prefix.keep if self.prefix is not None else None)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the overlapped decode loop --
    def _can_overlap(self) -> bool:
        """Whether the next step can be launched before the current one's tokens are read:
        decode rows only (greedy or sampled: both are drawn on the device), nothing waiting, a
        graph bucket holds the batch, and the n-grams are hashed on the device (no host
        fetch-ahead of Engram rows)."""
        if not self.overlap or self.waiting or self.record_logits or not self.running:
            return False
        if self.graphs.bucket(len(self.running)) is None:
            return False
        if any(s.prefilling or not s.out for s in self.running):
            return False
        if self._launched is not None and set(map(id, self.running)) != set(map(id, self._launched.seqs)):
            return False
        prefetch = self.model.engram_prefetch()
        return prefetch is None or not prefetch.layers

    def _launch(self, seqs: list[Sequence], prev_rows: list[int] | None) -> _Launched:
        """Build and replay one decode step of `seqs` (input ids from the host, or, with
        `prev_rows`, the launched step's tokens of those rows, on the device), draw its tokens on
        the device (the greedy ones inside the replay, `core/sampling.py`), then start copying
        them back."""
        if prev_rows is None:
            chunks = [Chunk(s.state, [s.out[-1]], 0, "last", text_only=True) for s in seqs]
        else:  # the ids are on the device; the host list holds a placeholder until they are read
            chunks = [Chunk(s.state, [0], 0, "last", text_only=True) for s in seqs]
        batch = build_step(self.cfg, self.pool, chunks, "cpu", self._image_token())
        logits = self.graphs.run(batch, prev_rows)
        platform = self.graphs.platform
        rows = RowParams.of([s.params for s in seqs], [s.state.length for s in seqs], logits.device,
                            platform.pinned_empty)
        picked = pick_tokens(logits, rows, self.graphs.picked[:len(seqs)])
        host = platform.pinned_empty((len(seqs), 2), torch.long)
        host.copy_(picked, non_blocking=True)
        copied = platform.event()
        copied.record()
        return _Launched(list(seqs), host, copied)

    def _overlapped_step(self) -> list[Sequence]:
        """Launch the next decode step (its input ids the launched step's tokens, on the
        device), then read the launched step's tokens and do its bookkeeping."""
        prev = self._launched
        if prev is None:  # the loop starts: this step's ids are known on the host
            self._launched = self._launch(list(self.running), None)
            return []
        # rows that still need a token after the one being read (max_new_tokens is known ahead)
        keep = [i for i, s in enumerate(prev.seqs) if len(s.out) + 1 < s.params.max_new_tokens]
        self._launched = None
        if keep:  # (the replay takes each kept row's token from the launched step's picks)
            self._launched = self._launch([prev.seqs[i] for i in keep], keep)
        return self._read(prev)

    def _read(self, done: _Launched) -> list[Sequence]:
        """Wait for a launched step's tokens and do what `step` does after sampling: append,
        stop, finish, free old SWA blocks. The next launched step (if any) ran with each token
        as its input: its placeholder in the host's token list is replaced here."""
        done.copied.synchronize()
        host = _checked_tokens(done.host.tolist())
        nxt = self._launched
        in_next = set(map(id, nxt.seqs)) if nxt is not None else set()
        now = time.perf_counter()
        finished = []
        for seq, tok in zip(done.seqs, host):
            if seq.finish_reason:  # stopped at the step before (its row here was computed for nothing)
                continue
            if id(seq) in in_next:
                seq.state.tokens[seq.state.length - 1] = tok  # the next step's input position
            if seq.accept(tok, now):
                finished.append(seq)
        if any(id(s) in in_next for s in finished):
            # a stopped sequence's row of the next step is dropped: wait for that step before its
            # blocks go back, and read it (its other rows' tokens) without launching more
            finished += self.drain()
        for seq in finished:
            if any(s is seq for s in self.running):  # (not those the drain above finished)
                self.finish(seq)
        self._free_old_windows()
        return finished

    def _free_old_windows(self) -> None:
        """Give back SWA blocks no running sequence's window can reach again (windows look
        back sliding_window - 1 positions)."""
        for seq in self.running:
            seq.state.free_old_swa(self.pool, seq.state.length - 2 * self.cfg.sliding_window)

    def drain(self) -> list[Sequence]:
        """Read the launched step of the overlapped loop, if any (no new launch); returns the
        sequences that finished. Call before changing sequences' states by hand."""
        done, self._launched = self._launched, None
        return self._read(done) if done is not None else []

    # -- whole requests --
    def generate_batch(self, requests: list[tuple[list[int], SamplingParams | None, list[torch.Tensor] | None]],
                       on_step=None) -> list[GenerationResult]:
        """Run every request to completion in one continuous batch; results in input order."""
        seqs = [self.add(prompt, params, images) for prompt, params, images in requests]
        while self.has_work():
            self.step()
            if on_step is not None:
                on_step()
        return [s.result() for s in seqs]

    def generate(self, prompt: list[int], params: SamplingParams | None = None,
                 images: list[torch.Tensor] | None = None) -> GenerationResult:
        return self.generate_batch([(prompt, params, images)])[0]

    def generate_speculative(self, prompt: list[int], params: SamplingParams | None = None, opts=None,
                             images: list[torch.Tensor] | None = None) -> GenerationResult:
        """`generate` with DSpark speculative decoding; `opts` is a `spec_decode.SpecOptions`
        (fixed verify length or the scheduler's choice). Statistics in `result.spec`."""
        from .spec_decode import generate_speculative

        return generate_speculative(self, prompt, params, opts, images)

    # -- one sequence at a time (speculative decoding, tools, tests) --
    def prefill_alone(self, prompt: list[int], params: SamplingParams | None = None,
                      images: list[torch.Tensor] | None = None, features: bool = False):
        """Admit one request and run its prefill by itself; returns (sequence, last logits [V],
        the DSpark target features of the decoder's prompt rows or None)."""
        seq = self.add(prompt, params, images)
        self.waiting.remove(seq)
        self._admit(seq)
        self.running.remove(seq)
        feats, logits = [], None
        while seq.prefilling:
            n = min(len(seq.prompt) - seq.fed, self.max_tokens_per_step)
            ids = seq.prompt[seq.fed:seq.fed + n]
            last = seq.fed + n == len(seq.prompt)
            ch = Chunk(seq.state, ids, seq.decoder_from, "last" if last else "none",
                       self._image_rows(seq, seq.state.length, ids))
            seq.fed += n
            lg, ctx, _ = self.run_chunks([ch], ForwardContext(features={} if features else None))
            # counters reduced on the device and read once after the last chunk: no device sync
            # between chunks (the host builds and launches the next chunk while this one runs)
            seq.add_counts(*ctx.count_parts())
            if features and ctx.features:
                feats.append(target_features_of(ctx, self.cfg))
            # the step's context holds its candidate pool and top-k ids ([chunk, 16K] int64: 1 GB
            # at an 8192-token chunk of the mini preset): dropped before the next chunk runs
            del ctx
            if last:
                logits = lg[0]
        seq.read_counts()
        if self.prefix is not None and seq.image_rows is None:
            self.prefix.insert(seq.prompt, seq.state.glob_blocks)
        return seq, logits, (torch.cat(feats) if feats else None)


def target_features_of(ctx: ForwardContext, cfg) -> torch.Tensor:
    """Concatenated mean-over-streams features [rows, n_targets * d] of a step's decoder rows."""
    return torch.cat([ctx.features[i] for i in cfg.dspark_target_layer_ids], -1)


class SingleSequence:
    """One sequence fed chunk by chunk through the batched forward (a batch of one): the
    convenience tests and tools use to drive the model directly."""

    def __init__(self, model: Transformer, pool: KVPool | None = None, block_size: int = 16):
        self.model = model
        self.pool = pool or KVPool(model.cfg, block_size=block_size, device=model.embed.weight.device,
                                   drafter=getattr(model, "mtp", None) is not None)
        self.state = SequenceState()

    @property
    def length(self) -> int:
        return self.state.length

    @property
    def tokens(self) -> list[int]:
        return self.state.tokens[: self.state.length]

    def feed(self, ids, *, decoder_from: int = 0, all_logits: bool = False, return_hidden: bool = False,
             image_embeds: torch.Tensor | None = None, ctx: ForwardContext | None = None) -> torch.Tensor:
        """Run `ids` at positions length .. and return the last row's logits [V] (all decoder
        rows' [T, V] with `all_logits`; the collapsed final streams with `return_hidden`)."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        chunk = Chunk(self.state, ids, decoder_from, "all" if (all_logits or return_hidden) else "last", image_embeds)
        image_token = self.model.cfg.image_token_id if self.model.cfg.vision is not None else None
        batch = build_step(self.model.cfg, self.pool, [chunk], self.model.embed.weight.device, image_token)
        out = self.model(batch, self.pool, ctx=ctx, return_hidden=return_hidden)
        return out if (all_logits or return_hidden) else out[0]

    def rollback(self, n_tokens: int) -> None:
        """Forget every position from `n_tokens` on (rows are addressed by position, so the
        rejected tokens' rows are simply overwritten later)."""
        if not 0 <= n_tokens <= self.state.length:
            raise ValueError(f"cannot roll back to {n_tokens} tokens (now {self.state.length})")
        self.state.length = n_tokens
