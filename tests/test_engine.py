"""Reference engine: sampling, stop rules, prefix cache with SWA bounded replay."""

import pytest
from _util import rand_prompt

from dsv41.core.engine import Engine, SamplingParams


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_greedy_is_deterministic_and_respects_max_tokens(tiny_model, tiny_cfg, rng):
    prompt = rand_prompt(tiny_cfg, 20, rng).tolist()
    e = Engine(tiny_model, prefill_mode="exact")
    a = e.generate(prompt, SamplingParams(max_new_tokens=6))
    b = e.generate(prompt, SamplingParams(max_new_tokens=6))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 6 and a.finish_reason == "length"


def test_stop_token_ends_generation(tiny_model, tiny_cfg, rng):
    prompt = rand_prompt(tiny_cfg, 12, rng).tolist()
    e = Engine(tiny_model)
    first = e.generate(prompt, SamplingParams(max_new_tokens=5)).token_ids
    stopped = e.generate(prompt, SamplingParams(max_new_tokens=5, stop_token_ids=(first[2],)))
    cut = first.index(first[2]) + 1
    assert stopped.token_ids == first[:cut] and stopped.finish_reason == "stop"


def test_seeded_sampling_reproduces_and_varies(tiny_model, tiny_cfg, rng):
    prompt = rand_prompt(tiny_cfg, 10, rng).tolist()
    e = Engine(tiny_model)
    p = dict(max_new_tokens=12, temperature=1.5, top_p=0.95, top_k=50)
    a = e.generate(prompt, SamplingParams(seed=1, **p)).token_ids
    assert a == e.generate(prompt, SamplingParams(seed=1, **p)).token_ids
    others = {tuple(e.generate(prompt, SamplingParams(seed=s, **p)).token_ids) for s in range(2, 6)}
    assert len(others | {tuple(a)}) > 1


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2)])
def test_invalid_sampling_options(tiny_model, bad):
    with pytest.raises(ValueError):
        Engine(tiny_model).generate([5, 6, 7], SamplingParams(**bad))


def test_prompt_beyond_context_is_rejected(tiny_model, tiny_cfg):
    e = Engine(tiny_model)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        e.generate([5] * (tiny_cfg.max_position_embeddings - 2), SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        e.generate([], SamplingParams())
    with pytest.raises(ValueError, match="prefill_mode"):
        Engine(tiny_model, prefill_mode="fast")


def _cold(model, prompt):
    _, logits, ctx, _ = Engine(model, prefill_mode="exact").prefill(prompt, len(prompt) + 1)
    return logits, ctx


def test_prefix_hit_with_exact_replay_matches_cold_path(tiny_model, tiny_cfg, rng):
    cfg = tiny_cfg
    replay = cfg.sliding_window * cfg.num_hidden_layers  # 96
    prompt = rand_prompt(cfg, 150, rng).tolist()
    cold, cold_ctx = _cold(tiny_model, prompt)
    e = Engine(tiny_model, prefill_mode="exact", replay="exact", prefix_cache=True, prefix_block_size=16)
    e.prefill(prompt[:140] + [7, 7, 7], 200)  # shares 140 tokens: 8 full blocks = 128 cached
    _, logits, ctx, hit = e.prefill(prompt, 200)
    assert hit == 128 and e.prefix.stats["hits"] == 1
    # the encoder skipped the cached prefix except the replayed span (counted, not assumed)
    assert ctx.counters["encoder_tokens"] == len(prompt) - (hit - replay)
    assert cold_ctx.counters["encoder_tokens"] == len(prompt)
    # the global KV of the cached prefix was reused, not recomputed
    src = cfg.kv_source_layer_ids[0]
    assert ctx.counters[f"compressed_entries.{src}"] == (len(prompt) - hit) // cfg.compress_ratios[src]
    assert rel_err(logits, cold) <= 1e-5


def test_prefix_hit_with_window_replay_is_bounded_and_measured(tiny_model, tiny_cfg, rng):
    cfg = tiny_cfg
    errs = []
    for _ in range(3):
        prompt = rand_prompt(cfg, 70, rng).tolist()
        cold, _ = _cold(tiny_model, prompt)
        e = Engine(tiny_model, prefill_mode="exact", prefix_cache=True, prefix_block_size=16)
        e.prefill(prompt[:64], 200)
        _, logits, ctx, hit = e.prefill(prompt, 200)
        assert hit == 64
        assert ctx.counters["encoder_tokens"] == len(prompt) - hit + cfg.sliding_window
        errs.append(rel_err(logits, cold))
    print("\n[dsv41] prefix hit, default bounded replay (window 8, 12 layers) vs cold path, "
          "last-position logits rel. error: " + ", ".join(f"{e:.3g}" for e in errs))
    assert all(0 < e < 2 for e in errs)


def test_prefix_cache_never_serves_a_different_prompt(tiny_model, tiny_cfg, rng):
    e = Engine(tiny_model, prefix_cache=True, prefix_block_size=16)
    a = rand_prompt(tiny_cfg, 40, rng).tolist()
    b = list(a)
    b[3] = (b[3] + 1 - 5) % (tiny_cfg.vocab_size - 5) + 5  # differs inside the first block
    e.prefill(a, 64)
    _, _, _, hit = e.prefill(b, 64)
    assert hit == 0
