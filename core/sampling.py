"""Token sampling for a whole step at once, on the logits' device, without a host round trip.

Greedy rows (temperature 0) take the argmax. A sampled row draws from `sampling_probs`
(temperature, then top-k, then top-p) by an exponential race: token = argmax_v p[v] / E[v] with
E[v] = -log U[v] and U[v] uniform in (0, 1), which picks v with probability p[v] (the Gumbel-max
trick in its exponential form; `torch.multinomial` draws one sample the same way). The uniforms
come from no generator's state: U[v] is a hash of (the request's seed, the position of the token
being drawn, v), counter-based random numbers in 32-bit integer arithmetic that every device
computes alike. So
- the draw needs nothing from the host: the overlapped decode loop feeds a sampled token to the
  next step the way it feeds an argmax, and a step's rows are drawn by one op, `sample_race`
  (no per-row launches, no read-back of a vocabulary-sized distribution): on the reference
  backend and Ascend a fixed handful of batched torch ops with a sort for top-p, on CUDA four
  Triton launches that find the top-p cut without sorting (`npu_ops/triton/sample_race.py`);
- a sequence's tokens depend on its seed, its prompt and its own positions only: the same alone
  or in any batch, in any step layout, on any backend up to the last-bit rounding of the
  distribution (the reference and a device can round a near-tie apart).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..backends import ops
from ..backends.reference.sampling import hash32, top_p_keep, uniforms  # noqa: F401  (the scheme's parts)
from ..backends.reference.sampling import sampling_probs_rows as _probs_rows

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


@functools.lru_cache(maxsize=4096)
def _seed_key(seed: int) -> int:
    s = seed & 0xFFFFFFFFFFFFFFFF
    return hash32((s & _M32) ^ hash32(((s >> 32) ^ _GOLDEN) & _M32))


def row_key(seed: int, position: int) -> int:
    """The 32-bit key of one draw: the request's seed (any Python int, taken mod 2^64) and the
    position the drawn token takes in its sequence (one hash a row a step on the host; the
    seed's own hashes are cached)."""
    return hash32(_seed_key(seed) ^ (position & _M32))


def sampling_probs(logits: torch.Tensor, p) -> torch.Tensor:
    """The distribution a sampled row draws from (p.temperature > 0): temperature, top-k, top-p."""
    x = logits.float() / p.temperature
    if p.top_k > 0:
        kth = torch.topk(x, min(p.top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, -1)
    if p.top_p < 1:  # ties with the last token kept stay (`top_p_keep`)
        probs = probs.masked_fill(~top_p_keep(probs.unsqueeze(0), torch.tensor([p.top_p], device=probs.device))[0], 0)
        probs = probs / probs.sum()
    return probs


@dataclass
class RowParams:
    """The sampled rows of one step as tensors on the logits' device: `rows` [S] (their row
    indices), `temperature`, `top_k`, `top_p` and the draw keys (`row_key`), all [S]; and, known
    on the host so that sampling never reads the device, the largest top-k and whether any row
    cuts by top-p."""

    rows: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    keys: torch.Tensor
    max_top_k: int
    any_top_p: bool

    @staticmethod
    def of(params: list, positions: list[int], device, pinned_empty=None) -> "RowParams | None":
        """The sampled rows among `params` (SamplingParams; row i draws the token at
        positions[i]); None when every row is greedy. Two small host-to-device copies, through
        page-locked memory from `pinned_empty(shape, dtype)` when given (then the copies do not
        wait for the device: `Platform.pinned_empty`)."""
        drawn = [i for i, p in enumerate(params) if p.temperature != 0]
        if not drawn:
            return None
        ints = torch.tensor([[i, params[i].top_k, row_key(params[i].seed, positions[i])] for i in drawn],
                            dtype=torch.int64)
        reals = torch.tensor([[params[i].temperature, params[i].top_p] for i in drawn], dtype=torch.float32)
        if pinned_empty is not None:
            ints = pinned_empty(ints.shape, ints.dtype).copy_(ints)
            reals = pinned_empty(reals.shape, reals.dtype).copy_(reals)
        ints = ints.to(device, non_blocking=pinned_empty is not None)
        reals = reals.to(device, non_blocking=pinned_empty is not None)
        return RowParams(ints[:, 0], reals[:, 0], ints[:, 1], reals[:, 1], ints[:, 2],
                         max(params[i].top_k for i in drawn), any(params[i].top_p < 1 for i in drawn))


def sampling_probs_rows(logits: torch.Tensor, rp: RowParams) -> torch.Tensor:
    """`sampling_probs` of each sampled row (logits [S, V]: those rows), batched: the same
    masks and renormalisation, row by row."""
    return _probs_rows(logits, rp.temperature, rp.top_k, rp.top_p, rp.max_top_k, rp.any_top_p)


def pick_tokens(logits: torch.Tensor, rp: RowParams | None, picked: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's token and non-finite flag, int64 [R, 2] on the logits' device (one read-back
    for both): the argmax (`ops.greedy_pick`), or for the rows of `rp` the exponential race over
    their `sampling_probs_rows`. `picked`: the greedy picks already made (a captured decode
    step's), whose sampled rows are replaced in place."""
    if picked is None:
        picked = ops.greedy_pick(logits)
    if rp is not None:
        drawn = ops.sample_race(logits, rp.rows, rp.temperature, rp.top_k, rp.top_p, rp.keys, rp.max_top_k,
                                rp.any_top_p)
        picked[:, 0].index_copy_(0, rp.rows, drawn)
    return picked


def sample_tokens(logits: torch.Tensor, rp: RowParams | None) -> torch.Tensor:
    """One token per row of logits [R, V] (int64 [R], on their device): `pick_tokens`' tokens."""
    return pick_tokens(logits, rp)[:, 0]
