"""The sampler without sorting the vocabulary (op `sample_race`): each sampled row's seeded
exponential race over its temperature / top-k / top-p distribution, in four launches.

The reference (`backends/reference/sampling.py`) builds each row's distribution with ~18 torch
ops over [rows, vocabulary] fp32, a full sort for top-p among them (2.1 ms for 64 rows of the
129280-token vocabulary on an H100). Here the rows of logits are streamed and the same tokens
drawn, every row split over SPLIT programs:

- Pass 1 (`_race_sweep_kernel`): the row's largest kept x = logits / temperature and the race
  over every token the top-k cut keeps, w = argmax_v (x[v] - log E[v]), E[v] = -log U[v] with U
  the reference's counter-based uniforms (the race argmax_v p[v] / E[v] in log form: p's
  softmax normaliser and any renormalisation after a cut do not move an argmax).
- Top-p keeps v when the mass above x[v] is at most top_p (ties kept, as the reference). If it
  keeps w, w is the race's winner over the kept set, which contains w. If not, every kept token
  lies above x[w], so the winner is the race's winner above x[w]. A round
  (`_race_round_kernel`) decides the previous round and sweeps the rows still open: the mass
  above the candidate and, in the same sweep, the race above it. The candidate rises every
  round and the largest token is always kept. After ROUNDS rounds `_race_finish_kernel` decides
  the last one and sweeps, one program a row, the rare row still open until a candidate is kept.
  The first round sweeps every row that cuts by top-p (a candidate is not known kept before the
  mass above it is summed); later ones only the rows whose candidate was cut (about 1 - top_p
  of them), all at once.

Rounding: the race in log space (the reference divides probabilities), approximate logs away from
U = 1 and the masses summed in another order can part the two on a near-tie, as the op's
contract allows. Where a row cuts by top-k, x is the IEEE quotient (torch's) and the cut's
threshold is the k-th largest logit divided (by `torch.topk`, or a radix select over the row,
`_top_k_threshold_kernel`: TOP_K_THRESHOLD): the reference's threshold bit for bit, so both keep
the same tokens. CUDA
only for now (inline PTX for the log); Ascend runs the reference in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends.reference.sampling import HASH_MUL1, HASH_MUL2
from ...backends.reference.sampling import sample_race as sample_race_ref  # noqa: F401  (the oracle)
from .indexer_topk import _kth_key
from .launch import interpreting
from .pdl import pdl_launch, pdl_start

BLOCK = 2048
NUM_WARPS = 8
# Programs a row in every split sweep, whatever the row count: the masses' partial sums then have
# one order for a row alone or in any batch. 16 x 2048-wide chunks: 4 chunks a program at the
# model's 129280 tokens; 64 rows make 1024 programs.
SPLIT = 16
# Top-p rounds on split rows (each: is the candidate kept, and the race above it) before the
# finishing program sweeps a row alone: only a row whose first two candidates were both cut.
ROUNDS = 2
INTERPRETER_SPLIT = 4  # fewer programs under TRITON_INTERPRET=1 (each costs milliseconds there)
# The top-k threshold's radix select (`_top_k_threshold_kernel`): values a chunk of its sweeps and
# bits a digit (32 / RADIX_BITS sweeps of the row).
THRESHOLD_BLOCK = 4096
RADIX_BITS = 8
# How the op finds a top-k cut's threshold (`top_k_threshold`'s method). The radix kernel (one
# program a row, four sweeps of it) is correct on the GPU (GPU tests passed on an H100, 2026-12-06)
# but slow: `sweep_kernels.py --only sampler` there, 1 / 8 / 64 rows of the 129280-entry vocabulary,
# top_k 50: radix 501 / 501 / 510 us against torch.topk 74 / 87 / 193 us. One program sweeping a
# 517 KB row four times is bound by one SM; it would need the row split over programs to compete.
# torch.topk stays the default.
TOP_K_THRESHOLD = "topk"
_MUL1, _MUL2 = tl.constexpr(HASH_MUL1), tl.constexpr(HASH_MUL2)


@triton.jit
def _hash32(x):
    """The reference's hash32 on uint32 (its products mod 2^32)."""
    x = x ^ (x >> 16)
    x = x * _MUL1
    x = x ^ (x >> 15)
    x = x * _MUL2
    return x ^ (x >> 15)


@triton.jit
def _log(x, FAST: tl.constexpr):
    """Natural log: on CUDA the MUFU's approximate log2 (absolute error about 2^-22, one
    instruction; `tl.log` lowers to libdevice's ~20), the exact log under the interpreter."""
    if FAST:
        return 0.6931471805599453 * tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x],
                                                              dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.log(x)


@triton.jit
def _race_scores(x, offs, key, FAST: tl.constexpr):
    """x - log E: the race's scores in log form, E = -log U, U = (k + 0.5) / 2^23 with k the top
    23 bits of hash32(key ^ hash32(v)) (the reference's `uniforms`). The winners are the tokens
    whose U lies nearest 1, where E is as small as 1 - U: there a log accurate to 2^-22 absolute
    would make E wrong by percents and draw other tokens than the reference, so E is the series
    -log(1 - d) = d + d^2/2 + ... in d = 1 - U (exact in fp32), to d^7 (the rest is below 2^-31
    of E for d <= 1/16). Past 1/16 the approximate log's error is at most 2e-6 of E, as is the
    outer log's of the score."""
    k = _hash32(key ^ _hash32(offs.to(tl.uint32))) >> 9
    u = (k.to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    d = ((8388608 - k).to(tl.float32) - 0.5) * (1.0 / 8388608.0)
    series = d * (1.0 + d * (0.5 + d * (1.0 / 3.0 + d * (0.25 + d * (0.2 + d * (1.0 / 6.0 + d * (1.0 / 7.0)))))))
    e = tl.where(d <= 0.0625, series, -_log(u, FAST))
    return x - _log(e, FAST)


@triton.jit
def _scaled(logits, temp, inv_t, EXACT: tl.constexpr):
    """x = logits / temperature: IEEE division where a top-k cut compares x with the threshold
    torch computed (the same x, so the same tokens pass), else a multiply by 1 / temperature
    (an ulp from it: moves only near-ties)."""
    if EXACT:
        return tl.math.div_rn(logits.to(tl.float32), temp)
    else:
        return logits.to(tl.float32) * inv_t


@triton.jit
def _winner(score, idx, V):
    """The largest score's index, the smallest index among equal scores (a lane holds one
    column of the row's chunks; lanes do not hold consecutive indices)."""
    top = tl.max(score, 0)
    return tl.min(tl.where(score == top, idx, V), 0)


@triton.jit
def _row_args(logits_ptr, stride, rows_ptr, temp_ptr, kth_ptr, s):
    row = logits_ptr + tl.load(rows_ptr + s).to(tl.int64) * stride
    temp = tl.load(temp_ptr + s)
    return row, temp, 1.0 / temp, tl.load(kth_ptr + s)


@triton.jit
def _race_sweep_kernel(logits_ptr, stride, rows_ptr, temp_ptr, kth_ptr, keys_ptr, part_ptr, V,
                       SPLIT: tl.constexpr, BLOCK: tl.constexpr, TOP_K: tl.constexpr, FAST: tl.constexpr,
                       PDL: tl.constexpr = 0):
    """Pass 1 over chunks j, j + SPLIT, ... of row s (program (s, j)): the largest kept x, and the
    race's best score and its index, into part [3, S, SPLIT] (the index as int32 bits)."""
    pdl_start(PDL)
    s = tl.program_id(0)
    j = tl.program_id(1)
    row, temp, inv_t, kth = _row_args(logits_ptr, stride, rows_ptr, temp_ptr, kth_ptr, s)
    key = tl.load(keys_ptr + s).to(tl.uint32)
    lanes = tl.arange(0, BLOCK)
    m_l = tl.full([BLOCK], -float("inf"), tl.float32)
    best_l = tl.full([BLOCK], -float("inf"), tl.float32)
    w_l = tl.zeros([BLOCK], tl.int32)
    first = j * BLOCK + lanes
    ahead = tl.load(row + first, mask=first < V, other=0.0)
    for start in range(j * BLOCK, V, SPLIT * BLOCK):
        offs = start + lanes
        x = _scaled(ahead, temp, inv_t, TOP_K)
        nxt = offs + SPLIT * BLOCK
        ahead = tl.load(row + nxt, mask=nxt < V, other=0.0)
        ok = offs < V
        if TOP_K:
            ok = ok & (x >= kth)
        m_l = tl.maximum(m_l, tl.where(ok, x, -float("inf")))
        g = tl.where(ok, _race_scores(x, offs, key, FAST), -float("inf"))
        w_l = tl.where(g > best_l, offs, w_l)
        best_l = tl.maximum(best_l, g)
    at = s * SPLIT + j
    n = tl.num_programs(0) * SPLIT
    tl.store(part_ptr + at, tl.max(m_l, 0))
    tl.store(part_ptr + n + at, tl.max(best_l, 0))
    tl.store(part_ptr + 2 * n + at, _winner(best_l, w_l, V).to(tl.float32, bitcast=True))


@triton.jit
def _sweep_result(part_ptr, s, V, SPLIT: tl.constexpr):
    """m and the race's winner of row s from pass 1's partials."""
    n = tl.num_programs(0) * SPLIT
    at = s * SPLIT + tl.arange(0, SPLIT)
    m = tl.max(tl.load(part_ptr + at), 0)
    w = _winner(tl.load(part_ptr + n + at), tl.load(part_ptr + 2 * n + at).to(tl.int32, bitcast=True), V)
    return m, w


@triton.jit
def _decide(prev_ptr, state_ptr, s, top_p, V, SPLIT: tl.constexpr):
    """Row s after a round: (candidate, done) from the round's state (its candidate, whether it
    was already kept) and its partials [4, S, SPLIT] (total mass, mass above the candidate, the
    race above it: score, index). The sums run over the partials in a fixed order: a row's
    decision does not depend on the other rows."""
    n = tl.num_programs(0) * SPLIT
    w = tl.load(state_ptr + s)
    done = tl.load(state_ptr + tl.num_programs(0) + s)
    if done == 0:
        at = s * SPLIT + tl.arange(0, SPLIT)
        total = tl.sum(tl.load(prev_ptr + at), 0)
        above = tl.sum(tl.load(prev_ptr + n + at), 0)
        done = (above <= top_p * total).to(tl.int32)
        if done == 0:
            w = _winner(tl.load(prev_ptr + 2 * n + at), tl.load(prev_ptr + 3 * n + at).to(tl.int32, bitcast=True), V)
    return w, done


@triton.jit
def _sweep_above(row, temp, inv_t, kth, key, m, pivot, V, first, step, BLOCK: tl.constexpr, TOP_K: tl.constexpr,
                 FAST: tl.constexpr):
    """One sweep of chunks first, first + step, ... of a row (per lane): the kept mass, the mass
    above the candidate's x (pivot), and the race above it (best score, its index)."""
    lanes = tl.arange(0, BLOCK)
    total_l = tl.zeros([BLOCK], tl.float32)
    above_l = tl.zeros([BLOCK], tl.float32)
    best_l = tl.full([BLOCK], -float("inf"), tl.float32)
    w_l = tl.zeros([BLOCK], tl.int32)
    ahead = tl.load(row + first + lanes, mask=first + lanes < V, other=0.0)
    for start in range(first, V, step):
        offs = start + lanes
        x = _scaled(ahead, temp, inv_t, TOP_K)
        ahead = tl.load(row + offs + step, mask=offs + step < V, other=0.0)
        ok = offs < V
        if TOP_K:
            ok = ok & (x >= kth)
        e = tl.where(ok, tl.exp(x - m), 0.0)
        above = ok & (x > pivot)
        total_l += e
        above_l += tl.where(above, e, 0.0)
        g = tl.where(above, _race_scores(x, offs, key, FAST), -float("inf"))
        w_l = tl.where(g > best_l, offs, w_l)
        best_l = tl.maximum(best_l, g)
    return total_l, above_l, best_l, w_l


@triton.jit
def _race_round_kernel(logits_ptr, stride, rows_ptr, temp_ptr, kth_ptr, top_p_ptr, keys_ptr, sweep_ptr,
                       prev_ptr, prev_state_ptr, part_ptr, state_ptr, V, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                       FIRST: tl.constexpr, TOP_K: tl.constexpr, FAST: tl.constexpr, PDL: tl.constexpr = 0):
    """One top-p round, a row split over programs as pass 1: decide the previous round (FIRST:
    pass 1's winner, done where top_p >= 1), write the row's state [2, S] (candidate, done), and
    for a row whose candidate is not yet known kept, sweep chunks j, j + SPLIT, ...: total mass,
    mass above the candidate, the race above it, into part [4, S, SPLIT]."""
    pdl_start(PDL)
    s = tl.program_id(0)
    j = tl.program_id(1)
    top_p = tl.load(top_p_ptr + s)
    m, w = _sweep_result(sweep_ptr, s, V, SPLIT)
    if FIRST:
        done = (top_p >= 1.0).to(tl.int32)
    else:
        w, done = _decide(prev_ptr, prev_state_ptr, s, top_p, V, SPLIT)
    if j == 0:
        tl.store(state_ptr + s, w)
        tl.store(state_ptr + tl.num_programs(0) + s, done)
    if done == 0:
        row, temp, inv_t, kth = _row_args(logits_ptr, stride, rows_ptr, temp_ptr, kth_ptr, s)
        key = tl.load(keys_ptr + s).to(tl.uint32)
        pivot = _scaled(tl.load(row + w), temp, inv_t, TOP_K)
        total_l, above_l, best_l, w_l = _sweep_above(row, temp, inv_t, kth, key, m, pivot, V, j * BLOCK,
                                                     SPLIT * BLOCK, BLOCK, TOP_K, FAST)
        at = s * SPLIT + j
        n = tl.num_programs(0) * SPLIT
        tl.store(part_ptr + at, tl.sum(total_l, 0))
        tl.store(part_ptr + n + at, tl.sum(above_l, 0))
        tl.store(part_ptr + 2 * n + at, tl.max(best_l, 0))
        tl.store(part_ptr + 3 * n + at, _winner(best_l, w_l, V).to(tl.float32, bitcast=True))


@triton.jit
def _race_finish_kernel(logits_ptr, stride, rows_ptr, temp_ptr, kth_ptr, top_p_ptr, keys_ptr, sweep_ptr, prev_ptr,
                        prev_state_ptr, out_ptr, V, SPLIT: tl.constexpr, BLOCK: tl.constexpr, TOP_K: tl.constexpr,
                        FAST: tl.constexpr, PDL: tl.constexpr = 0):
    """Row s's token: decide the last split round; a candidate still not known kept (rare: the
    race's winner cut by top-p in every round) is settled by whole-row sweeps in this one
    program, each the mass above the candidate and the race above it, until one is kept."""
    pdl_start(PDL)
    s = tl.program_id(0)
    top_p = tl.load(top_p_ptr + s)
    m, w = _sweep_result(sweep_ptr, s, V, SPLIT)
    w, done = _decide(prev_ptr, prev_state_ptr, s, top_p, V, SPLIT)
    if done == 0:
        row, temp, inv_t, kth = _row_args(logits_ptr, stride, rows_ptr, temp_ptr, kth_ptr, s)
        key = tl.load(keys_ptr + s).to(tl.uint32)
        while done == 0:
            pivot = _scaled(tl.load(row + w), temp, inv_t, TOP_K)
            total_l, above_l, best_l, w_l = _sweep_above(row, temp, inv_t, kth, key, m, pivot, V, 0, BLOCK, BLOCK,
                                                         TOP_K, FAST)
            done = (tl.sum(above_l, 0) <= top_p * tl.sum(total_l, 0)).to(tl.int32)
            w = tl.where(done != 0, w, _winner(best_l, w_l, V))
    tl.store(out_ptr + s, w.to(tl.int64))


@triton.jit
def _top_k_threshold_kernel(logits_ptr, stride, rows_ptr, temp_ptr, k_ptr, out_ptr, V, BLOCK: tl.constexpr,
                            RADIX_BITS: tl.constexpr, PDL: tl.constexpr = 0):
    """out[s] = the k-th largest logit of row rows[s] (k = top_k[s], at most V), divided by
    temperature[s] (IEEE); -inf where k <= 0. indexer_topk's radix select (`_kth_key`) over
    order-preserving int32 keys, RADIX_BITS at a time from the top: each pass sweeps the row once
    and histograms the digit of the values that share the digits found so far."""
    pdl_start(PDL)
    s = tl.program_id(0)
    k = tl.minimum(tl.load(k_ptr + s).to(tl.int32), V)
    if k <= 0:
        tl.store(out_ptr + s, float("-inf"))
    else:
        key, _ = _kth_key(logits_ptr + tl.load(rows_ptr + s).to(tl.int64) * stride, V, k, BLOCK, RADIX_BITS)
        kth = tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)
        tl.store(out_ptr + s, tl.math.div_rn(kth, tl.load(temp_ptr + s)))


def top_k_threshold(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    max_top_k: int, method: str | None = None) -> torch.Tensor:
    """fp32 [S]: the k-th largest x = logits[rows[s]] / temperature[s] of each row (-inf where
    top_k is 0 or no row cuts): the k-th largest logit divided, as the division's rounding is
    monotone -- the reference's threshold bit for bit without dividing the whole rows (a k-th
    largest of -0.0 comes out as +0.0: equal under comparison). `method` "radix": one program a
    row (`_top_k_threshold_kernel`); "topk": `torch.topk` over the rows; default TOP_K_THRESHOLD."""
    method = method or TOP_K_THRESHOLD
    if method not in ("radix", "topk"):
        raise ValueError(f"top_k_threshold: method must be 'radix' or 'topk', got {method!r}")
    s = rows.numel()
    if max_top_k <= 0 or s == 0:
        return torch.full((s,), float("-inf"), device=logits.device)
    vocab = logits.shape[1]
    if method == "radix":
        out = torch.empty(s, dtype=torch.float32, device=logits.device)
        _top_k_threshold_kernel[(s,)](logits, logits.stride(0), rows.contiguous(), temperature.float().contiguous(),
                                      top_k.contiguous(), out, vocab, BLOCK=THRESHOLD_BLOCK, RADIX_BITS=RADIX_BITS,
                                      num_warps=NUM_WARPS, **pdl_launch(logits))
        return out
    k = top_k.clamp(0, vocab)
    kth = torch.topk(logits.index_select(0, rows), min(max_top_k, vocab)).values
    kth = kth.gather(1, (k - 1).clamp_min(0).unsqueeze(1)).squeeze(1).float() / temperature
    return torch.where(k > 0, kth, float("-inf")).contiguous()


def sample_race(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, keys: torch.Tensor, max_top_k: int, any_top_p: bool,
                rounds: int = ROUNDS, threshold: str | None = None) -> torch.Tensor:
    """The op; `rounds`: top-p rounds on split rows before the finishing program's own sweeps;
    `threshold`: the top-k threshold's method (`top_k_threshold`; default TOP_K_THRESHOLD)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, vocabulary] with unit column stride, got {tuple(logits.shape)}")
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    vocab = logits.shape[1]
    s = rows.numel()
    dev = logits.device
    out = torch.empty(s, dtype=torch.int64, device=dev)
    if s == 0:
        return out
    temperature = temperature.float().contiguous()
    kth = top_k_threshold(logits, rows, temperature, top_k, max_top_k, threshold)
    top_p = top_p.float().contiguous() if any_top_p else torch.ones(s, device=dev)
    split = INTERPRETER_SPLIT if interpreting() else SPLIT
    sweep = torch.empty(3, s, split, dtype=torch.float32, device=dev)  # pass 1's partials
    parts = torch.empty(rounds, 4, s, split, dtype=torch.float32, device=dev)  # each round's partials
    states = torch.empty(rounds, 2, s, dtype=torch.int32, device=dev)  # each round's candidates, done flags
    rows, keys = rows.contiguous(), keys.contiguous()
    head = (logits, logits.stride(0), rows, temperature, kth)
    common = dict(SPLIT=split, BLOCK=BLOCK, TOP_K=max_top_k > 0, FAST=not interpreting(), num_warps=NUM_WARPS)
    _race_sweep_kernel[(s, split)](*head, keys, sweep, vocab, **common, **pdl_launch(logits))
    for r in range(rounds):
        prev, prev_state = (parts[r - 1], states[r - 1]) if r else (sweep, states[0])
        _race_round_kernel[(s, split)](*head, top_p, keys, sweep, prev, prev_state, parts[r], states[r], vocab,
                                       FIRST=r == 0, **common, **pdl_launch(logits))
    _race_finish_kernel[(s,)](*head, top_p, keys, sweep, parts[-1], states[-1], out, vocab, **common,
                              **pdl_launch(logits))
    return out


OPS = {"sample_race": sample_race}
