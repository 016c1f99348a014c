"""The sampler kernel (`npu_ops/triton/sample_race.py`) against the reference op: the same token
for every sampled row (temperatures, top-k, top-p, both together, ties at the top-p cut, bf16
and fp32 logits, peaked and flat rows), and the top-p passes exercised where the unrestricted
race's winner is cut. Two draws may part only on a near-tie of their race scores (the kernel
races in log space, the reference divides probabilities), and both must then be tokens the cuts
keep. Interpreter variants on CPU, `gpu`-marked ones at the model's vocabulary."""

import math

import pytest
import torch

from _triton import DEVICES, cuda_only, triton  # noqa: F401  (sets TRITON_INTERPRET; skips without triton)

from dsv41.backends.reference import sampling as ref  # noqa: E402
from dsv41.npu_ops.triton import sample_race as sr  # noqa: E402

pytestmark = cuda_only

VOCAB = {"cpu": 5000, "cuda": 129280}  # two chunks of 4096 under the interpreter; the model's width


def _keys(rng, n):
    return torch.randint(0, 2 ** 32, (n,), dtype=torch.int64, generator=rng)


def _near_tie_ok(logits, s, row, params, got, want):
    """Where the kernel and the reference drew apart: both tokens kept by the cuts (within 1e-5 of
    top_p's boundary) and their race scores log p - log E within 1e-5 (fp64 from the same x)."""
    temp, top_k, top_p, key = params
    x = logits[row].double() / temp
    if top_k > 0:
        x = x.masked_fill(x < torch.topk(x, top_k).values[-1], -math.inf)
    p = torch.softmax(x, -1)
    sp, si = torch.sort(p, descending=True)
    before = torch.empty_like(p).scatter_(0, si, sp.cumsum(-1) - sp)
    kept = (before <= top_p + 1e-5) & (p > 0)
    score = p.log() - (-ref.uniforms(torch.tensor([key]), p.numel())[0].double().log()).log()
    return bool(kept[got] and kept[want] and abs(score[got] - score[want]) <= 1e-5 * max(1.0, abs(score[want]))), \
        (s, row, got, want, float(score[got]), float(score[want]))


def _check(logits, rows, temp, top_k, top_p, keys, dev, threshold=None):
    max_k, any_p = int(top_k.max()), bool((top_p < 1).any())
    got = sr.sample_race(logits.to(dev), rows.to(dev), temp.to(dev), top_k.to(dev), top_p.to(dev), keys.to(dev),
                         max_k, any_p, threshold=threshold).cpu()
    want = ref.sample_race(logits, rows, temp, top_k, top_p, keys, max_k, any_p)
    apart = (got != want).nonzero().flatten().tolist()
    for s in apart:
        ok, why = _near_tie_ok(logits.float(), s, int(rows[s]),
                               (float(temp[s]), int(top_k[s]), float(top_p[s]), int(keys[s])), int(got[s]), int(want[s]))
        assert ok, why
    assert len(apart) <= max(1, len(rows) // 16), (apart, got.tolist(), want.tolist())
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("threshold", ["topk", "radix"])
def test_sample_race_equals_the_reference(dev, dtype, threshold, rng):
    """Mixed rows of one step (some rows not sampled, rows out of order), peaked (std 4) and flat
    (std 0.05: top-p 0.95 keeps most of the vocabulary) logits, top-k alone, top-p alone, both;
    the top-k threshold from torch.topk and from the radix-select kernel."""
    v = VOCAB[dev]
    n = 12 if dev == "cpu" else 64
    logits = torch.randn(n + 3, v, generator=rng) * torch.where(torch.arange(n + 3) % 2 == 0, 4.0, 0.05).unsqueeze(1)
    logits = logits.to(dtype)
    rows = torch.randperm(n + 3, generator=rng)[:n]
    temp = torch.rand(n, generator=rng) * 1.2 + 0.3
    top_k = torch.where(torch.arange(n) % 3 == 1, torch.randint(1, 200, (n,), generator=rng), 0)
    top_p = torch.where(torch.arange(n) % 4 < 2, torch.rand(n, generator=rng) * 0.9 + 0.05, 1.0)
    _check(logits, rows, temp, top_k, top_p, _keys(rng, n), dev, threshold)


@pytest.mark.parametrize("dev", DEVICES)
def test_top_p_passes_follow_a_cut_winner(dev, rng):
    """One peaked row drawn with many keys at top_p 0.2: where the race over the whole vocabulary
    picks a token the cut drops (checked to happen), the kernel's further passes find the kept
    winner, as the reference's sort does."""
    v = VOCAB[dev]
    n = 16 if dev == "cpu" else 128
    logits = (torch.randn(1, v, generator=rng) * 3).expand(n, v).contiguous()
    rows, temp = torch.arange(n), torch.ones(n)
    top_k, top_p, keys = torch.zeros(n, dtype=torch.int64), torch.full((n,), 0.2), _keys(rng, n)
    free = ref.sample_race(logits, rows, temp, top_k, torch.ones(n), keys, 0, False)
    kept = ref.sampling_probs_rows(logits, temp, top_k, top_p, 0, True) > 0
    assert not kept[rows, free].all(), "no row needed a second pass: pick another seed"
    _check(logits, rows, temp, top_k, top_p, keys, dev)


@pytest.mark.parametrize("dev", DEVICES)
def test_rows_draw_alike_alone_in_a_batch_and_over_rounds(dev, rng):
    """A row's token does not depend on the other rows of the call (every row is split over the
    same programs, so its partial sums run in one order) nor on how many top-p rounds run split
    before the finishing program sweeps alone (1, 2 or 3; peaked rows at top_p 0.3, where the
    race's first winner is often cut)."""
    v = VOCAB[dev]
    n = 6
    logits = (torch.randn(n, v, generator=rng) * 3).to(dev)
    temp = torch.tensor([0.9, 1.0, 0.7, 1.1, 1.0, 0.8], device=dev)
    top_k = torch.tensor([0, 30, 0, 0, 5, 0], device=dev)
    top_p = torch.tensor([0.3, 1.0, 0.3, 0.2, 0.8, 0.3], device=dev)
    keys = _keys(rng, n).to(dev)
    rows = torch.arange(n, device=dev)
    batch = sr.sample_race(logits, rows, temp, top_k, top_p, keys, 30, True).tolist()
    alone = [sr.sample_race(logits, rows[i:i + 1], temp[i:i + 1], top_k[i:i + 1], top_p[i:i + 1], keys[i:i + 1],
                            int(top_k[i]), bool(top_p[i] < 1))[0].item() for i in range(n)]
    assert alone == batch
    for rounds in (1, 3):
        assert sr.sample_race(logits, rows, temp, top_k, top_p, keys, 30, True, rounds=rounds).tolist() == batch


@pytest.mark.parametrize("dev", DEVICES)
def test_ties_at_the_top_p_cut_are_kept(dev, rng):
    """A row whose top tokens tie in groups across the top-p boundary: the kernel keeps whole tie
    groups as the reference does (`top_p_keep`), whatever order a sort gives equal values."""
    v = VOCAB[dev]
    n = 8
    base = torch.full((v,), -30.0)
    base[torch.randperm(v, generator=rng)[:40]] = torch.tensor([3.0] * 10 + [2.0] * 30)
    logits = base.expand(n, v).contiguous()
    rows, temp, top_k = torch.arange(n), torch.ones(n), torch.zeros(n, dtype=torch.int64)
    top_p = torch.full((n,), 0.6)  # the 3.0 group holds ~0.48 of the mass: the cut falls inside the 2.0 group
    got = _check(logits, rows, temp, top_k, top_p, _keys(rng, n), dev)
    assert (base[got] >= 2.0).all()
    assert (ref.sampling_probs_rows(logits, temp, top_k, top_p, 0, True)[0] > 0).sum() == 40


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["radix", "topk"])
def test_top_k_threshold_is_the_references(dev, dtype, method, rng):
    """The launcher's top-k threshold (the k-th largest logit, divided; by the radix-select kernel
    or torch.topk) equals the k-th largest of the divided row bit for bit: ties across the cut,
    negative and positive logits, small temperatures, k past the vocabulary; -inf where k is 0."""
    n, v = 9, 5000 if dev == "cpu" else VOCAB[dev]
    logits = (torch.randn(n, v, generator=rng) * 5).to(dtype)
    logits[2, :50] = logits[2, 0]  # a tie group across the cut
    logits[6] = -logits[6].abs() - 1  # every value negative
    rows = torch.tensor([3, 0, 2, 8, 5, 1, 7, 4, 6])
    temp = torch.tensor([0.8, 1.0, 0.3, 1e-3, 1.7, 0.9, 2.5, 0.05, 1.0])
    top_k = torch.tensor([1, 20, 25, 7, 0, v + 5, 3, 64, 2])
    got = sr.top_k_threshold(*(a.to(dev) for a in (logits, rows, temp, top_k)), int(top_k.max()), method).cpu()
    x = logits.index_select(0, rows).float() / temp.unsqueeze(1)
    for s in range(n):
        k = min(int(top_k[s]), v)
        want = torch.topk(x[s], k).values[-1] if k else torch.tensor(float("-inf"))
        assert torch.equal(got[s], want), (s, float(got[s]), float(want))
    assert torch.isinf(sr.top_k_threshold(logits.to(dev), rows.to(dev), temp.to(dev), top_k.to(dev), 0)).all()
    with pytest.raises(ValueError, match="method"):
        sr.top_k_threshold(logits, rows, temp, top_k, 3, "sort")

