"""FP4 routed experts at decode sizes (1..64 tokens) on tensor cores, the weight read as int32
words (or bytes: `byte_tiles`) and turned into bf16 with a few integer ops per value (the
`moe_experts` path "fold").

Per call, with R = T * k routed rows (token t, slot j -> flat row t * k + j):
1. `moe_grouped.sort_rows` orders the flat rows by expert (one launch, no host sync), and x is
   FP8-quantise-dequantised once (exact bf16 values, the activation scale inside them)
   (`_x_qdq_kernel`, columns stored in the weight tiles' K order),
2. `_fold_up_kernel`, one program per (expert, BN columns of the intermediate width): for each
   of its expert's RB-row tiles, w1 and w3 tiles [BN, BK] built from int32 words (8 E2M1 values
   each) with the E8M0 block scale folded in (`fp4_words_bf16`), each used in ONE bf16
   tensor-core dot per BK with the gathered x rows (weight on the dot's wide side: acc [BN, RB],
   so 1..16 rows cost one 16-wide MMA), fp32 accumulation. Epilogue: clamped SwiGLU, routing
   weight, FP8 quantise-dequantise of the w2 input per 32 columns, stored as bf16 rows in expert
   order (columns in the tiles' K order).
3. `_fold_down_kernel`, one program per (expert, BN columns of d): the same with w2 and h, fp32
   output rows written to their flat rows; `moe_experts._combine_kernel` sums a token's slots.
Every expert's weights are read once per RB-row tile of its rows (`TILES`: RB up to 32 or 64);
with `slots` an expert's row tiles go to as many programs side by side (grid dimension 2), so a
popular expert's tiles run in parallel (each slot reads the expert's weights; empty slots return at once).

The conversion (`fp4_words_bf16`, after Marlin's FP4 -> bf16 dequantisation): a word's nibble
(sign, e1, e0, m) placed as the bf16 bits (sign -> bit 15, e1 e0 m -> bits 8..6) is the E2M1
value times 2^-126 (code 1, the value 0.5, becomes the subnormal 2^-127); one bf16x2 multiply by
2^(byte - 1) per two values then gives value * 2^(byte - 127). The placement of two nibbles 16
bits apart is a mask, one integer multiply that makes the sign's and the magnitude's shifts at
once, and a mask (`e2m1_place`; 3 integer ops per two values instead of 5). The four bit placements
of a word take elements (v, v + 4) for v = 0..3 into one bf16x2 register, so the tile's K order
inside each group of 8 is permuted (`word_order`); x and h are stored in that order, and a dot
does not care about the order of K.

Byte tiles (`fold_moe(..., byte_tiles=True)`; the CUDA default at 17..64 tokens, where the
H200 measured them faster: T=64 379.9 -> 307.4 us, but slower at 1 / 8 / 16 tokens: 99.7 ->
109.3, 233.6 -> 241.8, 237.1 -> 249.1 us; 2026-12-01, graph replay, mini widths; T=17..63 take
it unmeasured): the same exact bf16 values built from the
weight's bytes (`fp4_bytes_bf16`: 4 bytes per inline-PTX call, the scale multiply inside). The
bytes are reordered inside each 16 (`_fragment_bytes`) so that one thread's wgmma A-operand
registers of a 16-wide K step are 4 consecutive bytes; the compiler then loads them from the
pipelined shared-memory buffer straight into the operand layout. With words, the converted tile
makes a round trip through shared memory (STS, barrier, LDSM) every K step. Local sm_90a SASS of
the gate/up K step, 32-row tile: 564 instructions instead of 591, no STS / LDSM / barrier,
234 registers without spills (words: 255 + 16 bytes of stack); benchmarks/RESULTS.md, "FP4
experts at decode sizes: FP8 dots". With the one-multiply placement (session twenty-eight) the
K step is 503 instructions at the 168-register cap (567 before), the down kernel's 289 (322).
K order `byte_order` per BK tile (x and h stored in it).

Numerics: every dot operand is an exact bf16 value, every product exact in fp32, only the fp32
summation order differs from the reference (the class of the other MoE kernels); the w1 / w3 sums, the weighted SwiGLU product and each expert's
output are then rounded to bf16 where the official expert rounds (`swiglu.expert_act`; the
reference's official mode, which the tests compare with):
- x: FP8 codes times 2^e, e >= -22 (`block_scaled.fp8_exponent`): bf16-normal, never rounded.
- weights: two significant bits times 2^(byte - 127): exact in bf16 whenever the result is
  normal (>= 2^-126). The factor 2^(byte - 1) must be a finite bf16, so scale bytes 1..128
  (|weights| <= 12) take this path; `moe_experts` checks the bytes once per set of experts and
  keeps the other kernels otherwise. Byte 0 (2^-127) gives 0 here as in the other kernels.
  Checked bit-exactly against the reference dequantisation for all 16 codes x bytes 1..128
  (tests/test_triton_moe_fold.py); on CUDA the multiply is one `mul.rn.bf16x2` (inline PTX, as
  sm_90 bf16 arithmetic keeps subnormal inputs), elsewhere the same product in fp32.
- Under TRITON_INTERPRET=1 (no bf16 arithmetic there) the same values go through fp32 "ieee"
  dots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_start
from .block_scaled import bf16_round, e2m1_value, e8m0_value, fp8_qdq_groups, pow2
from .fp4_common import bf16x2_halves, e2m1_place, word_order
from .swiglu import expert_act

# Tiles by token count, (most tokens, tiles): BN weight rows per program (gate/up, down), BK along
# K, the gate/up K slices (`split`), the dot orientation (`w_left`: weight as the left operand),
# the largest row tile (`rb_max`; the row tile RB is the next power of two >= T in 16..rb_max). The
# CUDA rows are the best measured on the H200 (benchmarks/RESULTS.md, "MoE at decode sizes").
# H200 2026-12-01 02:03 UTC, graph replay, T=1 / 2 / 4 / 8 / 16: split 1 98.8 / 180.9 / 187.9 /
# 247.5 / 244.9 us, split 2 101.9 / 158.8 / 189.7 / 237.3 / 237.6, split 4 104.9 / 166.9 / 183.2 /
# 234.7 / 234.0 (T=3 takes T=2's row unmeasured); w_left=False and 8 warps were slower at every T.
# H200 2026-12-01 04:57 UTC, T=64: RB 32 378.1 us against RB 64 448.6 (the 64-row gate/up tile
# spills registers; an expert with more than 32 rows loops over row tiles); T=33..63 take it
# unmeasured. Slower at T = 1 / 8 / 64 (the defaults then: 95.6 / 221.4 / 448.6 us): 2, 4, 5 or 6
# pipeline stages (e.g. 4: 124.7 / 296.7 / 468.8), and w1's K loop before w3's (fewer registers:
# 107.0 / 245.3 / 460.3 at 4 stages). H200 2026-12-01 14:25 UTC: byte tiles at T=64 307.4 us
# against 379.9 (words), at 4 stages 347.1, RB 64 402.8; slower at T = 1 / 8 / 16 (above).
# H200 2026-12-04 (session twenty-seven), T=64, graph replay, byte tiles: the gate/up kernel capped
# at 168 registers (`maxnreg`: 3 programs an SM instead of 2; no spill inside the K loop) and an
# expert's row tiles dealt to ceil(T / RB) programs (`slots`: an expert with more than 32 rows no
# longer runs its tiles one after the other): uniform routing (16-29 rows an expert) 302 -> 267
# us, the skewed routing the mini model's decode batches produce (up to 46-51 rows) 397 -> 301 us,
# outputs bit-equal. Slower: maxnreg 128 (283), 2 or 4 stages with the cap (298 / 307), RB 16 in
# 4 slots (377-393), the gate/up K split in 2 (+ its epilogue kernel: 271-334), 8-warp or 4-stage
# down kernels; on the skewed routing (290 us then): maxnreg 160 the same, 176 (2 programs an SM)
# 334, BK 256 338, RB 64 without slots 391, 8 warps x BN 128 446, a cap or 2 stages on the down
# kernel 295-304. T=33 (`sweep_kernels.py --only moe_slots`): 297 -> 256 us uniform, 363 -> 277 with
# an expert routed every token; T=17..32 (one row tile: the cap alone) unmeasured. Nsight
# Compute (T=64): gate/up issues an instruction every 2.2 cycles per scheduler (2.6 warps each),
# DRAM at 22%: bound by the conversion's instructions and their latency, not by bytes.
# H200 2026-12-04 (session twenty-eight), the one-multiply placement (`e2m1_place`, 11% fewer
# instructions a K step): T=64 267.5 -> 261.2 us uniform, 286.7 -> 281.2 / 289.1 -> 283.6 skewed;
# T=33 257.1 -> 251.8, 275.3 -> 270.6 (`sweep_kernels.py --only moe_slots`, two calls); the
# batch-64 decode step 4.87-4.89 -> 4.78-4.79 ms with the two-pass logits cap (benchmarks/RESULTS.md).
# H100 2026-12-05 (session thirty-four): 64-wide K steps in both kernels at 17..64 tokens (byte tiles;
# 151 registers without spills against 168 + 140 bytes of stack) were 1-3% faster alone (graph replay of
# the op, `moe_slots` routings: T=64 sigma 0.5 291.3 -> 283.9 us, sigma 1 294.9 -> 288.7, uniform equal)
# but SLOWER in the decode step: batch 64 at 4K 5.015 / 5.038 ms (these tiles) against 5.305 / 5.302
# (alternated processes, one machine). A 128-register cap (4 programs an SM) or 4 stages with them was
# slower alone too (268-329 us). Not kept; the change is in benchmarks/RESULTS.md's session thirty-four.
# The byte tiles' scale bytes loaded a K step ahead (`scale_bytes`, the kernels' AHEAD): in the down
# kernel always, in the gate/up kernel with at most AHEAD_UP_MAX_SLOTS row-tile slots (T <= 64). H100
# 2026-12-06 (session forty): the op alone (`sweep_kernels.py --only moe_slots`, graph us, both
# kernels ahead against neither) T=33 uniform / sigma 0.5 / sigma 1 263.6 / 267.5 / 280.7 -> 231.8 /
# 227.2 / 238.4, T=64 270.9 / 290.2 / 294.0 -> 239.7 / 250.0 / 253.8; the mini decode step at 4K
# (graph ms, processes alternated) batch 32 3.946 / 3.957 -> 3.717 / 3.729 with both. At batch 64 (two
# slots) the gate/up kernel ahead measured slower in the step than alone: 4.795 / 4.790 neither, 4.803
# / 4.811 both, 4.896 the gate/up kernel alone ahead, 4.717 the down kernel alone ahead (its six
# launches 99-197 us against 149-178; the gate/up ones 173-259 against 203-235, so some layers gained
# and others lost; the ahead form spills 172 bytes at the 168-register cap against 140), so it stayed
# at one slot. Session forty-one found where the loss was: the shared expert on the second stream.
# With everything on one stream the gate/up kernel ahead won at batch 64 (4.649 against 4.862 ms), and
# with the shared expert beside it lost (4.869 against 4.842; presumably the two share the SMs, and
# the faster gate/up kernel leaves the shared expert less to hide behind). So the CUDA platform runs
# the shared expert beside the routed ones only up to 32 tokens (`CudaPlatform.overlap_shared_tokens`)
# and the gate/up kernel takes its scales ahead at two slots as well: the step at 4K 4.19 / 4.33 /
# 4.35 / 4.62 / 4.75 -> 4.05 / 4.15 / 4.23 / 4.44 / 4.57 ms at batch 33 / 40 / 48 / 56 / 64 (H100,
# alternated processes).
AHEAD_UP_MAX_SLOTS = 2
_DECODE = {"bn_up": 64, "bn_down": 64, "bk": 128, "num_warps": 4, "num_stages": 3, "split": 1, "w_left": True,
           "rb_max": 64}
TILES = {"cuda": [(1, _DECODE), (3, dict(_DECODE, split=2)), (16, dict(_DECODE, split=4)),
                  (64, dict(_DECODE, rb_max=32, byte_tiles=True, maxnreg=168, slots=True))],
         "interp": [(1 << 30, {"bn_up": 32, "bn_down": 32, "bk": 128, "split": 1, "w_left": True})]}
MAX_SCALE_BYTE = 128  # the largest E8M0 weight scale byte the folded conversion takes (module docstring)


@triton.jit
def _scale2(placed, f2, s, ASM: tl.constexpr):
    """placed (bf16x2 bits) times 2^(s - 1) in both halves (f2: that factor as bf16x2 bits)."""
    if ASM:
        return tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [placed, f2], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        f = pow2(s - 1)
        lo = ((placed << 16).to(tl.float32, bitcast=True) * f).to(tl.int32, bitcast=True)
        hi = ((placed & -65536).to(tl.float32, bitcast=True) * f).to(tl.int32, bitcast=True)
        return ((lo >> 16) & 0xFFFF) | (hi & -65536)


@triton.jit
def fp4_words_bf16(words, s, ASM: tl.constexpr):
    """int32 words (8 E2M1 nibbles each, element i in bits 4i..4i+3) and their E8M0 scale bytes
    (int32 1..128, same shape) -> four int32 tensors of bf16x2 bits, the v-th holding elements v
    (low half) and v + 4 (high half) of each word as value * 2^(s - 127) (exact: module docstring)."""
    e = (s + 126) << 7  # 2^(s - 1) as bf16 bits
    f2 = e | (e << 16)
    high = words >> 8  # elements 2, 3, 6, 7 at the places of 0, 1, 4, 5
    r0 = _scale2(e2m1_place(words, 0), f2, s, ASM)
    r1 = _scale2(e2m1_place(words, 4), f2, s, ASM)
    r2 = _scale2(e2m1_place(high, 0), f2, s, ASM)
    r3 = _scale2(e2m1_place(high, 4), f2, s, ASM)
    return r0, r1, r2, r3


@triton.jit
def fp4_tile_bf16(w_ptr, s_ptr, rn, kw0, s_stride, w_stride, BN: tl.constexpr, BK: tl.constexpr,
                  ASM: tl.constexpr, LOWP: tl.constexpr):
    """Weight rows `rn` [BN], K columns 8 * kw0 .. + BK of a packed FP4 matrix (int32 words, row
    stride w_stride words; E8M0 scales read as int32 words of 4 bytes, row stride s_stride
    words) -> [BN, BK] exact bf16 (LOWP) or fp32 values with the scale folded in, K permuted
    inside each 8 as `word_order`. No masks: the launcher guarantees whole tiles (BK % 128 == 0,
    so a tile's scales are whole int32 words: 4-byte loads the pipeliner can issue ahead)."""
    W: tl.constexpr = BK // 8
    rn64 = rn.to(tl.int64)
    words = tl.load(w_ptr + rn64[:, None] * w_stride + kw0 + tl.arange(0, W)[None, :])
    sw = tl.load(s_ptr + rn64[:, None] * s_stride + kw0 // 16 + tl.arange(0, BK // 128)[None, :])
    sw = tl.reshape(tl.broadcast_to(sw[:, :, None], (BN, BK // 128, 16)), (BN, W))
    j = tl.arange(0, W)[None, :]
    s = (sw >> (((j % 16) // 4) * 8)) & 0xFF  # word j's block: byte (j % 16) // 4 of its scale word
    r0, r1, r2, r3 = fp4_words_bf16(words, s, ASM)
    return tl.reshape(bf16x2_halves(tl.join(tl.join(r0, r1), tl.join(r2, r3)), LOWP), (BN, BK))


# E2M1 bytes -> bf16 with the scale folded in, 4 bytes ($4) per call: prmt orders the bytes 0, 2,
# 1, 3, so byte 0's and byte 1's nibbles lie 16 bits apart, and bytes 2 and 3's after a shift by 8;
# each pair goes into one bf16x2 register as `e2m1_place` does (mask, one multiply for both shifts,
# mask: sign to bit 15, the three magnitude bits to 8..6 of its half: the value times 2^-126), and
# one mul.rn.bf16x2 by the halves' factors 2^(s - 1) ($5: elements 0, 1; $6: elements 2, 3) scales
# them. Out: $0, $1 the four low nibbles' values, $2, $3 the four high nibbles'. 18 instructions
# for 8 values (26 with separate shifts for the sign and the magnitude). The factors stay one per
# element: which 4 bytes a call gets is the compiler's layout (on sm_90 two bytes of one row and
# two of a row 8 below), so a call cannot assume one scale block.
_E2M1_BF16X4_ASM = tl.constexpr("""{
.reg .b32 w, v, a;
prmt.b32 w, $4, 0, 0x3120; shr.b32 v, w, 8;
and.b32 a, w, 0x000F000F; mul.lo.u32 a, a, 0x1040; and.b32 a, a, 0x81C081C0; mul.rn.bf16x2 $0, a, $5;
and.b32 a, v, 0x000F000F; mul.lo.u32 a, a, 0x1040; and.b32 a, a, 0x81C081C0; mul.rn.bf16x2 $1, a, $6;
and.b32 a, w, 0x00F000F0; mul.lo.u32 a, a, 0x0104; and.b32 a, a, 0x81C081C0; mul.rn.bf16x2 $2, a, $5;
and.b32 a, v, 0x00F000F0; mul.lo.u32 a, a, 0x0104; and.b32 a, a, 0x81C081C0; mul.rn.bf16x2 $3, a, $6;
}""")


@triton.jit
def byte_order(i, BK: tl.constexpr):
    """The activation column to load at tile column i of a tile built by `fp4_bytes_bf16`: inside
    each BK-wide tile, the low nibbles of its BK / 2 bytes, then their high nibbles, each half in
    the byte order of `_fragment_bytes` (tile column 16a + 8h + 2c + i of a half <- byte
    16a + 4c + 2h + i); `byte_position` is the inverse."""
    p = i % BK
    q = p % (BK // 2)
    j = q - q % 16 + ((q // 2) % 4) * 4 + ((q // 8) % 2) * 2 + q % 2
    return i - p + 2 * j + p // (BK // 2)


@triton.jit
def byte_position(c, BK: tl.constexpr):
    """The tile column of natural column c (the inverse of `byte_order`)."""
    p = c % BK
    j = p // 2
    r = j % 16
    return c - p + (p % 2) * (BK // 2) + j - r + ((r // 2) % 2) * 8 + (r // 4) * 2 + r % 2


@triton.jit
def _fragment_bytes(b, BN: tl.constexpr, C: tl.constexpr):
    """Bytes [BN, C] reordered inside each 16 (one scale block) so that the 4 bytes behind one
    thread's bf16 wgmma A-operand registers of a 16-wide K step (columns 2c, 2c + 1, 2c + 8,
    2c + 9) are 4 consecutive loaded bytes 4c .. 4c + 3 (one 32-bit shared-memory load, no byte
    repacking): column 16a + 8h + 2c + i <- byte 16a + 4c + 2h + i."""
    return tl.reshape(tl.permute(tl.reshape(b, (BN, C // 16, 4, 2, 2)), (0, 1, 3, 2, 4)), (BN, C))


@triton.jit
def scale_bytes(s_ptr, rn, k0, s_stride, BN: tl.constexpr, BK: tl.constexpr, BYTES: tl.constexpr):
    """The E8M0 scale bytes [BN, BK / 32] (int32) of weight rows rn, K columns k0 .. k0 + BK, for
    `fp4_bytes_bf16` (s_ptr: int32 word pointer, row stride s_stride bytes); 0 for the word tiles
    (`fp4_tile_bf16` loads its scale words itself). The kernels load a K step's scale bytes one
    step ahead: the compiler's pipeline takes the 2-byte loads of [BN, 4] bytes into no stage,
    so loaded in the step that used them they stalled it on their round trip (Nsight Compute,
    H100, the gate/up kernel at 64 tokens: 39% of its stall cycles waiting on L1TEX, the weight
    and x tiles being in shared memory stages ahead)."""
    if BYTES:
        return tl.load(s_ptr.to(tl.pointer_type(tl.uint8)) + rn.to(tl.int64)[:, None] * s_stride + k0 // 32
                       + tl.arange(0, BK // 32)[None, :]).to(tl.int32)
    else:
        return 0


@triton.jit
def fp4_bytes_bf16(w_ptr, sb, rn64, k0, w_stride, BN: tl.constexpr, BK: tl.constexpr,
                   ASM: tl.constexpr, LOWP: tl.constexpr):
    """Weight rows rn [BN], K columns k0 .. k0 + BK of a packed FP4 matrix (bytes, row stride
    w_stride) with its E8M0 scale bytes sb [BN, BK / 32] (`scale_bytes`) -> [BN, BK] exact bf16
    (LOWP) or fp32 values with the scale folded in, K in `byte_order`. The weight is loaded as
    bytes (not words), so the compiler can give each thread the bytes of its own dot-operand
    fragment and the tile never goes through shared memory after its load. No masks (whole
    tiles: the launcher checks)."""
    b = _fragment_bytes(tl.load(w_ptr + rn64[:, None] * w_stride + k0 // 2 + tl.arange(0, BK // 2)[None, :]), BN,
                        BK // 2)
    if ASM:
        f = (((sb + 126) << 7).to(tl.int16)).to(tl.bfloat16, bitcast=True)  # 2^(s - 1)
        f = tl.reshape(tl.broadcast_to(f[:, :, None], (BN, BK // 32, 16)), (BN, BK // 2))
        lo, hi = tl.inline_asm_elementwise(_E2M1_BF16X4_ASM, "=r,=r,=r,=r,r,r,r", [b, f],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        f = tl.reshape(tl.broadcast_to(e8m0_value(sb)[:, :, None], (BN, BK // 32, 16)), (BN, BK // 2))
        c = b.to(tl.int32)
        lo = e2m1_value(c & 15) * f
        hi = e2m1_value((c >> 4) & 15) * f
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BN, BK))


@triton.jit
def _tile(w_ptr, s_ptr, sb, rn, k0, s_stride, K, BN: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr,
          LOWP: tl.constexpr, BYTES: tl.constexpr):
    """Weight rows rn, K columns k0 .. k0 + BK of expert matrix w_ptr (int32 words; scales s_ptr as
    int32 words of 4 bytes, row stride s_stride bytes; K columns a row) with the scale folded in:
    from words (`fp4_tile_bf16`, `word_order`) or, BYTES, from bytes (`fp4_bytes_bf16`,
    `byte_order`) with this step's scale bytes sb (`scale_bytes`, loaded a step ahead)."""
    if BYTES:
        w = fp4_bytes_bf16(w_ptr.to(tl.pointer_type(tl.uint8)), sb, rn.to(tl.int64), k0, K // 2, BN, BK, ASM, LOWP)
    else:
        w = fp4_tile_bf16(w_ptr, s_ptr, rn, k0 // 8, s_stride // 4, K // 8, BN, BK, ASM, LOWP)
    return w


@triton.jit
def _expert_ptrs(w_base, s_base, table_ptr, e, which: tl.constexpr, ALIGN: tl.constexpr):
    """Expert e's matrix `which` (0: w1, 1: w3, 2: w2) and its scales as int32 word pointers
    (table: byte offsets from the bases, `moe_experts._expert_table`)."""
    w = (w_base + tl.multiple_of(tl.load(table_ptr + e * 6 + which), ALIGN)).to(tl.pointer_type(tl.int32))
    s = (s_base + tl.multiple_of(tl.load(table_ptr + e * 6 + 3 + which), ALIGN)).to(tl.pointer_type(tl.int32))
    return w, s


@triton.jit
def _acc0(BN: tl.constexpr, RB: tl.constexpr, W_LEFT: tl.constexpr):
    """A zero accumulator: [BN, RB] with the weight as the dot's left operand, else [RB, BN]."""
    if W_LEFT:
        return tl.zeros((BN, RB), dtype=tl.float32)
    else:
        return tl.zeros((RB, BN), dtype=tl.float32)


@triton.jit
def _wdot(acc, w, xk, W_LEFT: tl.constexpr, LOWP: tl.constexpr):
    """acc + the weight tile w [BN, BK] times the activation tile xk [BK, RB]: W_LEFT keeps the
    weight as the left operand (on Hopper its bf16 tile is the wgmma A operand from registers),
    else x^T @ w^T (both operands from shared memory). The interpreter: fp32 "ieee" dots."""
    if not LOWP:
        xk = xk.to(tl.float32)
    if W_LEFT:
        if LOWP:
            return tl.dot(w, xk, acc)
        else:
            return tl.dot(w, xk, acc, input_precision="ieee")
    else:
        if LOWP:
            return tl.dot(tl.trans(xk), tl.trans(w), acc)
        else:
            return tl.dot(tl.trans(xk), tl.trans(w), acc, input_precision="ieee")


@triton.jit
def _rows_first(acc, W_LEFT: tl.constexpr):
    """The accumulator as [RB, BN]."""
    if W_LEFT:
        return tl.trans(acc)
    else:
        return acc


@triton.jit
def _act_store(g, u, p, pmask, wts_ptr, f, h_ptr, I, rn, limit, RB: tl.constexpr, BN: tl.constexpr,
               BYTES: tl.constexpr, BK_DOWN: tl.constexpr):
    """The gate/up epilogue of rows p [RB] (flat rows f), columns rn [BN]: clamped SwiGLU of the
    fp32 sums g, u [RB, BN], routing weight, FP8 quantise-dequantise per 32 columns (BN % 32 ==
    0: whole groups), stored in the word order of the w2 tiles (the down kernel's loads are then
    contiguous; BYTES: the `byte_order` of BK_DOWN-wide tiles)."""
    h = expert_act(g, u, tl.load(wts_ptr + f, mask=pmask, other=0.0)[:, None], limit)
    h = fp8_qdq_groups(h, RB, BN)
    if BYTES:
        cols = byte_position(rn, BK_DOWN)
    else:
        cols = word_order(rn)
    tl.store(h_ptr + p.to(tl.int64)[:, None] * I + cols[None, :], h, mask=pmask[:, None])


@triton.jit
def _fold_up_kernel(x_ptr, perm_ptr, bounds_ptr, wts_ptr, w_base, s_base, table_ptr, h_ptr, part_ptr, R, K, I,
                    s_stride, limit, TOPK: tl.constexpr, ALIGN: tl.constexpr, ASM: tl.constexpr,
                    LOWP: tl.constexpr, RB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                    W_LEFT: tl.constexpr, BYTES: tl.constexpr = False, BK_DOWN: tl.constexpr = 128,
                    SLOTS: tl.constexpr = 1, AHEAD: tl.constexpr = True, PDL: tl.constexpr = 0):
    """h[p, n] for the expert-ordered rows p of expert program_id(0), columns of tile
    program_id(1); with SPLIT > 1, K slice program_id(2) // SLOTS's partial sums of gate and up
    to part [SPLIT, R, 2, I] instead (`_fold_act_kernel` adds them up). The expert's RB-row
    tiles are dealt to SLOTS programs (slot program_id(2) % SLOTS takes tiles slot, slot +
    SLOTS, ...), so an expert with more rows than one tile runs its tiles side by side. AHEAD:
    byte tiles take their scale bytes a K step ahead (`scale_bytes`), else in the step that uses
    them (the launcher's rule: AHEAD_UP_MAX_SLOTS)."""
    pdl_start(PDL)
    e = tl.program_id(0)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    start = tl.load(bounds_ptr + e)
    end = tl.load(bounds_ptr + e + 1)
    w1, s1 = _expert_ptrs(w_base, s_base, table_ptr, e, 0, ALIGN)
    w3, s3 = _expert_ptrs(w_base, s_base, table_ptr, e, 1, ALIGN)
    kk = tl.arange(0, BK)
    k_lo = tl.multiple_of((tl.program_id(2) // SLOTS) * (K // SPLIT), BK)  # the launcher checks K % (SPLIT * BK) == 0
    for p0 in range(start + (tl.program_id(2) % SLOTS) * RB, end, RB * SLOTS):
        p = p0 + tl.arange(0, RB)
        pmask = p < end
        f = tl.load(perm_ptr + p, mask=pmask, other=0).to(tl.int64)
        tok = f // TOPK
        acc1 = _acc0(BN, RB, W_LEFT)
        acc3 = _acc0(BN, RB, W_LEFT)
        sb1 = scale_bytes(s1, rn, k_lo, s_stride, BN, BK, BYTES)
        sb3 = scale_bytes(s3, rn, k_lo, s_stride, BN, BK, BYTES)
        for kr in range(0, K // SPLIT, BK):
            k0 = tl.multiple_of(k_lo + kr, BK)
            # the next step's scale bytes (the last step reloads its own), or without AHEAD this one's
            k_next = tl.multiple_of(tl.minimum(k0 + BK, k_lo + K // SPLIT - BK), BK) if AHEAD else k0
            sn1 = scale_bytes(s1, rn, k_next, s_stride, BN, BK, BYTES)
            sn3 = scale_bytes(s3, rn, k_next, s_stride, BN, BK, BYTES)
            xt = tl.load(x_ptr + tok[None, :] * K + (k0 + kk)[:, None], mask=pmask[None, :], other=0.0)
            if not AHEAD:
                sb1, sb3 = sn1, sn3
            acc1 = _wdot(acc1, _tile(w1, s1, sb1, rn, k0, s_stride, K, BN, BK, ASM, LOWP, BYTES), xt, W_LEFT, LOWP)
            acc3 = _wdot(acc3, _tile(w3, s3, sb3, rn, k0, s_stride, K, BN, BK, ASM, LOWP, BYTES), xt, W_LEFT, LOWP)
            sb1, sb3 = sn1, sn3
        g = _rows_first(acc1, W_LEFT)
        u = _rows_first(acc3, W_LEFT)
        if SPLIT == 1:
            _act_store(g, u, p, pmask, wts_ptr, f, h_ptr, I, rn, limit, RB, BN, BYTES, BK_DOWN)
        else:
            base = part_ptr + (((tl.program_id(2) // SLOTS) * R + p.to(tl.int64)[:, None]) * 2) * I + rn[None, :]
            tl.store(base, g, mask=pmask[:, None])
            tl.store(base + I, u, mask=pmask[:, None])


@triton.jit
def _fold_act_kernel(part_ptr, perm_ptr, bounds_ptr, wts_ptr, h_ptr, R, I, E, limit, SPLIT: tl.constexpr,
                     RB: tl.constexpr, BN: tl.constexpr, BYTES: tl.constexpr = False, BK_DOWN: tl.constexpr = 128, PDL: tl.constexpr = 0):
    """The split gate/up's epilogue: rows p of block program_id(0) (those below bounds[E], the
    routed rows), columns of tile program_id(1): gate and up summed over the K slices in slice
    order (deterministic), then `_act_store`."""
    pdl_start(PDL)
    p = tl.program_id(0) * RB + tl.arange(0, RB)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    pmask = p < tl.load(bounds_ptr + E)
    f = tl.load(perm_ptr + p, mask=pmask, other=0).to(tl.int64)
    g = tl.zeros((RB, BN), dtype=tl.float32)
    u = tl.zeros((RB, BN), dtype=tl.float32)
    for sl in range(SPLIT):
        base = part_ptr + ((sl * R + p.to(tl.int64)[:, None]) * 2) * I + rn[None, :]
        g += tl.load(base, mask=pmask[:, None], other=0.0)
        u += tl.load(base + I, mask=pmask[:, None], other=0.0)
    _act_store(g, u, p, pmask, wts_ptr, f, h_ptr, I, rn, limit, RB, BN, BYTES, BK_DOWN)


@triton.jit
def _fold_down_kernel(h_ptr, perm_ptr, bounds_ptr, w_base, s_base, table_ptr, y_ptr, I, D, s_stride,
                      ALIGN: tl.constexpr, ASM: tl.constexpr, LOWP: tl.constexpr, RB: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, W_LEFT: tl.constexpr, BYTES: tl.constexpr = False,
                      SLOTS: tl.constexpr = 1, PDL: tl.constexpr = 0):
    """y[flat row, n] = h rows of expert program_id(0) times its w2, columns of tile program_id(1);
    the row tiles dealt to SLOTS programs as in `_fold_up_kernel` (slot program_id(2)). Byte
    tiles take their scale bytes a K step ahead (`scale_bytes`)."""
    pdl_start(PDL)
    e = tl.program_id(0)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    start = tl.load(bounds_ptr + e)
    end = tl.load(bounds_ptr + e + 1)
    w2, s2 = _expert_ptrs(w_base, s_base, table_ptr, e, 2, ALIGN)
    kk = tl.arange(0, BK)
    for p0 in range(start + tl.program_id(2) * RB, end, RB * SLOTS):
        p = p0 + tl.arange(0, RB)
        pmask = p < end
        p64 = p.to(tl.int64)
        acc = _acc0(BN, RB, W_LEFT)
        sb = scale_bytes(s2, rn, 0, s_stride, BN, BK, BYTES)
        for k0 in range(0, I, BK):
            sn = scale_bytes(s2, rn, tl.multiple_of(tl.minimum(k0 + BK, I - BK), BK), s_stride, BN, BK,
                             BYTES)  # the next step's
            ht = tl.load(h_ptr + p64[None, :] * I + (k0 + kk)[:, None], mask=pmask[None, :], other=0.0)
            acc = _wdot(acc, _tile(w2, s2, sb, rn, k0, s_stride, I, BN, BK, ASM, LOWP, BYTES), ht, W_LEFT, LOWP)
            sb = sn
        f = tl.load(perm_ptr + p, mask=pmask, other=0).to(tl.int64)
        tl.store(y_ptr + f[:, None] * D + rn[None, :], bf16_round(_rows_first(acc, W_LEFT)), mask=pmask[:, None])


@triton.jit
def _x_qdq_kernel(x_ptr, out_ptr, D, CB: tl.constexpr, BYTES: tl.constexpr = False, BK: tl.constexpr = 128, PDL: tl.constexpr = 0):
    """out[t] = x[t]'s FP8 quantise-dequantise values (per 32 columns; exact in bf16), columns in
    the word order of the weight tiles (`word_order` is its own inverse)."""
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * CB + tl.arange(0, CB)
    v = fp8_qdq_groups(tl.load(x_ptr + t * D + c).to(tl.float32)[None, :], 1, CB)
    if BYTES:  # the `byte_order` of the gate/up tiles
        cols = byte_position(c, BK)
    else:
        cols = word_order(c)
    tl.store(out_ptr + t * D + cols[None, :], v)


def _buffer(shape, dtype, device) -> torch.Tensor:
    """Scratch allocation (one place, so tests can poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def fold_fits(inter: int, d: int, bn_up: int, bn_down: int, bk: int, split: int = 1) -> bool:
    """Whether the tiles divide the expert widths (the kernels load whole tiles, unmasked) and
    the gate/up K slices (d / split) are whole BK steps."""
    return (inter % bn_up == 0 and d % bn_down == 0 and d % (bk * split) == 0 and inter % bk == 0
            and bn_up % 32 == 0 and bk % 128 == 0)


def fold_tiles(t: int, interp: bool = False) -> dict:
    """The tiles for T tokens (TILES: the first row whose token bound T does not pass)."""
    rows = TILES["interp" if interp else "cuda"]
    return next((tiles for t_max, tiles in rows if t <= t_max), rows[-1][1])


def fold_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, table_args: tuple, limit: float,
             out: torch.Tensor, *, rb: int | None = None, bn_up: int | None = None, bn_down: int | None = None,
             bk: int | None = None, split: int | None = None, w_left: bool | None = None,
             byte_tiles: bool | None = None, num_warps: int | None = None,
             num_stages: int | None = None, maxnreg: int | None = None, slots: int | None = None,
             ahead_up: bool | None = None, add: torch.Tensor | None = None, join=None) -> torch.Tensor:
    """The folded FP4 decode path for x [T, d] (up to rb rows per expert in one tile, default
    the next power of two >= T in 16..the tiles' rb_max; more rows loop, or with `slots` programs
    per (expert, column tile) run side by side; the gate/up K range in `split` slices;
    `byte_tiles`: weight tiles from bytes, `fp4_bytes_bf16`; `maxnreg`: the gate/up kernel's
    register cap; `ahead_up`: the gate/up kernel's scale bytes a K step ahead, default at most
    AHEAD_UP_MAX_SLOTS slots; tile defaults `fold_tiles`):
    sort, x's FP8 quantise-dequantise, gate/up (+ its epilogue when split), down, combine into
    `out` [T, d] fp32
    (bf16 with `add`, `moe_experts.combine`)."""
    from .launch import interpreting
    from .moe_experts import combine
    from .moe_grouped import sort_rows

    w_base, s_base, table, kind, inter, d, (s_up, s_down), align = table_args
    interp = interpreting()
    t, topk = ids.shape
    n_exp = table.shape[0]
    tiles = fold_tiles(t, interp)
    bn_up, bn_down, bk = bn_up or tiles["bn_up"], bn_down or tiles["bn_down"], bk or tiles["bk"]
    split = split or tiles["split"]
    w_left = tiles["w_left"] if w_left is None else w_left
    byte_tiles = tiles.get("byte_tiles", False) if byte_tiles is None else byte_tiles
    if not fold_fits(inter, d, bn_up, bn_down, bk, split):
        raise ValueError(f"moe_experts fold path: tiles (bn_up {bn_up}, bn_down {bn_down}, bk {bk}, split {split}) "
                         f"must divide the widths ({inter}, {d}); bn_up a multiple of 32, bk of 128")
    kw = {} if interp else {"num_warps": num_warps or tiles["num_warps"], "num_stages": num_stages or tiles["num_stages"]}
    kw_down = dict(kw)  # (the down kernel, 95-126 registers, gained nothing from a cap: session twenty-seven)
    maxnreg = maxnreg or tiles.get("maxnreg")
    if maxnreg and not interp:  # a register cap for the gate/up kernel: more programs per SM
        kw["maxnreg"] = maxnreg
    r = t * topk
    rb = rb or max(16, min(tiles.get("rb_max", 64), triton.next_power_of_2(t)))  # rows of an expert: at most T
    if slots is None:  # enough programs per (expert, column tile) for an expert routed every token
        slots = -(-t // rb) if tiles.get("slots") else 1
    if slots < 1:
        raise ValueError(f"moe_experts fold path: slots must be a positive number of programs, got {slots}")
    flat_ids = ids.contiguous().reshape(-1)
    perm, bounds = sort_rows(flat_ids, n_exp)
    act = torch.float32 if interp else torch.bfloat16  # exact either way; the interpreter has no bf16 dots
    xq = _buffer((t, d), act, x.device)
    cb = 256 if d % 256 == 0 else 32
    _x_qdq_kernel[(t, d // cb)](x, xq, d, CB=cb, BYTES=byte_tiles, BK=bk, **pdl_launch(x))
    h = _buffer((r, inter), act, x.device)
    y = _buffer((r, d), torch.float32, x.device)
    wts = weights.float().contiguous().reshape(-1)
    part = _buffer((split, r, 2, inter), torch.float32, x.device) if split > 1 else y
    ahead = slots <= AHEAD_UP_MAX_SLOTS if ahead_up is None else bool(ahead_up)
    _fold_up_kernel[(n_exp, inter // bn_up, split * slots)](
        xq, perm, bounds, wts, w_base, s_base, table, h, part, r, d, inter, s_up, float(limit), TOPK=topk,
        ALIGN=align, ASM=not interp, LOWP=not interp, RB=rb, BN=bn_up, BK=bk, SPLIT=split, W_LEFT=w_left,
        BYTES=byte_tiles, BK_DOWN=bk, SLOTS=slots, AHEAD=ahead, **kw, **pdl_launch(xq))
    if split > 1:
        rbf = min(16, triton.next_power_of_2(r))
        _fold_act_kernel[(-(-r // rbf), inter // 32)](part, perm, bounds, wts, h, r, inter, n_exp, float(limit),
                                                       SPLIT=split, RB=rbf, BN=32, BYTES=byte_tiles, BK_DOWN=bk, **pdl_launch(part))
    _fold_down_kernel[(n_exp, d // bn_down, slots)](
        h, perm, bounds, w_base, s_base, table, y, inter, d, s_down, ALIGN=align, ASM=not interp, LOWP=not interp,
        RB=rb, BN=bn_down, BK=bk, W_LEFT=w_left, BYTES=byte_tiles, SLOTS=slots, **kw_down, **pdl_launch(h))
    return combine(y, flat_ids, out, add, join)
