"""MXFP4 quantise-dequantise of activations (the indexer's queries), fp32 out.

Groups of 32 along the last axis; amax floored at 6 * 2^-126; scale = 2^ceil(log2(amax / 6));
values divided by the scale round to the nearest E2M1 code (ties to the even code, saturating
at 6) and are multiplied back. Bit-exact with `mxfp4_act_quant_ref` (= `quant.mxfp4_qdq`).

Exactness without division or log: for amax = m * 2^e (m in [1, 2), amax normal thanks to the
floor), ceil(log2(amax / 6)) = e - 2 if m <= 1.5 else e - 1, read off the fp32 bits (the
correctly rounded quotient amax / 6 the reference uses never crosses a power of two, so the
two agree). Scaling by 2^-k and 2^k is exact (the powers are built from their bit patterns).
Inf / NaN inputs are out of contract.

Triton dialect kept to what upstream Triton and triton-ascend both accept: fp32/int32
arithmetic only (inputs cast to fp32 right after the load), bitcasts, tl.where, tl.max along
an axis, a 1-D persistent loop over tiles of BLOCK_G groups x 32 channels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends.reference import quant
from .fp4_common import offsets
from .pdl import pdl_launch, pdl_start

MX_GROUP = 32
BLOCK_G = 64  # groups per tile: 64 x 32 fp32 = 8 KB live per tensor (inside Ascend UB; H200 sweep: 16 -> 1851 GB/s, 64 -> 2294 GB/s)


def ub_tiles(block_g: int = BLOCK_G) -> dict[str, tuple[int, ...]]:
    """Live tiles of one program at its peak: x, x / scale, |x / scale|, the codes, magnitudes
    and the output, [BLOCK_G, 32] each, plus the per-group scalars."""
    t = (block_g, MX_GROUP)
    return {"x": t, "v": t, "a": t, "codes": t, "mag": t, "q": t, "per_group": (block_g, 8)}


def mxfp4_act_quant_ref(x: torch.Tensor) -> torch.Tensor:
    """The torch reference (fp32 out)."""
    return quant.mxfp4_qdq(x)


@triton.jit
def _mxfp4_act_quant_kernel(x_ptr, y_ptr, n_groups, n_tiles, num_programs,
                            BLOCK_G: tl.constexpr, GROUP: tl.constexpr, WIDE: tl.constexpr,
                            PDL: tl.constexpr = 0):
    pdl_start(PDL)
    pid = tl.program_id(0)
    cols = tl.arange(0, GROUP)
    for t in range(pid, n_tiles, num_programs):
        g = t * BLOCK_G + tl.arange(0, BLOCK_G)
        gmask = g < n_groups
        offs = offsets(g, WIDE)[:, None] * GROUP + cols[None, :]
        mask = gmask[:, None]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        # floor at 6 * 2^-126 = 1.5 * 2^-124 (bits 0x01C00000): for non-negative floats the
        # integer order of the bit patterns is the float order
        bits = tl.maximum(amax.to(tl.int32, bitcast=True), 0x01C00000)
        e = ((bits >> 23) & 0xFF) - 127
        k = e - 2 + ((bits & 0x7FFFFF) > 0x400000).to(tl.int32)  # ceil(log2(amax / 6))
        inv = ((127 - k) << 23).to(tl.float32, bitcast=True)  # 2^-k, k in [-126, 126]
        scl = ((127 + k) << 23).to(tl.float32, bitcast=True)  # 2^k
        v = x * inv[:, None]
        a = tl.abs(v)
        # E2M1 code of |v|: round to nearest, ties to the even code (>= where the upper
        # neighbour is even), saturating at 6.
        c = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) \
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) \
            + (a > 5.0).to(tl.int32)
        cf = c.to(tl.float32)
        mag = tl.where(cf < 4.0, cf * 0.5, tl.where(cf == 7.0, 6.0, cf - 2.0))  # fp32 compares (Ascend)
        # sign by bit ops (x < 0 gives a negative code, so -0.0 for values rounding to zero, as
        # the reference; a float negation may lower to 0 - mag and lose that)
        q = ((mag * scl[:, None]).to(tl.int32, bitcast=True) | ((v < 0).to(tl.int32) << 31)).to(tl.float32, bitcast=True)
        tl.store(y_ptr + offs, q.to(y_ptr.dtype.element_ty), mask=mask)


def mxfp4_act_quant(x: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., D] (fp32/bf16/fp16, D % 32 == 0) -> MXFP4 quantise-dequantised values in
    `out_dtype` (fp32 by default, as the op contract says). Requires triton; no fallback."""
    from .launch import grid_for, needs_int64

    if x.shape[-1] % MX_GROUP:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of {MX_GROUP}")
    xc = x.contiguous()
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    n_groups = xc.numel() // MX_GROUP
    if n_groups == 0:
        return y
    n_tiles = -(-n_groups // BLOCK_G)
    grid = grid_for(n_tiles, x.device)
    _mxfp4_act_quant_kernel[(grid,)](xc, y, n_groups, n_tiles, grid, BLOCK_G=BLOCK_G, GROUP=MX_GROUP,
                                     WIDE=needs_int64(xc), **pdl_launch(xc))
    return y


OPS = {"mxfp4_act_quant": mxfp4_act_quant}
