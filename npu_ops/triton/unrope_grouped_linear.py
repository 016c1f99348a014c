"""The attention output's tail in one launch at decode sizes (op `unrope_grouped_linear`).

One token (batch-1 decode): `_unrope_rows_kernel` streams `wo_a`'s rows as the one-row FP8
kernel streams its weights (a program's rows one contiguous run, the next step loaded ahead), the
group's channels of x rotated back once per program. H200 (2026-12-04, graph time at the mini
width, 64 MB `wo_a`, two weight copies alternated past the 50 MB L2): 18.8 us (16 warps, 32 KB
a step, 2 programs per SM; 19.5 at 8 warps, 21.9 at the first guess of 4 warps / 16 KB) against
22.2-22.5 for the composition (the `rope` kernel, then cuBLAS's grouped product); the mini decode
graph step at 4K, batch 1, 1.680-1.693 -> 1.666-1.671 ms. The CUDA default at one token.

Two to MAX_T tokens: x [T, H, D] bf16 (the attention output, RoPE'd in the last R channels of
each head) is rotated back and multiplied by the block-diagonal bf16 `wo_a` [G * Ro, H * D / G]:
output rows of group g read only the channels of heads g * H / G .. Program (t, n-tile) computes BN outputs of token t
(a tile lies inside one group); each BK step loads its channels of x and their pair partners,
rotates them back in the prologue (rounded to bf16, as `rope` returns), and accumulates the
weight tile's products in fp32. Token is the fastest grid axis, so the programs sharing a weight
tile run together and its second read hits L2. Above MAX_T tokens (prefill), or compiled for
two or more tokens and a weight above MAX_WEIGHT_BYTES, the composition (`rope` kernel + cuBLAS
grouped product) runs instead.

The oracle is the composition `backends.fused.unrope_grouped_linear`; the rotation is the same
fp32 arithmetic as the `rope` kernel, the product an fp32 sum in another order (within a bf16
ulp or two of the reference's fp64 sum). CUDA only for now (unvetted on triton-ascend; Ascend
runs the composition).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends.fused import unrope_grouped_linear as unrope_grouped_linear_ref  # noqa: F401  (the oracle)
from .pdl import pdl_launch, pdl_prefetch_launch, pdl_prefetch_range_start, pdl_start
from .block_scaled import bf16_bits16, bf16_round
from .rope import partner_cols, rope_cols

MAX_T = 8  # tokens up to which the fused kernels run (decode); above, the composition
# Compiled (CUDA), the 2..MAX_T-token GEMV runs only for weights up to this many bytes: above it
# lost to cuBLAS's product at the mini width (H200 2026-12-01: 99 against 26 us at eight tokens,
# each token's program reading the weight). The one-token rows kernel has no limit. The
# interpreter ignores it.
MAX_WEIGHT_BYTES: int | None = 8 << 20
TILES = {"bn": 16, "bk": 256, "num_warps": 4}
TILES_INTERP = {"bn": 16, "bk": 64}
# One token (`_unrope_rows_kernel`, no weight-size limit): programs per SM and bytes of weight
# rows a step.
ROWS = {"waves": 2, "step_bytes": 32768, "num_warps": 16}
ROWS_INTERP = {"waves": 4, "step_bytes": 1024}


@triton.jit
def _unrope_grouped_linear_kernel(x_ptr, cos_ptr, sin_ptr, w_ptr, out_ptr, N, K, HD, D, R, RO,
                                  BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    t = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < N
    group = (tl.program_id(1) * BN) // RO  # a tile lies inside one group (RO % BN == 0)
    xrow = x_ptr + t.to(tl.int64) * HD + group * K
    acc = tl.zeros((BN,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < K
        col = (group * K + kk) % D  # channel inside its head
        x = tl.load(xrow + kk, mask=kmask, other=0.0).to(tl.float32)
        xp = tl.load(xrow + kk - col + partner_cols(col, D, R), mask=kmask, other=0.0).to(tl.float32)
        y = tl.where(col >= D - R, bf16_round(rope_cols(x, xp, cos_ptr, sin_ptr, t, col, D, R, -1.0, kmask)), x)
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + kk[None, :], mask=nmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * y[None, :], axis=1)
    tl.store(out_ptr + t.to(tl.int64) * N + n, bf16_bits16(acc), mask=nmask)


@triton.jit
def _unrope_rows_kernel(x_ptr, cos_ptr, sin_ptr, w_ptr, out_ptr, K, D, R, RO, rows_per_prog, pre_bytes,
                        KP: tl.constexpr, RS: tl.constexpr, PDL: tl.constexpr = 0):
    """One token (the decode batch of one): program p owns `rows_per_prog` consecutive output rows,
    all in one group (rows_per_prog divides RO). The group's K channels of x are rotated back once
    per program (rounded to bf16 as `rope` returns) and held in registers as bf16;
    the weight rows stream RS at a time, each step one contiguous run of RS * K values, the next
    step's loaded before this one's are used (two steps in flight, as the one-row FP8 kernel).
    The first `pre_bytes` of the program's rows are asked of the L2 before the wait."""
    n_lo = tl.program_id(0) * rows_per_prog
    n_hi = n_lo + rows_per_prog
    pdl_prefetch_range_start(PDL, w_ptr, n_lo.to(tl.int64) * K * 2, tl.minimum(rows_per_prog * K * 2, pre_bytes), 128)
    group = n_lo // RO
    kk = tl.arange(0, KP)
    kmask = kk < K
    rr = tl.arange(0, RS)
    w = tl.load(w_ptr + (n_lo + rr).to(tl.int64)[:, None] * K + kk[None, :], mask=kmask[None, :], other=0.0)
    col = (group * K + kk) % D  # channel inside its head
    xrow = x_ptr + group * K
    x = tl.load(xrow + kk, mask=kmask, other=0.0).to(tl.float32)
    xp = tl.load(xrow + kk - col + partner_cols(col, D, R), mask=kmask, other=0.0).to(tl.float32)
    # every value of y is a bf16 value (x's, or a rotated one rounded): held as bf16, half the registers
    y = tl.where(col >= D - R, bf16_round(rope_cols(x, xp, cos_ptr, sin_ptr, 0, col, D, R, -1.0, kmask)),
                 x).to(tl.bfloat16)
    for n0 in range(n_lo, n_hi, RS):
        nxt = n0 + RS + rr
        w_next = tl.load(w_ptr + nxt.to(tl.int64)[:, None] * K + kk[None, :], mask=(nxt < n_hi)[:, None] & kmask[None, :],
                         other=0.0)
        acc = tl.sum(w.to(tl.float32) * y.to(tl.float32)[None, :], axis=1)
        tl.store(out_ptr + n0 + rr, bf16_bits16(acc))
        w = w_next


def _launch_rows(x, cos, sin, weight, out, k, d, r, ro) -> None:
    """`_unrope_rows_kernel` for one token: rows per program a power of two dividing RO, about
    ROWS["waves"] programs per SM; RS rows (about ROWS["step_bytes"]) a step."""
    from .launch import interpreting, num_workers

    cfg = ROWS_INTERP if interpreting() else ROWS
    n = weight.shape[0]
    rpp = min(ro & -ro, triton.next_power_of_2(max(1, -(-n // (cfg["waves"] * num_workers(x.device))))))
    rs = min(rpp, 1 << (max(1, cfg["step_bytes"] // (2 * k)).bit_length() - 1))
    kw = {} if interpreting() else {"num_warps": cfg["num_warps"], "num_stages": 1}
    pdl_kw, pre = pdl_prefetch_launch(weight, n // rpp, aligned=k % 8 == 0 and weight.element_size() == 2
                                      and weight.data_ptr() % 16 == 0)
    _unrope_rows_kernel[(n // rpp,)](x, cos, sin, weight, out.view(torch.int16), k, d, r, ro, rpp, pre,
                                     KP=triton.next_power_of_2(k), RS=rs, **kw, **pdl_kw)


def unrope_grouped_linear(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor,
                          groups: int) -> torch.Tensor:
    """`ops.unrope_grouped_linear`: one launch up to MAX_T tokens, else the composition."""
    from .launch import interpreting

    t, h, d = x.shape
    r = 2 * cos.shape[-1]
    n, k = weight.shape
    if groups <= 0 or (h * d) % groups or k != h * d // groups or n % groups or cos.shape != (t, r // 2) \
            or sin.shape != cos.shape or r > d:
        raise ValueError(f"unrope_grouped_linear: x {tuple(x.shape)}, {groups} groups, weight {tuple(weight.shape)}, "
                         f"cos {tuple(cos.shape)} do not fit together")
    ro = n // groups
    bn = (TILES_INTERP if interpreting() else TILES)["bn"]
    while ro % bn:
        bn //= 2
    too_big = (not interpreting() and MAX_WEIGHT_BYTES is not None
               and weight.numel() * weight.element_size() > MAX_WEIGHT_BYTES)
    if t > MAX_T or (too_big and t != 1) or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 \
            or not weight.is_contiguous():
        return unrope_grouped_linear_ref(x, cos, sin, weight, groups)
    out = torch.empty(t, n, dtype=torch.bfloat16, device=x.device)
    if t == 0:
        return out
    x, cos, sin = x.contiguous(), cos.float().contiguous(), sin.float().contiguous()
    if t == 1:
        _launch_rows(x, cos, sin, weight, out, k, d, r, ro)
        return out
    cfg = TILES_INTERP if interpreting() else TILES
    bk = min(cfg["bk"], triton.next_power_of_2(k))
    kw = {} if interpreting() else {"num_warps": cfg["num_warps"]}
    _unrope_grouped_linear_kernel[(t, -(-n // bn))](x, cos, sin, weight, out.view(torch.int16), n, k, h * d, d, r, ro,
                                                   BN=bn, BK=bk, **kw, **pdl_launch(weight))
    return out


OPS = {"unrope_grouped_linear": unrope_grouped_linear}
