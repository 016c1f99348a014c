"""Reference MoE: sqrtsoftplus routing and clamped-SwiGLU experts (FP4/FP8/bf16 weights)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import numerics
from ..registry import register
from . import quant
from .basic import dequant_weight, exact_fn, int8_linear, mm, swiglu_clamped


@register("moe_route")
def moe_route(x, gate_weight, bias, topk, route_scale, gate_temp=1.0, norm_topk_prob=True, image_bias=None,
              is_image=None):
    if image_bias is not None:  # image tokens choose with their own bias
        bias = torch.where(is_image.unsqueeze(-1), image_bias, bias)
    logits = mm(x.float(), gate_weight.float().t()) / gate_temp
    scores = torch.sqrt(exact_fn(F.softplus, logits))  # sqrt is correctly rounded on every path
    # The bias only chooses experts; ties go to the lower expert id (stable sort).
    choice = scores + bias.float()
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :topk]
    w = scores.gather(-1, ids)
    if norm_topk_prob and topk > 1:  # (true as released); one chosen expert keeps its raw score
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * route_scale, ids


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16, returned in fp32 (an official-numerics rounding point)."""
    return x.to(torch.bfloat16).float()


def expert_forward(xq: torch.Tensor, weight: torch.Tensor | None, expert, limit: float) -> torch.Tensor:
    """One clamped-SwiGLU expert on rows xq [t, d] (already FP8 quantise-dequantised when the
    expert is quantised); `weight` [t] multiplies before w2, whose input is FP8-quantised again.
    Official numerics (`backends/numerics.py`) round the w1 / w3 outputs, the weighted product
    (before the FP8 quantisation) and the w2 output to bf16, as the official expert does."""
    (w1, s1), (w2, s2), (w3, s3) = expert
    rnd = _bf16 if numerics.official() else (lambda t: t)
    if quant.is_int8_channel_weight(w1, s1):  # W8A8: per-token int8 activations at each GEMM
        h = swiglu_clamped(rnd(int8_linear(xq, w1, s1)), rnd(int8_linear(xq, w3, s3)), limit)
        if weight is not None:
            h = h * weight.unsqueeze(-1)
        return rnd(int8_linear(rnd(h), w2, s2))
    h = swiglu_clamped(rnd(mm(xq, dequant_weight(w1, s1).t())), rnd(mm(xq, dequant_weight(w3, s3).t())), limit)
    if weight is not None:
        h = h * weight.unsqueeze(-1)
    h = rnd(h)
    if s2 is not None:
        h = quant.fp8_qdq(h)
    return rnd(mm(h, dequant_weight(w2, s2).t()))


@register("moe_experts")
def moe_experts(x, weights, ids, experts, limit, out_dtype=torch.float32):
    # Activation quantisation is per token and per 32 channels, so quantising all rows once
    # equals quantising each expert's gathered rows.
    (w1, s1) = experts[0][0]
    fp8_acts = s1 is not None and not quant.is_int8_channel_weight(w1, s1)  # W8A8 quantises per GEMM
    xq = quant.fp8_qdq(x) if fp8_acts else x.float()
    # Official numerics: the bf16 expert outputs are summed in fp32, one expert after another in
    # ascending id order (a token meets each expert once, so each index_add_ is one fp32 add).
    acc = torch.float32 if numerics.official() else out_dtype
    out = torch.zeros(x.shape[0], x.shape[1], dtype=acc, device=x.device)
    for e in torch.unique(ids).tolist():
        if e < 0:  # an expert another model-parallel rank holds
            continue
        tok, slot = (ids == e).nonzero(as_tuple=True)
        out.index_add_(0, tok, expert_forward(xq[tok], weights[tok, slot], experts[e], limit).to(acc))
    return out.to(out_dtype)
