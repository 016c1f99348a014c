"""MXFP4 quantisation (op `mxfp4_quant`: the indexer keys): groups of 32, amax floored at
6 * 2^-126, E8M0 scale 2^ceil(log2(amax / 6)), E2M1 codes rounded to nearest with ties to the
even code (saturating at 6), packed two per byte (element 2j in the low nibble). Bit-exact with
`mxfp4_quant_ref` (= `quant.mxfp4_quant`); the exponent is read off the bits as in
`mxfp4_act_quant` (whose docstring shows why that equals the reference's rounded quotient).

Each tile loads the even and the odd elements of BLOCK_G groups as two [BLOCK_G, 16] halves, so a
byte's two nibbles come from the same lane: no shuffles, one byte store per pair.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends.reference.quant import mxfp4_quant as mxfp4_quant_ref  # noqa: F401  (the oracle)
from .pdl import pdl_launch, pdl_start
from .block_scaled import pow2

MX_GROUP = 32
BLOCK_G = 64


@triton.jit
def _e2m1_code(v):
    """E2M1 nibble of v (already divided by the scale): nearest, ties to even, sign bit 3 for
    v < 0 (as `quant.e2m1_encode`)."""
    a = tl.abs(v)
    c = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) \
        + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    return c | ((v < 0).to(tl.int32) << 3)


@triton.jit
def _mxfp4_quant_kernel(x_ptr, p_ptr, s_ptr, n_groups, n_tiles, num_programs, BLOCK_G: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    pid = tl.program_id(0)
    half = tl.arange(0, 16)
    for t in range(pid, n_tiles, num_programs):
        g = t * BLOCK_G + tl.arange(0, BLOCK_G)
        gmask = g < n_groups
        base = g.to(tl.int64)[:, None] * 32 + 2 * half[None, :]
        xe = tl.load(x_ptr + base, mask=gmask[:, None], other=0.0).to(tl.float32)
        xo = tl.load(x_ptr + base + 1, mask=gmask[:, None], other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))
        bits = tl.maximum(amax.to(tl.int32, bitcast=True), 0x01C00000)  # floor 6 * 2^-126
        k = ((bits >> 23) & 0xFF) - 129 + ((bits & 0x7FFFFF) > 0x400000).to(tl.int32)  # ceil(log2(amax / 6))
        inv = pow2(-k)[:, None]
        byte = _e2m1_code(xe * inv) | (_e2m1_code(xo * inv) << 4)
        tl.store(p_ptr + g.to(tl.int64)[:, None] * 16 + half[None, :], byte.to(tl.uint8), mask=gmask[:, None])
        tl.store(s_ptr + g, tl.minimum(tl.maximum(k + 127, 0), 254).to(tl.uint8), mask=gmask)


def mxfp4_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> (packed uint8 [..., D/2], E8M0 [..., D/32])."""
    from .launch import grid_for

    if x.shape[-1] % MX_GROUP:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of {MX_GROUP}")
    xc = x.contiguous()
    packed = torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=torch.uint8, device=x.device)
    scale = torch.empty(*x.shape[:-1], x.shape[-1] // MX_GROUP, dtype=torch.float8_e8m0fnu, device=x.device)
    n_groups = xc.numel() // MX_GROUP
    if n_groups:
        n_tiles = -(-n_groups // BLOCK_G)
        grid = grid_for(n_tiles, x.device)
        _mxfp4_quant_kernel[(grid,)](xc, packed, scale.view(torch.uint8), n_groups, n_tiles, grid, BLOCK_G=BLOCK_G, **pdl_launch(xc))
    return packed, scale


OPS = {"mxfp4_quant": mxfp4_quant}
