"""Reference MoE: sqrtsoftplus routing and clamped-SwiGLU experts (FP4/FP8/bf16 weights)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..registry import register
from . import quant
from .basic import dequant_weight, exact_fn, mm, swiglu_clamped


@register("moe_route")
def moe_route(x, gate_weight, bias, topk, route_scale, gate_temp=1.0, norm_topk_prob=True):
    logits = mm(x.float(), gate_weight.float().t()) / gate_temp
    scores = torch.sqrt(exact_fn(F.softplus, logits))  # sqrt is correctly rounded on every path
    # The bias only chooses experts; ties go to the lower expert id (stable sort).
    choice = scores + bias.float()
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :topk]
    w = scores.gather(-1, ids)
    if norm_topk_prob and topk > 1:  # (true as released); one chosen expert keeps its raw score
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * route_scale, ids


def expert_forward(xq: torch.Tensor, weight: torch.Tensor | None, expert, limit: float) -> torch.Tensor:
    """One clamped-SwiGLU expert on rows xq [t, d] (already FP8 quantise-dequantised when the
    expert is quantised); `weight` [t] multiplies before w2, whose input is FP8-quantised again."""
    (w1, s1), (w2, s2), (w3, s3) = expert
    h = swiglu_clamped(mm(xq, dequant_weight(w1, s1).t()), mm(xq, dequant_weight(w3, s3).t()), limit)
    if weight is not None:
        h = h * weight.unsqueeze(-1)
    if s2 is not None:
        h = quant.fp8_qdq(h)
    return mm(h, dequant_weight(w2, s2).t())


@register("moe_experts")
def moe_experts(x, weights, ids, experts, limit, out_dtype=torch.float32):
    # Activation quantisation is per token and per 32 channels, so quantising all rows once
    # equals quantising each expert's gathered rows.
    quantised = experts[0][0][1] is not None
    xq = quant.fp8_qdq(x) if quantised else x.float()
    out = torch.zeros(x.shape[0], x.shape[1], dtype=out_dtype, device=x.device)
    for e in torch.unique(ids).tolist():
        if e < 0:  # an expert another model-parallel rank holds
            continue
        tok, slot = (ids == e).nonzero(as_tuple=True)
        out.index_add_(0, tok, expert_forward(xq[tok], weights[tok, slot], experts[e], limit).to(out_dtype))
    return out
