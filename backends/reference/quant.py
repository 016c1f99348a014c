"""Reference numeric formats (MODEL.md section 4): FP8 E4M3 with power-of-two scales, FP4 E2M1
with E4M3 scales per 16 (main KV), MXFP4 with E8M0 scales per 32 (indexer, routed experts).

Storage conventions used everywhere in dsv41:
- FP4 values are packed two per byte, element 0 in the low nibble (as `torch.float4_e2m1fn_x2`),
  held in `uint8` tensors of half the channel count.
- E8M0 scales are `torch.float8_e8m0fnu` (one exponent byte, bias 127).
- E4M3 scales / values are `torch.float8_e4m3fn`.
All math runs in fp32; these functions are the oracle the fused kernels are tested against.
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP8_MAX = 448.0
FP4_MAX = 6.0
FP4_KV_GROUP = 16
FP4_KV_AMAX_FLOOR = 6.0 * 2.0**-9  # smallest scale = 2^-9, the smallest E4M3 subnormal
MX_GROUP = 32
MXFP4_AMAX_FLOOR = 6.0 * 2.0**-126
FP8_GROUP = 32
FP8_AMAX_FLOOR = 1e-4

# Decision points between neighbouring E2M1 magnitudes. A value exactly on a midpoint goes to
# the even code (codes 0,2,4,6 = 0, 1, 2, 4), so the comparison is `>` where the upper
# neighbour is odd and `>=` where it is even.
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _groups(x: torch.Tensor, g: int) -> torch.Tensor:
    if x.shape[-1] % g:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the group size {g}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // g, g)


def ceil_log2(v: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(v)) for positive finite fp32 `v` (via frexp, no log rounding)."""
    m, e = torch.frexp(v.float())
    return torch.where(m == 0.5, e - 1, e)


def e8m0_from_exponent(e: torch.Tensor) -> torch.Tensor:
    """Power-of-two exponents -> E8M0 bytes."""
    return (e + 127).clamp(0, 254).to(torch.uint8).view(torch.float8_e8m0fnu)


def e8m0_to_float(s: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 powers of two (exact)."""
    e = s.view(torch.uint8).to(torch.int32) - 127
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e)


# ---- E2M1 --------------------------------------------------------------------------------

def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scale) -> 4-bit codes in uint8 (0..15).

    Round to nearest, ties to the even code, saturate at 6; sign in bit 3.
    """
    a = x.float().abs()
    code = torch.zeros_like(a, dtype=torch.uint8)
    for mid, inclusive in _E2M1_MIDPOINTS:
        code += (a >= mid if inclusive else a > mid).to(torch.uint8)
    return code | ((x < 0).to(torch.uint8) << 3)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8 0..15) -> fp32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=code.device)
    mag = table[(code & 7).long()]
    return torch.where((code & 8) != 0, -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2k] codes -> [..., k] bytes, element 0 in the low nibble."""
    c = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (c[..., 0] | (c[..., 1] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., k] bytes -> [..., 2k] codes."""
    p = packed.view(torch.uint8)
    return torch.stack((p & 0xF, p >> 4), dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


# ---- FP4 main KV: E2M1 + E4M3 scale per 16 ------------------------------------------------

def fp4_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> (packed uint8 [..., D/2], E4M3 scales [..., D/16]).

    scale = e4m3(max(amax, 6*2^-9) / 6), true division, saturating at 448.
    """
    g = _groups(x.float(), FP4_KV_GROUP)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(FP4_KV_AMAX_FLOOR)
    scale = (amax / FP4_MAX).clamp_max(FP8_MAX).to(torch.float8_e4m3fn)
    codes = e2m1_encode(g / scale.float())
    return pack_nibbles(codes.reshape(x.shape)), scale.squeeze(-1)


def fp4_dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    vals = e2m1_decode(unpack_nibbles(packed))
    g = _groups(vals, FP4_KV_GROUP) * scale.float().unsqueeze(-1)
    return g.reshape(vals.shape)


# ---- MXFP4: E2M1 + E8M0 scale per 32 --------------------------------------------------------

def mxfp4_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> (packed uint8 [..., D/2], E8M0 scales [..., D/32]).

    scale = 2^ceil(log2(max(amax, 6*2^-126) / 6)); round to nearest, ties to the even code.
    """
    g = _groups(x.float(), MX_GROUP)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(MXFP4_AMAX_FLOOR)
    e = ceil_log2(amax / FP4_MAX)
    codes = e2m1_encode(torch.ldexp(g, -e))
    return pack_nibbles(codes.reshape(x.shape)), e8m0_from_exponent(e.squeeze(-1))


def mxfp4_dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    vals = e2m1_decode(unpack_nibbles(packed))
    g = _groups(vals, MX_GROUP) * e8m0_to_float(scale).unsqueeze(-1)
    return g.reshape(vals.shape)


def mxfp4_qdq(x: torch.Tensor) -> torch.Tensor:
    """Quantise-dequantise through MXFP4 (the indexer's queries), fp32 out."""
    return mxfp4_dequant(*mxfp4_quant(x))


# ---- FP8 E4M3 with power-of-two scales per 32 (activations, SWA ring) -----------------------

def fp8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> (E4M3 values [..., D], E8M0 scales [..., D/32]).

    amax floored at 1e-4; scale = 2^ceil(log2(amax/448)); clamp to +-448; round to nearest even.
    """
    g = _groups(x.float(), FP8_GROUP)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR)
    e = ceil_log2(amax / FP8_MAX)
    q = torch.ldexp(g, -e).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), e8m0_from_exponent(e.squeeze(-1))


def fp8_dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    g = _groups(q.float(), FP8_GROUP) * e8m0_to_float(scale).unsqueeze(-1)
    return g.reshape(q.shape)


def fp8_qdq(x: torch.Tensor) -> torch.Tensor:
    """Quantise-dequantise through blockwise FP8 (activations before FP8 linears, SWA KV).
    Same values as fp8_dequant(*fp8_quant(x)), with fewer temporaries (a hot path)."""
    g = _groups(x.float(), FP8_GROUP)
    e = ceil_log2(g.abs().amax(-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR) / FP8_MAX)
    q = torch.ldexp(g, -e).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return torch.ldexp(q, e).reshape(x.shape)


# ---- weights --------------------------------------------------------------------------------

def fp8_block_quant(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight [N, K] -> (E4M3 [N, K], E8M0 scales [ceil(N/32), ceil(K/32)]), power-of-two
    scales per 32x32 block chosen so the block's amax fits 448."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    pad = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    pad[:n, :k] = w.float()
    blocks = pad.reshape(nb, block, kb, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(FP8_AMAX_FLOOR)
    e = ceil_log2(amax / FP8_MAX)
    q = torch.ldexp(blocks, -e[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.reshape(nb * block, kb * block)[:n, :k].to(torch.float8_e4m3fn)
    return q, e8m0_from_exponent(e)


def fp8_block_dequant(q: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    n, k = q.shape
    s = e8m0_to_float(scale)
    s = s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return q.float() * s


def fp4_weight_quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed-expert weight [N, K] -> (int8 bytes [N, K/2] holding two E2M1 values, E8M0 [N, K/32])."""
    packed, scale = mxfp4_quant(w)
    return packed.view(torch.int8), scale


def fp4_weight_dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return mxfp4_dequant(packed.view(torch.uint8), scale)


def int8_row_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [r, D] -> (int8 [r, D], fp32 scale [r, 1]): scale = amax / 127, round half to even,
    clamp to +-127 (Engram rows for the Ascend host-offload path; an all-zero row keeps scale 0)."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x / safe).clamp(-127, 127).to(torch.int8), scale


def int8_token_qdq(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token symmetric INT8 of activations [..., K] (W8A8; what torch_npu's
    npu_dynamic_quant computes from bf16 input): (int8 values as fp32, fp32 scale [..., 1]),
    scale = amax / 127, round half to even. Rows of zeros get scale 0 and values 0."""
    return int8_row_quant(x)


def is_int8_channel_weight(weight: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """A W8A8 weight: int8 [N, K] with one fp32 scale per output channel (FP4 experts are int8
    bytes too, but with E8M0 scales)."""
    return scale is not None and weight.dtype == torch.int8 and scale.dtype == torch.float32 \
        and scale.numel() == weight.shape[0]
