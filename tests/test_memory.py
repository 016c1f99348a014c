"""The prefill memory estimate and the engine's default tokens per step (core/memory.py)."""

import pytest
import torch
from _util import rand_prompt

from dsv41.core import memory
from dsv41.core.config import preset
from dsv41.core.engine import Engine, SamplingParams


def test_footprint_counts_the_profiled_items_at_mini_widths():
    """Per token at mini widths, item by item as the H200 allocator profile saw them at 8192
    tokens (benchmarks/RESULTS-e2e.md): streams 0.3125 GiB, mHC 0.78125 GiB, the candidate
    pool (1 GiB as int64 entry ids then; 2048 int32 block ids a token now: 64 MiB); the MoE pass
    buffers stop growing at the pass length."""
    cfg = preset("mini")
    fp = memory.prefill_footprint(cfg)
    gib = 2 ** 30
    profiled = (0.3125 + 0.78125 + 1 / 16) * gib / 8192  # streams + mHC + one pool, per token
    assert fp.per_token >= profiled
    s = memory.MOE_SLICE_TOKENS
    assert fp.bytes(2 * s) - fp.bytes(s) == fp.per_token * s  # past one pass only per-token items grow
    assert fp.bytes(s) - fp.bytes(s - 1) == fp.per_token + fp.moe_per_token


@pytest.mark.parametrize("name", ["tiny", "mini", "full"])
def test_default_tokens_fit_the_budget(name):
    """The default is the largest multiple of STEP_MULTIPLE whose estimate fits 0.15 x (weights +
    KV), within the clamp."""
    cfg = preset(name)
    fp = memory.prefill_footprint(cfg)
    for weights in (10 ** 9, 8.24e9, 60e9):
        budget = int(0.15 * (weights + 0.26e9))
        n = memory.default_tokens_per_step(cfg, int(weights), int(0.26e9))
        assert n % memory.STEP_MULTIPLE == 0
        assert memory.MIN_TOKENS_PER_STEP <= n <= memory.MAX_TOKENS_PER_STEP
        if n > memory.MIN_TOKENS_PER_STEP:
            assert fp.bytes(n) <= budget
        if n < memory.MAX_TOKENS_PER_STEP:
            assert fp.bytes(n + memory.STEP_MULTIPLE) > budget


def test_default_tokens_mini_on_the_h200_sizes():
    """Mini (8.24 GB of weights, 0.26 GB of KV for a 32K prompt): one MoE pass a step (2048
    tokens; 1792 while the candidate pool was an int64 entry list), well under the 8192 tokens
    that peaked at 1.83x, and its estimate within 0.15 x (weights + KV)."""
    cfg = preset("mini")
    n = memory.default_tokens_per_step(cfg, int(8.24e9), int(0.26e9))
    assert n == memory.MAX_TOKENS_PER_STEP == memory.MOE_SLICE_TOKENS
    assert memory.prefill_footprint(cfg).bytes(n) <= 0.15 * 8.5e9


def test_weight_bytes_counts_each_storage_once(tiny_model):
    """Parameters and buffers, shared storages once; CPU tensors left out by default."""
    every = {t.data_ptr(): t.numel() * t.element_size()
             for t in list(tiny_model.parameters()) + list(tiny_model.buffers())}
    assert memory.weight_bytes(tiny_model, skip=("meta",)) == sum(every.values()) > 0
    assert memory.weight_bytes(tiny_model) == 0  # (all on the CPU here)


def test_bad_budget_inputs_are_refused():
    cfg = preset("tiny")
    with pytest.raises(ValueError, match="fraction"):
        memory.default_tokens_per_step(cfg, 10 ** 9, fraction=0)
    with pytest.raises(ValueError, match="bytes"):
        memory.default_tokens_per_step(cfg, -1)


def test_constants_match_the_moe_kernels():
    """core/ cannot import the kernels: its copies of their buffer constants must agree."""
    pytest.importorskip("triton")
    from dsv41.npu_ops.triton import moe_grouped as mg

    assert memory.MOE_SLICE_TOKENS == mg.PREFILL_SLICE_TOKENS
    assert memory.MOE_SCRATCH_EXPERTS == mg.PREDEQUANT_GROUP
    assert memory.MOE_BLOCK_ROWS == mg.TILES["prefill"]["bm"]


def test_engine_step_budget_default_and_override(tiny_model):
    """On the CPU the default stays the reference's 2048; an explicit value is kept; 0 refused."""
    assert Engine(tiny_model).max_tokens_per_step == memory.CPU_TOKENS_PER_STEP
    assert Engine(tiny_model, max_tokens_per_step=300).max_tokens_per_step == 300
    with pytest.raises(ValueError, match="max_tokens_per_step"):
        Engine(tiny_model, max_tokens_per_step=0)


def test_engine_device_default_from_the_budget(tiny_model, monkeypatch):
    """Off the CPU the default comes from the weights' bytes and the pool's (the model is on the
    CPU here, so the device check is patched)."""
    import dsv41.core.engine as eng

    seen = {}

    def fake_default(cfg, weights, kv, fraction=memory.TRANSIENT_FRACTION):
        seen.update(weights=weights, kv=kv)
        return 512

    monkeypatch.setattr(memory, "default_tokens_per_step", fake_default)
    monkeypatch.setattr(memory, "CPU_TOKENS_PER_STEP", None)  # (unused: the device branch runs)
    real_type = tiny_model.embed.weight.device.type
    assert real_type == "cpu"
    monkeypatch.setattr(eng, "_on_cpu", lambda model: False)
    real_bytes = memory.weight_bytes
    monkeypatch.setattr(memory, "weight_bytes", lambda model: real_bytes(model, skip=("meta",)))
    e = Engine(tiny_model)
    assert e.max_tokens_per_step == 512
    weights = sum(t.numel() * t.element_size() for t in tiny_model.buffers()) + sum(
        p.numel() * p.element_size() for p in tiny_model.parameters())
    assert seen["weights"] <= weights and seen["weights"] > 0.9 * weights
    assert seen["kv"] == e.pool.nbytes() > 0


def test_prefill_logits_do_not_depend_on_the_step_budget(tiny_model, tiny_cfg, rng):
    """The prefill's last logits and greedy tokens are the same for any tokens per step (the
    reference is batch-invariant: equal bits)."""
    prompt = rand_prompt(tiny_cfg, 90, rng).tolist()
    outs = []
    for n in (16, 37, 2048):
        e = Engine(tiny_model, prefill_mode="exact", max_tokens_per_step=n, record_logits=True)
        r = e.generate(prompt, SamplingParams(max_new_tokens=3))
        outs.append((r.token_ids, torch.stack(r.logits)))
    for toks, lg in outs[1:]:
        assert toks == outs[0][0]
        assert torch.equal(lg, outs[0][1])


def test_step_counters_stay_on_the_device_until_read(tiny_model, tiny_cfg, rng, monkeypatch):
    """Neither `prefill_alone` nor `step` reads a step's work counters from the device as it
    ends (no device sync between prefill chunks): `prefill_alone` reads them once after the last
    chunk, `step` when the sequence's result (or the engine's `counters`) is made: the same
    totals as the per-step counters. More than FOLD_COUNTS_AT parts are summed on the device."""
    from dsv41.core import engine as engine_mod

    prompt = rand_prompt(tiny_cfg, 70, rng).tolist()
    a = Engine(tiny_model, prefill_mode="exact", max_tokens_per_step=16)
    seq, _, _ = a.prefill_alone(prompt, SamplingParams(max_new_tokens=1))
    monkeypatch.setattr(engine_mod, "FOLD_COUNTS_AT", 3)
    b = Engine(tiny_model, prefill_mode="exact", max_tokens_per_step=16)
    other = b.add(prompt, SamplingParams(max_new_tokens=1))
    reads, real = [], engine_mod.read_counts
    monkeypatch.setattr(engine_mod, "read_counts", lambda parts: reads.append(len(parts)) or real(parts))
    steps = []
    while other.prefilling:
        b.step()
        steps.append(len(other.pending))
    assert not reads and len(steps) == 5 and 0 < max(steps) <= 2 * len({n for n, _ in other.pending}) + 3
    assert other.result().counters == seq.counters and reads
    assert seq.counters and b.counters == seq.counters
    assert any(k.startswith("indexer_scored") for k in seq.counters)


def test_cli_tokens_per_step_option(capsys, monkeypatch):
    """`dsv41 run --max-tokens-per-step N` reaches the engine (and a prompt in several chunks
    gives the same tokens as in one); without it the engine's default applies; 0 is refused with
    one clear line."""
    import json

    import dsv41.core.engine as eng
    from dsv41.deploy.cli import main

    seen = []
    real_init = eng.Engine.__init__

    def spy(self, *a, **kw):
        real_init(self, *a, **kw)
        seen.append(self.max_tokens_per_step)

    monkeypatch.setattr(eng.Engine, "__init__", spy)
    outs = []
    for extra in (["--max-tokens-per-step", "3"], ["--max-tokens-per-step", "2048"], []):
        assert main(["run", "--preset", "tiny", "--prompt-ids", "5,17,42,9,11,13,8", "--max-new-tokens", "2",
                     *extra, "--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"])
    assert seen == [3, 2048, memory.CPU_TOKENS_PER_STEP]
    assert outs[0] == outs[1] == outs[2]
    assert main(["run", "--preset", "tiny", "--prompt-ids", "5,17", "--max-tokens-per-step", "0"]) != 0
    assert "--max-tokens-per-step must be >= 1" in capsys.readouterr().err
