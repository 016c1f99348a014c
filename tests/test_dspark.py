"""DSpark drafter, lossless speculative decoding, cache rollback, rejection sampling, scheduler."""

import copy
import json
import math

import pytest
import torch
from _util import rand_prompt
from dsv41.core.dspark import Draft, DSpark
from dsv41.core.engine import Engine, SamplingParams
from dsv41.core.model import Transformer
from dsv41.core.spec_decode import (
    SpecOptions,
    ThroughputProfile,
    accept_sampled,
    choose_verify_len,
    generate_speculative,
    prefix_survival,
)
from dsv41.deploy.cli import main

# ---- structure ----------------------------------------------------------------------------------


def test_mtp_names_follow_the_checkpoint_layout(tiny_cfg):
    with torch.device("meta"):
        names = list(Transformer(tiny_cfg).state_dict())
    mtp = [n for n in names if n.startswith("mtp.")]
    stages = sorted({int(n.split(".")[1]) for n in mtp})
    assert stages == list(range(tiny_cfg.num_nextn_predict_layers))
    extra = {"main_proj", "main_norm", "markov_head", "confidence_head", "norm"}
    owners = {(int(n.split(".")[1]), n.split(".")[2]) for n in mtp if n.split(".")[2] in extra}
    assert owners == {(0, "main_proj"), (0, "main_norm"), (2, "markov_head"), (2, "confidence_head"), (2, "norm")}
    assert {"mtp.2.markov_head.embed.weight", "mtp.2.markov_head.head.weight",
            "mtp.2.confidence_head.proj.weight"} <= set(mtp)
    for k in stages:  # SWA-only stages: no compressor / indexer / Engram; the DSpark expert count
        assert not any(f"mtp.{k}.attn.{c}" in n for n in mtp for c in ("compressor", "indexer"))
        assert not any(n.startswith(f"mtp.{k}.engram") for n in mtp)
        experts = {int(n.split(".")[4]) for n in mtp if n.startswith(f"mtp.{k}.ffn.experts.")}
        assert experts == set(range(tiny_cfg.dspark_n_routed_experts))
        assert f"mtp.{k}.ffn.shared_experts.w1.weight" in mtp


def test_draft_block_is_noncausal_static_and_leaves_the_drafter_state(tiny_model, tiny_cfg, rng):
    eng = Engine(tiny_model, prefill_mode="exact")
    prompt = rand_prompt(tiny_cfg, 11, rng).tolist()
    _, logits, ctx, _ = eng.prefill(prompt, 32, features=True)
    drafter = DSpark(tiny_model)
    state = drafter.new_state()
    from dsv41.core.dspark import target_features

    feats = target_features(ctx, tiny_cfg)
    assert feats.shape == (11, len(tiny_cfg.dspark_target_layer_ids) * tiny_cfg.hidden_size)
    drafter.absorb(state, feats, 0)
    rings = {k: r.q.view(torch.uint8).clone() for k, r in state.swa.items()}
    tok = int(torch.argmax(logits))
    d = drafter.draft(state, tok)
    b = tiny_cfg.dspark_block_size
    assert d.tokens.shape == (b,) and d.logits.shape == (b, tiny_cfg.vocab_size) and d.confidence.shape == (b,)
    assert torch.isfinite(d.logits).all() and torch.isfinite(d.confidence).all()
    for k, r in state.swa.items():  # the block's rows are never written to the context ring
        assert torch.equal(r.q.view(torch.uint8), rings[k])
    assert torch.equal(drafter.draft(state, tok).logits, d.logits)  # deterministic
    # non-causal: row 0 (the last token) sees the noise rows after it
    drafter._noise = torch.full_like(drafter._noise, 7)
    d2 = drafter.draft(state, tok)
    assert (d2.logits[0] - d.logits[0]).abs().max() > 1e-3 * d.logits[0].abs().max()


def test_context_kv_is_kv_norm_of_wkv_of_main_x(tiny_model, tiny_cfg, rng):
    """Each stage's pool holds FP8(RoPE(kv_norm(wkv(main_x)))) with main_x = main_norm(main_proj(
    features)): no attn_norm on the context path (the official drafter has none there)."""
    from dsv41.backends import ops
    from dsv41.core.cache import KVPool, SequenceState
    from dsv41.core.model import rope_tables

    drafter = DSpark(tiny_model)
    t = 6
    feats = (torch.randn(t, len(tiny_cfg.dspark_target_layer_ids) * tiny_cfg.hidden_size, generator=rng)
             ).to(torch.bfloat16)

    def absorbed():
        pool, state = KVPool(tiny_cfg, block_size=4), SequenceState()
        state.ensure_blocks(pool, t)
        drafter.absorb(pool, state, feats, 0)
        return pool, drafter._rows_at(pool, state, list(range(t)))

    pool, rows = absorbed()
    s0, pos = drafter.stages[0], torch.arange(t)
    main_x = s0.main_norm(s0.main_proj(feats))
    for st in drafter.stages:
        a = st.attn
        cos, sin = rope_tables(a.inv_freq, pos)
        got = pool.swa[a.layer_id]
        want_q, want_s = ops.fp8_quant(ops.rope(a.kv_norm(a.wkv(main_x)), cos, sin))
        assert torch.equal(got.kv[rows].view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(got.scale[rows].view(torch.uint8), want_s.view(torch.uint8))
        # the former reading (attn_norm first) writes other bytes: the check above can fail
        old_q, _ = ops.fp8_quant(ops.rope(a.kv_norm(a.wkv(st.attn_norm(main_x))), cos, sin))
        assert not torch.equal(got.kv[rows].view(torch.uint8), old_q.view(torch.uint8))
    # attn_norm's weights play no part in the context KV
    saved = [st.attn_norm.weight.clone() for st in drafter.stages]
    try:
        for st in drafter.stages:
            st.attn_norm.weight.mul_(3)
        again, rows2 = absorbed()
    finally:
        for st, ws in zip(drafter.stages, saved):
            st.attn_norm.weight.copy_(ws)
    for st in drafter.stages:
        k = st.attn.layer_id
        assert torch.equal(again.swa[k].kv[rows2].view(torch.uint8), pool.swa[k].kv[rows].view(torch.uint8))


# ---- lossless greedy ------------------------------------------------------------------------------


class OracleDrafter:
    """Proposes the known greedy continuation with random corruptions: many partial acceptances
    (random weights give almost none), so rollbacks of every length happen."""

    def __init__(self, seq, block_size, vocab, gen, p_wrong=0.35):
        self.seq, self.block_size, self.vocab, self.gen, self.p_wrong = seq, block_size, vocab, gen, p_wrong

    def new_state(self):
        return {"length": 0}

    def absorb(self, state, feats, start):
        state["length"] = start + feats.shape[0]

    def draft(self, state, last_token, choose=None):
        i = state["length"]
        assert self.seq[i] == last_token
        toks = [self.seq[j] if j < len(self.seq) else 5 for j in range(i + 1, i + 1 + self.block_size)]
        for j in range(self.block_size):
            if float(torch.rand((), generator=self.gen)) < self.p_wrong:
                toks[j] = int(torch.randint(5, self.vocab, (), generator=self.gen))
        t = torch.tensor(toks)
        return Draft(t, torch.nn.functional.one_hot(t, self.vocab).float() * 10, torch.zeros(self.block_size))


@pytest.mark.parametrize("n_prompt, mode", [(9, "exact"), (14, "ced")])
def test_greedy_speculation_is_lossless(tiny_model, tiny_cfg, rng, n_prompt, mode):
    eng = Engine(tiny_model, prefill_mode=mode)
    prompt = rand_prompt(tiny_cfg, n_prompt, rng).tolist()
    params = SamplingParams(max_new_tokens=20)
    ref = eng.generate(prompt, params).token_ids
    spec = generate_speculative(eng, prompt, params, SpecOptions(spec_len=tiny_cfg.dspark_block_size))
    st = spec.spec
    print(f"\n[dsv41] random drafter ({mode}): acceptance {st['acceptance_rate']:.3f} "
          f"({st['accepted']}/{st['drafted']}), mean accepted length {st['mean_accepted_length']:.3f}")
    assert spec.token_ids == ref
    assert st["drafted"] > 0 and st["steps"] < 20

    oracle = OracleDrafter(prompt + ref, tiny_cfg.dspark_block_size, tiny_cfg.vocab_size, rng)
    spec = generate_speculative(eng, prompt, params, SpecOptions(), drafter=oracle)
    st = spec.spec
    print(f"[dsv41] oracle drafter ({mode}): acceptance {st['acceptance_rate']:.3f}, "
          f"mean accepted length {st['mean_accepted_length']:.3f}, {st['steps']} steps")
    assert spec.token_ids == ref
    assert 0 < st["accepted"] < st["drafted"]  # partial acceptances and rollbacks both happened


def test_sampled_speculation_runs(tiny_model, tiny_cfg, rng):
    eng = Engine(tiny_model, prefill_mode="exact")
    prompt = rand_prompt(tiny_cfg, 6, rng).tolist()
    seed = int(torch.randint(0, 2**31, (), generator=rng))
    res = eng.generate_speculative(prompt, SamplingParams(max_new_tokens=8, temperature=0.9, top_k=50, seed=seed),
                                   SpecOptions(spec_len=3))
    st = res.spec
    assert len(res.token_ids) == 8 and all(0 <= t < tiny_cfg.vocab_size for t in res.token_ids)
    assert 0 <= st["accepted"] <= st["drafted"] <= 3 * st["steps"]
    assert st["steps"] + st["accepted"] >= 7  # every step emits accepted drafts + one token


# ---- rollback -----------------------------------------------------------------------------------


def _assert_same_cache(a, b):
    assert (a.length, a.tokens, a.is_image) == (b.length, b.tokens, b.is_image)
    for ra, rb in zip(a.swa, b.swa):
        assert torch.equal(ra.q.view(torch.uint8), rb.q.view(torch.uint8))
        assert torch.equal(ra.scale.view(torch.uint8), rb.scale.view(torch.uint8))
    for s, ga in a.glob.items():
        gb = b.glob[s]
        assert (ga.n, ga.tokens) == (gb.n, gb.tokens)
        for name in ("kv_codes", "kv_scale", "key_codes", "key_scale"):
            assert torch.equal(getattr(ga, name)[: ga.n].view(torch.uint8), getattr(gb, name)[: gb.n].view(torch.uint8))
        for name in ("carry_kv", "carry_score"):
            x, y = getattr(ga, name), getattr(gb, name)
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y))


@pytest.mark.parametrize("n_prompt", [10, 11])
def test_rollback_restores_caches_exactly(tiny_model, tiny_cfg, rng, n_prompt):
    """Prompt 10 / 11 (window 8, ratio-2 groups): the 6-token chunk wraps the SWA ring and the
    rollback points fall on both sides of compressor group boundaries."""
    eng = Engine(tiny_model, prefill_mode="exact")
    prompt = rand_prompt(tiny_cfg, n_prompt, rng).tolist()
    base, _, _, _ = eng.prefill(prompt, 40)
    chunk = rand_prompt(tiny_cfg, 6, rng)
    refs, c = [], copy.deepcopy(base)
    for t in chunk:  # the oracle: the tokens one at a time
        tiny_model(t.view(1), c)
        refs.append(copy.deepcopy(c))
    nxt = rand_prompt(tiny_cfg, 1, rng)
    for keep in range(1, 6):
        c = copy.deepcopy(base)
        cp = c.checkpoint(6)
        tiny_model(chunk, c, all_logits=True)
        ring_changed = any(not torch.equal(x.q.view(torch.uint8), y.q.view(torch.uint8))
                           for x, y in zip(c.swa, refs[keep - 1].swa))
        assert ring_changed  # the rejected tokens overwrote slots the rollback must restore
        c.rollback(cp, n_prompt + keep)
        _assert_same_cache(c, refs[keep - 1])
        if keep <= 2:  # and the next step computes the same logits (odd and even rollback points)
            assert torch.equal(tiny_model(nxt, c), tiny_model(nxt, copy.deepcopy(refs[keep - 1])))
    c = copy.deepcopy(base)
    cp = c.checkpoint(6)
    tiny_model(chunk, c, all_logits=True)
    c.release(cp)
    _assert_same_cache(c, refs[5])
    with pytest.raises(ValueError, match="roll back"):
        c.rollback(c.checkpoint(2), n_prompt)


# ---- rejection sampling -------------------------------------------------------------------------


def _chi2_critical(df: int, z: float = 4.75) -> float:
    """Wilson-Hilferty upper quantile of chi-square (z = 4.75: about 1e-6 upper tail)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_rejection_sampler_keeps_the_target_distribution(rng):
    """Target and draft are two different Markov chains on 4 tokens; speculative steps with 3
    drafts each generate 3 tokens; their joint distribution (64 cells) must be the target
    chain's, while the draft chain's is clearly rejected by the same test."""
    v, k, n, s0 = 4, 3, 5000, 0

    def chain():
        return 0.5 / v + 0.5 * torch.softmax(2 * torch.randn(v, v, generator=rng, dtype=torch.float64), -1)

    P, Q = chain(), chain()
    counts = torch.zeros(v, v, v)
    for _ in range(n):
        out, prev = [], s0
        while len(out) < 3:
            drafts, x = [], prev
            for _ in range(k):
                x = int(torch.multinomial(Q[x], 1, generator=rng))
                drafts.append(x)
            p = torch.stack([P[prev]] + [P[d] for d in drafts])
            q = torch.stack([Q[prev]] + [Q[d] for d in drafts[:-1]])
            a, nxt = accept_sampled(p, q, drafts, rng)
            out += drafts[:a] + [nxt]
            prev = out[-1]
        counts[tuple(out[:3])] += 1

    def chi2(M):
        exp = n * M[s0][:, None, None] * M[:, :, None] * M[None, :, :]
        return float(((counts - exp) ** 2 / exp).sum())

    crit = _chi2_critical(v ** 3 - 1)
    print(f"\n[dsv41] rejection sampler chi2 {chi2(P):.1f} vs target (critical {crit:.1f}); "
          f"{chi2(Q):.1f} vs draft")
    assert chi2(P) < crit
    assert chi2(Q) > crit  # the test has the power to see a wrong distribution


# ---- scheduler and profile ------------------------------------------------------------------------


def test_scheduler_verifies_more_when_confident():
    b = 5
    curve = ThroughputProfile(list(range(1, b + 2)), [n / (0.1 + 0.02 * n) for n in range(1, b + 2)], 0.02)
    ks = [choose_verify_len(torch.full((b,), c), curve, b) for c in torch.linspace(-4, 6, 11).tolist()]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] == b
    # a falling confidence truncates the verify length where survival drops
    conf = torch.tensor([6.0, 6.0, -6.0, 6.0, 6.0])
    assert choose_verify_len(conf, curve, b) == 2
    assert torch.allclose(prefix_survival(conf), torch.cumprod(torch.sigmoid(conf.double()), 0))
    # compute-bound curve (step time proportional to tokens): speculation never pays below certainty
    bound = ThroughputProfile(list(range(1, b + 2)), [10.0] * (b + 1), 0.0)
    assert choose_verify_len(torch.full((b,), 2.0), bound, b) == 0


def test_profile_spec_writes_a_valid_file(tmp_path, capsys, monkeypatch):
    out = tmp_path / "sub" / "prof.json"
    assert main(["profile-spec", "--out", str(out), "--repeats", "1", "--prompt-len", "9"]) == 0
    prof = ThroughputProfile.load(out)
    assert prof.tokens == list(range(1, 7)) and all(v > 0 for v in prof.tokens_per_s) and prof.draft_s > 0
    assert prof.device == "cpu"
    assert [p.name for p in out.parent.iterdir()] == ["prof.json"]  # no temporary file left
    capsys.readouterr()
    # a damaged profile is one clear error
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"tokens": [1, 3], "tokens_per_s": [1.0, 2.0], "draft_s": 0.1}))
    assert main(["run", "--speculative", "--spec-profile", str(bad), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.json" in err[0] and "tokens" in err[0]
    assert main(["run", "--spec-len", "2"]) == 2
    assert "--speculative" in capsys.readouterr().err


def test_run_speculative_reports_acceptance(capsys):
    assert main(["run", "--speculative", "--spec-len", "3", "--max-new-tokens", "5", "--ignore-eos", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    sp = out["speculative"]
    assert len(out["token_ids"]) == 5
    assert {"acceptance_rate", "mean_accepted_length", "steps", "drafted", "accepted"} <= set(sp)
    assert sp["mean_accepted_length"] >= 1 and 0 <= sp["acceptance_rate"] <= 1
    assert main(["run", "--speculative", "--spec-len", "9"]) == 2
    assert "spec_len must be in 0..5" in capsys.readouterr().err
