"""The whole model on CUDA (Triton kernels where registered, the reference ops on CUDA tensors
elsewhere) against the CPU reference, same weights. Marked `gpu`; skipped without CUDA.

Why two bounds: while a prompt is shorter than the indexer's top-k (x ratio) and the candidate
pool, every visible entry is selected and the two runs differ only by bf16 rounding, so the
logits must agree closely. Past that, a score difference of one ulp can select another entry,
which is a legitimate discrete difference; there the test requires the greedy tokens to agree
at most positions and reports the logit error instead of bounding it tightly.
"""

import pytest
import torch
from _util import rand_prompt

from dsv41.core.cache import SequenceCache
from dsv41.core.config import preset
from dsv41.core.weights import build_model, random_state_dict

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# bf16 activations through 12 layers: errors of a few bf16 ulps (2^-8 each) relative to the
# logits' scale are expected; 3e-2 of the max |logit| leaves room for that and nothing else.
BF16_MODEL_REL = 3e-2


def _pair(seed):
    cfg = preset("tiny")
    cpu = build_model(cfg, seed=seed)
    sd = random_state_dict(cpu, seed)
    gpu = build_model(cfg, device="cuda", state_dict={k: v.cuda() for k, v in sd.items()})
    return cfg, cpu, gpu


def _logits(model, ids):
    cache = SequenceCache.allocate(model.cfg, len(ids), ids.device)
    return model(ids, cache, all_logits=True).float().cpu()


def test_model_forward_cuda_matches_cpu_reference(fresh_seed):
    cfg, cpu, gpu = _pair(fresh_seed)
    gen = torch.Generator().manual_seed(fresh_seed)
    n = min(cfg.index_topk * 2, cfg.candidate_topk_blocks * cfg.candidate_block_size)  # no selection yet
    ids = rand_prompt(cfg, n, gen)
    ref, out = _logits(cpu, ids), _logits(gpu, ids.cuda())
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    print(f"\n[dsv41] CUDA vs CPU reference, tiny preset, {n} tokens: max rel. logit error {err:.3g}")
    assert err <= BF16_MODEL_REL


def test_long_prompt_cuda_tracks_cpu_reference(fresh_seed):
    cfg, cpu, gpu = _pair(fresh_seed + 1)
    gen = torch.Generator().manual_seed(fresh_seed + 1)
    ids = rand_prompt(cfg, 64, gen)
    ref, out = _logits(cpu, ids), _logits(gpu, ids.cuda())
    agree = (ref.argmax(-1) == out.argmax(-1)).float().mean().item()
    err = ((out - ref).abs().amax(-1) / ref.abs().amax(-1)).median().item()
    print(f"\n[dsv41] CUDA vs CPU, 64 tokens (top-k and pool exceeded): greedy agreement {agree:.3f}, "
          f"median rel. logit error {err:.3g}")
    assert agree >= 0.9
