"""Registers and spills of Triton kernels compiled for the H200 (sm_90a) on a machine without
a GPU: each kernel is compiled ahead of time by upstream Triton (no driver needed) and its PTX
assembled by the ptxas that ships with Triton (`ptxas -v`). Integer arguments named in
DIVISIBLE and every pointer are marked divisible by 16, as Triton's launcher specialises them
at run time (without the hint, loads are compiled per byte and the counts mislead).

    python benchmarks/ptxas_usage.py [--only sparse,indexer,decode,mhc]

A check of static resource use (spill = local-memory traffic in the loop), not a timing; rows
with tensor-core dots also name their MMA layouts and the elementwise ops placed in a dot
operand's layout (`dot_layouts`: with `mma.sync` and warps along N that work repeats on every
warp). The
"decode" group (the FP8 linears and FP4 experts at 2-64 rows) also reads each kernel's SASS
(`nvdisasm`) and reports its loops: instructions in the body, their most frequent opcodes and
the plain global loads narrower than 4 bytes there ("narrow in-loop loads"). A load like that
is one the compiler's cp.async pipeline cannot stage, so unless the kernel issues it a step
ahead it is waited on in the step that issues it (session forty: the FP4 experts' scale bytes,
39% of the gate/up kernel's stall cycles).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

DIVISIBLE = {"w_stride", "ws_stride", "g_stride", "gs_stride", "H", "S", "K"}


def ptxas_usage(fn, pointers: dict[str, str], constexprs: dict, num_warps: int, num_stages: int = 1,
                floats: tuple[str, ...] = ("scale",), divisible: tuple[str, ...] = (), maxnreg: int | None = None,
                loops: bool = False) -> str:
    """ptxas's register / spill lines for `fn` (a triton.jit function) compiled for sm_90a:
    `pointers` maps pointer arguments to Triton types ("*fp32", "*i8", ...), `constexprs` the
    compile-time arguments; the other arguments are i32 (or fp32 when named in `floats`), marked
    divisible by 16 when named in DIVISIBLE or `divisible`. `maxnreg`: the launch's register cap.
    `loops`: also `sass_loops` of the cubin."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    # compile-time parameters left out take their defaults (as a launch that omits them does)
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **constexprs}
    sig = {n: pointers[n] if n in pointers else "constexpr" if n in constexprs else "fp32" if n in floats else "i32"
           for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if (n in pointers or n in DIVISIBLE or n in divisible) and n not in constexprs}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg:
        options["maxnreg"] = maxnreg
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = glob.glob(os.path.join(bindir, "ptxas"))[0]
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        cap = [f"--maxrregcount={maxnreg}"] if maxnreg else []
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", *cap, ptx, "-o", cubin], capture_output=True, text=True,
                           check=True)
        usage = " | ".join(line.split(":", 1)[-1].strip() for line in r.stderr.splitlines()
                           if "registers" in line or "spill" in line)
        usage += f" | {kernel.metadata.shared} bytes shared memory (launch)"
        layouts = dot_layouts(kernel.asm["ttgir"])
        if layouts:
            usage += " | " + layouts
        if loops:
            sass = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", cubin], capture_output=True, text=True,
                                  check=True).stdout
            usage += " | " + sass_loops(sass)
    return usage


def dot_layouts(ttgir: str) -> str:
    """The kernel's MMA layouts (version, warps along M and N) and how many elementwise ops
    (`arith.*`) Triton placed in a dot operand's register layout. With `mma.sync` (version 2) and
    warps side by side along N, the A operand is held whole by every warp, so elementwise work in
    its layout is repeated on each (session forty-seven: the mHC mix's 16-token tiles, 93 ops,
    2696 instructions a slice a warp against 1098 once moved to a wgmma's shared-memory operand)."""
    mmas = re.findall(r"nvidia_mma<\{versionMajor = (\d), versionMinor = \d+, warpsPerCTA = \[([0-9, ]+)\]", ttgir)
    if not mmas:
        return ""
    ops = [len(re.findall(rf"arith\.\w+ .*dot_op<\{{opIdx = {i}", ttgir)) for i in (0, 1)]
    kinds = ", ".join(f"mma v{v} warps [{w}]" for v, w in dict.fromkeys(mmas))
    return f"{kinds}; elementwise ops in the A / B operand layout: {ops[0]} / {ops[1]}"


def sass_loops(sass: str) -> str:
    """Each innermost loop of a kernel's SASS (a backward branch to a label, no other loop
    inside): its instruction count, its plain global loads narrower than 4 bytes
    (`LDG.E.U8` / `.S8` / `.U16` / `.S16`), each with how many instructions later (wrapping to
    the loop's top) its register is first read: a few dozen means the step that issued it waits
    on it, about the loop's length means it is carried to the next step; and its most frequent
    opcodes (where an instruction-bound loop's issue slots go)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) for m in [re.match(r"^(\.L_x_\d+):", line)] if m}
    spans = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA `?\(?(\.L_x_\d+)", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            spans.append((labels[m.group(1)], i))
    out = []
    for a, z in spans:
        if any(a < a2 and z2 < z for a2, z2 in spans if (a2, z2) != (a, z)):
            continue  # (an outer loop)
        body = [b.split("*/", 1)[1].strip() for b in lines[a:z] if re.match(r"\s+/\*[0-9a-f]{4}\*/", b)]
        if not body:
            continue
        dists = []
        for i, ins in enumerate(body):
            m = re.search(r"\bLDG\.E\.[US](?:8|16)\s+(R\d+)", ins)
            if not m:
                continue
            reg = re.compile(rf"\b{m.group(1)}\b")
            for d in range(1, len(body) + 1):
                nxt = re.sub(r"^@!?P\w+\s+", "", body[(i + d) % len(body)])
                ops = nxt.split(None, 1)[1] if " " in nxt else ""
                srcs = ops if nxt.startswith(("ST", "RED", "ATOM")) else ops.split(",", 1)[-1] if "," in ops else ""
                if reg.search(srcs):
                    dists.append(d)
                    break
        opcodes = Counter(re.sub(r"^@!?P\w+\s+", "", ins).split()[0].split(".")[0] for ins in body)
        top = ", ".join(f"{op} {n}" for op, n in opcodes.most_common(8))
        out.append(f"loop of {len(body)} instructions, narrow in-loop loads read after {dists or 'none'}, "
                   f"most frequent: {top}")
    return "; ".join(out) or "no loops"


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
        if cfg.get("MQA"):  # pools as 32-bit words (this kernel only: the others take the bytes)
            consts = dict(D=512, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], SPLIT=split, DOT_BF16=True,
                          AHEAD=cfg.get("AHEAD", True), LAZY=cfg.get("LAZY", 0.0))
            kptrs = dict(ptrs, win_ptr="*i32", gkv_ptr="*i32")
            fn = sa._mqa_kernel
        else:
            consts = dict(D=512, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=bd, BLOCK_DV=bdv, SPLIT=split,
                          DOT_BF16=True, QK_T=False, DV_HALF=False)
            kptrs = ptrs
            fn = sa._sparse_attn_kernel
        rows.append((f"sparse_attention {key}", ptxas_usage(fn, kptrs, consts, cfg["num_warps"], cfg["num_stages"])))
    rows += two_pass_rows(ptrs)
    from dsv41.npu_ops.triton import sparse_attention_rows as sar

    cfg = sa.CONFIGS["cuda_prefill"]  # the rows form's attention kernel (bf16 table rows)
    consts = dict(D=512, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["num_stages"], DOT_BF16=True)
    rows.append(("sparse_attention cuda_prefill (rows form)", ptxas_usage(
        sar._rows_attn_kernel, {"q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i32", "sink_ptr": "*fp32",
                                "out_ptr": "*bf16"}, consts, cfg["num_warps"], cfg["num_stages"])))
    return rows


def two_pass_rows(ptrs: dict[str, str]) -> list[tuple[str, str]]:
    """The two-pass decode attention's kernels (the decode batches' table, `cuda_decode_two_pass`;
    the logits pass under its register cap as from TWO_PASS_LOGITS_CAP's token count), with the
    cache rows decoded to fp32 and with KV_X2, and their loops. Each loop holds the window (FP8)
    and the global (FP4) decode behind a run-time branch, so a block executes one of the two."""
    from dsv41.npu_ops.triton import sparse_attention as sa
    from dsv41.npu_ops.triton import sparse_attention_two_pass as tp

    cfg = sa.CONFIGS["cuda_decode_two_pass"]
    cap = sa.TWO_PASS_LOGITS_CAP["cuda"][1]
    lg = dict(ptrs, lg_ptr="*fp32", mb_ptr="*fp32")
    rows = []
    for x2 in (False, True):
        tag = "KV_X2" if x2 else "fp32 decode"
        consts = dict(D=512, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=cfg["BLOCK_D"], DOT_BF16=True,
                      KV_X2=x2, ASM=x2)
        rows.append((f"two-pass logits, {tag}, cap {cap}", ptxas_usage(
            tp._logits_kernel, lg, consts, cfg["num_warps"], cfg["num_stages"], maxnreg=cap, loops=True)))
        # NB_MAX: the launch's power of two over the entry blocks (128 window + 512 global entries: 20)
        consts = dict(D=512, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], BLOCK_DV=cfg["BLOCK_DV"], NB_MAX=32,
                      SPLIT=True, DOT_BF16=True, AHEAD=cfg["VALUES_AHEAD"], KV_X2=x2, ASM=x2)
        rows.append((f"two-pass values, {tag}", ptxas_usage(
            tp._values_kernel, lg, consts, cfg["num_warps"], cfg["num_stages"], loops=True)))
    # the opt-in per-pool logits pass (LOGITS_BLOCK_N): one loop per pool, each pool's decode
    # fixed at compile time, at the values pass's block size and at twice it
    for lbn in (cfg["BLOCK_N"], 2 * cfg["BLOCK_N"]):
        consts = dict(D=512, BLOCK_H=cfg["BLOCK_H"], LBN=lbn, BLOCK_D=cfg["BLOCK_D"], DOT_BF16=True, KV_X2=True,
                      ASM=True)
        rows.append((f"two-pass logits per pool, KV_X2, {lbn} entries, cap {cap}", ptxas_usage(
            tp._logits_pools_kernel, lg, consts, cfg["num_warps"], cfg["num_stages"], maxnreg=cap, loops=True)))
    # the opt-in logits split over channel chunks (LOGITS_SPLIT_D) and its values pass (the chunk
    # partials summed, the split's own maximum first)
    consts = dict(D=512, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=cfg["BLOCK_D"], DOT_BF16=True,
                  KV_X2=True, ASM=True, SPLIT_D=True)
    rows.append(("two-pass logits split over D, KV_X2", ptxas_usage(
        tp._logits_kernel, lg, consts, cfg["num_warps"], cfg["num_stages"])))
    consts = dict(D=512, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], BLOCK_DV=cfg["BLOCK_DV"], NB_MAX=32,
                  SPLIT=True, DOT_BF16=True, AHEAD=cfg["VALUES_AHEAD"], KV_X2=True, ASM=True,
                  LG_PARTS=512 // cfg["BLOCK_D"])
    rows.append(("two-pass values over split-D logits, KV_X2", ptxas_usage(
        tp._values_kernel, lg, consts, cfg["num_warps"], cfg["num_stages"], loops=True)))
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


def decode_rows() -> list[tuple[str, str]]:
    """The batch 2-64 decode kernels of the FP8 linears (wq_b's K = 1280 and wo_b's 8192 as the
    launches specialise them) and the FP4 experts' fold kernels (mini widths, byte tiles at the
    17-64 token tiles), with their loops' narrow loads."""
    from dsv41.npu_ops.triton import block_linear as bl
    from dsv41.npu_ops.triton import moe_fold as mf

    lin = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*u8", "out_ptr": "*i16", "part_ptr": "*fp32",
           "count_ptr": "*i32"}
    div = ("M", "N", "x_stride", "k_per_split")
    rows = [("_fold_tm_kernel 64 rows (FOLD_TM)", ptxas_usage(
                bl._fold_tm_kernel, lin, dict(SPLIT_K=1, OUT_BF16=True, LOWP=True, BM=64, BN=bl.FOLD_TM["bn"],
                                              BK=bl.FOLD_TM["bk"]),
                bl.FOLD_TM["num_warps"], bl.FOLD_TM["num_stages"], floats=(), divisible=div, loops=True)),
            ("_fold_linear_kernel 64 rows, split K (FOLD)", ptxas_usage(
                bl._fold_linear_kernel, lin, dict(SPLIT_K=2, OUT_BF16=True, QDQ_ROW=False, SCALE_X=False, LOWP=True,
                                                  BM=64, BN=bl.FOLD["bn"], BK=bl.FOLD["bk"]),
                bl.FOLD["num_warps"], bl.FOLD["num_stages"], floats=(), divisible=div, loops=True)),
            ("_fold_xs_kernel 8 rows (XS)", ptxas_usage(
                bl._fold_xs_kernel, lin, dict(SPLIT_K=2, OUT_BF16=True, QDQ_ROW=False, PLACE=False, LOWP=True, MP=8,
                                              BX=max(16, bl.XS["bn"] // 32 * 8), BN=bl.XS["bn"], BK=bl.XS["bk"]),
                bl.XS["num_warps"], bl.XS["num_stages"], floats=(), divisible=div, loops=True))]
    tiles = mf.fold_tiles(64)
    moe = {"x_ptr": "*bf16", "perm_ptr": "*i32", "bounds_ptr": "*i32", "wts_ptr": "*fp32", "w_base": "*i8",
           "s_base": "*i8", "table_ptr": "*i64", "h_ptr": "*bf16", "part_ptr": "*fp32", "y_ptr": "*fp32"}
    common = dict(ALIGN=16, ASM=True, LOWP=True, RB=tiles["rb_max"], BK=tiles["bk"], W_LEFT=tiles["w_left"],
                  BYTES=tiles["byte_tiles"], SLOTS=2)
    for ahead in (True, False):
        rows.append((f"_fold_up_kernel 33-64 tokens, scale bytes {'a step ahead' if ahead else 'in their step'}",
                     ptxas_usage(mf._fold_up_kernel, moe, dict(common, TOPK=6, BN=tiles["bn_up"], SPLIT=1,
                                                               BK_DOWN=tiles["bk"], AHEAD=ahead),
                                 tiles["num_warps"], tiles["num_stages"], floats=("limit",),
                                 divisible=("K", "I", "s_stride"), maxnreg=tiles["maxnreg"], loops=True)))
    rows.append(("_fold_down_kernel 33-64 tokens", ptxas_usage(
        mf._fold_down_kernel, moe, dict(common, BN=tiles["bn_down"]), tiles["num_warps"], tiles["num_stages"],
        floats=(), divisible=("I", "D", "s_stride"), loops=True)))
    return rows


def mhc_rows() -> list[tuple[str, str]]:
    """The mHC kernels (bf16 streams, 16-token tiles of 64-wide slices): the fused mix with the next
    coefficients' partials and the entry partials, each with the projection as x_new x fn^T (fn
    split per program; the table's stages) and transposed on fn's bf16 parts (TDOT; the decode
    rule's stages), with loops."""
    from dsv41.npu_ops.triton import mega_mhc as mm
    from dsv41.npu_ops.triton import mhc_mixes as mx

    rows = []
    for tdot in (False, True):  # the table's tiles; TDOT as the decode rule runs it (DECODE_TDOT's stages)
        tiles = dict(mm.TILES["cuda"], num_stages=mm.DECODE_TDOT["num_stages"]) if tdot else mm.TILES["cuda"]
        ptrs = {n: "*fp32" for n in mm._mhc_mix_kernel.arg_names if n.endswith("_ptr")}
        ptrs.update(x_ptr="*bf16", y_ptr="*bf16", xnew_ptr="*i16", xhat_ptr="*i16", xn_ptr="*i16", nw_ptr="*bf16",
                    count_ptr="*i32", fn_ptr="*bf16" if tdot else "*fp32")
        rows.append((f"_mhc_mix_kernel {'TDOT' if tdot else 'fn^T'}", ptxas_usage(
            mm._mhc_mix_kernel, ptrs, dict(BLOCK_T=tiles["block_t"], BLOCK_D=tiles["block_d"], HAS_FN=True, SPLIT=True,
                                           OUT_BF16=True, WIDE=False, FUSED=False, CT=mm.COEF_T, CB=8, NORM=False,
                                           BLOCK_N=8192, TDOT=tdot),
            tiles["num_warps"], tiles["num_stages"], floats=("norm_eps", "hc_eps", "rms_eps"),
            divisible=("D", "chunk"), loops=True)))
        ptrs = {n: "*fp32" for n in mx._mhc_partials_kernel.arg_names if n.endswith("_ptr")}
        ptrs.update(x_ptr="*bf16", xhat_ptr="*i16", xn_ptr="*i16", nw_ptr="*bf16", count_ptr="*i32",
                    fn_ptr="*bf16" if tdot else "*fp32")
        rows.append((f"_mhc_partials_kernel {'TDOT' if tdot else 'fn^T'}", ptxas_usage(
            mx._mhc_partials_kernel, ptrs, dict(BLOCK_T=tiles["block_t"], BLOCK_D=tiles["block_d"], SPLIT=True,
                                                FUSED=False, CT=mm.COEF_T, CB=8, WIDE=False, NORM=False, BLOCK_N=8192,
                                                BF16=True, TDOT=tdot),
            tiles["num_warps"], tiles["num_stages"], floats=("norm_eps", "hc_eps", "rms_eps"),
            divisible=("D", "chunk"), loops=True)))
    ptrs = {n: "*fp32" for n in mm._mhc_coef_kernel.arg_names if n.endswith("_ptr")}
    ptrs.update(xhat_ptr="*i16", xn_ptr="*i16", nw_ptr="*bf16", x_ptr="*bf16")
    for bt in (1, mm.COEF_T):  # the narrow decode tiles (one token a program) and the table's
        rows.append((f"_mhc_coef_kernel {bt} token(s) a program (loops: chunk sums, Sinkhorn round)", ptxas_usage(
            mm._mhc_coef_kernel, ptrs, dict(BLOCK_T=bt, CB=mm.coef_chunk_block(bt), WIDE=False, NORM=False,
                                            BLOCK_N=8192, BF16=True, COLLAPSE=False),
            4, 1, floats=("norm_eps", "hc_eps", "rms_eps"), loops=True)))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="sparse,indexer", help="comma-separated: sparse, indexer, decode, mhc")
    a = ap.parse_args()
    groups = {"sparse": sparse_rows, "indexer": indexer_rows, "decode": decode_rows, "mhc": mhc_rows}
    for name in a.only.split(","):
        for kernel, usage in groups[name]():
            print(f"| {kernel} | {usage} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
