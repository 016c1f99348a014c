"""MoE router in one kernel: fp32 logits x @ W^T, sqrt(softplus(logits / gate_temp)), + bias to
choose the top-k (ties to the lower expert id), weights = chosen raw scores, divided by
(sum + 1e-20) when `norm_topk_prob` and top-k > 1, times route_scale. Matches `moe_route_ref`
(= backends.reference.moe.moe_route) within fp32 rounding.

Work split (one launch): tiles are (BLOCK_T tokens) x (BLOCK_E experts) x (K slices: one, or a
few on CUDA when there are few tiles, `_k_splits`); each tile computes its partial logits over
its slice of the hidden size (K loop, fp32 accumulation) and writes them to an fp32 scratch
[slices, T, E]. After a CTA barrier, the tile bumps an int32 counter of its token block
(atomic_add, acq_rel); the tile that completes a token block (counter == expert blocks x slices
- 1) reads the block's partial logit rows back (".cg": from L2, not a stale L1), sums the slices
in slice order, and does the routing: softplus
(x for x > 20 as torch, else log1p(exp(x)) with the accurate log1p(u) = log(1+u) * u / ((1+u)-1)),
sqrt, + bias, then k rounds of "max, lowest id among the max, mask it out". Every partial logit
comes from exactly one tile and the slices are summed in a fixed order (no float atomics), so the
result is deterministic. The counters are the device's shared `tile_counters` (zero between
calls: the completing tile resets its block's counter), so a call launches no memset; on Ascend
a zeroed buffer per call. With `image_bias`, image tokens (`is_image`) choose with it instead of
`bias`, selected per row inside the routing (no [T, E] bias made per layer).

Dot precision: compiled, the operands are bf16 with fp32 accumulation. The gate weight is bf16
(exact); x is split into SPLITS bf16 terms (hi + mid + lo) so that every product is exact: 1 term
for bf16 x, 2 for fp16, 3 for fp32 (24 bits = 3 x 8). A non-bf16 weight, and every run under
TRITON_INTERPRET=1 (bf16 math is broken there), uses fp32 dots with input_precision="ieee".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends.reference import moe as ref_moe
from .pdl import pdl_launch, pdl_start
from .fp4_common import as_cmp, offsets, split_dot_acc


def moe_route_ref(x, gate_weight, bias, topk, route_scale, gate_temp=1.0, norm_topk_prob=True, image_bias=None,
                  is_image=None):
    """The torch reference."""
    return ref_moe.moe_route(x, gate_weight, bias, topk, route_scale, gate_temp, norm_topk_prob, image_bias, is_image)


@triton.jit
def _route_rows(lg, rows, rmask, ecols, em, kcols, bias_ptr, vl_ptr, img_ptr, bias_stride_t, wout_ptr, iout_ptr,
                gate_temp, route_scale, TOPK: tl.constexpr, NORM: tl.constexpr, BLOCK_T: tl.constexpr,
                KP: tl.constexpr, EP: tl.constexpr, WIDE: tl.constexpr, HAS_IMG: tl.constexpr):
    """The routing of finished logit rows lg [BLOCK_T, EP] (rows `rows`, valid `rmask`; experts
    `ecols`, valid `em`): scores, biased choice (HAS_IMG: image rows, img_ptr, with the image
    bias vl_ptr), top-k rounds, normalisation; stores weights / ids."""
    m2 = rmask[:, None] & em[None, :]
    lg = lg / gate_temp
    u = tl.exp(tl.minimum(lg, 20.0))  # (the clamp only avoids inf in the unused branch)
    v = 1.0 + u
    lp = tl.where(v == 1.0, u, tl.log(v) * (u / tl.where(v == 1.0, 1.0, v - 1.0)))  # log1p(u)
    sp = tl.where(lg > 20.0, lg, lp)  # torch softplus, threshold 20
    score = tl.sqrt(sp)
    b_off = offsets(rows, WIDE)[:, None] * bias_stride_t + ecols[None, :]
    b = tl.load(bias_ptr + b_off, mask=m2, other=0.0).to(tl.float32)
    if HAS_IMG:  # image tokens choose with the image bias
        img = tl.load(img_ptr + rows, mask=rmask, other=0) != 0
        b = tl.where(img[:, None], tl.load(vl_ptr + b_off, mask=m2, other=0.0).to(tl.float32), b)
    choice = tl.where(em[None, :], score + b, float("-inf"))
    wk = tl.zeros([BLOCK_T, KP], dtype=tl.float32)
    ik = tl.zeros([BLOCK_T, KP], dtype=tl.int32)
    for r in tl.static_range(TOPK):
        best = tl.max(choice, axis=1)
        idx = tl.min(tl.where(choice == best[:, None], ecols[None, :], EP), axis=1)
        hit = as_cmp(ecols)[None, :] == as_cmp(idx)[:, None]  # ids < EP: exact in fp32
        wv = tl.sum(tl.where(hit, score, 0.0), axis=1)
        choice = tl.where(hit, float("-inf"), choice)
        at_r = as_cmp(kcols)[None, :] == r
        wk = tl.where(at_r, wv[:, None], wk)
        ik = tl.where(at_r, idx[:, None], ik)
    if NORM:  # norm_topk_prob and TOPK > 1 (decided by the launcher)
        total = tl.sum(wk, axis=1)
        wk = wk / (total + 1e-20)[:, None]
    wk = wk * route_scale
    om = rmask[:, None] & (kcols[None, :] < TOPK)
    out = offsets(rows, WIDE)[:, None] * TOPK + kcols[None, :]
    tl.store(wout_ptr + out, wk, mask=om)
    tl.store(iout_ptr + out, ik.to(tl.int64), mask=om)


@triton.jit
def _moe_route_kernel(x_ptr, w_ptr, bias_ptr, vl_ptr, img_ptr, logit_ptr, count_ptr, wout_ptr, iout_ptr,
                      T, E, K, bias_stride_t, gate_temp, route_scale, n_eb, n_ks, KS, n_tiles, num_programs,
                      TOPK: tl.constexpr, NORM: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                      SPLITS: tl.constexpr, LOWP: tl.constexpr, WIDE: tl.constexpr, HAS_IMG: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    pid = tl.program_id(0)
    bt = tl.arange(0, BLOCK_T)
    be = tl.arange(0, BLOCK_E)
    bk = tl.arange(0, BLOCK_K)
    ecols = tl.arange(0, EP)
    kcols = tl.arange(0, KP)
    per_tb = n_eb * n_ks
    for tile in range(pid, n_tiles, num_programs):
        tb = tile // per_tb
        rem = tile - tb * per_tb
        eb = rem // n_ks
        ks = rem - eb * n_ks
        rows = tb * BLOCK_T + bt
        rmask = rows < T
        es = eb * BLOCK_E + be
        emask = es < E
        xrow = offsets(rows, WIDE) * K
        wrow = offsets(es, WIDE) * K
        acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        k_lo = ks * KS
        k_hi = tl.minimum(K, k_lo + KS)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kc = k0 + bk
            kmask = kc < k_hi
            x = tl.load(x_ptr + xrow[:, None] + kc[None, :], mask=rmask[:, None] & kmask[None, :],
                        other=0.0).to(tl.float32)
            w = tl.load(w_ptr + wrow[None, :] + kc[:, None], mask=kmask[:, None] & emask[None, :],
                        other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_E]
            acc = split_dot_acc(acc, x, w, SPLITS, LOWP)
        # this K slice's partial logits: scratch [n_ks, T, E]
        tl.store(logit_ptr + offsets(ks * T + rows, WIDE)[:, None] * E + es[None, :], acc,
                 mask=rmask[:, None] & emask[None, :])
        tl.debug_barrier()  # every thread's logits are written before the release below
        done = tl.atomic_add(count_ptr + tb, 1, sem="acq_rel")
        if done == per_tb - 1:  # this tile completed token block tb: route it
            em = ecols < E
            m2 = rmask[:, None] & em[None, :]
            lg = tl.zeros([BLOCK_T, EP], dtype=tl.float32)
            for s in range(0, n_ks):  # the K slices' partials in slice order (deterministic)
                lg += tl.load(logit_ptr + offsets(s * T + rows, WIDE)[:, None] * E + ecols[None, :], mask=m2,
                              other=0.0, cache_modifier=".cg")
            _route_rows(lg, rows, rmask, ecols, em, kcols, bias_ptr, vl_ptr, img_ptr, bias_stride_t, wout_ptr,
                        iout_ptr, gate_temp, route_scale, TOPK, NORM, BLOCK_T, KP, EP, WIDE, HAS_IMG)
            # the block's counter back to zero for the next call (`tile_counters`): every tile of
            # the block has counted, so nothing else touches it in this launch
            tl.store(count_ptr + tb, 0)


@triton.jit
def _moe_route_small_kernel(x_ptr, w_ptr, bias_ptr, vl_ptr, img_ptr, logit_ptr, count_ptr, wout_ptr, iout_ptr,
                            T, E, K, bias_stride_t, gate_temp, route_scale, n_ks, KS,
                            TOPK: tl.constexpr, NORM: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, KSP: tl.constexpr, WIDE: tl.constexpr,
                            HAS_IMG: tl.constexpr, PDL: tl.constexpr = 0):
    """The router for a few tokens (decode: T * experts small): one program per K slice, all
    tokens and experts at once, products on the CUDA cores (fp32, exact for bf16 operands) summed
    per slice; the slice's partial logits [T, E] go to scratch, and the program that finishes last
    (a self-resetting counter: no memset launch) loads every slice's partials in one [KSP, T, E]
    read, sums them (a fixed tree: deterministic) and routes. Short critical path: one K slice
    of loads, one atomic, one L2 read, the routing."""
    pdl_start(PDL)
    ks = tl.program_id(0)
    rows = tl.arange(0, BLOCK_T)
    rmask = rows < T
    ecols = tl.arange(0, EP)
    em = ecols < E
    kcols = tl.arange(0, KP)
    bk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_T, EP], dtype=tl.float32)
    k_lo = ks * KS
    k_hi = tl.minimum(K, k_lo + KS)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kc = k0 + bk
        kmask = kc < k_hi
        x = tl.load(x_ptr + offsets(rows, WIDE)[:, None] * K + kc[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offsets(ecols, WIDE)[:, None] * K + kc[None, :], mask=em[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    m2 = rmask[:, None] & em[None, :]
    tl.store(logit_ptr + (ks * T + offsets(rows, WIDE))[:, None] * E + ecols[None, :], acc, mask=m2)
    tl.debug_barrier()  # every thread's logits are written before the release below
    done = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    if done == n_ks - 1:  # the last slice: sum all slices' partials and route
        sl = tl.arange(0, KSP)
        po = (sl[:, None, None] * T + offsets(rows, WIDE)[None, :, None]) * E + ecols[None, None, :]
        parts = tl.load(logit_ptr + po, mask=(sl[:, None, None] < n_ks) & m2[None, :, :], other=0.0,
                        cache_modifier=".cg")
        _route_rows(tl.sum(parts, axis=0), rows, rmask, ecols, em, kcols, bias_ptr, vl_ptr, img_ptr, bias_stride_t,
                    wout_ptr, iout_ptr, gate_temp, route_scale, TOPK, NORM, BLOCK_T, KP, EP, WIDE, HAS_IMG)
        tl.atomic_xchg(count_ptr, 0)


def ub_tiles(bt: int, be: int, bk: int, n_experts: int, topk: int) -> dict[str, tuple[int, ...]]:
    """Live tiles of one program at its peak: the x / weight K-slices and the logit accumulator
    (the dot), then the routing of a completed token block over all experts (logits, scores,
    choice, bias, hit masks) and the top-k weights / ids."""
    ep, kp = _pow2(n_experts), _pow2(topk)
    return {"x": (bt, bk), "w": (bk, be), "acc": (bt, be), "logits": (bt, ep), "score": (bt, ep),
            "choice": (bt, ep), "bias": (bt, ep), "hit": (bt, ep), "wk": (bt, kp), "ik": (bt, kp)}


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _config(t: int, e: int, device) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_E, BLOCK_K, num_warps)."""
    from .launch import interpreting

    if interpreting():
        return 16, 16, 64, 4
    kind = device.split(":")[0] if isinstance(device, str) else torch.device(device).type  # "npu" needs no torch_npu
    on_npu = kind == "npu"
    if on_npu:
        # the routing stage holds ~5 [BLOCK_T, E] fp32 tiles (E = 384 -> 512 padded): 8 rows keep
        # one program inside half the 192 KB unified buffer (tests/test_triton_ub.py);
        # unverified on hardware (the cube unit's fractal is 16 rows; triton-ascend pads the dot)
        return 8, 16, 128, 4
    bt = 16 if t <= 16 else (32 if t <= 128 else 64)
    return bt, 32 if t > 128 else 16, 128, 4


# Split-K on CUDA when the token x expert tiles are this few: one program's K loop over the whole
# hidden size is a serial chain of loads (T = 1, 16 experts: one tile of 40 steps, 18 us per call
# on the H200 in a decode profile, 2026-11-30); the slices' partial logits are summed in slice
# order by the tile that completes the token block. Not measured yet with the split.
SPLIT_BELOW_TILES = 32
MAX_K_SPLITS = 8


def _k_splits(n_tiles: int, k: int, bk: int, want: int | None, device) -> int:
    """K slices per (token block, expert block) tile: `want` if given, else MAX_K_SPLITS on CUDA
    for fewer than SPLIT_BELOW_TILES tiles, 1 otherwise (Ascend and the interpreter keep one)."""
    from .launch import interpreting

    if want is not None:
        return max(1, min(int(want), -(-k // bk)))
    kind = device.split(":")[0] if isinstance(device, str) else torch.device(device).type
    if interpreting() or kind != "cuda" or n_tiles >= SPLIT_BELOW_TILES:
        return 1
    return max(1, min(MAX_K_SPLITS, -(-k // bk)))


# The router kernel for few tokens, chosen once per process: DSV41_MOE_ROUTE = "tiled" (default:
# `_moe_route_kernel`) or "small" (`_moe_route_small_kernel` where it fits: tokens x experts <=
# SMALL_MAX_TE on CUDA). Default "tiled": on the H200 (benchmarks/dense_ab.py, 2026-12-01) "small"
# tied at 1-2 tokens (9.7 vs 9.9 us) and lost at 4-8 (12.0 / 14.2 vs 9.6 / 9.7).
MOE_ROUTE_MODES = ("tiled", "small")
SMALL_MAX_TE = 128  # BLOCK_T * EP: the [slices, T, E] partials of the final sum stay in registers
SMALL_MAX_SLICES = 64  # K slices (programs) of the small kernel
SMALL_PRODUCT = 2048  # BLOCK_T * EP * BLOCK_K: the per-step product tile
_ROUTE_MODE: list = []


def route_mode() -> str:
    """The DSV41_MOE_ROUTE choice, read once per process (one clear error for an unknown one)."""
    import os

    if not _ROUTE_MODE:
        mode = os.environ.get("DSV41_MOE_ROUTE", "tiled") or "tiled"
        if mode not in MOE_ROUTE_MODES:
            raise ValueError(f"DSV41_MOE_ROUTE: unknown mode {mode!r} (one of {', '.join(MOE_ROUTE_MODES)})")
        _ROUTE_MODE.append(mode)
    return _ROUTE_MODE[0]


def small_fits(t: int, e: int) -> bool:
    """Whether the few-token kernel takes T tokens over E experts."""
    return _pow2(t) * _pow2(e) <= SMALL_MAX_TE


def moe_route_small(x, gate_weight, bias, bias_stride, weights, ids, topk, route_scale, gate_temp, norm_topk_prob,
                    block_k: int | None = None, slices: int | None = None, image: tuple | None = None) -> None:
    """Launch `_moe_route_small_kernel` into weights / ids (`block_k`, `slices`: tuning; `image`:
    (image bias, is_image as uint8) for image rows)."""
    from .launch import interpreting, needs_int64, tile_counters

    t, d = x.shape
    e = gate_weight.shape[0]
    bt, ep = _pow2(t), _pow2(e)
    if bt * ep > SMALL_MAX_TE:
        raise ValueError(f"moe_route small kernel: {t} tokens x {e} experts over {SMALL_MAX_TE}")
    bk = block_k or max(16, min(128, SMALL_PRODUCT // (bt * ep)))
    steps = -(-d // bk)
    n_ks = max(1, min(slices or SMALL_MAX_SLICES, steps))
    ks_len = bk * -(-steps // n_ks)
    n_ks = -(-d // ks_len)
    logits = torch.empty(n_ks, t, e, dtype=torch.float32, device=x.device)
    counts = tile_counters(x.device, 1)
    extra = {} if interpreting() else {"num_warps": 4}
    _moe_route_small_kernel[(n_ks,)](
        x.contiguous(), gate_weight.contiguous(), bias.contiguous(), *(image or (bias, bias)), logits, counts, weights,
        ids, t, e, d, bias_stride, float(gate_temp), float(route_scale), n_ks, ks_len,
        TOPK=topk, NORM=bool(norm_topk_prob) and topk > 1, KP=_pow2(topk), EP=ep, BLOCK_T=bt, BLOCK_K=bk,
        KSP=_pow2(n_ks), WIDE=needs_int64(x, gate_weight, logits), HAS_IMG=image is not None, **extra, **pdl_launch(logits))


def moe_route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, topk: int, route_scale: float,
              gate_temp: float = 1.0, norm_topk_prob: bool = True, image_bias: torch.Tensor | None = None,
              is_image: torch.Tensor | None = None, _cfg: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.moe_route`: x [T, D], gate_weight [E, D], bias [E] or [T, E] (image tokens, is_image
    [T] bool, choose with image_bias of bias's shape when given) -> (weights fp32 [T, k], ids
    int64 [T, k]). Requires triton. `_cfg` (tests, sweeps): (BLOCK_T, BLOCK_E, BLOCK_K,
    num_warps[, K splits]), or "small" for the few-token kernel (else DSV41_MOE_ROUTE decides)."""
    from .launch import grid_for, interpreting, needs_int64, tile_counters

    t, d = x.shape
    e = gate_weight.shape[0]
    if gate_weight.shape[1] != d:
        raise ValueError(f"gate_weight {tuple(gate_weight.shape)} does not fit x {tuple(x.shape)}")
    if not 0 < topk <= e:
        raise ValueError(f"topk {topk} out of range for {e} experts")
    weights = torch.empty(t, topk, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, topk, dtype=torch.long, device=x.device)
    if t == 0:
        return weights, ids
    if bias.dim() == 1:
        bias_stride = 0
    elif bias.shape == (t, e):
        bias_stride = e
    else:
        raise ValueError(f"bias must be [{e}] or [{t}, {e}], got {tuple(bias.shape)}")
    has_img = image_bias is not None
    if has_img and (image_bias.shape != bias.shape or is_image is None or is_image.shape != (t,)):
        raise ValueError(f"image_bias must have bias's shape {tuple(bias.shape)} and is_image be [{t}], got "
                         f"{tuple(image_bias.shape)} and {None if is_image is None else tuple(is_image.shape)}")
    image = (image_bias.contiguous(), is_image.contiguous().view(torch.uint8)) if has_img else None
    small = _cfg == "small" or (_cfg is None and route_mode() == "small" and small_fits(t, e)
                                and torch.device(x.device).type == "cuda")
    if small:
        moe_route_small(x, gate_weight, bias, bias_stride, weights, ids, topk, route_scale, gate_temp, norm_topk_prob,
                        image=image)
        return weights, ids
    bt, be, bk, warps, *rest = _cfg or _config(t, e, x.device)
    lowp = not interpreting() and gate_weight.dtype == torch.bfloat16
    splits = {torch.bfloat16: 1, torch.float16: 2}.get(x.dtype, 3)
    n_tb, n_eb = -(-t // bt), -(-e // be)
    n_ks = _k_splits(n_tb * n_eb, d, bk, rest[0] if rest else None, x.device)
    ks_len = -(-(-(-d // bk)) // n_ks) * bk  # K slice length: whole BLOCK_K steps
    n_ks = -(-d // ks_len)
    n_tiles = n_tb * n_eb * n_ks
    grid = grid_for(n_tiles, x.device, cores="cube")  # tl.dot: one program per AI core on Ascend
    logits = torch.empty(n_ks, t, e, dtype=torch.float32, device=x.device)
    # the device's shared counters (zero, and left zero by the kernel: no memset per call); on
    # Ascend a zeroed buffer per call, as before (the shared buffer is keyed by CUDA stream only)
    counts = (torch.zeros(n_tb, dtype=torch.int32, device=x.device) if x.device.type == "npu"
              else tile_counters(x.device, n_tb))
    extra = {} if interpreting() else {"num_warps": warps}
    _moe_route_kernel[(grid,)](
        x.contiguous(), gate_weight.contiguous(), bias.contiguous(), *(image or (bias, bias)), logits, counts,
        weights, ids,
        t, e, d, bias_stride, float(gate_temp), float(route_scale), n_eb, n_ks, ks_len, n_tiles, grid,
        TOPK=topk, NORM=bool(norm_topk_prob) and topk > 1, KP=_pow2(topk), EP=_pow2(e), BLOCK_T=bt, BLOCK_E=be,
        BLOCK_K=bk, SPLITS=splits, LOWP=lowp, WIDE=needs_int64(x, gate_weight, logits), HAS_IMG=has_img, **extra, **pdl_launch(logits))
    return weights, ids


OPS = {"moe_route": moe_route}
