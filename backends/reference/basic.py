"""Reference formats, norms, RoPE, linears, SwiGLU and the Engram row gather."""

from __future__ import annotations

import contextlib
import os
import weakref
from collections import OrderedDict

import torch

from ..registry import register
from . import quant

register("fp4_quant")(quant.fp4_quant)
register("fp4_dequant")(quant.fp4_dequant)
register("mxfp4_quant")(quant.mxfp4_quant)
register("mxfp4_dequant")(quant.mxfp4_dequant)
register("mxfp4_act_quant")(quant.mxfp4_qdq)
register("fp8_quant")(quant.fp8_quant)
register("fp8_dequant")(quant.fp8_dequant)


def mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp32 operands, fp64 accumulation, fp32 result (fp64 `out_dtype`: left unrounded, for
    model-parallel partial sums that are added across ranks before the one rounding).

    Products of fp32 values are exact in fp64 and the fp64 sum is far below fp32 resolution,
    so each output is (almost always) the correctly rounded fp32 result whatever the batch
    shape: a one-token decode step computes the same bits as the same row inside a prefill,
    which the decode-vs-prefill oracle tests rely on (BLAS picks different fp32 summation
    orders for gemv and gemm, and top-k selection amplifies one-ulp differences).
    """
    return (a.to(ACCUM_DTYPE) @ b.to(ACCUM_DTYPE)).to(out_dtype)


def einsum(eq: str, *xs: torch.Tensor) -> torch.Tensor:
    """`torch.einsum` with the same fp64-accumulation contract as `mm`."""
    return torch.einsum(eq, *(x.to(ACCUM_DTYPE) for x in xs)).float()


# fp64 by default (the oracle). Benchmarks switch to fp32 with `fp32_accumulation()` to time
# the reference as the plain unfused torch sequence a kernel replaces.
ACCUM_DTYPE = torch.float64


@contextlib.contextmanager
def fp32_accumulation():
    global ACCUM_DTYPE
    old, ACCUM_DTYPE = ACCUM_DTYPE, torch.float32
    try:
        yield
    finally:
        ACCUM_DTYPE = old


def exact_fn(fn, x: torch.Tensor) -> torch.Tensor:
    """A transcendental function evaluated in fp64 and rounded to fp32.

    torch evaluates elementwise functions with SIMD code for whole vectors and scalar libm code
    for the tail of a tensor, which can differ by one fp32 ulp; a decode step (tiny tensors)
    and a prefill (large ones) would then disagree. In fp64 both paths are within an fp64 ulp,
    so the rounded fp32 result is (almost always) the same, whatever the tensor's size.
    Under `fp32_accumulation()` (benchmarks, the Ascend backend's NPU-legal fallback) it runs in fp32.
    """
    return fn(x.to(ACCUM_DTYPE)).float()


@register("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


@register("rope_tables")
def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ang = positions.to(torch.float64).unsqueeze(-1) * inv_freq.to(torch.float64)
    return torch.cos(ang).float(), torch.sin(ang).float()


@register("rope")
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    r = cos.shape[-1] * 2
    xf = x.float()
    rot = xf[..., -r:].reshape(*x.shape[:-1], r // 2, 2)
    # cos/sin are [T, R/2]; broadcast over any head dims between T and the channel dim.
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (r // 2,)
    c, s = cos.reshape(shape), sin.reshape(shape)
    if inverse:
        s = -s
    a, b = rot[..., 0], rot[..., 1]
    out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).reshape(*x.shape[:-1], r)
    return torch.cat((xf[..., :-r], out), dim=-1).to(x.dtype)


_DEQUANT_CACHE: OrderedDict[int, tuple] = OrderedDict()
# The memo is bounded (least recently used first out): an fp64 copy is 8x an FP8 weight, so a
# model larger than the tiny one would otherwise keep several times its size in copies.
DEQUANT_CACHE_BYTES = int(float(os.environ.get("DSV41_REFERENCE_CACHE_GB", "4")) * 2**30)
_cache_bytes = 0


def _forget(key: int) -> None:
    global _cache_bytes
    hit = _DEQUANT_CACHE.pop(key, None)
    if hit is not None:
        _cache_bytes -= hit[2].numel() * hit[2].element_size()


def dequant_weight(weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Any stored weight -> its exact values as fp64 [N, K] (what `mm` multiplies with),
    memoised per weight tensor up to DEQUANT_CACHE_BYTES (`DSV41_REFERENCE_CACHE_GB`, default
    4): weights are read-only during inference, and the in-place version counter invalidates an
    entry if a weight is rewritten."""
    global _cache_bytes
    key = id(weight)
    hit = _DEQUANT_CACHE.get(key)
    if hit is not None and hit[0]() is weight and hit[1] == weight._version and hit[2].dtype == ACCUM_DTYPE:
        _DEQUANT_CACHE.move_to_end(key)
        return hit[2]
    _forget(key)
    w = _dequant_weight(weight, scale).to(ACCUM_DTYPE)
    size = w.numel() * w.element_size()
    while _DEQUANT_CACHE and _cache_bytes + size > DEQUANT_CACHE_BYTES:
        _forget(next(iter(_DEQUANT_CACHE)))
    if size <= DEQUANT_CACHE_BYTES:
        _DEQUANT_CACHE[key] = (weakref.ref(weight, lambda _, k=key: _forget(k)), weight._version, w)
        _cache_bytes += size
    return w


def _dequant_weight(weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if scale is None:
        return weight.float()
    if quant.is_int8_channel_weight(weight, scale):
        return weight.float() * scale.float().reshape(-1, 1)
    if weight.dtype == torch.float8_e4m3fn:
        return quant.fp8_block_dequant(weight, scale)
    if weight.dtype in (torch.int8, torch.uint8):
        return quant.fp4_weight_dequant(weight, scale)
    raise TypeError(f"unsupported quantised weight dtype {weight.dtype}")


@register("linear")
def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
           out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Low-precision linear. The reference dequantises both operands and multiplies in fp32:
    every scale is a power of two (E8M0 weights, 2^ceil activation scales), so applying the
    scales per 32-wide K block or after dequantisation gives the same products; only the fp32
    summation order differs from a blockwise kernel.
    W8A8 (int8 weight, fp32 scale per output channel): x is int8-quantised per token and the
    integer dot products (exact in fp64) are scaled by both scales before the one rounding."""
    acc = torch.float64 if out_dtype == torch.float64 else torch.float32  # fp64: unrounded partials
    if quant.is_int8_channel_weight(weight, scale):
        return int8_linear(x, weight, scale, acc).to(out_dtype)
    xf = quant.fp8_qdq(x) if scale is not None else x.float()
    return mm(xf, dequant_weight(weight, scale).t(), acc).to(out_dtype)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype=torch.float32) -> torch.Tensor:
    """W8A8: per-token dynamic int8 activations times int8 weights, integer sums (exact in the
    fp64 accumulation), then x_scale[t] * w_scale[n] once (bf16 input rounding as the NPU's
    npu_dynamic_quant takes bf16)."""
    q, xs = quant.int8_token_qdq(x.to(torch.bfloat16).float())
    w = dequant_weight(weight, None)  # the int8 values, exact
    acc = (q.to(ACCUM_DTYPE) @ w.t()) * xs.to(ACCUM_DTYPE) * scale.reshape(1, -1).to(ACCUM_DTYPE)
    return acc.to(out_dtype)


@register("grouped_linear")
def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    t, g, k = x.shape
    w = dequant_weight(weight, None).view(g, -1, k)
    return einsum("tgk,grk->tgr", x.float(), w).reshape(t, -1).to(torch.bfloat16)


@register("swiglu_clamped")
def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    g = gate.float().clamp(max=limit)
    u = up.float().clamp(-limit, limit)
    return exact_fn(torch.nn.functional.silu, g) * u


def gather_rows_to(table: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor):
    """For a table held elsewhere than `rows` (Engram host offload): gather the rows where the
    table is and copy only those (page-locked staging when they go to a device). Returns
    (rows' entries, their scales, ids into them), all on rows' device: a lookup of those equals
    the lookup in the whole table."""
    flat = rows.reshape(-1).to(table.device)  # the ids come to the host (a sync on devices)
    vals, sc = table[flat], scale[flat]
    if vals.device.type == "cpu" and rows.device.type != "cpu":
        vals, sc = vals.pin_memory(), sc.pin_memory()
    vals, sc = vals.to(rows.device, non_blocking=True), sc.to(rows.device, non_blocking=True)
    return vals, sc, torch.arange(flat.numel(), device=rows.device).view(rows.shape)


@register("engram_lookup")
def engram_lookup(table: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    if table.device != rows.device:  # a host-offloaded table
        table, scale, rows = gather_rows_to(table, scale, rows)
    t, r = rows.shape
    flat = rows.reshape(-1)
    vals = table[flat]
    sc = scale[flat]
    if table.dtype == torch.int8:  # INT8 rows, one fp32 scale per row (the Ascend host path)
        out = vals.float() * sc.float().reshape(-1, 1)
    else:
        out = quant.fp8_dequant(vals, sc) if sc.dtype == torch.float8_e8m0fnu else (
            quant._groups(vals.float(), 32) * sc.float().unsqueeze(-1)).reshape(vals.shape)
    return out.reshape(t, r * table.shape[-1]).to(torch.bfloat16)


@register("engram_gate")
def engram_gate(x, k, v, q_weight, k_weight, eps, is_image):
    n, d = x.shape[-2:]
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if tuple(w.shape) != (n, d):  # one row per mHC stream: [d] would silently share one row
            raise ValueError(f"engram_gate: {name} must be [n_streams, d] = [{n}, {d}], got {list(w.shape)}")
    xf, k = x.float(), k.float()
    kn = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps)
    xn = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    dot = (kn * k_weight.float() * xn * q_weight.float()).sum(-1) * d ** -0.5
    gate = exact_fn(torch.sigmoid, torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(1e-6)))
    gate = gate.masked_fill(is_image.unsqueeze(-1), 0.0)
    return (xf + gate.unsqueeze(-1) * v.float().unsqueeze(1)).to(x.dtype)
