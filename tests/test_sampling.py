"""Token sampling on the logits' device (core/sampling.py): the batched distribution equals the
row-by-row one, each row's draw is the exponential race over its own seeded uniforms, and the
draws follow the distribution."""

import pytest
import torch

from dsv41.core.engine import SamplingParams, sample_rows
from dsv41.backends.reference.sampling import uniform_from_hash
from dsv41.core.sampling import (RowParams, hash32, row_key, sample_tokens, sampling_probs, sampling_probs_rows,
                                 uniforms)

# chi-square quantiles at p = 0.001 (the tests fail about once in a thousand seeds by chance)
CHI2_999 = {7: 24.32, 9: 27.88}


def _mixed_params():
    return [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1),
            SamplingParams(temperature=1.5, top_k=20, seed=2), SamplingParams(temperature=0.0),
            SamplingParams(temperature=1.0, top_p=0.9, seed=3),
            SamplingParams(temperature=0.7, top_k=7, top_p=0.5, seed=-4),
            SamplingParams(temperature=1.2, top_k=10 ** 6, seed=2 ** 70)]


def test_sampling_probs_rows_equal_the_row_by_row_distribution(rng):
    """Temperatures, top-k (none, small, wider than the vocabulary), top-p (none, 0.9, with a
    top-k): the batched masks and renormalisation give each row's `sampling_probs`."""
    logits = torch.randn(7, 300, generator=rng) * 3
    logits[5, :40] = logits[5, 0]  # ties at the top-k boundary are kept, as row by row
    params = _mixed_params()
    rp = RowParams.of(params, list(range(7)), "cpu")
    got = sampling_probs_rows(logits.index_select(0, rp.rows), rp)
    for j, i in enumerate(rp.rows.tolist()):
        want = sampling_probs(logits[i], params[i])
        assert torch.equal(got[j] == 0, want == 0), i
        torch.testing.assert_close(got[j], want, rtol=1e-6, atol=1e-9)
    assert rp.rows.tolist() == [1, 2, 4, 5, 6] and rp.max_top_k == 10 ** 6 and rp.any_top_p


def test_sample_rows_is_the_race_over_each_rows_keys(rng):
    """Greedy rows take the argmax; a sampled row draws argmax(p / -log U) with U its own
    uniforms for (seed, position): the same token whatever else is in the step and in whichever
    row, other tokens at other positions."""
    logits = torch.randn(7, 300, generator=rng) * 2
    params = _mixed_params()
    positions = [5, 9, 9, 2, 40, 3, 11]
    got = sample_rows(logits, params, positions)
    for i, p in enumerate(params):
        if p.temperature == 0:
            assert got[i] == int(logits[i].argmax())
        else:
            u = uniforms(torch.tensor([row_key(p.seed, positions[i])]), 300)[0]
            assert got[i] == int((sampling_probs(logits[i], p) / -torch.log(u)).argmax()), i
    order = [6, 2, 0, 5, 1, 4, 3]  # the same rows shuffled, and each row alone
    assert sample_rows(logits[order], [params[i] for i in order], [positions[i] for i in order]) == \
        [got[i] for i in order]
    assert [sample_rows(logits[i:i + 1], [params[i]], [positions[i]])[0] for i in range(7)] == got
    later = [sample_rows(logits, params, [q + d for q in positions]) for d in range(1, 9)]
    assert len({tuple(t) for t in later + [got]}) > 1  # other positions, other draws
    assert all(t[0] == got[0] and t[3] == got[3] for t in later)  # greedy rows do not move


def test_draws_follow_the_distribution(fresh_seed):
    """4000 draws of one distribution over 8 tokens (positions 0..3999 of one seed, then one
    position of 4000 seeds): chi-square against the probabilities; top-k / top-p never draw a
    cut token."""
    logits = torch.randn(8, generator=torch.Generator().manual_seed(fresh_seed)) * 1.5
    p = SamplingParams(temperature=1.0, seed=fresh_seed)
    want = sampling_probs(logits, p)
    n = 4000
    for positions, params in (([*range(n)], [p] * n),
                              ([17] * n, [SamplingParams(temperature=1.0, seed=fresh_seed + s) for s in range(n)])):
        toks = sample_tokens(logits.expand(n, 8), RowParams.of(params, positions, "cpu"))
        counts = torch.bincount(toks, minlength=8).double()
        chi2 = float(((counts - n * want) ** 2 / (n * want)).sum())
        assert chi2 < CHI2_999[7], (chi2, counts.tolist(), (n * want).tolist())
    cut = SamplingParams(temperature=1.0, top_k=3, top_p=0.8, seed=fresh_seed)
    allowed = sampling_probs(logits, cut) > 0
    toks = sample_tokens(logits.expand(n, 8), RowParams.of([cut] * n, [*range(n)], "cpu"))
    assert allowed[toks].all() and len(set(toks.tolist())) == int(allowed.sum())


def test_uniforms_are_uniform_in_the_open_interval(rng):
    """U lies in (0, 1) at 24 bits, spreads evenly over ten bins, and rows of other keys differ;
    hash32 is a bijection (distinct inputs, distinct outputs)."""
    keys = torch.tensor([row_key(s, pos) for s in (0, 1, 2 ** 40) for pos in (0, 1, 7)])
    u = uniforms(keys, 20000)
    assert (u > 0).all() and (u < 1).all()
    counts = torch.histc(u, bins=10, min=0, max=1).double()
    expect = u.numel() / 10
    assert float(((counts - expect) ** 2 / expect).sum()) < CHI2_999[9]
    assert len({tuple(r[:8].tolist()) for r in u}) == len(keys)
    x = torch.randint(0, 2 ** 32, (50000,), dtype=torch.int64, generator=rng).unique()
    assert hash32(x).unique().numel() == x.numel()
    assert hash32(0xFFFFFFFF) < 2 ** 32 and row_key(-1, 3) == row_key(2 ** 64 - 1, 3)


def test_uniforms_never_reach_one():
    """The extreme hashes give U strictly inside (0, 1), the top one 1 - 2^-24 exactly (with 24
    bits it rounded to 1.0: E = -log U = 0, a race won whatever the probabilities)."""
    u = uniform_from_hash(torch.tensor([0, 1 << 8, 0xFFFFFFFF - (1 << 9), 0xFFFFFFFF]))
    assert u.dtype == torch.float32 and (u > 0).all() and (u < 1).all()
    assert float(u[-1]) == 1 - 2 ** -24 and float(u[0]) == 2 ** -24
    assert len(set(u.tolist())) == 3  # 0 and 1 << 8 share their top 23 bits


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_are_one_error(bad):
    logits = torch.zeros(2, 10)
    logits[1, 3] = bad
    with pytest.raises(ValueError, match="non-finite logits"):
        sample_rows(logits, [SamplingParams(), SamplingParams(temperature=1.0)], [0, 0])
