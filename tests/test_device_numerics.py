"""Device numerics against the CPU reference (deploy/device_numerics.py), and greedy decode
against the same device's exact prefill.

The GPU tests hold the thresholds the README reports (measured on an H200, tiny preset,
realistic random weights); the CPU test checks the self-consistency measure itself on the
reference, where decode equals prefill bit for bit."""

from __future__ import annotations

import pytest
import torch
from dsv41.core.weights import build_model
from dsv41.deploy.device_numerics import compare_logits, greedy_self_consistency, teacher_forced

# Thresholds on the tiny preset (README, "Device numerics"): about twice the distance measured
# on an H200 (cosine min 0.771 -> 1 - cos doubled; KL mean 0.049) before the kernels took the
# official rounding points (0.883 / 0.033 after, seed 0, 2026-12-01). The tiny model is chaotic:
# the CPU reference's own exact mode is as far from its official mode (cosine min 0.73, top-1
# 0.61), so top-1 agreement is reported, not held; a broken kernel gives cosines near 0.
MIN_COSINE = 0.5
MAX_KL_MEAN = 0.1
MIN_GREEDY_AGREE = 0.3  # measured 0.55-0.57 (the issue asks 0.99: missed); chance is 1/512


def test_greedy_equals_prefill_on_the_reference(tiny_cfg, fresh_seed):
    model = build_model(tiny_cfg, seed=fresh_seed, with_drafter=False)
    r = greedy_self_consistency(model, n_prompt=6, n_new=10, seed=fresh_seed)
    assert r["positions"] == 10 and r["agree"] == 1.0, r


def test_compare_logits_measures_distance(rng):
    ref = torch.randn(5, 50, generator=rng)
    same = compare_logits(ref, ref.clone())
    assert same["cosine_min"] > 0.9999 and same["top1"] == 1.0 and same["kl_max"] < 1e-6
    noisy = compare_logits(ref, ref + torch.randn(5, 50, generator=rng))
    assert noisy["cosine_min"] < 0.9 and noisy["kl_mean"] > 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_logits_track_the_official_reference(tiny_cfg, fresh_seed):
    r = teacher_forced(tiny_cfg, "cuda", n=48, seed=fresh_seed)
    summary = {k: v for k, v in r.items() if k not in ("cosine", "kl")}
    print("device numerics (tiny):", summary)
    assert r["cosine_min"] >= MIN_COSINE, summary
    assert r["kl_mean"] <= MAX_KL_MEAN, summary


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_greedy_decode_equals_its_exact_prefill(tiny_cfg, fresh_seed):
    model = build_model(tiny_cfg, seed=fresh_seed, device="cuda", with_drafter=False)
    r = greedy_self_consistency(model, n_prompt=16, n_new=100, seed=fresh_seed)
    print("greedy vs exact prefill (tiny, cuda):", r)
    assert r["agree"] >= MIN_GREEDY_AGREE, r


# The bar for greedy decode against the device's own exact prefill, held in the
# batch-invariant mode (DSV41_BATCH_INVARIANT=1), where every op computes a row alike whatever
# the call's row count (1.000 on the H200, 2026-12-01).
MIN_GREEDY_AGREE_INVARIANT = 0.99


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_greedy_decode_equals_its_exact_prefill_batch_invariant(tiny_cfg, fresh_seed):
    model = build_model(tiny_cfg, seed=fresh_seed, device="cuda", with_drafter=False)
    r = greedy_self_consistency(model, n_prompt=16, n_new=100, seed=fresh_seed, batch_invariant=True)
    print("greedy vs exact prefill (tiny, cuda, batch-invariant):", r)
    assert r["agree"] >= MIN_GREEDY_AGREE_INVARIANT, r
