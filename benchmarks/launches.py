"""Device launches per decode step, by layer kind, counted on a CPU without a GPU.

    TRITON_INTERPRET=1 python benchmarks/launches.py --preset tiny [--context 24] [--batch 1]

A launch count is a property of the code, not a timing: it is what the CUDA backend would
launch, counted while the tiny model's decode step runs with the CUDA op set (every op
dispatched to its CUDA implementation; the Triton kernels run in Triton's interpreter on CPU
tensors) under `DSV41_STRICT=1`, so no op silently takes the reference. Two counters:
- Triton kernel launches (each `kernel[grid](...)`), by wrapping the runtime's `run`;
- torch ops that would be device kernels, by a `TorchDispatchMode` that counts every aten op
  outside a Triton launch except the ones that launch nothing on a device (views, reshapes,
  `empty`, metadata). One aten op is counted as one kernel: a few launch more than one on CUDA
  (a multi-pass sort, a `topk` of a long row), so the count is a lower bound of the profiler's.

Launches are attributed like `benchmarks/e2e.py`'s profile: to the attention sublayer (by its
kind), MoE or Engram module that launched them; 'other' is everything outside (embedding, mHC,
norms, head, the step's shared metadata). The context is prefilled with the reference ops first;
only the last decode step is counted. `tests/test_triton_launches.py` holds the counts at or under
`BOUNDS`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections import Counter, defaultdict

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# aten ops that launch no device kernel: views, shape and metadata, allocation without a fill
NO_KERNEL = {
    "view", "_unsafe_view", "reshape", "as_strided", "expand", "permute", "transpose", "t", "unsqueeze",
    "squeeze", "select", "slice", "alias", "detach", "split", "split_with_sizes", "unbind", "narrow",
    "diagonal", "view_as_real", "view_as_complex", "unfold", "empty", "empty_like", "empty_strided",
    "new_empty", "new_empty_strided", "lift_fresh", "_reshape_alias", "resize_", "set_", "is_nonzero",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim", "size", "stride", "numel",
    "is_contiguous", "_has_compatible_shallow_copy_type", "result_type", "_to_copy_meta",
}

# Launches per layer of each kind (and in all) in one tiny-preset decode step at batch 1, 24
# tokens of context: what this code reaches; tests/test_triton_launches.py holds the counts at or under
# these (lower them when a change removes launches).
BOUNDS = {"attn.full": 26, "attn.reindex": 15, "attn.reuse": 9, "attn.swa": 9.5, "engram": 5, "moe": 9,
          "other": 58, "total": 359}
# 'other' with the mHC coefficient epilogue inside the main mHC kernels (DSV41_MHC_COEF=fused-narrow, off
# until measured on a device: one launch per mHC step instead of two)
BOUNDS_FUSED_COEF = {"other": 34, "total": 336}
# with the kernels on by default (DSV41_FUSED unset: not indexer_queries, mhc_mix_norm,
# mhc_enter_norm, unrope_grouped_linear), 2026-12-01: full 29, reindex 18, reuse 10, swa 10.5,
# engram 5, moe 10, other 85; 409 in all.
# with the compositions instead of the fused kernels (DSV41_FUSED=none), 2026-12-01: full 71.67, reindex 33, reuse 15, swa 30, engram 5, moe 10,
# other 123; 669 in all (741 before: moe 15, other 129, swa 31, full 73)
# before (2026-12-01, main be12266, fused kernels): full 29.33, reindex 17, reuse 9, swa 10.5, engram
# 5, moe 15, other 91; 469 in all. Without the per-step memos and fused ops (main at f831fd8): full
# 113.7, reindex 51, reuse 39, swa 43.5, engram 5, moe 15, other 121; 1036 in all (at 391355d, before
# main's fold linear and indexer changes: full 132.7, reindex 90, reuse 43, swa 47.5, engram 6; 1201)


class _Count(TorchDispatchMode):
    """Counts aten ops that would launch device kernels, into the innermost open range."""

    def __init__(self, counter: "LaunchCounter"):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        c = self.counter
        if not c.in_triton:
            name = func.overloadpacket.__name__
            if name not in NO_KERNEL:
                c.add(f"aten.{name}")
        return func(*args, **(kwargs or {}))


class LaunchCounter:
    """Launch counts of a forward, by range ('attn.<kind>.<layer>', 'moe.<layer>',
    'engram.<layer>', 'other') and by kernel / op name."""

    def __init__(self):
        self.by_range: Counter = Counter()
        self.detail: dict[str, Counter] = defaultdict(Counter)
        self.stack: list[str] = []
        self.in_triton = False

    def add(self, what: str) -> None:
        where = self.stack[-1] if self.stack else "other"
        self.by_range[where] += 1
        self.detail[where][what] += 1

    @contextlib.contextmanager
    def ranges(self, model):
        """Forward hooks naming the range of every attention sublayer, MoE and Engram module."""
        handles, cfg = [], model.cfg
        for i, blk in enumerate(model.layers):
            mods = [(blk.attn, f"attn.{cfg.layer_kind(i)}.{i}"), (blk.ffn, f"moe.{i}")]
            if blk.engram is not None:
                mods.append((blk.engram, f"engram.{i}"))
            for mod, name in mods:
                handles.append(mod.register_forward_pre_hook(lambda _m, _a, name=name: self.stack.append(name)))
                handles.append(mod.register_forward_hook(lambda _m, _a, _o: self.stack.pop() and None))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @contextlib.contextmanager
    def triton_launches(self):
        """Count each Triton kernel launch (compiled or interpreted) once, and none of the torch
        work the interpreter does to run it."""
        from triton.runtime import interpreter, jit

        patched = []
        for cls in (jit.JITFunction, interpreter.InterpretedFunction):
            orig = cls.run

            def run(fn, *args, _orig=orig, **kwargs):
                if self.in_triton:
                    return _orig(fn, *args, **kwargs)
                self.add(f"triton.{getattr(fn, '__name__', None) or fn.fn.__name__}")
                self.in_triton = True
                try:
                    return _orig(fn, *args, **kwargs)
                finally:
                    self.in_triton = False

            cls.run = run
            patched.append((cls, orig))
        try:
            yield
        finally:
            for cls, orig in patched:
                cls.run = orig

    def kinds(self) -> dict[str, tuple[int, float]]:
        """{kind: (layers, launches per layer)} ('attn.reuse', 'moe', 'other', ...)."""
        groups = defaultdict(list)
        for name, n in self.by_range.items():
            groups[name.rsplit(".", 1)[0] if name[-1].isdigit() else name].append(n)
        return {k: (len(v), sum(v) / len(v)) for k, v in sorted(groups.items())}

    @property
    def total(self) -> int:
        return sum(self.by_range.values())


def decode_step_launches(preset: str = "tiny", context: int = 24, batch: int = 1, seed: int = 0,
                         fused: str = "all", fused_coef: bool | None = None) -> LaunchCounter:
    """Launches of one decode step of `batch` sequences after `context` prefilled tokens and
    one warm-up decode step each; `fused`: the DSV41_FUSED setting ("all": every fused op's
    kernel; "none": every fused op as the composition it replaces; "default": the kernels that
    are on by default, those measured on a device);
    `fused_coef`: the mHC coefficient epilogue inside the main mHC kernels (one launch per mix,
    DSV41_MHC_COEF=fused / fused-narrow) or as its own launch (None: the process's setting)."""
    from dsv41.backends import registry
    from dsv41.core.batch import Chunk, build_step
    from dsv41.core.cache import KVPool, SequenceState
    from dsv41.core.config import preset as get_preset
    from dsv41.core.weights import build_model
    from dsv41.npu_ops.triton import mega_mhc

    if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
        raise RuntimeError("set TRITON_INTERPRET=1 (no CUDA device) before importing triton")
    cfg = get_preset(preset)
    model = build_model(cfg, seed=seed, with_drafter=False)
    pool = KVPool(cfg, block_size=16, device="cpu", drafter=False)
    gen = torch.Generator().manual_seed(seed)
    states = [SequenceState() for _ in range(batch)]
    prompts = [torch.randint(0, cfg.vocab_size, (context + 2,), generator=gen).tolist() for _ in range(batch)]
    saved = {k: os.environ.get(k) for k in (registry.ENV_VAR, registry.STRICT_VAR, registry.FUSED_VAR)}
    saved_coef = list(mega_mhc._COEF_MODE)
    if fused_coef is not None:  # (the mode is read once per process: set for this count only)
        mega_mhc._COEF_MODE[:] = [(fused_coef, mega_mhc.coef_mode()[1])]
    try:
        if fused not in ("all", "none", "default"):
            raise ValueError(f"fused must be 'all', 'none' or 'default', got {fused!r}")
        os.environ[registry.FUSED_VAR] = "" if fused == "default" else fused
        os.environ[registry.ENV_VAR] = "reference"  # the context, quickly
        step = build_step(cfg, pool, [Chunk(s, p[:context]) for s, p in zip(states, prompts)], "cpu")
        model(step, pool)
        os.environ[registry.ENV_VAR], os.environ[registry.STRICT_VAR] = "cuda", "1"
        if registry.ensure_backend_loaded("cuda") is not None:
            raise RuntimeError(f"the CUDA op set is unavailable: {registry.ensure_backend_loaded('cuda')}")
        # one uncounted decode step first: what is made once per process (rope angle tables,
        # split-K counters) is made there, as in the warm-up before a graph capture
        step = build_step(cfg, pool, [Chunk(s, p[context:context + 1]) for s, p in zip(states, prompts)], "cpu")
        model(step, pool, check=False)
        step = build_step(cfg, pool, [Chunk(s, p[context + 1:]) for s, p in zip(states, prompts)], "cpu")
        counter = LaunchCounter()
        with counter.ranges(model), counter.triton_launches(), _Count(counter):
            model(step, pool, check=False)
    finally:
        mega_mhc._COEF_MODE[:] = saved_coef
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return counter


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--context", type=int, default=24, help="prefilled tokens per sequence")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--detail", action="store_true", help="list the launches of one layer of each kind")
    ap.add_argument("--fused", choices=("all", "none", "default"), default="all",
                    help="DSV41_FUSED: every fused kernel (all), every fused op as its composition (none), or the "
                         "kernels on by default (default)")
    ap.add_argument("--fused-coef", action="store_true",
                    help="the mHC coefficient epilogue inside the main mHC kernels (DSV41_MHC_COEF=fused-narrow)")
    args = ap.parse_args(argv)
    c = decode_step_launches(args.preset, args.context, args.batch, fused=args.fused,
                             fused_coef=True if args.fused_coef else None)
    print(f"launches in one {args.preset} decode step, batch {args.batch}, context {args.context}, "
          f"fused kernels: {args.fused}"
          f"{', coefficients fused' if args.fused_coef else ''}: {c.total}")
    print("| range | layers | launches per layer |\n|---|---|---|")
    for kind, (n, per) in c.kinds().items():
        print(f"| {kind} | {n} | {per:g} |")
    if args.detail:
        shown = set()
        for name in c.by_range:
            kind = name.rsplit(".", 1)[0] if name[-1].isdigit() else name
            if kind in shown:
                continue
            shown.add(kind)
            print(f"\n{name}: " + ", ".join(f"{k} x{v}" for k, v in c.detail[name].most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
