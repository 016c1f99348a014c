"""Shared @triton.jit helpers for the block-scaled formats of the linears and experts (MODEL.md
section 4): FP8 E4M3 with power-of-two (E8M0) scales per 32, and packed FP4 (E2M1) weights.

Everything is integer / fp32 arithmetic on bit patterns, so results are exact and identical
under the interpreter and compiled (no fp8 arithmetic, no reliance on a cast's rounding mode):
- `fp8_exponent(amax)`: ceil(log2(max(amax, 1e-4) / 448)) exactly as `quant.fp8_quant` (see
  below); `pow2(e)` is 2^e built from its bits.
- `fp8_round(v)` / `fp8_code(v)`: E4M3 round to nearest even of |v| <= 448 (value / code byte).
- `fp8_qdq_groups(x, R, C)`: quantise-dequantise an [R, C] fp32 tile through FP8 in groups of
  32 along C (the activation quantisation in front of every FP8 / FP4 linear); the result is a
  bf16-exact fp32 tile (3 mantissa bits times a power of two).
- `load_weight_tile`: a [BN, BK] weight tile dequantised to fp32 (exact), for bf16 / fp32,
  FP8 with E8M0 scales per 32x32 block, or packed FP4 with E8M0 scales per 32 along K.

ceil(log2(amax / 448)) without division: amax = m * 2^E (m in [1, 2); the 1e-4 floor keeps it
normal) and 448 = 1.75 * 2^8, so the quotient is (m / 1.75) * 2^(E - 8) with m / 1.75 in
(0.57, 1.15): the ceiling is E - 8 when m <= 1.75, else E - 7. The reference's correctly rounded
fp32 quotient never crosses the power of two on the other side (one ulp of m moves the quotient
by 0.57 of its ulp, which rounds away from 1), so both agree for every input.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_GROUP = 32
W_DENSE, W_FP8, W_FP4 = 0, 1, 2  # weight storage kinds (constexpr switch of the kernels)


@triton.jit
def pow2(e):
    """2^e as fp32 for int32 e in [-126, 127] (built from the exponent bits: exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_value(s):
    """E8M0 byte (int32 1..254) -> 2^(s - 127) fp32. Byte 0 (2^-127, subnormal) reads as 0."""
    return (s << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp8_exponent(amax):
    """ceil(log2(max(amax, 1e-4) / 448)) as int32 (see the module docstring)."""
    bits = tl.maximum(amax, 1e-4).to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)


@triton.jit
def _fp8_parts(v):
    """|v| rounded to E4M3 (nearest, ties to even; |v| <= 448): (normal flag, rounded normal
    value's bits with the low 20 bits cleared, subnormal multiple of 2^-9 as int32)."""
    b = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    normal = b >= 0x3C800000  # |v| >= 2^-6
    rn = (b + 0x7FFFF + ((b >> 20) & 1)) & -1048576
    f = b.to(tl.float32, bitcast=True) * 512.0  # exact; < 8 where subnormal
    i = f.to(tl.int32)
    frac = f - i.to(tl.float32)
    i = i + ((frac > 0.5) | ((frac == 0.5) & ((i & 1) == 1))).to(tl.int32)
    return normal, rn, i


@triton.jit
def fp8_round(v):
    """The E4M3 value nearest v (ties to even), as fp32 with v's sign (|v| <= 448)."""
    normal, rn, i = _fp8_parts(v)
    mag = tl.where(normal, rn.to(tl.float32, bitcast=True), i.to(tl.float32) * 0.001953125)
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    return (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def fp8_code(v):
    """The E4M3 (fn) byte of v as int32 0..255 (|v| <= 448; sign bit 7, also for -0.0)."""
    normal, rn, i = _fp8_parts(v)
    code = tl.where(normal, (rn >> 20) - 960, i)
    return code | ((v.to(tl.int32, bitcast=True) >> 24) & 0x80)


@triton.jit
def fp8_qdq_groups(x, R: tl.constexpr, C: tl.constexpr):
    """[R, C] fp32 (C % 32 == 0) -> quantise-dequantise through FP8 per 32 along C: the values
    of `quant.fp8_qdq` (exact)."""
    g = tl.reshape(x, (R, C // 32, 32))
    e = fp8_exponent(tl.max(tl.abs(g), axis=2))
    q = fp8_round(g * pow2(-e)[:, :, None]) * pow2(e)[:, :, None]
    return tl.reshape(q, (R, C))


@triton.jit
def e2m1_value(c):
    """E2M1 nibble (int32 0..15, sign in bit 3) -> fp32 value."""
    m = c & 7
    mf = m.to(tl.float32)
    mag = tl.where(m < 4, mf * 0.5, tl.where(m == 7, 6.0, mf - 2.0))
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def e4m3_byte(wd, j: tl.constexpr):
    """Byte j of int32 words of four E4M3 codes -> fp32 value (Triton's fp8 cast: the
    interpreters' decode; compiled kernels use the conversion PTX of their own)."""
    return ((wd >> (8 * j)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def load_weight_tile(w_ptr, s_ptr, rn, k0, N, K, s_stride,
                     BN: tl.constexpr, BK: tl.constexpr, W_KIND: tl.constexpr):
    """Rows `rn` [BN] x columns k0..k0+BK of a weight [N, K] as exact fp32 values (0 outside).

    W_KIND 0: a plain float weight [N, K]; 1: FP8 E4M3 [N, K] with E8M0 scales
    [ceil(N/32), s_stride] (32x32 blocks); 2: packed FP4 bytes [N, K/2] (element 2j in the low
    nibble) with E8M0 scales [N, s_stride] (32 along K). Scales are passed as uint8. BK % 32 == 0
    and k0 % 32 == 0 for the scaled kinds."""
    nmask = rn < N
    rn64 = rn.to(tl.int64)
    if W_KIND == 2:
        kh = k0 // 2 + tl.arange(0, BK // 2)
        byt = tl.load(w_ptr + rn64[:, None] * (K // 2) + kh[None, :],
                      mask=nmask[:, None] & (kh[None, :] < K // 2), other=0).to(tl.int32)
        w = tl.interleave(e2m1_value(byt & 15), e2m1_value((byt >> 4) & 15))
    else:
        kk = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + rn64[:, None] * K + kk[None, :], mask=nmask[:, None] & (kk[None, :] < K),
                    other=0.0).to(tl.float32)
    if W_KIND != 0:
        kb = k0 // 32 + tl.arange(0, BK // 32)
        if W_KIND == 1:
            srow = rn64 // 32
        else:
            srow = rn64
        s = tl.load(s_ptr + srow[:, None] * s_stride + kb[None, :], mask=nmask[:, None] & (kb[None, :] < s_stride),
                    other=0).to(tl.int32)
        w = tl.reshape(tl.reshape(w, (BN, BK // 32, 32)) * e8m0_value(s)[:, :, None], (BN, BK))
    return w


@triton.jit
def bf16_round(v):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32; integer ops only (the
    interpreter's fp32 -> bf16 cast truncates). Finite inputs."""
    b = v.to(tl.int32, bitcast=True)
    return ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def bf16_bits16(v):
    """fp32 -> bf16 (round to nearest even; the interpreter's cast truncates) as int16 bits."""
    b = v.to(tl.int32, bitcast=True)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16)


@triton.jit
def e2m1_fp16(c):
    """E2M1 nibble (int32 0..15) -> fp16 whose value is the E2M1 value times 2^-14, by placing the
    nibble's exponent and mantissa bits into fp16's (0.5 becomes the subnormal 2^-15): three
    integer ops, exact. The 2^14 goes into the block scale."""
    return (((c & 7) << 9) | ((c & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def scaled_block_step(acc, q_ptr, qs_ptr, arow, amask, w_ptr, s_ptr, rn, nmask, kc, k_hi, K, s_stride,
                      W_KIND: tl.constexpr, LOWP: tl.constexpr):
    """acc [BM, BN] + (one 32-wide K block kc..kc+31 of FP8 activations q [., K] with E8M0 scales
    qs [., K/32], rows `arow`) @ (the same block of a scaled weight, rows `rn`)^T.

    As MODEL.md's low-precision linear: the block's fp32 partial sum of the unscaled FP8 x FP8 (or
    FP8 x E2M1) products, times both power-of-two scales, added to the fp32 accumulator. The
    products are exact (fp16 operands on devices: E4M3 and E2M1 values are fp16-exact), so this
    equals the reference up to fp32 summation order. Nothing is scaled per element: the weight goes
    from its load straight into the dot (hardware fp8 -> fp16 conversion; FP4 by bit placement).
    Blocks at or past k_hi contribute 0."""
    kok = kc < k_hi
    am = amask & kok
    nm = nmask & kok
    blk = kc // 32
    sa = e8m0_value(tl.load(qs_ptr + arow * (K // 32) + blk, mask=am, other=0).to(tl.int32))
    rn64 = rn.to(tl.int64)
    if W_KIND == 1:
        cols = kc + tl.arange(0, 32)
        a = tl.load(q_ptr + arow[:, None] * K + cols[None, :], mask=am[:, None], other=0.0)
        w = tl.load(w_ptr + rn64[:, None] * K + cols[None, :], mask=nm[:, None], other=0.0)
        sw = e8m0_value(tl.load(s_ptr + (rn64 // 32) * s_stride + blk, mask=nm, other=0).to(tl.int32))
        if LOWP:
            part = tl.dot(a.to(tl.float16), tl.trans(w.to(tl.float16)))
        else:
            part = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    else:
        j = tl.arange(0, 16)
        cols = kc + tl.arange(0, 32)
        a = tl.load(q_ptr + arow[:, None] * K + cols[None, :], mask=am[:, None], other=0.0)
        ae, ao = tl.split(tl.reshape(a, (a.shape[0], 16, 2)))  # elements 2j and 2j + 1
        b = tl.load(w_ptr + rn64[:, None] * (K // 2) + kc // 2 + j[None, :], mask=nm[:, None], other=0).to(tl.int32)
        wlo = e2m1_fp16(b & 15)
        whi = e2m1_fp16((b >> 4) & 15)
        sw = e8m0_value(tl.load(s_ptr + rn64 * s_stride + blk, mask=nm, other=0).to(tl.int32)) * 16384.0
        if LOWP:
            part = tl.dot(ae.to(tl.float16), tl.trans(wlo)) + tl.dot(ao.to(tl.float16), tl.trans(whi))
        else:
            part = tl.dot(ae.to(tl.float32), tl.trans(wlo.to(tl.float32)), input_precision="ieee") \
                + tl.dot(ao.to(tl.float32), tl.trans(whi.to(tl.float32)), input_precision="ieee")
    return acc + part * sa[:, None] * sw[None, :]


# ---- GEMV-style helpers (decode: a few activation rows, no tensor cores) -----------------------
# At 1..4 activation rows a tile of weights is used by so few rows that the tensor cores buy
# nothing, while every per-32-block dot costs a trip through shared memory. These helpers keep the
# whole K block of a weight row inside one thread: the weight is dequantised to fp32 exactly, the
# products (exact in fp32: 4 x 2 or 4 x 4 significant bits) are summed per 32-wide scale block in
# registers, and the block sums take the weight's power-of-two scale. The activation arrives as
# its FP8 quantise-dequantise values (the power-of-two activation scale is inside them), so the
# result is the reference's sum(q_x * q_w) * s_x * s_w up to fp32 summation order.

# e2m1 bytes -> fp32 (value * 2^-14), 4 bytes per 32-bit register. An E2M1 nibble's fp16 bit
# pattern (e2m1_fp16) has a zero low byte and the high byte (sign << 7) | (magnitude << 1); the
# high bytes of all four low nibbles (l) and of all four high nibbles (h) are built with whole-
# register shifts and masks, prmt places them two by two into fp16x2 registers, and cvt widens.
_E2M1_ASM = tl.constexpr("""
{
.reg .b32 a, b, l, h, r;
.reg .b16 h0, h1;
shl.b32 a, $8, 1; and.b32 a, a, 0x0E0E0E0E; shl.b32 b, $8, 4; and.b32 b, b, 0x80808080; or.b32 l, a, b;
shr.b32 a, $8, 3; and.b32 a, a, 0x0E0E0E0E; and.b32 b, $8, 0x80808080; or.b32 h, a, b;
prmt.b32 r, l, 0, 0x1404; mov.b32 {h0, h1}, r; cvt.f32.f16 $0, h0; cvt.f32.f16 $1, h1;
prmt.b32 r, l, 0, 0x3424; mov.b32 {h0, h1}, r; cvt.f32.f16 $2, h0; cvt.f32.f16 $3, h1;
prmt.b32 r, h, 0, 0x1404; mov.b32 {h0, h1}, r; cvt.f32.f16 $4, h0; cvt.f32.f16 $5, h1;
prmt.b32 r, h, 0, 0x3424; mov.b32 {h0, h1}, r; cvt.f32.f16 $6, h0; cvt.f32.f16 $7, h1;
}
""")


@triton.jit
def e2m1_pairs_f32(b, ASM: tl.constexpr):
    """Packed FP4 bytes (uint8 tensor) -> (low-nibble values, high-nibble values) as fp32, each
    the E2M1 value times 2^-14 (exact). ASM: the packed PTX conversion (CUDA); else elementwise."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_E2M1_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [b],
                                           dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
    else:
        c = b.to(tl.int32)
        lo = e2m1_fp16(c & 15).to(tl.float32)
        hi = e2m1_fp16((c >> 4) & 15).to(tl.float32)
    return lo, hi


@triton.jit
def gemv_load_w(w_ptr, w_stride, s_ptr, s_stride, rn, nmask, k0, k_hi, W_KIND: tl.constexpr, BN: tl.constexpr,
                NB: tl.constexpr):
    """The raw weight tile of rows `rn` [BN] and K blocks k0 / 32 .. + NB (zero at or past k_hi) and
    its E8M0 scales as fp32 [BN, NB]: FP8 [BN, NB, 32] (W_KIND 1: 32x32 scale blocks) or packed
    FP4 bytes [BN, NB, 16] (W_KIND 2: a scale per row and block; times 2^14, see e2m1_pairs_f32).
    Loaded as 3-d tiles so that each thread holds whole blocks (the block sums stay in registers);
    w_stride: the weight's row stride in elements (bytes for FP4)."""
    rn64 = rn.to(tl.int64)
    kb = k0 // 32 + tl.arange(0, NB)
    bok = nmask[:, None] & (kb[None, :] * 32 < k_hi)
    if W_KIND == 1:
        j = tl.arange(0, 32)
        w = tl.load(w_ptr + rn64[:, None, None] * w_stride + kb[None, :, None] * 32 + j[None, None, :],
                    mask=bok[:, :, None], other=0.0)
        s = e8m0_value(tl.load(s_ptr + (rn64 // 32)[:, None] * s_stride + kb[None, :], mask=bok, other=0).to(tl.int32))
    else:
        j = tl.arange(0, 16)
        w = tl.load(w_ptr + rn64[:, None, None] * w_stride + kb[None, :, None] * 16 + j[None, None, :],
                    mask=bok[:, :, None], other=0)
        s = e8m0_value(tl.load(s_ptr + rn64[:, None] * s_stride + kb[None, :], mask=bok, other=0).to(tl.int32)) * 16384.0
    return w, s


@triton.jit
def gemv_acc(acc, w, s, x_ptr, rows, rmask, stride, k0, k_hi, W_KIND: tl.constexpr, RB: tl.constexpr,
             NB: tl.constexpr, ASM: tl.constexpr):
    """acc [RB, BN, NB] + for each activation row r (`rows` [RB], row stride `stride`; FP8-exact
    values) and each 32-wide K block k0 / 32 .. + NB (zero at or past k_hi): the sum of the exact
    products with the weight tile (w, s from gemv_load_w), times the weight scale. One row at a
    time, so every product stays in the weight tile's layout (each thread's blocks summed in its
    registers); FP4: a block's elements 2j and 2j + 1 meet the low and high nibbles of byte j."""
    if W_KIND == 1:
        wf = w.to(tl.float32)
    else:
        wlo, whi = e2m1_pairs_f32(w, ASM)
    kb = k0 // 32 + tl.arange(0, NB)
    ridx = tl.arange(0, RB)
    for r in tl.static_range(RB):
        row = tl.sum(tl.where(ridx == r, rows, 0), axis=0).to(tl.int64)
        ok = tl.sum(tl.where((ridx == r) & rmask, 1, 0), axis=0) > 0
        base = x_ptr + row * stride + kb[:, None] * 32
        m = ok & (kb[:, None] * 32 < k_hi)
        if W_KIND == 1:
            j = tl.arange(0, 32)
            xa = tl.load(base + j[None, :], mask=m, other=0.0).to(tl.float32)
            part = tl.sum(wf * xa[None, :, :], axis=2)
        else:
            j = tl.arange(0, 16)
            xe = tl.load(base + 2 * j[None, :], mask=m, other=0.0).to(tl.float32)
            xo = tl.load(base + 2 * j[None, :] + 1, mask=m, other=0.0).to(tl.float32)
            part = tl.sum(wlo * xe[None, :, :] + whi * xo[None, :, :], axis=2)
        if RB == 1:
            acc += (part * s)[None, :, :]
        else:
            acc += tl.where((ridx == r)[:, None, None], (part * s)[None, :, :], 0.0)
    return acc
