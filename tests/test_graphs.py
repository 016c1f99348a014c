"""Decode graphs (graphs/decode.py): bucketed, padded static batches give exactly the eager
step's logits. On CPU the runner replays the static batch eagerly (no device graph), which
tests the buffers, padding and bucketing; on CUDA the same test captures real graphs."""

import pytest
import torch
from _util import rand_prompt

from dsv41.core.batch import Chunk, build_step
from dsv41.core.cache import SequenceState
from dsv41.core.engine import Engine, SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("prefill_mode", ["exact", "ced"])
@pytest.mark.parametrize("device", DEVICES)
def test_graph_decode_equals_eager(tiny_cfg, fresh_seed, rng, device, prefill_mode):
    """Graph decode after either prefill mode (CED, the default, leaves the decoder's caches
    without the prompt's early rows) gives the eager engine's tokens."""
    from dsv41.core.weights import build_model

    model = build_model(tiny_cfg, seed=fresh_seed, device=device)
    # 7 prompts with max batch 6: decode batches of 6, then fewer (buckets 8 -> padded, 4, 2, 1)
    prompts = [rand_prompt(tiny_cfg, n, rng).tolist() for n in (3, 20, 9, 14, 1, 30, 6)]
    params = [SamplingParams(max_new_tokens=3 + i) for i in range(len(prompts))]
    eager = Engine(model, prefill_mode=prefill_mode, max_batch=6, record_logits=True)
    want = eager.generate_batch([(p, sp, None) for p, sp in zip(prompts, params)])
    graphed = Engine(model, prefill_mode=prefill_mode, max_batch=6, record_logits=True, graphs=True, max_model_len=48)
    assert graphed.graphs.buckets == [1, 2, 4, 6]
    replays = []
    run = graphed.graphs.run
    graphed.graphs.run = lambda b: replays.append(b.num_tokens) or run(b)
    got = graphed.generate_batch([(p, sp, None) for p, sp in zip(prompts, params)])
    assert replays and max(replays) == 6 and min(replays) < 6  # full and padded buckets replayed
    for w, g in zip(want, got):
        assert w.token_ids == g.token_ids
        if device == "cpu":  # the batch-invariant reference: the same bits
            assert all(torch.equal(a, b) for a, b in zip(w.logits, g.logits))


def test_graph_engine_rejects_what_it_cannot_hold(tiny_model, tiny_cfg):
    e = Engine(tiny_model, max_batch=2, graphs=True, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        e.generate([5] * 30, SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="max_model_len"):
        Engine(tiny_model, graphs=True)


def _speculate_on_graphs(model, tiny_cfg, prompt, params, device):
    """Greedy speculation on a graph engine, every replayed draft block compared with the eager
    draft block of the same batch (tokens; on CPU logits and confidences too, bit for bit);
    returns the output."""
    from dsv41.core.dspark import DSpark
    from dsv41.core.spec_decode import SpecOptions, generate_speculative

    engine = Engine(model, prefill_mode="exact", max_batch=2, graphs=True, max_model_len=48)
    drafter = DSpark(model)
    graph = engine.draft_graph(drafter)
    assert graph is not None and engine.draft_graph(drafter) is graph  # captured once per engine
    checked = []
    run = graph.run

    def run_and_compare(batch):
        got = run(batch)
        eager = drafter.draft_block(batch, engine.pool)
        assert torch.equal(got.tokens, eager.tokens)
        if device == "cpu":
            assert torch.equal(got.logits, eager.logits) and torch.equal(got.confidence, eager.confidence)
        checked.append(batch.positions[0].item())
        return got

    graph.run = run_and_compare
    out = generate_speculative(engine, prompt, params, SpecOptions(spec_len=tiny_cfg.dspark_block_size), drafter=drafter)
    assert len(checked) == out.spec["steps"] > 0 and len(set(checked)) == len(checked)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_draft_graph_equals_eager_draft(tiny_cfg, fresh_seed, rng, device):
    """Greedy speculation on a graph engine replays the captured draft block (`graphs/draft.py`);
    every replayed draft equals the eager draft block of the same batch, and the output equals
    plain greedy decoding. On a device that last equality is a batch-invariance claim (the
    verification forward over k + 1 tokens takes other kernels than a one-token step, e.g. the
    two-pass sparse attention, so near-ties of random weights may round apart): there it is
    checked with DSV41_BATCH_INVARIANT=1, after the default mode's draft-graph checks."""
    from dsv41.backends.registry import batch_invariant_mode
    from dsv41.core.weights import build_model

    model = build_model(tiny_cfg, seed=fresh_seed, device=device)
    prompt = rand_prompt(tiny_cfg, 11, rng).tolist()
    params = SamplingParams(max_new_tokens=12)
    out = _speculate_on_graphs(model, tiny_cfg, prompt, params, device)
    if device != "cpu":
        with batch_invariant_mode():
            want = Engine(model, prefill_mode="exact").generate(prompt, params).token_ids
            out = _speculate_on_graphs(model, tiny_cfg, prompt, params, device)
    else:
        want = Engine(model, prefill_mode="exact").generate(prompt, params).token_ids
    assert out.token_ids == want


@pytest.mark.parametrize("device", DEVICES)
def test_verify_graphs_equal_eager_verification(tiny_cfg, fresh_seed, rng, device):
    """A verification replayed from its row count's capture (`graphs/verify.py`) gives the eager
    verification's logits and target features for every k = 0 .. block size, at two context
    lengths (bit for bit on CPU, where the reference is batch-invariant; on a device in the
    batch-invariant mode, since the eager step's narrower tables may take other splits), and
    writes the drafter's context of its rows as `DSpark.absorb` writes it from those features."""
    from dsv41.backends.registry import batch_invariant_mode
    from dsv41.core.dspark import DSpark
    from dsv41.core.model import ForwardContext
    from dsv41.core.weights import build_model

    model = build_model(tiny_cfg, seed=fresh_seed, device=device)
    with batch_invariant_mode(device != "cpu"):
        engine = Engine(model, prefill_mode="exact", max_batch=2, graphs=True, max_model_len=48)
        graphs = engine.verify_graphs()
        assert graphs is not None and engine.verify_graphs() is graphs  # captured once per engine
        assert sorted(graphs.graphs) == list(range(1, tiny_cfg.dspark_block_size + 2))
        seq, _, _ = engine.prefill_alone(rand_prompt(tiny_cfg, 13, rng).tolist(), SamplingParams(max_new_tokens=24))
        state, checked = seq.state, 0
        drafter = DSpark(model)
        stage_pools = [engine.pool.swa[st.attn.layer_id] for st in drafter.stages]
        rows_at = lambda start, n: drafter._rows_at(engine.pool, state, list(range(start, start + n)))  # noqa: E731
        drafter_rows = lambda start, n: [t[rows_at(start, n)].clone() for swa in stage_pools  # noqa: E731
                                         for t in (swa.kv.view(torch.uint8), swa.scale.view(torch.uint8))]
        for extra in (0, 9):  # then a longer context: other blocks, the ring further on
            if extra:
                engine.run_chunks([Chunk(state, rand_prompt(tiny_cfg, extra, rng).tolist(), 0, "none", text_only=True)])
            for k in range(tiny_cfg.dspark_block_size + 1):
                ids, start = rand_prompt(tiny_cfg, k + 1, rng).tolist(), state.length
                logits, feats, counts = engine.verify(state, ids)
                assert counts is None  # a replay (no counters)
                got = logits.clone(), feats.clone()
                written = drafter_rows(start, k + 1)
                for swa in stage_pools:  # the same context again through `absorb`, on cleared rows
                    swa.kv[rows_at(start, k + 1)] = 0
                state.draft_length = start
                drafter.absorb(engine.pool, state, feats, start)
                assert all(torch.equal(w, a) for w, a in zip(written, drafter_rows(start, k + 1)))
                state.length = start
                ctx = ForwardContext(features={})
                want_logits, _, _ = engine.run_chunks([Chunk(state, ids, 0, "all", text_only=True)], ctx)
                state.length = start
                want = want_logits, torch.cat([ctx.features[i] for i in tiny_cfg.dspark_target_layer_ids], -1)
                for g, w in zip(got, want):
                    assert g.shape == w.shape and torch.isfinite(g).all()
                    assert torch.equal(g, w), f"k={k}: max difference {(g.float() - w.float()).abs().max()}"
                checked += 1
        engine.finish(seq)
    assert checked == 2 * (tiny_cfg.dspark_block_size + 1)
    with pytest.raises(ValueError, match="not a verification"):  # two sequences: not this capture
        graphs.run(build_step(tiny_cfg, engine.pool, [Chunk(SequenceState(), [5], 0, "all"),
                                                     Chunk(SequenceState(), [6], 0, "all")], "cpu"))


def test_spec_profile_times_the_replayed_steps(tiny_model, tiny_cfg):
    """`measure_profile` on a graph engine times the verification and the greedy draft through
    their captures, as a speculative run replays them (on CPU the captures run eagerly)."""
    from dsv41.core.spec_decode import measure_profile

    engine = Engine(tiny_model, max_batch=1, graphs=True, max_model_len=8 + 2 * tiny_cfg.dspark_block_size + 2)
    replays = []
    graphs = engine.verify_graphs()
    run = graphs.run
    graphs.run = lambda b: replays.append(b.num_tokens) or run(b)
    prof = measure_profile(engine, prompt_len=8, repeats=1)
    assert prof.tokens == list(range(1, tiny_cfg.dspark_block_size + 2))
    assert sorted(set(replays)) == prof.tokens  # every point through its capture
    assert engine._draft_graph is not None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_overlapped_decode_equals_step_by_step(tiny_cfg, fresh_seed, rng, device, sampled):
    """The overlapped decode loop (the next step launched on the device's tokens before the host
    reads them) gives the tokens of the ordinary loop, with sequences stopping on a stop token,
    on max_new_tokens and on their last prompt step mixed in one batch, and returns every block;
    `sampled`: rows drawn with temperatures, top-k and top-p beside greedy ones (drawn on the
    device in both loops)."""
    from dsv41.core.weights import build_model

    model = build_model(tiny_cfg, seed=fresh_seed, device=device)
    prompts = [rand_prompt(tiny_cfg, n, rng).tolist() for n in (5, 17, 9, 12, 3)]
    draw = [dict(temperature=0.9, seed=11), {}, dict(temperature=1.3, top_k=40, seed=12), {},
            dict(temperature=0.8, top_p=0.9, seed=13)] if sampled else [{}] * 5
    params = [SamplingParams(max_new_tokens=m, **d) for m, d in zip((9, 4, 12, 1, 7), draw)]

    def run(overlap, params):
        e = Engine(model, prefill_mode="exact", max_batch=4, graphs=True, max_model_len=48, overlap=overlap)
        fed = []
        graph_run = e.graphs.run
        e.graphs.run = lambda b, prev_rows=None: fed.append(prev_rows is not None) or graph_run(b, prev_rows)
        out = e.generate_batch([(p, sp, None) for p, sp in zip(prompts, params)])
        assert not e.running and not e.waiting and e._launched is None
        assert e.pool.free_global_blocks == e.pool.global_capacity - 1  # every block back
        assert len(e.pool._free_swa) == e.pool.swa_capacity - 1
        return [r.token_ids for r in out], [r.finish_reason for r in out], fed

    want, _, fed = run(False, params)
    assert not any(fed)
    # sequence 2 stops on the token it produced fifth (earlier tokens may equal it: the first wins)
    stop = want[2][4]
    params[2] = SamplingParams(max_new_tokens=12, stop_token_ids=(stop,), **draw[2])
    want, reasons, _ = run(False, params)
    assert reasons[2] == "stop" and len(want[2]) <= 5
    got, got_reasons, fed = run(True, params)
    assert sum(fed) >= 4, "the overlapped loop did not run"
    assert got == want and got_reasons == reasons


def test_packed_inputs_fill_like_the_per_field_copies(tiny_cfg, rng):
    """`PackedInputs.fill` (host twin + one copy) leaves the static batch exactly as
    `fill_static` field by field does: rows, padding rows, table columns past the batch, the
    host n-grams; twice in a row (the second twin), with a smaller batch after a larger one."""
    from dsv41.backends.platform import platform_for
    from dsv41.core.batch import StepBatch
    from dsv41.graphs.decode import DecodeGraphs, fill_static
    from dsv41.graphs.inputs import PackedInputs

    plat = platform_for("cpu")
    runner = DecodeGraphs.__new__(DecodeGraphs)  # only its static-batch layout
    runner.device, runner.table_blocks, runner.model = torch.device("cpu"), 6, type("M", (), {"cfg": tiny_cfg})()
    packed = PackedInputs(runner._static(4), plat)
    plain = runner._static(4)
    ng = plain.ngram_ids.shape[1]

    def batch(n, w):
        r = lambda *shape: torch.randint(1, 100, shape, generator=rng)  # noqa: E731  (no zeros: padding shows)
        return StepBatch(ids=r(n), positions=r(n), seq=torch.arange(n), swa_tables=(r(n, w),), glob_tables=(r(n, w),),
                         floors=r(n, 3), glob_from=r(n), ngram_ids=r(n, ng), ngram_image=r(n, ng) % 2 == 0,
                         is_image=r(n) % 2 == 0, ngram_host=(r(n, ng), r(n, ng) % 2 == 0))

    for n, w in ((4, 6), (3, 4), (1, 2)):
        b = batch(n, w)
        packed.fill(b)
        fill_static(plain, b, plat)
        for name in ("ids", "positions", "floors", "glob_from", "ngram_ids", "ngram_image", "is_image"):
            assert torch.equal(getattr(packed.static, name), getattr(plain, name)), (name, n)
        for name in ("swa_tables", "glob_tables", "ngram_host"):
            assert all(torch.equal(x, y) for x, y in zip(getattr(packed.static, name), getattr(plain, name))), (name, n)
        assert torch.equal(packed.static.seq, torch.arange(4))  # never rewritten
    assert (packed.static.ids[1:] == 0).all() and (packed.static.swa_tables[0][0, 2:] == 0).all()


def test_outgrown_constant_buffers_stay_alive(monkeypatch):
    """Graphs captured with `constant_rows` / `tile_counters` buffers read them by address, so a
    buffer outgrown by a later, larger eager step must never be freed (freed, its memory was
    handed out again and the replays read garbage: on the H200 the shared expert's ids, and the
    MoE kernel faulted after a long prefill grew the buffers past the captured batch)."""
    import gc
    import weakref

    from dsv41.core import model as model_mod
    from dsv41.npu_ops.triton import launch

    dev = torch.device("cpu")
    monkeypatch.setattr(model_mod, "_CONSTANT_ROWS", {})
    zeros = lambda n, d: torch.zeros(n, 1, dtype=torch.long, device=d)  # noqa: E731
    first = model_mod.constant_rows("ids", 4, dev, zeros)
    old = weakref.ref(first._base)
    del first
    grown = model_mod.constant_rows("ids", 43, dev, zeros)
    gc.collect()
    assert grown.shape == (43, 1) and old() is not None and old() is not grown._base
    assert model_mod.constant_rows("ids", 50, dev, zeros).shape == (50, 1)  # grows to 86 rows (twofold)
    assert model_mod.constant_rows("ids", 86, dev, None).shape == (86, 1)  # (no new buffer: make is not called)

    monkeypatch.setattr(launch, "_COUNTERS", {})
    small = weakref.ref(launch.tile_counters(dev, 8))
    big = launch.tile_counters(dev, 5000)
    gc.collect()
    assert big.numel() >= 8192 and small() is not None and not big.any()


def test_capture_runs_without_the_garbage_collector():
    """Graph captures run with the cyclic collector kept off (`capture_without_gc`): garbage in
    cycles (old engines with their graphs and page-locked buffers) is collected just before the
    capture, none inside it, and the collector is back on afterwards, also after a failed capture."""
    import contextlib
    import gc
    import weakref

    from dsv41.backends.platform import capture_without_gc

    class Cycle:
        pass

    def garbage():
        c = Cycle()
        c.me = c
        return weakref.ref(c)

    old = garbage()
    assert old() is not None and gc.isenabled()
    with capture_without_gc(contextlib.nullcontext()):
        assert old() is None, "garbage made before the capture was not collected first"
        assert not gc.isenabled()
        made_inside = garbage()
        [Cycle() for _ in range(10 * gc.get_threshold()[0])]  # enough allocations to trigger a collection
        assert made_inside() is not None
    assert gc.isenabled()
    with pytest.raises(RuntimeError), capture_without_gc(contextlib.nullcontext()):
        raise RuntimeError("capture failed")
    assert gc.isenabled()
