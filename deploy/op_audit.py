"""Per-op audit of a device forward: every op call replayed on the CPU reference.

A model-level mismatch (device logits against the reference, or a decode step against the same
row of a prefill) says that something is off, not where. `audit(model, steps)` runs forward
passes of `model` on its device with every op call traced (`backends.ops` dispatches through
one function, which the audit wraps): before each call its tensor arguments are copied to the
host; after it, its outputs and any argument it wrote in place. The same call is then replayed
on the host copies through the reference implementation (official rounding mode) and the two
compared, so each op is measured on the model's own data with its own inputs: an error does
not accumulate from earlier ops.

Per call: the op, the call index, the output shape, the relative error ||dev - ref|| / ||ref||
(float outputs; None on an all-zero reference), or the fraction of differing elements (integer
outputs: ids, codes). `report(rows)` prints the worst calls and a per-op summary.

`dsv41 audit-ops --preset tiny --device cuda` (or `python -m dsv41.deploy.op_audit`) audits an exact prefill and an
eager decode step of the preset with random weights of realistic statistics.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys

import torch

from ..backends import ops
from ..backends.numerics import numerics
from ..backends.registry import dispatch, op_names, resolve


def _to_host(x):
    """A host copy of every tensor in x (tuples, lists, dicts and dataclasses walked)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(_to_host(v) for v in x)
    if isinstance(x, tuple):  # a named tuple
        return type(x)(*(_to_host(v) for v in x))
    if isinstance(x, dict):
        return {k: _to_host(v) for k, v in x.items()}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: _to_host(getattr(x, f.name)) for f in dataclasses.fields(x)
                                         if f.init})
    return x


def _flat(x) -> list:
    """The tensors of x in a fixed order (None where a slot holds none)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _flat(v)]
    if isinstance(x, dict):
        return [t for k in sorted(x, key=str) for t in _flat(x[k])]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [t for f in dataclasses.fields(x) for t in _flat(getattr(x, f.name))]
    return []


def _error(dev: torch.Tensor, ref: torch.Tensor) -> tuple[str, float | None]:
    """('rel', ||dev - ref|| / ||ref||) for float tensors, ('mismatch', fraction) otherwise."""
    if dev.shape != ref.shape:
        return "shape", float("inf")
    if dev.is_floating_point() or ref.is_floating_point():
        wide = torch.promote_types(dev.dtype, ref.dtype)  # compared in the wider of the two dtypes
        wide = wide if wide.is_floating_point and wide.itemsize >= 4 else torch.float32
        d, r = dev.to(wide), ref.to(wide)
        finite = torch.isfinite(r)
        if not torch.equal(finite, torch.isfinite(d)):
            return "rel", float("inf")
        d, r = d[finite], r[finite]
        den = float(r.norm())
        return "rel", (float((d - r).norm()) / den if den > 0 else None)
    return "mismatch", (int((dev != ref).sum()) / dev.numel()) if dev.numel() else 0.0


def _past_null_row(t: torch.Tensor) -> torch.Tensor:
    """Rows 1.. of a tensor written in place with more than one row (cache pools)."""
    return t[1:] if t.dim() >= 2 and t.shape[0] > 1 else t


@contextlib.contextmanager
def traced_ops(rows: list[dict]):
    """Within: every op call that a backend other than the reference runs is replayed on the
    reference and compared (a row per output tensor appended to `rows`)."""
    orig = ops.dispatch
    count: dict[str, int] = {}

    def dispatch(name, device):
        fn = orig(name, device)
        ref = resolve(name, "reference")[0]
        if fn is ref:  # (the reference itself: nothing to compare)
            return fn

        def call(*args, **kwargs):
            host_args, host_kwargs = _to_host(args), _to_host(kwargs)
            out = fn(*args, **kwargs)
            idx = count[name] = count.get(name, 0) + 1
            dev_out, dev_after = _flat(_to_host(out)), _flat(_to_host((args, kwargs)))
            before = _flat((host_args, host_kwargs))
            try:
                with numerics("official"):
                    ref_out = _flat(ref(*host_args, **host_kwargs))
            except Exception as e:  # an argument the host replay cannot take (reported, not hidden)
                rows.append(dict(op=name, call=idx, out="-", shape=None, kind="skipped", err=None,
                                 note=f"{type(e).__name__}: {e}"[:120]))
                return out
            ref_after = _flat((host_args, host_kwargs))
            pairs = [(f"out{i}", d, r) for i, (d, r) in enumerate(zip(dev_out, ref_out))]
            # arguments written in place (KV caches, accumulators), where the device changed them;
            # row 0 left out of cache-like ones: the pools' null block takes the writes of padding
            # rows, in whatever order they land, and is never read
            pairs += [(f"arg{i}", _past_null_row(d), _past_null_row(r))
                      for i, (d, b, r) in enumerate(zip(dev_after, before, ref_after))
                      if d.shape == b.shape and not torch.equal(d, b)]
            for label, d, r in pairs:
                kind_, err = _error(d, r)
                rows.append(dict(op=name, call=idx, out=label, shape=tuple(d.shape), kind=kind_, err=err, note=""))
            return out

        return call

    ops.dispatch = dispatch
    try:
        yield rows
    finally:
        ops.dispatch = orig


def report(rows: list[dict], worst: int = 25, file=sys.stdout) -> None:
    """The worst calls, then per op: calls, the largest and median error."""
    def key(r):
        return -1.0 if r["err"] is None else r["err"]

    print(f"{'op':28s} {'call':>5s} {'out':6s} {'shape':22s} {'kind':9s} error", file=file)
    for r in sorted(rows, key=key, reverse=True)[:worst]:
        err = "-" if r["err"] is None else f"{r['err']:.3e}"
        print(f"{r['op']:28s} {r['call']:5d} {r['out']:6s} {str(r['shape']):22s} {r['kind']:9s} {err} {r['note']}",
              file=file)
    print(f"\n{'op':28s} {'rows':>5s} {'max':>10s} {'median':>10s}", file=file)
    by_op: dict[str, list] = {}
    for r in rows:
        by_op.setdefault(r["op"], []).append(r["err"])
    for name, errs in sorted(by_op.items()):
        vals = sorted(e for e in errs if e is not None)
        mx = f"{vals[-1]:.3e}" if vals else "-"
        med = f"{vals[len(vals) // 2]:.3e}" if vals else "-"
        print(f"{name:28s} {len(errs):5d} {mx:>10s} {med:>10s}", file=file)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The audit's options (`dsv41 audit-ops` and `python -m dsv41.deploy.op_audit`)."""
    ap.add_argument("--preset", default="tiny", help="model preset, random weights of realistic statistics")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt-len", type=int, default=48, help="tokens of the audited prefill")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worst", type=int, default=25, help="calls listed, worst first")


def run(args) -> int:
    """Audit an exact prefill of --prompt-len random tokens, then one decode step."""
    from ..core.config import preset
    from ..core.engine import SingleSequence
    from ..core.weights import build_model
    from .cli import UserError
    from .device_numerics import random_text_ids

    if args.prompt_len < 1:
        raise UserError(f"--prompt-len must be at least 1, got {args.prompt_len}")
    cfg = preset(args.preset)
    model = build_model(cfg, seed=args.seed, device=args.device, with_drafter=False)
    if all(dispatch(name, model.embed.weight.device) is resolve(name, "reference")[0] for name in op_names()):
        raise UserError(f"every op on {args.device} is the reference's own: nothing to compare (audit a device "
                        "backend: --device cuda / npu, or DSV41_BACKEND=cuda with TRITON_INTERPRET=1 on the CPU)")
    ids = random_text_ids(cfg, args.prompt_len + 1, torch.Generator().manual_seed(args.seed + 7))
    seq = SingleSequence(model)
    for phase, part in (("prefill", ids[:-1]), ("decode", ids[-1:])):
        rows: list[dict] = []
        with traced_ops(rows):
            seq.feed(part, all_logits=True)
        print(f"\n## {args.preset} {phase} ({len(part)} tokens at position {seq.length - len(part)}): "
              f"{len(rows)} compared outputs")
        report(rows, args.worst)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv41.deploy.op_audit", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
