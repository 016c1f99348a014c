"""The sampler's reference (ops `sample_race`, `greedy_pick`, `feed_tokens`): a sampled row's
distribution (temperature, top-k, top-p) and the seeded exponential race over it, the greedy
tokens with the finiteness check, and the decode step's device-fed input ids, in plain torch
ops on any device.

The uniforms are counter-based: U[v] is a 32-bit hash of (the draw's key, v), so every backend
draws the same token from the same distribution (`dsv41.core.sampling` explains the scheme and
makes the keys). Both cuts keep ties: top-k keeps every token at least as likely as the k-th,
top-p every token at least as likely as the last one of the smallest prefix (in descending
probability) whose mass reaches top_p. So the kept set does not depend on how a sort orders
equal values, and a kernel that finds the cut by a threshold keeps the same tokens.
"""

from __future__ import annotations

import torch

from ..registry import register

_M32 = 0xFFFFFFFF
# odd multipliers below 2^31, so a 32-bit value times one stays below 2^63 in int64 arithmetic
# (no overflow on any backend); the shifts and constants are Chris Wellons' hash-prospector
# 32-bit hash (16, 0x21f0aaad, 15, 0x735a2d97, 15), a bijection of the 32-bit integers
HASH_MUL1, HASH_MUL2 = 0x21F0AAAD, 0x735A2D97


def hash32(x):
    """The 32-bit integer hash on ints or int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * HASH_MUL1) & _M32
    x = x ^ (x >> 15)
    x = (x * HASH_MUL2) & _M32
    return x ^ (x >> 15)


_COLUMN_HASHES: dict[tuple, torch.Tensor] = {}


def _column_hashes(n: int, device: torch.device) -> torch.Tensor:
    """hash32 of the vocabulary ids 0 .. n-1 (int64 [n]), made once per size and device."""
    key = (n, device.type, device.index)
    h = _COLUMN_HASHES.get(key)
    if h is None:
        h = _COLUMN_HASHES[key] = hash32(torch.arange(n, dtype=torch.int64, device=device))
    return h


UNIFORM_BITS = 23  # k + 0.5 with k < 2^23 fits fp32's 24-bit significand: U is exact and below 1


def uniforms(keys: torch.Tensor, n: int) -> torch.Tensor:
    """U [R, n] fp32 in (0, 1): row r's n uniforms for draw key keys[r] (int64 [R] in [0, 2^32)),
    U[r, v] = (k + 0.5) / 2^23 with k the top 23 bits of hash32(keys[r] ^ hash32(v)): values at
    the centres of their intervals, exact in fp32, never 0 or 1. (With 24 bits, k + 0.5 past
    2^23 rounds, and the top value to 1.0: E = -log U = 0 would win every race it is in.)"""
    return uniform_from_hash(hash32(keys.unsqueeze(1) ^ _column_hashes(n, keys.device).unsqueeze(0)))


def uniform_from_hash(h: torch.Tensor) -> torch.Tensor:
    """fp32 (k + 0.5) / 2^23 from 32-bit hashes h (int64), k their top 23 bits."""
    return ((h >> (32 - UNIFORM_BITS)).float() + 0.5) * (1.0 / (1 << UNIFORM_BITS))


def top_p_keep(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """bool [R, V]: the tokens top-p keeps in each row of probs (top_p [R]): those whose
    probability is at least that of the last token of the smallest prefix, in descending
    probability, whose mass reaches top_p (a token is kept while the mass strictly before it is
    at most top_p; ties with the last kept token are kept too)."""
    sp = torch.sort(probs, dim=-1, descending=True).values
    inside = sp.cumsum(-1) - sp <= top_p.unsqueeze(1)  # a prefix: True then False
    last = sp.gather(1, (inside.sum(-1, keepdim=True) - 1).clamp_min(0))
    return probs >= last


def sampling_probs_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                        top_p: torch.Tensor, max_top_k: int, any_top_p: bool) -> torch.Tensor:
    """The distribution each row of logits [S, V] draws from: logits / temperature, top-k
    (top_k [S], 0 = off; max_top_k = their largest, 0 when none cuts), softmax, top-p (top_p
    [S], 1 = off; any_top_p: whether any row cuts), renormalised. fp32."""
    x = logits.float() / temperature.unsqueeze(1)
    n = x.shape[1]
    if max_top_k > 0:
        k = top_k.clamp(0, n)
        kth = torch.topk(x, min(max_top_k, n)).values.gather(1, (k - 1).clamp_min(0).unsqueeze(1))
        x = x.masked_fill((k > 0).unsqueeze(1) & (x < kth), float("-inf"))
    probs = torch.softmax(x, -1)
    if any_top_p:
        cut = top_p < 1
        kept = probs.masked_fill(~top_p_keep(probs, top_p), 0)
        probs = torch.where(cut.unsqueeze(1), kept / kept.sum(-1, keepdim=True), probs)
    return probs


@register("sample_race")
def sample_race(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, keys: torch.Tensor, max_top_k: int, any_top_p: bool) -> torch.Tensor:
    """int64 [S]: for each sampled row rows[s] of logits [R, V], argmax_v p[v] / -log U[v] with p
    its `sampling_probs_rows` distribution and U its `uniforms` for keys[s]."""
    probs = sampling_probs_rows(logits.index_select(0, rows), temperature, top_k, top_p, max_top_k, any_top_p)
    return (probs / -torch.log(uniforms(keys, probs.shape[1]))).argmax(-1)


@register("greedy_pick")
def greedy_pick(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [R, 2]: each row's argmax (the first of equal maxima) and 1 where it is not finite."""
    bad = (~torch.isfinite(logits)).any(-1)
    picked = torch.stack([logits.argmax(-1), bad.long()], -1)
    return picked if out is None else out.copy_(picked)


@register("feed_tokens")
def feed_tokens(ids: torch.Tensor, ngram_ids: torch.Tensor, picked: torch.Tensor) -> None:
    """Rows with ids[i] = -1 - r < 0 take picked[r, 0] as ids[i] and ngram_ids[i, 0], in place."""
    fed = ids < 0
    tok = picked[:, 0].index_select(0, (-1 - ids).clamp(0, max(picked.shape[0] - 1, 0)))
    ids.copy_(torch.where(fed, tok, ids))
    ngram_ids[:, 0].copy_(torch.where(fed, tok, ngram_ids[:, 0]))
