"""Clamped SwiGLU (op `swiglu_clamped`): silu(min(gate, limit)) * clamp(up, -limit, limit) in fp32,
elementwise (the MoE kernels fuse the same math into their epilogue: `swiglu_tile`). Matches
`swiglu_ref` within fp32 rounding (device exp)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends.reference.basic import swiglu_clamped as swiglu_ref  # noqa: F401  (the oracle)
from .pdl import pdl_launch, pdl_start
from .block_scaled import bf16_round

BLOCK = 1024


@triton.jit
def swiglu_tile(g, u, limit):
    """silu(min(g, limit)) * clamp(u, -limit, limit), fp32."""
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def expert_act(g, u, wt, limit):
    """An expert's w2 input from its fp32 w1 / w3 sums g, u and routing weights wt, rounded where
    the official expert rounds (MODEL.md, "Where the official code rounds"; the reference's
    official mode): the w1 and w3 outputs to bf16, then clamped SwiGLU times the weight in fp32,
    rounded to bf16 (before the w2 input's FP8 quantisation). Rounding to bf16 also makes the
    result independent of the sums' fp32 order in all but the rare near-tie elements, so the
    FP8 codes of h agree between kernels and with the reference."""
    return bf16_round(swiglu_tile(bf16_round(g), bf16_round(u), limit) * wt)


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, y_ptr, n, limit, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, swiglu_tile(g, u, limit), mask=m)


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    g, u = gate.contiguous(), up.contiguous()
    y = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    n = g.numel()
    if n:
        _swiglu_kernel[(-(-n // BLOCK),)](g, u, y, n, float(limit), BLOCK=BLOCK, **pdl_launch(g))
    return y


OPS = {"swiglu_clamped": swiglu_clamped}
