"""`grouped_linear` on CUDA (`npu_ops/triton/grouped_linear.py`): the tensor-core kernel at decode
batches and cuBLAS's batched product beyond, against the reference (fp64 sums, one bf16
rounding). bf16 operands with fp32 sums in another order: within a bf16 step of the reference
(bound 4e-3 relative in norm). Interpreter variants on CPU, `gpu`-marked ones at the mini width.
"""

import pytest
import torch

from _triton import DEVICES, cuda_only, triton  # noqa: F401  (sets TRITON_INTERPRET; skips without triton)

from dsv41.backends import registry  # noqa: E402
from dsv41.backends.reference import basic  # noqa: E402
from dsv41.npu_ops.triton import grouped_linear as gl  # noqa: E402

pytestmark = cuda_only

GPU = [DEVICES[1]]
BOUND = 4e-3


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    assert torch.isfinite(got).all(), "non-finite output"
    return ((got - want).norm() / want.norm()).item()


def case(rng, t, g, k, r):
    x = torch.randn(t, g, k, generator=rng).to(torch.bfloat16)
    w = (torch.randn(g * r, k, generator=rng) * k ** -0.5).to(torch.bfloat16)
    return x, w


def check(dev, x, w, **tiles):
    """The op on dev: every output written (poisoned buffers would show as NaN / inf), within
    BOUND of the reference; returns the output."""
    got = gl.grouped_linear(x.to(dev), w.to(dev), **tiles)
    want = basic.grouped_linear(x, w)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    err = rel_err(got, want)
    assert err < BOUND, f"x {tuple(x.shape)} w {tuple(w.shape)} {tiles}: rel err {err:.2e}"
    return got


@pytest.mark.parametrize("dev", DEVICES[:1])
@pytest.mark.parametrize("t", [1, 2, 5, 16, 17])
def test_grouped_linear_kernel(dev, t, rng):
    """The kernel at 1..17 tokens (padded to 16 / 32 on the dot's narrow side), 4 groups of 32
    rows: each group's rows read only their group's channels (a group's x alone nonzero gives
    nonzero output rows of that group alone)."""
    g, k, r = 4, 64, 32
    assert gl.kernel_fits(t, g, k, g * r, gl.TILES_INTERP["bn"], gl.TILES_INTERP["bk"])
    x, w = case(rng, t, g, k, r)
    check(dev, x, w)
    x1 = torch.zeros_like(x)
    x1[:, 2] = x[:, 2]
    got = gl.grouped_linear(x1.to(dev), w.to(dev)).cpu().view(t, g, r)
    assert (got[:, [0, 1, 3]] == 0).all() and (got[:, 2] != 0).any()


@pytest.mark.parametrize("dev", DEVICES[:1])
def test_grouped_linear_falls_back(dev, rng, monkeypatch):
    """Past MAX_T tokens, tiles that do not divide the widths, and fp32 inputs take cuBLAS's
    batched product (`grouped_linear_bmm`), within the same bound; a weight of the wrong width
    is an error naming both shapes."""
    calls = []
    monkeypatch.setattr(gl, "_grouped_linear_kernel", None)  # any kernel launch would fail
    real_bmm = gl.grouped_linear_bmm
    monkeypatch.setattr(gl, "grouped_linear_bmm", lambda x, w: calls.append(x.shape) or real_bmm(x, w))
    x, w = case(rng, gl.MAX_T + 1, 2, 64, 32)
    check(dev, x, w)
    x, w = case(rng, 3, 2, 48, 32)  # K not a multiple of the interpreter's BK (32)
    check(dev, x, w)
    x, w = case(rng, 3, 2, 64, 24)  # R not a multiple of BN (16)
    check(dev, x, w)
    x, w = case(rng, 3, 2, 64, 32)
    got = gl.grouped_linear(x.float().to(dev), w.float().to(dev))
    assert got.dtype == torch.bfloat16 and rel_err(got, basic.grouped_linear(x.float(), w.float())) < BOUND
    assert len(calls) == 4
    with pytest.raises(ValueError, match=r"x \(3, 2, 64\) and weight \(64, 32\)"):
        gl.grouped_linear(x.to(dev), w[:, :32].contiguous().to(dev))


def test_grouped_linear_registered_for_cuda():
    """The CUDA backend's `grouped_linear` is this module's launcher."""
    assert registry.resolve("grouped_linear", "cuda")[0] is gl.grouped_linear


@pytest.mark.gpu
@pytest.mark.parametrize("dev", GPU)
@pytest.mark.parametrize("t", [1, 2, 8, 33, 64, 65])
def test_grouped_linear_mini_width_gpu(dev, t, rng):
    """The mini width (wo_a: 8 groups of 1024 rows over 4096 channels) on the compiled kernel up
    to 64 tokens and on cuBLAS past them; at 1..64 tokens the bytes equal a second call's
    (deterministic), and the tile variants the sweep times agree."""
    x, w = case(rng, t, 8, 4096, 1024)
    got = check(dev, x, w)
    assert torch.equal(got, gl.grouped_linear(x.to(dev), w.to(dev)))
    if t <= gl.MAX_T:
        for tiles in ({"bn": 128, "num_warps": 8}, {"bk": 64, "num_stages": 5}):
            check(dev, x, w, **tiles)


@pytest.mark.gpu
@pytest.mark.parametrize("dev", GPU)
def test_grouped_linear_bmm_in_place_gpu(dev, rng):
    """cuBLAS's product is written in place through a transposed view: the bytes of the product
    transposed afterwards."""
    t, g, k, r = 80, 8, 512, 128
    x, w = case(rng, t, g, k, r)
    got = gl.grouped_linear_bmm(x.to(dev), w.to(dev))
    xd, wd = x.to(dev).transpose(0, 1), w.to(dev).view(g, r, k).transpose(1, 2)
    assert got.is_contiguous() and torch.equal(got, torch.bmm(xd, wd).transpose(0, 1).reshape(t, -1))
    assert rel_err(got, basic.grouped_linear(x, w)) < BOUND
