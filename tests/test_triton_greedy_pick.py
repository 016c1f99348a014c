"""The greedy-pick and token-feed kernels (`npu_ops/triton/greedy_pick.py`) against the reference
ops: every finite row's token is `torch.argmax`'s (equal maxima placed across slice boundaries,
at one slice and at many), every row's non-finite flag is the reference's (NaN, +inf, -inf
rows), a broken row's token is still an id of the vocabulary, and the fed ids and n-gram
columns equal the reference's. Interpreter variants on CPU, `gpu`-marked ones at the model's
vocabulary."""

import pytest
import torch

from _triton import DEVICES, cuda_only, triton  # noqa: F401  (sets TRITON_INTERPRET; skips without triton)

from dsv41.backends.reference import sampling as ref  # noqa: E402
from dsv41.npu_ops.triton import greedy_pick as gp  # noqa: E402

pytestmark = cuda_only

VOCAB = {"cpu": 3000, "cuda": 129280}


def _logits(rows, v, rng, dtype):
    """Random rows, each with its maximum repeated (first copy placed at random, later copies past
    it), a few rows broken by a NaN, +inf or -inf, one (from three rows) all NaN."""
    x = torch.randn(rows, v, generator=rng) * 4
    for r in range(rows):
        top = float(x[r].max()) + 1
        where = torch.randint(0, v, (3,), generator=rng).sort().values
        x[r, where] = top
    x = x.to(dtype)
    broken = {}
    for r, bad in zip(range(1, rows, 3), (float("nan"), float("inf"), float("-inf"))):
        x[r, int(torch.randint(0, v, (1,), generator=rng))] = bad
        broken[r] = bad
    if rows > 2:  # a row of NaNs only: its token must still be an id
        x[2] = float("nan")
        broken[2] = float("nan")
    return x, broken


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,splits", [(1, None), (1, 1), (5, None), (9, 7), (64, None)])
@pytest.mark.parametrize("dev", DEVICES)
def test_greedy_pick_equals_the_reference(dev, rows, splits, dtype, rng, fresh_seed):
    v = VOCAB[dev.split(":")[0]]
    x, broken = _logits(rows, v, rng, dtype)
    got = gp.greedy_pick(x.to(dev), splits=splits).cpu()
    want = ref.greedy_pick(x)
    info = f"seed {fresh_seed}, rows {rows}, splits {splits}"
    assert got.shape == (rows, 2) and got.dtype == torch.long, info
    assert torch.equal(got[:, 1], want[:, 1]), info
    assert set(torch.nonzero(want[:, 1]).flatten().tolist()) == set(broken), info  # NaN, +inf and -inf
    ok = want[:, 1] == 0
    assert torch.equal(got[ok, 0], want[ok, 0]), info  # the first of the equal maxima
    assert ((got[:, 0] >= 0) & (got[:, 0] < v)).all(), info  # broken rows too


@pytest.mark.parametrize("dev", DEVICES)
def test_greedy_pick_into_a_persistent_buffer(dev, rng):
    """`out` (a row slice of a larger int64 [R, 2] buffer) is written and returned; the rows past
    it are left alone."""
    x = torch.randn(3, 700, generator=rng).to(dev)
    buf = torch.full((5, 2), -7, dtype=torch.long, device=dev)
    out = gp.greedy_pick(x, buf[:3])
    assert out.data_ptr() == buf.data_ptr()
    assert torch.equal(buf[:3].cpu(), ref.greedy_pick(x.cpu())) and (buf[3:] == -7).all()
    with pytest.raises(ValueError, match="out must be int64"):
        gp.greedy_pick(x, buf[:2])


@pytest.mark.parametrize("dev", DEVICES)
def test_feed_tokens_equals_the_reference(dev, rng):
    """Rows with ids -1 - r take picked[r, 0] as id and n-gram column 0; other rows (and the other
    n-gram columns) are untouched."""
    t, r = 37, 11
    picked = torch.stack([torch.randint(0, 1000, (r,), generator=rng), torch.zeros(r, dtype=torch.long)], -1)
    ids = torch.randint(0, 1000, (t,), generator=rng)
    fed = torch.rand(t, generator=rng) < 0.6
    ids[fed] = -1 - torch.randint(0, r, (int(fed.sum()),), generator=rng)
    ngram = torch.randint(-1, 1000, (t, 3), generator=rng)
    want_ids, want_ng = ids.clone(), ngram.clone()
    ref.feed_tokens(want_ids, want_ng, picked)
    got_ids, got_ng = ids.clone().to(dev), ngram.clone().to(dev)
    gp.feed_tokens(got_ids, got_ng, picked.to(dev))
    assert torch.equal(got_ids.cpu(), want_ids) and torch.equal(got_ng.cpu(), want_ng)
    assert torch.equal(want_ids[~fed], ids[~fed]) and torch.equal(want_ng[:, 1:], ngram[:, 1:])
    assert torch.equal(want_ids[fed], picked[-1 - ids[fed], 0]) and torch.equal(want_ng[fed, 0], want_ids[fed])
