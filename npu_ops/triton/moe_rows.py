"""FP4 routed experts at one or two tokens on the CUDA cores, whole weight rows streamed as int32
words (the `moe_experts` path "rows"; the FP4 analogue of block_linear's `_row_gemv_kernel`).

Per call, with R = T * k routed rows (token t, slot j -> flat row f = t * k + j; expert ids[f]):
1. `_rows_up_kernel`, grid (R, I / 32): program (f, c) takes rows 32c .. 32c + 31 of expert
   ids[f]'s w1 and w3. It FP8-quantise-dequantises x's row itself (per 32 columns, the values of
   `quant.fp8_qdq`) into registers, then streams the 64 weight rows RS of each per step (a step's
   rows are one contiguous run of K / 2 bytes each, the next step's words loaded before this
   step's are used). Each output is the fp32 sum over the 32-wide K blocks of (block sum of the
   exact products) times the block's E8M0 scale. The fp32 sums go to a scratch [R, 2, I]; after
   a CTA barrier the program reads its 32 gate and up sums back and applies the official
   epilogue (`swiglu.expert_act`: w1 / w3 sums rounded to bf16, clamped SwiGLU times the routing
   weight rounded to bf16) and the FP8 quantise-dequantise of the w2 input (its 32 columns are
   one group), stored as exact fp32 values in h [R, I].
2. `_rows_down_kernel`, grid (R, D / RPP): program (f, c) holds h's row f in registers and
   streams rows RPP * c .. of expert ids[f]'s w2; each expert output rounded to bf16 into y [R, D].
3. `moe_experts._combine_kernel`: out[t] = the sum of its slots' rows (ids >= 0) in slot order.
Slots with ids < 0 (another rank's experts) do nothing. An expert routed from both tokens at T = 2
is read twice (no sort): the path is for T <= ROWS_MAX_T.

The conversion (`e2m1x8_f32`): a word holds 8 E2M1 nibbles (element i in bits 4i..4i+3). A
nibble's fp16 bit pattern with the sign at bit 15 and its three magnitude bits at bits 11..9 is
its value times 2^-14, for the normal codes and the subnormal one (0.5) alike; that pattern has a
zero low byte, so whole-register shifts and masks build the high bytes of the four low nibbles
and of the four high nibbles (two registers), `prmt` places them two by two into fp16x2
registers, and `cvt.f32.f16` widens them (Hopper has no E2M1 conversion; sm_90 PTX). The 2^14 is
folded into x's registers, so each product (an FP8 value times 2^e, e >= -22, by an E2M1 value:
at most 6 significant bits) is exact in fp32, and the block's power-of-two scale multiplies the
block sum exactly. Numerics: exact products, fp32 sums (the fold kernels' class), rounded to bf16
where the official expert rounds; the reference's official-mode values up to the fp32 summation
order and the device exp. E8M0 byte 0 (2^-127) reads as 0 as in the other kernels.

Under TRITON_INTERPRET=1 (no inline PTX) the same bit placement runs as plain Triton integer ops
and fp16 bitcasts (constexpr ASM=False).

Speed (H200, benchmarks/RESULTS.md): 93-94 us at one token against the fold path's 97 (gate/up
58.5 us, down 31.9), 172 against 143 at two tokens. The kernels stream about 9.3 weights per SM
clock, the rate of block_linear's FP8 rows kernel; the sm_90a loop is 4.5 (gate/up) / 5.0 (down)
instructions per weight, one of them the fp16 -> fp32 conversion. L2 prefetches of the rows
ahead (93.0 us), Triton's cp.async pipeline of the word loads (107-113 us) and a 128-register cap
(151 us, spills) did not help, so the loop's instruction issue, not DRAM latency, bounds it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_start
from .block_scaled import _E2M1_ASM, bf16_round, e8m0_value, fp8_exponent, fp8_qdq_groups, fp8_round, pow2
from .swiglu import expert_act

GROUP = 32  # the w2 input's FP8 group: the gate/up program's rows
# The most tokens the path takes (it reads an expert once per routed row, not once per call).
ROWS_MAX_T = 2
# Tiles: rows per step of each of w1 / w3 (gate/up) and of w2, w2 rows per program, warps. H200
# 2026-12-01 (benchmarks/RESULTS.md, "FP4 experts at one token: the rows path"), graph replay, mini
# widths, T=1: these tiles 94.2 / 93.5 us in two runs (fold 96.8 / 96.6); rs_up 1 108.0, rs_up 4
# 192.3 (254 registers), rs_down 8 with rpp_down 64 96.0, rs_down 16 150.5, 8 warps 130.9.
ROWS_TILES = {"cuda": {"rs_up": 2, "rs_down": 4, "rpp_down": 32, "num_warps": 4},
              "interp": {"rs_up": 2, "rs_down": 4, "rpp_down": 8}}

@triton.jit
def _f16_high_byte(v):
    """fp32 value of the fp16 whose high byte is v's low byte (low byte zero)."""
    return ((v & 0xFF) << 8).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e2m1x8_f32(wd, ASM: tl.constexpr):
    """int32 words of 8 E2M1 nibbles -> their 8 values times 2^-14 as fp32 (element i of the
    word first; exact). ASM: `block_scaled`'s PTX (the module docstring's recipe); else the same
    bits through plain Triton ops."""
    if ASM:  # block_scaled's byte-wise conversion on a whole word: $0..$3 the even elements, $4..$7 the odd
        e0, e2, e4, e6, e1, e3, e5, e7 = tl.inline_asm_elementwise(
            _E2M1_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [wd], dtype=(tl.float32, tl.float32, tl.float32, tl.float32,
                                                                 tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True, pack=1)
        return e0, e1, e2, e3, e4, e5, e6, e7
    else:
        lo = ((wd << 1) & 0x0E0E0E0E) | ((wd << 4) & -2139062144)  # 0x80808080: the even elements' bytes
        hi = ((wd >> 3) & 0x0E0E0E0E) | (wd & -2139062144)  # the odd elements'
        return (_f16_high_byte(lo), _f16_high_byte(hi), _f16_high_byte(lo >> 8), _f16_high_byte(hi >> 8),
                _f16_high_byte(lo >> 16), _f16_high_byte(hi >> 16), _f16_high_byte(lo >> 24),
                _f16_high_byte(hi >> 24))


@triton.jit
def _x_part(x_ptr, b0, NBP: tl.constexpr):
    """The activation over the 32-wide blocks b0 .. b0 + NBP as 8 [1, NBP, 4] fp32 tensors
    (x_j[0, b, i] = x[32 (b0 + b) + 8 i + j]), FP8-quantise-dequantised per block (the values of
    `fp8_qdq_groups`) and times 2^14 (the weight conversion's 2^-14; exact)."""
    b = b0 + tl.arange(0, NBP)[None, :, None]
    base = x_ptr + 32 * b + 8 * tl.arange(0, 4)[None, None, :]
    x0 = tl.load(base).to(tl.float32)
    x1 = tl.load(base + 1).to(tl.float32)
    x2 = tl.load(base + 2).to(tl.float32)
    x3 = tl.load(base + 3).to(tl.float32)
    x4 = tl.load(base + 4).to(tl.float32)
    x5 = tl.load(base + 5).to(tl.float32)
    x6 = tl.load(base + 6).to(tl.float32)
    x7 = tl.load(base + 7).to(tl.float32)
    m = tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))),
                   tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)), tl.maximum(tl.abs(x6), tl.abs(x7))))
    e = fp8_exponent(tl.max(m, axis=2))[:, :, None]  # [1, NBP, 1]
    inv = pow2(-e)
    back = pow2(e) * 16384.0
    return (fp8_round(x0 * inv) * back, fp8_round(x1 * inv) * back, fp8_round(x2 * inv) * back,
            fp8_round(x3 * inv) * back, fp8_round(x4 * inv) * back, fp8_round(x5 * inv) * back,
            fp8_round(x6 * inv) * back, fp8_round(x7 * inv) * back)


@triton.jit
def _h_part(h_ptr, b0, NBP: tl.constexpr):
    """The w2 input (already FP8-quantise-dequantised) over blocks b0 .. b0 + NBP, laid out as
    `_x_part`, times 2^14."""
    b = b0 + tl.arange(0, NBP)[None, :, None]
    base = h_ptr + 32 * b + 8 * tl.arange(0, 4)[None, None, :]
    return (tl.load(base) * 16384.0, tl.load(base + 1) * 16384.0, tl.load(base + 2) * 16384.0,
            tl.load(base + 3) * 16384.0, tl.load(base + 4) * 16384.0, tl.load(base + 5) * 16384.0,
            tl.load(base + 6) * 16384.0, tl.load(base + 7) * 16384.0)


@triton.jit
def _words(w_rows, s_rows, rok, b0, NBP: tl.constexpr):
    """The weight words [RR, NBP, 4] (block b's 4 words: one 16-byte run) and E8M0 scale bytes
    [RR, NBP] (int32) of blocks b0 .. b0 + NBP of the rows whose first word / scale byte
    w_rows / s_rows point at ([RR] pointers); rows with rok false read zeros."""
    b = b0 + tl.arange(0, NBP)
    wd = tl.load(w_rows[:, None, None] + 4 * b[None, :, None] + tl.arange(0, 4)[None, None, :],
                 mask=rok[:, None, None], other=0)
    sc = tl.load(s_rows[:, None] + b[None, :], mask=rok[:, None], other=0).to(tl.int32)
    return wd, sc


@triton.jit
def _rows_dot(wd, sc, x0, x1, x2, x3, x4, x5, x6, x7, ASM: tl.constexpr):
    """Per row of the word tile wd [RR, NBP, 4]: the sum over its blocks of (the fp32 sum of the
    block's 32 exact products with x) times the block's scale."""
    w0, w1, w2, w3, w4, w5, w6, w7 = e2m1x8_f32(wd, ASM)
    p = w0 * x0 + w1 * x1 + w2 * x2 + w3 * x3 + w4 * x4 + w5 * x5 + w6 * x6 + w7 * x7
    return tl.sum(tl.sum(p, axis=2) * e8m0_value(sc), axis=1)


@triton.jit
def _row_ptrs(w_base, s_base, table_ptr, e, which, rows, KW, s_stride, ALIGN: tl.constexpr):
    """[RR] pointers to the first word and the first scale byte of `rows` of expert e's matrix
    `which` ([RR]: 0 w1, 1 w3, 2 w2; table: byte offsets from the bases, `moe_experts._expert_table`;
    ALIGN: the offsets' known alignment, which lets the word loads be 16-byte vectors)."""
    w_off = tl.multiple_of(tl.load(table_ptr + e * 6 + which), ALIGN)
    s_off = tl.load(table_ptr + e * 6 + 3 + which)
    r64 = rows.to(tl.int64)
    w_rows = (w_base + w_off).to(tl.pointer_type(tl.int32)) + r64 * KW
    return w_rows, s_base + s_off + r64 * s_stride


@triton.jit
def _stream_rows(w_rows, s_rows, rin, n_end, KW, s_stride, out, wa, sa, wb, sb, xa0, xa1, xa2, xa3, xa4, xa5, xa6,
                 xa7, xb0, xb1, xb2, xb3, xb4, xb5, xb6, xb7, RS: tl.constexpr, NBA: tl.constexpr, NBB: tl.constexpr,
                 ROUND: tl.constexpr, ASM: tl.constexpr):
    """The rows loop of both kernels: out[s + rin] = the dot of the tile's rows (w_rows / s_rows:
    [RR] pointers at step 0, rin: each row's place in its step) with x's parts, RS rows a step
    up to n_end, rounded to bf16 if ROUND. wa, sa (wb, sb): step 0's words and scales, loaded by
    the caller; the next step's are loaded before this step's are used."""
    for s in range(0, n_end, RS):
        nxt_ok = (s + RS + rin) < n_end
        wa_n, sa_n = _words(w_rows + RS * KW, s_rows + RS * s_stride, nxt_ok, 0, NBA)
        y = _rows_dot(wa, sa, xa0, xa1, xa2, xa3, xa4, xa5, xa6, xa7, ASM)
        if NBB > 0:
            wb_n, sb_n = _words(w_rows + RS * KW, s_rows + RS * s_stride, nxt_ok, NBA, NBB)
            y += _rows_dot(wb, sb, xb0, xb1, xb2, xb3, xb4, xb5, xb6, xb7, ASM)
            wb, sb = wb_n, sb_n
        if ROUND:
            y = bf16_round(y)
        tl.store(out + s + rin, y)
        wa, sa = wa_n, sa_n
        w_rows += RS * KW
        s_rows += RS * s_stride


@triton.jit
def _rows_up_kernel(x_ptr, ids_ptr, wts_ptr, w_base, s_base, table_ptr, gu_ptr, h_ptr, K, KW, I, s_stride, limit,
                    TOPK: tl.constexpr, ALIGN: tl.constexpr, RS: tl.constexpr, NBA: tl.constexpr, NBB: tl.constexpr,
                    ASM: tl.constexpr, PDL: tl.constexpr = 0):
    """h[f, 32c .. 32c + 31] for flat row f = program_id(0), c = program_id(1) (module docstring):
    each step RS rows of w1 and the same RS rows of w3 (one [2 RS] tile); NBA + NBB = K / 32
    blocks in two power-of-two parts (NBB may be 0)."""
    pdl_start(PDL)
    f = tl.program_id(0)
    n0 = tl.program_id(1) * 32
    e = tl.load(ids_ptr + f)
    active = e >= 0
    e = tl.maximum(e, 0).to(tl.int64)
    rr = tl.arange(0, 2 * RS)
    which = rr // RS  # 0: w1, 1: w3
    n_end = tl.where(active, 32, 0)
    # the first step's words go out before x's quantisation (its latency hides behind them)
    w_rows, s_rows = _row_ptrs(w_base, s_base, table_ptr, e, which, n0 + rr % RS, KW, s_stride, ALIGN)
    ok = (rr % RS) < n_end
    wa, sa = _words(w_rows, s_rows, ok, 0, NBA)
    wb, sb = wa, sa  # part B's placeholders when there is none
    if NBB > 0:
        wb, sb = _words(w_rows, s_rows, ok, NBA, NBB)
    xrow = x_ptr + (f // TOPK).to(tl.int64) * K
    xa0, xa1, xa2, xa3, xa4, xa5, xa6, xa7 = _x_part(xrow, 0, NBA)
    xb0, xb1, xb2, xb3, xb4, xb5, xb6, xb7 = xa0, xa1, xa2, xa3, xa4, xa5, xa6, xa7
    if NBB > 0:
        xb0, xb1, xb2, xb3, xb4, xb5, xb6, xb7 = _x_part(xrow, NBA, NBB)
    _stream_rows(w_rows, s_rows, rr % RS, n_end, KW, s_stride, gu_ptr + f.to(tl.int64) * 2 * I + which * I + n0,
                 wa, sa, wb, sb, xa0, xa1, xa2, xa3, xa4, xa5, xa6, xa7, xb0, xb1, xb2, xb3, xb4, xb5, xb6, xb7,
                 RS, NBA, NBB, False, ASM)
    tl.debug_barrier()  # every thread's sums are stored before they are read back across the CTA
    if active:
        cols = n0 + tl.arange(0, 32)
        base = gu_ptr + f.to(tl.int64) * 2 * I + cols
        g = tl.load(base, cache_modifier=".cg")
        u = tl.load(base + I, cache_modifier=".cg")
        h = expert_act(g, u, tl.load(wts_ptr + f), limit)
        h = fp8_qdq_groups(h[None, :], 1, 32)
        tl.store(h_ptr + f.to(tl.int64) * I + cols[None, :], h)


@triton.jit
def _rows_down_kernel(h_ptr, ids_ptr, w_base, s_base, table_ptr, y_ptr, I, KW, D, s_stride, ALIGN: tl.constexpr,
                      RPP: tl.constexpr, RS: tl.constexpr, NBA: tl.constexpr, NBB: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr = 0):
    """y[f, RPP c .. RPP (c + 1)] = bf16(h[f] @ w2 rows) for flat row f = program_id(0), c =
    program_id(1), RS rows a step (slots with ids < 0 do nothing)."""
    pdl_start(PDL)
    f = tl.program_id(0)
    n0 = tl.program_id(1) * RPP
    e = tl.load(ids_ptr + f)
    n_end = tl.where(e >= 0, RPP, 0)
    e = tl.maximum(e, 0).to(tl.int64)
    rr = tl.arange(0, RS)
    w_rows, s_rows = _row_ptrs(w_base, s_base, table_ptr, e, 2, n0 + rr, KW, s_stride, ALIGN)
    ok = rr < n_end
    wa, sa = _words(w_rows, s_rows, ok, 0, NBA)
    wb, sb = wa, sa
    if NBB > 0:
        wb, sb = _words(w_rows, s_rows, ok, NBA, NBB)
    hrow = h_ptr + f.to(tl.int64) * I
    xa0, xa1, xa2, xa3, xa4, xa5, xa6, xa7 = _h_part(hrow, 0, NBA)
    xb0, xb1, xb2, xb3, xb4, xb5, xb6, xb7 = xa0, xa1, xa2, xa3, xa4, xa5, xa6, xa7
    if NBB > 0:
        xb0, xb1, xb2, xb3, xb4, xb5, xb6, xb7 = _h_part(hrow, NBA, NBB)
    _stream_rows(w_rows, s_rows, rr, n_end, KW, s_stride, y_ptr + f.to(tl.int64) * D + n0, wa, sa, wb, sb,
                 xa0, xa1, xa2, xa3, xa4, xa5, xa6, xa7, xb0, xb1, xb2, xb3, xb4, xb5, xb6, xb7, RS, NBA, NBB, True,
                 ASM)


def block_parts(k: int) -> tuple[int, int] | None:
    """K / 32 blocks as two powers of two (NBA, NBB), NBB possibly 0 (5120: 128 + 32, 2304: 64 + 8),
    or None where K is not a multiple of 32 or its blocks are no such sum."""
    if k <= 0 or k % 32:
        return None
    nb = k // 32
    nba = 1 << (nb.bit_length() - 1)
    nbb = nb - nba
    return (nba, nbb) if nbb & (nbb - 1) == 0 else None


def rows_fits(inter: int, d: int, rpp_down: int = ROWS_TILES["cuda"]["rpp_down"]) -> bool:
    """Whether the kernels take the expert widths: both K's blocks split in two powers of two, the
    intermediate width whole 32-row groups, d whole RPP-row programs."""
    return (block_parts(inter) is not None and block_parts(d) is not None and inter % GROUP == 0
            and d % rpp_down == 0)


def _buffer(shape, dtype, device) -> torch.Tensor:
    """Scratch allocation (one place, so tests can poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def rows_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, table_args: tuple, limit: float,
             out: torch.Tensor, *, rs_up: int | None = None, rs_down: int | None = None,
             rpp_down: int | None = None, num_warps: int | None = None, mma: bool | None = None,
             mma_bb: int | None = None, mma_warps_down: int | None = None, mma_split_up: int | None = None,
             mma_split_down: int | None = None, mma_grouped: bool | None = None,
             mma_scale_words: bool | None = None, mma_vec_words: bool | tuple | None = None,
             mma_diag: bool | None = None, mma_l2_hint: bool | tuple | None = None,
             add: torch.Tensor | None = None, join=None) -> torch.Tensor:
    """The rows path for x [T, d] (FP4 experts; T <= ROWS_MAX_T on the CUDA cores, tiles default
    `ROWS_TILES`; on the MMA variant T <= moe_rows_mma.MMA_MAX_T with a program per routed row, any
    T grouped, and by default up to MMA_MAX_T):
    gate/up with its epilogue, down, combine into `out` [T, d] (fp32; bf16 with `add`:
    `moe_experts.combine`). `mma`: gate/up and down on the tensor cores fed from registers
    (`moe_rows_mma`; CUDA), with its own settings `mma_bb` (K blocks a loop step),
    `mma_warps_down`, `mma_scale_words` (a step's scale bytes in one load), `mma_vec_words`
    (16-byte weight loads, transposed across lanes; a bool or (gate/up, down)), `mma_diag` (at a
    program per routed row, the block-diagonal MMA operand in place of that transpose), `mma_l2_hint`
    (its weight loads asking L2 for 256-byte blocks; a bool or (gate/up, down)), the K
    slices `mma_split_up` / `mma_split_down` and `mma_grouped` (a program per expert, its rows as MMA columns: up to `moe_rows_mma.MMA_MAX_T`
    tokens, where the CUDA-core kernels take ROWS_MAX_T); None (default): compiled on CUDA where its
    widths fit, unless a CUDA-core kernel tile is given (the H200 measured it faster at one and two
    tokens: `moe_rows_mma.MMA_SPLITS`)."""
    from .launch import interpreting
    from .moe_experts import combine

    inter, d = table_args[4], table_args[5]
    interp = interpreting()
    tiles = ROWS_TILES["interp" if interp else "cuda"]
    core_tiles = any(v is not None for v in (rs_up, rs_down, rpp_down, num_warps))  # the CUDA-core kernels' settings
    rs_up, rs_down = rs_up or tiles["rs_up"], rs_down or tiles["rs_down"]
    rpp_down = rpp_down or tiles["rpp_down"]
    t, topk = ids.shape
    flat_ids = ids.contiguous().reshape(-1)
    if mma is None:
        from .moe_rows_mma import MMA_MAX_T, mma_fits

        mma = (not interp and x.device.type == "cuda" and mma_fits(inter, d) and not core_tiles
               and t <= MMA_MAX_T)
    wts = weights.float().contiguous().reshape(-1)
    if mma:
        from .moe_rows_mma import mma_moe

        y = mma_moe(x, flat_ids, wts, table_args, limit, topk, bb=mma_bb, num_warps_down=mma_warps_down,
                    split_up=mma_split_up, split_down=mma_split_down, grouped=mma_grouped,
                    scale_words=mma_scale_words, vec_words=mma_vec_words, diag=mma_diag,
                    l2_hint=mma_l2_hint)
    else:
        y = _core_moe(x, flat_ids, wts, table_args, limit, topk, rs_up, rs_down, rpp_down, num_warps, tiles, interp)
    return combine(y, flat_ids, out, add, join)


def _core_moe(x, flat_ids, wts, table_args, limit, topk, rs_up, rs_down, rpp_down, num_warps, tiles, interp):
    """Gate/up and down on the CUDA cores (module docstring, steps 1-2): y [R, d] fp32."""
    w_base, s_base, table, kind, inter, d, (s_up, s_down), align = table_args
    r = flat_ids.numel()
    t = r // topk
    if t > ROWS_MAX_T:
        raise ValueError(f"moe_experts rows path: at most {ROWS_MAX_T} tokens, got {t}")
    if not rows_fits(inter, d, rpp_down) or GROUP % rs_up or rpp_down % rs_down or rs_up & (rs_up - 1) \
            or rs_down & (rs_down - 1):
        raise ValueError(f"moe_experts rows path: widths ({inter}, {d}) need K / 32 blocks as a sum of two powers of "
                         f"two, {GROUP} | {inter}, rows per program {rpp_down} | {d}; rows per step (powers of two) "
                         f"rs_up {rs_up} | {GROUP}, rs_down {rs_down} | {rpp_down}")
    kw = {} if interp else {"num_warps": num_warps or tiles["num_warps"], "num_stages": 1}
    gu = _buffer((r, 2, inter), torch.float32, x.device)
    h = _buffer((r, inter), torch.float32, x.device)
    y = _buffer((r, d), torch.float32, x.device)
    nba, nbb = block_parts(d)
    _rows_up_kernel[(r, inter // GROUP)](x, flat_ids, wts, w_base, s_base, table, gu, h, d, d // 8, inter, s_up,
                                         float(limit), TOPK=topk, ALIGN=align, RS=rs_up, NBA=nba, NBB=nbb,
                                         ASM=not interp, **kw, **pdl_launch(x))
    nba, nbb = block_parts(inter)
    _rows_down_kernel[(r, d // rpp_down)](h, flat_ids, w_base, s_base, table, y, inter, inter // 8, d, s_down,
                                          ALIGN=align, RPP=rpp_down, RS=rs_down, NBA=nba, NBB=nbb, ASM=not interp,
                                          **kw, **pdl_launch(h))
    return y
