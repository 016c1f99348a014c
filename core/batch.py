"""The execution interface: one forward over a flat batch of tokens from many sequences.

`StepBatch` is everything a step needs, built on the host before the step (`build_step`): token
ids, positions, each token's sequence, one block table per cache kind, the window floors, the
Engram n-gram inputs, which rows go through the decoder and which rows' logits are wanted. The
forward reads and writes the paged pools (`cache.KVPool`) in place through the tables and never
asks the host anything: a decode step's shapes depend only on its batch size (and the table
width the caller chooses), so it can be captured as a device graph.

Block tables come in groups: `swa_tables` / `glob_tables` hold one table per group, and each
pool of the `KVPool` names the table it is addressed through and its block size (the reference
engine has one group per kind; vLLM's hybrid allocator gives layer groups their own tables and
block sizes). Rows are addressed by `backends.paging.table_rows` only.

`Rows` is the per-row view of a batch that the layers use (positions, the rows where each token's
SWA entry goes, its sequence's table rows, its window); the decoder takes a subset of it in CED
prefill.
"""

from __future__ import annotations

import array
import threading
from dataclasses import dataclass, field, replace

import torch

from ..backends.paging import NULL_BLOCK, table_rows, window_rows
from ..backends.platform import to_device
from .cache import FLOOR_DECODER, BlockTable, GlobalPool, KVPool, SequenceState, SWAPool
from .config import ModelConfig


@dataclass
class StepBatch:
    """One forward step over T tokens of B sequences (tensors on the model's device)."""

    ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    seq: torch.Tensor  # [T] long: the token's sequence (row of the per-sequence tensors)
    swa_tables: tuple  # per table group: [B, nbw] long, logical SWA block -> pool block (0 = none)
    glob_tables: tuple  # per table group: [B, nbg] long, logical global block -> pool block
    floors: torch.Tensor  # [B, 3] long: lowest visible window position (encoder, decoder, drafter)
    glob_from: torch.Tensor  # [B] long: global entries of positions below this exist already
    ngram_ids: torch.Tensor  # [T, N] long: ids at positions p, p-1, .. p-N+1 (-1 before the start)
    ngram_image: torch.Tensor  # [T, N] bool: those positions hold image tokens
    is_image: torch.Tensor  # [T] bool
    decoder_rows: torch.Tensor | None = None  # rows the decoder runs (CED prefill); None = all
    logit_rows: torch.Tensor | None = None  # decoder rows whose logits are returned; None = all
    image_embeds: torch.Tensor | None = None  # [image rows of the batch, d], in row order
    # the DSpark draft block: every row sees its sequence's context window [lo, block start) and
    # the whole block (non-causal); None = the causal sliding window
    draft_window: tuple[torch.Tensor, torch.Tensor] | None = None  # (lo [T], hi [T]) positions
    # host copies of (ngram_ids, ngram_image): Engram rows of host-held tables are gathered from
    # them before the step (core/engram.EngramPrefetch); None = read back from the device
    ngram_host: tuple[torch.Tensor, torch.Tensor] | None = None
    # row i is sequence i (seq = arange(T): a decode step, one token per sequence), so the
    # per-sequence tensors are already per row: `Rows.of` gathers nothing (a host fact, fixed
    # when the batch is laid out; a decode graph's persistent batch keeps it)
    rows_are_sequences: bool = False

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[0]


@dataclass
class Rows:
    """The rows one layer processes, with what they need to find their cache entries."""

    pos: torch.Tensor  # [T]
    seq: torch.Tensor  # [T]
    is_image: torch.Tensor  # [T]
    swa_tables: tuple  # per table group [T, nbw]: the row's sequence's SWA table
    glob_tables: tuple  # per table group [T, nbg]
    floors: torch.Tensor  # [T, 3]
    glob_from: torch.Tensor  # [T]
    win_lo: torch.Tensor  # [T] first key position of the window
    win_hi: torch.Tensor  # [T] last key position of the window
    width: int  # key slots per row (window size, or window + block for a draft)
    n_seqs: int = 0  # sequences of the step (the tables' rows; a host int; 0 = not known)
    # what every layer would otherwise compute again from these rows (windows, write rows, RoPE
    # tables, compressor metadata): made once per step, on first use (`memo`)
    _memo: dict = field(default_factory=dict)

    @classmethod
    def of(cls, b: StepBatch, cfg: ModelConfig) -> "Rows":
        seq, w = b.seq, cfg.sliding_window
        if b.draft_window is None:
            lo, hi, width = b.positions - (w - 1), b.positions, w
        else:
            lo, hi = b.draft_window
            width = w + cfg.dspark_block_size
        if b.rows_are_sequences and b.floors.shape[0] == b.num_tokens:  # per row already: no gathers
            return cls(b.positions, seq, b.is_image, tuple(b.swa_tables), tuple(b.glob_tables), b.floors,
                       b.glob_from, lo, hi, width, b.floors.shape[0])
        return cls(b.positions, seq, b.is_image, tuple(t[seq] for t in b.swa_tables),
                   tuple(t[seq] for t in b.glob_tables), b.floors[seq], b.glob_from[seq], lo, hi, width,
                   b.floors.shape[0])

    def select(self, index: torch.Tensor) -> "Rows":
        pick = lambda t: t[index]  # noqa: E731
        return replace(self, pos=pick(self.pos), seq=pick(self.seq), is_image=pick(self.is_image),
                       swa_tables=tuple(map(pick, self.swa_tables)), glob_tables=tuple(map(pick, self.glob_tables)),
                       floors=pick(self.floors), glob_from=pick(self.glob_from), win_lo=pick(self.win_lo),
                       win_hi=pick(self.win_hi), _memo={})

    @property
    def num(self) -> int:
        return self.pos.shape[0]

    def memo(self, key: tuple, make):
        """`make()`, computed once for these rows and `key` (a per-step quantity several layers
        share: the key must name everything the value depends on besides the rows)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def rows_bound(self, swa: SWAPool, g: GlobalPool | None) -> tuple[int, int] | None:
        """(window, global) bounds of the distinct rows of pools `swa` and `g` these rows' tables
        reach: sequences x table width x rows per block (host ints, no device read; the
        `rows_bound` of `ops.sparse_attention`). None when the sequence count is not known."""
        if not self.n_seqs:
            return None
        w = self.n_seqs * self.swa_tables[swa.table].shape[1] * swa.block_size
        return w, (self.n_seqs * self.glob_table(g).shape[1] * g.entries_per_block if g is not None else 0)

    def glob_table(self, g: GlobalPool) -> torch.Tensor:
        """[T, nbg] the global table each row's entries of pool `g` are addressed through."""
        return self.glob_tables[g.table]

    def swa_rows_at(self, swa: SWAPool, positions: torch.Tensor) -> torch.Tensor:
        """Rows of window pool `swa` (and its compressor rows) at positions [T, ...] >= 0 of each
        row's sequence."""
        return table_rows(self.swa_tables[swa.table], swa.block_size, positions)

    def swa_rows(self, swa: SWAPool) -> torch.Tensor:
        """Where each row's own entry of window pool `swa` (and its compressor rows) is written."""
        return self.memo(("own", swa.table, swa.block_size),
                         lambda: self.swa_rows_at(swa, self.pos.unsqueeze(1))[:, 0])

    def window(self, swa: SWAPool, group: int) -> torch.Tensor:
        """[T, width] rows of window pool `swa` each query attends (-1 = masked), oldest first.
        Positions below the layer group's floor were never computed for this sequence, and
        positions in the null block are not held (below a bounded replay's start, or outside
        every window: the block was given back)."""
        return self.memo(("window", group, swa.table, swa.block_size),
                         lambda: window_rows(self.swa_tables[swa.table], swa.block_size, self.win_lo, self.win_hi,
                                             self.floors[:, group], self.width))


@dataclass
class Chunk:
    """What one sequence runs in a step: `ids` at positions state.length .. ; `decoder_from`: the
    first position the decoder runs (CED prefill; 0 = every row); `logits`: "last", "all" or
    "none" of the decoder's rows; `image_embeds`: rows for this chunk's image positions;
    `text_only`: the ids are generated tokens, text even where one equals the image token id
    (only a prompt's image spans are image positions)."""

    state: SequenceState
    ids: list[int]
    decoder_from: int = 0
    logits: str = "last"
    image_embeds: torch.Tensor | None = None
    text_only: bool = False


def block_tables(tables: list) -> torch.Tensor:
    """[B, longest (at least 1)] int64 host tensor of the sequences' block tables, padded with the
    null block: one `torch.stack` of equal-width views of each `BlockTable`'s tensor copy (its
    spare capacity is already the null block), no per-step list conversion or padding pass. 64
    tables of 2050 blocks (a decode batch at 32K), a 2-core development CPU with other work on it:
    0.97-1.66 ms with `pad_sequence` over exact-length views, 0.62-1.07 ms stacked (two tables a
    step). A fresh tensor each call (see `StackedTables` for the step-to-step form)."""
    width = max(1, max((len(tb) for tb in tables), default=0))
    return torch.stack([tb.padded(width) if isinstance(tb, BlockTable)
                        else BlockTable(tb).padded(width) for tb in tables]) if tables \
        else torch.full((0, 1), NULL_BLOCK, dtype=torch.long)


class StackedTables:
    """`block_tables` for one kind of table across consecutive steps: when a step has the same
    BlockTable objects in the same order at the same width as the step before, only the rows of
    tables that changed since (`BlockTable.version`) are rewritten into the kept stack; a decode
    step at 32K context changes about one table in sixteen (a block appended every block_size
    tokens, a window block freed). Returns a copy, so no step's tensor changes later."""

    def __init__(self):
        self._lock = threading.Lock()  # (steps built from several threads share the kept stack)
        self._tables: tuple = ()
        self._versions: tuple = ()
        self._out: torch.Tensor | None = None

    def __call__(self, tables: list) -> torch.Tensor:
        if not tables or not all(isinstance(tb, BlockTable) for tb in tables):
            return block_tables(tables)
        width = max(1, max(len(tb) for tb in tables))
        with self._lock:
            out = self._out
            if out is not None and out.shape == (len(tables), width) \
                    and all(a is b for a, b in zip(tables, self._tables)):
                for i, (tb, seen) in enumerate(zip(tables, self._versions)):
                    if tb.version != seen:
                        out[i] = tb.padded(width)
            else:
                out = self._out = block_tables(tables)
            self._tables, self._versions = tuple(tables), tuple(tb.version for tb in tables)
            return out.clone()


# one per kind of table: SWA, global
_STACKED = (StackedTables(), StackedTables())


_ARRAY_CODES = {torch.long: "q", torch.bool: "B"}


def host_tensor(data: list, dtype: torch.dtype) -> torch.Tensor:
    """A flat list of Python ints (or bools) as a 1-D CPU tensor. Long lists go through a typed array
    (`array.array`, then `torch.frombuffer`, which keeps the array alive): 3-4x faster than
    `torch.tensor` on a list (1792 ints: 19 against 69 us here), and a prefill step converts a
    dozen such lists."""
    code = _ARRAY_CODES.get(dtype)
    if code is None or len(data) < 64:
        return torch.tensor(data, dtype=dtype)
    return torch.frombuffer(array.array(code, data), dtype=dtype)


def build_step(cfg: ModelConfig, pool: KVPool, chunks: list[Chunk], device: torch.device | str,
               image_token_id: int | None = None) -> StepBatch:
    """Lay out one step of `chunks` (one per sequence): allocate the blocks the new positions
    need, advance each state (tokens, length, floors) and build the step's tensors."""
    n_gram = max(cfg.engram_max_ngram_size, 1)
    for ch in chunks:  # everything checked before any state changes
        start = ch.state.length
        if not ch.ids:
            raise ValueError("a chunk must hold at least one token")
        if min(ch.ids) < 0 or max(ch.ids) >= cfg.vocab_size:
            bad = next(t for t in ch.ids if not 0 <= t < cfg.vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {cfg.vocab_size})")
        if start + len(ch.ids) > cfg.max_position_embeddings:
            raise ValueError(f"sequence of {start + len(ch.ids)} tokens exceeds max_position_embeddings "
                             f"({cfg.max_position_embeddings})")
        n_img = 0 if ch.text_only or image_token_id is None else ch.ids.count(image_token_id)
        if ch.image_embeds is not None and tuple(ch.image_embeds.shape) != (n_img, cfg.hidden_size):
            raise ValueError(f"the chunk has {n_img} image-token positions, so image_embeds must be "
                             f"[{n_img}, {cfg.hidden_size}], got {list(ch.image_embeds.shape)}")
    # Row lists are extended a chunk at a time (C-speed list ops), and the n-gram windows are one
    # gather over the step: a per-token Python loop cost ~3 us a token (5 ms a 1792-token prefill
    # step on the H200 host), host time the device waits for when the step is launch-bound.
    ids, pos, seq, is_img, dec_rows, logit_rows, images = [], [], [], [], [], [], []
    hist_tok, hist_img, hist_at = [], [], []  # each chunk's last n_gram - 1 older positions + its own
    n_dec = 0
    for b, ch in enumerate(chunks):
        st, start, n = ch.state, ch.state.length, len(ch.ids)
        img = ([t == image_token_id for t in ch.ids] if not ch.text_only and image_token_id is not None
               and image_token_id in ch.ids else [False] * n)
        del st.tokens[start:], st.is_image[start:]  # (after a rollback: forget rejected tokens)
        st.tokens += ch.ids
        st.is_image += img
        st.ensure_blocks(pool, start + n)
        if ch.decoder_from > start:  # CED: the decoder never computed rows below decoder_from
            st.floors[FLOOR_DECODER] = max(st.floors[FLOOR_DECODER], ch.decoder_from)
        row0, lo = len(ids), max(0, start - (n_gram - 1))
        hist_at.extend(range(len(hist_tok) + start - lo, len(hist_tok) + start - lo + n))  # a row's own position
        hist_tok += st.tokens[lo:start + n]
        hist_img += st.is_image[lo:start + n]
        ids += ch.ids
        pos.extend(range(start, start + n))
        seq += [b] * n
        is_img += img
        first = min(n, max(0, ch.decoder_from - start))  # rows j >= first reach the decoder
        dec_rows.extend(range(row0 + first, row0 + n))
        if ch.logits == "all":
            logit_rows.extend(range(n_dec, n_dec + n - first))
        elif ch.logits == "last" and first < n:
            logit_rows.append(n_dec + n - first - 1)
        n_dec += n - first
        if ch.image_embeds is not None:
            images.append(ch.image_embeds)
        st.length = start + n
    back = torch.arange(n_gram)  # n-gram slot s holds position p - s (-1 / False before the start)
    pos_t = host_tensor(pos, torch.long)
    ok = pos_t[:, None] >= back
    at = (host_tensor(hist_at, torch.long)[:, None] - back).clamp(min=0)
    ngram_host = (torch.where(ok, host_tensor(hist_tok, torch.long)[at], -1),
                  ok & host_tensor(hist_img, torch.bool)[at])  # sent once
    # built on the host, sent without a host wait (`to_device`): the forward reads nothing back,
    # so the host builds the next step (a prefill's next chunk) while the device runs this one
    def t(data, dtype):
        return to_device(data if isinstance(data, torch.Tensor) else host_tensor(data, dtype), device)

    return StepBatch(
        ids=t(ids, torch.long),
        positions=t(pos_t, torch.long),
        seq=t(seq, torch.long),
        swa_tables=(to_device(_STACKED[0]([c.state.swa_blocks for c in chunks]), device),),
        glob_tables=(to_device(_STACKED[1]([c.state.glob_blocks for c in chunks]), device),),
        floors=to_device(torch.tensor([c.state.floors for c in chunks], dtype=torch.long), device),
        glob_from=t([c.state.glob_from for c in chunks], torch.long),
        ngram_ids=to_device(ngram_host[0], device),
        ngram_image=to_device(ngram_host[1], device),
        is_image=t(is_img, torch.bool),
        decoder_rows=None if len(dec_rows) == len(ids) else t(dec_rows, torch.long),
        logit_rows=None if len(logit_rows) == n_dec else t(logit_rows, torch.long),
        image_embeds=torch.cat(images) if images else None,
        ngram_host=ngram_host,
        rows_are_sequences=all(len(ch.ids) == 1 for ch in chunks),  # (then seq = 0 .. B - 1)
    )
