"""Engram's gated add (op `engram_gate`), one program per (token, stream): x_s [d] (bf16), its key
k_s [d] and the token's value v [d] (bf16 or fp32, read in place through their strides: k and v
are views of the wkv output, so no widening or gathering copy runs first; H200: 2.8 + 1.3 us a
layer at one token) are read once; both RMS norms, the weighted dot product, gate =
sigmoid(sign(dot) sqrt(max(|dot|, 1e-6))) (0 on image tokens) and x_s + gate * v in fp32, rounded
to x's dtype. The weights are per stream, [n, d]: program (t, s) reads row s.
Matches `engram_gate_ref` within fp32 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends.reference.basic import engram_gate as engram_gate_ref  # noqa: F401  (the oracle)
from .pdl import pdl_launch, pdl_start
from .block_scaled import bf16_bits16


@triton.jit
def _engram_gate_kernel(x_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, img_ptr, y_ptr, N, D, k_st, k_ss, v_st, eps,
                        inv_sqrt_d, BLOCK_D: tl.constexpr, OUT_BF16: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    t = tl.program_id(0)
    s = tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)
    m = cols < D
    row = (t.to(tl.int64) * N + s) * D
    x = tl.load(x_ptr + row + cols, mask=m, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + t.to(tl.int64) * k_st + s * k_ss + cols, mask=m, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + t.to(tl.int64) * v_st + cols, mask=m, other=0.0).to(tl.float32)
    qw = tl.load(qw_ptr + s * D + cols, mask=m, other=0.0).to(tl.float32)
    kw = tl.load(kw_ptr + s * D + cols, mask=m, other=0.0).to(tl.float32)
    kn = k * tl.math.rsqrt(tl.sum(k * k, axis=0) / D + eps)
    xn = x * tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    dot = tl.sum(kn * kw * xn * qw, axis=0) * inv_sqrt_d
    z = tl.sqrt(tl.maximum(tl.abs(dot), 1e-6))
    z = tl.where(dot < 0, -z, tl.where(dot > 0, z, 0.0))
    gate = 1.0 / (1.0 + tl.exp(-z))
    gate = tl.where(tl.load(img_ptr + t) != 0, 0.0, gate)
    y = x + gate * v
    if OUT_BF16:
        tl.store(y_ptr + row + cols, bf16_bits16(y), mask=m)
    else:
        tl.store(y_ptr + row + cols, y, mask=m)


def engram_gate(x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                eps: float, is_image: torch.Tensor) -> torch.Tensor:
    """x [T, n, d], k [T, n, d], v [T, d], weights [n, d] (one row per stream), is_image [T] -> [T, n, d]."""
    t, n, d = x.shape
    if k.shape != x.shape or v.shape != (t, d) or is_image.shape != (t,):
        raise ValueError(f"engram_gate: k {tuple(k.shape)}, v {tuple(v.shape)}, is_image {tuple(is_image.shape)} "
                         f"do not fit x {tuple(x.shape)}")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if tuple(w.shape) != (n, d):  # one row per mHC stream, as the reference requires
            raise ValueError(f"engram_gate: {name} must be [n_streams, d] = [{n}, {d}], got {list(w.shape)}")
    xc = x.contiguous()
    y = torch.empty_like(xc)
    if t:
        out_bf16 = x.dtype == torch.bfloat16
        if k.dtype not in (torch.bfloat16, torch.float32) or k.stride(-1) != 1:
            k = k.float().contiguous()
        if v.dtype not in (torch.bfloat16, torch.float32) or v.stride(-1) != 1:
            v = v.float().contiguous()
        img = is_image.contiguous()
        img = img.view(torch.int8) if img.dtype == torch.bool else img.to(torch.int8)  # (a bool view: no launch)
        _engram_gate_kernel[(t, n)](xc, k, v, q_weight.contiguous(), k_weight.contiguous(), img,
                                    y.view(torch.int16) if out_bf16 else y, n, d, k.stride(0), k.stride(1),
                                    v.stride(0), float(eps), d ** -0.5, BLOCK_D=triton.next_power_of_2(d),
                                    OUT_BF16=out_bf16, **pdl_launch(xc))
    return y


OPS = {"engram_gate": engram_gate}
