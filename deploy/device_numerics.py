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
from ..backends.registry import batch_invariant_mode
from ..core.batch import Chunk, build_step
from ..core.engine import Engine, SamplingParams, SingleSequence
from ..core.weights import build_model


def random_text_ids(cfg, n: int, gen: torch.Generator) -> list[int]:
    """n random token ids that are text: the special ids (0..4) and the image token avoided."""
    ids = torch.randint(5, cfg.vocab_size, (n,), generator=gen)
    if cfg.vision is not None and cfg.image_token_id is not None:
        ids = torch.where(ids == cfg.image_token_id, 5, ids)
    return ids.tolist()


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
    ids = random_text_ids(cfg, n, torch.Generator().manual_seed(seed + 7))
    with numerics("official"):
        ref = logits_all(ref_model, ids)
    dev = logits_all(dev_model, ids)
    return compare_logits(ref, dev)


def greedy_self_consistency(model, n_prompt: int, n_new: int, seed: int = 0, graphs: bool = True,
                            batch_invariant: bool = False) -> dict:
    """Greedy decode of `n_new` tokens on the model's device vs the argmax of one exact prefill
    of prompt + generated tokens on the same device. Also: the largest difference between a
    decode step's logits and the prefill's logits of the same position, and at each position
    where the argmax differs, the prefill's margin between the decoded token and its top token
    (a near-tie flips under rounding noise; a large margin would be a bug). `batch_invariant`:
    all of it (decode, graphs, prefill) under DSV41_BATCH_INVARIANT=1, where every op's row is
    computed alike whatever the call's row count, so decode should equal prefill exactly."""
    if batch_invariant:
        with batch_invariant_mode():
            return dict(greedy_self_consistency(model, n_prompt, n_new, seed, graphs), batch_invariant=True)
    cfg = model.cfg
    prompt = random_text_ids(cfg, n_prompt, torch.Generator().manual_seed(seed + 11))
    use_graphs = graphs and model.embed.weight.device.type != "cpu"
    engine = Engine(model, prefill_mode="exact", max_batch=1, graphs=use_graphs, record_logits=True,
                    max_model_len=n_prompt + n_new + 8 if use_graphs else None)
    res = engine.generate(prompt, SamplingParams(max_new_tokens=n_new))
    out = res.token_ids
    full = logits_all(model, prompt + out[:-1])[n_prompt - 1:].cpu()  # row k predicts out[k]
    dec = torch.stack([x.float().cpu() for x in res.logits])
    pred = full.argmax(-1).tolist()
    bad = [k for k, (a, b) in enumerate(zip(pred, out)) if a != b]
    margins = [float(full[k].max() - full[k, out[k]]) for k in bad]
    return {"positions": len(out), "agree": 1 - len(bad) / len(out), "graphs": use_graphs,
            "first_mismatch": bad[0] if bad else None, "max_logit_diff": float((dec - full).abs().max()),
            "logit_scale": float(full.abs().max()), "mismatch_margin_max": max(margins, default=0.0)}
