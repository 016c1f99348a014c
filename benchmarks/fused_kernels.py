"""The fused decode-path ops against the compositions they replace, at a preset's shapes, on CUDA.

    python benchmarks/fused_kernels.py --preset mini [--tokens 1 8 64] [--out fused.md]

Per op and token count: the fused CUDA launch and the composition of the CUDA ops it stands for
(`backends/fused.py`, `backends/paging.*_torch`), each captured several times in one CUDA graph
and replayed (GPU time per call, launch gaps included: what a decode graph pays), with the maximum
difference of their outputs. `unrope_grouped_linear` is timed with its fused GEMV forced on
(`MAX_WEIGHT_BYTES=None`): from two tokens the row says whether raising that limit pays at this
width (one token takes the rows kernel, which has no limit). The mHC
ops are timed twice: with the coefficient epilogue as its own launch (the shipped setting) and
inside the main kernel (DSV41_MHC_COEF=fused-narrow, one launch per mix): the rows decide that switch.
`linear_pair` runs on weights stacked as the loader stacks them (one linear), against the two
linears apart.
Correctness is the tests' business (tests/test_triton_fused.py); this only times.
"""

from __future__ import annotations

import argparse
import sys

import torch


def graph_time_us(fn) -> str:
    """GPU microseconds per call of `fn` replayed from a CUDA graph (`benchmarks/ops.py`)."""
    from ops import graph_time  # benchmarks/ops.py (this script's folder is on sys.path)

    t = graph_time(fn)
    return "n/a" if t is None else f"{t * 1e6:.1f}"


def flat(out) -> list:
    """The tensors of an op's output (nested tuples flattened, None dropped)."""
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in flat(o)]
    return [] if out is None else [out]


def cases(cfg, t: int, dev: torch.device):
    """(name, fused call, composition call) at the attention's shapes for t tokens."""
    from dsv41.backends import fused, paging
    from dsv41.backends.rope_tables import rope_tables as torch_tables
    from dsv41.npu_ops.triton import indexer_queries as iq
    from dsv41.npu_ops.triton import mega_mhc
    from dsv41.npu_ops.triton import mhc_mix_norm as mn
    from dsv41.npu_ops.triton import rope as rp
    from dsv41.npu_ops.triton import rope_store_key as rk
    from dsv41.npu_ops.triton import rope_store_kv as rs
    from dsv41.npu_ops.triton import table_rows as tr
    from dsv41.npu_ops.triton import unrope_grouped_linear as ug

    g = torch.Generator(device=dev).manual_seed(0)
    h, d, r = cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim
    di, groups, ro = cfg.index_head_dim, cfg.o_groups, cfg.o_lora_rank
    bf = torch.bfloat16
    q = torch.randn(t, h, d, device=dev, generator=g).to(bf)
    kv = torch.randn(t, d, device=dev, generator=g).to(bf)
    key = torch.randn(t, di, device=dev, generator=g).to(bf)
    ang = torch.randn(t, r // 2, device=dev, generator=g)
    cos, sin = ang.cos(), ang.sin()
    w, wk = torch.ones(d, dtype=bf, device=dev), torch.ones(di, dtype=bf, device=dev)
    n_rows = 4096
    pool = (torch.zeros(n_rows, d, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn),
            torch.zeros(n_rows, d // 32, dtype=torch.uint8, device=dev).view(torch.float8_e8m0fnu))
    keys = (torch.zeros(n_rows, di // 2, dtype=torch.uint8, device=dev),
            torch.zeros(n_rows, di // 32, dtype=torch.uint8, device=dev).view(torch.float8_e8m0fnu))
    rows = torch.randperm(n_rows, device=dev)[:t]
    wo_a = (torch.randn(groups * ro, h * d // groups, device=dev, generator=g) * 0.02).to(bf)
    table = torch.randint(1, n_rows // 16, (t, 256), device=dev)
    idx = torch.randint(-1, 256 * 16, (t, cfg.index_topk), device=dev)
    pos = torch.randint(0, 1 << 16, (t,), device=dev)
    floor = torch.zeros(t, dtype=torch.long, device=dev)
    inv = torch.rand(r // 2, device=dev) * 0.1
    w_ = cfg.sliding_window

    iqs = torch.randn(t, cfg.index_n_heads, di, device=dev, generator=g).to(bf)  # indexer queries
    iw = torch.randn(t, cfg.index_n_heads, device=dev, generator=g)
    # the mHC step at the model width: streams, sublayer output, this and the next coefficients
    n, hd = cfg.hc_mult, cfg.hidden_size
    xs = torch.randn(t, n, hd, device=dev, generator=g).to(bf)
    ys = torch.randn(t, hd, device=dev, generator=g).to(bf)
    post, pre = torch.rand(t, n, device=dev, generator=g) * 2, torch.rand(t, n, device=dev, generator=g)
    comb = torch.softmax(torch.randn(t, n, n, device=dev, generator=g), -1)
    fn = torch.randn((2 + n) * n, n * hd, device=dev, generator=g) * (n * hd) ** -0.5
    sc, base = torch.rand(3, device=dev, generator=g) + 0.5, torch.randn((2 + n) * n, device=dev, generator=g)
    nw = torch.ones(hd, dtype=bf, device=dev)
    mix = (xs, ys, post, comb, pre, fn, sc, base, 1e-20, 1e-6, 20, nw, 1e-6)
    enter = (xs, pre, fn, sc, base, 1e-20, 1e-6, 20, nw, 1e-6)

    # linear_pair: the attention's wq_a / wkv and the shared expert's w1 / w3 (FP8, random codes of
    # either sign below 448, block scales near 1) and the compressor's bf16 wkv / wgate (fp32 out),
    # stacked as the loader stacks them (one linear), against the two linears apart
    from dsv41.npu_ops.triton import block_linear as bl

    def fp8_weight(n_out: int, k_in: int):
        codes = torch.randint(0, 0x7E, (n_out, k_in), device=dev, generator=g, dtype=torch.int32)
        codes |= torch.randint(0, 2, (n_out, k_in), device=dev, generator=g, dtype=torch.int32) << 7
        sc8 = torch.randint(120, 124, (-(-n_out // 32), -(-k_in // 32)), device=dev, generator=g, dtype=torch.int32)
        return codes.to(torch.uint8).view(torch.float8_e4m3fn), sc8.to(torch.uint8).view(torch.float8_e8m0fnu)

    def stacked(a, b):
        """(w_a, s_a, w_b, s_b): b's rows and scale rows after a's in one allocation each
        (`core.weights.stack_linears`' layout)."""
        def cat(u, v):
            return None if u is None else torch.cat([u.view(torch.uint8), v.view(torch.uint8)]).view(u.dtype)
        w, s = cat(a[0], b[0]), cat(a[1], b[1])
        n, ns = a[0].shape[0], (None if a[1] is None else a[1].shape[0])
        return w[:n], (None if s is None else s[:ns]), w[n:], (None if s is None else s[ns:])

    def apart(pair):
        """The two linears of a pair (x, w_a, s_a, w_b, s_b[, out dtype]), one after the other."""
        x, w_a, s_a, w_b, s_b, *odt = pair
        return lambda: (bl.linear(x, w_a, s_a, *odt), bl.linear(x, w_b, s_b, *odt))

    def bf16_weight(n_out: int, k_in: int):
        return (torch.randn(n_out, k_in, device=dev, generator=g) * k_in ** -0.5).to(bf), None

    xh = torch.randn(t, hd, device=dev, generator=g).to(bf)
    inter = cfg.moe_intermediate_size
    attn_pair = (xh, *stacked(fp8_weight(cfg.q_lora_rank, hd), fp8_weight(d, hd)))
    shared_pair = (xh, *stacked(fp8_weight(inter, hd), fp8_weight(inter, hd)))
    comp_pair = (xh, *stacked(bf16_weight(d, hd), bf16_weight(d, hd)), torch.float32)

    def coef_inside(call):
        """`call` with the coefficient epilogue inside the main mHC kernel (the process's narrow
        setting kept)."""
        def run():
            saved = list(mega_mhc._COEF_MODE)
            mega_mhc._COEF_MODE[:] = [(True, mega_mhc.coef_mode()[1])]
            try:
                return call()
            finally:
                mega_mhc._COEF_MODE[:] = saved
        return run

    def unrope_fused():
        saved, ug.MAX_WEIGHT_BYTES = ug.MAX_WEIGHT_BYTES, None
        try:
            return ug.unrope_grouped_linear(q, cos, sin, wo_a, groups)
        finally:
            ug.MAX_WEIGHT_BYTES = saved

    return [
        ("rope_store_kv", lambda: rs.rope_store_kv(q, kv, w, 1e-6, cos, sin, *pool, rows),
         lambda: fused.rope_store_kv(q, kv, w, 1e-6, cos, sin, *pool, rows)),
        ("rope_store_key", lambda: rk.rope_store_key(key, wk, 1e-6, cos, sin, *keys, rows),
         lambda: fused.rope_store_key(key, wk, 1e-6, cos, sin, *keys, rows)),
        ("unrope_grouped_linear", unrope_fused, lambda: fused.unrope_grouped_linear(q, cos, sin, wo_a, groups)),
        ("table_rows (top-k)", lambda: tr.table_rows(table, 16, idx), lambda: paging.table_rows_torch(table, 16, idx)),
        ("window_rows", lambda: tr.window_rows(table, 16, pos - w_ + 1, pos, floor, w_),
         lambda: paging.window_rows_torch(table, 16, pos - w_ + 1, pos, floor, w_)),
        ("rope_tables", lambda: rp.rope_tables(inv, pos), lambda: torch_tables(inv, pos)),
        ("indexer_queries", lambda: iq.indexer_queries(iqs, cos, sin, iw, 0.01),
         lambda: fused.indexer_queries(iqs, cos, sin, iw, 0.01)),
        ("linear_pair (wq_a / wkv, FP8, stacked)", lambda: bl.linear_pair(*attn_pair), apart(attn_pair)),
        ("linear_pair (shared w1 / w3, FP8, stacked)", lambda: bl.linear_pair(*shared_pair), apart(shared_pair)),
        ("linear_pair (compressor wkv / wgate, bf16 -> fp32, stacked)", lambda: bl.linear_pair(*comp_pair),
         apart(comp_pair)),
        ("mhc_mix_norm", lambda: mn.mhc_mix_norm(*mix), lambda: fused.mhc_mix_norm(*mix)),
        ("mhc_mix_norm (coefficients fused)", coef_inside(lambda: mn.mhc_mix_norm(*mix)),
         coef_inside(lambda: fused.mhc_mix_norm(*mix))),
        ("mhc_enter_norm", lambda: mn.mhc_enter_norm(*enter), lambda: fused.mhc_enter_norm(*enter)),
        ("mhc_enter_norm (coefficients fused)", coef_inside(lambda: mn.mhc_enter_norm(*enter)),
         coef_inside(lambda: fused.mhc_enter_norm(*enter))),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--out", help="also write the table to this markdown file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device (the fused kernels' launch counts are measured on CPU by benchmarks/launches.py)")
        return 2
    from dsv41.backends import registry
    from dsv41.core.config import preset

    registry.ensure_backend_loaded("cuda")
    cfg = preset(args.preset)
    dev = torch.device("cuda")
    lines = [f"# Fused decode ops vs their compositions ({args.preset}, {torch.cuda.get_device_name()})", "",
             "| op | tokens | fused us | composition us | max abs diff |", "|---|---|---|---|---|"]
    for t in args.tokens:
        for name, fast, slow in cases(cfg, t, dev):
            a, b = fast(), slow()
            diff = "-" if a is None else f"{max((x.float() - y.float()).abs().max().item() for x, y in zip(flat(a), flat(b))):.3g}"  # noqa: E501
            lines.append(f"| {name} | {t} | {graph_time_us(fast)} | {graph_time_us(slow)} | {diff} |")
            print(lines[-1], flush=True)
    if args.out:
        with open(args.out + ".tmp", "w") as f:
            f.write("\n".join(lines) + "\n")
        import os

        os.replace(args.out + ".tmp", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
