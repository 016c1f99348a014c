"""Triton sparse attention (npu_ops/triton/sparse_attention.py) against the torch reference.

Interpreter variants (`TRITON_INTERPRET=1`, small shapes) and `gpu`-marked compiled variants.
The output is bf16 and the probabilities are rounded to bf16 (relative to the running max in
the kernel, to the global max in the reference), so the comparison is a relative bound:
|err| <= 2^-8 (max|v| + |ref|) per element and max|err| <= 1e-2 max|ref|. All-masked rows
must be exactly 0.
"""

import pytest
import torch

from _triton import DEVICES, triton  # noqa: E402,F401  (sets TRITON_INTERPRET; skips without triton)

from dsv41.backends import registry  # noqa: E402
from dsv41.backends.reference import quant  # noqa: E402
from dsv41.npu_ops.triton import sparse_attention as sa  # noqa: E402


# tile configurations exercised explicitly: whole rows, tiled contraction + output blocks
TILED = dict(BLOCK_H=16, BLOCK_N=16, BLOCK_D=32, BLOCK_DV=32)
WHOLE = dict(BLOCK_H=16, BLOCK_N=16, BLOCK_D=None, BLOCK_DV=None)
WHOLE_T = dict(WHOLE, QK_T=True)  # q.k^T computed as k.q^T (entries as the MMA's M)
WHOLE_HALF = dict(WHOLE, DV_HALF=True)  # one output-channel parity per tile


def make_inputs(g, t, h, d, s, n, k, *, glob=True, dead_rows=(2,), window_off_rows=(1,)):
    q = (torch.randn(t, h, d, generator=g) * 2).bfloat16()
    wx = torch.randn(s, d, generator=g) * torch.exp2(torch.randint(-3, 4, (s, 1), generator=g).float())
    win_kv, win_scale = quant.fp8_quant(wx)
    win_mask = torch.rand(t, s, generator=g) < 0.6
    sink = torch.randn(h, generator=g)
    if not glob:
        for r in dead_rows:
            if r < t:
                win_mask[r] = False
        return [q, win_kv, win_scale, win_mask, None, None, None, sink]
    gx = torch.randn(n, d, generator=g) * torch.exp2(torch.randint(-3, 4, (n, 1), generator=g).float())
    glob_kv, glob_scale = quant.fp4_quant(gx)
    glob_idx = torch.randint(0, n, (t, k), generator=g)
    glob_idx[torch.rand(t, k, generator=g) < 0.3] = -1
    if t > 0 and k > 1:
        glob_idx[0, 0] = glob_idx[0, 1] = 3  # duplicates count twice
    for r in window_off_rows:
        if r < t:
            win_mask[r] = False  # global entries only
    for r in dead_rows:
        if r < t:
            win_mask[r] = False
            glob_idx[r] = -1  # nothing at all: output 0
    return [q, win_kv, win_scale, win_mask, glob_kv, glob_scale, glob_idx, sink]


def to(dev, args):
    return [a.to(dev) if isinstance(a, torch.Tensor) else a for a in args]


def check(out, args, scale, dead_rows=()):
    ref = sa.sparse_attention_ref(*args, scale)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    out = out.cpu()
    assert not torch.isnan(out.float()).any()
    q, win_kv, win_scale, win_mask, glob_kv, glob_scale, glob_idx, sink = args
    vmax = quant.fp8_dequant(win_kv, win_scale).abs().max().item()
    if glob_kv is not None:
        vmax = max(vmax, quant.fp4_dequant(glob_kv, glob_scale).abs().max().item())
    err = (out.double() - ref.double()).abs()
    assert ref.abs().max() > 0
    assert err.max() <= 1e-2 * ref.abs().max(), f"max err {err.max():.3g} vs max|ref| {ref.abs().max():.3g}"
    assert (err <= 2.0 ** -8 * (vmax + ref.double().abs())).all()
    for r in dead_rows:
        if r < out.shape[0]:
            assert torch.equal(out[r].float(), torch.zeros_like(out[r].float()))  # all masked -> exactly 0


@pytest.mark.filterwarnings("ignore:overflow encountered")  # exp(sink + 1e30) of an all-masked row
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("cfg", [WHOLE, WHOLE_T, WHOLE_HALF, TILED], ids=["whole", "whole_t", "whole_half", "tiled"])
@pytest.mark.parametrize("n_split", [1, 3, None])
def test_sparse_attention_tiny(dev, cfg, n_split, rng):
    # tiny preset widths: H = 4, D = 64
    t, h, d, s, n, k = 5, 4, 64, 37, 50, 21
    args = make_inputs(rng, t, h, d, s, n, k)
    out = sa.sparse_attention_launch(*to(dev, args), d ** -0.5, n_split=n_split, **cfg)
    check(out, args, d ** -0.5, dead_rows=(2,))


@pytest.mark.filterwarnings("ignore:overflow encountered")  # exp(sink + 1e30) of an all-masked row
@pytest.mark.parametrize("dev", DEVICES)
def test_sparse_attention_window_only(dev, rng):
    t, h, d, s = 4, 4, 64, 24
    args = make_inputs(rng, t, h, d, s, 0, 0, glob=False, dead_rows=(1,))
    out = sa.sparse_attention(*to(dev, args), d ** -0.5)
    check(out, args, d ** -0.5, dead_rows=(1,))
    # an empty index list behaves as no global entries
    args2 = list(args)
    args2[4], args2[5] = quant.fp4_quant(torch.randn(8, d, generator=rng))
    args2[6] = torch.zeros(t, 0, dtype=torch.long)
    out2 = sa.sparse_attention(*to(dev, args2), d ** -0.5)
    assert torch.equal(out2.cpu(), out.cpu())


@pytest.mark.filterwarnings("ignore:overflow encountered")  # exp(sink + 1e30) of an all-masked row
@pytest.mark.parametrize("dev", DEVICES)
def test_sparse_attention_real_widths(dev, rng):
    # H = 64 heads of 512 (fewer entries under the interpreter), int32 indices
    t, s, n, k = (2, 40, 64, 40) if dev == "cpu" else (8, 128, 4096, 512)
    h, d = 64, 512
    args = make_inputs(rng, t, h, d, s, n, k)
    args[6] = args[6].int()
    out = sa.sparse_attention(*to(dev, args), d ** -0.5)
    check(out, args, d ** -0.5, dead_rows=(2,))
    if dev == "cuda":  # the Ascend tile table, compiled on CUDA
        cfg = {kk: v for kk, v in sa.CONFIGS["npu"].items()}
        out = sa.sparse_attention_launch(*to(dev, args), d ** -0.5, **cfg)
        check(out, args, d ** -0.5, dead_rows=(2,))


@pytest.mark.filterwarnings("ignore:overflow encountered")  # exp(sink + 1e30) of an all-masked row
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("sink", [-3.0, 5.0])
def test_sparse_attention_sink_in_denominator_only(dev, sink):
    # one valid entry with logit l: out = v * sigmoid(l - sink)
    d, h = 64, 2
    win_kv, win_scale = quant.fp8_quant(torch.randn(3, d))
    v = quant.fp8_dequant(win_kv, win_scale)
    q = torch.randn(1, h, d).bfloat16()
    mask = torch.tensor([[False, True, False]])
    sinks = torch.tensor([sink, -sink])
    out = sa.sparse_attention(*to(dev, [q, win_kv, win_scale, mask, None, None, None, sinks]), d ** -0.5).cpu()
    for hh in range(h):
        logit = (q[0, hh].double() @ v[1].double()).item() * d ** -0.5
        expect = v[1].double() / (1 + torch.exp(torch.tensor(sinks[hh].item() - logit, dtype=torch.float64)))
        assert (out[0, hh].double() - expect).abs().max() <= 2.0 ** -8 * v[1].abs().max()


@pytest.mark.filterwarnings("ignore:overflow encountered")  # exp(sink + 1e30) of an all-masked row
@pytest.mark.parametrize("dev", DEVICES)
def test_cuda_backend_registers_sparse_attention(dev, monkeypatch, rng):
    from dsv41.backends import ops

    impl, used, reason = registry.resolve("sparse_attention", "cuda")
    assert (impl, used) == (sa.sparse_attention, "cuda"), reason
    if dev == "cpu":
        monkeypatch.setenv("DSV41_BACKEND", "cuda")
    args = make_inputs(rng, 3, 4, 64, 16, 20, 8)
    out = ops.sparse_attention(*to(dev, args), 64 ** -0.5)
    check(out, args, 64 ** -0.5, dead_rows=(2,))
