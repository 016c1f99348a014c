"""Registers and spills of Triton kernels compiled for the H200 (sm_90a) on a machine without
a GPU: each kernel is compiled ahead of time by upstream Triton (no driver needed) and its PTX
assembled by the ptxas that ships with Triton (`ptxas -v`). Integer arguments named in
DIVISIBLE and every pointer are marked divisible by 16, as Triton's launcher specialises them
at run time (without the hint, loads are compiled per byte and the counts mislead).

    python benchmarks/ptxas_usage.py [--only sparse,indexer]

A check of static resource use (spill = local-memory traffic in the loop), not a timing.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile

DIVISIBLE = {"w_stride", "ws_stride", "g_stride", "gs_stride", "H", "S", "K"}


def ptxas_usage(fn, pointers: dict[str, str], constexprs: dict, num_warps: int, num_stages: int = 1,
                floats: tuple[str, ...] = ("scale",)) -> str:
    """ptxas's register / spill lines for `fn` (a triton.jit function) compiled for sm_90a:
    `pointers` maps pointer arguments to Triton types ("*fp32", "*i8", ...), `constexprs` the
    compile-time arguments; the other arguments are i32 (or fp32 when named in `floats`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    # compile-time parameters left out take their defaults (as a launch that omits them does)
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **constexprs}
    sig = {n: pointers[n] if n in pointers else "constexpr" if n in constexprs else "fp32" if n in floats else "i32"
           for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if (n in pointers or n in DIVISIBLE) and n not in constexprs}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                                 num_stages=num_stages))
    ptxas = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))[0]
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True, check=True)
    return " | ".join(line.split(":", 1)[-1].strip() for line in r.stderr.splitlines()
                      if "registers" in line or "spill" in line)


def sparse_rows() -> list[tuple[str, str]]:
    """The sparse attention tile tables (real widths: 64 heads of 512)."""
    from dsv41.npu_ops.triton import sparse_attention as sa

    ptrs = {"q_ptr": "*bf16", "win_ptr": "*i8", "wsc_ptr": "*i8", "widx_ptr": "*i64", "gkv_ptr": "*i8",
            "gsc_ptr": "*i8", "gidx_ptr": "*i64", "sink_ptr": "*fp32", "out_ptr": "*bf16", "pacc_ptr": "*fp32",
            "pm_ptr": "*fp32", "pl_ptr": "*fp32"}
    rows = []
    for key in ("cuda", "cuda_mqa", "cuda_decode"):
        cfg = sa.CONFIGS[key]
        bd, bdv = cfg["BLOCK_D"] or 512, cfg["BLOCK_DV"] or 512
        split = cfg["min_blocks_per_split"] == 1  # the decode tables run split
        if cfg.get("MQA"):  # pools as 32-bit words
            consts = dict(D=512, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], SPLIT=split, DOT_BF16=True,
                          AHEAD=cfg.get("AHEAD", True), LAZY=cfg.get("LAZY", 0.0))
            ptrs = dict(ptrs, win_ptr="*i32", gkv_ptr="*i32")
            fn = sa._mqa_kernel
        else:
            consts = dict(D=512, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=bd, BLOCK_DV=bdv, SPLIT=split,
                          DOT_BF16=True, QK_T=False, DV_HALF=False)
            fn = sa._sparse_attn_kernel
        rows.append((f"sparse_attention {key}", ptxas_usage(fn, ptrs, consts, cfg["num_warps"], cfg["num_stages"])))
    from dsv41.npu_ops.triton import sparse_attention_rows as sar

    cfg = sa.CONFIGS["cuda_prefill"]  # the rows form's attention kernel (bf16 table rows)
    consts = dict(D=512, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["num_stages"], DOT_BF16=True)
    rows.append(("sparse_attention cuda_prefill (rows form)", ptxas_usage(
        sar._rows_attn_kernel, {"q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i32", "sink_ptr": "*fp32",
                                "out_ptr": "*bf16"}, consts, cfg["num_warps"], cfg["num_stages"])))
    return rows


def indexer_rows() -> list[tuple[str, str]]:
    """The indexer's selection kernels at the mini preset's top-512 (dense, Reindex, pool)."""
    from dsv41.npu_ops.triton import indexer_topk as itk

    sel = {"s_ptr": "*fp32", "max_ptr": "*fp32", "nvis_ptr": "*i64", "out_ptr": "*i64", "chunk_ptr": "*i32",
           "surv_s_ptr": "*fp32", "surv_p_ptr": "*i32", "cand_ptr": "*i64", "stage_ptr": "*i64"}
    rows = []
    for mapped, use_max, cb in ((False, True, 1), (False, False, 1), (True, False, 1), (True, False, 8)):
        consts = dict(MAXG=8 if use_max else 1, CAP=itk.SELECT_CAPACITY, USE_MAX=use_max, BLOCK=itk.SELECT_BLOCK,
                      RADIX_BITS=itk.RADIX_BITS, MAP=mapped, KP=512, RB=itk.SORT_ROWS,
                      SBLOCK=itk.SELECT_SURVIVOR_BLOCK or itk.SELECT_BLOCK, BOUND_PASSES=itk.SELECT_BOUND_PASSES,
                      SPAN=itk.SELECT_SPAN, CB=cb, MAP_NV=cb > 1)
        cand = dict(sel, cand_ptr="*i32") if cb > 1 else sel  # (the pool's int32 block ids)
        rows.append((f"topk_select MAP={mapped} USE_MAX={use_max}" + (f" candidate blocks of {cb}" if cb > 1 else ""),
                     ptxas_usage(itk._topk_select_kernel, cand, consts, itk.SELECT_WARPS, floats=())))
    for bits in itk.RADIX_BITS_CHOICES:
        consts = dict(MAXG=16, CAP=itk.SELECT_CAPACITY, USE_MAX=True, BLOCK=itk.SELECT_BLOCK, RADIX_BITS=bits,
                      MAP=False, KP=512, RB=itk.SORT_ROWS, SBLOCK=itk.SELECT_SURVIVOR_BLOCK or itk.SELECT_BLOCK,
                      BOUND_PASSES=0, SPAN=False)
        rows.append((f"topk_select USE_MAX MAXG=16 RADIX_BITS={bits}",
                     ptxas_usage(itk._topk_select_kernel, sel, consts, itk.SELECT_WARPS, floats=())))
    consts = dict(MAXG=16, CAP=itk.SELECT_CAPACITY, USE_MAX=True, BLOCK=itk.SELECT_BLOCK, RADIX_BITS=itk.RADIX_BITS,
                  MAP=False, KP=512, RB=itk.SORT_ROWS, SBLOCK=itk.SELECT_SURVIVOR_BLOCK, BOUND_PASSES=3, SPAN=True)
    rows.append(("topk_select USE_MAX MAXG=16 bound 3 passes, span",
                 ptxas_usage(itk._topk_select_kernel, sel, consts, itk.SELECT_WARPS, floats=())))
    split = {"s_ptr": "*fp32", "max_ptr": "*fp32", "nvis_ptr": "*i64", "out_ptr": "*i64", "surv_s_ptr": "*fp32",
             "surv_p_ptr": "*i32", "part_ptr": "*i32", "count_ptr": "*i32", "cand_ptr": "*i32", "stage_ptr": "*i64",
             "pool_ptr": "*i32", "work_ptr": "*fp32"}
    # (MAXG 16: 8 maxima per k at 64K / top-512, the default; 64: 2 per k, the option; merge: the
    # bound over merged neighbouring maxima, the launcher's default without span passes)
    for parts, maxg, span, warps, merge in ((16, 16, False, itk.SPLIT_WARPS, itk.SPLIT_BOUND_MERGE),
                                            (32, 16, False, itk.SPLIT_WARPS, itk.SPLIT_BOUND_MERGE),
                                            (32, 16, False, itk.SPLIT_WARPS, 1),
                                            (16, 16, True, itk.SPLIT_WARPS, 1),
                                            (16, 16, False, 8, itk.SPLIT_BOUND_MERGE),
                                            (32, 64, False, itk.SPLIT_WARPS, itk.SPLIT_BOUND_MERGE)):
        consts = dict(MAXG=maxg, MBLOCK=min(itk.SELECT_BLOCK, 65536 // maxg),
                      SBLOCK=min(itk.SELECT_BLOCK, 65536 // parts), FBLOCK=itk.SPLIT_FINAL_BLOCK,
                      BLOCK=itk.SELECT_BLOCK, PP=parts, RADIX_BITS=itk.RADIX_BITS, SPAN=span, MERGE=merge,
                      PER_K=itk.SPLIT_BOUND_PER_K)
        rows.append((f"split select MAXG={maxg} parts={parts} span={span} warps={warps} merge={merge} (64K entries)",
                     ptxas_usage(itk._split_select_kernel, split, consts, warps, floats=())))
    # the Reindex selection (MAP: 8192 candidate columns in blocks of 4, maxima of 2) and the pool
    # source's select with the candidate pool beside it (POOL: 32K entries, maxima of 4-entry blocks)
    # (MBLOCK 8192: the merged bound over 8192 maxima on one tile, SPLIT_BOUND_WIDE's option)
    for label, maxg, mblock, extra in (
            ("MAP CB=4", 2, itk.SELECT_BLOCK, dict(MAP=True, CB=4, MAP_NV=True, KP=512, RB=itk.SORT_ROWS)),
            ("POOL", 4, itk.SELECT_BLOCK, dict(POOL=True, POOL_BLOCK=itk.POOL_BLOCK)),
            ("POOL MBLOCK=8192", 4, 8192, dict(POOL=True, POOL_BLOCK=itk.POOL_BLOCK))):
        consts = dict(MAXG=maxg, MBLOCK=mblock, SBLOCK=256, FBLOCK=itk.SPLIT_FINAL_BLOCK,
                      BLOCK=itk.SELECT_BLOCK, PP=32, RADIX_BITS=itk.RADIX_BITS, SPAN=False, MERGE=itk.SPLIT_BOUND_MERGE,
                      PER_K=itk.SPLIT_BOUND_PER_K, **extra)
        rows.append((f"split select {label} MAXG={maxg} parts=32", ptxas_usage(itk._split_select_kernel, split, consts,
                                                                             itk.SPLIT_WARPS, floats=())))
    sc = {"q_ptr": "*fp32", "w_ptr": "*fp32", "code_ptr": "*i8", "scale_ptr": "*i8", "table_ptr": "*i64",
          "nvis_ptr": "*i64", "cand_ptr": "*i64", "out_ptr": "*fp32", "max_ptr": "*fp32"}
    for bn, nsub, warps, words, keys_m in ((128, 4, 8, 0, 0), (128, 4, 4, 0, 0), (64, 8, 4, 0, 0), (256, 2, 8, 0, 0),
                                           (128, 4, 8, 1, 0), (128, 4, 8, 1, 1), (64, 4, 4, 1, 1)):
        consts = dict(H=32, HP=32, DH=64, DHP=64, BLOCK_N=bn, NSUB=nsub, LOWP=True, MAXG=16, WORDS=words,
                      KEYS_M=keys_m, ASM=1)
        decode = f"word decode, keys on {'M' if keys_m else 'N'}" if words else "byte decode"
        rows.append((f"indexer rows kernel BLOCK_N={bn} NSUB={nsub} warps={warps} {decode}",
                     ptxas_usage(itk._indexer_rows_kernel, sc, consts, warps, floats=())))
    consts = dict(H=32, HP=32, HP1=32, DH=64, DHP=64, BLOCK_T=1, BLOCK_N=128, NSUB=1, GATHER=False, LOWP=True, MAXG=16)
    rows.append(("indexer scores kernel T=1 BLOCK_N=128 warps=8",
                 ptxas_usage(itk._indexer_scores_kernel, sc, consts, 8, floats=())))
    for warps in (8, 4):  # Reindex gather tiles over the pool's blocks of 8 (int32 block ids)
        consts = dict(H=32, HP=32, HP1=32, DH=64, DHP=64, BLOCK_T=1, BLOCK_N=128, NSUB=4, GATHER=True, LOWP=True,
                      MAXG=0, CB=8)
        rows.append((f"indexer scores kernel gather, candidate blocks of 8, BLOCK_N=128 NSUB=4 warps={warps}",
                     ptxas_usage(itk._indexer_scores_kernel, dict(sc, cand_ptr="*i32"), consts, warps, floats=())))
    pool = {"max_ptr": "*fp32", "nvis_ptr": "*i64", "out_ptr": "*i32", "work_ptr": "*fp32"}
    rows.append(("pool_select B=8", ptxas_usage(itk._pool_kernel, pool, dict(B=8, BLOCK=itk.SELECT_BLOCK,
                                                                               RADIX_BITS=itk.RADIX_BITS),
                                                 itk.SELECT_WARPS, floats=())))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="sparse,indexer", help="comma-separated: sparse, indexer")
    a = ap.parse_args()
    groups = {"sparse": sparse_rows, "indexer": indexer_rows}
    for name in a.only.split(","):
        for kernel, usage in groups[name]():
            print(f"| {kernel} | {usage} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
