"""The vLLM plugin's in-place step (`deploy/vllm/paged_cache.py`) without vLLM: ONE core forward
per step over vLLM-style pages and per-layer block tables must reproduce the reference engine
exactly, including chunked prefill (compressor rows carried across chunks in the pages), the
window over freed blocks, a prefix-cache hit whose replay starts at a block-aligned position
with the earlier window blocks null (vLLM's layout), and many requests in shared steps.

Pages start as random bytes (stale data from earlier owners) and block ids are shuffled; block 0,
vLLM's null block, which every cache kind overlays in vLLM's buffer, holds bytes that decode to
NaN in every field (0xFF), so a masked read that leaks into a result shows. With `interleaved`, every layer's
pages sit in one buffer block by block (vLLM's block-major layouts), so each layer's records are
row-strided views whose block stride spans the other layers' pages; with `ascend`, each layer is
bound as vllm-ascend's runner binds a single-tensor cache (a one-tensor list, the head dimension
after the records). The same tests run on CUDA tensors (marked `gpu`).
"""

from __future__ import annotations

import pytest
import torch
from dsv41.core.batch import Chunk, build_step
from dsv41.core.engine import Engine, SamplingParams, SingleSequence
from dsv41.core.weights import build_model
from dsv41.backends.paging import NULL_BLOCK
from dsv41.deploy.vllm.paged_cache import LayerRequest, PagedCaches
from torch import nn

BLOCK = 8  # divides the tiny window (8) and exact replay (8 x 12)
N_BLOCKS = 512
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


class FakeLayer(nn.Module):
    """A cache layer as vLLM binds it: [blocks, heads=1, states, bytes], full of stale bytes."""

    def __init__(self, req: LayerRequest, gen: torch.Generator, device, pages: torch.Tensor | None = None,
                 ascend: bool = False):
        super().__init__()
        self.prefix = req.prefix
        states = req.block_size // req.ratio
        if pages is None:  # a buffer of its own
            pages = torch.randint(0, 256, (N_BLOCKS, req.page_bytes), generator=gen, dtype=torch.uint8).to(device)
            pages[NULL_BLOCK] = 0xFF
        self.kv_cache = pages.view(N_BLOCKS, req.page_bytes)[:, : states * req.record_bytes].unflatten(
            1, (1, states, req.record_bytes))
        if ascend:  # vllm-ascend's binding: a one-tensor list of [blocks, records, heads=1, bytes]
            self.kv_cache = [self.kv_cache.transpose(1, 2)]


class Meta:
    """One cache group's metadata of a step (what `backend.PagedMetadataBuilder` builds)."""

    def __init__(self, block_table: torch.Tensor, query_start_loc: torch.Tensor):
        self.block_table, self.query_start_loc, self.num_reqs = block_table, query_start_loc, block_table.shape[0]


class FakeVllm:
    """Block allocation per request like vLLM's managers: every layer has its own table; a
    prefix hit shares the global blocks of the hit, and leaves SWA blocks below the replay
    start null."""

    def __init__(self, model, replay: int, device, gen, interleaved: bool = False, ascend: bool = False):
        self.model, self.device = model, device
        make = lambda r: FakeLayer(r, gen, device, ascend=ascend)  # noqa: E731
        if interleaved:
            probe = PagedCaches(model.cfg, BLOCK, "t", replay, lambda r: nn.Module())
            n = len(probe.requests)
            buf = torch.randint(0, 256, (N_BLOCKS, n, probe.page_bytes), generator=gen, dtype=torch.uint8).to(device)
            buf[NULL_BLOCK] = 0xFF
            slot = {p: i for i, p in enumerate(probe.requests)}
            make = lambda r: FakeLayer(r, gen, device, buf[:, slot[r.prefix]])  # noqa: E731
        self.caches = PagedCaches(model.cfg, BLOCK, "t", replay, make)
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
            tables[lay.prefix] = t
        return tables

    def run(self, chunks: list[tuple[dict, list[int], int]], image_rows=None) -> torch.Tensor:
        """One step over (tables, ids, start) per request: the collapsed streams of every token."""
        ids = torch.tensor([t for _, c, _ in chunks for t in c], dtype=torch.long, device=self.device)
        pos = torch.tensor([s + j for _, c, s in chunks for j in range(len(c))], device=self.device)
        qsl = torch.tensor([0, *torch.tensor([len(c) for _, c, _ in chunks]).cumsum(0).tolist()],
                           dtype=torch.int32, device=self.device)
        meta = {}
        for lay in self.layers:
            rows = [t[lay.prefix] for t, _, _ in chunks]
            width = max(r.shape[0] for r in rows)
            table = torch.stack([nn.functional.pad(r, (0, width - r.shape[0])) for r in rows]).to(self.device)
            meta[lay.prefix] = Meta(table, qsl)
        is_image = self.model.image_mask(ids) if image_rows is not None else None
        return self.caches.run_step(self.model, meta, ids, pos, qsl, len(chunks), is_image, image_rows)

    def step(self, tables, ids: list[int], start: int, image_rows=None) -> torch.Tensor:
        h = self.run([(tables, ids, start)], image_rows)
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
@pytest.mark.parametrize("layout", ["own", "interleaved", "ascend"])
def test_paged_equals_engine_with_chunked_prefill(tiny_cfg, fresh_seed, rng, gen, device, layout):
    model = build_model(tiny_cfg, seed=fresh_seed, device=device)
    fake = FakeVllm(model, tiny_cfg.sliding_window, device, gen, layout == "interleaved", layout == "ascend")
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
                kind, layer = prefix.split(".")[-2:]
                ratio = cfg.compress_ratios[int(layer)] if kind == "global_kv" else 1
                record = caches.glob_recs[int(layer)].size if kind == "global_kv" else caches.swa_recs[int(layer)].size
                states = block // ratio
                slot = caches.page_bytes // states
                assert block % bs == 0 and block % ratio == 0 and slot * states == caches.page_bytes
                at_bound = block * 2 > MAX_BLOCK_SCALE * bs or (kind == "swa" and replay % (block * 2))
                assert record <= slot and (slot < 2 * record or at_bound), (prefix, block, slot, record)
                slots[prefix] = slot
            if cfg.num_hidden_layers == 40 and bs == 16:  # the published config, a long replay
                assert caches.page_bytes == 16 * 4672  # the carry-SWA page
                assert max(slots.values()) == 4672 and sorted(set(slots.values())) == [584, 4672]


def test_image_chunks_equal_engine(tiny_cfg, fresh_seed, rng, gen):
    """A prompt with an image span, prefilled in chunks that cut the span (Engram's n-grams
    cross the chunk boundaries and the image flags come back from the pages), then a decode
    that samples the image token id (text, not an image position): equal to the reference."""
    cfg = tiny_cfg
    model = build_model(cfg, seed=fresh_seed)
    fake = FakeVllm(model, cfg.sliding_window, "cpu", gen)
    prompt = _prompt(rng, 30)
    prompt[3:15] = [cfg.image_token_id] * 12
    rows = torch.randn(12, cfg.hidden_size, generator=rng).to(torch.bfloat16)
    seq = SingleSequence(model)
    want = [seq.feed(prompt[:9], image_embeds=rows[:6]), seq.feed(prompt[9:20], image_embeds=rows[6:]),
            seq.feed(prompt[20:])]
    generated = Chunk(seq.state, [cfg.image_token_id], logits="last", text_only=True)  # (as the engine feeds it)
    want.append(model(build_step(cfg, seq.pool, [generated], "cpu", cfg.image_token_id), seq.pool)[0])
    tables = fake.new_tables(40)
    got = [fake.step(tables, prompt[:9], 0, rows[:6]), fake.step(tables, prompt[9:20], 9, rows[6:]),
           fake.step(tables, prompt[20:], 20), fake.step(tables, [cfg.image_token_id], 30)]
    for k, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"step {k}"


def test_one_step_over_many_requests_equals_each_alone(tiny_cfg, fresh_seed, rng, gen):
    """vLLM's steps mix requests: several prefill chunks of different lengths and starts, and
    decodes, in ONE forward over the shared pages. Each request's greedy tokens must equal the
    reference engine's for it alone; a prefix hit with replay rides along."""
    model = build_model(tiny_cfg, seed=fresh_seed)
    fake = FakeVllm(model, tiny_cfg.sliding_window, "cpu", gen, interleaved=True)
    engine = Engine(model, prefill_mode="exact")
    prompts = [_prompt(rng, n) for n in (5, 23, 17, 9)]
    n_new = 6
    expected = [engine.generate(p, SamplingParams(max_new_tokens=n_new)).token_ids for p in prompts]
    tables = [fake.new_tables(48) for _ in prompts]
    # request 1 prefills in two chunks (the second beside the others' decodes), odd boundary
    # (a ratio-2 group spans the steps); request 3 starts late
    plan = {0: [(0, 5)], 1: [(0, 11), (11, 23)], 2: [(0, 17)], 3: [None, (0, 9)]}
    pos = [0] * len(prompts)
    out: list[list[int]] = [[] for _ in prompts]
    step = 0
    while any(len(o) < n_new for o in out):
        chunks, who = [], []
        for i, p in enumerate(prompts):
            todo = plan[i][step] if step < len(plan[i]) else "decode"
            if todo is None or len(out[i]) >= n_new:
                continue
            ids = p[todo[0]:todo[1]] if todo != "decode" else [out[i][-1]]
            samples = todo == "decode" or todo[1] == len(p)  # a prompt's last chunk gives a token
            chunks.append((tables[i], ids, pos[i]))
            who.append((i, len(ids), samples))
            pos[i] += len(ids)
        assert len(chunks) > 1 or step > 3
        h = fake.run(chunks)
        o = 0
        for i, n, sample in who:
            o += n
            if sample:
                out[i].append(int(model.logits(h[o - 1:o])[0].argmax()))
        step += 1
    assert out == expected


def test_prefix_hit_beside_other_requests(tiny_cfg, fresh_seed, rng, gen):
    """A request replaying after a prefix hit (exact replay, in chunks) shares its steps with a
    fresh request; both equal the reference (the replay start is found in the pages, the hit's
    global entries are not rewritten)."""
    cfg = tiny_cfg
    model = build_model(cfg, seed=fresh_seed)
    r = cfg.sliding_window * cfg.num_hidden_layers
    fake = FakeVllm(model, r, "cpu", gen)
    grain = max(fake.caches.block_sizes.values())
    prompt, other = _prompt(rng, r + grain + 5), _prompt(rng, 13)
    first = fake.new_tables(len(prompt) + 8)
    fake.generate(first, prompt, 2)
    snapshot = {p: lay.kv_cache.clone() for p, lay in fake.caches.glob.items()}
    hit = (len(prompt) - 1) // grain * grain
    start = hit - r
    hit_tables = fake.new_tables(len(prompt) + 8, {"hit": hit, "tables": first}, null_below=start)
    other_tables = fake.new_tables(24)
    cold = Engine(model, prefill_mode="exact")
    want = [cold.generate(prompt, SamplingParams(max_new_tokens=3)).token_ids,
            cold.generate(other, SamplingParams(max_new_tokens=3)).token_ids]
    # the replay in chunks of 40 beside the other request's prefill, then both decode
    got: list[list[int]] = [[], []]
    p0, p1 = start, 0
    while p0 < len(prompt) or len(got[0]) < 3:
        c0 = prompt[p0:p0 + 40] if p0 < len(prompt) else [got[0][-1]]
        c1 = other[p1:] if p1 < len(other) else [got[1][-1]]
        steps = [(hit_tables, c0, p0)] + ([(other_tables, c1, p1)] if len(got[1]) < 3 else [])
        h = fake.run(steps)
        if p0 + len(c0) >= len(prompt):
            got[0].append(int(model.logits(h[len(c0) - 1:len(c0)])[0].argmax()))
        if len(steps) > 1:
            got[1].append(int(model.logits(h[-1:])[0].argmax()))
        p0, p1 = p0 + len(c0), p1 + len(c1)
    assert got[0][:3] == want[0] and got[1][:3] == want[1]
    for p, lay in fake.caches.glob.items():  # the hit's cached entries are untouched
        bs = fake.caches.block_sizes[lay.prefix]
        shared = first[lay.prefix][: hit // bs].long()
        assert torch.equal(lay.kv_cache[shared], snapshot[p][shared])
