"""ModelConfig: nested and flat loading, validation messages, presets and the YaRN table
(MODEL.md sections 1, 3 and 6)."""

from __future__ import annotations

import copy
import json
import math

import pytest

from dsv41.core import config as C
from dsv41.core.config import (
    FLAT_KEYS,
    ConfigError,
    ModelConfig,
    RopeScaling,
    VisionConfig,
    from_dict,
    from_flat_dict,
    load_config,
    preset,
    yarn_inv_freq,
)

COMPRESS_RATIOS = [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]

# Written by hand from MODEL.md section 1 (not from ModelConfig defaults).
PUBLISHED = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "torch_dtype": "bfloat16",
    "image_token_id": 129264,
    "quantization_config": {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
        "scale_fmt": "ue8m0", "weight_block_size": [32, 32],
    },
    "vision_config": {
        "num_hidden_layers": 32, "hidden_size": 1024, "num_attention_heads": 16,
        "intermediate_size": 2816, "patch_size": 14, "downsample_ratio": 3, "max_image_tokens": 1024,
    },
    "text_config": {
        "model_type": "deepseek_v41", "dtype": "bfloat16",
        "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 64,
        "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280,
        "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128, "vocab_size": 129280,
        "moe_intermediate_size": 2304, "n_routed_experts": 384, "n_shared_experts": 1,
        "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
        "swiglu_limit": 10, "rms_norm_eps": 1e-20, "hc_mult": 4, "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6, "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1048576, "compress_ratios": COMPRESS_RATIOS,
        "index_n_heads": 32, "index_head_dim": 128, "kv_source_layer_ids": [2, 8, 14, 20],
        "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36], "candidate_source_layer_id": 20,
        "candidate_topk_blocks": 2048, "candidate_block_size": 8, "index_topk": 512,
        "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682],
        "engram_max_ngram_size": 4, "engram_n_heads": 8, "engram_head_dim": 256,
        "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092,
        "engram_vocab_size": 16000000, "num_nextn_predict_layers": 3, "dspark_block_size": 5,
        "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39],
        "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3,
    },
}

# Flat inference-style config (renamed keys) of the same model.
FLAT = {
    "vocab_size": 129280, "dim": 5120, "n_layers": 40, "n_heads": 64, "head_dim": 512,
    "rope_head_dim": 64, "q_lora_rank": 1280, "o_groups": 8, "o_lora_rank": 1024,
    "window_size": 128, "moe_inter_dim": 2304, "n_routed_experts": 384, "n_shared_experts": 1,
    "n_activated_experts": 6, "score_func": "sqrtsoftplus", "route_scale": 1.5,
    "swiglu_limit": 10.0, "norm_eps": 1e-20, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "max_seq_len": 1048576,
    "compress_ratios": COMPRESS_RATIOS, "index_n_heads": 32, "index_head_dim": 128,
    "index_topk": 512, "kv_source_layers": [2, 8, 14, 20],
    "index_source_layers": [2, 8, 14, 20, 24, 28, 32, 36], "candidate_source_layer": 20,
    "candidate_topk_blocks": 2048, "candidate_block_size": 8, "engram_layers": [1, 14],
    "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4,
    "engram_n_heads": 8, "engram_head_dim": 256, "engram_pad_id": 2,
    "engram_compressed_vocab_size": 99092, "engram_vocab_size": 16000000, "n_mtp_layers": 3,
    "dspark_block_size": 5, "dspark_noise_token_id": 128799, "dspark_target_layers": [37, 38, 39],
    "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_n_activated_experts": 3,
    "image_token_id": 129264, "original_seq_len": 65536, "rope_factor": 16, "beta_fast": 32,
    "beta_slow": 1, "dtype": "fp8", "scale_fmt": "ue8m0", "max_batch_size": 8,
    "vision_layers": 32, "vision_dim": 1024, "vision_heads": 16, "vision_inter_dim": 2816,
    "vision_patch_size": 14, "vision_downsample": 3, "vision_max_tokens": 1024,
}

# The released flat `inference/config.json`, key for key (the official key names: `n_mtp_layers`,
# `engram_layer_ids`, `dspark_target_layer_ids`, `vision_n_layers`, ..., no `max_seq_len`).
RELEASED_FLAT = {
    "vocab_size": 129280, "dim": 5120, "moe_inter_dim": 2304, "n_layers": 40, "n_mtp_layers": 3,
    "dspark_block_size": 5, "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39],
    "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_n_activated_experts": 3,
    "n_heads": 64, "n_routed_experts": 384, "n_shared_experts": 1, "n_activated_experts": 6,
    "score_func": "sqrtsoftplus", "route_scale": 1.5, "swiglu_limit": 10.0, "q_lora_rank": 1280,
    "head_dim": 512, "rope_head_dim": 64, "norm_eps": 1e-20, "o_groups": 8, "o_lora_rank": 1024,
    "window_size": 128, "kv_source_layers": [2, 8, 14, 20],
    "index_source_layers": [2, 8, 14, 20, 24, 28, 32, 36], "original_seq_len": 65536,
    "rope_theta": 10000, "rope_factor": 16, "beta_fast": 32, "beta_slow": 1, "index_n_heads": 32,
    "index_head_dim": 128, "index_topk": 512, "candidate_source_layer": 20,
    "candidate_topk_blocks": 2048, "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06, "engram_layer_ids": [1, 14], "engram_vocab_size": 16000000,
    "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4, "engram_pad_id": 2,
    "engram_compressed_vocab_size": 99092, "dtype": "fp8", "expert_dtype": "fp4",
    "compress_rope_theta": 160000, "compress_ratios": COMPRESS_RATIOS,
    "vision_n_layers": 32, "vision_dim": 1024, "vision_n_heads": 16, "vision_inter_dim": 2816,
    "vision_patch_size": 14, "vision_downsample_ratio": 3, "vision_max_n_token": 1024,
    "vision_min_pixels": 295936, "vision_max_wh_ratio": None, "image_token_id": 129264,
    "engram_n_heads": 8, "engram_head_dim": 256, "vision_rope_theta": 10000,
}


@pytest.fixture(scope="module")
def presets():
    return {name: preset(name) for name in ("tiny", "mini", "full")}


# ---- loading -------------------------------------------------------------------------------

def test_published_nested_config_loads():
    cfg = from_dict(copy.deepcopy(PUBLISHED))
    assert cfg == ModelConfig()
    assert cfg.weight_dtype == "fp8" and cfg.expert_dtype == "fp4"
    assert cfg.rope_scaling == RopeScaling(16.0, 65536, 32.0, 1.0)
    assert cfg.vision == VisionConfig()
    assert cfg.image_token_id == 129264
    assert len(cfg.compress_ratios) == 43
    assert [cfg.layer_kind(i) for i in (0, 1, 2, 3, 20, 24, 25, 39)] == [
        "swa", "swa", "full", "reuse", "full", "reindex", "reuse", "reuse"]
    assert cfg.decoder_start == 20


def test_to_hf_dict_round_trips(presets):
    for cfg in presets.values():
        d = json.loads(json.dumps(cfg.to_hf_dict()))  # through JSON, as a file would be
        assert d["model_type"] == "deepseek_v41"
        assert d["architectures"] == ["DeepseekV41ForCausalLM"]
        assert d["quantization_config"]["weight_block_size"] == [32, 32]
        assert d["quantization_config"]["scale_fmt"] == "ue8m0"
        assert from_dict(d) == cfg
    full = presets["full"]
    bf16 = full.replace(weight_dtype="bf16", vision=None)
    d = bf16.to_hf_dict()
    assert "quantization_config" not in d and "vision_config" not in d
    assert from_dict(d) == bf16
    no_yarn = full.replace(rope_scaling=None)
    assert from_dict(no_yarn.to_hf_dict()).rope_scaling is None


def test_to_hf_dict_round_trips_text_only_image_token():
    cfg = from_flat_dict({k: v for k, v in FLAT.items() if not k.startswith("vision_")
                          and k != "image_token_id"})
    assert cfg.vision is None and cfg.image_token_id is None
    assert from_dict(cfg.to_hf_dict()) == cfg


def test_flat_config_matches_nested():
    nested = from_dict(copy.deepcopy(PUBLISHED))
    flat = from_dict(dict(FLAT))
    for key, name in FLAT_KEYS.items():
        if key in FLAT:
            assert getattr(flat, name) == getattr(nested, name), name
    # nothing left over differs either (every ModelConfig field is covered by the two files)
    assert flat == nested
    assert flat.rope_scaling == nested.rope_scaling
    assert flat.vision == nested.vision
    assert flat.weight_dtype == "fp8"  # flat `dtype` fp8 = FP8 weights


def test_flat_defaults_and_rope_switch():
    base = {k: v for k, v in FLAT.items() if k not in ("max_seq_len", "original_seq_len",
                                                        "rope_factor", "beta_fast", "beta_slow")}
    cfg = from_flat_dict(base)
    assert cfg.max_position_embeddings == 4096  # absent max_seq_len: reference default
    assert cfg.rope_scaling is None  # absent original_seq_len: no YaRN
    cfg0 = from_flat_dict({**base, "original_seq_len": 0, "rope_factor": 16})
    assert cfg0.rope_scaling is None
    cfg1 = from_flat_dict({**base, "original_seq_len": 65536, "rope_factor": 16, "max_seq_len": 8192})
    assert cfg1.rope_scaling == RopeScaling(16, 65536, 32, 1)
    assert cfg1.max_position_embeddings == 8192
    # norm_topk_prob absent in the flat file: default true
    assert cfg.norm_topk_prob is True
    assert cfg.vision == VisionConfig()  # from the vision_* keys
    # without vision keys there is no vision tower
    text_only = from_flat_dict({k: v for k, v in base.items() if not k.startswith("vision_")})
    assert text_only.vision is None


def test_released_flat_config_loads():
    """The released flat file (every key it holds) gives the published model; only the absent
    `max_seq_len` falls back to the reference default."""
    cfg = from_flat_dict(json.loads(json.dumps(RELEASED_FLAT)))
    assert cfg == ModelConfig(max_position_embeddings=4096)
    assert cfg.vision == VisionConfig() and cfg.vision.min_pixels == 295936 and cfg.vision.max_wh_ratio is None
    assert cfg.engram_layer_ids == [1, 14] and cfg.dspark_target_layer_ids == [37, 38, 39]
    assert cfg.norm_topk_prob is True  # absent from the released file


def test_flat_reference_args_at_their_v41_values():
    """A dump of the reference ModelArgs also carries `n_hash_layers` and `scale_dtype`: accepted at
    V4.1's values, a clear error otherwise."""
    assert from_flat_dict({**RELEASED_FLAT, "n_hash_layers": 0, "scale_dtype": "fp8"}) == from_flat_dict(RELEASED_FLAT)
    with pytest.raises(ConfigError, match=r"n_hash_layers = 3 is not supported \(V4.1 uses 0\)"):
        from_flat_dict({**RELEASED_FLAT, "n_hash_layers": 3})
    with pytest.raises(ConfigError, match="scale_dtype = 'fp32' is not supported"):
        from_flat_dict({**RELEASED_FLAT, "scale_dtype": "fp32"})


def test_norm_topk_prob_and_compressed_vocab_validated():
    with pytest.raises(ConfigError, match="norm_topk_prob must be true or false, got 'yes'"):
        from_dict(_nested(norm_topk_prob="yes"))
    assert from_dict(_nested(norm_topk_prob=False)).norm_topk_prob is False
    with pytest.raises(ConfigError, match=r"engram_compressed_vocab_size \(0\) must be the size of the tokenizer"):
        from_dict(_nested(engram_compressed_vocab_size=0))


def test_flat_unknown_key_is_named():
    with pytest.raises(ConfigError, match="bogus_key"):
        from_flat_dict({**FLAT, "bogus_key": 1})


# ---- validation ----------------------------------------------------------------------------

def _nested(**text_changes):
    d = copy.deepcopy(PUBLISHED)
    d["text_config"].update(text_changes)
    return d


def test_unknown_model_type():
    d = copy.deepcopy(PUBLISHED)
    d["model_type"] = "llama"
    with pytest.raises(ConfigError, match=r"unknown model_type 'llama'"):
        from_dict(d)


def test_compress_ratios_length():
    with pytest.raises(ConfigError, match=r"compress_ratios has 40 entries.*40 \+ 3 = 43"):
        from_dict(_nested(compress_ratios=COMPRESS_RATIOS[:40]))
    tiny = C._tiny()
    with pytest.raises(ConfigError, match=r"compress_ratios has 12 entries.*= 15"):
        tiny.replace(compress_ratios=tiny.compress_ratios[:12]).validate()


def test_kv_source_with_ratio_zero():
    r = list(COMPRESS_RATIOS)
    r[8] = 0
    with pytest.raises(ConfigError, match="KV source layer 8 has compress ratio 0"):
        from_dict(_nested(compress_ratios=r))


def test_reindex_before_first_full():
    tiny = C._tiny()
    bad = tiny.replace(index_source_layer_ids=[1, 2, 4, 6, 8, 10])
    with pytest.raises(ConfigError, match=r"Reindex layer 1 comes before the first Full layer \(2\)"):
        bad.validate()
    r = list(COMPRESS_RATIOS)
    r[1] = 2
    with pytest.raises(ConfigError, match=r"Reindex layer 1 comes before the first Full layer \(2\)"):
        from_dict(_nested(compress_ratios=r, index_source_layer_ids=[1, 2, 8, 14, 20, 24, 28, 32, 36]))


def test_heads_not_divisible_by_o_groups():
    with pytest.raises(ConfigError, match=r"num_attention_heads \(64\) is not divisible by o_groups \(6\)"):
        from_dict(_nested(o_groups=6))


@pytest.mark.parametrize("name", ["hidden_size", "head_dim", "q_lora_rank", "o_lora_rank",
                                  "moe_intermediate_size", "index_head_dim"])
def test_width_not_multiple_of_32(name):
    v = getattr(ModelConfig(), name) + 16
    with pytest.raises(ConfigError, match=rf"{name} \({v}\) must be a multiple of 32"):
        from_dict(_nested(**{name: v}))


def test_all_problems_reported_together():
    with pytest.raises(ConfigError) as e:
        from_dict(_nested(o_groups=6, hidden_size=5100))
    msg = str(e.value)
    assert "o_groups" in msg and "hidden_size (5100)" in msg


def test_load_config_files(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(PUBLISHED))
    assert load_config(good) == ModelConfig()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(FLAT))
    assert load_config(ckpt) == ModelConfig()

    arr = tmp_path / "arr.json"
    arr.write_text("[1, 2, 3]")
    with pytest.raises(ConfigError, match="expected a JSON object, got list"):
        load_config(arr)
    broken = tmp_path / "broken.json"
    broken.write_text('{"model_type": "deepseek_v41", ')
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(broken)
    empty = tmp_path / "empty_ckpt"
    empty.mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        load_config(empty)
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.json")


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


# ---- presets -------------------------------------------------------------------------------

def test_presets_validate(presets):
    for name, cfg in presets.items():
        assert cfg.problems() == [], name
        assert len(cfg.compress_ratios) == cfg.num_hidden_layers + cfg.num_nextn_predict_layers
        assert all(n > 0 for n in cfg.engram_num_embeddings)
    assert presets["full"] == ModelConfig()
    kinds = {presets["tiny"].layer_kind(i) for i in range(presets["tiny"].num_hidden_layers)}
    assert kinds == {"swa", "full", "reindex", "reuse"}
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        preset("huge")


# ---- YaRN ----------------------------------------------------------------------------------

def test_yarn_inv_freq_published():
    cfg = ModelConfig()
    got = yarn_inv_freq(cfg, ratio=2)
    assert got == yarn_inv_freq(cfg, ratio=1)
    assert len(got) == 32
    plain = [1.0 / 160000.0 ** (2 * i / 64) for i in range(32)]
    for i in range(32):
        if i <= 15:
            assert got[i] == pytest.approx(plain[i], rel=1e-12), i
        elif i >= 25:
            assert got[i] == plain[i] / 16, i  # exactly divided by 16
        else:
            t = (i - 15) / 10  # linear ramp over pairs 15..25
            assert got[i] == pytest.approx(plain[i] * (1 - t) + plain[i] / 16 * t, rel=1e-12), i
            assert plain[i] / 16 < got[i] < plain[i]
    # the blend factor is linear in the pair index
    ramp = [(plain[i] - got[i]) / (plain[i] - plain[i] / 16) for i in range(15, 26)]
    assert ramp == pytest.approx([k / 10 for k in range(11)], abs=1e-12)


def test_yarn_inv_freq_ratio0_and_no_scaling():
    cfg = ModelConfig()
    got = yarn_inv_freq(cfg, ratio=0)
    assert got == pytest.approx([1.0 / 10000.0 ** (2 * i / 64) for i in range(32)], rel=1e-12)
    off = cfg.replace(rope_scaling=None)
    assert yarn_inv_freq(off, ratio=2) == pytest.approx(
        [1.0 / 160000.0 ** (2 * i / 64) for i in range(32)], rel=1e-12)
    assert math.isclose(yarn_inv_freq(off, 0)[1], 10000.0 ** (-2 / 64), rel_tol=1e-12)


@pytest.mark.parametrize("expert", ["fp4", "fp8", "bf16"])
def test_bf16_weight_config_keeps_expert_dtype(tiny_cfg, expert):
    """A bf16-weight config has no quantization_config; its expert storage still round-trips."""
    cfg = tiny_cfg.replace(weight_dtype="bf16", expert_dtype=expert)
    back = from_dict(json.loads(json.dumps(cfg.to_hf_dict())))
    assert (back.weight_dtype, back.expert_dtype) == ("bf16", expert)


def test_flat_form_writes_the_released_keys(presets):
    """`to_flat_dict` writes exactly the released keys (+ max_seq_len) and loads back as the same
    config; what those keys cannot state is one error, not a silently different model."""
    from dsv41.core.config import FLAT_RELEASED

    assert FLAT_RELEASED == set(RELEASED_FLAT)
    for cfg in presets.values():
        flat = cfg.to_flat_dict()
        assert set(flat) == set(RELEASED_FLAT) | {"max_seq_len"}
        assert from_flat_dict(json.loads(json.dumps(flat))) == cfg
    with pytest.raises(ConfigError, match="cannot state"):
        presets["tiny"].replace(gate_temp=2.0).to_flat_dict()
