"""FP8 E4M3 quantisation of activations in groups of 32 (op `fp8_quant`), bit-exact with
`fp8_quant_ref` (= `quant.fp8_quant`): amax floored at 1e-4, scale 2^ceil(log2(amax / 448)),
values rounded to nearest even in E4M3 (|v| <= 448 by construction of the scale), -0.0 kept.
Integer / fp32 arithmetic only (`block_scaled` helpers); codes and E8M0 scales are stored as bytes.

`fp8_qdq_bf16` is the same pass writing the dequantised values as bf16 (exact: 3 mantissa
bits times a power of two): the quantised activation of a large-M linear, made once per call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends.reference.quant import fp8_quant as fp8_quant_ref  # noqa: F401  (the oracle)
from .pdl import pdl_launch, pdl_start
from .block_scaled import FP8_GROUP, fp8_code, fp8_exponent, fp8_round, pow2

BLOCK_G = 64  # groups of 32 per tile


@triton.jit
def _fp8_quant_kernel(x_ptr, q_ptr, s_ptr, n_groups, n_tiles, num_programs,
                      BLOCK_G: tl.constexpr, QDQ: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    pid = tl.program_id(0)
    cols = tl.arange(0, 32)
    for t in range(pid, n_tiles, num_programs):
        g = t * BLOCK_G + tl.arange(0, BLOCK_G)
        gmask = g < n_groups
        offs = g.to(tl.int64)[:, None] * 32 + cols[None, :]
        x = tl.load(x_ptr + offs, mask=gmask[:, None], other=0.0).to(tl.float32)
        e = fp8_exponent(tl.max(tl.abs(x), axis=1))
        v = x * pow2(-e)[:, None]
        if QDQ:  # dequantised, as bf16 bits (exact)
            val = fp8_round(v) * pow2(e)[:, None]
            tl.store(q_ptr + offs, (val.to(tl.int32, bitcast=True) >> 16).to(tl.int16), mask=gmask[:, None])
        else:
            tl.store(q_ptr + offs, fp8_code(v).to(tl.uint8), mask=gmask[:, None])
            tl.store(s_ptr + g, tl.minimum(tl.maximum(e + 127, 0), 254).to(tl.uint8), mask=gmask)


def _launch(x: torch.Tensor, qdq: bool):
    from .launch import grid_for

    if x.shape[-1] % FP8_GROUP:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of {FP8_GROUP}")
    xc = x.contiguous()
    if qdq:
        q = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
        s = q
    else:
        q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty(*x.shape[:-1], x.shape[-1] // FP8_GROUP, dtype=torch.float8_e8m0fnu, device=x.device)
    n_groups = xc.numel() // FP8_GROUP
    if n_groups:
        n_tiles = -(-n_groups // BLOCK_G)
        grid = grid_for(n_tiles, x.device)
        _fp8_quant_kernel[(grid,)](xc, q.view(torch.int16 if qdq else torch.uint8), s.view(torch.int16 if qdq else torch.uint8),
                                   n_groups, n_tiles, grid, BLOCK_G=BLOCK_G, QDQ=qdq, **pdl_launch(xc))
    return q, s


def fp8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> (E4M3 [..., D], E8M0 [..., D/32])."""
    return _launch(x, False)


def fp8_qdq_bf16(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> the FP8 quantise-dequantised values as bf16 (exact)."""
    return _launch(x, True)[0]


OPS = {"fp8_quant": fp8_quant}
