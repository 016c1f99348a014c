"""Reference CSA2 attention ops: ratio-r KV pooling, the indexer with its candidate pool, and
sparse attention over the FP8 SWA window plus FP4 global entries."""

from __future__ import annotations

import torch

from .. import numerics
from ..paging import table_rows
from ..registry import register
from . import quant
from . import basic
from .basic import einsum, exact_fn, rms_norm, rope

NEG_INF = float("-inf")
RUNNING_MAX_INIT = -1e30  # a row with no valid entry outputs 0 (spec section 3, Attention)


def pool_groups(kv: torch.Tensor, score: torch.Tensor, ratio: int) -> torch.Tensor:
    """Softmax pooling of complete groups of `ratio` rows, per channel, fp32: [G*r, D] -> [G, D]."""
    g, d = kv.shape[0] // ratio, kv.shape[-1]
    kv = kv[: g * ratio].float().reshape(g, ratio, d)
    w = exact_fn(lambda z: torch.softmax(z, dim=1), score[: g * ratio].float().reshape(g, ratio, d))
    return (w * kv).sum(1)


@register("compress_kv")
def compress_kv(kv, score, ratio, norm_weight, eps, cos, sin, codes, scales, slots):
    pooled = pool_groups(kv, score, ratio) if ratio > 1 else kv.float()
    if ratio > 1 and numerics.official():  # the official pooled latent is bf16 before its norm
        pooled = pooled.to(torch.bfloat16)
    lat = rms_norm(pooled, norm_weight, eps).to(torch.bfloat16)
    packed, sc = quant.fp4_quant(rope(lat, cos, sin))
    codes[slots] = packed
    scales[slots] = sc
    return lat


def _stable_topk_sorted(scores: torch.Tensor, k: int, valid: torch.Tensor) -> torch.Tensor:
    """Top-k column ids per row among `valid` ones, ties to the lower id, returned in ascending id
    order with -1 padding at the end."""
    s = scores.masked_fill(~valid, NEG_INF)
    k = min(k, s.shape[-1])
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k]
    ok = valid.gather(-1, order)
    big = torch.iinfo(torch.long).max
    ids = torch.where(ok, order, torch.full_like(order, big)).sort(-1).values
    return torch.where(ids == big, torch.full_like(ids, -1), ids)


def _partial_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [T, H, D], weights [T, H], keys [T, P, D] or [P, D] -> [T, P] fp64 sums over heads.

    The sum over heads runs in fp64 (each fp32 x fp32 term is exact there) and is rounded once
    by `_finish_scores`, after the model-parallel reduction, so the result does not depend on
    how the heads are split or ordered. Official numerics: the head weights are bf16
    (`weights_proj`'s output; the folded power-of-two scale does not change the rounding)."""
    if numerics.official():
        weights = weights.to(torch.bfloat16)
    if keys.dim() == 2:
        dots = einsum("thd,pd->thp", q.float(), keys)
    else:
        dots = einsum("thd,tpd->thp", q.float(), keys)
    return (torch.relu(dots).double() * weights.double().unsqueeze(-1)).sum(1)


def _finish_scores(s: torch.Tensor, reduce=None) -> torch.Tensor:
    """`reduce` (model parallelism: the sum over the other ranks' heads), then one rounding."""
    return (reduce(s) if reduce is not None else s).float()


def candidate_pool(scores: torch.Tensor, n_visible: torch.Tensor, n_blocks: int, block: int,
                   topk_sorted=None) -> torch.Tensor:
    """Hierarchical candidate pool: blocks of `block` positions scored by their best visible
    position; the newest (possibly partial) block is always kept; the best `n_blocks` blocks are
    kept (ties to the older block); unreachable blocks are dropped. Returns the chosen block ids
    [T, min(n_blocks, blocks)] in ascending order, -1 padded (block b holds entries b * block ..
    b * block + block - 1; `pool_entries` lists them). Kept as blocks, not entries: the pool
    lives through the rest of the forward, and a [T, n_blocks * block] int64 entry list was
    the largest transient buffer of a long prefill step (1 GiB at 8192 mini tokens).
    `topk_sorted` may replace the block selection with a faster one of the same contract."""
    t, n = scores.shape
    nb = -(-n // block)
    padded = torch.full((t, nb * block), NEG_INF, dtype=torch.float32, device=scores.device)
    padded[:, :n] = scores
    pos = torch.arange(nb * block, device=scores.device)
    vis = pos.unsqueeze(0) < n_visible.unsqueeze(1)
    bmax = padded.masked_fill(~vis, NEG_INF).reshape(t, nb, block).amax(-1)
    reachable = vis.reshape(t, nb, block).any(-1)
    newest = ((n_visible - 1).clamp_min(0) // block).unsqueeze(1)
    bmax = bmax.scatter(1, newest, float("inf"))
    return (topk_sorted or _stable_topk_sorted)(bmax, n_blocks, reachable)  # [T, n_blocks] block ids


def pool_entries(blocks: torch.Tensor, block: int, n_visible: torch.Tensor) -> torch.Tensor:
    """The entry ids [T, P * block] of candidate blocks [T, P] (`candidate_pool`'s form; block 1:
    entry ids), -1 for padding blocks and for entries >= n_visible[t] (a pool's newest block
    may be partial)."""
    t = blocks.shape[0]
    cand = blocks.long().unsqueeze(-1) * block + torch.arange(block, device=blocks.device)
    ok = (blocks.unsqueeze(-1) >= 0) & (cand < n_visible.view(t, 1, 1))
    return torch.where(ok, cand, torch.full_like(cand, -1)).reshape(t, -1)


def _sequence_groups(block_table: torch.Tensor):
    """Tokens grouped by their sequence (identical block-table rows): [(token ids, table row)]."""
    rows, inverse = torch.unique(block_table, dim=0, return_inverse=True)
    return [(torch.nonzero(inverse == g).flatten(), rows[g]) for g in range(rows.shape[0])]


@register("indexer_topk")
def indexer_topk(q, weights, key_codes, key_scale, block_table, entries_per_block, n_visible, topk,
                 candidates=None, pool_blocks=0, pool_block_size=1, reduce_scores=None, candidate_block_size=1):
    t = q.shape[0]
    n = block_table.shape[1] * entries_per_block  # entries addressable through the tables
    if candidates is None:
        # each sequence's keys are dequantised once and scored by all of its tokens
        s = torch.empty(t, n, dtype=torch.float64, device=q.device)
        for toks, table in _sequence_groups(block_table):
            slots = table_rows(table.unsqueeze(0), entries_per_block,
                                torch.arange(n, device=q.device).unsqueeze(0))[0].clamp_min(0)
            keys = quant.mxfp4_dequant(key_codes[slots], key_scale[slots])  # [N, Di]
            s[toks] = _partial_scores(q[toks], weights[toks], keys)
        s = _finish_scores(s, reduce_scores)
        valid = torch.arange(n, device=q.device).unsqueeze(0) < n_visible.unsqueeze(1)
        idx = _stable_topk_sorted(s, topk, valid)
        pool = candidate_pool(s.masked_fill(~valid, NEG_INF), n_visible, pool_blocks, pool_block_size) \
            if pool_blocks > 0 else None
        return idx, pool
    candidates = pool_entries(candidates, candidate_block_size, n_visible)
    valid = candidates >= 0
    slots = table_rows(block_table, entries_per_block, candidates).clamp_min(0)
    keys = quant.mxfp4_dequant(key_codes[slots], key_scale[slots])  # only the pool's keys: [T, P, Di]
    s = _finish_scores(_partial_scores(q, weights, keys), reduce_scores)
    local = _stable_topk_sorted(s, topk, valid)
    idx = torch.where(local >= 0, candidates.gather(-1, local.clamp_min(0)), local)
    # candidates are ascending within each row except for -1 padding, so keep position order
    big = torch.iinfo(torch.long).max
    idx = torch.where(idx < 0, big, idx).sort(-1).values
    return torch.where(idx == big, -1, idx), None


# prefill chunks are processed in pieces of this many tokens (bounds the gathered [T, S, D] rows)
ATTENTION_TOKEN_CHUNK = 256
# the official attention kernel walks a query's entry list in blocks of this many entries
OFFICIAL_ATTENTION_BLOCK = 64


def _valid_first(idx: torch.Tensor) -> torch.Tensor:
    """idx [T, S] with each row's valid entries (>= 0) moved to the front in their order and its
    -1 entries after them (a stable partition)."""
    order = torch.sort((idx < 0).to(torch.uint8), dim=-1, stable=True).indices
    return idx.gather(-1, order)


def official_block_probabilities(logits: torch.Tensor, row_max: torch.Tensor,
                                 block: int = OFFICIAL_ATTENTION_BLOCK) -> torch.Tensor:
    """The weights [T, H, N] that multiply V in the official attention kernel, relative to the
    row's final maximum `row_max` [T, H, 1]; logits [T, H, N] fp32, scaled, -inf where masked.

    The official kernel (`sparse_attn_kernel` in the release's `inference/kernel.py`) runs an
    online softmax over blocks of 64 entries: block b raises the running maximum to
    m_b = max(m_(b-1), the block's largest logit) (m_(-1) = -1e30), rescales the fp32
    accumulator and sum by exp(m_(b-1) - m_b), adds exp(s - m_b) (fp32) to the sum, and rounds
    those probabilities to bf16 for the p.V product. An entry's probability is therefore rounded
    against the running maximum of its block, not the row's maximum: its weight is
    bf16(exp(s - m_b)) * exp(m_b - row_max), computed here in fp64 (the rescaling exact, the
    bf16 rounding the only one). The sum takes the unrounded probabilities, so the denominator
    is the same as without blocks (the caller's). With one block (<= 64 entries) the weights
    are plain bf16(exp(s - row_max)).

    The blocks depend on where each entry sits in the list. The official list is the window
    entries (`get_window_topk_idxs`: valid positions oldest first, then -1) followed by the
    top-k global entries (position order, then -1): the caller (`sparse_attention`) moves each
    part's -1 entries behind its valid ones to match (our window rows put the positions before
    the sequence start first). Not reproduced: the official prefill of a prompt of L < window
    tokens gives each query only L window slots, so its global entries start at L, not at the
    window width (this op does not see L; window rows L wide would give that layout); the
    official tie order among equal indexer scores (implementation-defined there). The DSpark
    drafter's lists (window plus draft block) follow the same rule by assumption."""
    t, h, n = logits.shape
    nb = -(-n // block)
    padded = torch.full((t, h, nb * block), NEG_INF, dtype=logits.dtype, device=logits.device)
    padded[..., :n] = logits
    running = padded.reshape(t, h, nb, block).amax(-1).cummax(-1).values.clamp_min(RUNNING_MAX_INIT)
    block_max = running.repeat_interleave(block, -1)[..., :n]  # [T, H, N]: each entry's m_b
    p = exact_fn(torch.exp, logits - block_max).to(torch.bfloat16)
    return p.to(basic.ACCUM_DTYPE) * torch.exp((block_max - row_max).to(basic.ACCUM_DTYPE))


@register("sparse_attention")
def sparse_attention(q, swa_kv, swa_scale, win_idx, glob_kv, glob_scale, glob_idx, sink, softmax_scale,
                     rows_bound=None):
    """`ops.sparse_attention` (rows_bound is a sizing hint for scratch tables: none here)."""
    t = q.shape[0]
    if t > ATTENTION_TOKEN_CHUNK:  # every token is independent: pieces give the same bits
        c = ATTENTION_TOKEN_CHUNK
        return torch.cat([sparse_attention(q[i:i + c], swa_kv, swa_scale, win_idx[i:i + c], glob_kv, glob_scale,
                                           None if glob_idx is None else glob_idx[i:i + c], sink, softmax_scale)
                          for i in range(0, t, c)])
    h = q.shape[1]
    qf = q.float()
    official = numerics.official()
    logits, values = [], []
    for idx, dequant, kv, sc in ((win_idx, quant.fp8_dequant, swa_kv, swa_scale),
                                 (glob_idx, quant.fp4_dequant, glob_kv, glob_scale)):
        if idx is None or idx.shape[-1] == 0:
            continue
        if official:  # the official entry order, which sets the blocks (official_block_probabilities)
            idx = _valid_first(idx)
        ok = idx >= 0
        rows = idx.clamp_min(0)
        # masked rows zeroed by selection: their bytes (the null block, shared by every cache
        # kind in vLLM's pages) may decode to NaN, which a multiplication by 0 would keep
        v = torch.where(ok.unsqueeze(-1), dequant(kv[rows], sc[rows]), 0.0)  # [T, S, D]
        logits.append(einsum("thd,tsd->ths", qf, v).masked_fill(~ok.unsqueeze(1), NEG_INF))
        values.append(v)
    lg = torch.cat(logits, -1) * softmax_scale
    v = torch.cat(values, 1)
    m = lg.amax(-1, keepdim=True).clamp_min(RUNNING_MAX_INIT)
    p = exact_fn(torch.exp, lg - m)
    # The denominator is summed in fp64 and rounded to fp32: a query's entries sit at different
    # offsets in a prefill chunk than in a decode step, and an fp32 SIMD sum would depend on that.
    denom = (p.double().sum(-1, keepdim=True) + torch.exp((sink.float().view(1, h, 1) - m).double())).float()
    # probabilities go to bf16 before multiplying V (official numerics: against the running
    # maximum of their 64-entry block, as the official kernel does); the denominator stays fp32
    pv = official_block_probabilities(lg, m) if official else p.to(torch.bfloat16).float()
    num = einsum("ths,tsd->thd", pv, v)
    return (num / denom).to(torch.bfloat16)
