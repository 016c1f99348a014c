"""Fused ops as the compositions they stand for.

A fused op saves device launches (one kernel instead of several small ones, on the decode
path); its meaning is the composition below, written through `backends.ops` so that each part
runs on the caller's backend. That composition is the op's reference implementation (so the
CPU path computes exactly what it computed before the op existed) and its implementation on any
backend without a fused kernel of its own (`registry.register_composite`; Ascend runs it so until
its kernels are vetted on triton-ascend). CUDA registers the Triton kernels
(`npu_ops/triton/rope_store_kv.py`, `rope_store_key.py`, `unrope_grouped_linear.py`,
`engram_hash.py`, `mhc_mix_norm.py`, `indexer_queries.py`, `block_linear.py`'s
`linear_pair`, `moe_experts.py`'s `moe_experts_add`), tested against these.
"""

from __future__ import annotations

import torch

from . import ops
from .paging import write_rows
from .registry import register_composite


@register_composite("rope_store_kv")
def rope_store_kv(q: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor, swa_kv: torch.Tensor, swa_scale: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The attention's RoPE'd query, and its window entry written to the window pool."""
    kv8, kv_s = ops.fp8_quant(ops.rope(ops.rms_norm(kv, norm_weight, eps), cos, sin))
    write_rows((swa_kv, swa_scale), rows, (kv8, kv_s))
    return ops.rope(q, cos, sin)


@register_composite("unrope_grouped_linear")  # one token: the rows kernel beat rope + cuBLAS on the H200
def unrope_grouped_linear(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor,
                          groups: int) -> torch.Tensor:
    """The attention output rotated back, then the grouped `wo_a` projection."""
    return ops.grouped_linear(ops.rope(x, cos, sin, inverse=True).reshape(x.shape[0], groups, -1), weight)


@register_composite("rope_store_key")
def rope_store_key(key: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                   key_codes: torch.Tensor, key_scale: torch.Tensor, slots: torch.Tensor) -> None:
    """The compressed entries' indexer keys, normed, RoPE'd, MXFP4-quantised, written to the pool."""
    codes, scales = ops.mxfp4_quant(ops.rope(ops.rms_norm(key, norm_weight, eps), cos, sin))
    write_rows((key_codes, key_scale), slots, (codes, scales))


def _rows_after(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """a's rows then b's as one tensor where b's rows follow a's in one allocation, else None."""
    if (a.dim() != 2 or b.dim() != 2 or a.dtype != b.dtype or a.shape[1] != b.shape[1] or a.device != b.device
            or a.device.type == "meta" or not (a.is_contiguous() and b.is_contiguous())
            or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
            or b.storage_offset() != a.storage_offset() + a.numel()):
        return None
    return a.as_strided((a.shape[0] + b.shape[0], a.shape[1]), a.stride(), a.storage_offset())


def scale_rows_line_up(weight_a: torch.Tensor, scale_a: torch.Tensor, weight_b: torch.Tensor,
                       scale_b: torch.Tensor) -> bool:
    """Whether b's scale rows, stacked after a's, start at b's first weight row: one scale row per
    weight row (FP4, int8 channels), or 32-row FP8 blocks that a's rows fill whole."""
    na, nb, sa, sb = weight_a.shape[0], weight_b.shape[0], scale_a.shape[0], scale_b.shape[0]
    return (sa, sb) == (na, nb) or (sa * 32 == na and sb == -(-nb // 32))


def stacked_pair(weight_a: torch.Tensor, scale_a: torch.Tensor | None, weight_b: torch.Tensor,
                 scale_b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, scale) of the two linears as one, where `core.weights.stack_linears` put b's rows
    (weight and scale alike) right after a's, their scale rows lined up; else None. The answer is
    kept on weight_a (the same stacked tensors on every call: per-weight caches such as the
    Ascend backend's key on the tensor object)."""
    memo = weight_a.__dict__.get("_stacked_pair")
    if memo is not None and memo[0] is weight_b and memo[1] is scale_a and memo[2] is scale_b:
        return memo[3]
    w = _rows_after(weight_a, weight_b)
    both = None
    if w is not None and scale_a is None and scale_b is None:
        both = w, None
    elif w is not None and scale_a is not None and scale_b is not None:
        s = _rows_after(scale_a, scale_b)
        if s is not None and scale_rows_line_up(weight_a, scale_a, weight_b, scale_b):
            both = w, s
    if weight_a.device.type != "meta":
        weight_a._stacked_pair = (weight_b, scale_a, scale_b, both)
    return both


@register_composite("linear_pair")
def linear_pair(x: torch.Tensor, weight_a: torch.Tensor, scale_a: torch.Tensor | None, weight_b: torch.Tensor,
                scale_b: torch.Tensor | None, out_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Two projections of the same input: one linear over the stacked rows where the weights are
    stacked (`stacked_pair`; each output column is the same dot product either way), the two
    outputs then views of its output."""
    stacked = stacked_pair(weight_a, scale_a, weight_b, scale_b)
    if stacked is None:
        return ops.linear(x, weight_a, scale_a, out_dtype), ops.linear(x, weight_b, scale_b, out_dtype)
    y = ops.linear(x, *stacked, out_dtype)
    return y[..., :weight_a.shape[0]], y[..., weight_a.shape[0]:]


@register_composite("moe_experts_add")
def moe_experts_add(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: list, limit: float,
                    add: torch.Tensor, join=None) -> torch.Tensor:
    """The routed experts' fp32 sum plus the shared expert's output, rounded to bf16 once (an fp32
    add that casts on store: the value of (y + add).to(bf16))."""
    y = ops.moe_experts(x, weights, ids, experts, limit, torch.float32)
    if join is not None:
        join()
    return torch.add(y, add, out=torch.empty(y.shape, dtype=torch.bfloat16, device=y.device))


@register_composite("indexer_queries")  # H200: 2.0 vs 6.7 us at one row, 2.4 vs 7.1 at eight
def indexer_queries(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: torch.Tensor,
                    w_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's RoPE'd, MXFP4 quantise-dequantised queries, and its scaled head weights."""
    return ops.mxfp4_act_quant(ops.rope(q, cos, sin)), w * w_scale


@register_composite("mhc_mix_norm", kernel_by_default=False)  # H200: 15.1 vs 15.0 us at one row, 32.9 vs 24.3 at eight
def mhc_mix_norm(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, pre: torch.Tensor,
                 fn: torch.Tensor | None, scale: torch.Tensor | None, base: torch.Tensor | None, norm_eps: float,
                 hc_eps: float, iters: int, norm_weight: torch.Tensor, eps: float) -> tuple:
    """The mHC step after a sublayer, and the next sublayer's normed input."""
    x_new, x_hat, coef = ops.mhc_mix(x, y, post, comb, pre, fn, scale, base, norm_eps, hc_eps, iters)
    return x_new, x_hat, coef, ops.rms_norm(x_hat, norm_weight, eps)


@register_composite("mhc_enter_norm", kernel_by_default=False)  # H200: 12.7 vs 12.9 us at one row, 38.8 vs 22.3 at eight
def mhc_enter_norm(x: torch.Tensor, pre: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                   norm_eps: float, hc_eps: float, iters: int, norm_weight: torch.Tensor, eps: float) -> tuple:
    """A block's mHC entry: its coefficients, its input collapsed with `pre`, and that normed."""
    coef = ops.mhc_mixes(x, fn, scale, base, norm_eps, hc_eps, iters)
    x_hat = ops.mhc_collapse(x, pre)
    return coef, x_hat, ops.rms_norm(x_hat, norm_weight, eps)


@register_composite("engram_hash")
def engram_hash(ngram_ids: torch.Tensor, ngram_image: torch.Tensor, token_map: torch.Tensor,
                multipliers: torch.Tensor, primes: torch.Tensor, pad_id: int, n_heads: int) -> torch.Tensor:
    """Engram row ids of per-position n-gram windows: a slot is valid when it holds a token (id
    >= 0) with no image token at or before it in the window; valid slots hash their compressed
    id (`token_map`), the others `pad_id` (`core.engram.engram_window_row_ids`, the hash's one
    definition: the host-side prefetch hashes with it too)."""
    from ..core.engram import engram_window_row_ids

    valid = (ngram_ids >= 0) & torch.cumprod((~ngram_image).to(torch.int32), 1).bool()
    comp = token_map[ngram_ids.clamp_min(0)]
    return engram_window_row_ids(comp, valid, multipliers, primes, pad_id, n_heads)
