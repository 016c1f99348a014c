"""A/B of the decode kernels behind the DSV41_FP8_DECODE, DSV41_MHC_COEF and DSV41_MOE_ROUTE
switches, on a CUDA GPU at the mini preset's shapes: every variant is first checked against the
reference op on fresh random inputs, then timed as the median of CUDA-graph replays (weights
cycled through enough copies that they do not stay in L2, as in a decode step), and the fastest
checked setting of each switch is printed as one line `DENSE7_ENV=...`.

    python benchmarks/dense_ab.py --warm --part 3/12   # checks only (and Triton compiles) of every 12th job
    python benchmarks/dense_ab.py                      # checks and timings, table, DENSE7_ENV line

The warm runs exist so that a wrapper can compile in several processes at once before the one
timing process (benchmarks/dense_ab.sh).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from dsv41.backends import (
    ops,  # noqa: F401  (registers the reference ops)
    registry,
)
from dsv41.backends.reference import quant
from dsv41.core.config import PRESETS
from ops import timeit  # benchmarks/ops.py: CUDA-event median per call

CFG = PRESETS["mini"]()
D, H = CFG.hidden_size, CFG.num_attention_heads
# The mini preset's FP8 linears of a layer (name, N, K), the shared expert's included.
LINEARS = [("wq_a", CFG.q_lora_rank, D), ("wq_b", H * CFG.head_dim, CFG.q_lora_rank), ("wkv", CFG.head_dim, D),
           ("wo_b", D, CFG.o_groups * CFG.o_lora_rank), ("idx_wq_b", CFG.index_n_heads * CFG.index_head_dim,
                                                         CFG.q_lora_rank),
           ("shared_w13", CFG.moe_intermediate_size, D), ("shared_w2", D, CFG.moe_intermediate_size)]
LIN_M = (1, 4, 8)
# (label, DSV41_FP8_DECODE value): the path and its tile settings
LIN_VARIANTS = [("fold", "fold"), ("xscale", "xscale"), ("place", "place"), ("fp8mma", "fp8mma"),
                ("fp16mma", "fp16mma"), ("fp8mma waves8", "fp8mma:waves=8")]
# --variants: the one-row "rows" kernel and tile settings of "xscale" (dense8)
LIN_VARIANTS_ROWS = [("xscale", "xscale"), ("xs bk256", "xscale:bk=256"), ("rows", "rows"), ("rows w8", "rows:warps=8"),
                     ("rows wv8", "rows:waves=8"), ("rows rs2", "rows:rs=2"), ("rowmma", "rowmma"),
                     ("rowmma wv8", "rowmma:waves=8"), ("rowmma wv2", "rowmma:waves=2")]
MMA = ("fp8mma", "fp16mma")  # the paths that also take 9-64 rows
BIG_M = 64  # batch 64: fold against the MMA variants (xscale / place stop at 8 rows)
# the fp32-output error of each path against the reference must stay within the tests' bound for
# the fold path's numerics class (exact products, fp32 sums) to be chosen by default
FP32_BOUND = 2e-5
MHC_T = (1, 2, 8)
MHC_MODES = ("split", "narrow", "fused", "fused-narrow")
MHC_OPS = ("mhc_mix", "mhc_mixes")
ROUTE_T = (1, 2, 4, 8)
ROUTE_MODES = ("tiled", "small")
L2_CYCLE_BYTES = 160e6
DEV = "cuda"


def smoke_shapes() -> None:
    """--smoke: tiny shapes on the CPU under the Triton interpreter (the script's checks, no timing)."""
    global DEV, D, LINEARS, LIN_M, MHC_T, ROUTE_T
    DEV, D = "cpu", 128
    LINEARS = [("a", 72, 160), ("b", 40, 320)]
    LIN_M, MHC_T, ROUTE_T = (1, 3), (1, 2), (1, 3)  # weight copies cycled per graph: more than the H200's 50 MB L2


def graph_median(calls, reps: int = 15) -> float:
    """Median seconds per call over `reps` replays of one CUDA graph holding every call in
    `calls` once (warm-up outside the capture, on a side stream, as torch requires, and the capture
    on that same stream: per-stream state such as `launch.tile_counters` is made eagerly there, a
    capture cannot allocate it)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        for c in calls:
            c()
    torch.cuda.synchronize()
    return timeit(g.replay, iters=reps, warmup=2) / len(calls)


def rel_err(got, want) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm()).item()


# ---- jobs: each returns (check message or "", timing callable list or None) --------------------

def runner(spec):
    """out <- x @ W^T through the FP8 decode path `spec` (a DSV41_FP8_DECODE value)."""
    from dsv41.npu_ops.triton import block_linear as bl

    path, tiles = bl.parse_fp8_decode(spec)
    tiles.pop("max_m", None)

    def run(x, w, s, out):
        if path == "fold":
            bl.launch_linear(x, w, s, out, path="fold")
        elif path == "rows" and x.shape[0] == 1:
            bl._launch_row_gemv(x, w, s, out, **tiles)
        elif path == "rows":
            bl._launch_fold_xs(x, w, s, out, place=False)
        elif path in MMA:
            bl._launch_fp8_mma(x, w, s, out, f16=path == "fp16mma", **tiles)
        else:
            bl._launch_fold_xs(x, w, s, out, place=path == "place", **tiles)
    return run


def fp32_error_job(spec, m):
    """The path's fp32-output relative error against the reference at wo_b's shape (K = 8192)."""
    from dsv41.backends.reference.basic import fp32_accumulation
    from dsv41.backends.reference.basic import linear as linear_ref

    _, n, k = max(LINEARS, key=lambda row: row[2])
    w, s = quant.fp8_block_quant(torch.randn(n, k, device=DEV) * k ** -0.5)
    x = (torch.randn(m, k, device=DEV) * 2).to(torch.bfloat16)
    out = torch.empty(m, n, dtype=torch.float32, device=DEV)
    runner(spec)(x, w, s, out)
    with fp32_accumulation():
        want = linear_ref(x, w, s, torch.float32)
    return rel_err(out, want)


def linear_job(name, n, k, m, spec, timed):
    """One FP8 linear variant: checked against the fp32-accumulating reference (bf16 output, the
    model's), then (timed) the call list cycling weight copies."""
    from dsv41.backends.reference.basic import fp32_accumulation
    from dsv41.backends.reference.basic import linear as linear_ref
    from dsv41.npu_ops.triton import block_linear as bl

    path, tiles = bl.parse_fp8_decode(spec)

    run = runner(spec)

    w, s = quant.fp8_block_quant(torch.randn(n, k, device=DEV) * k ** -0.5)
    x = (torch.randn(m, k, device=DEV) * 2).to(torch.bfloat16)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
    run(x, w, s, out)
    with fp32_accumulation():
        want = linear_ref(x, w, s)
    err = rel_err(out, want)
    msg = "" if err < 4e-3 and torch.isfinite(out).all() else f"rel err {err:.2e}"
    if not timed or msg:
        return msg, None
    return msg, [lambda w=w, s=s: run(x, w, s, out) for w, s in weight_copies(n, k)]


_COPIES: dict = {}


def weight_copies(n: int, k: int) -> list:
    """Enough random FP8 weights [n, k] (with scales) to exceed the L2 when cycled: one set per
    shape, shared by every variant timed on it."""
    if (n, k) not in _COPIES:
        copies = max(1, min(24, math.ceil(L2_CYCLE_BYTES / (n * k))))
        _COPIES[(n, k)] = [quant.fp8_block_quant(torch.randn(n, k, device=DEV) * k ** -0.5) for _ in range(copies)]
    return _COPIES[(n, k)]


def every_code_job(spec):
    """Every E4M3 code through the path, bit for bit against the reference, NaN codes NaN."""
    from dsv41.backends.reference.basic import linear as linear_ref
    from dsv41.npu_ops.triton import block_linear as bl

    path, _ = bl.parse_fp8_decode(spec)
    codes = torch.zeros(256, 64, dtype=torch.uint8)
    codes[:, 0] = torch.arange(256, dtype=torch.uint8)
    w = codes.view(torch.float8_e4m3fn)
    s = torch.full((8, 2), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    x[0, 0] = 1.0
    want = linear_ref(x, w, s, torch.float32)
    got = bl.linear(x.to(DEV), w.to(DEV), s.to(DEV), torch.float32, path=path).cpu()
    ok = ~want.isnan()
    # (the interpreter's own fp8 cast reads the NaN codes as +-480: NaN checked where it is real)
    nan_same = torch.equal(got.isnan(), want.isnan()) or (DEV == "cpu" and path != "place")
    same = nan_same and torch.equal(got[ok].view(torch.int32),
                                                                  want.float()[ok].view(torch.int32))
    return "" if same else "not bit-exact on all 256 codes", None


def mhc_job(op, t, mode, timed):
    """mhc_mix (with the next coefficients) or mhc_mixes at t tokens in one DSV41_MHC_COEF mode,
    against the reference's coefficients (rtol / atol 1e-3, the tests' full-reference bound)."""
    from dsv41.npu_ops.triton import mega_mhc as mm
    from dsv41.npu_ops.triton import mhc_mixes as mx

    n, dim, its = CFG.hc_mult, D, CFG.hc_sinkhorn_iters
    fn = torch.randn((2 + n) * n, n * dim, device=DEV) * (n * dim) ** -0.5
    scale, base = torch.rand(3, device=DEV) + 0.5, torch.randn((2 + n) * n, device=DEV) * 0.5
    x = torch.randn(t, n, dim, device=DEV).to(torch.bfloat16)
    y = torch.randn(t, dim, device=DEV).to(torch.bfloat16)
    post, pre = torch.rand(t, n, device=DEV) * 2, torch.rand(t, n, device=DEV)
    comb = torch.softmax(torch.randn(t, n, n, device=DEV), -1)
    mode, early = mode.split("+")[0], mode.endswith("+early")  # "+early": mega_mhc's EARLY_LOADS
    fused, narrow = mode.startswith("fused"), mode.endswith("narrow")
    nw = torch.rand(dim, device=DEV) + 0.5

    def call():
        mm._COEF_MODE[:] = [(fused, narrow)]
        if op == "mhc_mix_norm":  # the model's form: the next sublayer's norm in the epilogue
            return mm.mhc_mix(x, y, post, comb, pre, fn, scale, base, 1e-20, 1e-6, its, norm=(nw, 1e-6),
                              early=early)
        if op == "mhc_mix":
            return mm.mhc_mix(x, y, post, comb, pre, fn, scale, base, 1e-20, 1e-6, its, early=early)
        return mx.mhc_mixes(x, fn, scale, base, 1e-20, 1e-6, its)

    got = call()
    if op == "mhc_mix_norm":
        wn = registry.resolve("rms_norm", "reference")[0](got[1], nw, 1e-6)
        if rel_err(got[3], wn) > 4e-3:
            return "rms_norm(x_hat) off the reference", None
    if op.startswith("mhc_mix") and op != "mhc_mixes":
        want = registry.resolve("mhc_mix", "reference")[0](x, y, post, comb, pre, fn, scale, base, 1e-20, 1e-6, its)
        coefs, wcoefs = got[2], want[2]
        ok = rel_err(got[0], want[0]) < 4e-3
    else:
        wcoefs = registry.resolve("mhc_mixes", "reference")[0](x, fn, scale, base, 1e-20, 1e-6, its)
        coefs, ok = got, True
    for a, b in zip(coefs, wcoefs):
        ok = ok and bool(torch.isfinite(a).all()) and torch.allclose(a.double(), b.double(), rtol=1e-3, atol=1e-3)
    msg = "" if ok else "coefficients off the reference"
    return msg, ([call] if timed and not msg else None)


def route_job(t, mode, timed):
    """moe_route at t tokens over the mini preset's experts: ids equal to the fp64 reference on
    rows without near-ties, weights within rtol 1e-5."""
    import torch.nn.functional as F

    from dsv41.npu_ops.triton import moe_route as mr

    e, k = CFG.n_routed_experts, CFG.num_experts_per_tok
    x = (torch.randn(t, D, device=DEV) * 0.5).to(torch.bfloat16)
    w = (torch.randn(e, D, device=DEV) * D ** -0.5).to(torch.bfloat16)
    bias = torch.randn(e, device=DEV) * 0.1

    def call():
        return mr.moe_route(x, w, bias, k, 2.5, 1.0, _cfg="small" if mode == "small" else None)

    mr._ROUTE_MODE[:] = ["tiled"]
    gw, gi = call()
    ww, wi = mr.moe_route_ref(x.cpu(), w.cpu(), bias.cpu(), k, 2.5, 1.0)
    c = (torch.sqrt(F.softplus(x.cpu().double() @ w.cpu().double().t())) + bias.cpu().double())
    c = c.sort(-1, descending=True).values[:, : k + 1]
    sep = ((c[:, :-1] - c[:, 1:]) > 1e-4).all(-1)
    ok = torch.equal(gi.cpu()[sep], wi[sep]) and torch.allclose(gw.cpu()[sep], ww[sep], rtol=1e-5, atol=1e-7)
    msg = "" if ok else "ids / weights off the reference"
    return msg, ([call] if timed and not msg else None)


def jobs():
    """Every (key, thunk(timed)) in a fixed order (the warm parts split this list)."""
    out = []
    for mode in sorted({spec.split(":")[0] for _, spec in LIN_VARIANTS}):
        out.append((("code", mode), lambda timed, mode=mode: every_code_job(mode)))
    for label, spec in LIN_VARIANTS:
        for m in (1, 8) if ROUTE_T else (1,):  # (--rows: the one-row error of "xscale" and "rows" only)
            if not ROUTE_T and label not in ("xscale", "rows"):
                continue
            out.append((("fp32err", label, m), lambda timed, spec=spec, m=m: ("", fp32_error_job(spec, m))))
    for m in lin_rows():
        for name, n, k in LINEARS:
            for label, spec in LIN_VARIANTS:
                if not runs_at(spec, m):
                    continue
                out.append((("linear", name, m, label),
                            lambda timed, name=name, n=n, k=k, m=m, spec=spec: linear_job(name, n, k, m, spec, timed)))
    for op in MHC_OPS if MHC_T else ():
        for t in MHC_T:
            for mode in MHC_MODES:
                out.append((("mhc", op, t, mode), lambda timed, op=op, t=t, mode=mode: mhc_job(op, t, mode, timed)))
    for t in ROUTE_T:
        for mode in ROUTE_MODES:
            out.append((("route", t, mode), lambda timed, t=t, mode=mode: route_job(t, mode, timed)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--warm", action="store_true", help="checks only (compiles), no timing")
    ap.add_argument("--part", default="0/1", help="i/n: run every n-th job from the i-th")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpreter, checks only")
    ap.add_argument("--rows", action="store_true",
                    help="the FP8 linears only, the one-row kernel and xscale tile variants (no mHC / router)")
    a = ap.parse_args()
    if a.rows:
        global LIN_VARIANTS, LIN_M, MHC_T, ROUTE_T, BIG_M, MHC_MODES, MHC_OPS
        LIN_VARIANTS, MHC_T, ROUTE_T, BIG_M = LIN_VARIANTS_ROWS, (1, 2), (), None
        MHC_MODES, MHC_OPS = ("narrow", "narrow+early"), ("mhc_mix_norm", "mhc_mix")
        LIN_M = LIN_M[:1]
        if a.smoke:
            LIN_VARIANTS = [v for v in LIN_VARIANTS if not v[1].startswith("xscale:bk=256")]  # K < 256 there
    if a.smoke:
        import os

        os.environ["TRITON_INTERPRET"] = "1"
        smoke_shapes()
        a.warm = True
    elif not torch.cuda.is_available():
        print("benchmarks/dense_ab.py needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(20261201)
    i, n = (int(v) for v in a.part.split("/"))
    res: dict = {}
    failed = []
    for key, thunk in jobs()[i::n]:
        try:
            msg, calls = thunk(not a.warm)
        except Exception as e:  # noqa: BLE001  (a failing variant is reported, the others still run)
            msg, calls = f"{type(e).__name__}: {str(e)[:120]}", None
        if msg:
            failed.append(key)
            print(f"CHECK FAILED {key}: {msg}", flush=True)
            continue
        if key[0] == "fp32err":
            res[key] = calls  # the error itself
            print(f"{key}: fp32-output rel err {calls:.2e}", flush=True)
        elif calls:
            res[key] = graph_median(calls)
            print(f"timed {key}: {res[key] * 1e6:.1f} us", flush=True)  # (kept if the run is cut short)
    if a.warm:
        print(f"warm part {a.part}: {len(failed)} failed", flush=True)
        return 1 if failed else 0
    return report(res, failed)


def lin_rows() -> tuple:
    """The row counts of the FP8 table: LIN_M, then BIG_M (if set)."""
    return LIN_M + ((BIG_M,) if BIG_M else ())


def runs_at(spec: str, m: int) -> bool:
    """Whether variant `spec` is its own kernel at m rows: "rows" only at one row (more take
    "xscale"), xscale / place up to 8 rows."""
    if spec.startswith("rows"):
        return m == 1
    return m <= 8 or spec.startswith(("fold",) + MMA)


def big_labels() -> list[str]:
    return [lbl for lbl, spec in LIN_VARIANTS if spec.startswith(("fold",) + MMA)]


def lin_choice(tot: dict, big: dict) -> str:
    """The DSV41_FP8_DECODE value of the least 1-8 row total; an MMA winner keeps its rows up to
    64 only where it also beats fold there (else maxm=8)."""
    best = min(tot, key=tot.get)
    if tot[best] == math.inf:
        return "fold"
    spec = dict(LIN_VARIANTS)[best]
    if spec.startswith(MMA) and not big[best] < big["fold"]:
        spec += ("," if ":" in spec else ":") + "maxm=8"
    return spec


def report(res: dict, failed: list) -> int:
    """The tables (us per call) and the DENSE7_ENV line: per switch the setting with the least
    summed time over its shapes, among settings that passed every check."""
    bad = set(failed)
    labels = [lbl for lbl, _ in LIN_VARIANTS]
    print("\n| FP8 linear (us, graph) | M | " + " | ".join(labels) + " |")
    print("|---|---|" + "---|" * len(labels))
    tot = {lbl: 0.0 for lbl in labels}
    big = {lbl: 0.0 for lbl in labels}
    specs = dict(LIN_VARIANTS)
    for m in lin_rows():
        for name, n, k in LINEARS:
            cells = []
            for lbl in labels:
                v = res.get(("linear", name, m, lbl))
                if not runs_at(specs[lbl], m):
                    cells.append("-")
                    continue
                cells.append(f"{v * 1e6:.1f}" if v else "FAIL")
                (big if m > 8 else tot)[lbl] += v if v else math.inf
            floor = n * k * (1 + 1 / 1024) / 4.0e12 * 1e6
            print(f"| {name} {n}x{k} (floor {floor:.1f} at 4 TB/s) | {m} | " + " | ".join(cells) + " |")
    for m in lin_rows():
        sums = [sum(res.get(("linear", name, m, lbl), math.inf) for name, _, _ in LINEARS) for lbl in labels]
        print(f"| sum | {m} | " + " | ".join(f"{v * 1e6:.1f}" if runs_at(specs[lbl], m) else "-"
                                             for v, lbl in zip(sums, labels)) + " |")
    if ROUTE_T == ():  # --rows: the one-row winners per shape and the mHC load order, no switch line
        for name, n, k in LINEARS:
            cands = {lbl: res.get(("linear", name, 1, lbl), math.inf) for lbl in labels}
            best = min(cands, key=cands.get)
            print(f"one row, {name}: fastest {best} {cands[best] * 1e6:.1f} us (xscale "
                  f"{cands.get('xscale', math.inf) * 1e6:.1f})")
        print("\n| mHC (us, graph) | T | " + " | ".join(MHC_MODES) + " |")
        print("|---|---|" + "---|" * len(MHC_MODES))
        for op in MHC_OPS:
            for t in MHC_T:
                vals = [res.get(("mhc", op, t, mode)) for mode in MHC_MODES]
                print(f"| {op} | {t} | " + " | ".join(f"{v * 1e6:.1f}" if v else "FAIL" for v in vals) + " |")
        if failed:
            print(f"\n{len(failed)} checks failed: {failed}")
        return 0
    print("| sum | 1,4,8 | " + " | ".join(f"{tot[lbl] * 1e6:.1f}" for lbl in labels) + " |")
    print(f"| sum | {BIG_M} | " + " | ".join(f"{big[lbl] * 1e6:.1f}" if lbl in big_labels() else "-"
                                          for lbl in labels) + " |")
    errs = {lbl: max(res.get(("fp32err", lbl, m), math.inf) for m in (1, 8)) for lbl in labels}
    print("| fp32-output rel err (wo_b, M=1/8) | | " + " | ".join(f"{errs[lbl]:.1e}" for lbl in labels) + " |")
    allowed = dict(tot)
    for lbl, spec in LIN_VARIANTS:
        mode = spec.split(":")[0]
        if ("code", mode) in bad or any(f[0] == "linear" and f[3] == lbl and f[2] <= 8 for f in bad):
            tot[lbl] = allowed[lbl] = math.inf
        if not errs[lbl] <= FP32_BOUND:  # another numerics class: never the default on timing alone
            allowed[lbl] = math.inf
    lin = lin_choice(allowed, big)
    if lin_choice(tot, big) != lin:
        print(f"\nfastest if its numerics are accepted (fp32 error above {FP32_BOUND:.0e}): "
              f"DSV41_FP8_DECODE={lin_choice(tot, big)}")

    print("\n| mHC | T | " + " | ".join(MHC_MODES) + " |")
    print("|---|---|" + "---|" * len(MHC_MODES))
    mt = {mode: 0.0 for mode in MHC_MODES}
    for op in MHC_OPS:
        for t in MHC_T:
            vals = [res.get(("mhc", op, t, mode)) for mode in MHC_MODES]
            for mode, v in zip(MHC_MODES, vals):
                mt[mode] += v if v else math.inf
            print(f"| {op} | {t} | " + " | ".join(f"{v * 1e6:.1f}" if v else "FAIL" for v in vals) + " |")
    mhc = min(mt, key=mt.get) if min(mt.values()) < math.inf else "split"

    print(f"\n| moe_route E={CFG.n_routed_experts} | T | " + " | ".join(ROUTE_MODES) + " |")
    print("|---|---|" + "---|" * len(ROUTE_MODES))
    rt = {mode: 0.0 for mode in ROUTE_MODES}
    for t in ROUTE_T:
        vals = [res.get(("route", t, mode)) for mode in ROUTE_MODES]
        for mode, v in zip(ROUTE_MODES, vals):
            rt[mode] += v if v else math.inf
        print(f"| moe_route | {t} | " + " | ".join(f"{v * 1e6:.1f}" if v else "FAIL" for v in vals) + " |")
    route = min(rt, key=rt.get) if min(rt.values()) < math.inf else "tiled"
    if failed:
        print(f"\n{len(failed)} checks failed: {failed}")
    print(f"\nDENSE7_ENV=DSV41_FP8_DECODE={lin} DSV41_MHC_COEF={mhc} DSV41_MOE_ROUTE={route}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
