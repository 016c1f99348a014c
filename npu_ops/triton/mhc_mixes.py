"""The mHC entry of a block (ops `mhc_mixes` and `mhc_collapse`), for the places the fused
`mhc_mix` (mega_mhc.py) does not cover: the model entry and blocks after Engram.

`mhc_mixes`: coefficient prediction from the streams x [T, n, d] alone. The work split and the
exact dot products are mega_mhc's (its docstring): BLOCK_T tokens x one chunk of d per work item;
the 24 dot products with fn as tl.dot on bf16 x times fn split into three bf16 parts (exact
products, fp32 sums, Kahan-compensated across slices), written per chunk and added by mega_mhc's
coefficient epilogue (sigmoids, Sinkhorn in registers; its own launch, or with `fused=True` the
partials kernel's last program per token tile). x is read once.

`mhc_collapse`: sum_i pre[i] * x_i in fp32, rounded to x's dtype; one program per token and
d-block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends.reference.mhc import mhc_collapse as mhc_collapse_ref  # noqa: F401  (the oracle)
from ...backends.reference.mhc import mhc_mixes as mhc_mixes_ref  # noqa: F401  (the oracle)
from .pdl import pdl_launch, pdl_start
from .block_scaled import bf16_bits16
from .mega_mhc import (N_MIX, N_STREAMS, _finish_coef, _fn_partial_step, _fn_partial_step_t, _partials_init,
                       _store_partials, coef_chunk_block, coef_launch, coef_mode, coef_tokens, fn_bf16_parts,
                       tiles_for)


@triton.jit
def _mhc_partials_kernel(x_ptr, fn_ptr, part_ptr, pcomp_ptr, pss_ptr, count_ptr, scale_ptr, base_ptr, opre_ptr,
                         opost_ptr, ocomb_ptr, cpre_ptr, xhat_ptr, nw_ptr, xn_ptr, T, D, chunk, n_chunks, n_items,
                         num_programs, norm_eps, hc_eps, iters, rms_eps,
                         BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, FUSED: tl.constexpr,
                         CT: tl.constexpr, CB: tl.constexpr, WIDE: tl.constexpr, NORM: tl.constexpr,
                         BLOCK_N: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr = 0, TDOT: tl.constexpr = False):
    """The chunk partials of m (mega_mhc's projection, TDOT its transposed form on fn's bf16
    parts), then the coefficients (FUSED: here; else `launch_coef`)."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    dt = tl.arange(0, BLOCK_D)
    kk = tl.arange(0, 32)
    kmask = kk < 24
    for item in range(pid, n_items, num_programs):
        tile = item // n_chunks
        ck = item - tile * n_chunks
        tok = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = tok < T
        x_row = tok.to(tl.int64)[:, None] * (4 * D)
        acc, comp, ss = _partials_init(BLOCK_T, BLOCK_D, TDOT)
        for d0 in range(ck * chunk, tl.minimum(ck * chunk + chunk, D), BLOCK_D):
            cols = d0 + dt
            cm = cols < D
            m2 = tm[:, None] & cm[None, :]
            xo = x_row + cols[None, :]
            f0 = tl.load(x_ptr + xo, mask=m2, other=0.0).to(tl.float32)
            f1 = tl.load(x_ptr + xo + D, mask=m2, other=0.0).to(tl.float32)
            f2 = tl.load(x_ptr + xo + 2 * D, mask=m2, other=0.0).to(tl.float32)
            f3 = tl.load(x_ptr + xo + 3 * D, mask=m2, other=0.0).to(tl.float32)
            if TDOT:
                acc, comp, ss = _fn_partial_step_t(acc, comp, ss, f0, f1, f2, f3, fn_ptr, cols, cm, D, SPLIT)
            else:
                acc, comp, ss = _fn_partial_step(acc, comp, ss, f0, f1, f2, f3, fn_ptr, kk.to(tl.int64), kmask, cols,
                                                 cm, D, SPLIT)
        _store_partials(part_ptr, pcomp_ptr, pss_ptr, acc, comp, ss, ck, T, tok.to(tl.int64), tm, TDOT)
        if FUSED:  # the tile's last chunk computes the coefficients (no second launch)
            _finish_coef(tile, count_ptr, part_ptr, pcomp_ptr, pss_ptr, scale_ptr, base_ptr, opre_ptr, opost_ptr,
                         ocomb_ptr, T, D, n_chunks, norm_eps, hc_eps, iters, BLOCK_T, CT, CB, WIDE,
                         xhat_ptr, nw_ptr, xn_ptr, rms_eps, NORM, BLOCK_N, BF16, x_ptr, cpre_ptr, NORM)


def mhc_mixes(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
              hc_eps: float, iters: int, *, fused: bool | None = None, d_split: int | None = None,
              collapse_norm: tuple | None = None, chunk_block: int | None = None, tdot: bool | None = None,
              sized_tiles: bool = True):
    """x [T, 4, d] -> (pre [T, 4], post [T, 4], comb [T, 4, 4]) fp32. `fused`: the coefficients
    come from the partials kernel's last program per token tile (one launch; default:
    DSV41_MHC_COEF); `d_split` fixes the d chunks per token tile (default: more when few tiles).
    `collapse_norm` = (pre_prev [T, 4], weight [d], eps): the coefficient epilogue also makes
    x_hat = mhc_collapse(x, pre_prev) and rms_norm(x_hat, weight, eps), returned after the
    coefficients (`mhc_enter_norm`). `chunk_block`: the chunk partials the coefficient epilogue
    adds per step (`mega_mhc.mhc_mix`). `tdot`: the transposed projection on fn's bf16 parts
    (default: `mega_mhc.tiles_for`'s; bf16 streams only; `mega_mhc.TDOT_M`); `sized_tiles`: as
    `mega_mhc.mhc_mix`'s."""
    from .launch import grid_for, interpreting, needs_int64, num_workers, tile_counters

    if x.dim() != 3 or x.shape[1] != N_STREAMS:
        raise ValueError(f"x must be [T, {N_STREAMS}, d], got {tuple(x.shape)}")
    t, n, d = x.shape
    if fn.shape != (N_MIX, n * d) or scale.numel() != 3 or base.numel() != N_MIX:
        raise ValueError(f"fn must be [{N_MIX}, {n * d}], scale [3], base [{N_MIX}]")
    x, fn, scale, base = x.contiguous(), fn.float().contiguous(), scale.float().contiguous(), base.float().contiguous()
    pre = torch.empty(t, n, dtype=torch.float32, device=x.device)
    post = torch.empty_like(pre)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=x.device)
    norm = collapse_norm is not None
    if norm:
        pre_prev, nw, rms_eps = collapse_norm
        if pre_prev.shape != (t, n) or nw.shape != (d,):
            raise ValueError(f"collapse_norm needs pre [{t}, {n}] and a weight [{d}], got {tuple(pre_prev.shape)}, "
                             f"{tuple(nw.shape)}")
        pre_prev, nw = pre_prev.float().contiguous(), nw.contiguous()
        x_hat, x_norm = torch.empty(t, d, dtype=x.dtype, device=x.device), torch.empty(t, d, dtype=x.dtype, device=x.device)
        bf16 = x.dtype == torch.bfloat16
        xh_arg, xn_arg = (x_hat.view(torch.int16), x_norm.view(torch.int16)) if bf16 else (x_hat, x_norm)
        done = (pre, post, comb, x_hat, x_norm)
    else:
        pre_prev = nw = xh_arg = xn_arg = pre  # unused placeholders
        rms_eps, bf16, done = 0.0, False, (pre, post, comb)
    if t == 0:
        return done
    tiles = tiles_for(t, x.device, sized_tiles)
    bt, bd = tiles["block_t"], min(tiles["block_d"], triton.next_power_of_2(d))
    n_tiles, slices = -(-t // bt), -(-d // bd)
    want = d_split or max(tiles["d_split"], -(-2 * num_workers(x.device) // n_tiles))
    chunk = bd * -(-slices // want)
    n_chunks = -(-d // chunk)
    n_items = n_tiles * n_chunks
    grid = grid_for(n_items, x.device)
    split = (not interpreting()) and x.dtype == torch.bfloat16
    tdot = (tiles["tdot"] if tdot is None else tdot) and x.dtype == torch.bfloat16
    kw = {} if interpreting() else {"num_warps": tiles["num_warps"], "num_stages": tiles["num_stages"]}
    part = torch.empty(n_chunks, t, 32, dtype=torch.float32, device=x.device)
    pcomp = torch.empty_like(part)
    pss = torch.empty(n_chunks, t, dtype=torch.float32, device=x.device)
    fused_default, narrow = coef_mode()
    if fused is None:
        fused = fused_default
    ct = coef_tokens(t, narrow, fused)
    wide = needs_int64(x, fn)
    counts = tile_counters(x.device, n_tiles) if fused else pss
    cb = chunk_block or coef_chunk_block(ct)
    fn_arg = fn_bf16_parts(fn) if tdot else fn
    _mhc_partials_kernel[(grid,)](x, fn_arg, part, pcomp, pss, counts, scale, base, pre, post, comb, pre_prev, xh_arg,
                                  nw, xn_arg, t, d, chunk, n_chunks, n_items, grid, float(norm_eps), float(hc_eps),
                                  int(iters), float(rms_eps), BLOCK_T=bt, BLOCK_D=bd, SPLIT=split, FUSED=fused,
                                  CT=ct, CB=cb, WIDE=wide, NORM=norm,
                                  BLOCK_N=triton.next_power_of_2(d), BF16=bf16, TDOT=tdot, **kw, **pdl_launch(x))
    if not fused:
        coef_launch(x.device, part, pcomp, pss, scale, base, pre, post, comb, t, d, n_chunks, norm_eps, hc_eps, iters,
                    wide, ct, norm=(xh_arg, nw, xn_arg, rms_eps, x, pre_prev) if norm else None, cb=cb)
    return done


@triton.jit
def _mhc_collapse_kernel(x_ptr, pre_ptr, y_ptr, D, BLOCK_D: tl.constexpr, OUT_BF16: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = cols < D
    base = t.to(tl.int64) * 4 * D + cols
    acc = tl.load(pre_ptr + t * 4).to(tl.float32) * tl.load(x_ptr + base, mask=m, other=0.0).to(tl.float32)
    acc += tl.load(pre_ptr + t * 4 + 1).to(tl.float32) * tl.load(x_ptr + base + D, mask=m, other=0.0).to(tl.float32)
    acc += tl.load(pre_ptr + t * 4 + 2).to(tl.float32) * tl.load(x_ptr + base + 2 * D, mask=m, other=0.0).to(tl.float32)
    acc += tl.load(pre_ptr + t * 4 + 3).to(tl.float32) * tl.load(x_ptr + base + 3 * D, mask=m, other=0.0).to(tl.float32)
    if OUT_BF16:
        tl.store(y_ptr + t.to(tl.int64) * D + cols, bf16_bits16(acc), mask=m)
    else:
        tl.store(y_ptr + t.to(tl.int64) * D + cols, acc, mask=m)


def mhc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """x [T, 4, d], pre [T, 4] -> [T, d] in x's dtype."""
    if x.dim() != 3 or x.shape[1] != N_STREAMS or pre.shape != x.shape[:2]:
        raise ValueError(f"x must be [T, {N_STREAMS}, d] and pre [T, {N_STREAMS}], got {tuple(x.shape)}, "
                         f"{tuple(pre.shape)}")
    t, _, d = x.shape
    xc = x.contiguous()
    y = torch.empty(t, d, dtype=x.dtype, device=x.device)
    if t:
        bd = min(1024, triton.next_power_of_2(d))
        out_bf16 = x.dtype == torch.bfloat16
        _mhc_collapse_kernel[(t, -(-d // bd))](xc, pre.float().contiguous(), y.view(torch.int16) if out_bf16 else y,
                                              d, BLOCK_D=bd, OUT_BF16=out_bf16, **pdl_launch(xc))
    return y


OPS = {"mhc_mixes": mhc_mixes, "mhc_collapse": mhc_collapse}
