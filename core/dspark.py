"""DSpark: the speculative drafter of DeepSeek-V4.1-Flash (`mtp.0..2`, MODEL.md section 3).

Structure (checkpoint names under `mtp.K.`):
- every stage is a backbone `Block` of an SWA-only layer (`compress_ratios[L + K]` = 0: RoPE theta
  10000 without YaRN, no compressor / indexer / Engram) whose MoE has `dspark_n_routed_experts`
  routed experts, top `dspark_num_experts_per_tok`, and its own shared expert; the stages are
  chained through single-pass mHC exactly like backbone layers;
- stage 0 owns the feature fusion: at the inputs of the `dspark_target_layer_ids` layers the main
  model's mHC streams are averaged, concatenated and mapped by `main_proj` + `main_norm`;
- the last stage owns the final `norm`, the Markov head and the confidence head; logits come from
  the backbone's shared `head`.

Runtime (our reading where the spec is terse; each choice is one place to change):
- Context. For every token the main model has processed, each stage writes a KV row computed
  from the fused feature h = main_norm(main_proj(concat)) (the official drafter: no
  `attn_norm` on this path): kv_norm(wkv(h)), RoPE at the token's position, FP8, into its SWA
  pool at the token's position. Only accepted tokens are written as context.
- Draft block. Tokens [last token, noise x (B-1)] at positions start+1 .. start+B (`start` = the
  last context position) run through the stages, non-causal inside the block; EVERY block row
  sees all valid context entries of the window (min(window, start+1) of them, no per-row
  sliding limit) plus all B block rows. Row j's logits predict the token at start+2+j: B
  drafts per forward.
- Markov head: a rank-r factorised bigram table, `embed` [V, r] and `head` [V, r]; draft j's
  logits = base_j + head . embed[previous draft] (the previous draft of row 0 is the last token),
  so drafts are chosen one after another (semi-autoregressive).
- Confidence head: a raw logit per row from concat(hidden before the final norm, Markov
  embedding of that row's previous token); sigmoid of it estimates the row's acceptance given
  that every earlier draft was accepted. The head and the projection run in fp32.
The draft step's shapes are static: always B rows over a window of `sliding_window + B` keys. Verification: `core/spec_decode.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..backends import ops
from .batch import Rows, StepBatch
from .cache import FLOOR_DRAFT, KVPool, SequenceState
from .config import ConfigError, ModelConfig
from .model import (
    Block,
    ForwardContext,
    Linear,
    RMSNorm,
    _dense,
    embed_rows,
    rope_tables,
)
from .parallel import SINGLE, Group


def dspark_problems(cfg: ModelConfig) -> list[str]:
    """What makes `cfg`'s DSpark fields unusable (empty when fine or when there is no drafter)."""
    n, L = cfg.num_nextn_predict_layers, cfg.num_hidden_layers
    if n <= 0:
        return []
    p = []
    bad = [i for i in cfg.dspark_target_layer_ids if not 0 <= i < L]
    if not cfg.dspark_target_layer_ids or bad:
        p.append(f"dspark_target_layer_ids {cfg.dspark_target_layer_ids} must name backbone layers 0..{L - 1}")
    ratios = cfg.compress_ratios[L:L + n]
    if any(r != 0 for r in ratios):
        p.append(f"compress_ratios[{L}:{L + n}] = {ratios}: DSpark stages are SWA-only (ratio 0)")
    if cfg.dspark_block_size < 2:
        p.append(f"dspark_block_size must be >= 2, got {cfg.dspark_block_size}")
    if cfg.dspark_block_size >= cfg.sliding_window:
        p.append(f"dspark_block_size ({cfg.dspark_block_size}) must be below sliding_window ({cfg.sliding_window})")
    if not 0 <= cfg.dspark_noise_token_id < cfg.vocab_size:
        p.append(f"dspark_noise_token_id {cfg.dspark_noise_token_id} is outside the vocabulary")
    if not 0 < cfg.dspark_num_experts_per_tok <= cfg.dspark_n_routed_experts:
        p.append(f"dspark_num_experts_per_tok ({cfg.dspark_num_experts_per_tok}) must be in "
                 f"1..dspark_n_routed_experts ({cfg.dspark_n_routed_experts})")
    if cfg.dspark_markov_rank <= 0:
        p.append(f"dspark_markov_rank must be > 0, got {cfg.dspark_markov_rank}")
    return p


class MarkovHead(nn.Module):
    """Rank-r bigram logits: embed[previous token] . head^T, both factors [V, r] (bf16)."""

    def __init__(self, vocab: int, rank: int, group: Group = SINGLE):
        super().__init__()
        self.group = group  # model parallel: both factors split by vocabulary rows
        vocab = group.split(vocab, "vocab_size")
        self.embed = Linear(rank, vocab, "bf16")  # weight [V, r]: the previous token's row
        self.head = Linear(rank, vocab, "bf16")  # weight [V, r]: scored against every token

    def forward(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(Markov embeddings [n, r] bf16, additive logits [n, V] fp32) of previous tokens [n]."""
        e = embed_rows(self.embed.weight, prev, self.group)
        return e, self.group.all_gather(self.head(e, torch.float32), -1)


class ConfidenceHead(nn.Module):
    """Raw acceptance logit of a draft row from concat(hidden before the final norm, Markov
    embedding); no bias, no sigmoid (the scheduler applies it). Promoted to fp32 at use."""

    def __init__(self, dim: int, rank: int):
        super().__init__()
        self.proj = Linear(dim + rank, 1, "bf16")

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat((h, e), -1), torch.float32)[:, 0]


class DSparkStage(Block):
    """One drafter stage: an SWA-only backbone block with the DSpark MoE; stage 0 adds the
    feature fusion, the last stage the final norm and the Markov / confidence heads."""

    def __init__(self, cfg: ModelConfig, index: int, group: Group = SINGLE):
        dcfg = cfg.replace(n_routed_experts=cfg.dspark_n_routed_experts,
                           num_experts_per_tok=cfg.dspark_num_experts_per_tok)
        super().__init__(dcfg, cfg.num_hidden_layers + index, None, group)
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        if index == 0:
            self.main_proj = Linear(len(cfg.dspark_target_layer_ids) * d, d, _dense(cfg))
            self.main_norm = RMSNorm(d, eps)
        if index == cfg.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(d, eps)
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank, group)
            self.confidence_head = ConfidenceHead(d, cfg.dspark_markov_rank)


def build_stages(cfg: ModelConfig, group: Group = SINGLE) -> nn.ModuleList | None:
    """The `mtp` module list of a Transformer (None when the config has no drafter)."""
    if cfg.num_nextn_predict_layers <= 0:
        return None
    problems = dspark_problems(cfg)
    if problems:
        raise ConfigError("invalid DSpark config:\n  - " + "\n  - ".join(problems))
    return nn.ModuleList(DSparkStage(cfg, k, group) for k in range(cfg.num_nextn_predict_layers))


# ---- runtime ----------------------------------------------------------------------------------

@dataclass
class Draft:
    """One draft block's output (B rows)."""

    tokens: torch.Tensor  # [B] long: drafts for the B positions after the last token
    logits: torch.Tensor  # [B, V] fp32: base + Markov logits each draft was chosen from
    confidence: torch.Tensor  # [B] fp32 raw acceptance logits


def target_features(ctx: ForwardContext, cfg: ModelConfig) -> torch.Tensor:
    """Concatenated mean-over-streams features [T, n_targets * d] of the last forward's rows
    (the decoder's rows: with CED prefill only the last window of the prompt)."""
    feats = [ctx.features[i] for i in cfg.dspark_target_layer_ids]
    t = min(f.shape[0] for f in feats)
    return torch.cat([f[f.shape[0] - t:] for f in feats], -1)


def verify_forward(model, pool: KVPool, batch: StepBatch, writer: DSpark | None, check: bool = False):
    """The body of a verification step, eager or inside its captured graph (`graphs/verify.py`):
    the forward over `batch` with every row's logits, the target features of its rows and, with
    a `writer` (a DSpark of the model), the drafter's context KV of every row
    (`DSpark.write_context`). Returns (logits, features, the forward's context)."""
    ctx = ForwardContext(features={})
    logits = model(batch, pool, ctx=ctx, check=check)
    feats = target_features(ctx, model.cfg)
    if writer is not None:
        writer.write_context(pool, Rows.of(batch, model.cfg), feats)
    return logits, feats, ctx


class DSpark:
    """Runs the `mtp` stages of a `Transformer`: absorbs context features into the stages' SWA
    pools (the sequence's SWA block table addresses them by position, like the backbone's
    layers) and drafts blocks through the backbone's own batched `Block` code."""

    def __init__(self, model):
        if getattr(model, "mtp", None) is None:
            raise ValueError("this model has no DSpark drafter (num_nextn_predict_layers = 0)")
        self.model, self.cfg = model, model.cfg
        self.stages = list(model.mtp)
        self.block_size = self.cfg.dspark_block_size
        dev = model.embed.weight.device
        self._noise = [self.cfg.dspark_noise_token_id] * (self.block_size - 1)
        self._pre = torch.zeros(self.block_size, self.cfg.hc_mult, dtype=torch.float32, device=dev)
        self._pre[:, 0] = 1.0  # the first sublayer collapses with one-hot [1, 0, 0, 0]
        self.graph = None  # a captured greedy draft block (`graphs/draft.DraftGraph`), set by its owner

    def _rows_at(self, pool: KVPool, state: SequenceState, pos: list[int]) -> torch.Tensor:
        bs = pool.block_size
        return torch.tensor([state.swa_blocks[p // bs] * bs + p % bs for p in pos], dtype=torch.long,
                            device=self._pre.device)

    @torch.no_grad()
    def absorb(self, pool: KVPool, state: SequenceState, feats: torch.Tensor, start: int) -> None:
        """Write each stage's context KV of positions start .. start+T-1 from the main model's
        target-layer features [T, n_targets * d] (the rows must continue the context): the
        official drafter's kv_norm(wkv(main_x)), RoPE at the position, FP8."""
        t = feats.shape[0]
        if t == 0:
            return
        if state.draft_length == 0:  # first rows (e.g. after CED prefill): nothing older is valid
            state.floors[FLOOR_DRAFT] = start
        elif start != state.draft_length:
            raise ValueError(f"drafter context must continue at position {state.draft_length}, got {start}")
        pos = list(range(start, start + t))
        rows = self._rows_at(pool, state, pos)
        self._write_kv(pool, feats, torch.tensor(pos, device=feats.device), lambda swa: rows)
        state.draft_length = start + t

    def _write_kv(self, pool: KVPool, feats: torch.Tensor, positions: torch.Tensor, rows_of) -> None:
        """Each stage's context KV of the rows at `positions` (device [T]) from the target
        features [T, n_targets * d], written at `rows_of(stage's SWA pool)`."""
        s0 = self.stages[0]
        h = s0.main_norm(s0.main_proj(feats))
        cos, sin = None, None
        for st in self.stages:
            a = st.attn
            if cos is None:  # every stage is a ratio-0 layer: one RoPE table
                cos, sin = rope_tables(a.inv_freq, positions)
            kv8, kv_s = ops.fp8_quant(ops.rope(a.kv_norm(a.wkv(h)), cos, sin))
            swa = pool.swa[a.layer_id]
            swa.write(rows_of(swa), kv8, kv_s)

    @torch.no_grad()
    def write_context(self, pool: KVPool, rows: Rows, feats: torch.Tensor) -> None:
        """`absorb`'s KV writes for a step's rows, addressed on the device through the step's
        tables (no host read, so a verification graph holds it: `graphs/verify.py`). A
        verification writes every verified row; `advance` then keeps the accepted ones as
        context. The rejected rows' entries lie at positions past the new context, where the
        next draft block writes its own rows before any window reads them."""
        self._write_kv(pool, feats, rows.pos, rows.swa_rows)

    def advance(self, state: SequenceState, start: int, n: int) -> None:
        """The context now holds n more positions from `start`, written by `write_context`."""
        if state.draft_length == 0 or start != state.draft_length:
            raise ValueError(f"drafter context must continue at position {state.draft_length}, got {start}")
        state.draft_length = start + n

    def _block_batch(self, pool: KVPool, state: SequenceState, last_token: int) -> StepBatch:
        """The draft block as a one-sequence step: rows at positions n .. n+B-1 (n = context
        length), each seeing the context window [n - W, n) and the whole block. The block's own
        rows go to the stages' pools at their positions as scratch: the context written there
        later (`absorb`) replaces them before any window reads them as context."""
        cfg, b, dev = self.cfg, self.block_size, self._pre.device
        n = state.draft_length
        state.ensure_blocks(pool, n + b)
        t = lambda x, dt=torch.long: torch.tensor(x, dtype=dt, device=dev)  # noqa: E731
        pos = t(list(range(n, n + b)))
        return StepBatch(
            ids=t([last_token] + self._noise), positions=pos, seq=t([0] * b),
            swa_tables=(t([state.swa_blocks]),), glob_tables=(t([state.glob_blocks]),), floors=t([state.floors]),
            glob_from=t([state.glob_from]), ngram_ids=t([[-1]] * b), ngram_image=t([[False]] * b, torch.bool),
            is_image=t([False] * b, torch.bool),
            draft_window=(torch.full_like(pos, n - cfg.sliding_window), torch.full_like(pos, n + b - 1)))

    @torch.no_grad()
    def draft(self, pool: KVPool, state: SequenceState, last_token: int, choose=None) -> Draft:
        """Draft B tokens after `last_token` (at position state.draft_length). `choose(row,
        logits)` picks a token from fp32 logits [V] (default: argmax, on the device, replaying
        `self.graph` when one is set: `graphs/draft.py`)."""
        batch = self._block_batch(pool, state, last_token)
        if choose is None and self.graph is not None and self.graph.holds(batch):
            return self.graph.run(batch)
        return self.draft_block(batch, pool, choose)

    @torch.no_grad()
    def draft_block(self, batch: StepBatch, pool: KVPool, choose=None) -> Draft:
        """The draft block's forward over a prepared block batch (`_block_batch`; its first id
        is the last token). Greedy (`choose` None) reads nothing back to the host, so the
        whole block can be captured as one device graph."""
        cfg, b = self.cfg, self.block_size
        rows = Rows.of(batch, cfg)
        x = self.model.embed_tokens(batch.ids).unsqueeze(1).expand(b, cfg.hc_mult, cfg.hidden_size).contiguous()
        ctx = ForwardContext(cache=pool)
        s = self.stages[0].enter(x, self._pre, None, rows.is_image)
        for k, st in enumerate(self.stages):
            nxt = self.stages[k + 1] if k + 1 < len(self.stages) else None
            s = st(s, rows, ctx, nxt)
        last = self.stages[-1]
        h = s.x_hat  # hidden before the final norm [B, d] bf16
        base = self.model.lm_head(last.norm(h))
        # Markov head: sequential over the block (each row's previous token is the row before's draft)
        tokens, embeds, logits = [], [], []
        prev = batch.ids[:1]
        for j in range(b):
            e, add = last.markov_head(prev)
            lj = base[j] + add[0]
            if choose is None:
                prev = torch.argmax(lj, -1, keepdim=True)
            else:
                prev = torch.tensor([int(choose(j, lj))], dtype=torch.long, device=lj.device)
            tokens.append(prev)
            embeds.append(e)
            logits.append(lj)
        conf = last.confidence_head(h, torch.cat(embeds))
        return Draft(torch.cat(tokens), torch.stack(logits), conf)
