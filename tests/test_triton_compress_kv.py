"""Triton `compress_kv` (npu_ops/triton/compress_kv.py) against the torch reference.

Runs under the Triton interpreter on CPU (`TRITON_INTERPRET=1`; set here when no CUDA device is
present) and compiled on CUDA for the `gpu`-marked variants. The reference always runs on CPU.

What is checked:
- RoPE + FP4 are bit-exact given the latent: the kernel's codes / scales equal
  `quant.fp4_quant(rope(kernel latent))`, always.
- Inputs whose sums are exact in fp32 (small integers times a power of two, equal scores):
  latent, codes and scales bit-exact with the reference.
- Random inputs: the latent may differ from the reference in rare elements: the sum of squares
  is reduced in another order than torch's, and `tl.exp` (ex2.approx on CUDA) is not torch's
  expf. A few fp32 ulps flip the bf16 rounding of values near a midpoint (~1e-5 of the
  elements), and where w0 * kv0 and w1 * kv1 nearly cancel (ratio 2) the small result can move
  by more than a bf16 ulp. Required: >= 99.9% of latent elements and code / scale bytes exact,
  and every latent element within max(bf16 ulp of either value) + 2^-18 * M of the reference,
  M = sum_i w_i |kv_i| * rsqrt(mean(pooled^2) + eps) * |weight| (the un-cancelled magnitude).
"""


import pytest
import torch

from _triton import DEVICES, triton  # noqa: E402,F401  (sets TRITON_INTERPRET; skips without triton)

from dsv41.backends import registry  # noqa: E402
from dsv41.backends.reference import quant  # noqa: E402
from dsv41.backends.reference.basic import rope  # noqa: E402
from dsv41.npu_ops.triton import compress_kv as ckv  # noqa: E402

MIN_EXACT = 0.999  # of the elements bit-exact (and never fewer than all but one: small cases)


def mostly_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a == b in at least MIN_EXACT of the elements, or in all but one: a pooled value next to a
    bf16 rounding boundary (the official pooled latent is bf16) rounds either way under another
    exp / summation order."""
    differ = int((a != b).sum())
    return differ <= max(1, int((1 - MIN_EXACT) * a.numel()))

pytestmark = pytest.mark.usefixtures("official_reference")  # (conftest.py)


def make_inputs(g: torch.Generator, n: int, ratio: int, d: int, r: int, cap: int, exact: bool = False):
    rows = n * ratio
    if exact:  # sums exact in fp32: integers in [-64, 64] times a per-group power of two
        kv = torch.randint(-64, 65, (rows, d), generator=g).float()
        kv *= torch.exp2(torch.randint(-12, 13, (n, 1), generator=g).float()).repeat_interleave(ratio, 0)
        kv[0] = 0.0  # an all-zero group (eps only) when ratio 1; half-zero at ratio 2
        score = torch.randn(n, 1, d, generator=g).expand(n, ratio, d).reshape(rows, d) * 3 if ratio > 1 else None
        weight = (torch.randint(-8, 9, (d,), generator=g).float() / 8).to(torch.bfloat16)
    else:
        kv = torch.randn(rows, d, generator=g) * torch.exp2(torch.randint(-8, 9, (rows, 1), generator=g).float())
        score = torch.randn(rows, d, generator=g) * 3 if ratio > 1 else None
        weight = (1 + 0.3 * torch.randn(d, generator=g)).to(torch.bfloat16)
    ang = torch.rand(n, r // 2, generator=g) * 100
    cos, sin = torch.cos(ang), torch.sin(ang)
    slots = torch.randperm(cap, generator=g)[:n]
    codes = torch.randint(0, 256, (cap, d // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 127, (cap, d // 16), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    return kv, score, weight, cos, sin, codes, scales, slots


def run_both(dev, ratio, eps, kv, score, weight, cos, sin, codes, scales, slots):
    want_c, want_s = codes.clone(), scales.clone()
    want = ckv.compress_kv_ref(kv, score, ratio, weight, eps, cos, sin, want_c, want_s, slots)
    got_c, got_s = codes.to(dev), scales.to(dev)
    to = (lambda t: None if t is None else t.to(dev))
    got = ckv.compress_kv(to(kv), to(score), ratio, to(weight), eps, to(cos), to(sin), got_c, got_s, to(slots))
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    return got.cpu(), got_c.cpu(), got_s.cpu(), want, want_c, want_s


def latent_scale(kv, score, ratio, weight, eps):
    """M per latent element: sum_i w_i |kv_i| * rsqrt(mean(pooled^2) + eps) * |weight| (fp64)."""
    n, d = kv.shape[0] // ratio, kv.shape[1]
    k = kv[: n * ratio].double().reshape(n, ratio, d)
    w = torch.softmax(score[: n * ratio].double().reshape(n, ratio, d), 1) if ratio > 1 else torch.ones_like(k)
    pooled = (w * k).sum(1)
    rs = torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + eps)
    return (w * k.abs()).sum(1) * rs * weight.double().abs()


def bf16_ulp(t):
    """The ulp of bf16 values (fp64; 0 for zeros)."""
    t = t.double()
    _, e = torch.frexp(t)
    return torch.where(t == 0, 0.0, torch.ldexp(torch.ones_like(t), e - 8))


def bits16(t):
    return t.contiguous().view(torch.int16).to(torch.int32)


def check_tail_exact(lat, cos, sin, codes, scales, slots, untouched_c, untouched_s):
    """Codes / scales are exactly the FP4 of rope(latent) at the slots; other rows unchanged."""
    rc, rs = quant.fp4_quant(rope(lat, cos, sin))
    assert torch.equal(codes[slots], rc)
    assert torch.equal(scales.view(torch.uint8)[slots], rs.view(torch.uint8))
    keep = torch.ones(codes.shape[0], dtype=torch.bool)
    keep[slots] = False
    assert torch.equal(codes[keep], untouched_c[keep])
    assert torch.equal(scales.view(torch.uint8)[keep], untouched_s.view(torch.uint8)[keep])


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("n,d,r", [(5, 64, 32), (3, 512, 64)])
def test_compress_kv_exact_inputs(dev, ratio, n, d, r, rng):
    inp = make_inputs(rng, n, ratio, d, r, cap=n + 7, exact=True)
    got, gc, gs, want, wc, ws = run_both(dev, ratio, 1e-20, *inp)
    assert torch.equal(bits16(got), bits16(want))
    assert torch.equal(gc, wc)
    assert torch.equal(gs.view(torch.uint8), ws.view(torch.uint8))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("n,d,r,eps", [(9, 64, 32, 1e-20), (4, 512, 64, 1e-20), (6, 128, 64, 1e-6)])
def test_compress_kv_random(dev, ratio, n, d, r, eps, rng):
    if dev == "cuda":
        n *= 300  # more groups on the GPU
    inp = make_inputs(rng, n, ratio, d, r, cap=n + 13)
    kv, score, weight, cos, sin, codes, scales, slots = inp
    got, gc, gs, want, wc, ws = run_both(dev, ratio, eps, *inp)
    # latent: >= 99.9% exact; every element within a bf16 ulp (two at ratio 2: the pooled value's
    # own bf16 rounding can flip too) plus 2^-18 of its un-cancelled size
    bg, bw = bits16(got), bits16(want)
    assert mostly_equal(bg, bw)
    err = (got.double() - want.double()).abs()
    bound = ratio * torch.maximum(bf16_ulp(got), bf16_ulp(want)) + 2.0**-18 * latent_scale(kv, score, ratio, weight, eps)
    assert (err <= bound).all(), f"{int((err > bound).sum())} latent elements out of bounds, worst {(err / bound).max():.3g}x"
    if ratio == 1:  # no cancellation: one bf16 ulp at most
        assert ((bg - bw).abs() <= 1).all()
    # RoPE + FP4 bit-exact given the latent; untouched cache rows unchanged
    check_tail_exact(got, cos, sin, gc, gs, slots, codes, scales)
    # against the full reference
    assert mostly_equal(gc[slots], wc[slots])
    assert mostly_equal(gs.view(torch.uint8)[slots], ws.view(torch.uint8)[slots])


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("ratio", [1, 2])
def test_compress_kv_row_strided_inputs(dev, ratio, rng):
    """kv and score as the two halves of one [rows, 2, D] tensor (the compressor's carry rows, as
    the model passes them): read in place through their row stride, the same bytes out as from
    contiguous copies."""
    kv, score, weight, cos, sin, codes, scales, slots = make_inputs(rng, 5, ratio, 64, 32, cap=12, exact=True)
    both = torch.stack((kv, score if score is not None else kv), 1)
    kv_v, score_v = both[:, 0], (both[:, 1] if ratio > 1 else None)
    assert kv_v.stride(0) == 128 and not kv_v.is_contiguous()
    pools = lambda: (codes.clone(), scales.clone())  # noqa: E731  (fresh pools: .to("cpu") aliases)
    got, gc, gs, want, wc, ws = run_both(dev, ratio, 1e-20, kv_v, score_v, weight, cos, sin, *pools(), slots)
    _, cc, cs, _, _, _ = run_both(dev, ratio, 1e-20, kv, score, weight, cos, sin, *pools(), slots)
    assert torch.equal(bits16(got), bits16(want))
    assert torch.equal(gc, wc) and torch.equal(gc, cc)
    assert torch.equal(gs.view(torch.uint8), ws.view(torch.uint8)) and torch.equal(gs.view(torch.uint8), cs.view(torch.uint8))


@pytest.mark.parametrize("dev", DEVICES)
def test_compress_kv_bf16_rows_at_ratio_one(dev, rng):
    """At ratio 1 kv may be the compressor's bf16 matmul output (the model passes it so): widened
    as it loads, the same bytes out as from its fp32 copy, on the device and on the reference."""
    kv, _, weight, cos, sin, codes, scales, slots = make_inputs(rng, 5, 1, 64, 32, cap=12, exact=True)
    kb = kv.to(torch.bfloat16)
    pools = lambda: (codes.clone(), scales.clone())  # noqa: E731  (fresh pools: .to("cpu") aliases)
    got, gc, gs, want, wc, ws = run_both(dev, 1, 1e-20, kb, None, weight, cos, sin, *pools(), slots)
    wide, cc, cs, _, _, _ = run_both(dev, 1, 1e-20, kb.float(), None, weight, cos, sin, *pools(), slots)
    assert torch.equal(bits16(got), bits16(wide)) and torch.equal(bits16(got), bits16(want))
    assert torch.equal(gc, cc) and torch.equal(gc, wc)
    assert torch.equal(gs.view(torch.uint8), cs.view(torch.uint8)) and torch.equal(gs.view(torch.uint8), ws.view(torch.uint8))


@pytest.mark.parametrize("dev", DEVICES)
def test_compress_kv_odd_rows_and_no_groups(dev, rng):
    """ratio 2 with a trailing incomplete group (ignored, as the reference), and zero groups."""
    kv, score, weight, cos, sin, codes, scales, slots = make_inputs(rng, 3, 2, 64, 32, cap=8, exact=True)
    kv = torch.cat([kv, torch.randn(1, 64, generator=rng)])
    score = torch.cat([score, torch.randn(1, 64, generator=rng)])
    got, gc, gs, want, wc, ws = run_both(dev, 2, 1e-20, kv, score, weight, cos, sin, codes, scales, slots)
    assert torch.equal(bits16(got), bits16(want)) and torch.equal(gc, wc)
    e = torch.empty(0, 2)
    out = ckv.compress_kv(kv[:1].to(dev), score[:1].to(dev), 2, weight.to(dev), 1e-20, e.to(dev), e.to(dev),
                          codes.to(dev), scales.to(dev), torch.empty(0, dtype=torch.long, device=dev))
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16


def test_compress_kv_rejects_bad_args():
    z = torch.zeros
    with pytest.raises(ValueError, match="ratio"):
        ckv.compress_kv(z(8, 64), z(8, 64), 4, z(64), 1e-6, z(2, 16), z(2, 16), z(4, 32, dtype=torch.uint8),
                        z(4, 4, dtype=torch.uint8), torch.arange(2))
    with pytest.raises(ValueError, match="power of two"):
        ckv.compress_kv(z(2, 48), None, 1, z(48), 1e-6, z(2, 8), z(2, 8), z(4, 24, dtype=torch.uint8),
                        z(4, 3, dtype=torch.uint8), torch.arange(2))
    with pytest.raises(ValueError, match="cos"):
        ckv.compress_kv(z(2, 64), None, 1, z(64), 1e-6, z(3, 16), z(3, 16), z(4, 32, dtype=torch.uint8),
                        z(4, 4, dtype=torch.uint8), torch.arange(2))


@pytest.mark.parametrize("dev", DEVICES)
def test_cuda_backend_registers_compress_kv(dev, monkeypatch, rng):
    from dsv41.backends import ops
    from dsv41.npu_ops.triton import KERNELS

    if "compress_kv" not in KERNELS:
        pytest.skip("compress_kv not in npu_ops.triton.KERNELS yet")
    impl, used, reason = registry.resolve("compress_kv", "cuda")
    assert (impl, used) == (ckv.compress_kv, "cuda"), reason
    if dev == "cpu":
        monkeypatch.setenv("DSV41_BACKEND", "cuda")  # CPU tensors reach the (interpreted) kernel
    kv, score, weight, cos, sin, codes, scales, slots = make_inputs(rng, 4, 2, 64, 32, cap=6, exact=True)
    wc, ws = codes.clone(), scales.clone()
    want = ckv.compress_kv_ref(kv, score, 2, weight, 1e-20, cos, sin, wc, ws, slots)
    gc, gs = codes.to(dev), scales.to(dev)
    got = ops.compress_kv(kv.to(dev), score.to(dev), 2, weight.to(dev), 1e-20, cos.to(dev), sin.to(dev), gc, gs,
                          slots.to(dev))
    assert torch.equal(bits16(got.cpu()), bits16(want)) and torch.equal(gc.cpu(), wc)
