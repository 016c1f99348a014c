"""The vLLM plugin's page adapter (`deploy/vllm/paged_cache.py`) without vLLM: caches gathered
from / scattered to block-table pages must reproduce the reference engine exactly, including
chunked prefill (compressor carry across chunks), SWA ring wrap, and a prefix-cache hit whose
replay starts at a block-aligned position with the earlier window blocks null (vLLM's layout).

Pages start as random bytes (stale data from earlier owners) and block ids are shuffled. The
same tests run on CUDA tensors (marked `gpu`), where both paths run the same kernels on the same
chunks, so they must agree bit for bit as well.
"""

from __future__ import annotations

import pytest
import torch
from dsv41.core.engine import Engine, SamplingParams
from dsv41.core.weights import build_model
from dsv41.deploy.vllm.paged_cache import NULL_BLOCK, LayerRequest, PagedCaches
from torch import nn

BLOCK = 8  # divides the tiny window (8) and exact replay (8 x 12)
N_BLOCKS = 1024
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


class FakeLayer(nn.Module):
    """A cache layer as vLLM binds it: [blocks, heads=1, states, bytes], full of stale bytes."""

    def __init__(self, req: LayerRequest, gen: torch.Generator, device):
        super().__init__()
        self.prefix = req.prefix
        states = req.block_size // req.ratio
        self.kv_cache = torch.randint(0, 256, (N_BLOCKS, 1, states, req.record_bytes), generator=gen,
                                      dtype=torch.uint8).to(device)


class Meta:
    def __init__(self, table: torch.Tensor):
        self.block_table = table.unsqueeze(0)


class FakeVllm:
    """Block allocation per request like vLLM's managers: every layer has its own table; a
    prefix hit shares the global blocks of the hit, and leaves SWA blocks below the replay
    start null."""

    def __init__(self, model, replay: int, device, gen):
        self.model, self.device = model, device
        self.caches = PagedCaches(model.cfg, BLOCK, "t", replay, lambda r: FakeLayer(r, gen, device))
        self.free = (torch.randperm(N_BLOCKS - 1, generator=gen) + 1).tolist()
        self.layers = [*self.caches.glob.values(), *self.caches.swa]

    def new_tables(self, n_tokens: int, shared: dict | None = None, null_below: int = 0) -> dict:
        """Fresh blocks per layer; with `shared`, the global blocks of its first `hit` tokens."""
        tables = {}
        for lay in self.layers:
            bs = self.caches.block_sizes[lay.prefix]
            t = torch.zeros(n_tokens // bs + 2, dtype=torch.int32)
            for b in range(t.shape[0]):
                if shared and ".global_kv." in lay.prefix and (b + 1) * bs <= shared["hit"]:
                    t[b] = shared["tables"][lay.prefix][b]
                elif ".swa." in lay.prefix and (b + 1) * bs <= null_below:
                    t[b] = NULL_BLOCK
                else:
                    t[b] = self.free.pop()
            tables[lay.prefix] = t.to(self.device)
        return tables

    def step(self, tables, ids: list[int], start: int, image_rows=None) -> torch.Tensor:
        meta = {k: Meta(v) for k, v in tables.items()}
        x = torch.tensor(ids, dtype=torch.long, device=self.device)
        is_image = self.model.image_mask(x)
        h = self.caches.run_chunk(self.model, meta, 0, start, x, image_rows, is_image)
        return self.model.logits(h[-1:])[0]

    def generate(self, tables, prompt: list[int], n: int, chunks=(), start: int = 0) -> list[int]:
        """Greedy: prompt[start:] in the given chunk lengths (rest in one), then one token per step."""
        pos, logits = start, None
        for c in [*chunks, len(prompt) - start - sum(chunks)]:
            logits = self.step(tables, prompt[pos:pos + c], pos)
            pos += c
        out = [int(logits.argmax())]
        while len(out) < n:
            out.append(int(self.step(tables, [out[-1]], pos).argmax()))
            pos += 1
        return out


def _prompt(rng, n):
    return [int(x) for x in torch.randint(9, 500, (n,), generator=rng)]


@pytest.fixture
def gen(rng):
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))


@pytest.mark.parametrize("device", DEVICES)
def test_paged_equals_engine_with_chunked_prefill(tiny_cfg, fresh_seed, rng, gen, device):
    model = build_model(tiny_cfg, seed=fresh_seed, device=device)
    fake = FakeVllm(model, tiny_cfg.sliding_window, device, gen)
    prompt = _prompt(rng, 29)
    expected = Engine(model, prefill_mode="exact").generate(prompt, SamplingParams(max_new_tokens=12)).token_ids
    assert fake.generate(fake.new_tables(64), prompt, 12) == expected
    # chunk boundaries at odd positions: the ratio-2 compressors carry a row across chunks. The
    # reference is batch-invariant, so the whole-prompt tokens are the oracle; CUDA kernels round
    # a 5-row chunk and a 29-row prompt differently, so there the oracle takes the same chunks.
    chunked = expected if device == "cpu" else _greedy_in_chunks(model, prompt, (5, 10), 12)
    assert fake.generate(fake.new_tables(64), prompt, 12, chunks=(5, 10)) == chunked


def _greedy_in_chunks(model, prompt, chunks, n):
    """Greedy tokens of the core model fed `prompt` in `chunks` (rest in one), then one token per step."""
    from dsv41.core.engine import SingleSequence

    seq, pos, logits = SingleSequence(model), 0, None
    for c in [*chunks, len(prompt) - sum(chunks)]:
        logits = seq.feed(prompt[pos:pos + c])
        pos += c
    out = [int(logits.argmax())]
    while len(out) < n:
        out.append(int(seq.feed([out[-1]]).argmax()))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("replay", ["window", "exact"])
def test_prefix_hit_replay_equals_engine(tiny_cfg, fresh_seed, rng, gen, device, replay):
    cfg = tiny_cfg
    model = build_model(cfg, seed=fresh_seed, device=device)
    r = cfg.sliding_window * (cfg.num_hidden_layers if replay == "exact" else 1)
    fake = FakeVllm(model, r, device, gen)
    grain = max(fake.caches.block_sizes.values())  # vLLM schedules on the lcm of the block sizes
    prompt = _prompt(rng, r + grain + 5)
    first_tables = fake.new_tables(len(prompt) + 8)
    fake.generate(first_tables, prompt, 4)
    hit = (len(prompt) - 1) // grain * grain  # vLLM's hit: whole blocks, not the last prompt token
    start = hit - r
    shared = {"hit": hit, "tables": first_tables}
    got = fake.generate(fake.new_tables(len(prompt) + 8, shared, null_below=start), prompt, 8, start=start)

    engine = Engine(model, prefill_mode="exact", replay=replay, prefix_cache=True, block_size=grain)
    engine.generate(prompt, SamplingParams(max_new_tokens=1))  # fills the engine's prefix cache
    res = engine.generate(prompt, SamplingParams(max_new_tokens=8))
    assert res.prefix_hit_tokens == hit
    assert got == res.token_ids
    if replay == "exact" and device == "cpu":
        # exact replay reproduces the cold run on the batch-invariant reference (CUDA kernels
        # round a replay chunk and a whole prompt differently, so there only the above holds)
        cold = Engine(model, prefill_mode="exact").generate(prompt, SamplingParams(max_new_tokens=8)).token_ids
        assert got == cold


def test_rejects_block_size_not_dividing_replay(tiny_cfg, gen):
    with pytest.raises(ValueError, match="--block-size"):
        PagedCaches(tiny_cfg, 16, "t", tiny_cfg.sliding_window, lambda r: FakeLayer(r, gen, "cpu"))


def test_pages_are_filled_not_padded(tiny_cfg, gen):
    """Every layer's page has one size (vLLM's hybrid allocator); the layers with small records
    reach it with larger blocks rather than padding: a slot is under 2x its record unless the
    next block size is out of bounds (16x the block size, or not dividing the replay length)."""
    from dsv41.core.config import preset
    from dsv41.deploy.vllm.paged_cache import MAX_BLOCK_SCALE

    for cfg in (tiny_cfg, preset("full")):
        for bs, replay in ((8, 128), (16, 128), (64, 128), (8, 8), (8, 96)):
            caches = PagedCaches(cfg, bs, "t", replay, lambda r: nn.Module())
            slots = {}
            for prefix, block in caches.block_sizes.items():
                kind, layer = prefix.split(".")[1:]
                ratio = cfg.compress_ratios[int(layer)] if kind == "global_kv" else 1
                record = caches.glob_rec[ratio].size if kind == "global_kv" else caches.swa_recs[int(layer)].size
                states = block // ratio
                slot = caches.page_bytes // states
                assert block % bs == 0 and block % ratio == 0 and slot * states == caches.page_bytes
                at_bound = block * 2 > MAX_BLOCK_SCALE * bs or (kind == "swa" and replay % (block * 2))
                assert record <= slot and (slot < 2 * record or at_bound), (prefix, block, slot, record)
                slots[prefix] = slot
            if cfg.num_hidden_layers == 40 and bs == 16:  # the published config, a long replay
                assert caches.page_bytes == 16 * 4672  # the carry-SWA page
                assert max(slots.values()) == 4672 and sorted(set(slots.values())) == [584, 4672]


def test_missing_history_is_an_error(tiny_cfg, fresh_seed, rng, gen):
    """A chunk starting mid-sequence whose earlier tokens are in no page (null blocks
    everywhere) must fail loudly, never hash Engram n-grams from garbage."""
    model = build_model(tiny_cfg, seed=fresh_seed)
    fake = FakeVllm(model, tiny_cfg.sliding_window, "cpu", gen)
    tables = {k: torch.zeros_like(v) for k, v in fake.new_tables(32).items()}
    for v in tables.values():
        v[2:] = torch.arange(2, v.shape[0]) + 40
    with pytest.raises(RuntimeError, match="missing"):
        fake.step(tables, _prompt(rng, 3), 16)


def test_same_tokens_other_image_never_reuses_stale_entries(tiny_cfg, fresh_seed, rng, gen):
    """Image positions share one token id: a request whose pages still hold another request's
    entries for the same ids but a different image must recompute them (content digests)."""
    cfg = tiny_cfg
    model = build_model(cfg, seed=fresh_seed)
    fake = FakeVllm(model, cfg.sliding_window, "cpu", gen)
    prompt = _prompt(rng, 30)
    prompt[3:15] = [cfg.image_token_id] * 12
    rows_a, rows_b = (torch.randn(12, cfg.hidden_size, generator=rng).to(torch.bfloat16) for _ in range(2))

    def run(tables, rows):  # chunked prefill: the second chunk starts at an aligned position
        fake.step(tables, prompt[:16], 0, rows)
        return fake.step(tables, prompt[16:], 16)

    reused = fake.new_tables(40)
    run(reused, rows_a)  # leaves request A's entries in these pages
    stale = run(reused, rows_b)
    fresh = run(fake.new_tables(40), rows_b)
    assert torch.equal(stale, fresh)
    assert not torch.equal(fresh, run(fake.new_tables(40), rows_a))  # the image matters at all


def test_one_step_over_many_requests_equals_each_alone(tiny_cfg, fresh_seed, rng, gen):
    """vLLM's steps mix requests: several prefill chunks of different lengths and starts, and
    decodes, in ONE forward over one shared private pool (`run_step`). Each request's greedy
    tokens must equal the reference engine's for it alone."""
    from dsv41.deploy.vllm.paged_cache import ScheduledChunk

    model = build_model(tiny_cfg, seed=fresh_seed)
    fake = FakeVllm(model, tiny_cfg.sliding_window, "cpu", gen)
    engine = Engine(model, prefill_mode="exact")
    prompts = [_prompt(rng, n) for n in (5, 23, 17, 9)]
    n_new = 6
    expected = [engine.generate(p, SamplingParams(max_new_tokens=n_new)).token_ids for p in prompts]
    tables = [fake.new_tables(48) for _ in prompts]
    width = max(v.shape[0] for t in tables for v in t.values())
    meta = {k: Meta(torch.zeros(0)) for k in tables[0]}
    for k in meta:  # one block-table row per request (vLLM's layout)
        meta[k].block_table = torch.stack([torch.nn.functional.pad(t[k], (0, width - t[k].shape[0])) for t in tables])
    # request 1 prefills in two chunks (the second beside the others' decodes); request 3 starts late
    plan = {0: [(0, 5)], 1: [(0, 11), (11, 23)], 2: [(0, 17)], 3: [None, (0, 9)]}
    pos = [0] * len(prompts)
    out: list[list[int]] = [[] for _ in prompts]
    step = 0
    while any(len(o) < n_new for o in out):
        chunks = []
        for i, p in enumerate(prompts):
            todo = plan[i][step] if step < len(plan[i]) else "decode"
            if todo is None or len(out[i]) >= n_new:
                continue
            ids = torch.tensor(p[todo[0]:todo[1]] if todo != "decode" else [out[i][-1]])
            samples = todo == "decode" or todo[1] == len(p)  # a prompt's last chunk gives a token
            chunks.append((i, ScheduledChunk(i, pos[i], ids, None, model.image_mask(ids)), samples))
            pos[i] += ids.shape[0]
        assert len(chunks) > 1 or step > 3
        h = fake.caches.run_step(model, meta, [c for _, c, _ in chunks])
        o = 0
        for i, c, sample in chunks:
            o += c.ids.shape[0]
            if sample:
                out[i].append(int(model.logits(h[o - 1:o])[0].argmax()))
        step += 1
    assert out == expected
