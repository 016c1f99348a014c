"""Mega-mHC: the single-pass mHC step after a sublayer, fused into one kernel (op `mhc_mix`).

Per token (n = 4 streams of width d): x [n, d] and the sublayer output y [d] are read once,
x_new_j = post[j] * y + sum_i comb[i][j] * x_i (fp32) is rounded to x's dtype and written
once, x_hat = sum_j pre[j] * x_new_j (from the rounded x_new, fp32 math) is written once, and,
when `fn` is given, the next sublayer's coefficients come out of the same pass:
m = (fn . x_new_flat) * rsqrt(mean(x_new_flat^2) + norm_eps), then the sigmoids and the
Sinkhorn normalisation of the 4x4 comb in registers. Activation traffic: (2n + 2) d elements.

Work items: BLOCK_T tokens x one chunk of d (a whole number of BLOCK_D slices; a token tile is
cut into enough chunks to occupy the device), so every slice of the fp32 weight fn [24, n*d] is
read once per BLOCK_T tokens (from L2; loaded row-major [32, BLOCK_D] and transposed in
registers). The 24 dot products run as tl.dot [BLOCK_T, BLOCK_D] x [BLOCK_D, 32]: on devices,
x_new (exact in bf16) times fn split into three bf16 parts (hi + mid + lo == fn exactly), each
dot from a zero accumulator and the partials added in fp32, so the products are exact and only
the summation order differs from the reference's fp64 `mm`; under the interpreter (bf16
arithmetic is unreliable there) and for non-bf16 streams an fp32 "ieee" dot. Within a chunk the
per-slice partial dot products are summed with Kahan compensation (the running m grows well
past one slice's share) and the sum of squares elementwise in fp32; each chunk writes its m, its
Kahan residue and its sum of squares ([chunks, T, 65] fp32, written and read back: 4% of the
activation bytes at 8 chunks, more for the few-token calls that get more chunks), and a small
second kernel (`_mhc_coef_kernel`, COEF_T tokens per work item) adds them in chunk order (CB
chunks per step: a tree sum inside a step, compensated across steps) before the sigmoids and
Sinkhorn. Activations are still read and written once. With `fused=True` (CUDA) the same
epilogue runs in the main kernel instead: each program bumps its token tile's counter after
storing its chunk (acq_rel, after a CTA barrier) and the tile's last program reads every chunk
from L2 and computes the coefficients (one launch; off by default, see FUSED_COEF).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends.reference.mhc import mhc_mix as mhc_mix_ref  # noqa: F401  (the oracle)
from .pdl import pdl_launch, pdl_start
from .block_scaled import bf16_bits16
from .fp4_common import as_cmp, offsets
from .launch import tile_counters

N_STREAMS = 4
N_MIX = (2 + N_STREAMS) * N_STREAMS  # 24 coefficients per token
# Tiles per backend: BLOCK_T tokens (tl.dot needs M >= 16) x BLOCK_D columns per inner step,
# and d_split, the least number of d chunks a token tile is cut into (separate work items, so that
# T = 1..4096 still gives enough programs; 1 chunk per tile left a 4096-token call with 256
# programs, each walking 40 slices back to back). Ascend / interpreter: 16 x 64 fp32 slices
# (~11 live, 4 KB each) plus the fn slice and its three bf16 parts (4 x 8 KB) come to ~84 KB,
# inside half the 192 KB unified buffer (tests/test_triton_ub.py; 128 wide was ~160 KB). CUDA: from the H200
# sweep (benchmarks/sweep_kernels.py --only mhc_mix, T=4096, d=5120, graph time): BLOCK_D 64,
# 4 warps, 2 stages, 8 chunks 547 us; 1 stage 753 us; BLOCK_D 32 972 us; 8 warps 1330-1375 us
# (4 / 8 / 16 chunks); the single-chunk kernel before it (BLOCK_D 128, 3 stages) 1519 us.
# The coefficient epilogue inside the main kernel (last program per token tile) instead of its own
# launch: off by default. H200 2026-11-30, graph time per call at d = 5120: mhc_mix T=1 51.6 us
# fused against 40.7 us unfused, T=64 62.6 against 48.2 (mhc_mixes T=1 40.8 / 34.5), measured
# with the 16-token epilogue, before COEF_T; not measured since. It is correct on the H200
# (tests/test_triton_mega_mhc.py, test_triton_dense_ops.py) and the CUDA path only (atomics).
FUSED_COEF = False
# The projection's orientation (`_mhc_mix_kernel`'s TDOT), chosen by `tiles_for`'s "tdot":
# False, x_new [BLOCK_T, BLOCK_D] x fn^T (fn fp32, split into its three bf16 parts in every
# program); True, fn's parts [TDOT_M, BLOCK_D] (split once per weight: `fn_bf16_parts`) x
# x_new^T, so that the MMA is Hopper's wgmma (M = 64) and the activations reach it through
# shared memory. With x_new as the A operand (M = BLOCK_T = 16: mma.sync, its 4 warps side by
# side along N) Triton computes the whole elementwise update in that operand's layout, the same
# on every warp: static sm_90a (triton 3.6, 16 x 64 tiles, 4 warps, 2 stages) 2696 SASS
# instructions a slice a warp, 255 registers and 44 bytes of spill; with TDOT 1098 instructions,
# 196 registers, no spill (1 stage: 917, 174 registers; `benchmarks/ptxas_usage.py --only mhc`).
# fn's parts take 1.5x fp32 fn's bytes.
TDOT_M = tl.constexpr(64)  # fn's 24 rows padded to the wgmma's M (the padding rows load as zeros)
# Decode batches (T <= max_t, CUDA): TDOT with one stage, and 32-token tiles from wide_t tokens
# (`tiles_for`). H100 (session forty-seven, sweep_kernels.py --only mhc_mix, graph us a call with
# the coefficients, d = 5120, T = 1 / 8 / 64): the table (16 x 64, 2 stages) 12.0 / 12.3 / 21.2; TDOT
# 2 stages 9.3 / 9.9 / 18.9; TDOT 1 stage 8.7 / 9.5 / 14.7; TDOT 32-token tiles 1 stage 9.9 / 10.6 /
# 12.9; 32-wide slices 9.7 / 10.4 / 14.8.
# Prefill (T > max_t, CUDA): TDOT with 32 x 32 tiles and 2 stages (`PREFILL_TDOT`). H100 (session
# forty-eight, the same sweep, T = 512 / 4096): the table (16 x 64, 2 stages) 147.7 / 606.9 us; TDOT
# 16 x 64 96.9 / 545.0; TDOT 16 x 32 96.8 / 450.3; TDOT 32 x 64 1 stage 72.7 / 384.4; TDOT 32 x 32
# 68.5 / 326.6 (every row checked against the fp64 oracle, the same differing fractions).
# DSV41_MHC_TDOT=0 (read once per process, `backends.platform.env_switch`) keeps the table's tiles
# at every size.
# On CUDA (DSV41_MHC_COEF_LANE=0 turns it off) the unfused coefficient launch of a call without
# `norm` runs on the platform's side lane `MHC_COEF_LANE` (`coef_launch`): its outputs (pre, post,
# comb) are read only by the next mHC step, after a whole sublayer, so it runs beside that
# sublayer's first kernels instead of before them; the model joins the lane before it reads them
# (H100, mini decode graph at 4K: -53 / -42 / -56 us a step at batch 1 / 8 / 64).
DECODE_TDOT = {"max_t": 64, "num_stages": 1, "block_t": 16, "wide_t": 32, "wide_block_t": 32}
PREFILL_TDOT = {"block_t": 32, "block_d": 32, "num_stages": 2}


# Tokens per coefficient work item: one per warp of a 4-warp program (the Sinkhorn rounds are a
# serial chain per token; more tokens per thread lengthen it).
COEF_T = 4
# The coefficient epilogue's form, chosen once per process: DSV41_MHC_COEF = "split" (default: its
# own launch, FUSED_COEF decides), "narrow" (own launch; fewer than COEF_T tokens take a tile of
# just those tokens, so CB covers every chunk of a decode call and the chunk sums are one L2 read
# instead of a chain), "fused" (in the main kernel) or "fused-narrow". Default "narrow": on the
# H200 (benchmarks/dense_ab.py, 2026-12-01) mhc_mix at one token 15.8 us against 23.5 "split",
# 25.1 "fused", 16.4 "fused-narrow"; mhc_mixes 12.1 against 19.8; equal at 8 tokens.
MHC_COEF_MODES = ("split", "narrow", "fused", "fused-narrow")
# Decode (one token tile): issue the loads that do not depend on this kernel's stores first -- fn's
# slices in the main kernel (FN_FIRST), the x_hat row and norm weight in the coefficient kernel
# (NORM_FIRST) -- so one memory round trip per kernel overlaps another instead of following it.
# H200 (benchmarks/dense_ab.py --rows, 2026-12-01, graph time per call, d = 5120, narrow tiles):
# mhc_mix with the next norm (the model's mhc_mix_norm) at one token 21.7 -> 19.2 us, two tokens
# 24.2 -> 23.5; mhc_mix alone 17.9 -> 17.4 / 21.3 -> 21.2. Outputs bit-identical (tested).
EARLY_LOADS = True
_COEF_MODE: list = []


def coef_mode() -> tuple[bool, bool]:
    """(fused, narrow) from DSV41_MHC_COEF, read once (one clear error for an unknown value)."""
    import os

    if not _COEF_MODE:
        mode = os.environ.get("DSV41_MHC_COEF", "narrow") or "narrow"
        if mode not in MHC_COEF_MODES:
            raise ValueError(f"DSV41_MHC_COEF: unknown mode {mode!r} (one of {', '.join(MHC_COEF_MODES)})")
        _COEF_MODE.append((FUSED_COEF if mode == "split" else mode.startswith("fused"), mode.endswith("narrow")))
    return _COEF_MODE[0]


# Narrow tiles in their own launch: one token per coefficient work item up to COEF_ONE_MAX_T
# tokens, so a token's chunk partials are one reduction step (CB = 128 chunks) and the T programs
# run side by side. With 4 tokens a program, a decode call's 80 chunks took three chained steps of
# 32 (H200 2026-12-02, the mini step at batch 8: `_mhc_coef_kernel` 14 us a launch, 5 at one token).
COEF_ONE_MAX_T = 64


def coef_tokens(t: int, narrow: bool, fused: bool = False) -> int:
    """Tokens per coefficient work item: COEF_T; with `narrow` one token (in its own launch, up to
    COEF_ONE_MAX_T tokens), or inside the main kernel (`fused`) the next power of two >= T when
    that is fewer than COEF_T (the tile's last program computes its tokens in turn)."""
    if narrow and not fused and t <= COEF_ONE_MAX_T:
        return 1
    return min(COEF_T, triton.next_power_of_2(max(1, t))) if narrow else COEF_T
TILES = {
    "cuda": {"block_t": 16, "block_d": 64, "num_warps": 4, "num_stages": 2, "d_split": 8, "tdot": False},
    "default": {"block_t": 16, "block_d": 64, "num_warps": 4, "num_stages": 1, "d_split": 2, "tdot": False},
}


def tiles_for(t: int, device: torch.device, sized: bool = True) -> dict:
    """The mHC kernels' tiles for a T-token call on `device`: TILES, on CUDA with the TDOT rules
    that follow T (DECODE_TDOT up to its max_t tokens, PREFILL_TDOT above) unless `sized` is False
    (batch-invariant mode: tiles that do not follow T, since a dot's shape may change its sums'
    bits) or DSV41_MHC_TDOT=0."""
    from ...backends.platform import env_switch
    from .launch import interpreting

    if device.type != "cuda" or interpreting():
        return TILES["default"]
    tiles = TILES["cuda"]
    if not sized or not env_switch("DSV41_MHC_TDOT", True):
        return tiles
    if t > DECODE_TDOT["max_t"]:
        return dict(tiles, tdot=True, **PREFILL_TDOT)
    wide = t >= DECODE_TDOT["wide_t"]
    return dict(tiles, tdot=True, num_stages=DECODE_TDOT["num_stages"],
                block_t=DECODE_TDOT["wide_block_t" if wide else "block_t"])


def ub_tiles(block_t: int, block_d: int) -> dict[str, tuple[int, ...]]:
    """Live tiles of one program of the main kernel at its peak: the four stream slices and y,
    the four rounded outputs, x_hat, the sum of squares, the fn slice with its three bf16 parts
    (the dot operands), the [BLOCK_T, 32] partial products, their Kahan sum and residue, and the
    16 comb / 8 pre-post coefficient columns."""
    s = (block_t, block_d)
    w = (32, block_d)
    c = (block_t, 32)
    return {"x0": s, "x1": s, "x2": s, "x3": s, "y": s, "n0": s, "n1": s, "n2": s, "n3": s, "xhat": s, "ss": s,
            "fn": w, "fn_hi": w, "fn_mid": w, "fn_lo": w, "part": c, "acc": c, "comp": c, "coef": (block_t, 24)}


@triton.jit
def _col(acc, kk, k: tl.constexpr):
    """Column k of a [BLOCK_T, 32] tile as a [BLOCK_T] vector."""
    return tl.sum(tl.where(as_cmp(kk)[None, :] == k, acc, 0.0), axis=1)


@triton.jit
def _bf16_bits(v):
    """fp32 -> bf16 round-to-nearest-even, done on the bits (the interpreter's cast truncates):
    returns the rounded value as fp32 and its 16-bit pattern as int16."""
    b = v.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return (r << 16).to(tl.float32, bitcast=True), r.to(tl.int16)


@triton.jit
def _round_out(v, ty: tl.constexpr, OUT_BF16: tl.constexpr):
    """v in the output dtype (bits for bf16) and its value back in fp32."""
    if OUT_BF16:
        f, h = _bf16_bits(v)
        return h, f
    else:
        o = v.to(ty)
        return o, o.to(tl.float32)


@triton.jit
def _softmax4(a, b, c, d, eps):
    mx = tl.maximum(tl.maximum(a, b), tl.maximum(c, d))
    ea = tl.exp(a - mx)
    eb = tl.exp(b - mx)
    ec = tl.exp(c - mx)
    ed = tl.exp(d - mx)
    r = 1.0 / (ea + eb + ec + ed)
    return ea * r + eps, eb * r + eps, ec * r + eps, ed * r + eps


@triton.jit
def _norm4(a, b, c, d, eps):
    """(a, b, c, d) / (a + b + c + d + eps), as one reciprocal and four products: the Sinkhorn
    rounds are one serial chain per token (the coefficient epilogue's latency), and a division
    costs a long instruction sequence; within 1.5 fp32 ulps of the quotients."""
    r = 1.0 / (a + b + c + d + eps)
    return a * r, b * r, c * r, d * r


@triton.jit
def _fn_dot(xn, fn_ptr, fn_off, fn_mask, SPLIT: tl.constexpr):
    """xn [BLOCK_T, BLOCK_D] @ (fn slice [32, BLOCK_D])^T -> [BLOCK_T, 32] fp32. The fn slice is
    loaded row-major (coalesced along d) and transposed in registers. Each tl.dot starts from
    a zero accumulator and the partial products are added on the fp32 ALUs: chaining the three
    split parts through one tensor-core accumulator cost ~5e-5 absolute in m on an H200."""
    return _fn_dot_w(xn, tl.load(fn_ptr + fn_off, mask=fn_mask, other=0.0).to(tl.float32), SPLIT)


@triton.jit
def _fn_dot_w(xn, w, SPLIT: tl.constexpr):
    """`_fn_dot` on an fn slice already loaded (fp32 [32, BLOCK_D])."""
    if SPLIT:
        xb = xn.to(tl.bfloat16)  # exact: xn holds bf16-rounded values
        w_hi = w.to(tl.bfloat16)
        r1 = w - w_hi.to(tl.float32)
        w_mid = r1.to(tl.bfloat16)
        w_lo = (r1 - w_mid.to(tl.float32)).to(tl.bfloat16)
        lo = tl.dot(xb, tl.trans(w_lo)) + tl.dot(xb, tl.trans(w_mid))
        return lo + tl.dot(xb, tl.trans(w_hi))
    else:
        return tl.dot(xn, tl.trans(w), input_precision="ieee")


@triton.jit
def _mhc_mix_kernel(x_ptr, y_ptr, post_ptr, comb_ptr, pre_ptr, fn_ptr, scale_ptr, base_ptr,
                    xnew_ptr, xhat_ptr, part_ptr, pcomp_ptr, pss_ptr, count_ptr, opre_ptr, opost_ptr, ocomb_ptr,
                    nw_ptr, xn_ptr, T, D, chunk, n_chunks, n_items, num_programs, norm_eps, hc_eps, iters, rms_eps,
                    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, HAS_FN: tl.constexpr,
                    SPLIT: tl.constexpr, OUT_BF16: tl.constexpr, WIDE: tl.constexpr, FUSED: tl.constexpr,
                    CT: tl.constexpr, CB: tl.constexpr, NORM: tl.constexpr, BLOCK_N: tl.constexpr,
                    FN_FIRST: tl.constexpr = False, PDL: tl.constexpr = 0, TDOT: tl.constexpr = False):
    """See the module docstring. FN_FIRST (decode: one token tile, one BLOCK_D slice per work item):
    each slice's fn loads are issued before its activation loads, so that the fn bytes (from HBM)
    do not wait behind the x_new / x_hat stores (which Triton keeps in order with later loads).
    TDOT: fn_ptr holds fn's three bf16 parts [3, 24, 4d] and the projection runs transposed
    (`_fn_partial_step_t`; see TDOT_M); the chunk partials are stored as without it."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    dt = tl.arange(0, BLOCK_D)
    kk = tl.arange(0, 32)
    kmask = kk < 24
    out_ty = xnew_ptr.dtype.element_ty
    for item in range(pid, n_items, num_programs):
        tile = item // n_chunks
        ck = item - tile * n_chunks  # which d chunk of this token tile
        tok = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = tok < T
        t4 = tok * 4
        p0 = tl.load(post_ptr + t4 + 0, mask=tm, other=0.0).to(tl.float32)
        p1 = tl.load(post_ptr + t4 + 1, mask=tm, other=0.0).to(tl.float32)
        p2 = tl.load(post_ptr + t4 + 2, mask=tm, other=0.0).to(tl.float32)
        p3 = tl.load(post_ptr + t4 + 3, mask=tm, other=0.0).to(tl.float32)
        q0 = tl.load(pre_ptr + t4 + 0, mask=tm, other=0.0).to(tl.float32)
        q1 = tl.load(pre_ptr + t4 + 1, mask=tm, other=0.0).to(tl.float32)
        q2 = tl.load(pre_ptr + t4 + 2, mask=tm, other=0.0).to(tl.float32)
        q3 = tl.load(pre_ptr + t4 + 3, mask=tm, other=0.0).to(tl.float32)
        t16 = tok * 16
        c00 = tl.load(comb_ptr + t16 + 0, mask=tm, other=0.0).to(tl.float32)[:, None]
        c01 = tl.load(comb_ptr + t16 + 1, mask=tm, other=0.0).to(tl.float32)[:, None]
        c02 = tl.load(comb_ptr + t16 + 2, mask=tm, other=0.0).to(tl.float32)[:, None]
        c03 = tl.load(comb_ptr + t16 + 3, mask=tm, other=0.0).to(tl.float32)[:, None]
        c10 = tl.load(comb_ptr + t16 + 4, mask=tm, other=0.0).to(tl.float32)[:, None]
        c11 = tl.load(comb_ptr + t16 + 5, mask=tm, other=0.0).to(tl.float32)[:, None]
        c12 = tl.load(comb_ptr + t16 + 6, mask=tm, other=0.0).to(tl.float32)[:, None]
        c13 = tl.load(comb_ptr + t16 + 7, mask=tm, other=0.0).to(tl.float32)[:, None]
        c20 = tl.load(comb_ptr + t16 + 8, mask=tm, other=0.0).to(tl.float32)[:, None]
        c21 = tl.load(comb_ptr + t16 + 9, mask=tm, other=0.0).to(tl.float32)[:, None]
        c22 = tl.load(comb_ptr + t16 + 10, mask=tm, other=0.0).to(tl.float32)[:, None]
        c23 = tl.load(comb_ptr + t16 + 11, mask=tm, other=0.0).to(tl.float32)[:, None]
        c30 = tl.load(comb_ptr + t16 + 12, mask=tm, other=0.0).to(tl.float32)[:, None]
        c31 = tl.load(comb_ptr + t16 + 13, mask=tm, other=0.0).to(tl.float32)[:, None]
        c32 = tl.load(comb_ptr + t16 + 14, mask=tm, other=0.0).to(tl.float32)[:, None]
        c33 = tl.load(comb_ptr + t16 + 15, mask=tm, other=0.0).to(tl.float32)[:, None]
        tok64 = offsets(tok, WIDE)  # int32 unless a tensor has 2^31 elements
        x_row = tok64[:, None] * (4 * D)
        y_row = tok64[:, None] * D
        acc, comp, ss = _partials_init(BLOCK_T, BLOCK_D, TDOT)
        for d0 in range(ck * chunk, tl.minimum(ck * chunk + chunk, D), BLOCK_D):
            cols = d0 + dt
            cm = cols < D
            if HAS_FN and FN_FIRST and not TDOT:  # fn's slices requested with the activations
                w0, w1, w2, w3 = _fn_slices(fn_ptr, offsets(kk, WIDE), kmask, cols, cm, D)
            m2 = tm[:, None] & cm[None, :]
            xo = x_row + cols[None, :]
            yo = y_row + cols[None, :]
            x0 = tl.load(x_ptr + xo, mask=m2, other=0.0).to(tl.float32)
            x1 = tl.load(x_ptr + xo + D, mask=m2, other=0.0).to(tl.float32)
            x2 = tl.load(x_ptr + xo + 2 * D, mask=m2, other=0.0).to(tl.float32)
            x3 = tl.load(x_ptr + xo + 3 * D, mask=m2, other=0.0).to(tl.float32)
            yv = tl.load(y_ptr + yo, mask=m2, other=0.0).to(tl.float32)
            n0, f0 = _round_out(p0[:, None] * yv + (c00 * x0 + c10 * x1 + c20 * x2 + c30 * x3), out_ty, OUT_BF16)
            n1, f1 = _round_out(p1[:, None] * yv + (c01 * x0 + c11 * x1 + c21 * x2 + c31 * x3), out_ty, OUT_BF16)
            n2, f2 = _round_out(p2[:, None] * yv + (c02 * x0 + c12 * x1 + c22 * x2 + c32 * x3), out_ty, OUT_BF16)
            n3, f3 = _round_out(p3[:, None] * yv + (c03 * x0 + c13 * x1 + c23 * x2 + c33 * x3), out_ty, OUT_BF16)
            tl.store(xnew_ptr + xo, n0, mask=m2)
            tl.store(xnew_ptr + xo + D, n1, mask=m2)
            tl.store(xnew_ptr + xo + 2 * D, n2, mask=m2)
            tl.store(xnew_ptr + xo + 3 * D, n3, mask=m2)
            xh, _ = _round_out(q0[:, None] * f0 + q1[:, None] * f1 + q2[:, None] * f2 + q3[:, None] * f3,
                               out_ty, OUT_BF16)
            tl.store(xhat_ptr + yo, xh, mask=m2)
            if HAS_FN and TDOT:
                acc, comp, ss = _fn_partial_step_t(acc, comp, ss, f0, f1, f2, f3, fn_ptr, cols, cm, D, SPLIT)
            elif HAS_FN and FN_FIRST:
                acc, comp, ss = _fn_partial_step_w(acc, comp, ss, f0, f1, f2, f3, w0, w1, w2, w3, SPLIT)
            elif HAS_FN:
                acc, comp, ss = _fn_partial_step(acc, comp, ss, f0, f1, f2, f3, fn_ptr, offsets(kk, WIDE), kmask,
                                                 cols, cm, D, SPLIT)
        if HAS_FN:  # this chunk's share of m (with its Kahan residue) and of the sum of squares
            _store_partials(part_ptr, pcomp_ptr, pss_ptr, acc, comp, ss, ck, T, offsets(tok, WIDE), tm, TDOT)
            if FUSED:  # the tile's last chunk computes the coefficients (no second launch)
                _finish_coef(tile, count_ptr, part_ptr, pcomp_ptr, pss_ptr, scale_ptr, base_ptr, opre_ptr, opost_ptr,
                             ocomb_ptr, T, D, n_chunks, norm_eps, hc_eps, iters, BLOCK_T, CT, CB, WIDE,
                             xhat_ptr, nw_ptr, xn_ptr, rms_eps, NORM, BLOCK_N, OUT_BF16, x_ptr, pre_ptr, False)


@triton.jit
def _partials_init(BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, TDOT: tl.constexpr):
    """Zero (acc, comp, ss) of a work item: m's running sum and Kahan residue [BLOCK_T, 32] (with
    TDOT transposed, [TDOT_M, BLOCK_T]) and the elementwise sum of squares [BLOCK_T, BLOCK_D]."""
    if TDOT:
        acc = tl.zeros((TDOT_M, BLOCK_T), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_T, 32), dtype=tl.float32)
    return acc, tl.zeros_like(acc), tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)


@triton.jit
def _store_partials(part_ptr, pcomp_ptr, pss_ptr, acc, comp, ss, ck, T, tok, tm, TDOT: tl.constexpr):
    """Chunk ck's share of m, its Kahan residue ([chunks, T, 32]) and its sum of squares ([chunks,
    T]) for tokens `tok` (valid: tm); with TDOT the first 32 of acc's rows, transposed back."""
    if TDOT:
        rk = tl.arange(0, TDOT_M)
        po = (ck * T + tok)[None, :] * 32 + rk[:, None]
        pm = tm[None, :] & (rk[:, None] < 32)
    else:
        kk = tl.arange(0, 32)
        po = (ck * T + tok)[:, None] * 32 + kk[None, :]
        pm = tm[:, None]
    tl.store(part_ptr + po, acc, mask=pm)
    tl.store(pcomp_ptr + po, comp, mask=pm)
    tl.store(pss_ptr + ck * T + tok, tl.sum(ss, axis=1), mask=tm)


@triton.jit
def _fn_partial_step(acc, comp, ss, f0, f1, f2, f3, fn_ptr, krow, kmask, cols, cm, D, SPLIT: tl.constexpr):
    """One BLOCK_D slice of the mix projection for the four streams' rows f0..f3 [BLOCK_T,
    BLOCK_D]: the sum of squares (ss) and the dot products with fn's rows `krow` ([32], 24 valid:
    kmask) over columns `cols` (valid: cm), added to the Kahan-compensated (acc, comp)."""
    ss += f0 * f0 + f1 * f1 + f2 * f2 + f3 * f3
    fmask = kmask[:, None] & cm[None, :]
    fo = krow[:, None] * (4 * D) + cols[None, :]
    part = _fn_dot(f0, fn_ptr, fo, fmask, SPLIT) + _fn_dot(f1, fn_ptr, fo + D, fmask, SPLIT)
    part += _fn_dot(f2, fn_ptr, fo + 2 * D, fmask, SPLIT) + _fn_dot(f3, fn_ptr, fo + 3 * D, fmask, SPLIT)
    acc, comp = _kahan(acc, comp, part)
    return acc, comp, ss


@triton.jit
def _parts_dot(f, parts_ptr, fo, fmask, part_stride, SPLIT: tl.constexpr):
    """fn's parts at offsets fo [TDOT_M, BLOCK_D] (rows past 24 masked to zero) x f^T (f [BLOCK_T,
    BLOCK_D], exact in bf16) -> [TDOT_M, BLOCK_T] fp32: each part's dot from a zero accumulator,
    added (lo + mid) + hi as `_fn_dot_w` adds them. Without SPLIT (the interpreter) the parts are
    upcast and the dots are fp32 "ieee" ones."""
    hi = tl.load(parts_ptr + fo, mask=fmask, other=0.0)
    mid = tl.load(parts_ptr + part_stride + fo, mask=fmask, other=0.0)
    lo = tl.load(parts_ptr + 2 * part_stride + fo, mask=fmask, other=0.0)
    if SPLIT:
        fb = tl.trans(f.to(tl.bfloat16))
        return (tl.dot(lo, fb) + tl.dot(mid, fb)) + tl.dot(hi, fb)
    else:
        ft = tl.trans(f)
        return (tl.dot(lo.to(tl.float32), ft, input_precision="ieee")
                + tl.dot(mid.to(tl.float32), ft, input_precision="ieee")) \
            + tl.dot(hi.to(tl.float32), ft, input_precision="ieee")


@triton.jit
def _fn_partial_step_t(acc, comp, ss, f0, f1, f2, f3, parts_ptr, cols, cm, D, SPLIT: tl.constexpr):
    """`_fn_partial_step` transposed (TDOT): (acc, comp) are [TDOT_M, BLOCK_T] and fn comes as its
    bf16 parts [3, 24, 4D] (`fn_bf16_parts`)."""
    ss += f0 * f0 + f1 * f1 + f2 * f2 + f3 * f3
    rk = tl.arange(0, TDOT_M)
    fo = rk[:, None] * (4 * D) + cols[None, :]
    fmask = (rk < 24)[:, None] & cm[None, :]  # (N_MIX rows)
    ps = 24 * 4 * D
    part = _parts_dot(f0, parts_ptr, fo, fmask, ps, SPLIT) + _parts_dot(f1, parts_ptr, fo + D, fmask, ps, SPLIT)
    part += _parts_dot(f2, parts_ptr, fo + 2 * D, fmask, ps, SPLIT) + _parts_dot(f3, parts_ptr, fo + 3 * D, fmask,
                                                                                 ps, SPLIT)
    acc, comp = _kahan(acc, comp, part)
    return acc, comp, ss


@triton.jit
def _fn_slices(fn_ptr, krow, kmask, cols, cm, D):
    """The four streams' fn slices [32, BLOCK_D] (fp32) at columns `cols` (see _fn_partial_step)."""
    fo = krow[:, None] * (4 * D) + cols[None, :]
    fmask = kmask[:, None] & cm[None, :]
    return (tl.load(fn_ptr + fo, mask=fmask, other=0.0).to(tl.float32),
            tl.load(fn_ptr + fo + D, mask=fmask, other=0.0).to(tl.float32),
            tl.load(fn_ptr + fo + 2 * D, mask=fmask, other=0.0).to(tl.float32),
            tl.load(fn_ptr + fo + 3 * D, mask=fmask, other=0.0).to(tl.float32))


@triton.jit
def _fn_partial_step_w(acc, comp, ss, f0, f1, f2, f3, w0, w1, w2, w3, SPLIT: tl.constexpr):
    """`_fn_partial_step` with the fn slices already loaded (`_fn_slices`)."""
    ss += f0 * f0 + f1 * f1 + f2 * f2 + f3 * f3
    part = _fn_dot_w(f0, w0, SPLIT) + _fn_dot_w(f1, w1, SPLIT)
    part += _fn_dot_w(f2, w2, SPLIT) + _fn_dot_w(f3, w3, SPLIT)
    acc, comp = _kahan(acc, comp, part)
    return acc, comp, ss


@triton.jit
def _kahan(acc, comp, v):
    """One step of Kahan summation: (acc, comp) + v."""
    yk = v - comp
    tk = acc + yk
    return tk, (tk - acc) - yk


@triton.jit
def _load_chunks(ptr, offs, mask, CG: tl.constexpr):
    """A masked load of chunk partials; CG: from L2 (".cg": written by other programs of this launch)."""
    if CG:
        return tl.load(ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0)


@triton.jit
def _coef_tile(t0, part_ptr, pcomp_ptr, pss_ptr, scale_ptr, base_ptr, opre_ptr, opost_ptr, ocomb_ptr,
               T, D, n_chunks, norm_eps, hc_eps, iters, BLOCK_T: tl.constexpr, CB: tl.constexpr,
               WIDE: tl.constexpr, CG: tl.constexpr):
    """The coefficient epilogue of tokens t0 .. t0 + BLOCK_T - 1: adds the per-chunk partial dot
    products and sums of squares (CB chunks per step: tree sums inside a step, Kahan-compensated
    across steps, in chunk order), then the sigmoids and the Sinkhorn normalisation in registers.
    The Sinkhorn rounds are a serial chain per token, so BLOCK_T is small (COEF_T: one token per
    warp; 16 tokens put 4 chains on each thread, ~1000 instructions a round)."""
    kk = tl.arange(0, 32)
    kmask = kk < 24
    cb = tl.arange(0, CB)
    tok = t0 + tl.arange(0, BLOCK_T)
    tm = tok < T
    t4 = tok * 4
    t16 = tok * 16
    tok_o = offsets(tok, WIDE)
    acc = tl.zeros((BLOCK_T, 32), dtype=tl.float32)
    comp = tl.zeros((BLOCK_T, 32), dtype=tl.float32)
    ssum = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for c0 in range(0, n_chunks, CB):
        ck = c0 + cb
        m2 = (ck < n_chunks)[:, None] & tm[None, :]
        ro = offsets(ck, WIDE)[:, None] * T + tok_o[None, :]  # [CB, BLOCK_T] rows of [chunks * T, 32]
        po = ro[:, :, None] * 32 + kk[None, None, :]
        v = _load_chunks(part_ptr, po, m2[:, :, None], CG) - _load_chunks(pcomp_ptr, po, m2[:, :, None], CG)
        acc, comp = _kahan(acc, comp, tl.sum(v, axis=0))
        ssum += tl.sum(_load_chunks(pss_ptr, ro, m2, CG), axis=0)
    acc = acc - comp
    inv = tl.math.rsqrt(ssum / (4 * D) + norm_eps)
    base = tl.load(base_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
    s0 = tl.load(scale_ptr + 0).to(tl.float32)
    s1 = tl.load(scale_ptr + 1).to(tl.float32)
    s2 = tl.load(scale_ptr + 2).to(tl.float32)
    kf = as_cmp(kk)
    sel = tl.where(kf < 4.0, s0, tl.where(kf < 8.0, s1, s2))
    z = (acc * inv[:, None]) * sel[None, :] + base[None, :]  # scale * m + base
    sg = 1.0 / (1.0 + tl.exp(-z))
    tl.store(opre_ptr + t4[:, None] + kk[None, :], sg + hc_eps,
             mask=tm[:, None] & (kk[None, :] < 4))
    tl.store(opost_ptr + t4[:, None] + kk[None, :] - 4, 2.0 * sg,
             mask=tm[:, None] & (kk[None, :] >= 4) & (kk[None, :] < 8))
    a00, a01, a02, a03 = _softmax4(_col(z, kk, 8), _col(z, kk, 9), _col(z, kk, 10), _col(z, kk, 11), hc_eps)
    a10, a11, a12, a13 = _softmax4(_col(z, kk, 12), _col(z, kk, 13), _col(z, kk, 14), _col(z, kk, 15), hc_eps)
    a20, a21, a22, a23 = _softmax4(_col(z, kk, 16), _col(z, kk, 17), _col(z, kk, 18), _col(z, kk, 19), hc_eps)
    a30, a31, a32, a33 = _softmax4(_col(z, kk, 20), _col(z, kk, 21), _col(z, kk, 22), _col(z, kk, 23), hc_eps)
    a00, a10, a20, a30 = _norm4(a00, a10, a20, a30, hc_eps)  # columns
    a01, a11, a21, a31 = _norm4(a01, a11, a21, a31, hc_eps)
    a02, a12, a22, a32 = _norm4(a02, a12, a22, a32, hc_eps)
    a03, a13, a23, a33 = _norm4(a03, a13, a23, a33, hc_eps)
    for _ in range(1, iters):
        a00, a01, a02, a03 = _norm4(a00, a01, a02, a03, hc_eps)  # rows
        a10, a11, a12, a13 = _norm4(a10, a11, a12, a13, hc_eps)
        a20, a21, a22, a23 = _norm4(a20, a21, a22, a23, hc_eps)
        a30, a31, a32, a33 = _norm4(a30, a31, a32, a33, hc_eps)
        a00, a10, a20, a30 = _norm4(a00, a10, a20, a30, hc_eps)  # columns
        a01, a11, a21, a31 = _norm4(a01, a11, a21, a31, hc_eps)
        a02, a12, a22, a32 = _norm4(a02, a12, a22, a32, hc_eps)
        a03, a13, a23, a33 = _norm4(a03, a13, a23, a33, hc_eps)
    tl.store(ocomb_ptr + t16 + 0, a00, mask=tm)
    tl.store(ocomb_ptr + t16 + 1, a01, mask=tm)
    tl.store(ocomb_ptr + t16 + 2, a02, mask=tm)
    tl.store(ocomb_ptr + t16 + 3, a03, mask=tm)
    tl.store(ocomb_ptr + t16 + 4, a10, mask=tm)
    tl.store(ocomb_ptr + t16 + 5, a11, mask=tm)
    tl.store(ocomb_ptr + t16 + 6, a12, mask=tm)
    tl.store(ocomb_ptr + t16 + 7, a13, mask=tm)
    tl.store(ocomb_ptr + t16 + 8, a20, mask=tm)
    tl.store(ocomb_ptr + t16 + 9, a21, mask=tm)
    tl.store(ocomb_ptr + t16 + 10, a22, mask=tm)
    tl.store(ocomb_ptr + t16 + 11, a23, mask=tm)
    tl.store(ocomb_ptr + t16 + 12, a30, mask=tm)
    tl.store(ocomb_ptr + t16 + 13, a31, mask=tm)
    tl.store(ocomb_ptr + t16 + 14, a32, mask=tm)
    tl.store(ocomb_ptr + t16 + 15, a33, mask=tm)


@triton.jit
def _norm_rows(t0, xhat_ptr, nw_ptr, xn_ptr, T, D, rms_eps, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
               BF16: tl.constexpr, WIDE: tl.constexpr, CG: tl.constexpr, x_ptr, pre_ptr, COLLAPSE: tl.constexpr):
    """RMSNorm of x_hat rows t0 .. t0 + BLOCK_T - 1 (the next sublayer's normed input, as the
    `rms_norm` kernel computes it: fp32 math, one whole row at a time): x_hat and the output are
    bf16 bit patterns (int16) when BF16, fp32 otherwise; CG: x_hat was written by other programs
    of this launch (read from L2). COLLAPSE: x_hat is made here first, from the streams x [T, 4,
    D] and pre [T, 4] as the `mhc_collapse` kernel makes it, and stored."""
    cols = tl.arange(0, BLOCK_N)
    cm = cols < D
    for i in tl.static_range(BLOCK_T):
        tk = t0 + i
        m = cm & (tk < T)
        off = offsets(tk, WIDE) * D + cols
        if COLLAPSE:
            xo = offsets(tk, WIDE) * 4 * D + cols
            tv = tk < T
            acc = tl.load(pre_ptr + tk * 4, mask=tv, other=0.0).to(tl.float32) * \
                tl.load(x_ptr + xo, mask=m, other=0.0).to(tl.float32)
            acc += tl.load(pre_ptr + tk * 4 + 1, mask=tv, other=0.0).to(tl.float32) * \
                tl.load(x_ptr + xo + D, mask=m, other=0.0).to(tl.float32)
            acc += tl.load(pre_ptr + tk * 4 + 2, mask=tv, other=0.0).to(tl.float32) * \
                tl.load(x_ptr + xo + 2 * D, mask=m, other=0.0).to(tl.float32)
            acc += tl.load(pre_ptr + tk * 4 + 3, mask=tv, other=0.0).to(tl.float32) * \
                tl.load(x_ptr + xo + 3 * D, mask=m, other=0.0).to(tl.float32)
            if BF16:
                bits = bf16_bits16(acc)
                tl.store(xhat_ptr + off, bits, mask=m)
                xv = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
            else:
                tl.store(xhat_ptr + off, acc, mask=m)
                xv = acc
        elif BF16:
            xv = (_load_chunks(xhat_ptr, off, m, CG).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            xv = _load_chunks(xhat_ptr, off, m, CG).to(tl.float32)
        inv = tl.math.rsqrt(tl.sum(xv * xv, axis=0) / D + rms_eps)
        # (the weight loaded per row, from L1: one [BLOCK_N] row live at a time, as in `rms_norm`)
        yv = xv * inv * tl.load(nw_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        if BF16:
            tl.store(xn_ptr + off, bf16_bits16(yv), mask=m)
        else:
            tl.store(xn_ptr + off, yv, mask=m)


@triton.jit
def _finish_coef(tile, count_ptr, part_ptr, pcomp_ptr, pss_ptr, scale_ptr, base_ptr, opre_ptr, opost_ptr, ocomb_ptr,
                 T, D, n_chunks, norm_eps, hc_eps, iters, BLOCK_T: tl.constexpr, CT: tl.constexpr, CB: tl.constexpr,
                 WIDE: tl.constexpr, xhat_ptr, nw_ptr, xn_ptr, rms_eps, NORM: tl.constexpr, BLOCK_N: tl.constexpr,
                 BF16: tl.constexpr, x_ptr, pre_ptr, COLLAPSE: tl.constexpr):
    """After a program stored its chunk's partials of token tile `tile`: bump the tile's counter
    (acq_rel, after a CTA barrier); the program that completes the tile runs its coefficient
    epilogue (reading every chunk from L2), with NORM the RMSNorm of the tile's x_hat rows
    (`_norm_rows`), and resets the counter to 0 (one launch, no second kernel)."""
    tl.debug_barrier()  # every thread's partials are stored before the counter moves
    done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
    if done == n_chunks - 1:
        for t0 in range(tile * BLOCK_T, tl.minimum(T, tile * BLOCK_T + BLOCK_T), CT):  # CT tokens at a time
            _coef_tile(t0, part_ptr, pcomp_ptr, pss_ptr, scale_ptr, base_ptr, opre_ptr, opost_ptr, ocomb_ptr,
                       T, D, n_chunks, norm_eps, hc_eps, iters, CT, CB, WIDE, True)
            if NORM:
                _norm_rows(t0, xhat_ptr, nw_ptr, xn_ptr, T, D, rms_eps, CT, BLOCK_N, BF16, WIDE, True, x_ptr, pre_ptr,
                           COLLAPSE)
        tl.atomic_xchg(count_ptr + tile, 0)


@triton.jit
def _mhc_coef_kernel(part_ptr, pcomp_ptr, pss_ptr, scale_ptr, base_ptr, opre_ptr, opost_ptr, ocomb_ptr,
                     xhat_ptr, nw_ptr, xn_ptr, x_ptr, pre_ptr, T, D, n_chunks, norm_eps, hc_eps, iters, rms_eps,
                     n_tiles, num_programs, BLOCK_T: tl.constexpr, CB: tl.constexpr, WIDE: tl.constexpr,
                     NORM: tl.constexpr, BLOCK_N: tl.constexpr, BF16: tl.constexpr, COLLAPSE: tl.constexpr,
                     NORM_FIRST: tl.constexpr = False, PDL: tl.constexpr = 0):
    """The coefficient epilogue as its own launch (the unfused path: Ascend, or fused=False), BLOCK_T
    tokens per work item; with NORM also the RMSNorm of their x_hat rows (`_norm_rows`). NORM_FIRST
    (BLOCK_T == 1, no collapse): the x_hat row's loads go out before the chunk sums' and the
    Sinkhorn chain, so their latency overlaps it."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    for tile in range(pid, n_tiles, num_programs):
        if NORM and NORM_FIRST:  # one token: its x_hat row and the weight requested before the chain
            xv, wv = _norm_row_load(tile, xhat_ptr, nw_ptr, T, D, BLOCK_N, BF16, WIDE)
        _coef_tile(tile * BLOCK_T, part_ptr, pcomp_ptr, pss_ptr, scale_ptr, base_ptr, opre_ptr, opost_ptr, ocomb_ptr,
                   T, D, n_chunks, norm_eps, hc_eps, iters, BLOCK_T, CB, WIDE, False)
        if NORM and NORM_FIRST:
            _norm_row_store(tile, xv, wv, xn_ptr, T, D, rms_eps, BLOCK_N, BF16, WIDE)
        elif NORM:
            _norm_rows(tile * BLOCK_T, xhat_ptr, nw_ptr, xn_ptr, T, D, rms_eps, BLOCK_T, BLOCK_N, BF16, WIDE, False,
                       x_ptr, pre_ptr, COLLAPSE)


@triton.jit
def _norm_row_load(tk, xhat_ptr, nw_ptr, T, D, BLOCK_N: tl.constexpr, BF16: tl.constexpr, WIDE: tl.constexpr):
    """Token tk's x_hat row (fp32 [BLOCK_N], zero past D) and the norm weight, as `_norm_rows` reads them."""
    cols = tl.arange(0, BLOCK_N)
    cm = cols < D
    off = offsets(tk + 0 * cols, WIDE) * D + cols  # (tk + 0 * cols: a tensor also where tk is a plain int)
    if BF16:
        xv = (tl.load(xhat_ptr + off, mask=cm & (tk < T), other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        xv = tl.load(xhat_ptr + off, mask=cm & (tk < T), other=0.0).to(tl.float32)
    return xv, tl.load(nw_ptr + cols, mask=cm, other=0.0).to(tl.float32)


@triton.jit
def _norm_row_store(tk, xv, wv, xn_ptr, T, D, rms_eps, BLOCK_N: tl.constexpr, BF16: tl.constexpr,
                    WIDE: tl.constexpr):
    """RMSNorm of a row from `_norm_row_load`, stored as `_norm_rows` stores it (same fp32 math)."""
    cols = tl.arange(0, BLOCK_N)
    m = (cols < D) & (tk < T)
    inv = tl.math.rsqrt(tl.sum(xv * xv, axis=0) / D + rms_eps)
    yv = xv * inv * wv
    off = offsets(tk + 0 * cols, WIDE) * D + cols
    if BF16:
        tl.store(xn_ptr + off, bf16_bits16(yv), mask=m)
    else:
        tl.store(xn_ptr + off, yv, mask=m)


def coef_chunk_block(block_t: int = COEF_T) -> int:
    """Chunks per reduction step of the coefficient epilogue: a [CB, BLOCK_T, 32] fp32 tile of
    about 4096 values (32 registers a thread at 4 warps)."""
    return max(1, 4096 // (32 * block_t))


def launch_coef(part, pcomp, pss, scale, base, opre, opost, ocomb, t, d, n_chunks, norm_eps, hc_eps, iters,
                wide, ct: int = COEF_T, norm: tuple | None = None, early: bool | None = None,
                cb: int | None = None) -> None:
    """The unfused coefficient launch: one program per token tile of `ct` tokens (persistent over
    tiles). `norm` = (x_hat, weight, out, eps[, x, pre]): the tiles also write rms_norm(x_hat) to
    out (x_hat / out as bf16 bit patterns, int16, or fp32); with x [T, 4, d] and pre [T, 4], x_hat
    is written first, as mhc_collapse(x, pre)."""
    from .launch import grid_for, interpreting

    n_tiles = -(-t // ct)
    cgrid = grid_for(n_tiles, part.device)
    xh, nw, xn, rms_eps, *collapse = norm if norm is not None else (part, part, part, 0.0)
    xs, pre = collapse if collapse else (part, part)
    _mhc_coef_kernel[(cgrid,)](part, pcomp, pss, scale, base, opre, opost, ocomb, xh, nw, xn, xs, pre, t, d, n_chunks,
                               float(norm_eps), float(hc_eps), int(iters), float(rms_eps), n_tiles, cgrid,
                               BLOCK_T=ct, CB=cb or coef_chunk_block(ct), WIDE=wide, NORM=norm is not None,
                               BLOCK_N=triton.next_power_of_2(d), BF16=xh.dtype == torch.int16,
                               COLLAPSE=bool(collapse),
                               NORM_FIRST=(EARLY_LOADS and part.device.type == "cuda" if early is None else early)
                               and ct == 1 and not collapse,
                               **({} if interpreting() else {"num_warps": 4}), **pdl_launch(part))


def coef_launch(device: torch.device, part, pcomp, pss, *rest, norm: tuple | None = None, **kw) -> None:
    """`launch_coef(part, pcomp, pss, *rest, norm=norm, **kw)`, on the side lane MHC_COEF_LANE
    (`backends.platform.mhc_coef_lane_forks`: CUDA unless DSV41_MHC_COEF_LANE=0, and only inside
    `mhc_coef_lane_scope`, whose code joins the lane before reading coefficients: the model's
    forward) when nothing waits for it at once (no `norm`: a normed output is the next
    sublayer's input); else on the calling stream (an op called on its own returns ready
    coefficients). The lane reads the chunk partials (part, pcomp, pss) that the calling stream
    wrote and that nobody holds afterwards: the fork marks them as used on the lane (`reads`), so
    their memory is not handed out again before it is done. Same bits as on the calling stream,
    eagerly and in a CUDA graph (tests/test_triton_mega_mhc.py, H100 2026-12-07)."""
    from ...backends.platform import MHC_COEF_LANE, cached_platform, mhc_coef_lane_forks
    from .launch import interpreting

    if norm is not None or interpreting() or not mhc_coef_lane_forks(device.type):
        launch_coef(part, pcomp, pss, *rest, norm=norm, **kw)
        return
    cached_platform(device).fork(lambda: launch_coef(part, pcomp, pss, *rest, norm=norm, **kw),
                                 lane=MHC_COEF_LANE, reads=(part, pcomp, pss))


def split_bf16_parts(fn: torch.Tensor) -> torch.Tensor:
    """fp32 fn [24, k] as [3, 24, k] bf16 (hi, mid, lo): the split `_fn_dot_w` does in registers
    (hi = bf16(fn), mid = bf16(fn - hi), lo = bf16(fn - hi - mid), each difference exact in fp32),
    so the parts' products are the ones the kernel's own split gives. hi + mid + lo == fn while lo
    stays a normal bf16 (|fn| above ~2^-110; bits below 2^-133 are lost either way)."""
    hi = fn.to(torch.bfloat16)
    r1 = fn - hi.float()
    mid = r1.to(torch.bfloat16)
    return torch.stack((hi, mid, (r1 - mid.float()).to(torch.bfloat16)))


def fn_bf16_parts(fn: torch.Tensor) -> torch.Tensor:
    """`split_bf16_parts(fn)`, kept on the fn tensor and made again when fn changes in place (its
    version counter; an inference tensor has none and can only change inside inference mode, where
    nothing counts it: its parts are kept for good): one split per weight, not one per call. While
    a CUDA graph is being captured an uncached fn is split inside the graph and not kept (the
    split's kernels would only run at replay); the engines run every step eagerly before capturing
    it, so that does not happen there."""
    try:
        version = fn._version
    except RuntimeError:  # an inference tensor (made under torch.inference_mode) has no version counter
        version = None
    hit = getattr(fn, "_dsv41_bf16_parts", None)
    if hit is not None and hit[0] == version:
        return hit[1]
    parts = split_bf16_parts(fn)
    if not (fn.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        fn._dsv41_bf16_parts = (version, parts)
    return parts


def mhc_mix(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, pre: torch.Tensor,
            fn: torch.Tensor | None, scale: torch.Tensor | None, base: torch.Tensor | None,
            norm_eps: float, hc_eps: float, iters: int, *, block_t: int | None = None,
            block_d: int | None = None, num_warps: int | None = None, workers: int | None = None,
            split: bool | None = None, d_split: int | None = None, num_stages: int | None = None,
            fused: bool | None = None, norm: tuple | None = None, early: bool | None = None,
            chunk_block: int | None = None, tdot: bool | None = None, sized_tiles: bool = True):
    """`ops.mhc_mix` in one pass: x [T, 4, d], y [T, d], post/pre [T, 4], comb [T, 4, 4];
    fn [24, 4d] fp32, scale [3], base [24] (or fn None). Returns (x_new [T, 4, d] in x's dtype,
    x_hat [T, d] in x's dtype, (pre, post, comb) fp32 or None). The keyword-only tile
    parameters are for tuning and default to this module's table; `fused` computes the
    coefficients in the main kernel's last program per token tile instead of a second launch
    (default: DSV41_MHC_COEF, see coef_mode); `early` (default EARLY_LOADS on CUDA devices)
    issues the decode kernels' independent loads first; `chunk_block` fixes the chunk partials the
    coefficient epilogue adds per step (default `coef_chunk_block` of its tokens per tile, which
    follows T: batch-invariant mode fixes it). `tdot` (default: `tiles_for`'s; bf16 streams with
    fn only): the transposed projection on fn's cached bf16 parts (TDOT_M); `sized_tiles=False`
    keeps the table's tiles whatever T (`tiles_for`). `norm` = (weight [d], eps), with
    `fn` only: the coefficient epilogue also writes rms_norm(x_hat, weight, eps), returned as a
    fourth value (`mhc_mix_norm`)."""
    from .launch import grid_for, interpreting, needs_int64, num_workers

    if x.dim() != 3 or x.shape[1] != N_STREAMS:
        raise ValueError(f"x must be [T, {N_STREAMS}, d], got {tuple(x.shape)}")
    t, n, d = x.shape
    if y.shape != (t, d):
        raise ValueError(f"y must be [{t}, {d}], got {tuple(y.shape)}")
    if post.shape != (t, n) or pre.shape != (t, n) or comb.shape != (t, n, n):
        raise ValueError(f"post/pre must be [{t}, {n}] and comb [{t}, {n}, {n}], got "
                         f"{tuple(post.shape)}, {tuple(pre.shape)}, {tuple(comb.shape)}")
    has_fn = fn is not None
    if has_fn and (fn.shape != (N_MIX, n * d) or scale.numel() != 3 or base.numel() != N_MIX):
        raise ValueError(f"fn must be [{N_MIX}, {n * d}], scale [3], base [{N_MIX}]")
    if norm is not None and (not has_fn or norm[0].shape != (d,)):
        raise ValueError(f"norm needs fn and a weight [{d}], got fn {'set' if has_fn else 'None'}, weight "
                         f"{tuple(norm[0].shape)}")
    x, y = x.contiguous(), y.contiguous()
    post, comb, pre = post.contiguous(), comb.contiguous(), pre.contiguous()
    x_new = torch.empty_like(x)
    x_hat = torch.empty(t, d, dtype=x.dtype, device=x.device)
    xnew_arg, xhat_arg = (x_new.view(torch.int16), x_hat.view(torch.int16)) if x.dtype == torch.bfloat16 \
        else (x_new, x_hat)  # bf16 results are stored as their bit patterns
    if has_fn:
        fn, scale, base = fn.contiguous(), scale.contiguous(), base.contiguous()
        opre = torch.empty(t, n, dtype=torch.float32, device=x.device)
        opost = torch.empty(t, n, dtype=torch.float32, device=x.device)
        ocomb = torch.empty(t, n, n, dtype=torch.float32, device=x.device)
    else:
        fn = scale = base = opre = opost = ocomb = x_hat  # unused placeholders
    x_norm = torch.empty(t, d, dtype=x.dtype, device=x.device) if norm is not None else None
    done = (x_new, x_hat, ((opre, opost, ocomb) if has_fn else None)) + ((x_norm,) if norm is not None else ())
    if t == 0:
        return done
    tiles = tiles_for(t, x.device, sized_tiles)
    bt = block_t or tiles["block_t"]
    bd = block_d or min(tiles["block_d"], triton.next_power_of_2(d))
    # d chunks per token tile: enough work items to fill the device (each chunk a whole number
    # of BLOCK_D slices); the chunk partials of m meet in the coefficient kernel
    n_tiles = -(-t // bt)
    slices = -(-d // bd)
    # at least the table's split, more when few token tiles would leave workers idle (T=64:
    # 4 tiles; H200 sweep: 8 -> 16 chunks took 70 -> 42 us)
    cores = "cube" if has_fn else "vector"  # the fn dot products run on tl.dot: AI cores on Ascend
    want = d_split or max(tiles["d_split"], -(-2 * num_workers(x.device, cores) // n_tiles))
    chunk = bd * -(-slices // want)
    n_chunks = -(-d // chunk)
    n_items = n_tiles * n_chunks
    grid = min(n_items, workers) if workers else grid_for(n_items, x.device, cores)
    if split is None:
        split = (not interpreting()) and x.dtype == torch.bfloat16
    tdot = (tiles["tdot"] if tdot is None else tdot) and has_fn and x.dtype == torch.bfloat16
    fn_arg = fn_bf16_parts(fn) if tdot else fn
    kw = {} if interpreting() else {"num_warps": num_warps or tiles["num_warps"],
                                    "num_stages": num_stages or tiles["num_stages"]}
    wide = needs_int64(x, fn if has_fn else None)
    fused_default, narrow = coef_mode()
    if fused is None:
        fused = fused_default
    fused = fused and has_fn
    if early is None:  # (CUDA only by default: on Ascend the four fn slices at once are unmeasured UB)
        early = EARLY_LOADS and x.device.type == "cuda"
    ct = coef_tokens(t, narrow, fused)
    if has_fn:
        part = torch.empty(n_chunks, t, 32, dtype=torch.float32, device=x.device)
        pcomp = torch.empty_like(part)
        pss = torch.empty(n_chunks, t, dtype=torch.float32, device=x.device)
    else:
        part = pcomp = pss = x_hat  # unused placeholders
    counts = tile_counters(x.device, n_tiles) if fused else x_hat
    cb = chunk_block or coef_chunk_block(ct)
    if norm is not None:
        nw = norm[0].contiguous()
        xn_arg = x_norm.view(torch.int16) if x.dtype == torch.bfloat16 else x_norm
    else:
        nw = xn_arg = x_hat  # unused placeholders
    _mhc_mix_kernel[(grid,)](x, y, post, comb, pre, fn_arg, scale, base, xnew_arg, xhat_arg, part, pcomp, pss, counts,
                             opre, opost, ocomb, nw, xn_arg, t, d, chunk, n_chunks, n_items, grid, float(norm_eps),
                             float(hc_eps), int(iters), float(norm[1]) if norm is not None else 0.0, BLOCK_T=bt,
                             BLOCK_D=bd, HAS_FN=has_fn, SPLIT=split, OUT_BF16=x.dtype == torch.bfloat16, WIDE=wide,
                             FUSED=fused, CT=ct, CB=cb, NORM=norm is not None, BLOCK_N=triton.next_power_of_2(d),
                             FN_FIRST=early and n_tiles == 1 and chunk == bd, TDOT=tdot, **kw, **pdl_launch(x))
    if has_fn and not fused:
        coef_launch(x.device, part, pcomp, pss, scale, base, opre, opost, ocomb, t, d, n_chunks, norm_eps, hc_eps,
                    iters, wide, ct, norm=(xhat_arg, nw, xn_arg, norm[1]) if norm is not None else None, early=early,
                    cb=cb)
    return done


OPS = {"mhc_mix": mhc_mix}
