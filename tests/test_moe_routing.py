"""The MoE block's routing weights: normalised over the chosen experts only with `norm_topk_prob`
(true as released) and top-k > 1, then times `routed_scaling_factor` (MODEL.md section 3, MoE)."""

import pytest
import torch

from dsv41.backends import ops


def _block_output(moe, x, norm: bool) -> torch.Tensor:
    """What the MoE block computes, spelled out with the ops, for one normalisation reading."""
    cfg = moe.cfg
    w, ids = ops.moe_route(x, moe.gate.weight, moe.gate.bias, cfg.num_experts_per_tok, cfg.routed_scaling_factor,
                           cfg.gate_temp, norm)
    y = ops.moe_experts(x, w, ids, [e.parts() for e in moe.experts.values()], cfg.swiglu_limit, torch.float64)
    ones, zeros = torch.ones(x.shape[0], 1), torch.zeros(x.shape[0], 1, dtype=torch.long)
    y = y + ops.moe_experts(x, ones, zeros, [moe.shared_experts.parts()], cfg.swiglu_limit, torch.float64)
    return y.float().to(torch.bfloat16)


@pytest.mark.parametrize("norm", [True, False])
def test_moe_block_follows_norm_topk_prob(tiny_model, tiny_cfg, rng, norm):
    moe = tiny_model.layers[2].ffn
    x = (torch.randn(6, tiny_cfg.hidden_size, generator=rng) * 0.2).bfloat16()
    saved = moe.cfg
    try:
        moe.cfg = tiny_cfg.replace(norm_topk_prob=norm)
        got = moe(x, None)
    finally:
        moe.cfg = saved
    assert torch.equal(got, _block_output(moe, x, norm))
    assert not torch.equal(got, _block_output(moe, x, not norm))  # the flag changes the block's output


def test_top1_routing_keeps_the_raw_score(tiny_model, tiny_cfg, rng):
    """With one chosen expert there is nothing to normalise: both readings agree."""
    moe = tiny_model.layers[2].ffn
    x = (torch.randn(6, tiny_cfg.hidden_size, generator=rng) * 0.2).bfloat16()
    saved = moe.cfg
    try:
        outs = []
        for norm in (True, False):
            moe.cfg = tiny_cfg.replace(num_experts_per_tok=1, norm_topk_prob=norm)
            outs.append(moe(x, None))
    finally:
        moe.cfg = saved
    assert torch.equal(outs[0], outs[1])


def test_fp32_partial_sums_round_once(tiny_model, tiny_cfg, rng, monkeypatch):
    """With fp32 partial sums (the device backends'), the routed and shared sums are added and
    rounded to bf16 in one op: the value of (routed + shared).to(bf16); with image tokens the
    router takes the image bias (bias_vl) for those rows only."""
    from dsv41.core import model as model_mod

    moe = tiny_model.layers[2].ffn
    cfg = moe.cfg
    x = (torch.randn(6, tiny_cfg.hidden_size, generator=rng) * 0.2).bfloat16()
    is_image = torch.tensor([False, True, False, True, False, False])
    monkeypatch.setattr(model_mod.ops, "partial_sum_dtype", lambda device: torch.float32)
    # an image bias that decides: image rows take experts 0 .. k-1
    monkeypatch.setattr(moe.gate, "bias_vl", torch.linspace(50.0, -50.0, cfg.n_routed_experts))
    got = moe(x, is_image)
    bias = torch.where(is_image.unsqueeze(-1), moe.gate.bias_vl, moe.gate.bias)
    w, ids = ops.moe_route(x, moe.gate.weight, bias, cfg.num_experts_per_tok, cfg.routed_scaling_factor,
                           cfg.gate_temp, cfg.norm_topk_prob)
    routed = ops.moe_experts(x, w, ids, [e.parts() for e in moe.experts.values()], cfg.swiglu_limit, torch.float32)
    ones, zeros = torch.ones(6, 1), torch.zeros(6, 1, dtype=torch.long)
    shared = ops.moe_experts(x, ones, zeros, [moe.shared_experts.parts()], cfg.swiglu_limit, torch.float32)
    assert routed.dtype == shared.dtype == torch.float32
    assert got.dtype == torch.bfloat16 and torch.equal(got, (routed + shared).to(torch.bfloat16))
    k = cfg.num_experts_per_tok
    assert torch.equal(ids[is_image].sort(-1).values, torch.arange(k).expand(2, k))
    text_ids = ops.moe_route(x, moe.gate.weight, moe.gate.bias, k, cfg.routed_scaling_factor, cfg.gate_temp,
                             cfg.norm_topk_prob)[1]
    assert torch.equal(ids[~is_image], text_ids[~is_image])
