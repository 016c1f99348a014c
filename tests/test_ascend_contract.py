"""The torch_npu contract checker (backends/ascend_contract.py) on a tiny fake wheel: it must
accept calls that fit the header and docs, and name each wrong op, argument and dtype."""

import textwrap
import zipfile

import pytest

from dsv41.backends import ascend_contract as ac

FAKE_HEADER = """\
#include <ATen/ATen.h>
TORCH_NPU_API ::std::tuple<at::Tensor,at::Tensor> npu_rms_norm(const at::Tensor & self, const at::Tensor & gamma, double epsilon=1e-06);
TORCH_NPU_API at::Tensor npu_quant_matmul(const at::Tensor & x1, const at::Tensor & x2, const at::Tensor & scale, const ::std::optional<at::Tensor> & offset={}, const ::std::optional<at::Tensor> & pertoken_scale={}, ::std::optional<int64_t> output_dtype=::std::nullopt);
"""

FAKE_DOCS = '''
_add_torch_npu_docstr(
    "npu_rms_norm",
    """
torch_npu.npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)
参数说明
self：Tensor类型，支持float16、bfloat16、float32。
gamma：Tensor类型，数据类型需要和self保持一致。
"""
)

_add_torch_npu_docstr(
    "npu_quant_matmul",
    """
接口原型:
torch_npu.npu_quant_matmul(Tensor x1, Tensor x2, Tensor scale, *, Tensor? offset=None, Tensor? pertoken_scale=None, ScalarType? output_dtype=None) -> Tensor
参数说明:
x1: Tensor类型.
Atlas 推理系列加速卡产品: 数据类型支持int8、float16.
Atlas A2 训练系列产品: 数据类型支持int8和int32.
x2: Tensor类型, 数据类型支持int8.
scale: Tensor类型, 数据类型支持float32、bfloat16.
pertoken_scale: Tensor类型, 数据类型支持float32.
output_dtype: 可选参数. Atlas A3 训练系列产品: 支持输入torch.int8、torch.bfloat16.
输出说明:
result: float16
"""
)
'''

FAKE_NPU = '__all__ = ["synchronize", "Stream", "get_device_properties"]\n'


@pytest.fixture
def fake_wheel(tmp_path):
    path = tmp_path / "torch_npu-0.0-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(ac.HEADER, FAKE_HEADER)
        z.writestr(ac.DOCS, FAKE_DOCS)
        z.writestr(ac.NPU_MODULE, FAKE_NPU)
    return ac.read_wheel(path)


def run_check(tmp_path, wheel, code: str) -> list[str]:
    src = tmp_path / "proj"
    src.mkdir(exist_ok=True)
    (src / "mod.py").write_text(textwrap.dedent(code))
    files = ac.source_files(src)
    calls, tables, where = ac.project_calls(files, src)
    return ac.check(wheel, calls, tables, where, ac.project_schemas(files))


GOOD = """
import torch, torch_npu
TORCH_NPU_DTYPES = {
    "npu_rms_norm": {"input": ("bfloat16",)},
    "npu_quant_matmul": {"x1": ("int8",), "x2": ("int8",), "scale": ("float32",), "pertoken_scale": ("float32",),
                         "output_dtype": ("bfloat16",)},
}
VLLM_ASCEND_SCHEMAS = {"npu_hc_post": "x, residual, post, comb", "sfa": "q, k, *, block_table=, mode="}
def f(x, w, g, s, p):
    torch_npu.npu_rms_norm(x, g, epsilon=1e-6)
    torch_npu.npu_quant_matmul(x, w, s, pertoken_scale=p, output_dtype=torch.bfloat16)
    torch.npu.synchronize()
    torch.ops._C_ascend.npu_hc_post(x, w, g, s)
    torch.ops._C_ascend.sfa(x, w, block_table=g)
"""


def test_parses_the_fake_wheel(fake_wheel):
    assert [p.name for p in fake_wheel.header["npu_rms_norm"][0]] == ["input", "gamma", "epsilon"]
    doc = fake_wheel.docs["npu_quant_matmul"]
    assert doc.kwonly_from == 3
    # the line about another product (float16) is not an A2/A3 dtype
    assert doc.dtypes["x1"] == {"int8", "int32"}
    assert doc.dtypes["output_dtype"] == {"int8", "bfloat16"}


def test_accepts_calls_that_fit(tmp_path, fake_wheel):
    assert run_check(tmp_path, fake_wheel, GOOD) == []


@pytest.mark.parametrize("bad, expect", [
    ("torch_npu.npu_rms_normm(x, g)", "npu_rms_normm is neither a custom op"),
    ("torch_npu.npu_rms_norm(x, g, eps=1e-6)", "unknown argument name(s) ['eps']"),
    ("torch_npu.npu_rms_norm(x)", "required argument(s) ['gamma'] not given"),
    ("torch_npu.npu_rms_norm(x, g, 1e-6, 3)", "4 positional arguments, the signature has 3"),
    ("torch_npu.npu_quant_matmul(x, w, s, None, p)", "keyword-only argument(s) ['offset', 'pertoken_scale'] passed positionally"),
    ("torch.npu.synchronise()", "torch.npu.synchronise is not exported"),
    ("torch.ops._C_ascend.npu_hc_pre(x, w)", "torch.ops._C_ascend.npu_hc_pre has no VLLM_ASCEND_SCHEMAS entry"),
    ("torch.ops._C_ascend.npu_hc_post(x, w, g)", "required argument(s) ['comb'] not given"),
    ("torch.ops._C_ascend.npu_hc_post(x, w, g, s, p)", "5 positional arguments, the signature has 4"),
    ("torch.ops._C_ascend.sfa(x, w, g)", "keyword-only argument(s) ['block_table'] passed positionally"),
    ("torch.ops._C_ascend.sfa(x, w, modes=1)", "unknown argument name(s) ['modes']"),
])
def test_names_a_wrong_call(tmp_path, fake_wheel, bad, expect):
    problems = run_check(tmp_path, fake_wheel, GOOD + f"    {bad}\n")
    assert len(problems) == 1 and expect in problems[0], problems
    assert problems[0].startswith("mod.py:")


@pytest.mark.parametrize("old, new, expect", [
    ('"x1": ("int8",)', '"x1": ("float16",)', "['float16'] not allowed on Atlas A2/A3"),
    ('"scale": ("float32",)', '"scales": ("float32",)', "npu_quant_matmul has no argument 'scales'"),
    ('"npu_rms_norm": {"input": ("bfloat16",)},', '', "npu_rms_norm has no TORCH_NPU_DTYPES entry"),
])
def test_names_a_wrong_dtype_table(tmp_path, fake_wheel, old, new, expect):
    assert old in GOOD
    problems = run_check(tmp_path, fake_wheel, GOOD.replace(old, new))
    assert len(problems) == 1 and expect in problems[0], problems


def test_main_exit_status(tmp_path, fake_wheel, capsys):
    src = tmp_path / "proj"
    src.mkdir()
    (src / "mod.py").write_text(GOOD.replace("npu_rms_norm(x, g,", "npu_rms_norm(x, gammma=g,"))
    wheel_path = next(tmp_path.glob("*.whl"))
    assert ac.main([str(wheel_path), str(src)]) == 1
    assert "unknown argument name(s) ['gammma']" in capsys.readouterr().out
    (src / "mod.py").write_text(GOOD)
    assert ac.main([str(wheel_path), str(src)]) == 0
