"""deploy/op_audit.py: every op call a non-reference backend runs is replayed on the reference.

On the CPU there is no device backend, so the test stands one in: `ops.dispatch` returns, for
`rms_norm`, an implementation 1% off the reference and, for `rope`, an exact copy (another
function object, so both are traced); every other op resolves to the reference and is not.
"""

import io

import pytest
import torch

from dsv41.backends import ops
from dsv41.backends.registry import resolve
from dsv41.core.engine import SingleSequence
from dsv41.deploy import op_audit
from _util import rand_prompt


@pytest.fixture
def fake_device_ops(monkeypatch):
    real = ops.dispatch

    def dispatch(name, device):
        ref = resolve(name, "reference")[0]
        if name == "rms_norm":
            return lambda *a, **k: ref(*a, **k) * 1.01
        if name == "rope":
            return lambda *a, **k: ref(*a, **k)
        return real(name, device)

    monkeypatch.setattr(ops, "dispatch", dispatch)
    return dispatch


def test_audit_finds_the_op_that_is_off(tiny_model, tiny_cfg, fake_device_ops, rng):
    rows: list[dict] = []
    with op_audit.traced_ops(rows):
        SingleSequence(tiny_model).feed(rand_prompt(tiny_cfg, 6, rng).tolist())
    assert ops.dispatch is fake_device_ops  # restored on exit
    by_op = {}
    for r in rows:
        by_op.setdefault(r["op"], []).append(r["err"])
    assert set(by_op) == {"rms_norm", "rope"}, set(by_op)
    # (rms_norm returns bf16: the 1% lands within a bf16 rounding of 1%)
    assert all(e == pytest.approx(0.01, rel=0.1) for e in by_op["rms_norm"]), by_op["rms_norm"][:4]
    assert all(e == 0.0 for e in by_op["rope"])
    out = io.StringIO()
    op_audit.report(rows, worst=3, file=out)
    worst = out.getvalue().splitlines()[1:4]
    assert all(line.startswith("rms_norm") for line in worst), worst


def test_error_measures():
    a = torch.tensor([1.0, 2.0, 4.0])
    assert op_audit._error(a, a) == ("rel", 0.0)
    assert op_audit._error(a * 1.5, a)[1] == pytest.approx(0.5)
    assert op_audit._error(a, torch.zeros(3)) == ("rel", None)  # no relative error on zeros
    assert op_audit._error(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0])) == ("rel", float("inf"))
    assert op_audit._error(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 0, 4])) == ("mismatch", 0.25)
    assert op_audit._error(a, a[:2]) == ("shape", float("inf"))
    # in-place cache writes: row 0 (the null block) is left out
    assert torch.equal(op_audit._past_null_row(torch.arange(6).view(3, 2)), torch.tensor([[2, 3], [4, 5]]))
