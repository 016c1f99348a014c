"""The second device stream (`Transformer.overlap_streams`: each MoE's shared expert beside its
routed experts, each indexed layer's compressor and top-k beside its projections, the Engram
layers' values from the step's start): the same arithmetic, so the same logits and tokens with it
on or off."""

from __future__ import annotations

import pytest
import torch
from dsv41.core.engine import Engine, SamplingParams, SingleSequence
from dsv41.core.weights import build_model

from _util import rand_prompt


def recording_platform(log: list, kind: str = "cpu"):
    """A platform of `kind` on the CPU that runs forked work at once (as CPU does) and records its
    forks and joins ("fork 1", "join 1") in `log`."""
    from dsv41.backends.platform import Platform

    class Recording(Platform):
        def fork(self, fn, lane=0, reads=()):
            log.append(f"fork {lane}")
            return fn()

        def join(self, lane=0, out=None):
            log.append(f"join {lane}")

    return Recording(kind, torch.device("cpu"))


def test_overlap_gives_the_same_logits(tiny_cfg, fresh_seed, rng):
    model = build_model(tiny_cfg, seed=fresh_seed, with_drafter=False)
    ids = rand_prompt(tiny_cfg, 12, rng)
    want = SingleSequence(model).feed(ids, all_logits=True)
    model.overlap_streams(True)
    assert all(blk.ffn.overlap_shared and blk.attn.overlap_indexer for blk in model.layers) and model.overlap_engram
    got = SingleSequence(model).feed(ids, all_logits=True)
    assert want.abs().max() > 0 and torch.equal(got, want)
    with pytest.raises(ValueError, match="unknown overlap parts"):
        model.overlap_streams(True, parts=("indexer", "router"))


def test_engram_values_are_forked_at_the_step_start(tiny_cfg, fresh_seed, rng):
    """With "engram" on, each Engram layer's values (lookup + wkv) but the entry block's are forked
    on ENGRAM_LANE before the first block runs, and joined right before that layer's gate; off
    (the default on every platform until measured), nothing is forked. Recorded by a CPU platform
    that runs forked work at once; the logits stay the sequential ones. A CED prefill selects the
    decoder's rows of forked values too."""
    from dsv41.backends import ops
    from dsv41.backends.platform import ENGRAM_LANE

    log = []

    model = build_model(tiny_cfg, seed=fresh_seed, with_drafter=False)
    ids = rand_prompt(tiny_cfg, 12, rng)
    want = SingleSequence(model).feed(ids, all_logits=True)
    want_ced = SingleSequence(model).feed(ids, decoder_from=6, all_logits=True)
    model._plat = recording_platform(log)
    gate = ops.engram_gate

    def logged_gate(*a, **k):
        log.append("gate")
        return gate(*a, **k)

    engram_layers = [blk.layer_id for blk in model.layers if blk.engram is not None]
    forked = [i for i in engram_layers if i != model.layers[0].layer_id]
    assert forked, engram_layers  # (the tiny preset has Engram past the entry block)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops, "engram_gate", logged_gate)
        SingleSequence(model).feed(ids, all_logits=True)
        assert f"fork {ENGRAM_LANE}" not in log, log  # the default: off
        model.overlap_streams(True, parts=("engram",))
        log.clear()
        got = SingleSequence(model).feed(ids, all_logits=True)
        seen = list(log)
        assert torch.equal(SingleSequence(model).feed(ids, decoder_from=6, all_logits=True), want_ced)  # CED
    assert torch.equal(got, want)
    lane = [e for e in seen if e in (f"fork {ENGRAM_LANE}", f"join {ENGRAM_LANE}", "gate")]
    n = len(forked)
    entry = ["gate"] if model.layers[0].engram is not None else []
    assert lane == [f"fork {ENGRAM_LANE}"] * n + entry + [f"join {ENGRAM_LANE}", "gate"] * n, seen


def test_full_layers_fork_their_compressor_from_the_layer_input(tiny_cfg, fresh_seed, rng):
    """With the indexer overlapped, a Full layer forks its compressor (lane 1) before its query
    projection's norm, then its top-k (lane 0), whose scores join lane 1 before the main stream
    joins lane 0; a Reindex layer forks its top-k alone, after the norm. The order is recorded by
    a CPU platform that runs forked work at once (as CPU does), and the logits stay the
    sequential ones."""

    log = []

    model = build_model(tiny_cfg, seed=fresh_seed, with_drafter=False)
    ids = rand_prompt(tiny_cfg, 12, rng)
    want = SingleSequence(model).feed(ids, all_logits=True)
    model.overlap_streams(True, parts=("indexer",))
    for blk in model.layers:
        blk.attn._plat = recording_platform(log)
        norm = blk.attn.q_norm.forward
        blk.attn.q_norm.forward = lambda x, norm=norm: (log.append("q_norm"), norm(x))[1]
    got = SingleSequence(model).feed(ids, all_logits=True)
    assert torch.equal(got, want)
    forms = {"full": ["fork 1", "q_norm", "fork 0", "join 1", "join 0"], "reindex": ["q_norm", "fork 0", "join 0"],
             "none": ["q_norm"]}
    seen, i = [], 0
    while i < len(log):  # the log cut into per-layer blocks of the three forms
        kind = next((k for k, f in forms.items() if log[i:i + len(f)] == f), None)
        assert kind is not None, (i, log)
        seen.append(kind)
        i += len(forms[kind])
    assert {"full", "reindex"} <= set(seen), seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_overlap_in_decode_graphs_gives_the_same_tokens(tiny_cfg, fresh_seed, rng):
    """The fork / join of the second stream inside captured decode steps."""
    model = build_model(tiny_cfg, seed=fresh_seed, device="cuda", with_drafter=False)
    prompts = [rand_prompt(tiny_cfg, n, rng).tolist() for n in (4, 7)]

    def tokens():
        engine = Engine(model, max_batch=2, graphs=True, max_model_len=64)
        return [r.token_ids for r in engine.generate_batch([(p, SamplingParams(max_new_tokens=10), None)
                                                            for p in prompts])]

    model.overlap_streams(False)
    want = tokens()
    model.overlap_streams(None)  # CUDA's default: on at decode sizes
    assert all(blk.ffn.overlap_shared is None and blk.attn.overlap_indexer is None for blk in model.layers)
    assert tokens() == want
    model.overlap_streams(True)
    assert tokens() == want
    model.overlap_streams(False, parts=("shared",))  # the indexer alone on the second stream
    assert tokens() == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fork_keeps_the_tensors_it_reads(fresh_seed):
    """A tensor the calling stream made, read on a side lane and dropped by the caller before the
    join (the Engram row ids): named in `reads`, its memory is not handed to the calling stream's
    next tensor while the lane still waits to read it. The lane is held back (a spin kernel) so
    the caller's next tensor of the same size is filled before the lane reads."""
    from dsv41.backends.platform import cached_platform

    plat = cached_platform(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    src = torch.randint(1, 1 << 20, (1 << 20,), device="cuda", generator=gen)
    want = src * 3
    torch.cuda.synchronize()

    def side(t):
        torch.cuda._sleep(20_000_000)  # ~10 ms at H100 clocks: the caller runs ahead meanwhile
        return t * 3

    out = plat.fork(lambda t=src: side(t), lane=6, reads=(src,))
    held = src.data_ptr()
    del src
    after = torch.full((1 << 20,), -7, dtype=want.dtype, device="cuda")  # same size: the freed block
    plat.join(lane=6, out=out)
    torch.cuda.synchronize()
    assert after.data_ptr() != held, "the lane's input was handed to the caller's next tensor"
    assert torch.equal(out, want) and int(after[0]) == -7


def test_tile_counters_are_kept_per_stream(monkeypatch):
    """`tile_counters` hands each stream of a device its own zeroed buffer (two streams running
    counter kernels at once must never bump the same counters; on Ascend every stream used to
    share one), and refuses to make one inside a graph capture."""
    from dsv41.npu_ops.triton import launch

    class StreamsPlatform:  # the two things tile_counters asks a platform
        key, capturing = 7, False

        def stream_key(self):
            return self.key

        def is_capturing(self):
            return self.capturing

    plat = StreamsPlatform()
    dev = torch.device("cpu")
    monkeypatch.setattr(launch, "_PLATFORMS", {(dev.type, dev.index): plat})
    monkeypatch.setattr(launch, "_COUNTERS", {})
    main = launch.tile_counters(dev, 8)
    assert launch.tile_counters(dev, 8).data_ptr() == main.data_ptr()  # one buffer per stream, reused
    plat.key = 8
    aux = launch.tile_counters(dev, 8)
    assert aux.data_ptr() != main.data_ptr() and not aux.any()
    plat.key, plat.capturing = 9, True
    with pytest.raises(RuntimeError, match="before the graph capture"):
        launch.tile_counters(dev, 8)
    plat.key = 8  # a stream whose buffer exists may be used inside a capture
    assert launch.tile_counters(dev, 8).data_ptr() == aux.data_ptr()


def test_mhc_mixes_join_the_coefficient_lane_when_it_is_on(tiny_cfg, fresh_seed, rng, monkeypatch):
    """On a CUDA platform (the default, DSV41_MHC_COEF_LANE unset) every mHC step joins
    MHC_COEF_LANE (where the device forks the coefficient epilogue; here a recording platform
    runs it in order) before reading its coefficients, and the logits stay the sequential ones;
    with DSV41_MHC_COEF_LANE=0, or on a platform of another kind, nothing joins that lane."""
    from dsv41.backends import platform

    log = []

    model = build_model(tiny_cfg, seed=fresh_seed, with_drafter=False)
    ids = rand_prompt(tiny_cfg, 12, rng)
    want = SingleSequence(model).feed(ids, all_logits=True)
    for kind, env, joins in (("cuda", "0", False), ("npu", None, False), ("cuda", None, True)):
        for blk in model.layers:
            blk._plat = recording_platform(log, kind)
        monkeypatch.setattr(platform, "_SWITCHES", {})  # (the switch is read once per process)
        if env is not None:
            monkeypatch.setenv("DSV41_MHC_COEF_LANE", env)
        else:
            monkeypatch.delenv("DSV41_MHC_COEF_LANE", raising=False)
        log.clear()
        got = SingleSequence(model).feed(ids, all_logits=True)
        assert torch.equal(got, want), (kind, env)
        if joins:  # (every mix of every feed step)
            assert log.count(f"join {platform.MHC_COEF_LANE}") >= 2 * len(model.layers), (kind, env)
        else:
            assert f"join {platform.MHC_COEF_LANE}" not in log, (kind, env)


def test_mhc_coef_lane_forks_only_inside_its_scope(monkeypatch):
    """The mHC coefficient launch goes to its side lane only inside `mhc_coef_lane_scope` (the
    model's forward, which joins the lane before reading coefficients): an `ops.mhc_mix` /
    `ops.mhc_mixes` called on its own returns coefficients ready in stream order. The scope
    nests, ends with its block (also on an error), is per thread, and the lane stays off where
    its switch or the device kind says so."""
    import threading

    from dsv41.backends import platform

    monkeypatch.setattr(platform, "_SWITCHES", {"DSV41_MHC_COEF_LANE": True})
    assert not platform.mhc_coef_lane_forks("cuda")
    with platform.mhc_coef_lane_scope():
        assert platform.mhc_coef_lane_forks("cuda") and not platform.mhc_coef_lane_forks("npu")
        with platform.mhc_coef_lane_scope():
            assert platform.mhc_coef_lane_forks("cuda")
        assert platform.mhc_coef_lane_forks("cuda")  # (still inside the outer scope)
        seen = []
        worker = threading.Thread(target=lambda: seen.append(platform.mhc_coef_lane_forks("cuda")))
        worker.start()
        worker.join()
        assert seen == [False]  # another thread is outside this thread's scope
        monkeypatch.setattr(platform, "_SWITCHES", {"DSV41_MHC_COEF_LANE": False})
        assert not platform.mhc_coef_lane_forks("cuda")
        monkeypatch.setattr(platform, "_SWITCHES", {"DSV41_MHC_COEF_LANE": True})
    assert not platform.mhc_coef_lane_forks("cuda")
    with pytest.raises(RuntimeError, match="inside"):
        with platform.mhc_coef_lane_scope():
            raise RuntimeError("inside")
    assert not platform.mhc_coef_lane_forks("cuda")

    @platform.mhc_coef_lane_scope()
    def decorated():
        return platform.mhc_coef_lane_forks("cuda")

    assert decorated() and not platform.mhc_coef_lane_forks("cuda")
    # the join follows the same rule: outside the scope nothing was forked, and inside a graph
    # capture a wait on a lane that nothing in the capture forked invalidates the capture (the
    # DSpark draft graph, whose stages mix outside the model's forward)
    log = []
    plat = recording_platform(log, "cuda")
    platform.join_mhc_coef(plat, None)
    assert log == []
    with platform.mhc_coef_lane_scope():
        platform.join_mhc_coef(plat, None)
    assert log == [f"join {platform.MHC_COEF_LANE}"]
