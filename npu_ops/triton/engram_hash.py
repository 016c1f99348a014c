"""Engram's n-gram hash in one launch (op `engram_hash`).

Row ids of per-position windows: slot s of row m holds comp[m, s] where valid, else the pad id;
its product with multiplier s (int64, wrapping); the hash of the n-gram of length n is the xor of
the first n products; row j = (n - 2) * n_heads + k takes hash n modulo primes[j] (non-negative,
as torch.remainder) plus the sum of the primes before j. The torch version
(`core.engram.engram_window_row_ids`, the oracle) launches about a dozen kernels per layer
(select, multiply, xors, stack, repeat, cumsum, remainder, add). Integer arithmetic only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends.fused import engram_hash as engram_hash_ref  # noqa: F401  (the oracle)

BLOCK_M = 64


@triton.jit
def _engram_hash_kernel(comp_ptr, valid_ptr, mult_ptr, primes_ptr, offsets_ptr, out_ptr, M, pad_id,
                        N: tl.constexpr, HEADS: tl.constexpr, BLOCK_M: tl.constexpr):
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = m < M
    n_rows = (N - 1) * HEADS
    h = tl.zeros((BLOCK_M,), dtype=tl.int64)
    for s in tl.static_range(N):
        c = tl.load(comp_ptr + m * N + s, mask=mm, other=0).to(tl.int64)
        ok = tl.load(valid_ptr + m * N + s, mask=mm, other=0) != 0
        prod = tl.where(ok, c, pad_id) * tl.load(mult_ptr + s).to(tl.int64)  # (wraps, as torch's int64)
        h = h ^ prod
        if s >= 1:
            for k in tl.static_range(HEADS):
                j = (s - 1) * HEADS + k
                p = tl.load(primes_ptr + j).to(tl.int64)
                r = h % p
                r = tl.where(r < 0, r + p, r)  # (% truncates; torch.remainder follows the divisor)
                tl.store(out_ptr + m * n_rows + j, r + tl.load(offsets_ptr + j).to(tl.int64), mask=mm)


_OFFSETS: dict[tuple, torch.Tensor] = {}


def _offsets(primes: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sums of the primes, made once per primes tensor (a layer's constants)."""
    key = (primes.data_ptr(), primes.device, primes.shape[0], primes._version)
    if key not in _OFFSETS:
        _OFFSETS[key] = torch.cumsum(primes, 0) - primes
    return _OFFSETS[key]


def engram_hash(comp: torch.Tensor, valid: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor,
                pad_id: int, n_heads: int) -> torch.Tensor:
    """`ops.engram_hash`: comp / valid [M, N] -> row ids [M, (N - 1) * n_heads] long."""
    m, n = comp.shape
    if valid.shape != comp.shape or not isinstance(primes, torch.Tensor) or primes.shape != ((n - 1) * n_heads,) \
            or not isinstance(multipliers, torch.Tensor) or multipliers.shape[0] < n or n < 2:
        raise ValueError(f"engram_hash: comp {tuple(comp.shape)}, valid {tuple(valid.shape)}, {n_heads} heads, "
                         f"primes {getattr(primes, 'shape', None)}, multipliers {getattr(multipliers, 'shape', None)} "
                         "do not fit together")
    out = torch.empty(m, (n - 1) * n_heads, dtype=torch.long, device=comp.device)
    if m:
        p = primes.to(device=comp.device, dtype=torch.int64)
        _engram_hash_kernel[(-(-m // BLOCK_M),)](comp.contiguous(), valid.contiguous().view(torch.int8),
                                                 multipliers.to(device=comp.device, dtype=torch.int64).contiguous(),
                                                 p, _offsets(p), out, m, int(pad_id), N=n, HEADS=n_heads,
                                                 BLOCK_M=BLOCK_M)
    return out


OPS = {"engram_hash": engram_hash}
