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


@register_composite("linear_pair")
def linear_pair(x: torch.Tensor, weight_a: torch.Tensor, scale_a: torch.Tensor | None, weight_b: torch.Tensor,
                scale_b: torch.Tensor | None, out_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Two projections of the same input."""
    return ops.linear(x, weight_a, scale_a, out_dtype), ops.linear(x, weight_b, scale_b, out_dtype)


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
