"""Compressor tail in one pass (op `compress_kv`): pool -> RMSNorm -> bf16 latent -> RoPE -> FP4.

Per group of `ratio` rows of kv / score ([G * ratio, D] fp32):
- ratio 2: per-channel softmax over the two score rows (max, exp, sum, true division, as torch's
  softmax), pooled = w0 * kv0 + w1 * kv1, rounded to bf16 (the official code's pooled latent is
  a bf16 tensor: the reference's official mode); ratio 1: pooled = kv row.
- RMSNorm in fp32: pooled * (1 / sqrt(sum(pooled^2) / D + eps)) * weight, rounded to bf16 ->
  the latent (returned, un-rotated, [G, D] bf16).
- interleaved-pair RoPE on the last R = 2 * cos.shape[-1] channels of the bf16 latent, fp32
  math rounded to bf16 (as `basic.rope`): (a, b) -> (a c - b s, a s + b c);
- FP4 (E2M1 + E4M3 scale per 16, `quant.fp4_quant`) written to codes[slots] / scales[slots].
Reference: `compress_kv_ref` (= backends/reference/attention.compress_kv).

Exactness. RoPE and FP4 are bit-exact given the latent (the FP4 encoding is the exact one of
fp4_kv_store.py via fp4_common.py; bf16 rounding is done on the bits; on CUDA the kernel is
compiled with `enable_fp_fusion=False`, so a*c - b*s is two rounded products and a rounded
difference, like torch, never an FMA; sqrt and divisions use the correctly rounded
`tl.sqrt_rn` / `tl.div_rn`). The latent itself can differ from the reference in rare elements:
the sum of squares is reduced in a different order than torch's, and at ratio 2 `tl.exp`
(ex2.approx on CUDA) is not torch's expf; a few fp32 ulps flip the bf16 rounding only of values
near a bf16 midpoint (~1e-5 of the elements), and where w0 * kv0 and w1 * kv1 nearly cancel
the small pooled value can move by more than a bf16 ulp (bounded by ~2^-21 of the un-cancelled
size |w0 kv0| + |w1 kv1|, in a CPU emulation of ex2.approx-sized exp errors). Inputs
whose sums are exact (and equal scores) give bit-exact results.

Tiles: BLOCK_G groups x the whole row (D channels, D a power of two) -- RMSNorm needs the row;
the latent is re-viewed as [BLOCK_G, D/2, 2] and split into even / odd channels (the RoPE pairs
and the two nibbles of a code byte), then as [BLOCK_G, D/16, 8] for the FP4 groups.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends.reference.attention import compress_kv as compress_kv_ref  # noqa: F401 (the oracle)
from .pdl import pdl_launch, pdl_start
from .fp4_common import (FP4_GROUP, as_cmp, bf16_rne_bits, byte_to_int8, e2m1_code, e4m3_value, fp4_scale_code,
                         offsets)

# (BLOCK_G, num_warps) per ratio. CUDA: 8 (ratio 2) / 16 (ratio 1) rows of 512 fp32 in flight
# per program keep ~64 KB of loads outstanding per SM. Ascend / interpreter: <= 4 fp32 row
# tiles of 4 x 2 KB live, well inside half the 192 KB unified buffer.
TILES = {
    "cuda": {1: (16, 8), 2: (8, 8)},
    "default": {1: (8, 4), 2: (4, 4)},
}


def ub_tiles(block_g: int, d: int, ratio: int) -> dict[str, tuple[int, ...]]:
    """Live tiles of one program at its peak: at ratio 2 the two score and two kv rows plus the
    exponentials while pooling; then the pooled row, the bf16 latent (as fp32 bits), the norm
    weight, the RoPE halves with cos / sin and their rotations, and the FP4 codes / bytes."""
    row = (block_g, d)
    half = (block_g, d // 2)
    tiles = {"x": row, "latent": row, "weight": (1, d), "a": half, "b": half, "cos": half, "sin": half,
             "ra": half, "rb": half, "codes": half, "scales": (block_g, d // 16)}
    if ratio == 2:
        tiles.update(s0=row, s1=row, k0=row, k1=row, e0=row, e1=row)
    return tiles


@triton.jit
def _compress_kv_kernel(kv_ptr, score_ptr, w_ptr, cos_ptr, sin_ptr, slot_ptr, lat_ptr, code_ptr, scale_ptr,
                        n_groups, cap, eps, n_tiles, num_programs, code_stride, scale_stride, kv_stride, score_stride,
                        D: tl.constexpr, HALF_R: tl.constexpr, RATIO: tl.constexpr,
                        BLOCK_G: tl.constexpr, WIDE: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    NG: tl.constexpr = D // 16  # FP4 groups per row
    HALF_D: tl.constexpr = D // 2
    pid = tl.program_id(0)
    ch = tl.arange(0, D)[None, :]  # [1, D] channel
    p = tl.arange(0, HALF_D)[None, :]  # [1, D/2] channel pair
    rp = p - (HALF_D - HALF_R)  # RoPE frequency index of the pair (< 0: not rotated)
    rmask = rp >= 0
    q3 = tl.arange(0, NG)[None, :, None]
    p3 = q3 * 8 + tl.arange(0, 8)[None, None, :]  # [1, NG, 8] pair index
    q2 = tl.arange(0, NG)[None, :]
    w = tl.load(w_ptr + ch).to(tl.float32)  # norm weight [1, D]
    for t in range(pid, n_tiles, num_programs):
        g = t * BLOCK_G + tl.arange(0, BLOCK_G)
        gmask = g < n_groups
        g64 = offsets(g, WIDE)  # int32 unless a tensor has 2^31 elements
        m2 = gmask[:, None]
        if RATIO == 1:
            x = tl.load(kv_ptr + g64[:, None] * kv_stride + ch, mask=m2, other=0.0).to(tl.float32)
        else:
            r0 = (g64 * 2)[:, None]  # the group's first row (rows may be strided: views of one tensor)
            s0 = tl.load(score_ptr + r0 * score_stride + ch, mask=m2, other=0.0).to(tl.float32)
            s1 = tl.load(score_ptr + (r0 + 1) * score_stride + ch, mask=m2, other=0.0).to(tl.float32)
            k0 = tl.load(kv_ptr + r0 * kv_stride + ch, mask=m2, other=0.0).to(tl.float32)
            k1 = tl.load(kv_ptr + (r0 + 1) * kv_stride + ch, mask=m2, other=0.0).to(tl.float32)
            mx = tl.maximum(s0, s1)
            e0 = tl.exp(s0 - mx)
            e1 = tl.exp(s1 - mx)
            den = e0 + e1
            x = tl.div_rn(e0, den) * k0 + tl.div_rn(e1, den) * k1
            # the official pooled latent is a bf16 tensor before its norm (the reference's official mode)
            x = bf16_rne_bits(x).to(tl.float32, bitcast=True)
        # RMSNorm (fp32): mean of squares (D a power of two: the division is exact), eps, 1/sqrt
        ms = tl.sum(x * x, axis=1) * (1.0 / D)
        rs = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))
        yb = bf16_rne_bits((x * rs[:, None]) * w)  # bf16 latent as fp32 bits
        tl.store(lat_ptr + g64[:, None] * D + ch, (yb >> 16).to(tl.int16), mask=m2)
        lat = yb.to(tl.float32, bitcast=True)
        # RoPE on the last HALF_R pairs of the bf16 latent
        a, b = tl.split(tl.reshape(lat, (BLOCK_G, HALF_D, 2)))
        cs_off = g64[:, None] * HALF_R + rp
        cmask = m2 & rmask
        c = tl.load(cos_ptr + cs_off, mask=cmask, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + cs_off, mask=cmask, other=0.0).to(tl.float32)
        ra = bf16_rne_bits(a * c - b * s).to(tl.float32, bitcast=True)
        rb = bf16_rne_bits(a * s + b * c).to(tl.float32, bitcast=True)
        a = tl.where(rmask, ra, a)
        b = tl.where(rmask, rb, b)
        # FP4: E4M3 scale per 16 channels (8 pairs), E2M1 nibbles, element 0 in the low nibble
        a3 = tl.reshape(a, (BLOCK_G, NG, 8))
        b3 = tl.reshape(b, (BLOCK_G, NG, 8))
        amax = tl.maximum(tl.max(tl.abs(a3), axis=2), tl.max(tl.abs(b3), axis=2))
        sc = fp4_scale_code(amax)  # [BLOCK_G, NG] E4M3 codes
        sv = e4m3_value(sc)[:, :, None]
        byte = e2m1_code(a3, sv) | (e2m1_code(b3, sv) << 4)
        slot = offsets(tl.load(slot_ptr + g, mask=gmask, other=0), WIDE)
        slot = tl.where(as_cmp(slot) < 0.0, slot + cap, slot)  # torch indexing semantics for negative slots
        # bytes through int8 pointers (no uint8 pointer stores on Atlas A2/A3)
        tl.store(code_ptr + slot[:, None, None] * code_stride + p3, byte_to_int8(byte), mask=gmask[:, None, None])
        tl.store(scale_ptr + slot[:, None] * scale_stride + q2, sc.to(tl.int8), mask=m2)  # E4M3 codes 0..126


def _tiles(device: torch.device, ratio: int) -> tuple[int, int]:
    from .launch import interpreting

    table = TILES["cuda"] if device.type == "cuda" and not interpreting() else TILES["default"]
    return table[ratio]


def compress_kv(kv, score, ratio, norm_weight, eps, cos, sin, codes, scales, slots):
    """`ops.compress_kv`: kv, score [G * ratio, D] fp32 (score None at ratio 1, where kv may be bf16:
    the kernel widens what it loads, so the model's bf16 matmul rows need no copy), norm_weight [D],
    cos / sin [G, R/2] fp32, codes [cap, D/2] uint8, scales [cap, D/16] float8_e4m3fn (or
    uint8), slots [G] -> writes codes[slots] / scales[slots]; returns the latent [G, D] bf16.
    ratio 1 or 2; D a power of two >= 16; R <= D. Requires triton."""
    from .launch import as_int8, grid_for, interpreting, needs_int64

    if ratio not in (1, 2):
        raise ValueError(f"compress ratio {ratio} is not supported (1 or 2)")
    if kv.dim() != 2:
        raise ValueError(f"kv must be [rows, D], got {tuple(kv.shape)}")
    d = kv.shape[1]
    if d < FP4_GROUP or d & (d - 1):
        raise ValueError(f"D = {d} must be a power of two >= {FP4_GROUP}")
    n = kv.shape[0] // ratio
    if ratio > 1 and (score is None or score.shape[1] != d or score.shape[0] < n * ratio):
        raise ValueError("score must be [rows, D] like kv at ratio > 1")
    half_r = cos.shape[-1]
    if cos.shape != (n, half_r) or sin.shape != (n, half_r) or 2 * half_r > d:
        raise ValueError(f"cos / sin must be [{n}, R/2] with R <= {d}, got {tuple(cos.shape)} / {tuple(sin.shape)}")
    if slots.shape != (n,):
        raise ValueError(f"slots must be [{n}], got {tuple(slots.shape)}")
    cv, sv = codes.view(torch.uint8), scales.view(torch.uint8)
    if cv.shape[1:] != (d // 2,) or sv.shape[1:] != (d // FP4_GROUP,) or cv.shape[0] != sv.shape[0]:
        raise ValueError(f"codes {tuple(codes.shape)} / scales {tuple(scales.shape)} do not fit rows of width {d}")
    if cv.stride(-1) != 1 or sv.stride(-1) != 1:  # (row-strided views of page records are fine)
        raise ValueError("each row of codes and scales must be contiguous")
    lat = torch.empty(n, d, dtype=torch.bfloat16, device=kv.device)
    if n == 0:
        return lat
    # row-strided views (kv and score interleaved in one tensor) are read in place: no copies
    rows_of = lambda v: v[: n * ratio] if v.stride(-1) == 1 else v[: n * ratio].contiguous()  # noqa: E731
    kv_c = rows_of(kv)
    score_c = rows_of(score) if ratio > 1 else kv_c
    block_g, warps = _tiles(kv.device, ratio)
    n_tiles = -(-n // block_g)
    grid = grid_for(n_tiles, kv.device)
    extra = {} if interpreting() else {"num_warps": warps}
    if kv.device.type == "cuda" and not interpreting():
        extra["enable_fp_fusion"] = False  # a*c - b*s etc. rounded like torch, no FMA contraction
    _compress_kv_kernel[(grid,)](kv_c, score_c, norm_weight.contiguous(), cos.contiguous(), sin.contiguous(),
                                 slots.contiguous(), lat.view(torch.int16), as_int8(cv), as_int8(sv), n, cv.shape[0],
                                 float(eps), n_tiles, grid, cv.stride(0), sv.stride(0), kv_c.stride(0),
                                 score_c.stride(0), D=d, HALF_R=half_r,
                                 RATIO=ratio, BLOCK_G=block_g, WIDE=needs_int64(kv, cv, lat), **extra, **pdl_launch(kv_c))
    return lat


OPS = {"compress_kv": compress_kv}
