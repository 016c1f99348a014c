"""`dsv41 backends`: for this machine, which implementation each op resolves to and why."""

from __future__ import annotations

import json

from . import ops  # noqa: F401  (registers the reference ops)
from .platform import cuda_unavailable_reason, npu_unavailable_reason
from .registry import BACKENDS, forced_backend, op_names, resolve


def backend_status() -> dict[str, str]:
    why = {"reference": None, "cuda": cuda_unavailable_reason(), "ascend": npu_unavailable_reason()}
    return {b: "available" if why[b] is None else f"unavailable ({why[b]})" for b in BACKENDS}


def ascend_plan() -> tuple[str, dict[str, str]]:
    """(heading, op -> what the Ascend backend runs for it): the registered choice once the
    backend has loaded, else what it would choose on an NPU with this machine's triton."""
    from . import ascend

    if ascend.IMPLEMENTATIONS:
        return "Ascend backend (loaded), per op:", dict(ascend.IMPLEMENTATIONS)
    triton_ops, triton_why = ascend.triton_op_names()
    plan = ascend.plan(op_names(), triton_ops, triton_why, ascend.vllm_ascend_ops())
    return ("Ascend backend on an NPU (torch_npu present; triton and vllm-ascend as here), per op:",
            {n: w for n, (_, w) in plan.items()})


def backend_report(as_json: bool = False) -> str:
    status = backend_status()
    heading, plan = ascend_plan()
    table = {}
    for name in op_names():
        table[name] = {}
        for b in BACKENDS:
            _, used, reason = resolve(name, b)
            table[name][b] = {"uses": used, "why": reason}
    if as_json:
        return json.dumps({"forced": forced_backend(), "backends": status, "ops": table, "ascend_plan": plan})
    lines = [f"{b}: {s}" for b, s in status.items()]
    if forced_backend():
        lines.append(f"DSV41_BACKEND={forced_backend()} forces every op onto that backend")
    lines += ["", "Per op, what a tensor on each backend's device runs:"]
    w = max(len(n) for n in table)
    lines.append(f"{'op'.ljust(w)}  " + "  ".join(b.ljust(24) for b in BACKENDS))

    def cell(c: dict) -> str:
        if c["uses"] != "reference" or c["why"] == "reference backend":
            return c["uses"]
        return "reference (unavailable)" if "unavailable" in c["why"] else "reference (no kernel)"

    for name, row in table.items():
        lines.append(f"{name.ljust(w)}  " + "  ".join(cell(row[b]).ljust(24) for b in BACKENDS))
    lines += ["", heading] + [f"  {name.ljust(w)}  {what}" for name, what in plan.items()]
    return "\n".join(lines)
