"""The core forward over a `KVPool.over` of row-strided views (every pool a field of wider records
with padding around it, the compressor rows first as in vLLM's pages; per-layer block sizes and
tables) equals the forward over the engine's own contiguous pool, bit for bit, on the reference
backend: chunked prefill across ratio-2 groups, then decode steps."""

import torch
from dsv41.core.batch import Chunk, build_step
from dsv41.core.cache import GlobalPool, KVPool, SequenceState, SWAPool
from dsv41.core.engine import SingleSequence
from dsv41.core.weights import build_model

PAD = 8  # bytes between fields and after the last one


def records(n: int, widths: list[int], gen) -> list[torch.Tensor]:
    """uint8 field views [n, w] of records holding `widths` bytes each with PAD bytes after every
    field (random contents: stale bytes)."""
    slot = -(-sum(w + PAD for w in widths) // 4) * 4  # (4-byte aligned rows, for the fp32 field)
    raw = torch.randint(0, 256, (n, slot), generator=gen, dtype=torch.uint8)
    out, o = [], 0
    for w in widths:
        out.append(raw[:, o:o + w])
        o += w + PAD
    return out


def strided_pool(cfg, n_blocks: int, gen) -> KVPool:
    """A pool over strided views: SWA layer l has block size 4 (l even) or 8 and its own table
    (number l % 2); KV source s has block size 8 and the global table (s // 2) % 2."""
    d, di = cfg.head_dim, cfg.index_head_dim
    swa, carry, glob = [], {}, {}
    for li in range(cfg.num_hidden_layers):
        bs = 4 if li % 2 == 0 else 8
        has_carry = li in cfg.kv_source_layer_ids and cfg.compress_ratios[li] > 1
        f = records(n_blocks * bs, ([8 * d] if has_carry else []) + [d, d // 32], gen)
        if has_carry:
            carry[li] = f.pop(0).view(torch.float32).view(-1, 2, d)
        swa.append(SWAPool(f[0].view(torch.float8_e4m3fn), f[1].view(torch.float8_e8m0fnu), bs, li % 2))
    for s in cfg.kv_source_layer_ids:
        r = cfg.compress_ratios[s]
        e = 8 // r
        f = records(n_blocks * e, [d // 2, d // 16, di // 2, di // 32], gen)
        glob[s] = GlobalPool(r, e, f[0], f[1].view(torch.float8_e4m3fn), f[2], f[3].view(torch.float8_e8m0fnu),
                             (s // 2) % 2)
    for t in (*carry.values(), *(p.kv for p in swa), *(g.kv_codes for g in glob.values())):
        assert not t.is_contiguous()
    return KVPool.over(cfg, swa, carry, glob, "cpu")


def test_forward_over_strided_pools_equals_contiguous(tiny_cfg, fresh_seed, rng):
    cfg = tiny_cfg
    model = build_model(cfg, seed=fresh_seed)
    gen = torch.Generator().manual_seed(fresh_seed)
    ids = [int(x) for x in torch.randint(9, 500, (31,), generator=rng)]
    n_blocks = 40
    pool = strided_pool(cfg, n_blocks, gen)
    for p in pool.swa:  # the null block never decodes to NaN here (vLLM's starts zeroed)
        p.kv.view(torch.uint8)[: p.block_size] = 0
    state = SequenceState()
    # this pool allocates nothing: blocks 1.. of every table (shuffled), one table per group
    perm = (torch.randperm(n_blocks - 1, generator=gen) + 1).tolist()
    tables = {"swa": [perm[:12], perm[12:24]], "glob": [perm[24:30], perm[30:36]]}

    def step(chunk_ids):
        ch = Chunk(state, chunk_ids, 0, "all")
        state.swa_blocks, state.glob_blocks = tables["swa"][0], tables["glob"][0]  # (build_step takes none)
        batch = build_step(cfg, pool, [ch], "cpu")
        t = lambda x: torch.tensor([x])  # noqa: E731
        batch.swa_tables = tuple(t(b) for b in tables["swa"])
        batch.glob_tables = tuple(t(b) for b in tables["glob"])
        return model(batch, pool)

    ref = SingleSequence(model, block_size=8)
    pos = 0
    for n in (7, 12, 1, 1, 9, 1):  # odd boundaries: ratio-2 groups span the steps
        got = step(ids[pos:pos + n])
        want = ref.feed(ids[pos:pos + n], all_logits=True)
        assert torch.isfinite(want).all()
        assert torch.equal(got, want), f"chunk at {pos}"
        pos += n
