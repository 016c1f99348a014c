"""Reference engine: sampling, stop rules, prefix cache with SWA bounded replay."""

import pytest
from _util import rand_prompt

import torch

from dsv41.core.engine import Engine, SamplingParams, SingleSequence


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_greedy_is_deterministic_and_respects_max_tokens(tiny_model, tiny_cfg, rng):
    prompt = rand_prompt(tiny_cfg, 20, rng).tolist()
    e = Engine(tiny_model, prefill_mode="exact")
    a = e.generate(prompt, SamplingParams(max_new_tokens=6))
    b = e.generate(prompt, SamplingParams(max_new_tokens=6))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 6 and a.finish_reason == "length"


def test_stop_token_ends_generation(tiny_model, tiny_cfg, rng):
    prompt = rand_prompt(tiny_cfg, 12, rng).tolist()
    e = Engine(tiny_model)
    first = e.generate(prompt, SamplingParams(max_new_tokens=5)).token_ids
    stopped = e.generate(prompt, SamplingParams(max_new_tokens=5, stop_token_ids=(first[2],)))
    cut = first.index(first[2]) + 1
    assert stopped.token_ids == first[:cut] and stopped.finish_reason == "stop"


def test_seeded_sampling_reproduces_and_varies(tiny_model, tiny_cfg, rng):
    prompt = rand_prompt(tiny_cfg, 10, rng).tolist()
    e = Engine(tiny_model)
    p = dict(max_new_tokens=12, temperature=1.5, top_p=0.95, top_k=50)
    a = e.generate(prompt, SamplingParams(seed=1, **p)).token_ids
    assert a == e.generate(prompt, SamplingParams(seed=1, **p)).token_ids
    others = {tuple(e.generate(prompt, SamplingParams(seed=s, **p)).token_ids) for s in range(2, 6)}
    assert len(others | {tuple(a)}) > 1


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2)])
def test_invalid_sampling_options(tiny_model, bad):
    with pytest.raises(ValueError):
        Engine(tiny_model).generate([5, 6, 7], SamplingParams(**bad))


def test_prompt_beyond_context_is_rejected(tiny_model, tiny_cfg):
    e = Engine(tiny_model)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        e.generate([5] * (tiny_cfg.max_position_embeddings - 2), SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        e.generate([], SamplingParams())
    with pytest.raises(ValueError, match="prefill_mode"):
        Engine(tiny_model, prefill_mode="fast")


def _prefill(e: Engine, prompt):
    """Run one prompt's prefill by itself: (last logits, work counters, prefix-hit tokens)."""
    seq, logits, _ = e.prefill_alone(prompt, SamplingParams(max_new_tokens=1))
    e.finish(seq)
    return logits, seq.counters, seq.hit


def _cold(model, prompt):
    logits, counters, _ = _prefill(Engine(model, prefill_mode="exact"), prompt)
    return logits, counters


def test_prefix_hit_with_exact_replay_matches_cold_path(tiny_model, tiny_cfg, rng):
    cfg = tiny_cfg
    replay = cfg.sliding_window * cfg.num_hidden_layers  # 96
    prompt = rand_prompt(cfg, 150, rng).tolist()
    cold, cold_ctx = _cold(tiny_model, prompt)
    e = Engine(tiny_model, prefill_mode="exact", replay="exact", prefix_cache=True, block_size=16)
    _prefill(e, prompt[:140] + [7, 7, 7])  # shares 140 tokens: 8 full blocks = 128 cached
    logits, counters, hit = _prefill(e, prompt)
    assert hit == 128 and e.prefix.stats["hits"] == 1
    # the encoder skipped the cached prefix except the replayed span (counted, not assumed)
    assert counters["encoder_tokens"] == len(prompt) - (hit - replay)
    assert cold_ctx["encoder_tokens"] == len(prompt)
    # the global KV of the cached prefix was reused, not recomputed
    src = cfg.kv_source_layer_ids[0]
    assert counters[f"compressed_entries.{src}"] == (len(prompt) - hit) // cfg.compress_ratios[src]
    assert rel_err(logits, cold) <= 1e-5


def test_prefix_hit_with_window_replay_is_bounded_and_measured(tiny_model, tiny_cfg, rng):
    cfg = tiny_cfg
    errs = []
    for _ in range(3):
        prompt = rand_prompt(cfg, 70, rng).tolist()
        cold, _ = _cold(tiny_model, prompt)
        e = Engine(tiny_model, prefill_mode="exact", prefix_cache=True, block_size=16)
        _prefill(e, prompt[:64])
        logits, counters, hit = _prefill(e, prompt)
        assert hit == 64
        assert counters["encoder_tokens"] == len(prompt) - hit + cfg.sliding_window
        errs.append(rel_err(logits, cold))
    print("\n[dsv41] prefix hit, default bounded replay (window 8, 12 layers) vs cold path, "
          "last-position logits rel. error: " + ", ".join(f"{e:.3g}" for e in errs))
    # regression bound: about 2x the largest error measured over seeds 1-4 and the default
    # (0.25-0.73 with realistic random weights, 2026-11-30); unrelated logits would give ~1.4
    assert all(0 < e < 1.5 for e in errs)


def test_prefix_cache_never_serves_a_different_prompt(tiny_model, tiny_cfg, rng):
    e = Engine(tiny_model, prefix_cache=True, block_size=16)
    a = rand_prompt(tiny_cfg, 40, rng).tolist()
    b = list(a)
    b[3] = (b[3] + 1 - 5) % (tiny_cfg.vocab_size - 5) + 5  # differs inside the first block
    _prefill(e, a)
    assert _prefill(e, b)[2] == 0


def _mixed_prompts(cfg, rng, shared):
    """Prompts of mixed lengths; two of them extend `shared` (prefix-cache hits)."""
    lens = [3, 17, 40, 9, 25, 1, 33, 12]
    out = [rand_prompt(cfg, n, rng).tolist() for n in lens]
    out[2] = shared + out[2][:6]
    out[6] = shared + out[6][:3]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("prefill_mode", ["exact", "ced"])
def test_batch_invariance(tiny_model, tiny_cfg, rng, prefill_mode):
    """Every sequence's tokens (greedy, or sampled with its own seed) and logits are identical
    alone and inside a continuous batch of mixed lengths: steps mix prefill chunks (16 tokens per step) with decode rows, and
    two prompts hit the prefix cache of a third."""
    shared = rand_prompt(tiny_cfg, 48, rng).tolist()
    prompts = _mixed_prompts(tiny_cfg, rng, shared)
    # half of them sampled, each with its own seed
    params = [SamplingParams(max_new_tokens=6, temperature=0.8 if i % 2 else 0.0, seed=i) for i in range(len(prompts))]
    alone = []
    for p, sp in zip(prompts, params):
        e = Engine(tiny_model, prefill_mode=prefill_mode, record_logits=True, prefix_cache=True)
        _prefill(e, shared + [5])  # the same cached prefix the batch will find
        alone.append(e.generate(p, sp))
    e = Engine(tiny_model, prefill_mode=prefill_mode, record_logits=True, prefix_cache=True,
               max_tokens_per_step=16, max_batch=5)
    _prefill(e, shared + [5])
    steps = []
    batch = e.generate_batch([(p, sp, None) for p, sp in zip(prompts, params)], on_step=lambda: steps.append(1))
    assert len(steps) < sum(len(p) + 6 for p in prompts) / 4  # really batched
    assert [r.prefix_hit_tokens for r in batch] == [r.prefix_hit_tokens for r in alone]
    assert sum(r.prefix_hit_tokens > 0 for r in batch) == 2
    for i, (a, b) in enumerate(zip(alone, batch)):
        assert a.token_ids == b.token_ids, i
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits)), i


def test_decode_equals_exact_prefill_in_a_batch(tiny_model, tiny_cfg, rng):
    """Greedy decode inside a batch computes the logits an exact prefill of the generated
    sequence gives at the same positions (bit for bit on the reference backend)."""
    prompts = [rand_prompt(tiny_cfg, n, rng).tolist() for n in (5, 30, 11)]
    e = Engine(tiny_model, prefill_mode="exact", record_logits=True, max_tokens_per_step=8)
    res = e.generate_batch([(p, SamplingParams(max_new_tokens=5), None) for p in prompts])
    for p, r in zip(prompts, res):
        full = SingleSequence(tiny_model).feed(p + r.token_ids[:-1], all_logits=True)
        for j, lg in enumerate(r.logits):
            assert torch.equal(full[len(p) - 1 + j], lg), j


def test_block_size_does_not_change_results(tiny_model, tiny_cfg, rng):
    prompt = rand_prompt(tiny_cfg, 37, rng).tolist()
    runs = [Engine(tiny_model, block_size=bs, record_logits=True, max_tokens_per_step=13).generate(
        prompt, SamplingParams(max_new_tokens=4)) for bs in (2, 16, 64)]
    assert all(r.token_ids == runs[0].token_ids for r in runs)
    assert all(torch.equal(a, b) for r in runs for a, b in zip(r.logits, runs[0].logits))


def test_finished_sequences_return_their_blocks(tiny_model, tiny_cfg, rng):
    e = Engine(tiny_model, max_batch=3)
    prompts = [rand_prompt(tiny_cfg, n, rng).tolist() for n in (20, 7, 33, 4, 15)]
    e.generate_batch([(p, SamplingParams(max_new_tokens=3), None) for p in prompts])
    pool = e.pool
    assert not e.running and not e.waiting
    assert pool.free_global_blocks == pool.global_capacity - 1  # all but the null block
    assert len(pool._free_swa) == pool.swa_capacity - 1


def test_prefix_cached_blocks_give_way_before_the_pool_grows(tiny_model, tiny_cfg, rng):
    """Unreferenced prefix-cached blocks are reused (least recently used first) when no block is
    free, instead of growing the pool; a later lookup of an evicted prefix misses."""
    e = Engine(tiny_model, prefix_cache=True, block_size=16)
    a = rand_prompt(tiny_cfg, 40, rng).tolist()
    _prefill(e, a)
    cached = len(e.prefix.block_of)
    assert cached == 2 and e.pool.free_global_blocks < e.pool.global_capacity - 1
    e.pool._free_glob.clear()  # no free block left: the next sequence must take cached ones
    capacity = e.pool.global_capacity
    b = rand_prompt(tiny_cfg, 20, rng).tolist()
    _prefill(e, b)
    assert e.pool.global_capacity == capacity and len(e.prefix.block_of) < cached + 1
    assert _prefill(e, a)[2] < 32  # (at least one of a's blocks was evicted)


def test_block_table_tensor_follows_every_change(rng):
    """A `BlockTable`'s tensor copy equals the list after appends, single writes (negative indices
    too) and every other list mutation, and its padded view holds the null block past the end;
    lists assigned to a `SequenceState` become BlockTables; the step's tables are padded with the
    null block."""
    from dsv41.backends.paging import NULL_BLOCK
    from dsv41.core.batch import block_tables
    from dsv41.core.cache import BlockTable, SequenceState

    def follows(t):
        assert t.tensor().tolist() == list(t)
        for extra in (0, 3, 40):  # within and past the copy's capacity
            assert t.padded(len(t) + extra).tolist() == list(t) + [NULL_BLOCK] * extra

    tb = BlockTable()
    for v in torch.randint(1, 1000, (40,), generator=rng).tolist():  # past the first capacities
        tb.append(v)
        follows(tb)
    tb[3] = 0
    tb[-1] = 77
    follows(tb)
    with pytest.raises(ValueError, match="does not fit"):
        tb.padded(len(tb) - 1)
    for change in (lambda t: t.extend([7, 8]), lambda t: t.__setitem__(slice(0, 2), [5]), lambda t: t.pop(),
                   lambda t: t.insert(1, 9), lambda t: t.__delitem__(0), lambda t: t.__iadd__([4]),
                   lambda t: t.remove(9), lambda t: t.reverse(), lambda t: t.sort(), lambda t: t.clear()):
        change(tb)
        follows(tb)
        tb.append(11)
        tb[-1] = 12
        follows(tb)
    import copy

    for dup in (copy.copy(tb), copy.deepcopy(tb)):  # a copy's changes never reach the original's tensor
        dup.append(99)
        dup[0] = 98
        assert dup.tensor().tolist() == list(dup) and tb.tensor().tolist() == list(tb) != list(dup)
    st = SequenceState()
    st.swa_blocks, st.glob_blocks = [3, 4], [5]
    assert isinstance(st.swa_blocks, BlockTable) and isinstance(st.glob_blocks, BlockTable)
    assert block_tables([st.swa_blocks, st.glob_blocks, []]).tolist() == [[3, 4], [5, 0], [0, 0]]
    assert block_tables([[], BlockTable()]).tolist() == [[0], [0]] and block_tables([]).shape == (0, 1)


def test_stacked_tables_follow_every_change(rng):
    """`StackedTables` (a step's padded tables kept from the step before, only changed rows
    rewritten) equals a fresh `block_tables` step after step: appends, single writes, other
    list changes, a table replaced, the batch reordered or resized, the width growing; and a
    returned tensor never changes afterwards."""
    from dsv41.core.batch import StackedTables, block_tables
    from dsv41.core.cache import BlockTable

    stacked = StackedTables()
    tables = [BlockTable(torch.randint(1, 99, (int(n),), generator=rng).tolist())
              for n in torch.randint(0, 40, (6,), generator=rng)]
    kept = []
    for step in range(60):
        i = int(torch.randint(0, len(tables), (1,), generator=rng))
        kind = step % 6
        if kind in (0, 1):
            tables[i].append(step + 100)
        elif kind == 2 and len(tables[i]):
            tables[i][int(torch.randint(0, len(tables[i]), (1,), generator=rng))] = 0
        elif kind == 3 and len(tables[i]):
            tables[i].pop()
        elif kind == 4:
            tables[i] = BlockTable(list(tables[i]) + [7])
        elif step % 12 == 5:
            tables = tables[::-1] if step % 24 == 5 else tables[:-1] + [BlockTable([1, 2, 3])]
        got = stacked(tables)
        assert torch.equal(got, block_tables(tables)), step
        kept.append((got, got.clone()))
    assert all(torch.equal(a, b) for a, b in kept)


def test_free_old_swa_frees_each_block_once(tiny_model, tiny_cfg, rng):
    """Freeing out-of-window SWA blocks starts where the last call stopped, and frees exactly the
    blocks whose positions lie below the bound (the pool gets each back once)."""
    from dsv41.core.cache import KVPool, SequenceState

    pool = KVPool(tiny_cfg, block_size=4, swa_blocks=4, global_blocks=4)
    st = SequenceState()
    st.ensure_blocks(pool, 64)
    blocks = list(st.swa_blocks)
    free_before = len(pool._free_swa)
    st.free_old_swa(pool, 21)  # blocks 0..4 end at or below position 20
    assert st.swa_blocks[:5] == [0] * 5 and st.swa_blocks[5:] == blocks[5:] and st.swa_freed == 5
    assert len(pool._free_swa) == free_before + 5
    st.free_old_swa(pool, 21)
    st.free_old_swa(pool, 40)
    assert st.swa_blocks[:10] == [0] * 10 and len(pool._free_swa) == free_before + 10
    st.swa_blocks = list(st.swa_blocks)  # a new list: the scan starts from its first block again
    assert st.swa_freed == 0
