"""Engram host offload (`Transformer.offload_engram`): the tables stay in host memory whatever
device the model moves to, and lookups through them (host gather, or on CUDA the kernel reading
page-locked memory in place) give exactly the on-device model's logits."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from dsv41.core.engine import SingleSequence
from dsv41.core.model import EngramEmbed
from dsv41.core.weights import build_model
from dsv41.deploy.checkpoint import load_checkpoint, load_checkpoint_weights, make_checkpoint
from dsv41.deploy.convert import convert

from _util import rand_prompt


def engram_tables(model) -> list[EngramEmbed]:
    return [m for m in model.modules() if isinstance(m, EngramEmbed)]


def logits(model, ids: torch.Tensor, n_prefill: int) -> torch.Tensor:
    """Every position's logits: a prefill chunk, then one-token steps (fresh rows every step)."""
    cache = SingleSequence(model)
    out = [cache.feed(ids[:n_prefill], all_logits=True)]
    out += [cache.feed(ids[k:k + 1], all_logits=True) for k in range(n_prefill, ids.numel())]
    return torch.cat(out)


def test_offloaded_model_equals_on_device_model(tiny_cfg, fresh_seed, rng):
    ids = rand_prompt(tiny_cfg, 24, rng)
    on_device = build_model(tiny_cfg, seed=fresh_seed)
    offloaded = build_model(tiny_cfg, seed=fresh_seed, engram_offload=True)
    assert all(e.offloaded and e.weight.device.type == "cpu" for e in engram_tables(offloaded))
    assert len(engram_tables(offloaded)) == len(tiny_cfg.engram_layer_ids)
    assert torch.equal(logits(offloaded, ids, 16), logits(on_device, ids, 16))


def test_int8_tables_offloaded_from_a_checkpoint(tiny_cfg, fresh_seed, tmp_path, rng):
    make_checkpoint(tiny_cfg, tmp_path / "a", seed=fresh_seed)
    convert(tmp_path / "a", tmp_path / "i8", 1, engram_dtype="int8", progress=False)
    cfg, on_device, tok = load_checkpoint(tmp_path / "i8")
    offloaded = load_checkpoint_weights(tmp_path / "i8", cfg, "cpu", tok, engram_offload=True)
    assert all(e.weight.dtype == torch.int8 and e.offloaded for e in engram_tables(offloaded))
    ids = rand_prompt(cfg, 20, rng)
    assert torch.equal(logits(offloaded, ids, 12), logits(on_device, ids, 12))


def test_tables_stay_on_host_when_the_model_moves(tiny_cfg, fresh_seed):
    model = build_model(tiny_cfg, seed=fresh_seed, engram_offload=True)
    before = {id(e): (e.weight.clone(), e.scale.clone()) for e in engram_tables(model)}
    model.to("meta")  # stands in for `.to("cuda")` / `.to("npu")` on this CPU-only machine
    model.to(torch.float16)  # a dtype cast must not touch the stored formats either
    for e in engram_tables(model):
        w, s = before[id(e)]
        assert e.weight.device.type == "cpu" and torch.equal(e.weight.view(torch.uint8), w.view(torch.uint8))
        assert e.scale.device.type == "cpu" and torch.equal(e.scale.view(torch.uint8), s.view(torch.uint8))
    assert model.embed.weight.is_meta  # ... while the rest of the model did move


@pytest.mark.parametrize("storage", ["fp8", "int8"])
def test_gathered_rows_give_the_same_lookup(storage, rng):
    """The gather path (`gather_rows_to`: the step's rows taken where the table is, then looked
    up by position) returns exactly the lookup in the whole table."""
    from dsv41.backends.reference.basic import engram_lookup, gather_rows_to
    from dsv41.backends.reference.quant import fp8_quant, int8_row_quant

    src = torch.randn(300, 64, generator=rng)
    table, scale = fp8_quant(src) if storage == "fp8" else int8_row_quant(src)
    rows = torch.randint(0, 300, (7, 5), generator=rng)
    want = engram_lookup(table, scale, rows)
    got = engram_lookup(*gather_rows_to(table, scale, rows))
    assert want.abs().max() > 0 and torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_run_flag_gives_the_same_tokens(tmp_path):
    def run(*extra):
        r = subprocess.run([sys.executable, "-m", "dsv41.deploy.cli", "run", "--preset", "tiny", "--seed", "11",
                            "--prompt-ids", "0,5,17,42,99,7", "--max-new-tokens", "6", "--json", *extra],
                           capture_output=True, text=True, timeout=300, check=False)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["token_ids"]

    assert run("--engram-offload") == run()


def test_rows_are_fetched_ahead_once_per_step(tiny_cfg, fresh_seed, rng, monkeypatch):
    """The default offload gathers every Engram layer's rows once per step, before the layers
    run (one host gather and one copy issue per forward, not one per layer)."""
    from dsv41.core.engram import EngramPrefetch

    model = build_model(tiny_cfg, seed=fresh_seed, engram_offload=True)
    calls = []
    for name in ("gather", "issue"):
        orig = getattr(EngramPrefetch, name)
        monkeypatch.setattr(EngramPrefetch, name, lambda self, *a, _o=orig, _n=name: calls.append(_n) or _o(self, *a))
    logits(model, rand_prompt(tiny_cfg, 12, rng), 8)
    assert calls == ["gather", "issue"] * 5
    assert set(model.engram_prefetch().layers) == set(tiny_cfg.engram_layer_ids)


def test_in_place_mode_and_bad_mode(tiny_cfg, fresh_seed, rng):
    ids = rand_prompt(tiny_cfg, 16, rng)
    on_device = build_model(tiny_cfg, seed=fresh_seed)
    with torch.device("meta"):
        from dsv41.core.model import Transformer

        model = Transformer(tiny_cfg)
    with pytest.raises(ValueError, match="fetch must be"):
        model.offload_engram("cpu", "later")
    model.offload_engram("cpu", "in_place")
    from dsv41.core.weights import load_into, materialize

    model = load_into(materialize(model, "cpu"), on_device.state_dict())
    assert model.engram_prefetch() is None
    assert torch.equal(logits(model, ids, 10), logits(on_device, ids, 10))


def decode_tokens(model, prompts, graphs: bool, n_new: int = 6):
    from dsv41.core.engine import Engine, SamplingParams

    engine = Engine(model, max_batch=len(prompts), graphs=graphs, max_model_len=64)
    res = engine.generate_batch([(p, SamplingParams(max_new_tokens=n_new), None) for p in prompts])
    return [r.token_ids for r in res]


def test_decode_graph_runner_with_rows_fetched_ahead(tiny_cfg, fresh_seed, rng):
    """Decode graphs over an offloaded model (on CPU the runner replays its padded static
    batches eagerly, refilling the host n-grams) give the on-device model's tokens."""
    prompts = [rand_prompt(tiny_cfg, n, rng).tolist() for n in (5, 9, 3)]
    on_device = build_model(tiny_cfg, seed=fresh_seed)
    offloaded = build_model(tiny_cfg, seed=fresh_seed, engram_offload=True)
    assert decode_tokens(offloaded, prompts, graphs=True) == decode_tokens(on_device, prompts, graphs=False)


def cuda_offloaded(cfg, on_device, pinned: bool, fetch: str):
    from dsv41.core.model import Transformer
    from dsv41.core.weights import load_into, materialize

    with torch.device("meta"):
        model = Transformer(cfg)
    model.offload_engram("cuda", fetch)
    for e in engram_tables(model):
        e.to_host(pinned)
    model = load_into(materialize(model, "cuda"), {k: v.cpu() for k, v in on_device.state_dict().items()})
    for e in engram_tables(model):
        assert e.weight.device.type == "cpu" and e.weight.is_pinned() == pinned
    return model


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fetch", ["ahead", "in_place"])
@pytest.mark.parametrize("pinned", [True, False])
def test_cuda_offload_equals_on_device(tiny_cfg, fresh_seed, rng, pinned, fetch):
    """Host tables on a CUDA model, page-locked or pageable: rows fetched ahead (gathered on the
    host, copied on a side stream), or looked up by the backend (page-locked: the Triton kernel
    reads them in place; pageable: gathered in the lookup); against the tables in device memory."""
    ids = rand_prompt(tiny_cfg, 24, rng).cuda()
    on_device = build_model(tiny_cfg, seed=fresh_seed, device="cuda")
    model = cuda_offloaded(tiny_cfg, on_device, pinned, fetch)
    assert torch.equal(logits(model, ids, 16), logits(on_device, ids, 16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pinned", [True, False])
def test_cuda_decode_graphs_with_rows_fetched_ahead(tiny_cfg, fresh_seed, rng, pinned):
    """Captured decode steps copy the rows from the fetch-ahead's staging buffers, which the
    runner refills before each replay: the tokens of the on-device model's graphs."""
    prompts = [rand_prompt(tiny_cfg, n, rng).tolist() for n in (5, 9, 3)]
    on_device = build_model(tiny_cfg, seed=fresh_seed, device="cuda")
    model = cuda_offloaded(tiny_cfg, on_device, pinned, "ahead")
    assert decode_tokens(model, prompts, graphs=True, n_new=12) == decode_tokens(on_device, prompts, graphs=True, n_new=12)


def test_fetch_ahead_never_waits_on_an_event_recorded_in_a_capture(tiny_cfg, fresh_seed, rng):
    """CUDA refuses a host wait on an event recorded while capturing a graph (seen on an H200):
    after a captured step, the next host gather of the same buffers must not wait on it, while
    an event recorded outside a capture is still waited on before its buffers are refilled."""
    from dsv41.backends.platform import Platform

    log = []

    class Event:
        def __init__(self, platform):
            self.platform, self.captured = platform, False

        def record(self, stream=None):
            self.captured = self.platform.capturing

        def synchronize(self):
            assert not self.captured, "host wait on an event recorded during a capture"
            log.append("wait")

    class CapturePlatform(Platform):
        capturing = False

        def event(self):
            return Event(self)

        def is_capturing(self):
            return self.capturing

    model = build_model(tiny_cfg, seed=fresh_seed, engram_offload=True)
    prefetch = model.engram_prefetch()
    prefetch.platform = CapturePlatform("cpu", torch.device("cpu"))
    ids = rand_prompt(tiny_cfg, 4, rng).tolist()
    ngrams = torch.tensor([[ids[p - s] if p >= s else -1 for s in range(4)] for p in range(4)])
    no_image = torch.zeros(4, 4, dtype=torch.bool)
    prefetch.platform.capturing = True
    prefetch.gather(ngrams, no_image)
    captured = prefetch.issue()
    prefetch.platform.capturing = False
    prefetch.gather(ngrams, no_image)  # after the capture: nothing to wait on
    assert log == []
    eager = prefetch.issue()
    prefetch.gather(ngrams, no_image)  # after an eager copy: wait for it, once per layer
    assert log == ["wait"] * len(tiny_cfg.engram_layer_ids)
    for layer in captured:
        assert torch.equal(captured[layer].values.view(torch.uint8), eager[layer].values.view(torch.uint8))
