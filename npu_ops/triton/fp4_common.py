"""Shared @triton.jit helpers for the FP4 main-KV format (E2M1 + E4M3 scale per 16) and bf16
rounding, with integer/fp32 ops only (no fp8/bf16 arithmetic, no division); plus the exact
split-bf16 dot (`split_dot_acc`) and the offset width switch (`offsets`) other kernels share, and
the E2M1-word to bf16x2 bit placement (`e2m1_place`, `word_order`, `bf16x2_halves`) of the
routed experts and the indexer's keys.

The encoding is the one of `fp4_kv_store.py` (see its docstring for why every comparison is
exact and agrees with `quant.fp4_quant`), factored out so fused kernels can quantise rows they
computed themselves; `fp4_kv_store.py` keeps its own copy unchanged.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP4_GROUP = 16


@triton.jit
def as_cmp(x):
    """An integer vector as fp32, for a comparison inside a compute expression (`tl.where`):
    triton-ascend's performance guide says integer compares there run as scalar code on Atlas
    A2/A3, while fp32 compares vectorise. Exact for |x| <= 2^24; a sign test (x < 0) is exact for
    any value. Load / store masks stay integer (those vectorise)."""
    return x.to(tl.float32)


@triton.jit
def e4m3_value(c):
    """E4M3 (fn) code 0..127 (int32) -> fp32 value; 127 maps to 480 (only used as a bound)."""
    e = c >> 3
    m = c & 7
    p2 = ((tl.maximum(e, 1) - 10 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(max(e,1)-10)
    return ((e > 0).to(tl.int32) * 8 + m).to(tl.float32) * p2


@triton.jit
def fp4_scale_code(amax):
    """Group amax (fp32, >= 0) -> E4M3 code (int32 0..126) of min(max(amax, 6*2^-9) / 6, 448),
    rounded to nearest-even exactly as torch's fp32 -> float8_e4m3fn conversion of the quotient."""
    amax = tl.maximum(amax, 0.01171875)  # 6 * 2^-9
    # candidate code: truncate q ~ amax / 6 to the E4M3 grid
    q = amax * 0.16666666666666666
    qb = q.to(tl.int32, bitcast=True)
    qe = ((qb >> 23) & 0xFF) - 127
    c_norm = (qe + 7) * 8 + ((qb >> 20) & 7)
    c_sub = (tl.minimum(q, 1.0) * 512.0).to(tl.int32)  # below 2^-6: multiples of 2^-9
    c = tl.where(as_cmp(qe) >= -6.0, c_norm, c_sub)  # qe in [-127, 128]
    c = tl.minimum(tl.maximum(c, 0), 126)
    # exact fix-up: floor code of amax / 6 ...
    c = c + (amax >= 6.0 * e4m3_value(c + 1)).to(tl.int32) - (amax < 6.0 * e4m3_value(c)).to(tl.int32)
    # ... then round to nearest, ties to even, saturating at 448 (code 126)
    lo = e4m3_value(c)
    mid6 = 3.0 * (lo + e4m3_value(c + 1))
    up = (amax > mid6) | ((amax == mid6) & ((c & 1) == 1))
    return tl.minimum(c + up.to(tl.int32), 126)


@triton.jit
def e2m1_code(x, s):
    """E2M1 nibble (int32 0..15, sign in bit 3) of x / s for fp32 x and an E4M3 scale value s
    (broadcastable), round to nearest, ties to the even code, saturating at 6."""
    a = tl.abs(x)
    return (a > 0.25 * s).to(tl.int32) + (a >= 0.75 * s).to(tl.int32) + (a > 1.25 * s).to(tl.int32) \
        + (a >= 1.75 * s).to(tl.int32) + (a > 2.5 * s).to(tl.int32) + (a >= 3.5 * s).to(tl.int32) \
        + (a > 5.0 * s).to(tl.int32) + (x < 0).to(tl.int32) * 8


@triton.jit
def bf16_rne_bits(x):
    """fp32 -> its bf16 rounding (nearest-even, as torch's .to(bfloat16)) as int32 bits with the
    low 16 bits cleared: `.to(tl.float32, bitcast=True)` gives the value, `>> 16` the bf16 bits.
    Finite inputs (NaN is out of contract)."""
    b = x.to(tl.int32, bitcast=True)
    return (b + 0x7FFF + ((b >> 16) & 1)) & -65536


@triton.jit
def byte_to_int8(v):
    """int32 byte values 0..255 -> the int8 with the same bits (-128..127), by arithmetic, so the
    narrowing cast never overflows: byte data is stored through int8 pointers because
    triton-ascend marks uint8 pointer stores unsupported on Atlas A2/A3."""
    return (v - ((v & 0x80) << 1)).to(tl.int8)


@triton.jit
def offsets(i, WIDE: tl.constexpr):
    """Index vector i as the offset type: int64 only when the launcher saw a tensor of 2^31 or
    more elements (`launch.needs_int64`); int32 otherwise (triton-ascend runs int64 vector
    arithmetic as scalar code)."""
    if WIDE:
        return i.to(tl.int64)
    else:
        return i.to(tl.int32)


@triton.jit
def split_dot_acc(acc, a, w, TERMS: tl.constexpr, LOWP: tl.constexpr):
    """acc + a [M, K] @ w [K, N] with exact products: on devices (LOWP) bf16 tensor-core dots,
    a split into TERMS bf16 parts (hi + mid + lo; w must be bf16-exact); under the interpreter
    one fp32 "ieee" dot."""
    if LOWP:
        wb = w.to(tl.bfloat16)
        hi = a.to(tl.bfloat16)
        acc = tl.dot(hi, wb, acc)
        if TERMS > 1:
            r = a - hi.to(tl.float32)
            mid = r.to(tl.bfloat16)
            acc = tl.dot(mid, wb, acc)
            if TERMS > 2:
                acc = tl.dot((r - mid.to(tl.float32)).to(tl.bfloat16), wb, acc)
    else:
        acc = tl.dot(a, w, acc, input_precision="ieee")
    return acc


# E2M1 words -> bf16x2 registers by bit placement, shared by the routed experts' `moe_fold` and
# the indexer's word decode (`indexer_topk._decode_key_words`)
_KEEP2 = tl.constexpr(-2118090304)  # 0x81C081C0: both halves' sign bit and bf16 bits 8..6, as an int32 literal


@triton.jit
def word_order(i):
    """The activation column to load at tile column i of a tile built by `moe_fold.fp4_tile_bf16`:
    the word's base (i - i % 8) plus element v + 4h of the word, where position p = i % 8 holds
    p = (v & 1) * 4 + (v >> 1) * 2 + h (h innermost: a bf16x2 register's two halves stay side
    by side, so nothing is repacked between the conversion and the dot)."""
    p = i % 8
    return i - p + ((p >> 1) & 1) * 2 + ((p >> 2) & 1) + (p & 1) * 4


@triton.jit
def e2m1_place(q, lo: tl.constexpr):
    """The bf16x2 bits of the nibbles at bits lo..lo + 3 and lo + 16..lo + 19 of q (lo 0 or 4):
    sign to bit 15 / 31, the three magnitude bits to 8..6 / 24..22 (value * 2^-126). One
    multiply makes both shifts at once (sign: 12 - lo, magnitude: 6 - lo; the two copies of a
    nibble land in bits 6..9 and 12..15 of its half, apart), then one mask keeps the bits wanted:
    3 integer ops a register."""
    if lo == 0:
        return ((q & 0x000F000F) * 0x1040) & _KEEP2
    else:
        return ((q & 0x00F000F0) * 0x0104) & _KEEP2


@triton.jit
def bf16x2_halves(r, LOWP: tl.constexpr):
    """bf16x2 bits -> [..., 2] (low half, high half) as bf16 (LOWP) or their exact fp32 values."""
    if LOWP:
        lo = r.to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = (r >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        lo = (r << 16).to(tl.float32, bitcast=True)
        hi = (r & -65536).to(tl.float32, bitcast=True)
    return tl.join(lo, hi)
