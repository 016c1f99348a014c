"""Random weights (core/weights.py): the realistic draw follows the released checkpoint's
statistics (MODEL.md section 8); the unit draw stays available."""

import math

import pytest
import torch

from dsv41.backends.reference import quant
from dsv41.core.model import Transformer
from dsv41.core.weights import (
    EMBED_RMS,
    ROUTER_GAIN,
    build_model,
    check_state_dict,
    norm_mean,
    projection_gain,
    random_state_dict,
)


@pytest.fixture(scope="module")
def meta_model(tiny_cfg):
    with torch.device("meta"):
        return Transformer(tiny_cfg)


@pytest.fixture(scope="module")
def draws(meta_model, fresh_seed):
    return {init: random_state_dict(meta_model, fresh_seed, init) for init in ("realistic", "unit")}


def decoded(sd: dict, owner: str) -> torch.Tensor:
    """A Linear's weight as the model uses it (FP8 / FP4 storage decoded), fp32."""
    w, s = sd[owner + ".weight"], sd.get(owner + ".scale")
    if s is None:
        return w.float()
    if w.dtype == torch.int8:
        return quant.fp4_weight_dequant(w, s)
    return quant.fp8_block_dequant(w, s)


def rms(t: torch.Tensor) -> float:
    return float(t.float().pow(2).mean().sqrt())


def test_section_8_gains_and_means_by_name():
    """The names MODEL.md section 8 measures, in the text backbone and the drafter only."""
    assert projection_gain("layers.3.attn.wq_a") == 1.6 and projection_gain("mtp.1.attn.wo_b") == 1.9
    assert projection_gain("layers.3.attn.wq_b") == 0.95 and projection_gain("layers.0.attn.wkv") == 1.8
    assert projection_gain("layers.3.attn.wo_a") == 1.6
    assert projection_gain("layers.2.ffn.experts.5.w1") == 1.5 and projection_gain("layers.2.ffn.experts.5.w3") == 1.5
    assert projection_gain("mtp.0.ffn.shared_experts.w2") == 1.05
    for other in ("layers.3.attn.indexer.wq_b", "layers.3.attn.compressor.wkv", "layers.1.engram.wkv", "head",
                  "mtp.0.main_proj", "vision.blocks.0.mlp.w1", "aligner.w1"):
        assert projection_gain(other) == 1.0, other
    assert norm_mean("layers.3.attn_norm") == 0.025 and norm_mean("mtp.2.ffn_norm") == 0.2
    assert norm_mean("layers.3.attn.q_norm") == 0.97 and norm_mean("layers.3.attn.kv_norm") == 0.4
    assert norm_mean("layers.4.attn.compressor.norm") == 0.6 and norm_mean("layers.4.attn.indexer.k_norm") == 0.5
    for other in ("norm", "mtp.0.main_norm", "mtp.2.norm", "vision.blocks.0.norm1", "vision.norm"):
        assert norm_mean(other) == 1.0, other


def test_realistic_draw_has_the_released_statistics(draws, tiny_cfg):
    sd = draws["realistic"]
    assert rms(sd["embed.weight"]) == pytest.approx(EMBED_RMS, rel=0.03)
    # norm weights: the measured mean, a spread of 10% of it (128 or 64 values: ~1% / 1.5% sampling error)
    for owner, mean in [("layers.3.attn_norm", 0.025), ("layers.3.ffn_norm", 0.2), ("layers.3.attn.q_norm", 0.97),
                        ("layers.3.attn.kv_norm", 0.4), ("layers.4.attn.compressor.norm", 0.6),
                        ("layers.4.attn.indexer.k_norm", 0.5), ("norm", 1.0)]:
        w = sd[owner + ".weight"].float()
        assert w.mean().item() == pytest.approx(mean, rel=0.05), owner
        assert (w.std() / w.mean()).item() == pytest.approx(0.1, rel=0.3), owner
    # projections: decoded std = gain * fan_in^-0.5 (>= 4096 values: ~1% sampling error)
    for owner, gain in [("layers.3.attn.wq_a", 1.6), ("layers.3.attn.wq_b", 0.95), ("layers.3.attn.wkv", 1.8),
                        ("layers.3.attn.wo_a", 1.6), ("layers.3.attn.wo_b", 1.9), ("layers.3.ffn.shared_experts.w1", 1.5),
                        ("layers.3.ffn.shared_experts.w2", 1.05), ("layers.4.attn.indexer.wq_b", 1.0), ("head", 1.0)]:
        w = decoded(sd, owner)
        assert rms(w) == pytest.approx(gain / math.sqrt(w.shape[1]), rel=0.04), owner
    gate = sd["layers.3.ffn.gate.weight"]
    assert rms(gate) == pytest.approx(ROUTER_GAIN / math.sqrt(tiny_cfg.hidden_size), rel=0.04)


def test_fp4_expert_scales_give_the_target_rms(draws):
    """Every routed expert's decoded weight has exactly (to 1e-3) the target RMS."""
    sd = draws["realistic"]
    owners = sorted({k[: -len(".weight")] for k in sd if ".ffn.experts." in k and k.endswith(".weight")})
    assert len(owners) > 20
    for owner in owners:
        w = decoded(sd, owner)
        target = projection_gain(owner) / math.sqrt(w.shape[1])
        assert rms(w) == pytest.approx(target, rel=1e-3), owner


def test_unit_draw_is_the_earlier_one(draws):
    sd = draws["unit"]
    assert rms(sd["embed.weight"]) == pytest.approx(1.0, rel=0.03)
    assert sd["layers.3.attn_norm.weight"].float().mean().item() == pytest.approx(1.0, rel=0.03)
    w = decoded(sd, "layers.3.attn.wq_a")
    assert rms(w) == pytest.approx(1 / math.sqrt(w.shape[1]), rel=0.04)
    # every tensor the realistic draw covers is drawn in both, with the same names and storage
    real = draws["realistic"]
    assert sd.keys() == real.keys()
    assert all(sd[k].dtype == real[k].dtype and sd[k].shape == real[k].shape for k in sd)


def test_engram_gate_rows_are_drawn_per_stream(draws, tiny_cfg):
    for init, sd in draws.items():
        q = sd["layers.1.engram.q_weight"]
        assert q.shape == (tiny_cfg.hc_mult, tiny_cfg.hidden_size)
        assert all(not torch.equal(q[i], q[j]) for i in range(q.shape[0]) for j in range(i)), init


def test_draw_is_seeded_and_checked(meta_model, tiny_cfg, draws, fresh_seed):
    a, b = random_state_dict(meta_model, fresh_seed), draws["realistic"]  # the default is the realistic draw
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
    with pytest.raises(ValueError, match=r"init must be one of \('realistic', 'unit'\), got 'normal'"):
        random_state_dict(meta_model, 5, "normal")
    model = build_model(tiny_cfg, seed=fresh_seed + 1)
    assert not torch.equal(model.embed.weight, a["embed.weight"])
    assert rms(model.embed.weight) == pytest.approx(EMBED_RMS, rel=0.03)


def test_w8a8_linears_are_drawn_in_their_storage(tiny_cfg, fresh_seed):
    """A W8A8 config (int8 linears and experts, per-output-channel scales) draws int8 weights whose
    decoded values have the same statistics."""
    cfg = tiny_cfg.replace(weight_dtype="int8", expert_dtype="int8")
    with torch.device("meta"):
        model = Transformer(cfg)
    sd = random_state_dict(model, fresh_seed)
    for owner, gain in [("layers.3.attn.wq_a", 1.6), ("layers.3.ffn.experts.1.w2", 1.05)]:
        w, s = sd[owner + ".weight"], sd[owner + ".scale"]
        assert w.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (w.shape[0], 1)
        assert rms(w.float() * s) == pytest.approx(gain / math.sqrt(w.shape[1]), rel=0.04), owner
    check_state_dict(model, sd)  # names, shapes and dtypes are the model's
