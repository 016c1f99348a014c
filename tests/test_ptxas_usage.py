"""`benchmarks/ptxas_usage.py`'s SASS loop report on a hand-written listing (no compiler needed):
only the innermost loop is reported, a narrow load's distance runs to the first instruction
that reads its register (a predicated one too), and the opcode counts ignore predicates and
modifiers; its TTGIR layout report on a hand-written excerpt."""
import importlib.util
import pathlib

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "ptxas_usage.py"
_spec = importlib.util.spec_from_file_location("ptxas_usage", _PATH)
ptxas_usage = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ptxas_usage)

LISTING = """
.L_x_1:
        /*0000*/                   MOV R1, RZ ;
.L_x_2:
        /*0010*/                   LDG.E.U8 R5, desc[UR4][R2.64] ;
        /*0020*/                   IMAD R11, R7, R8, RZ ;
        /*0030*/                   IMAD.WIDE R9, R6, R8, RZ ;
        /*0040*/                   @!P0 IADD3 R10, R5, R9, RZ ;
        /*0050*/                   BRA `(.L_x_2) ;
        /*0060*/                   BRA `(.L_x_1) ;
"""


def test_sass_loops_reports_the_inner_loop():
    # the load's register is first read three instructions later, under a predicate; the outer
    # loop, which holds the inner one, is left out
    assert ptxas_usage.sass_loops(LISTING) == (
        "loop of 4 instructions, narrow in-loop loads read after [3], most frequent: IMAD 2, LDG 1, IADD3 1")


def test_sass_loops_without_loops():
    assert ptxas_usage.sass_loops("        /*0000*/                   EXIT ;\n") == "no loops"


TTGIR = """
#blocked = #ttg.blocked<{sizePerThread = [1, 8], threadsPerWarp = [4, 8], warpsPerCTA = [4, 1], order = [1, 0]}>
#mma = #ttg.nvidia_mma<{versionMajor = 2, versionMinor = 0, warpsPerCTA = [1, 4], instrShape = [16, 8]}>
    %a = arith.addf %x, %y : tensor<16x64xf32, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 2}>>
    %b = arith.mulf %a, %a : tensor<16x64xf32, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 2}>>
    %c = arith.constant dense<1> : tensor<16xi32, #ttg.slice<{dim = 1, parent = #ttg.dot_op<{opIdx = 1, parent = #mma, kWidth = 2}>}>>
    %d = arith.addf %p, %q : tensor<16x64xf32, #blocked>
"""


def test_dot_layouts_counts_elementwise_ops_in_operand_layouts():
    # two ops in the A operand's layout, one (a constant) in B's; a blocked-layout op is not counted
    assert ptxas_usage.dot_layouts(TTGIR) == "mma v2 warps [1, 4]; elementwise ops in the A / B operand layout: 2 / 1"
    assert ptxas_usage.dot_layouts("#blocked = #ttg.blocked<{}>") == ""
