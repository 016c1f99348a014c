"""The folded FP4 decode path (npu_ops/triton/moe_fold.py) against the reference.

The int32-word conversion bit-exactly against the reference dequantisation for every E2M1 code
and scale byte it takes; the whole path (`moe_experts(..., path="fold")`) against the fp64
reference at decode sizes: repeated expert ids across tokens, skipped (-1) slots, experts with
no rows, more rows per expert than one row tile; every scratch buffer poisoned (NaN) first.
Interpreter variants at small widths, `gpu`-marked compiled variants at model-like widths.
Bound as tests/test_triton_moe_grouped.py (exact products, fp32 sums, FP8 re-quantisation of the
w2 input: 1e-4 in norm).
"""

import pytest
import torch

from _triton import DEVICES, cuda_only, triton  # noqa: F401  (sets TRITON_INTERPRET; skips without triton)

from test_triton_block_linear import weight  # noqa: E402  (the random weights in storage formats)
from test_triton_moe_grouped import check as grouped_check  # noqa: E402  (inputs, reference, bound)
from test_triton_moe_grouped import every_code_weight  # noqa: E402

from dsv41.backends.reference.basic import dequant_weight  # noqa: E402
from dsv41.backends.reference import quant  # noqa: E402
from dsv41.npu_ops.triton import moe_experts as me  # noqa: E402
from dsv41.npu_ops.triton import moe_fold as mf  # noqa: E402
from dsv41.npu_ops.triton.launch import interpreting  # noqa: E402

tl = triton.language
pytestmark = [cuda_only, pytest.mark.usefixtures("official_reference")]


def poison_buffers(monkeypatch, module):
    """Every buffer `module._buffer` allocates starts as NaN."""
    def poison(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(module, "_buffer", poison)


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the fold path allocates starts as NaN."""
    poison_buffers(monkeypatch, mf)


def assert_default_reaches(monkeypatch, pays: str, module, launcher: str, run) -> None:
    """With `moe_experts.<pays>` true, `run()` (a default-path call checked against the reference)
    goes through `module.<launcher>` exactly once: the dispatch passes the right arguments."""
    calls = []
    real = getattr(module, launcher)
    monkeypatch.setattr(me, pays, lambda *a: True)
    monkeypatch.setattr(module, launcher, lambda *a, **k: calls.append(1) or real(*a, **k))
    run()
    assert calls == [1]



@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, K, BN: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr,
                    LOWP: tl.constexpr):
    """out [BN, K] fp32 = the folded tile values, written back in natural K order."""
    rn = tl.arange(0, BN)
    kcol = mf.word_order(tl.arange(0, BK))
    for k0 in range(0, K, BK):
        w = mf.fp4_tile_bf16(w_ptr, s_ptr, rn, k0 // 8, K // 128, K // 8, BN, BK, ASM, LOWP)
        tl.store(out_ptr + rn[:, None] * K + k0 + kcol[None, :], w.to(tl.float32))


@pytest.mark.parametrize("dev", DEVICES)
def test_fold_dequant_bit_exact(dev):
    """Every E2M1 code at every scale byte 1..128 (the bytes the path takes): bit-equal to the
    reference dequantisation where the result is normal (>= 2^-126); the one smaller result
    (0.5 at byte 1, 2^-127) is exact or flushed to zero."""
    w, s = every_code_weight(mf.MAX_SCALE_BYTE, 8)
    n, k = w.shape[0], w.shape[1] * 2
    want = dequant_weight(w, s).double()
    out = torch.full((n, k), float("nan"), dtype=torch.float32, device=dev)
    wd = w.view(torch.uint8).to(dev).view(torch.int32)
    _dequant_kernel[(1,)](wd, s.view(torch.uint8).to(dev).view(torch.int32), out, k, BN=n, BK=128,
                          ASM=not interpreting(), LOWP=not interpreting())
    got = out.cpu().double()
    normal = (want.abs() >= 2.0 ** -126) | (want == 0)
    assert (~normal).sum() == 4  # 0.5 and -0.5, twice each, at byte 1
    assert torch.equal(got[normal], want[normal])
    assert ((got[~normal] == want[~normal]) | (got[~normal] == 0)).all()


@triton.jit
def _dequant_bytes_kernel(w_ptr, s_ptr, out_ptr, K, BN: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr,
                          LOWP: tl.constexpr):
    """out [BN, K] fp32 = the tiles `fp4_bytes_bf16` builds from bytes, in natural K order."""
    rn = tl.arange(0, BN).to(tl.int64)
    kcol = mf.byte_order(tl.arange(0, BK), BK)
    for k0 in range(0, K, BK):
        sb = mf.scale_bytes(s_ptr, rn, k0, K // 32, BN, BK, True)
        w = mf.fp4_bytes_bf16(w_ptr, sb, rn, k0, K // 2, BN, BK, ASM, LOWP)
        tl.store(out_ptr + rn[:, None] * K + k0 + kcol[None, :], w.to(tl.float32))


@pytest.mark.parametrize("dev", DEVICES)
def test_fold_bytes_dequant_bit_exact(dev):
    """The byte-tile conversion (`fp4_bytes_bf16`: the four values of each nibble position beside
    every other code, at every scale byte 1..128) equals the word conversion's values: bit-equal to
    the reference dequantisation where the result is normal, 0.5 at byte 1 exact or flushed."""
    w, s = every_code_weight(mf.MAX_SCALE_BYTE, 8)
    w = w.view(torch.uint8)
    w = torch.cat([w, (w >> 4) | (w << 4)])  # every code in both nibbles
    s = torch.cat([s, s])
    n, k = w.shape[0], w.shape[1] * 2
    want = dequant_weight(w.view(torch.int8), s).double()
    out = torch.full((n, k), float("nan"), dtype=torch.float32, device=dev)
    _dequant_bytes_kernel[(1,)](w.to(dev), s.view(torch.uint8).to(dev), out, k, BN=n, BK=128,
                                ASM=not interpreting(), LOWP=not interpreting())
    got = out.cpu().double()
    normal = (want.abs() >= 2.0 ** -126) | (want == 0)
    assert (~normal).sum() == 8  # 0.5 and -0.5, twice each per nibble position, at byte 1
    assert torch.equal(got[normal], want[normal])
    assert ((got[~normal] == want[~normal]) | (got[~normal] == 0)).all()


def run_ptx(asm: str, args: dict) -> dict:
    """A Python interpreter for the few b32 instructions (prmt, shl, shr, and, or, mul.lo.u32,
    mul.rn.bf16x2) of a packed-conversion PTX string: `args` maps operand names ($4, ...) to
    32-bit inputs; returns every register after the run. The bf16x2 product is rounded to nearest
    even (torch), as mul.rn keeps subnormal bf16 inputs and results on sm_90."""
    regs = dict(args)
    body = asm.replace("{", "").replace("}", "")

    def val(x):
        return int(x, 0) if x[0].isdigit() else regs[x]

    def bf16x2_mul(a, b):
        def halves(v):
            return torch.tensor([v & 0xFFFF, v >> 16], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        prod = (halves(a).double() * halves(b).double()).to(torch.bfloat16).view(torch.int16).int() & 0xFFFF
        return int(prod[0]) | (int(prod[1]) << 16)

    for ins in (i.strip() for i in body.split(";")):
        if not ins or ins.startswith(".reg"):
            continue
        op, rest = ins.split(None, 1)
        d, *src = [o.strip() for o in rest.split(",")]
        if op == "prmt.b32":  # result byte i = byte sel[i] of b:a
            both = val(src[0]) | (val(src[1]) << 32)
            sel = val(src[2])
            regs[d] = sum(((both >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif op == "shl.b32":
            regs[d] = (val(src[0]) << val(src[1])) & 0xFFFFFFFF
        elif op == "shr.b32":
            regs[d] = val(src[0]) >> val(src[1])
        elif op == "mul.lo.u32":
            regs[d] = (val(src[0]) * val(src[1])) & 0xFFFFFFFF
        elif op == "and.b32":
            regs[d] = val(src[0]) & val(src[1])
        elif op == "or.b32":
            regs[d] = val(src[0]) | val(src[1])
        elif op == "mul.rn.bf16x2":
            regs[d] = bf16x2_mul(val(src[0]), val(src[1]))
        else:
            raise AssertionError(f"run_ptx: no model of {op}")
    return regs


def test_bytes_ptx_every_code():
    """`_E2M1_BF16X4_ASM` (CUDA only, so run here instruction by instruction) on 4 packed bytes
    and 4 scale factors: element i (byte i, factor i) gives the E2M1 value of its low nibble in
    halfword i of $0 $1 and of its high nibble in halfword i of $2 $3, times 2^(scale - 127),
    for every byte in every position and scale bytes 1..128."""
    asm = mf._E2M1_BF16X4_ASM.value
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    for i in range(256):
        byts = [(i + 67 * lane) % 256 for lane in range(4)]  # each byte value once in every lane
        sbytes = [1 + (i * 5 + 37 * lane) % 128 for lane in range(4)]
        f = [((sb + 126) << 7) for sb in sbytes]  # bf16 bits of 2^(s - 1), as the kernel builds them
        out = run_ptx(asm, {"$4": sum(b << (8 * k) for k, b in enumerate(byts)),
                            "$5": f[0] | (f[1] << 16), "$6": f[2] | (f[3] << 16)})
        for lane, (b, sb) in enumerate(zip(byts, sbytes)):
            for reg, nib in (("$0", b & 15), ("$2", b >> 4)):
                r = out[f"${int(reg[1]) + lane // 2}"]
                got = torch.tensor([(r >> (16 * (lane % 2))) & 0xFFFF], dtype=torch.int32).to(torch.int16)
                want = (-1 if nib & 8 else 1) * e2m1[nib & 7] * 2.0 ** (sb - 127)
                assert got.view(torch.bfloat16).double().item() == want, (i, lane, reg)


def test_byte_order_is_a_permutation():
    """`byte_order` permutes each BK-wide tile and `byte_position` undoes it."""
    for bk in (128, 256):
        i = torch.arange(3 * bk)
        order = mf.byte_order.fn(i, bk)
        assert torch.equal(order.sort().values, i) and torch.equal(order // bk, i // bk)
        assert torch.equal(mf.byte_position.fn(order, bk), i)


def check(dev, t, n_exp, topk, d, inter, rng, used=None, **tiles):
    """moe_experts through the fold path (unless `path` says otherwise) against the reference:
    test_triton_moe_grouped.check with FP4 experts."""
    grouped_check(dev, "fp4", t, n_exp, topk, d, inter, rng, used, **dict({"path": "fold"}, **tiles))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("t", [1, 3, 20])
def test_fold_decode_batches(dev, t, rng, poisoned):
    """T = 1 / 3 (rows below one MMA's 16) and 20 with 8 experts, top-4: up to 20 rows per
    expert, more than one 16-row tile at the interpreter's tiles."""
    check(dev, t, 8, 4, 256, 128, rng, used=7, bm=16)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("split", [2, 4])
def test_fold_split_k(dev, split, rng, poisoned):
    """The gate/up K range in slices (partial sums, then the epilogue kernel)."""
    check(dev, 5, 8, 4, 512, 128, rng, used=7, split=split)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("t", [1, 20])
def test_fold_weight_right(dev, t, rng, poisoned):
    """The other dot orientation (x^T @ w^T, accumulator [rows, columns])."""
    check(dev, t, 8, 4, 256, 128, rng, used=7, bm=16, w_left=False)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("t", [1, 3, 20])
def test_fold_byte_tiles_decode_batches(dev, t, rng, poisoned):
    """The byte-tile variant (weight tiles from bytes in `byte_order`, x and h stored in it) at the
    shapes of test_fold_decode_batches."""
    check(dev, t, 8, 4, 256, 128, rng, used=7, bm=16, byte_tiles=True)


@pytest.mark.parametrize("dev", DEVICES)
def test_fold_byte_tiles_split_k(dev, rng, poisoned):
    """The byte-tile variant with the gate/up K range in slices (the epilogue kernel stores h)."""
    check(dev, 5, 8, 4, 512, 128, rng, used=7, split=2, byte_tiles=True)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("slots", [2, 3])
def test_fold_row_slots(dev, slots, rng, poisoned):
    """An expert's row tiles dealt to several programs side by side (`slots`; 3 leaves a slot
    without a tile) at T = 20 with 16-row tiles: experts with more than 16 rows take two."""
    check(dev, 20, 8, 4, 256, 128, rng, used=5, bm=16, slots=slots)


def slots_case(dev, t, d, inter, rng):
    """t tokens routed top-2 over 4 FP4 experts, expert 0 in every token (t rows: several row
    tiles), and the fold path's output for a given `slots` / tiles."""
    x = (torch.randn(t, d, generator=rng) * 2).to(torch.bfloat16).to(dev)
    ids = torch.stack([torch.tensor([0, 1 + i % 3]) for i in range(t)]).to(dev)
    w = (torch.rand(t, 2, generator=rng) + 0.1).to(dev)
    ex = [tuple((a.to(dev), b.to(dev)) for a, b in (weight("fp4", inter, d, rng), weight("fp4", d, inter, rng),
                                                   weight("fp4", inter, d, rng))) for _ in range(4)]
    return lambda **tiles: me.moe_experts(x, w, ids, ex, 10.0, path="fold", **tiles)


@pytest.mark.parametrize("dev", DEVICES)
def test_fold_slots_bit_equal(dev, rng, poisoned):
    """Slots change no bit (each row's sums run in the same order in whichever program): 24 rows
    of one expert in 16-row tiles, in one program or two."""
    run = slots_case(dev, 24, 256, 128, rng)
    one = run(bm=16, slots=1)
    assert torch.isfinite(one).all()
    assert torch.equal(run(bm=16, slots=2), one)
    with pytest.raises(ValueError, match="slots"):
        run(bm=16, slots=0)


def test_fold_refuses_large_scales(rng):
    """Scale bytes above MAX_SCALE_BYTE (weights beyond +-12) are refused with a clear error."""
    w, s = quant.fp4_weight_quant(torch.full((32, 64), 100.0))
    assert int(s.view(torch.uint8).max()) > mf.MAX_SCALE_BYTE
    ex = [((w, s), (torch.zeros(64, 16, dtype=torch.int8), s[:, :1].clone().contiguous()), (w, s))]
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fold path"):
        me.moe_experts(x, torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long), ex, 10.0, path="fold")


def pays_case(rng, monkeypatch):
    """For the tests of the default-path choosers: two FP4 experts (width 128, d 256, their table
    built), the CUDA device, and a function that makes `launch.interpreting` answer as told."""
    from dsv41.npu_ops.triton import launch

    ex = [(weight("fp4", 128, 256, rng), weight("fp4", 256, 128, rng), weight("fp4", 128, 256, rng)) for _ in range(2)]
    me._expert_table(ex, torch.device("cpu"))
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    return ex, torch.device("cuda"), lambda on: monkeypatch.setattr(launch, "interpreting", lambda: on)


def test_fold_pays(rng, monkeypatch):
    """The default takes the fold path exactly for foldable FP4 experts at 1..FOLD_MAX_T tokens
    on CUDA (the interpreters keep the old default)."""
    ex, cuda, interpreting = pays_case(rng, monkeypatch)
    assert me.fold_pays(cuda, 1, ex, 128, 256) and me.fold_pays(cuda, me.FOLD_MAX_T, ex, 128, 256)
    assert not me.fold_pays(cuda, me.FOLD_MAX_T + 1, ex, 128, 256)
    assert not me.fold_pays(torch.device("cpu"), 1, ex, 128, 256)
    assert not me.fold_pays(cuda, 1, ex, 96, 256)  # a width the tiles do not divide
    big = [(quant.fp4_weight_quant(torch.full((128, 256), 100.0)),) + e[1:] for e in ex]
    me._expert_table(big, torch.device("cpu"))
    assert not me.fold_pays(cuda, 1, big, 128, 256)
    interpreting(True)
    assert not me.fold_pays(cuda, 1, ex, 128, 256)


@pytest.mark.parametrize("dev", DEVICES)
def test_default_dispatch_reaches_fold(dev, rng, poisoned, monkeypatch):
    """With `fold_pays` true, the default call runs the fold path (and gets the reference's
    result): the dispatch passes the right arguments."""
    monkeypatch.setattr(me, "rows_pays", lambda *a: False)  # (the rows path is asked first)
    assert_default_reaches(monkeypatch, "fold_pays", mf, "fold_moe",
                           lambda: check(dev, 3, 8, 4, 256, 128, rng, path=None))


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
@pytest.mark.parametrize("t", [1, 2, 4, 8, 16, 33, 64])
def test_fold_model_shapes_gpu(dev, t, rng, poisoned):
    check(dev, t, 16, 6, 1024, 512, rng, used=14)


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
@pytest.mark.parametrize("t", [1, 4, 16])
@pytest.mark.parametrize("split", [2, 4])
def test_fold_split_k_gpu(dev, t, split, rng, poisoned):
    check(dev, t, 16, 6, 1024, 512, rng, used=14, split=split)


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
@pytest.mark.parametrize("t", [1, 8, 64])
def test_fold_weight_right_gpu(dev, t, rng, poisoned):
    check(dev, t, 16, 6, 1024, 512, rng, used=14, w_left=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
@pytest.mark.parametrize("t", [1, 2, 8, 16, 33, 64])
def test_fold_byte_tiles_model_shapes_gpu(dev, t, rng, poisoned):
    check(dev, t, 16, 6, 1024, 512, rng, used=14, byte_tiles=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
@pytest.mark.parametrize("t", [1, 16])
def test_fold_byte_tiles_split_k_gpu(dev, t, rng, poisoned):
    check(dev, t, 16, 6, 1024, 512, rng, used=14, split=4, byte_tiles=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
@pytest.mark.parametrize("t", [40, 64])
def test_fold_default_slots_bit_equal_gpu(dev, t, rng, poisoned):
    """The default tiles from 17 tokens (register cap, row tiles in slots) against one program
    per (expert, column tile) with no cap: bit-equal, with one expert routed every token."""
    run = slots_case(dev, t, 1024, 512, rng)
    assert mf.fold_tiles(t).get("slots")
    assert torch.equal(run(), run(slots=1, maxnreg=255))


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
@pytest.mark.parametrize("t", [24, 64])
def test_fold_scales_ahead_bit_equal_gpu(dev, t, rng, poisoned):
    """The byte tiles' scale bytes loaded a K step ahead or in their own step (`ahead_up`; the
    down kernel always ahead): bit-equal, one slot (24 tokens) and two (64)."""
    run = slots_case(dev, t, 1024, 512, rng)
    ahead = run(ahead_up=True)
    assert torch.isfinite(ahead).all()
    assert torch.equal(ahead, run(ahead_up=False))


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [DEVICES[1]])
@pytest.mark.parametrize("t", [8, 64])
def test_fold_byte_tiles_mini_widths_gpu(dev, t, rng, poisoned):
    """The mini preset's widths (d 5120, width 2304: 40 / 18 K tiles), 4 experts (the fp64
    reference's dequantised copies stay small)."""
    check(dev, t, 4, 4, 5120, 2304, rng, byte_tiles=True)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("path,t", [("fold", 3), ("rows", 2), ("gemv", 2), ("tiled", 5), ("grouped", 5)])
def test_moe_experts_add(dev, path, t, rng):
    """`moe_experts_add` (the MoE's final add in the path's combine launch; through the path's
    own add after it where the path has no combine of its own: grouped) is bit-equal to the path's
    fp32 sum + the shared output rounded once (`fused.moe_experts_add`'s torch.add), with a bf16
    and an fp32 `add`, calling `join` once before it reads `add`."""
    n_exp, topk, d, inter = 8, 4, 320 if path == "rows" else 256, 96 if path == "rows" else 128
    x = (torch.randn(t, d, generator=rng) * 2).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(7, generator=rng)[:topk] for _ in range(t)])
    ids[0, -1] = -1  # a slot another model-parallel rank holds
    w = torch.rand(t, topk, generator=rng) + 0.1
    fmt = "fp8" if path == "gemv" else "fp4"
    ex = [tuple((a.to(dev), None if b is None else b.to(dev))
                for a, b in (weight(fmt, inter, d, rng), weight(fmt, d, inter, rng), weight(fmt, inter, d, rng)))
          for _ in range(n_exp)]
    args = (x.to(dev), w.to(dev), ids.to(dev), ex, 10.0)
    y = me.moe_experts(*args, path=path)
    assert y.dtype == torch.float32
    for add_dtype in (torch.bfloat16, torch.float32):
        add = (torch.randn(t, d, generator=rng) * y.abs().mean().item()).to(add_dtype).to(dev)
        joins = []
        got = me.moe_experts(*args, path=path, add=add, join=lambda: joins.append(1))
        want = torch.add(y, add, out=torch.empty(t, d, dtype=torch.bfloat16, device=dev))
        assert got.dtype == torch.bfloat16 and joins == [1]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"{path} add {add_dtype}"
        assert not torch.equal(got, y.to(torch.bfloat16))  # (the add changes the value)
