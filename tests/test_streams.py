"""The second device stream (`Transformer.overlap_streams`: each MoE's shared expert beside its
routed experts): the same arithmetic, so the same logits and tokens with it on or off."""

from __future__ import annotations

import pytest
import torch
from dsv41.core.engine import Engine, SamplingParams, SingleSequence
from dsv41.core.weights import build_model

from _util import rand_prompt


def test_overlap_gives_the_same_logits(tiny_cfg, fresh_seed, rng):
    model = build_model(tiny_cfg, seed=fresh_seed, with_drafter=False)
    ids = rand_prompt(tiny_cfg, 12, rng)
    want = SingleSequence(model).feed(ids, all_logits=True)
    model.overlap_streams(True)
    assert all(blk.ffn.overlap_shared for blk in model.layers)
    got = SingleSequence(model).feed(ids, all_logits=True)
    assert want.abs().max() > 0 and torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_overlap_in_decode_graphs_gives_the_same_tokens(tiny_cfg, fresh_seed, rng):
    """The fork / join of the second stream inside captured decode steps."""
    model = build_model(tiny_cfg, seed=fresh_seed, device="cuda", with_drafter=False)
    prompts = [rand_prompt(tiny_cfg, n, rng).tolist() for n in (4, 7)]

    def tokens():
        engine = Engine(model, max_batch=2, graphs=True, max_model_len=64)
        return [r.token_ids for r in engine.generate_batch([(p, SamplingParams(max_new_tokens=10), None)
                                                            for p in prompts])]

    model.overlap_streams(False)
    want = tokens()
    model.overlap_streams(None)  # CUDA's default: on at decode sizes
    assert all(blk.ffn.overlap_shared is None for blk in model.layers)
    assert tokens() == want
    model.overlap_streams(True)
    assert tokens() == want
