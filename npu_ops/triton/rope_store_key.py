"""The compressed entries' indexer keys in one launch (op `rope_store_key`).

One program per row: the key [Di] is held as the even and the odd channels of its groups of 32
([Di / 32, 16] each), so a RoPE pair (2i, 2i + 1) sits in one lane of the two halves and an
MXFP4 byte's two nibbles too: RMSNorm (fp32 math, rounded to bf16 as `rms_norm` returns), RoPE of
the last R channels (rounded to bf16 as `rope` returns), MXFP4 (E2M1 codes, E8M0 scale per 32, as
`mxfp4_quant`), and the bytes stored straight into the key pool's row `slots[t]` (row-strided
pools allowed). Rows that complete no entry write to the null row, as the composition does
(nothing reads it).

The oracle is the composition `backends.fused.rope_store_key` (rms_norm -> rope -> mxfp4_quant ->
row write). Bytes agree with it except where the norm's fp32 sum, summed in another order, moves
a value across a bf16 rounding (one E2M1 step). CUDA only for now (uint8 stores; on Ascend the
composition runs: unvetted on triton-ascend).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends.fused import rope_store_key as rope_store_key_ref  # noqa: F401  (the oracle)
from .pdl import pdl_launch, pdl_start
from .block_scaled import bf16_round, pow2
from .mxfp4_quant import MX_GROUP, _e2m1_code

MAX_D = 8192  # a key row in registers


@triton.jit
def _rope_store_key_kernel(k_ptr, w_ptr, cos_ptr, sin_ptr, codes_ptr, scales_ptr, slots_ptr, D, R, eps,
                           codes_stride, scales_stride, BLOCK_G: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    t = tl.program_id(0)
    g = tl.arange(0, BLOCK_G)
    even = g[:, None] * 32 + 2 * tl.arange(0, 16)[None, :]  # [groups, 16]: channel 2i of each pair
    ok = even < D
    base = k_ptr + t.to(tl.int64) * D
    xe = tl.load(base + even, mask=ok, other=0.0).to(tl.float32)
    xo = tl.load(base + even + 1, mask=ok, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt((tl.sum(tl.sum(xe * xe, axis=1), axis=0) + tl.sum(tl.sum(xo * xo, axis=1), axis=0)) / D + eps)
    ne = bf16_round(xe * inv * tl.load(w_ptr + even, mask=ok, other=0.0).to(tl.float32))
    no = bf16_round(xo * inv * tl.load(w_ptr + even + 1, mask=ok, other=0.0).to(tl.float32))
    rel = even - (D - R)
    rot = (rel >= 0) & ok
    half = tl.where(rot, rel // 2, 0)
    c = tl.load(cos_ptr + t * (R // 2) + half, mask=rot, other=1.0)
    s = tl.load(sin_ptr + t * (R // 2) + half, mask=rot, other=0.0)
    ye = bf16_round(ne * c + (-s) * no)  # the `rope` kernel's arithmetic, pair by pair
    yo = bf16_round(no * c + s * ne)
    amax = tl.maximum(tl.max(tl.abs(ye), axis=1), tl.max(tl.abs(yo), axis=1))
    bits = tl.maximum(amax.to(tl.int32, bitcast=True), 0x01C00000)  # floor 6 * 2^-126
    k = ((bits >> 23) & 0xFF) - 129 + ((bits & 0x7FFFFF) > 0x400000).to(tl.int32)  # ceil(log2(amax / 6))
    scale = pow2(-k)[:, None]
    byte = _e2m1_code(ye * scale) | (_e2m1_code(yo * scale) << 4)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    gok = (g < D // 32) & (slot >= 0)
    tl.store(codes_ptr + slot * codes_stride + even // 2, byte.to(tl.uint8), mask=ok & gok[:, None])
    tl.store(scales_ptr + slot * scales_stride + g, tl.minimum(tl.maximum(k + 127, 0), 254).to(tl.uint8), mask=gok)


def rope_store_key(key: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                   key_codes: torch.Tensor, key_scale: torch.Tensor, slots: torch.Tensor) -> None:
    """`ops.rope_store_key` in one launch (the composition where the kernel does not apply:
    other dtypes, rows wider than MAX_D, pools whose rows are not contiguous)."""
    t, d = key.shape[0], key.shape[-1]
    r = 2 * cos.shape[-1]
    if key.dim() != 2 or cos.shape != (t, r // 2) or sin.shape != cos.shape or r > d or r % 2 or (d - r) % 2 \
            or slots.shape != (t,) or norm_weight.shape != (d,):
        raise ValueError(f"rope_store_key: key {tuple(key.shape)}, cos {tuple(cos.shape)}, slots {tuple(slots.shape)}, "
                         f"norm weight {tuple(norm_weight.shape)} do not fit together")
    if (key.dtype != torch.bfloat16 or d % MX_GROUP or d > MAX_D or key_codes.stride(-1) != 1
            or key_scale.stride(-1) != 1 or key_codes.element_size() != 1 or key_scale.element_size() != 1):
        return rope_store_key_ref(key, norm_weight, eps, cos, sin, key_codes, key_scale, slots)
    if t == 0:
        return None
    _rope_store_key_kernel[(t,)](key.contiguous(), norm_weight.contiguous(), cos.float().contiguous(),
                                 sin.float().contiguous(), key_codes.view(torch.uint8), key_scale.view(torch.uint8),
                                 slots.contiguous(), d, r, float(eps), key_codes.stride(0), key_scale.stride(0),
                                 BLOCK_G=triton.next_power_of_2(d // MX_GROUP), **pdl_launch(slots))
    return None


OPS = {"rope_store_key": rope_store_key}
