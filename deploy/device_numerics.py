"""Cross-backend numerics report: the device path's logits against the CPU reference.

`teacher_forced(cfg, ...)`: one random prompt, every position's logits by an exact prefill,
on the CPU reference in the official rounding mode (`backends/numerics.py`) and on the device
with the same weights; per position the cosine of the two logit vectors, whether their argmax
agrees, and KL(reference || device) of the softmaxes (fp32 log-softmax).

`greedy_self_consistency(model, ...)`: greedy decode on the device (one token per step, through
the engine, decode graphs where the device has them), then one exact prefill of prompt +
generated tokens on the same device; the fraction of generated positions whose prefill argmax
is the token the decode chose.

`dsv41`'s benchmarks print these (`benchmarks/e2e.py --numerics`) and tests/test_device_numerics.py
holds thresholds on them.
"""

from __future__ import annotations

import torch

from ..backends.numerics import numerics
from ..core.batch import Chunk, build_step
from ..core.engine import Engine, SamplingParams, SingleSequence
from ..core.weights import build_model


def logits_all(model, ids: list[int]) -> torch.Tensor:
    """fp32 logits [n, V] of every position of `ids` (one exact prefill, a fresh cache). Every id
    is text, as generated tokens are, even one equal to the image token id."""
    seq = SingleSequence(model)
    batch = build_step(model.cfg, seq.pool, [Chunk(seq.state, list(ids), 0, "all", text_only=True)],
                       model.embed.weight.device, model.cfg.image_token_id)
    return model(batch, seq.pool).float()


def compare_logits(ref: torch.Tensor, dev: torch.Tensor) -> dict:
    """Per-position cosine, top-1 agreement and KL(ref || dev) of two [n, V] logit tensors."""
    ref, dev = ref.float().cpu(), dev.float().cpu()
    cos = torch.nn.functional.cosine_similarity(ref, dev, dim=-1)
    top1 = (ref.argmax(-1) == dev.argmax(-1)).float()
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(dev, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return {"positions": ref.shape[0], "cosine_min": float(cos.min()), "cosine_mean": float(cos.mean()),
            "top1": float(top1.mean()), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "cosine": cos.tolist(), "kl": kl.tolist()}


def teacher_forced(cfg, device: str | torch.device, n: int, seed: int = 0, ref_model=None, dev_model=None) -> dict:
    """Device vs CPU reference (official rounding) on `n` random positions of one prompt; the
    models are built from the default CPU draw of `seed` unless given."""
    ref_model = ref_model if ref_model is not None else build_model(cfg, seed=seed, with_drafter=False)
    if dev_model is None:
        dev_model = build_model(cfg, seed=seed, device=device, with_drafter=False,
                                state_dict={k: v for k, v in ref_model.state_dict().items()})
    gen = torch.Generator().manual_seed(seed + 7)
    ids = torch.randint(5, cfg.vocab_size, (n,), generator=gen).tolist()
    with numerics("official"):
        ref = logits_all(ref_model, ids)
    dev = logits_all(dev_model, ids)
    return compare_logits(ref, dev)


def greedy_self_consistency(model, n_prompt: int, n_new: int, seed: int = 0, graphs: bool = True) -> dict:
    """Greedy decode of `n_new` tokens on the model's device vs the argmax of one exact prefill
    of prompt + generated tokens on the same device."""
    cfg = model.cfg
    gen = torch.Generator().manual_seed(seed + 11)
    prompt = torch.randint(5, cfg.vocab_size, (n_prompt,), generator=gen).tolist()
    use_graphs = graphs and model.embed.weight.device.type != "cpu"
    engine = Engine(model, prefill_mode="exact", max_batch=1, graphs=use_graphs,
                    max_model_len=n_prompt + n_new + 8 if use_graphs else None)
    out = engine.generate(prompt, SamplingParams(max_new_tokens=n_new)).token_ids
    full = logits_all(model, prompt + out[:-1])  # position p predicts token p + 1
    pred = full[n_prompt - 1:].argmax(-1).cpu().tolist()
    agree = sum(int(a == b) for a, b in zip(pred, out))
    return {"positions": len(out), "agree": agree / len(out), "graphs": use_graphs}
