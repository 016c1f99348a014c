"""Dispatch: device -> backend, the DSV41_BACKEND override, the one-time fallback warning, and
the guards that keep torch_npu / triton out of `import dsv41`."""

import subprocess
import sys
import warnings

import pytest
import torch

from dsv41.backends import ops, registry
from dsv41.backends.platform import Platform, platform_for


@pytest.mark.parametrize("device, backend", [("cpu", "reference"), ("cuda", "cuda"), ("npu", "ascend"),
                                             ("meta", "reference")])
def test_device_picks_backend(device, backend, monkeypatch):
    monkeypatch.delenv("DSV41_BACKEND", raising=False)
    assert registry.backend_for_device(device) == backend


def test_env_override_and_bad_value(monkeypatch):
    monkeypatch.setenv("DSV41_BACKEND", "ascend")
    assert registry.backend_for_device("cpu") == "ascend"
    monkeypatch.setenv("DSV41_BACKEND", "tpu")
    with pytest.raises(ValueError, match="DSV41_BACKEND"):
        registry.backend_for_device("cpu")


def test_unavailable_forced_backend_warns_once_and_matches_reference(monkeypatch):
    """DSV41_BACKEND naming a backend that cannot load: one warning for the process (not one
    per op), and the reference's results."""
    monkeypatch.setenv("DSV41_BACKEND", "ascend")  # no torch_npu here: every op falls back
    registry.reset_warnings()
    x, w = torch.randn(3, 32), torch.rand(32) + 0.5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = ops.rms_norm(x, w, 1e-6)
        b = ops.rms_norm(x, w, 1e-6)
        ops.rope(x, torch.ones(3, 4), torch.zeros(3, 4))
    msgs = [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)]
    assert len(msgs) == 1, msgs
    assert "DSV41_BACKEND=ascend" in msgs[0] and "torch_npu not importable" in msgs[0]
    monkeypatch.delenv("DSV41_BACKEND")
    assert torch.equal(a, b) and torch.equal(a, ops.rms_norm(x, w, 1e-6))


def test_resolve_reports_why(monkeypatch):
    fn, used, why = registry.resolve("sparse_attention", "ascend")
    assert used == "reference" and "torch_npu not importable" in why
    with pytest.raises(KeyError):
        registry.resolve("no_such_op", "reference")


def test_import_dsv41_loads_no_optional_backend():
    code = ("import sys, torch, dsv41, dsv41.core.model, dsv41.core.engine, dsv41.backends.ops, dsv41.deploy.cli;"
            "from dsv41.backends import ops; ops.rms_norm(torch.ones(2, 32), torch.ones(32), 1e-6);"
            "bad = [m for m in ('torch_npu', 'triton', 'vllm', 'mindspore') if m in sys.modules];"
            "print(bad); sys.exit(1 if bad else 0)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_backends_command_names_the_ascend_reason():
    p = subprocess.run([sys.executable, "-m", "dsv41.deploy.cli", "backends", "--json"], capture_output=True,
                       text=True, timeout=120)
    import json

    out = json.loads(p.stdout)
    assert out["backends"]["reference"] == "available"
    assert out["backends"]["ascend"].startswith("unavailable (torch_npu not importable")
    assert set(out["ops"]) == set(registry.op_names())


def test_cpu_platform_is_a_no_op_stand_in():
    p = platform_for("cpu")
    assert isinstance(p, Platform) and p.kind == "cpu" and p.backend == "reference" and p.num_workers() == 1
    s, e = p.stream(), p.event()
    with p.use_stream(s):
        e.record(s)
        s.wait_event(e)
    p.synchronize()
    assert p.graph_class() is None and p.pinned_empty((2, 3), torch.float32).shape == (2, 3)
    with pytest.raises(RuntimeError, match="npu"):
        platform_for("npu")


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_host_copies_without_a_wait_keep_their_values(device):
    """`to_device` / `host_to_device` (page-locked staging, non-blocking copies): the values
    arrive, in every dtype a step sends, also when the host tensor is changed or freed at once
    after the call (the staging copy is the one in flight)."""
    from dsv41.backends.platform import host_to_device, to_device

    for dtype in (torch.long, torch.bool, torch.float32):
        src = (torch.arange(1000) % 7).to(dtype)
        want = src.clone()
        got = to_device(src, device)
        if device != "cpu":  # (on the CPU the host tensor itself is returned)
            src.zero_()  # the caller reuses its host tensor right away
        dst = torch.zeros(2, 1000, dtype=dtype, device=device)
        host_to_device(dst[1], want.clone())  # a temporary source, freed after the call
        assert torch.equal(got.cpu(), want) and torch.equal(dst[1].cpu(), want) and not dst[0].any()
        assert (got is src) == (device == "cpu")  # nothing to copy on the CPU


def test_dispatch_resolves_once_per_op_and_device(monkeypatch):
    monkeypatch.delenv("DSV41_BACKEND", raising=False)
    monkeypatch.delenv("DSV41_STRICT", raising=False)
    seen = []
    real = registry.resolve
    monkeypatch.setattr(registry, "resolve", lambda name, backend: (seen.append((name, backend)), real(name, backend))[1])
    registry.reset_warnings()
    x, w = torch.randn(3, 32), torch.rand(32) + 0.5
    for _ in range(3):
        ops.rms_norm(x, w, 1e-6)
        ops.rope(x, torch.ones(3, 4), torch.zeros(3, 4))
    assert seen == [("rms_norm", "reference"), ("rope", "reference")]
    monkeypatch.setenv("DSV41_BACKEND", "reference")  # a changed setting is a new choice
    ops.rms_norm(x, w, 1e-6)
    assert len(seen) == 3


def test_strict_raises_instead_of_falling_back(monkeypatch):
    monkeypatch.setenv("DSV41_BACKEND", "ascend")  # no torch_npu here
    monkeypatch.setenv("DSV41_STRICT", "1")
    registry.reset_warnings()
    with pytest.raises(registry.MissingImplementation, match="op 'rms_norm' has no usable ascend.*DSV41_STRICT"):
        ops.rms_norm(torch.randn(2, 32), torch.ones(32), 1e-6)
    monkeypatch.setenv("DSV41_BACKEND", "reference")  # the reference itself is always allowed
    assert ops.rms_norm(torch.ones(2, 32), torch.ones(32), 1e-6).shape == (2, 32)


def test_fused_kernel_choice(monkeypatch):
    """Unset, DSV41_FUSED runs the kernels of the fused ops registered `kernel_by_default` (the
    others as the compositions they stand for); "all", "none" and a list choose explicitly; a name
    that is no fused op is one clear error."""
    fused = sorted(n for n, op in registry._OPS.items() if op.composite is not None)
    on = [n for n in fused if registry._OPS[n].kernel_by_default]
    off = [n for n in fused if not registry._OPS[n].kernel_by_default]
    # off: the kernels that tied or lost on the H200
    assert "unrope_grouped_linear" in on and off == ["mhc_enter_norm", "mhc_mix_norm"], (on, off)
    kernel = object()
    for name in (on[0], off[0]):
        monkeypatch.setitem(registry._OPS[name].impls, "cuda", kernel)
    monkeypatch.setitem(registry._LOADED, "cuda", None)  # the backend counts as loaded
    monkeypatch.delenv("DSV41_FUSED", raising=False)
    assert registry.resolve(on[0], "cuda")[0] is kernel
    fn, used, why = registry.resolve(off[0], "cuda")
    assert fn is registry.composite_of(off[0]) and used == "cuda" and "DSV41_FUSED" in why
    for value in ("all", f" {off[0]} ,{on[0]}"):
        monkeypatch.setenv("DSV41_FUSED", value)
        assert registry.resolve(off[0], "cuda")[0] is kernel and registry.resolve(on[0], "cuda")[0] is kernel
    for value in ("none", off[0]):  # "none", or a list without it, composes the default-on op
        monkeypatch.setenv("DSV41_FUSED", value)
        assert registry.resolve(on[0], "cuda")[0] is registry.composite_of(on[0])
        assert (registry.resolve(off[0], "cuda")[0] is kernel) == (value == off[0])
    monkeypatch.setenv("DSV41_FUSED", "rms_norm")
    with pytest.raises(ValueError, match="DSV41_FUSED: rms_norm not a fused op"):
        registry.resolve(on[0], "cuda")


def test_freeze_host_objects_moves_live_objects_out_of_collections():
    """What `dsv41 run` does on a device after its warm-up: the objects alive then are frozen (no
    full collection walks them again); cycles made later are still collected."""
    import gc
    import weakref

    from dsv41.backends.platform import freeze_host_objects

    class Node:
        pass

    gc.unfreeze()
    try:
        keep = [[i] for i in range(1000)]  # noqa: F841  (alive across the freeze)
        freeze_host_objects()
        assert gc.get_freeze_count() >= 1000
        n = Node()
        n.self = n  # a cycle made after the freeze: only the collector frees it
        ref = weakref.ref(n)
        del n
        assert ref() is not None
        gc.collect()
        assert ref() is None
    finally:
        gc.unfreeze()  # (the test session builds many models: nothing stays frozen after it)


def test_serving_host_threads(monkeypatch):
    """What `dsv41 run` (and e2e.py's timed phases) set on a device once the model is loaded:
    torch's intra-op CPU threads from DSV41_HOST_THREADS (default 1), the count before returned;
    a bad value is one error naming the variable, raised by `dsv41 run` before anything loads."""
    import torch

    from dsv41.backends import platform
    from dsv41.deploy import cli

    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("DSV41_HOST_THREADS", raising=False)
        assert platform.serving_host_threads() == 1
        monkeypatch.setenv("DSV41_HOST_THREADS", "3")
        assert platform.limit_host_threads() == before
        assert torch.get_num_threads() == 3
        for bad in ("0", "-2", "two", ""):
            monkeypatch.setenv("DSV41_HOST_THREADS", bad)
            with pytest.raises(ValueError, match="DSV41_HOST_THREADS must be a positive integer"):
                platform.serving_host_threads()
            with pytest.raises(cli.UserError, match="DSV41_HOST_THREADS"):
                cli._check_host_threads(torch.device("meta"))  # (any device but the CPU)
            cli._check_host_threads(torch.device("cpu"))  # the CPU reference keeps its threads
    finally:
        torch.set_num_threads(before)
    assert "CPUs (affinity)" in platform.host_cpus()
