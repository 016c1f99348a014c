"""Device launches per decode step, held at or under what the code reaches
(`benchmarks/launches.py`: the tiny model's decode step with the CUDA op set, Triton kernels
under the interpreter, aten ops that would be device kernels counted by a dispatch mode).

A launch count is a property of the code, not a timing. Lower `BOUNDS` when a change removes
launches; a change that adds some must say why there.
"""

import importlib.util
import pathlib

import pytest

from _triton import cuda_only, triton  # noqa: F401  (sets TRITON_INTERPRET; skips without triton)

pytestmark = [cuda_only, pytest.mark.slow]

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "launches.py"


def _launches():
    spec = importlib.util.spec_from_file_location("launches", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_decode_step_launches_per_layer_kind():
    mod = _launches()
    c = mod.decode_step_launches("tiny", context=24, batch=1)
    kinds = c.kinds()
    print("\n[dsv41] launches per layer:", {k: round(v[1], 2) for k, v in kinds.items()}, "total", c.total)
    assert set(kinds) == set(mod.BOUNDS) - {"total"}
    over = {k: per for k, (_, per) in kinds.items() if per > mod.BOUNDS[k]}
    assert not over, f"more launches than BOUNDS allows: {over}"
    assert c.total <= mod.BOUNDS["total"]
    # a Reuse layer: four linears (one launch each at one row: the activation is quantised in the
    # kernel), q_norm, the fused query / window-entry tail, attention (+ its split combine), the
    # fused output tail: no torch glue; nor in SWA and Reindex layers
    for kind in ("attn.reuse.", "attn.swa.", "attn.reindex."):
        layer = next(n for n in c.by_range if n.startswith(kind))
        assert not [k for k in c.detail[layer] if k.startswith("aten.")], c.detail[layer]
    # MoE: the router, the shared and routed experts' kernels; the add rounding their sum is inside
    # the routed experts' combine launch (moe_experts_add): no torch glue
    moe = next(n for n in c.by_range if n.startswith("moe."))
    assert not [k for k in c.detail[moe] if k.startswith("aten.")], c.detail[moe]
    # 'other': the norms before attention and FFN come out of the mHC steps (only the final norm
    # is its own launch)
    assert c.detail["other"]["triton._rms_norm_kernel"] == 1, c.detail["other"]


def test_decode_step_launches_with_coefficients_inside_mhc_kernels():
    """With the mHC coefficient epilogue inside the main mHC kernels (DSV41_MHC_COEF=fused-narrow), each
    mHC step (and its next norm) is one launch: 'other' is then the per-step work and one launch per
    mHC step. The switch itself is left as shipped."""
    from dsv41.npu_ops.triton import mega_mhc

    mod = _launches()
    before = mega_mhc.coef_mode()
    c = mod.decode_step_launches("tiny", context=24, batch=1, fused_coef=True)
    assert mega_mhc.coef_mode() == before
    kinds = c.kinds()
    print("\n[dsv41] launches per layer with the coefficients fused:", {k: round(v[1], 2) for k, v in kinds.items()}, "total", c.total)
    assert kinds["other"][1] <= mod.BOUNDS_FUSED_COEF["other"] and c.total <= mod.BOUNDS_FUSED_COEF["total"]
    other = c.detail["other"]
    assert "triton._mhc_coef_kernel" not in other and "triton._rms_norm_kernel" in other  # (the final norm only)
    assert other["triton._rms_norm_kernel"] == 1


def test_counter_counts_kernels_not_views():
    """The dispatch-mode counter sees one launch per kernel-launching aten op and none for views,
    and attributes them to the open range."""
    import torch

    mod = _launches()
    c = mod.LaunchCounter()
    x = torch.arange(12.0)
    with mod._Count(c):
        y = x.view(3, 4).t().unsqueeze(0)  # views only
        c.stack.append("attn.swa.0")
        z = (x * 2).sum()  # two kernels
        c.stack.pop()
    assert y.shape == (1, 4, 3) and z.item() == 132.0
    assert c.by_range == {"attn.swa.0": 2} and c.kinds() == {"attn.swa": (1, 2.0)}
