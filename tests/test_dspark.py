"""DSpark drafter, lossless speculative decoding, cache rollback, rejection sampling, scheduler."""

import json
import math

import pytest
import torch
from _util import rand_prompt
from dsv41.core.batch import Chunk
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


def _drafter_after_prompt(model, cfg, prompt):
    """(engine, sequence, drafter, last logits) with the drafter's context absorbed."""
    eng = Engine(model, prefill_mode="exact")
    seq, logits, feats = eng.prefill_alone(prompt, features=True)
    assert feats.shape == (len(prompt), len(cfg.dspark_target_layer_ids) * cfg.hidden_size)
    drafter = DSpark(model)
    drafter.absorb(eng.pool, seq.state, feats, 0)
    return eng, seq, drafter, logits


def _context_rows(eng, seq, cfg, n):
    """The drafter stages' pool rows (bytes) of context positions 0..n-1."""
    bs = eng.pool.block_size
    rows = torch.tensor([seq.state.swa_blocks[p // bs] * bs + p % bs for p in range(n)])
    return {k: eng.pool.swa[cfg.num_hidden_layers + k].kv.view(torch.uint8)[rows].clone()
            for k in range(cfg.num_nextn_predict_layers)}, rows


def test_draft_block_is_noncausal_static_and_leaves_the_context(tiny_model, tiny_cfg, rng):
    prompt = rand_prompt(tiny_cfg, 11, rng).tolist()
    eng, seq, drafter, logits = _drafter_after_prompt(tiny_model, tiny_cfg, prompt)
    before, _ = _context_rows(eng, seq, tiny_cfg, 11)
    tok = int(torch.argmax(logits))
    d = drafter.draft(eng.pool, seq.state, tok)
    b = tiny_cfg.dspark_block_size
    assert d.tokens.shape == (b,) and d.logits.shape == (b, tiny_cfg.vocab_size) and d.confidence.shape == (b,)
    assert torch.isfinite(d.logits).all() and torch.isfinite(d.confidence).all()
    after, _ = _context_rows(eng, seq, tiny_cfg, 11)
    assert all(torch.equal(before[k], after[k]) for k in before)  # the block never touches the context
    assert seq.state.draft_length == 11
    assert torch.equal(drafter.draft(eng.pool, seq.state, tok).logits, d.logits)  # deterministic
    # non-causal: row 0 (the last token) sees the noise rows after it
    drafter._noise = [7] * (b - 1)
    d2 = drafter.draft(eng.pool, seq.state, tok)
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


def test_every_draft_row_sees_the_whole_context_window(tiny_model, tiny_cfg, rng):
    """The official drafter: every block row attends to ALL min(window, start+1) context entries
    (plus the block); no per-row sliding limit. Changing the OLDEST context entry in the window
    changes every row's output, the last row's included."""
    w = tiny_cfg.sliding_window
    prompt = rand_prompt(tiny_cfg, 3 * w, rng).tolist()
    eng, seq, drafter, logits = _drafter_after_prompt(tiny_model, tiny_cfg, prompt)
    tok = int(torch.argmax(logits))
    d = drafter.draft(eng.pool, seq.state, tok)
    n = len(prompt)
    _, rows = _context_rows(eng, seq, tiny_cfg, n)
    for k in range(tiny_cfg.num_nextn_predict_layers):  # perturb position n - w in every stage
        kv = eng.pool.swa[tiny_cfg.num_hidden_layers + k].kv.view(torch.uint8)
        kv[rows[n - w]] = kv[rows[n - w]].flip(0)
    d2 = drafter.draft(eng.pool, seq.state, tok)
    for j in range(tiny_cfg.dspark_block_size):
        assert not torch.equal(d2.logits[j], d.logits[j]), f"row {j} does not see position n - window"
    # ... while an entry older than the window is invisible to every row
    for k in range(tiny_cfg.num_nextn_predict_layers):
        kv = eng.pool.swa[tiny_cfg.num_hidden_layers + k].kv.view(torch.uint8)
        kv[rows[n - w - 1]] = kv[rows[n - w - 1]].flip(0)
    assert torch.equal(drafter.draft(eng.pool, seq.state, tok).logits, d2.logits)


# ---- lossless greedy ------------------------------------------------------------------------------


class OracleDrafter:
    """Proposes the known greedy continuation with random corruptions: many partial acceptances
    (random weights give almost none), so rollbacks of every length happen."""

    def __init__(self, seq, block_size, vocab, gen, p_wrong=0.35):
        self.seq, self.block_size, self.vocab, self.gen, self.p_wrong = seq, block_size, vocab, gen, p_wrong

    def absorb(self, pool, state, feats, start):
        state.draft_length = start + feats.shape[0]

    def draft(self, pool, state, last_token, choose=None):
        i = state.draft_length
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


class _RecordingDSpark(DSpark):
    """A DSpark that drafts for real (its tokens and confidences recorded) but proposes the
    oracle's tokens, so verifications accept partially."""

    def __init__(self, model, oracle):
        super().__init__(model)
        self.oracle, self.seen = oracle, []

    def draft(self, pool, state, last_token, choose=None):
        real = super().draft(pool, state, last_token, choose)
        self.seen.append((real.tokens.clone(), real.confidence.clone()))
        return self.oracle.draft(pool, state, last_token, choose)


class _AbsorbingDrafter:
    """The same drafter behind a plain object: `generate_speculative` then absorbs the accepted
    rows' features itself instead of keeping the context the verification wrote."""

    def __init__(self, inner):
        self.inner, self.block_size = inner, inner.block_size

    def absorb(self, *args):
        DSpark.absorb(self.inner, *args)

    def draft(self, *args, **kwargs):
        return self.inner.draft(*args, **kwargs)


def test_context_written_by_the_verification_equals_absorbing_the_accepted_rows(tiny_model, tiny_cfg, rng):
    """Speculation keeps the drafter context the verification wrote for every row (`DSpark.
    write_context` + `advance`, what a verification graph does); absorbing only the accepted rows'
    features after each step, as before, gives the real drafter the same drafts and confidences
    bit for bit, through partial acceptances and rollbacks."""
    prompt = rand_prompt(tiny_cfg, 9, rng).tolist()
    params = SamplingParams(max_new_tokens=18)
    eng = Engine(tiny_model, prefill_mode="exact")
    ref = eng.generate(prompt, params).token_ids
    seed = int(torch.randint(0, 2**31, (), generator=rng))
    runs = []
    for wrap in (False, True):
        oracle = OracleDrafter(prompt + ref, tiny_cfg.dspark_block_size, tiny_cfg.vocab_size,
                               torch.Generator().manual_seed(seed))
        drafter = _RecordingDSpark(tiny_model, oracle)
        out = generate_speculative(eng, prompt, params, SpecOptions(spec_len=tiny_cfg.dspark_block_size),
                                   drafter=_AbsorbingDrafter(drafter) if wrap else drafter)
        assert out.token_ids == ref
        assert 0 < out.spec["accepted"] < out.spec["drafted"], f"seed {seed}: no partial acceptance"
        runs.append(drafter.seen)
    kept, absorbed = runs
    assert len(kept) == len(absorbed) > 2
    for (t1, c1), (t2, c2) in zip(kept, absorbed):
        assert torch.equal(t1, t2) and torch.equal(c1, c2)


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


@pytest.mark.parametrize("n_prompt", [10, 11])
def test_rollback_equals_feeding_only_the_kept_tokens(tiny_model, tiny_cfg, rng, n_prompt):
    """Prompt 10 / 11 (window 8, ratio-2 groups): a 6-token verification chunk, rolled back to
    every length, leaves the caches as if only the kept tokens had been fed (rollback points on
    both sides of compressor group boundaries): the next step's logits are the same bits."""
    prompt = rand_prompt(tiny_cfg, n_prompt, rng).tolist()
    chunk = rand_prompt(tiny_cfg, 6, rng).tolist()
    nxt = rand_prompt(tiny_cfg, 2, rng).tolist()
    for keep in range(0, 7):
        eng = Engine(tiny_model, prefill_mode="exact")
        seq, _, _ = eng.prefill_alone(prompt)
        eng.run_chunks([Chunk(seq.state, chunk, 0, "all")])
        seq.state.length = n_prompt + keep  # the rollback
        got, _, _ = eng.run_chunks([Chunk(seq.state, nxt, 0, "all")])
        ref_eng = Engine(tiny_model, prefill_mode="exact")
        ref_seq, _, _ = ref_eng.prefill_alone(prompt + chunk[:keep])
        want, _, _ = ref_eng.run_chunks([Chunk(ref_seq.state, nxt, 0, "all")])
        assert torch.equal(got, want), keep
        assert seq.state.tokens == ref_seq.state.tokens


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
    assert torch.allclose(prefix_survival(conf).double(), torch.cumprod(torch.sigmoid(conf.double()), 0))
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
