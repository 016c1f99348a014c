"""The op registry: every op has a reference implementation and optional per-backend ones.

Which backend runs an op is decided here and nowhere else:
- `DSV41_BACKEND=reference|cuda|ascend` forces one backend for every op;
- otherwise the device of the op's first tensor argument picks it
  (`cpu` -> reference, `cuda` -> cuda, `npu` -> ascend).
An op the chosen backend lacks falls back to the reference, with one warning naming the op;
under `DSV41_STRICT=1` it raises instead (the device tests run so). The choice is made once per
(op, device type, settings) and cached: a call costs one dictionary lookup.
"""

from __future__ import annotations

import importlib
import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

BACKENDS = ("reference", "cuda", "ascend")
DEVICE_BACKEND = {"cpu": "reference", "cuda": "cuda", "npu": "ascend", "meta": "reference"}
ENV_VAR = "DSV41_BACKEND"
STRICT_VAR = "DSV41_STRICT"
# DSV41_FUSED=all|none|op,op: the fused ops whose backend kernels run; every other fused op runs
# as the composition of ops it stands for. Unset: the fused ops registered `kernel_by_default`,
# those whose kernels matched the reference on the H200 and beat their compositions there
# (benchmarks/fused_kernels.py, 2026-12-01; `unrope_grouped_linear` since 2026-12-04, its one-token
# rows kernel: 18.8-19.5 us against 22.2-22.5 for rope + cuBLAS at the mini width); opt-in:
# `mhc_mix_norm` and `mhc_enter_norm` (tied at one row, lost at eight).
FUSED_VAR = "DSV41_FUSED"
# DSV41_BATCH_INVARIANT=1: ops that have a batch-invariant implementation on the backend
# (`register_invariant`) use it: every row's result is then bitwise independent of how many rows
# the call has and of the other rows (one kernel and one tile configuration for every row
# count, no split-K chosen by the row count, no cuBLAS), so a decode step reproduces the same
# row of an exact prefill. Slower; for numerics checks (greedy decode == prefill argmax).
INVARIANT_VAR = "DSV41_BATCH_INVARIANT"


@dataclass
class Op:
    name: str
    impls: dict[str, Callable] = field(default_factory=dict)
    warned: set[str] = field(default_factory=set)
    # a fused op: the composition of other ops that it stands for (`register_composite`)
    composite: Callable | None = None
    # a fused op whose backend kernel runs when DSV41_FUSED is unset
    kernel_by_default: bool = False
    # backend -> its batch-invariant implementation (`register_invariant`)
    invariant: dict[str, Callable] = field(default_factory=dict)


_OPS: dict[str, Op] = {}
# Loaders for the optional backends: imported the first time a tensor of theirs shows up, so
# `import dsv41` never imports triton or torch_npu. A backend's module (`dsv41.backends.<name>`,
# e.g. `cuda`) registers its loader when imported; that import itself is deferred to first use.
_BACKEND_LOADERS: dict[str, Callable[[], None]] = {}
_LOADED: dict[str, str | None] = {}  # backend -> None when loaded, else the reason it failed
# (op, device type, DSV41_BACKEND, DSV41_STRICT) -> implementation; cleared by `register`
_RESOLVED: dict[tuple, Callable] = {}


class MissingImplementation(RuntimeError):
    """A backend lacks an op under DSV41_STRICT=1 (no silent fallback to the reference)."""


def _registrar(name: str, backend: str, table: str) -> Callable[[Callable], Callable]:
    """A decorator putting `fn` into op `name`'s `table` ("impls" / "invariant") for `backend`."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")

    def deco(fn: Callable) -> Callable:
        getattr(_OPS.setdefault(name, Op(name)), table)[backend] = fn
        _RESOLVED.clear()
        return fn

    return deco


def register(name: str, backend: str = "reference") -> Callable[[Callable], Callable]:
    """Decorator: `fn` implements op `name` on `backend`."""
    return _registrar(name, backend, "impls")


def register_invariant(name: str, backend: str) -> Callable[[Callable], Callable]:
    """Decorator: `fn` is op `name`'s batch-invariant implementation on `backend`, used instead
    of its kernel under DSV41_BATCH_INVARIANT=1."""
    return _registrar(name, backend, "invariant")


def batch_invariant() -> bool:
    """DSV41_BATCH_INVARIANT=1: the batch-invariant implementations run (see INVARIANT_VAR)."""
    return os.environ.get(INVARIANT_VAR, "") not in ("", "0")


@contextmanager
def batch_invariant_mode(on: bool = True) -> Iterator[None]:
    """DSV41_BATCH_INVARIANT set to `on` inside the block, restored after (the dispatch cache
    is keyed by it, so the choice changes with it)."""
    old = os.environ.get(INVARIANT_VAR)
    os.environ[INVARIANT_VAR] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(INVARIANT_VAR, None)
        else:
            os.environ[INVARIANT_VAR] = old


def register_composite(name: str, kernel_by_default: bool = True) -> Callable[[Callable], Callable]:
    """Decorator: `fn` is fused op `name` written as the composition of other ops (through
    `backends.ops`, so each part runs on the caller's backend; or of plain torch ops that run on
    any device, as `table_rows`' integer arithmetic). It is the reference
    implementation, and the implementation on any backend without a fused kernel of its own: a
    composition of that backend's ops is no fallback to the reference (no warning; allowed under
    DSV41_STRICT=1). `kernel_by_default`: a backend's kernel for it runs unless DSV41_FUSED says
    otherwise (False: only when DSV41_FUSED names it)."""

    def deco(fn: Callable) -> Callable:
        register(name)(fn)
        _OPS[name].composite = fn
        _OPS[name].kernel_by_default = kernel_by_default
        return fn

    return deco


def composite_of(name: str) -> Callable | None:
    """The composition fused op `name` stands for (None for an op that is no composition)."""
    op = _OPS.get(name)
    return op.composite if op is not None else None


def register_backend_loader(backend: str, loader: Callable[[], None]) -> None:
    _BACKEND_LOADERS[backend] = loader


def forced_backend() -> str | None:
    v = os.environ.get(ENV_VAR)
    if not v:
        return None
    if v not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={v!r} is not one of {', '.join(BACKENDS)}")
    return v


def backend_for_device(device: torch.device | str) -> str:
    forced = forced_backend()
    if forced:
        return forced
    # a string is parsed by hand: torch.device("npu") only works once torch_npu is imported
    kind = device.split(":")[0] if isinstance(device, str) else torch.device(device).type
    return DEVICE_BACKEND.get(kind, "reference")


def _import_backend_module(backend: str) -> Callable[[], None] | None:
    """Import `dsv41.backends.<backend>` (if it exists) so that it registers its loader."""
    name = f"{__package__}.{backend}"
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
    return _BACKEND_LOADERS.get(backend)


def ensure_backend_loaded(backend: str) -> str | None:
    """Import a backend's implementations once; returns None when usable, else why not."""
    if backend == "reference":
        return None
    if backend not in _LOADED:
        loader = _BACKEND_LOADERS.get(backend) or _import_backend_module(backend)
        if loader is None:
            _LOADED[backend] = "no implementation registered"
        else:
            try:
                loader()
                _LOADED[backend] = None
            except Exception as e:  # a missing optional dependency: say why, fall back
                _LOADED[backend] = f"{type(e).__name__}: {e}"
    return _LOADED[backend]


def fused_kernels() -> set[str]:
    """The fused ops whose backend kernels run: DSV41_FUSED "all" (every fused op), "none" (none,
    each runs as its composition), a comma list of names, or unset (those registered
    `kernel_by_default`); a name that is no fused op is an error naming it."""
    v = os.environ.get(FUSED_VAR)
    fused = {n for n, op in _OPS.items() if op.composite is not None}
    if v is None or not v.strip():
        return {n for n in fused if _OPS[n].kernel_by_default}
    if v.strip() in ("all", "none"):
        return fused if v.strip() == "all" else set()
    names = {n.strip() for n in v.split(",") if n.strip()}
    if names - fused:
        raise ValueError(f"{FUSED_VAR}: {', '.join(sorted(names - fused))} not a fused op "
                         f"(fused ops: {', '.join(sorted(fused))})")
    return names


def resolve(name: str, backend: str) -> tuple[Callable, str, str]:
    """(implementation, backend actually used, reason) for op `name` on `backend`."""
    op = _OPS.get(name)
    if op is None:
        raise KeyError(f"unknown op {name!r}")
    if backend == "reference":
        return op.impls["reference"], "reference", "reference backend"
    why = ensure_backend_loaded(backend)
    if why is None and op.composite is not None and name not in fused_kernels():
        return op.composite, backend, f"composition of {backend} ops (its kernel: {FUSED_VAR}=all or its name)"
    if why is None and backend in op.impls:
        return op.impls[backend], backend, f"{backend} kernel"
    if why is None and op.composite is not None:
        return op.composite, backend, f"composition of {backend} ops"
    reason = f"{backend} unavailable ({why})" if why else f"no {backend} implementation"
    return op.impls["reference"], "reference", f"fallback: {reason}"


_UNAVAILABLE_WARNED: set[str] = set()  # backends whose "unavailable" warning was given


def _warn_unavailable_once(backend: str) -> bool:
    """One warning per process for a backend that cannot load at all (e.g. forced with
    DSV41_BACKEND on a machine without it), rather than one per op; True when it applies."""
    why = _LOADED.get(backend)
    if backend == "reference" or why is None:
        return False
    if backend not in _UNAVAILABLE_WARNED:
        _UNAVAILABLE_WARNED.add(backend)
        how = f"{ENV_VAR}={backend}" if forced_backend() == backend else f"the {backend} backend"
        warnings.warn(f"dsv41: {how}: the {backend} backend is unavailable ({why}); every op uses the reference",
                      RuntimeWarning, stacklevel=4)
    return True


def strict() -> bool:
    """DSV41_STRICT=1: a backend lacking an op raises instead of falling back to the reference."""
    return os.environ.get(STRICT_VAR, "") not in ("", "0")


def _choose(name: str, backend: str) -> Callable:
    fn, used, reason = resolve(name, backend)
    if used != backend:
        if strict():
            raise MissingImplementation(f"dsv41: op '{name}' has no usable {backend} implementation ({reason}) "
                                        f"and {STRICT_VAR}=1 forbids the reference fallback")
        if _warn_unavailable_once(backend):
            return fn
        op = _OPS[name]
        if backend not in op.warned:
            op.warned.add(backend)
            warnings.warn(f"dsv41: op '{name}' has no usable {backend} implementation; using the reference ({reason})",
                          RuntimeWarning, stacklevel=4)
    return fn


def _choose_invariant(name: str, backend: str) -> Callable:
    """Under DSV41_BATCH_INVARIANT=1: the backend's batch-invariant implementation of the op when
    it has one (and the backend loads), else the usual choice (ops whose kernels are row-local
    as they are: elementwise, per-row or per-group)."""
    op = _OPS.get(name)
    loaded = ensure_backend_loaded(backend) is None  # (loading registers the invariant implementations)
    if op is not None and loaded and backend in op.invariant:
        return op.invariant[backend]
    return _choose(name, backend)


def dispatch(name: str, device: torch.device | str) -> Callable:
    """The implementation of op `name` for tensors on `device`, resolved once per (op, device
    type, DSV41_BACKEND, DSV41_STRICT, DSV41_FUSED, DSV41_BATCH_INVARIANT) and cached."""
    kind = device.split(":")[0] if isinstance(device, str) else device.type
    env = os.environ
    key = (name, kind, env.get(ENV_VAR), env.get(STRICT_VAR), env.get(FUSED_VAR), env.get(INVARIANT_VAR))
    fn = _RESOLVED.get(key)
    if fn is None:
        choose = _choose_invariant if batch_invariant() else _choose
        fn = _RESOLVED[key] = choose(name, backend_for_device(kind))
    return fn


def op_names() -> list[str]:
    return sorted(_OPS)


def reset_warnings() -> None:
    """Forget the warnings given and the cached choices (the next call resolves and warns again)."""
    _RESOLVED.clear()
    for op in _OPS.values():
        op.warned.clear()
    _UNAVAILABLE_WARNED.clear()
