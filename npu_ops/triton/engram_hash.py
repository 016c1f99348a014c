"""Engram's n-gram hash in one launch (op `engram_hash`).

Row ids of per-position windows: slot s of row m is valid when it holds a token (id >= 0) and no
slot 0 .. s holds an image token; it hashes as token_map[id] where valid, else as the pad id;
its product with multiplier s (int64, wrapping); the hash of the n-gram of length n is the xor of
the first n products; row j = (n - 2) * n_heads + k takes hash n modulo primes[j] (non-negative,
as torch.remainder) plus the sum of the primes before j. The torch version
(`core.engram.engram_window_row_ids`, the oracle) launches about a dozen kernels per layer
(select, multiply, xors, stack, repeat, cumsum, remainder, add), and the validity and token map
eight more per step. Integer arithmetic only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_start

from ...backends.fused import engram_hash as engram_hash_ref  # noqa: F401  (the oracle)

BLOCK_M = 64  # positions per program (fewer when a call has fewer: a decode step's 1-64)


@triton.jit
def _engram_hash_kernel(ids_ptr, image_ptr, map_ptr, mult_ptr, primes_ptr, offsets_ptr, out_ptr, M, pad_id,
                        N: tl.constexpr, HEADS: tl.constexpr, BLOCK_M: tl.constexpr, JP: tl.constexpr, PDL: tl.constexpr = 0):
    """Rows [BLOCK_M, (N - 1) * HEADS] of one tile of positions. The n-gram hashes come from a
    chain of N xors; their remainders by every row's prime are one [BLOCK_M, JP] int64 op, not
    (N - 1) * HEADS dependent ones (each an emulated 64-bit division: 9 us a launch at one
    position on the H200 when they ran in turn)."""
    pdl_start(PDL)
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = m < M
    n_rows = (N - 1) * HEADS
    j = tl.arange(0, JP)
    jm = j < n_rows
    hj = tl.zeros((BLOCK_M, JP), dtype=tl.int64)  # row j's n-gram hash (n = j // HEADS + 2)
    h = tl.zeros((BLOCK_M,), dtype=tl.int64)
    text = mm  # no image token in the slots so far
    for s in tl.static_range(N):
        tok = tl.load(ids_ptr + m * N + s, mask=mm, other=-1).to(tl.int64)
        text = text & (tl.load(image_ptr + m * N + s, mask=mm, other=1) == 0)
        ok = (tok >= 0) & text
        c = tl.load(map_ptr + tl.maximum(tok, 0), mask=mm, other=0).to(tl.int64)
        prod = tl.where(ok, c, pad_id) * tl.load(mult_ptr + s).to(tl.int64)  # (wraps, as torch's int64)
        h = h ^ prod
        if s >= 1:
            hj = tl.where((j // HEADS == s - 1)[None, :], h[:, None], hj)
    p = tl.load(primes_ptr + j, mask=jm, other=1).to(tl.int64)
    r = hj % p[None, :]
    r = tl.where(r < 0, r + p[None, :], r)  # (% truncates; torch.remainder follows the divisor)
    off = tl.load(offsets_ptr + j, mask=jm, other=0).to(tl.int64)
    tl.store(out_ptr + m[:, None] * n_rows + j[None, :], r + off[None, :], mask=mm[:, None] & jm[None, :])


def _offsets(primes: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sums of the primes, made once per primes tensor (a layer's constants) and
    held by it (with its version), so they live as long as it does and a later tensor at the
    same address never finds them (as `backends.rope_tables.angle_tables`)."""
    held = getattr(primes, "_dsv41_offsets", None)
    if held is None or held[0] != primes._version:
        held = primes._dsv41_offsets = (primes._version, torch.cumsum(primes, 0) - primes)
    return held[1]


def engram_hash(ngram_ids: torch.Tensor, ngram_image: torch.Tensor, token_map: torch.Tensor,
                multipliers: torch.Tensor, primes: torch.Tensor, pad_id: int, n_heads: int) -> torch.Tensor:
    """`ops.engram_hash`: ngram_ids / ngram_image [T, N] -> row ids [T, (N - 1) * n_heads] long."""
    m, n = ngram_ids.shape
    if ngram_image.shape != ngram_ids.shape or not isinstance(primes, torch.Tensor) \
            or primes.shape != ((n - 1) * n_heads,) or not isinstance(multipliers, torch.Tensor) \
            or multipliers.shape[0] < n or n < 2 or token_map.dim() != 1:
        raise ValueError(f"engram_hash: ids {tuple(ngram_ids.shape)}, image {tuple(ngram_image.shape)}, {n_heads} "
                         f"heads, primes {getattr(primes, 'shape', None)}, multipliers "
                         f"{getattr(multipliers, 'shape', None)}, token map {tuple(token_map.shape)} do not fit together")
    out = torch.empty(m, (n - 1) * n_heads, dtype=torch.long, device=ngram_ids.device)
    if m:
        p = primes.to(device=ngram_ids.device, dtype=torch.int64)
        bm = min(BLOCK_M, triton.next_power_of_2(m))
        _engram_hash_kernel[(-(-m // bm),)](ngram_ids.contiguous(), ngram_image.contiguous().view(torch.int8),
                                            token_map.contiguous(),
                                            multipliers.to(device=ngram_ids.device, dtype=torch.int64).contiguous(),
                                            p, _offsets(p), out, m, int(pad_id), N=n, HEADS=n_heads, BLOCK_M=bm,
                                            JP=triton.next_power_of_2((n - 1) * n_heads), **pdl_launch(out))
    return out


OPS = {"engram_hash": engram_hash}
