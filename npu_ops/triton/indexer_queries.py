"""The indexer's query tail in one launch (op `indexer_queries`).

One program per (token, head) row: the query row [Di] is held as the even and the odd channels of
its groups of 32 ([Di / 32, 16] each), so a RoPE pair (2i, 2i + 1) sits in one lane of the two
halves: RoPE of the last R channels (rounded to bf16 as `rope` returns), then the MXFP4
quantise-dequantise of each group of 32 (`mxfp4_act_quant`'s arithmetic: amax floored at
6 * 2^-126, scale 2^ceil(log2(amax / 6)) read off the fp32 bits, E2M1 round to nearest even,
saturating at 6), fp32 out; the program also scales its head weight (w * w_scale in fp32, as the
torch multiply). Before: `rope`, `mxfp4_act_quant` and an elementwise multiply, three launches.

The oracle is the composition `backends.fused.indexer_queries`; bit-exact with it (the same fp32
operations in the same order). CUDA only for now (on Ascend the composition runs: unvetted on
triton-ascend); interpreter-tested (tests/test_triton_fused.py), unverified on hardware.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends.fused import indexer_queries as indexer_queries_ref  # noqa: F401  (the oracle)
from .pdl import pdl_launch, pdl_start
from .mxfp4_quant import MX_GROUP
from .block_scaled import bf16_round

MAX_D = 8192  # a query row in registers


@triton.jit
def _mxfp4_qdq_pair(ye, yo):
    """MXFP4 quantise-dequantise of groups held as even / odd halves [G, 16] (fp32 values)."""
    amax = tl.maximum(tl.max(tl.abs(ye), axis=1), tl.max(tl.abs(yo), axis=1))
    bits = tl.maximum(amax.to(tl.int32, bitcast=True), 0x01C00000)  # floor 6 * 2^-126
    k = ((bits >> 23) & 0xFF) - 129 + ((bits & 0x7FFFFF) > 0x400000).to(tl.int32)  # ceil(log2(amax / 6))
    inv = ((127 - k) << 23).to(tl.float32, bitcast=True)[:, None]  # 2^-k
    scl = ((127 + k) << 23).to(tl.float32, bitcast=True)[:, None]  # 2^k
    return _qdq(ye * inv, scl), _qdq(yo * inv, scl)


@triton.jit
def _qdq(v, scl):
    """E2M1 round (nearest, ties to the even code, saturating at 6) of v, times scl, with v's sign
    by bit ops (-0.0 for negative values rounding to zero, as the reference)."""
    a = tl.abs(v)
    c = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) \
        + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) \
        + (a > 5.0).to(tl.int32)
    cf = c.to(tl.float32)
    mag = tl.where(cf < 4.0, cf * 0.5, tl.where(cf == 7.0, 6.0, cf - 2.0))
    return ((mag * scl).to(tl.int32, bitcast=True) | ((v < 0).to(tl.int32) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _indexer_queries_kernel(q_ptr, cos_ptr, sin_ptr, w_ptr, qo_ptr, wo_ptr, H, D, R, w_scale,
                            BLOCK_G: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    row = tl.program_id(0)
    t = row // H
    g = tl.arange(0, BLOCK_G)
    even = g[:, None] * 32 + 2 * tl.arange(0, 16)[None, :]  # [groups, 16]: channel 2i of each pair
    ok = even < D
    base = row.to(tl.int64) * D
    xe = tl.load(q_ptr + base + even, mask=ok, other=0.0).to(tl.float32)
    xo = tl.load(q_ptr + base + even + 1, mask=ok, other=0.0).to(tl.float32)
    rel = even - (D - R)
    rot = (rel >= 0) & ok
    half = tl.where(rot, rel // 2, 0)
    c = tl.load(cos_ptr + t * (R // 2) + half, mask=rot, other=1.0)
    s = tl.load(sin_ptr + t * (R // 2) + half, mask=rot, other=0.0)
    ye = tl.where(rot, bf16_round(xe * c + (-s) * xo), xe)  # the `rope` kernel's arithmetic, pair by pair
    yo = tl.where(rot, bf16_round(xo * c + s * xe), xo)
    qe, qo = _mxfp4_qdq_pair(ye, yo)
    tl.store(qo_ptr + base + even, qe, mask=ok)
    tl.store(qo_ptr + base + even + 1, qo, mask=ok)
    tl.store(wo_ptr + row, tl.load(w_ptr + row).to(tl.float32) * w_scale)


def indexer_queries(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: torch.Tensor,
                    w_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.indexer_queries` in one launch (the composition where the kernel does not apply:
    other dtypes, rows wider than MAX_D)."""
    t = q.shape[0]
    r = 2 * cos.shape[-1]
    if q.dim() != 3 or w.shape != q.shape[:2] or cos.shape != (t, r // 2) or sin.shape != cos.shape:
        raise ValueError(f"indexer_queries: q {tuple(q.shape)}, w {tuple(w.shape)}, cos {tuple(cos.shape)} "
                         "do not fit together")
    h, d = q.shape[1], q.shape[2]
    if (q.dtype != torch.bfloat16 or w.dtype != torch.float32 or d % MX_GROUP or d > MAX_D or r > d
            or (d - r) % 2):
        return indexer_queries_ref(q, cos, sin, w, w_scale)
    q_out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    w_out = torch.empty(w.shape, dtype=torch.float32, device=q.device)
    if t * h:
        _indexer_queries_kernel[(t * h,)](q.contiguous(), cos.float().contiguous(), sin.float().contiguous(),
                                          w.contiguous(), q_out, w_out, h, d, r, float(w_scale),
                                          BLOCK_G=triton.next_power_of_2(d // MX_GROUP), **pdl_launch(q_out))
    return q_out, w_out


OPS = {"indexer_queries": indexer_queries}
