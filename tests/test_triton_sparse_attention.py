"""Triton sparse attention (npu_ops/triton/sparse_attention.py) against the torch reference.

Interpreter variants (`TRITON_INTERPRET=1`, small shapes) and `gpu`-marked compiled variants.
Inputs are paged: two or three sequences whose SWA and global rows sit in scattered blocks of
shared pools, each token gathering its own window rows and global rows (-1 entries masked).
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
MQA = dict(BLOCK_H=16, BLOCK_N=16, BLOCK_D=None, BLOCK_DV=None, MQA=True)  # rows decoded once as K and V
MQA_H32 = dict(MQA, BLOCK_H=32)  # heads padded past H (masked rows)
MQA_LAZY = dict(MQA, LAZY=2.0)  # the running max moves only when a block passes it by > 2 (e^2 bound)
TWO_PASS = dict(TILED, TWO_PASS=True)  # every logit first (one tile per entry block), then the values
TWO_PASS_WHOLE = dict(WHOLE, TWO_PASS=True)  # the same with whole-row chunks and output blocks
TWO_PASS_AHEAD = dict(TWO_PASS, VALUES_AHEAD=True)  # the values pass loads each entry block one ahead
TWO_PASS_X2 = dict(TWO_PASS_AHEAD, KV_X2=True)  # rows decoded to bf16 pairs, every value times 2^-64
ROWS = dict(WHOLE, ROWS=True)  # every pool row read decoded once into a dense bf16 table, then bf16 gathers

BLOCK = 8  # pool block size (rows) of both pools in these tests


def paged_rows(g, n_seq: int, lengths: list[int], n_pool_blocks: int) -> list[torch.Tensor]:
    """Per sequence, the pool rows of its entries 0..len-1: blocks drawn without replacement from
    one shared pool of `n_pool_blocks` blocks, in scattered order."""
    perm = torch.randperm(n_pool_blocks, generator=g)
    rows, used = [], 0
    for i in range(n_seq):
        nb = -(-lengths[i] // BLOCK)
        blocks = perm[used:used + nb]
        used += nb
        rows.append((blocks.repeat_interleave(BLOCK) * BLOCK + torch.arange(BLOCK).repeat(nb))[:lengths[i]])
    assert used <= n_pool_blocks
    return rows


def make_inputs(g, t, h, d, s, n, k, *, glob=True, dead_rows=(2,), window_off_rows=(1,), n_seq=2):
    """[q, swa_kv, swa_scale, win_idx, glob_kv, glob_scale, glob_idx, sink]: token i belongs to
    sequence i % n_seq at position 3 + i (its window: the last s positions, older ones -1); its
    global rows are k picks among the sequence's n // n_seq entries (30% -1, one duplicate)."""
    q = (torch.randn(t, h, d, generator=g) * 2).bfloat16()
    sink = torch.randn(h, generator=g)
    pos = [3 + i for i in range(t)]
    seq_len = max(pos) + 1
    nw_blocks = n_seq * -(-seq_len // BLOCK) + 3  # spare blocks: rows no token reads
    win_rows = paged_rows(g, n_seq, [seq_len] * n_seq, nw_blocks)
    wx = torch.randn(nw_blocks * BLOCK, d, generator=g) * torch.exp2(
        torch.randint(-3, 4, (nw_blocks * BLOCK, 1), generator=g).float())
    swa_kv, swa_scale = quant.fp8_quant(wx)
    win_idx = torch.full((t, s), -1, dtype=torch.long)
    for i in range(t):
        lo = pos[i] - s + 1
        for j in range(s):
            if lo + j >= 0:
                win_idx[i, j] = win_rows[i % n_seq][lo + j]
    win_idx[torch.rand(t, s, generator=g) < 0.2] = -1
    dead = [r for r in dead_rows if r < t]
    if not glob:
        win_idx[dead] = -1
        return [q, swa_kv, swa_scale, win_idx, None, None, None, sink]
    per_seq = max(1, n // n_seq)
    ng_blocks = n_seq * -(-per_seq // BLOCK) + 2
    glob_rows = paged_rows(g, n_seq, [per_seq] * n_seq, ng_blocks)
    gx = torch.randn(ng_blocks * BLOCK, d, generator=g) * torch.exp2(
        torch.randint(-3, 4, (ng_blocks * BLOCK, 1), generator=g).float())
    glob_kv, glob_scale = quant.fp4_quant(gx)
    glob_idx = torch.stack([glob_rows[i % n_seq][torch.randint(0, per_seq, (k,), generator=g)] for i in range(t)])
    glob_idx[torch.rand(t, k, generator=g) < 0.3] = -1
    if t > 0 and k > 1:
        glob_idx[0, 0] = glob_idx[0, 1] = glob_rows[0][3]  # duplicates count twice
    win_idx[[r for r in window_off_rows if r < t]] = -1  # global entries only
    win_idx[dead] = -1
    glob_idx[dead] = -1  # nothing at all: output 0
    return [q, swa_kv, swa_scale, win_idx, glob_kv, glob_scale, glob_idx, sink]


def to(dev, args):
    return [a.to(dev) if isinstance(a, torch.Tensor) else a for a in args]


def check(out, args, scale, dead_rows=(), ref=None):
    if ref is None:
        ref = sa.sparse_attention_ref(*args, scale)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    out = out.cpu()
    assert not torch.isnan(out.float()).any()
    q, swa_kv, swa_scale, win_idx, glob_kv, glob_scale, glob_idx, sink = args
    def finite_max(v):  # over the rows that decode to numbers (a NaN null block is never read)
        return v[torch.isfinite(v)].abs().max().item()

    vmax = finite_max(quant.fp8_dequant(swa_kv, swa_scale))
    if glob_kv is not None:
        vmax = max(vmax, finite_max(quant.fp4_dequant(glob_kv, glob_scale)))
    err = (out.double() - ref.double()).abs()
    assert ref.abs().max() > 0
    assert err.max() <= 1e-2 * ref.abs().max(), f"max err {err.max():.3g} vs max|ref| {ref.abs().max():.3g}"
    assert (err <= 2.0 ** -8 * (vmax + ref.double().abs())).all()
    for r in dead_rows:
        if r < out.shape[0]:
            assert torch.equal(out[r].float(), torch.zeros_like(out[r].float()))  # all masked -> exactly 0


@pytest.mark.filterwarnings("ignore:overflow encountered")  # exp(sink + 1e30) of an all-masked row
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("cfg", [WHOLE, WHOLE_T, WHOLE_HALF, TILED, MQA, MQA_H32, MQA_LAZY, TWO_PASS, TWO_PASS_WHOLE,
                                 TWO_PASS_AHEAD, TWO_PASS_X2],
                         ids=["whole", "whole_t", "whole_half", "tiled", "mqa", "mqa_h32", "mqa_lazy", "two_pass",
                              "two_pass_whole", "two_pass_ahead", "two_pass_x2"])
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
@pytest.mark.parametrize("t", [1, 3])
def test_sparse_attention_decode_splits(dev, t, rng):
    """Decode shapes: few tokens of three sequences, the decode tile table, one split per entry
    block (flash-decoding) and the automatic choice; all agree with the reference."""
    h, d = (8, 64) if dev == "cpu" else (64, 512)
    s, n, k = (20, 90, 40) if dev == "cpu" else (128, 6000, 512)
    args = make_inputs(rng, t, h, d, s, n, k, dead_rows=(), window_off_rows=(), n_seq=3)
    cfg = dict(sa.CONFIGS["cuda_decode"], BLOCK_N=16)
    n_blocks = -(-s // 16) + -(-k // 16)
    out = sa.sparse_attention_launch(*to(dev, args), d ** -0.5, n_split=n_blocks, **cfg)
    check(out, args, d ** -0.5)
    auto = sa.sparse_attention(*to(dev, args), d ** -0.5)
    check(auto, args, d ** -0.5)


# decode-table neighbours timed on the H200 (benchmarks/sweep_kernels.py): each checked at model
# widths for one token at a long context (flash-decoding splits) and a decode batch of 64.
# (BLOCK_N 16 with num_stages=1 gave wrong results there, then an illegal address: triton 3.6
# on the H200, 2026-12-01; no tile table uses one stage for this kernel.)
DECODE_VARIANTS = [dict(), dict(BLOCK_N=16), dict(BLOCK_N=16, num_stages=3), dict(BLOCK_N=64), dict(min_blocks_per_split=2), dict(BLOCK_N=16, min_blocks_per_split=2),
                   dict(num_warps=8), dict(BLOCK_D=256), dict(BLOCK_D=256, num_warps=8),
                   dict(BLOCK_DV=256, num_warps=8), dict(BLOCK_N=16, BLOCK_D=64, BLOCK_DV=64),
                   dict(BLOCK_N=16, BLOCK_D=256, BLOCK_DV=256, num_warps=8), dict(min_blocks_per_split=4),
                   dict(TWO_PASS=True), dict(TWO_PASS=True, BLOCK_N=16), dict(TWO_PASS=True, min_blocks_per_split=4),
                   dict(TWO_PASS=True, BLOCK_DV=256, num_warps=8), dict(TWO_PASS=True, LOGITS_MAXNREG=168),
                   dict(TWO_PASS=True, VALUES_AHEAD=True), dict(TWO_PASS=True, VALUES_AHEAD=True, BLOCK_N=16),
                   dict(TWO_PASS=True, VALUES_AHEAD=False), dict(TWO_PASS=True, VALUES_AHEAD=True, KV_X2=True),
                   dict(TWO_PASS=True, VALUES_AHEAD=False, KV_X2=True, BLOCK_N=16),
                   dict(TWO_PASS=True, VALUES_AHEAD=True, KV_X2=True, LOGITS_BLOCK_N=64),
                   dict(TWO_PASS=True, VALUES_AHEAD=True, KV_X2=True, BLOCK_N=16, LOGITS_BLOCK_N=64),
                   dict(TWO_PASS=True, VALUES_AHEAD=True, KV_X2=True, LOGITS_SPLIT_D=True)]


@pytest.fixture(scope="module")
def model_width_cases():
    """(inputs, dead rows) at 64 heads x 512 (seeded once per module): one token over a 64K
    global pool, and a decode batch of 64 tokens of 5 sequences at 4K."""
    g = torch.Generator().manual_seed(0)
    return [(make_inputs(g, t, 64, 512, 128, n, 512, dead_rows=(2,), window_off_rows=(1,), n_seq=n_seq), (2,))
            for t, n, n_seq in ((1, 65536, 1), (64, 4096, 5))]


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:overflow encountered")  # exp(sink + 1e30) of an all-masked row
@pytest.mark.parametrize("dev", DEVICES[1:])
@pytest.mark.parametrize("variant", DECODE_VARIANTS, ids=lambda v: "-".join(f"{k}{x}" for k, x in v.items()) or "table")
def test_sparse_attention_decode_variants_gpu(dev, variant, model_width_cases):
    """The decode table's entry changed as given (automatic splits), at model widths: one token
    at a 64K context and a batch of 64; equal to the reference."""
    cfg = dict(sa.CONFIGS["cuda_decode"], **variant)
    for args, dead in model_width_cases:
        out = sa.sparse_attention_launch(*to(dev, args), 512 ** -0.5, **cfg)
        check(out, args, 512 ** -0.5, dead_rows=dead)


def test_decode_table_serves_decode_batches(monkeypatch):
    """On a 132-SM GPU the decode tables serve one token (two passes, the logits split over
    channel chunks: 11.9 against the one-pass 14.4 us on an H100) and decode batches of 2-64
    (two passes: they won at T = 8 and 64 on the H200; the logits pass
    register-capped from TWO_PASS_LOGITS_CAP's token count); a prefill chunk takes
    the rows form, except while a graph is captured (the whole-row table then: the rows form
    reads its table size back to the host)."""
    from dsv41.backends.platform import platform_for
    from dsv41.npu_ops.triton import launch

    monkeypatch.setattr(sa, "_backend_key", lambda device: "cuda")
    monkeypatch.setattr(launch, "num_workers", lambda device=None, cores="vector": 132)
    monkeypatch.setattr(sa, "_SPARSE_DECODE", [])
    monkeypatch.delenv("DSV41_SPARSE_DECODE", raising=False)
    dev = torch.device("cpu")
    split_d = dict(sa.CONFIGS["cuda_decode_two_pass"], LOGITS_SPLIT_D=True)
    assert sa.config_for(dev, 1, 64) == split_d  # one token: two passes, the logits split over D
    cap_t, cap = sa.TWO_PASS_LOGITS_CAP["cuda"]
    for t in (2, 8, cap_t - 1):  # the default form: two passes from TWO_PASS_MIN_T tokens
        assert sa.config_for(dev, t, 64) is sa.CONFIGS["cuda_decode_two_pass"], t
    for t in (cap_t, 64):  # and from cap_t tokens the logits pass under a register cap
        assert sa.config_for(dev, t, 64) == dict(sa.CONFIGS["cuda_decode_two_pass"], LOGITS_MAXNREG=cap), t
    assert sa.config_for(dev, 2048, 64) is sa.CONFIGS["cuda_prefill"]
    monkeypatch.setattr(type(platform_for(dev)), "is_capturing", lambda self: True)
    assert sa.config_for(dev, 2048, 64) is sa.CONFIGS["cuda"]
    assert sa.config_for(dev, 1, 64) == split_d


def test_sparse_attention_rejects_mismatched_pools(rng):
    q, swa_kv, swa_scale, win_idx, glob_kv, glob_scale, glob_idx, sink = make_inputs(rng, 2, 4, 64, 8, 20, 4)
    with pytest.raises(ValueError, match="window pool"):
        sa.sparse_attention(q, swa_kv, swa_scale[:-1], win_idx, glob_kv, glob_scale, glob_idx, sink, 0.1)
    with pytest.raises(ValueError, match="global pool"):
        sa.sparse_attention(q, swa_kv, swa_scale, win_idx, glob_kv, glob_scale, glob_idx[:1], sink, 0.1)
    for bad in (dict(TILED, KV_X2=True), dict(MQA, KV_X2=True)):  # KV_X2 is a two-pass option
        with pytest.raises(ValueError, match="KV_X2"):
            sa.sparse_attention_launch(q, swa_kv, swa_scale, win_idx, glob_kv, glob_scale, glob_idx, sink, 0.1, **bad)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # exp(sink + 1e30) of an all-masked row
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("sink", [-3.0, 5.0])
def test_sparse_attention_sink_in_denominator_only(dev, sink):
    # one valid entry with logit l: out = v * sigmoid(l - sink)
    d, h = 64, 2
    win_kv, win_scale = quant.fp8_quant(torch.randn(3, d))
    v = quant.fp8_dequant(win_kv, win_scale)
    q = torch.randn(1, h, d).bfloat16()
    win_idx = torch.tensor([[-1, 1, -1]])  # one valid pool row
    sinks = torch.tensor([sink, -sink])
    out = sa.sparse_attention(*to(dev, [q, win_kv, win_scale, win_idx, None, None, None, sinks]), d ** -0.5).cpu()
    for hh in range(h):
        logit = (q[0, hh].double() @ v[1].double()).item() * d ** -0.5
        expect = v[1].double() / (1 + torch.exp(torch.tensor(sinks[hh].item() - logit, dtype=torch.float64)))
        assert (out[0, hh].double() - expect).abs().max() <= 2.0 ** -8 * v[1].abs().max()


def test_kernel_with_official_blocks_reproduces_the_official_reference(rng):
    """The reference's official mode rounds each probability against the running maximum of its
    64-entry block of the official entry list (valid window rows first, then the global rows).
    This kernel with 64-entry blocks and one split has that structure, and on rows in that order
    reproduces the official reference: an independent check of the emulation. The tile tables
    do not have it (blocks of 16 / 32, the window padded to whole blocks, split-K): they stay
    within the bf16 bound of `check` of both modes."""
    from dsv41.backends import numerics

    t, h, d, s, k, n = 4, 16, 64, 128, 128, 400  # lists of 256 entries: 4 official blocks
    q = (torch.randn(t, h, d, generator=rng) * 3).bfloat16()
    swa_kv, swa_scale = quant.fp8_quant(torch.randn(s, d, generator=rng))
    glob_kv, glob_scale = quant.fp4_quant(torch.randn(n, d, generator=rng))
    win_idx = torch.arange(s).repeat(t, 1)
    win_idx[0, :28] = -1  # a query near the sequence start: masked slots first in our rows
    glob_idx = torch.stack([torch.randperm(n, generator=rng)[:k].sort().values for _ in range(t)])
    glob_idx[1, 100:] = -1
    sink = torch.randn(h, generator=rng)
    args = [q, swa_kv, swa_scale, win_idx, glob_kv, glob_scale, glob_idx, sink]
    with numerics.numerics("official"):
        official = sa.sparse_attention_ref(*args, d ** -0.5)
    exact = sa.sparse_attention_ref(*args, d ** -0.5)
    ordered = list(args)
    ordered[3] = win_idx.clone()  # the official order (valid rows first), which the kernel takes as given
    ordered[3][0] = torch.cat([win_idx[0, 28:], win_idx[0, :28]])
    out = sa.sparse_attention_launch(*ordered, d ** -0.5, BLOCK_H=16, BLOCK_N=64, BLOCK_D=None, BLOCK_DV=None,
                                     n_split=1)
    same = (out == official).float().mean().item()
    same_exact = (out == exact).float().mean().item()
    print(f"\n[dsv41] kernel with 64-entry blocks: outputs equal to the official reference {same:.4f}, "
          f"to the exact one {same_exact:.4f}")
    assert same >= 0.999 and same_exact < 0.95
    for cfg in (WHOLE, dict(sa.CONFIGS["cuda_decode"], BLOCK_N=32)):  # blocks of 16; 32 with splits
        table = sa.sparse_attention_launch(*args, d ** -0.5, **cfg)
        with numerics.numerics("official"):
            check(table, args, d ** -0.5)
        check(table, args, d ** -0.5)


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


def with_null_block(args, nan: bool = True):
    """The pools with a leading null block (BLOCK rows whose bytes decode to NaN: E4M3 0xFF, E8M0
    0xFF, E4M3 scale 0x7F) and every index shifted past it; -1 entries stay -1. As in vLLM's
    pages, masked entries may address the null block: nothing of it may reach the output."""
    q, swa_kv, swa_scale, win_idx, glob_kv, glob_scale, glob_idx, sink = args

    def grow(pool, fill):
        null = torch.full((BLOCK,) + tuple(pool.shape[1:]), fill, dtype=torch.uint8)
        return torch.cat([null, pool.view(torch.uint8)]).view(pool.dtype)

    b = 0xFF if nan else 0
    out = [q, grow(swa_kv, b), grow(swa_scale, b), torch.where(win_idx >= 0, win_idx + BLOCK, -1)]
    if glob_kv is None:
        return out + [None, None, None, sink]
    return out + [grow(glob_kv, b), grow(glob_scale, 0x7F if nan else 0),
                  torch.where(glob_idx >= 0, glob_idx + BLOCK, -1), sink]


@pytest.mark.filterwarnings("ignore:overflow encountered")  # exp(sink + 1e30) of an all-masked row
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("cfg", [MQA, TILED, TWO_PASS, ROWS, None], ids=["mqa", "tiled", "two_pass", "rows", "auto"])
def test_sparse_attention_null_block_nan_does_not_leak(dev, cfg, rng):
    """Masked entries point at a null block of NaN bytes (row 0 of both pools, where -1 entries
    are clamped): the output equals the reference, which selects them away with torch.where."""
    t, h, d, s, n, k = 4, 4, 64, 20, 40, 16
    args = with_null_block(make_inputs(rng, t, h, d, s, n, k, dead_rows=(2,)))
    assert torch.isnan(quant.fp8_dequant(args[1][:BLOCK], args[2][:BLOCK])).all()
    ref = sa.sparse_attention_ref(*args, d ** -0.5)
    assert not torch.isnan(ref.float()).any()
    if cfg is None:
        out = sa.sparse_attention(*to(dev, args), d ** -0.5)
    else:
        out = sa.sparse_attention_launch(*to(dev, args), d ** -0.5, n_split=3, **cfg)
    check(out, args, d ** -0.5, dead_rows=(2,))


@pytest.mark.filterwarnings("ignore:overflow encountered")  # exp(sink + 1e30) of an all-masked row
@pytest.mark.parametrize("dev", DEVICES)
def test_sparse_attention_mqa_long_context_split_k(dev, rng):
    """One token at a long context (many entry blocks): the MQA tiles split over the entry list
    (flash-decoding: one split per block, a few blocks per split, automatic) and combined; every
    choice equals the reference. Also an empty global list and an all-masked token."""
    h, d = (8, 64) if dev == "cpu" else (64, 512)
    s, n, k = (16, 400, 160) if dev == "cpu" else (128, 65536, 512)
    cfg = dict(sa.CONFIGS["cuda_mqa"], BLOCK_N=16, min_blocks_per_split=1)
    args = make_inputs(rng, 1, h, d, s, n, k, dead_rows=(), window_off_rows=(), n_seq=1)
    n_blocks = -(-s // 16) + -(-k // 16)
    for n_split in (n_blocks, 3, None):
        out = sa.sparse_attention_launch(*to(dev, args), d ** -0.5, n_split=n_split, **cfg)
        check(out, args, d ** -0.5)
    empty = list(args)
    empty[6] = torch.zeros(1, 0, dtype=torch.long)
    out = sa.sparse_attention_launch(*to(dev, empty), d ** -0.5, n_split=2, **cfg)
    check(out, empty, d ** -0.5)
    dead = list(args)
    dead[3] = torch.full_like(args[3], -1)
    dead[6] = torch.full_like(args[6], -1)
    out = sa.sparse_attention_launch(*to(dev, dead), d ** -0.5, n_split=4, **cfg)
    assert torch.equal(out.cpu().float(), torch.zeros(1, h, d))


@pytest.mark.filterwarnings("ignore:overflow encountered")  # exp(sink + 1e30) of an all-masked row
@pytest.mark.parametrize("dev", DEVICES)
def test_sparse_attention_batch_of_64_mixed_lengths(dev, rng):
    """A decode batch of 64 tokens of 5 sequences with mixed context lengths: tokens see
    different numbers of window and global entries (short ones mostly -1), some none at all;
    the MQA tiles (compiled: the prefill table) and (compiled) the default tile table equal the
    reference."""
    t = 64
    h, d = (4, 64) if dev == "cpu" else (64, 512)
    s, n, k = (16, 60, 24) if dev == "cpu" else (128, 4096, 512)
    args = make_inputs(rng, t, h, d, s, n, k, dead_rows=(5, 40), window_off_rows=(7,), n_seq=5)
    win_idx, glob_idx = args[3], args[6]
    keep_w = torch.randint(0, s + 1, (t, 1), generator=rng)  # a token's window length
    keep_g = torch.randint(0, k + 1, (t, 1), generator=rng)  # its number of global entries
    win_idx[torch.arange(s).unsqueeze(0) >= keep_w] = -1
    glob_idx[torch.arange(k).unsqueeze(0) >= keep_g] = -1
    win_idx[3], glob_idx[3] = -1, -1
    glob_idx[9, : k // 2] = -1  # leading masked entries
    dead = [r for r in range(t) if (win_idx[r] < 0).all() and (glob_idx[r] < 0).all()]
    out = sa.sparse_attention_launch(*to(dev, args), d ** -0.5, **(MQA if dev == "cpu" else sa.CONFIGS["cuda_mqa"]))
    check(out, args, d ** -0.5, dead_rows=dead)
    rows = sa.sparse_attention_launch(*to(dev, args), d ** -0.5, **(ROWS if dev == "cpu" else sa.CONFIGS["cuda_prefill"]))
    check(rows, args, d ** -0.5, dead_rows=dead)
    if dev == "cuda":
        check(sa.sparse_attention(*to(dev, args), d ** -0.5), args, d ** -0.5, dead_rows=dead)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # exp(sink + 1e30) of an all-masked row
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("ahead", [True, False], ids=["ahead", "in_place"])
def test_sparse_attention_mqa_loads_ahead_or_in_place(dev, ahead, rng):
    """The MQA kernel with the next block's loads issued ahead and with each block loaded in
    its own iteration gives the same bits (the loads move, the arithmetic does not)."""
    t, h, d, s, n, k = 3, 4, 64, 40, 60, 50
    args = make_inputs(rng, t, h, d, s, n, k, dead_rows=(2,))
    cfg = dict(MQA, AHEAD=ahead)
    out = sa.sparse_attention_launch(*to(dev, args), d ** -0.5, n_split=2, **cfg)
    check(out, args, d ** -0.5, dead_rows=(2,))
    other = sa.sparse_attention_launch(*to(dev, args), d ** -0.5, n_split=2, **dict(cfg, AHEAD=not ahead))
    assert torch.equal(out.cpu(), other.cpu())


# the MQA table and its neighbours timed on the H200 (benchmarks/sparse_prefill.py), and the
# default whole-row prefill table: each checked at model widths on prefill chunks (split and unsplit).
PREFILL_VARIANTS = [dict(), dict(LAZY=8.0), dict(BLOCK_N=16), dict(BLOCK_N=16, LAZY=8.0),
                    dict(BLOCK_N=16, LAZY=8.0, AHEAD=False), dict(BLOCK_N=16, LAZY=8.0, num_warps=16),
                    dict(BLOCK_N=16, LAZY=8.0, num_stages=3), "cuda", "cuda_prefill",
                    dict(sa.CONFIGS["cuda_prefill"], BLOCK_N=64, num_stages=2), dict(sa.CONFIGS["cuda_prefill"], num_stages=2)]


@pytest.fixture(scope="module")
def prefill_cases():
    """(inputs, reference, dead rows) at 64 heads x 512 (seeded once per module): a 100-token
    chunk of one sequence (fewer tokens than SMs: the entry list splits in two) and 160 tokens
    of two sequences, over 4K global pools."""
    g = torch.Generator().manual_seed(1)
    cases = []
    for t, n_seq in ((100, 1), (160, 2)):
        args = make_inputs(g, t, 64, 512, 128, 4096, 512, dead_rows=(2,), window_off_rows=(1,), n_seq=n_seq)
        cases.append((args, sa.sparse_attention_ref(*args, 512 ** -0.5), (2,)))
    return cases


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:overflow encountered")  # exp(sink + 1e30) of an all-masked row
@pytest.mark.parametrize("dev", DEVICES[1:])
@pytest.mark.parametrize("variant", PREFILL_VARIANTS,
                         ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}{x}" for k, x in v.items())
                         or "table")
def test_sparse_attention_prefill_variants_gpu(dev, variant, prefill_cases):
    """The MQA entry changed as given (or the named entry), at model widths on prefill chunks;
    equal to the reference. The default dispatch takes the prefill table (cuda)."""
    cfg = sa.CONFIGS[variant] if isinstance(variant, str) else variant if variant.get("ROWS") else \
        dict(sa.CONFIGS["cuda_mqa"], **variant)
    for args, ref, dead in prefill_cases:
        out = sa.sparse_attention_launch(*to(dev, args), 512 ** -0.5, **cfg)
        check(out, args, 512 ** -0.5, dead_rows=dead, ref=ref)
        if variant == "cuda":
            check(sa.sparse_attention(*to(dev, args), 512 ** -0.5), args, 512 ** -0.5, dead_rows=dead, ref=ref)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # exp(sink + 1e30) of an all-masked row
@pytest.mark.parametrize("dev", DEVICES)
def test_sparse_attention_two_pass_splits_and_mixed_lengths(dev, rng):
    """The two-pass form over a decode batch with mixed entry counts (some tokens with none) and
    index lists of two integer widths, with one split per entry block, a few, and the automatic
    choice: every choice equals the reference, all-masked tokens give exact zeros, and an empty
    global list behaves as none."""
    t = 9
    h, d = (4, 64) if dev == "cpu" else (64, 512)
    s, n, k = (16, 60, 24) if dev == "cpu" else (128, 4096, 512)
    args = make_inputs(rng, t, h, d, s, n, k, dead_rows=(5,), window_off_rows=(7,), n_seq=3)
    win_idx, glob_idx = args[3], args[6]
    win_idx[torch.arange(s).unsqueeze(0) >= torch.randint(0, s + 1, (t, 1), generator=rng)] = -1
    glob_idx[torch.arange(k).unsqueeze(0) >= torch.randint(0, k + 1, (t, 1), generator=rng)] = -1
    dead = [r for r in range(t) if (win_idx[r] < 0).all() and (glob_idx[r] < 0).all()]
    args[6] = glob_idx.int()  # index lists of two integer widths (int32 global, int64 window)
    cfg = TWO_PASS if dev == "cpu" else dict(sa.CONFIGS["cuda_decode"], TWO_PASS=True)
    n_blocks = -(-s // cfg["BLOCK_N"]) + -(-k // cfg["BLOCK_N"])
    for n_split in (n_blocks, 3, None):
        out = sa.sparse_attention_launch(*to(dev, args), d ** -0.5, n_split=n_split, **cfg)
        check(out, args, d ** -0.5, dead_rows=dead)
        # KV_X2 (every decoded value times 2^-64, undone by powers of two) gives the same bits,
        # split partials included
        x2 = sa.sparse_attention_launch(*to(dev, args), d ** -0.5, n_split=n_split, **dict(cfg, KV_X2=True))
        assert torch.equal(x2, out), f"KV_X2 differs at n_split {n_split}: max {(x2.float() - out.float()).abs().max()}"
    empty = list(args)
    empty[6] = torch.zeros(t, 0, dtype=torch.long)
    empty[3] = args[3].clone()
    empty[3][dead] = -1
    out = sa.sparse_attention_launch(*to(dev, empty), d ** -0.5, n_split=2, **cfg)
    check(out, empty, d ** -0.5, dead_rows=[r for r in range(t) if (empty[3][r] < 0).all()])


@pytest.mark.filterwarnings("ignore:overflow encountered")  # exp(sink + 1e30) of an all-masked row
@pytest.mark.parametrize("dev", DEVICES)
def test_sparse_attention_two_pass_logits_blocks(dev, rng):
    """LOGITS_BLOCK_N (the logits pass on its own entry blocks, one loop per pool): smaller,
    equal and larger than the values pass's blocks, pools whose lengths are not multiples of
    either, fp32 decode and KV_X2, a window-only launch: equal to the reference. (Not bit-equal
    to the shared-block form in general: on an H100, 16-entry logits blocks gave other bits
    than 32-entry ones, 2026-12-07; a dot's N may change the MMA and its summation order.)"""
    t = 9
    h, d = (4, 64) if dev == "cpu" else (64, 512)
    s, n, k = (21, 60, 37) if dev == "cpu" else (128, 4096, 500)
    base = dict(TWO_PASS_AHEAD, BLOCK_N=32) if dev == "cpu" else dict(sa.CONFIGS["cuda_decode_two_pass"])
    args = make_inputs(rng, t, h, d, s, n, k, dead_rows=(5,), window_off_rows=(7,), n_seq=3)
    win = make_inputs(rng, 4, h, d, s, 0, 0, glob=False, dead_rows=(1,))
    for x2 in (False, True):
        for a, dead in ((args, (5,)), (win, (1,))):
            for lbn in (16, 32, 64):
                out = sa.sparse_attention_launch(*to(dev, a), d ** -0.5, **dict(base, KV_X2=x2, LOGITS_BLOCK_N=lbn))
                check(out, a, d ** -0.5, dead_rows=dead)
    for bad in (dict(TILED, LOGITS_BLOCK_N=32), dict(TWO_PASS, LOGITS_BLOCK_N=24), dict(TWO_PASS, LOGITS_BLOCK_N=8)):
        with pytest.raises(ValueError, match="LOGITS_BLOCK_N"):
            sa.sparse_attention_launch(*to(dev, args), d ** -0.5, **bad)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # exp(sink + 1e30) of an all-masked row
@pytest.mark.parametrize("dev", DEVICES)
def test_sparse_attention_two_pass_logits_split_d(dev, rng):
    """LOGITS_SPLIT_D (a logits tile per channel chunk; the values pass sums the chunks and each
    split takes its own maximum, which the combine rescales): one split per entry block, a few and
    the automatic choice, with masked entries, all-masked tokens and the fp32 decode and KV_X2;
    a window-only launch; equal to the reference. With LOGITS_BLOCK_N it is one clear error."""
    t = 9
    h, d = (4, 64) if dev == "cpu" else (64, 512)
    s, n, k = (21, 60, 37) if dev == "cpu" else (128, 4096, 500)
    base = TWO_PASS_AHEAD if dev == "cpu" else dict(sa.CONFIGS["cuda_decode_two_pass"])
    args = make_inputs(rng, t, h, d, s, n, k, dead_rows=(5,), window_off_rows=(7,), n_seq=3)
    win_idx, glob_idx = args[3], args[6]
    win_idx[torch.arange(s).unsqueeze(0) >= torch.randint(0, s + 1, (t, 1), generator=rng)] = -1
    glob_idx[torch.arange(k).unsqueeze(0) >= torch.randint(0, k + 1, (t, 1), generator=rng)] = -1
    dead = [r for r in range(t) if (win_idx[r] < 0).all() and (glob_idx[r] < 0).all()]
    n_blocks = -(-s // base["BLOCK_N"]) + -(-k // base["BLOCK_N"])
    win = make_inputs(rng, 4, h, d, s, 0, 0, glob=False, dead_rows=(1,))
    for x2 in (False, True):
        cfg = dict(base, KV_X2=x2, LOGITS_SPLIT_D=True)
        for n_split in (n_blocks, 3, None):
            out = sa.sparse_attention_launch(*to(dev, args), d ** -0.5, n_split=n_split, **cfg)
            check(out, args, d ** -0.5, dead_rows=dead)
        check(sa.sparse_attention_launch(*to(dev, win), d ** -0.5, **cfg), win, d ** -0.5, dead_rows=(1,))
    with pytest.raises(ValueError, match="LOGITS_SPLIT_D"):
        sa.sparse_attention_launch(*to(dev, args), d ** -0.5, **dict(base, LOGITS_SPLIT_D=True, LOGITS_BLOCK_N=32))
    with pytest.raises(ValueError, match="LOGITS_SPLIT_D"):
        sa.sparse_attention_launch(*to(dev, args), d ** -0.5, **dict(TILED, LOGITS_SPLIT_D=True))


def test_sparse_decode_form_chooses_the_decode_entry(monkeypatch):
    """DSV41_SPARSE_DECODE picks the decode entry's form (read once per process: the memo is
    reset here); a prefill chunk keeps the prefill table; a bad value is one clear error."""
    from dsv41.npu_ops.triton import launch

    monkeypatch.setattr(sa, "_backend_key", lambda device: "cuda")
    monkeypatch.setattr(launch, "num_workers", lambda device=None, cores="vector": 132)
    dev = torch.device("cpu")
    for form, entry in (("two_pass", "cuda_decode_two_pass"), ("one_pass", "cuda_decode")):
        monkeypatch.setattr(sa, "_SPARSE_DECODE", [])
        monkeypatch.setenv("DSV41_SPARSE_DECODE", form)
        for t in (1, 8):
            assert sa.config_for(dev, t, 64) is sa.CONFIGS[entry], (form, t)
        assert sa.config_for(dev, 2048, 64) is sa.CONFIGS["cuda_prefill"]
    monkeypatch.setattr(sa, "_SPARSE_DECODE", [])
    monkeypatch.setenv("DSV41_SPARSE_DECODE", "auto")  # one pass for one token, two from two
    assert sa.config_for(dev, 1, 64) is sa.CONFIGS["cuda_decode"]
    assert sa.config_for(dev, 8, 64) is sa.CONFIGS["cuda_decode_two_pass"]
    for env in ("split_d", None):  # the default: one token on the two-pass form, logits split over D
        monkeypatch.setattr(sa, "_SPARSE_DECODE", [])
        if env is None:
            monkeypatch.delenv("DSV41_SPARSE_DECODE", raising=False)
        else:
            monkeypatch.setenv("DSV41_SPARSE_DECODE", env)
        assert sa.config_for(dev, 1, 64) == dict(sa.CONFIGS["cuda_decode_two_pass"], LOGITS_SPLIT_D=True)
        assert sa.config_for(dev, 8, 64) is sa.CONFIGS["cuda_decode_two_pass"]
        assert sa.config_for(dev, 2048, 64) is sa.CONFIGS["cuda_prefill"]
    monkeypatch.setattr(sa, "_SPARSE_DECODE", [])
    monkeypatch.setenv("DSV41_SPARSE_DECODE", "three_pass")
    with pytest.raises(ValueError, match="DSV41_SPARSE_DECODE"):
        sa.config_for(dev, 8, 64)


def test_sparse_kv_x2_switch(monkeypatch):
    """KV_X2 is the two-pass decode entry's default (capped or not); DSV41_SPARSE_KV_X2=0 takes it
    out of that entry and nothing else; a bad value is one clear error (read once per process:
    memo reset)."""
    from dsv41.backends import platform
    from dsv41.npu_ops.triton import launch

    monkeypatch.setattr(sa, "_backend_key", lambda device: "cuda")
    monkeypatch.setattr(launch, "num_workers", lambda device=None, cores="vector": 132)
    monkeypatch.setattr(sa, "_SPARSE_DECODE", [])
    monkeypatch.delenv("DSV41_SPARSE_DECODE", raising=False)
    dev = torch.device("cpu")
    cap_t = sa.TWO_PASS_LOGITS_CAP["cuda"][0]
    monkeypatch.setattr(platform, "_SWITCHES", {})
    monkeypatch.delenv("DSV41_SPARSE_KV_X2", raising=False)
    assert sa.config_for(dev, 8, 64) is sa.CONFIGS["cuda_decode_two_pass"] and sa.CONFIGS["cuda_decode_two_pass"]["KV_X2"]
    assert sa.config_for(dev, cap_t, 64)["KV_X2"] and sa.config_for(dev, cap_t, 64)["LOGITS_MAXNREG"]
    monkeypatch.setattr(platform, "_SWITCHES", {})
    monkeypatch.setenv("DSV41_SPARSE_KV_X2", "0")
    assert sa.config_for(dev, 8, 64) == dict(sa.CONFIGS["cuda_decode_two_pass"], KV_X2=False)
    assert not sa.config_for(dev, cap_t, 64)["KV_X2"] and sa.config_for(dev, cap_t, 64)["LOGITS_MAXNREG"]
    assert sa.config_for(dev, 1, 64) == dict(sa.CONFIGS["cuda_decode_two_pass"], LOGITS_SPLIT_D=True, KV_X2=False)
    assert "KV_X2" not in sa.CONFIGS["cuda_decode"]  # (the one-pass entry keeps its decode)
    monkeypatch.setattr(platform, "_SWITCHES", {})
    monkeypatch.setenv("DSV41_SPARSE_KV_X2", "yes")
    with pytest.raises(ValueError, match="DSV41_SPARSE_KV_X2"):
        sa.config_for(dev, 8, 64)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # exp(sink + 1e30) of an all-masked row
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("block_n", [16, 32])
def test_sparse_attention_rows_form(dev, block_n, rng):
    """The rows form (pool rows decoded once into a dense bf16 table, then bf16 gathers): tokens
    of two sequences with masked, duplicated and all-masked entries, the entry list not a multiple
    of the block; a window-only launch; equal to the reference."""
    t, h, d, s, n, k = 6, 4, 64, 37, 50, 21
    args = make_inputs(rng, t, h, d, s, n, k, dead_rows=(2,))
    out = sa.sparse_attention_launch(*to(dev, args), d ** -0.5, **dict(ROWS, BLOCK_N=block_n))
    check(out, args, d ** -0.5, dead_rows=(2,))
    win = make_inputs(rng, 4, h, d, 24, 0, 0, glob=False, dead_rows=(1,))
    out = sa.sparse_attention_launch(*to(dev, win), d ** -0.5, **dict(ROWS, BLOCK_N=block_n))
    check(out, win, d ** -0.5, dead_rows=(1,))


@pytest.mark.parametrize("dev", DEVICES)
def test_dense_table_holds_each_row_read_once(dev, rng):
    """The rows form's table step: every pool row the lists name decoded once (bf16, exact: the
    reference dequantisation), each entry pointing at its row's slot, -1 kept; the table sized by
    the least of pool rows, list entries and `rows_bound`; a bound below the rows read drops
    entries (masked) and never writes or reads past the table."""
    from dsv41.npu_ops.triton.sparse_attention_rows import dense_table

    t, h, d, s, n, k = 6, 4, 64, 19, 50, 13
    q, wk, ws, wi, gk, gs, gi, _ = make_inputs(rng, t, h, d, s, n, k, dead_rows=(2,))
    want_w, want_g = quant.fp8_dequant(wk, ws), quant.fp4_dequant(gk, gs)
    n_w, n_g = len(set(wi[wi >= 0].tolist())), len(set(gi[gi >= 0].tolist()))
    for bound, full in ((None, True), ((n_w, n_g), True), ((n_w, 2), False)):
        table, ent = dense_table(*to(dev, [wk, ws, wi, gk, gs, gi]), rows_bound=bound)
        table, ent = table.cpu().float(), ent.cpu().long()
        assert ent.shape == (t, s + k)
        cap = min(wk.shape[0], t * s) + min(gk.shape[0], t * k)
        if bound is not None:
            cap = min(wk.shape[0], t * s, bound[0]) + min(gk.shape[0], t * k, bound[1])
        assert table.shape == (cap, d), f"seed {rng.initial_seed()}"
        src = torch.cat([wi, gi], 1)
        assert ((ent >= 0) <= (src >= 0)).all()  # a masked entry stays masked
        if full:
            assert torch.equal(ent >= 0, src >= 0)
            assert len(set(ent[ent >= 0].tolist())) == n_w + n_g  # each row once
        else:
            assert (ent >= 0).sum() < (src >= 0).sum()
        for tq in range(t):
            for j in range(s + k):
                if ent[tq, j] >= 0:
                    row = want_w[src[tq, j]] if j < s else want_g[src[tq, j]]
                    assert torch.equal(table[ent[tq, j]], row.bfloat16().float()), (tq, j)


def test_rows_form_rejects_other_options():
    q = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    args = make_inputs(torch.Generator().manual_seed(0), 2, 4, 64, 8, 16, 4)
    args[0] = q
    for bad in (dict(ROWS, MQA=True), dict(ROWS, TWO_PASS=True), dict(ROWS, BLOCK_N=8)):
        with pytest.raises(ValueError, match="ROWS"):
            sa.sparse_attention_launch(*args, 0.125, **bad)
