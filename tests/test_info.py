"""`model_info`: published figures of the full config, and the analytic backbone count checked
against an actually built tiny model."""

from __future__ import annotations

import time

import torch

from dsv41.core.config import ModelConfig, preset
from dsv41.core.info import format_info, model_info
from dsv41.core.weights import build_model


def test_full_config_figures():
    t0 = time.perf_counter()
    info = model_info(ModelConfig())
    assert time.perf_counter() - t0 < 2.0
    p = info["params"]
    assert info["kv_bytes_per_token"] == 890
    assert info["swa_bytes_per_sequence"] == 40 * 128 * (512 + 16)
    assert 540e9 <= p["backbone"] <= 560e9
    assert 190e9 <= p["engram"] <= 200e9
    assert p["engram"] == (384006168 + 384016682) * 256
    assert 7e9 <= p["activated_prefill"] <= 9e9
    assert 14e9 <= p["activated_decode"] <= 18e9
    assert p["total"] == p["backbone"] + p["engram"] + p["dspark"] + p["vision"]
    assert p["dspark"] > 0 and p["vision"] > 0


def test_full_config_layers():
    lay = model_info(ModelConfig())["layers"]
    assert lay["swa"] == [0, 1]
    assert lay["full"] == [2, 8, 14, 20]
    assert lay["reindex"] == [24, 28, 32, 36]
    assert len(lay["reuse"]) == 30
    assert lay["encoder"] == list(range(20))
    assert lay["decoder"] == list(range(20, 40))
    assert sorted(lay["swa"] + lay["full"] + lay["reindex"] + lay["reuse"]) == list(range(40))


def test_tiny_backbone_matches_built_model():
    cfg = preset("tiny")
    model = build_model(cfg)
    n = n_mtp = n_vision = 0
    for name, t in model.state_dict().items():
        if name.endswith(".scale") or ".engram.embed." in name:
            continue
        if name.startswith("mtp."):  # the DSpark drafter, counted apart
            n_mtp += t.numel() * (2 if t.dtype == torch.int8 else 1)
            continue
        if name.startswith(("vision.", "aligner.", "image_")):  # the vision tower, counted apart
            n_vision += t.numel()
            continue
        n += t.numel() * (2 if t.dtype == torch.int8 else 1)
    assert any(t.dtype == torch.int8 for t in model.state_dict().values())  # packed FP4 experts present
    info = model_info(cfg)
    assert info["params"]["backbone"] == n
    assert info["params"]["dspark"] == n_mtp > 0
    assert info["params"]["vision"] == n_vision > 0
    engram_rows = sum(t.shape[0] for k, t in model.state_dict().items() if k.endswith("engram.embed.weight"))
    assert info["params"]["engram"] == engram_rows * cfg.engram_head_dim


def test_format_info():
    text = format_info(model_info(ModelConfig()))
    assert "551.88B" in text and "890 B" in text
    tiny = format_info(model_info(preset("tiny")))
    assert "B" in tiny and "," in tiny
