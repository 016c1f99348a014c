"""`build_step`'s host layout of a step: every row's position, sequence, n-gram window, image
flags, and which rows reach the decoder and return logits, checked row by row against their
definitions on random multi-sequence steps (chunks after earlier chunks, CED decoder starts,
all three logits modes, image tokens, generated tokens that equal the image token id)."""

from __future__ import annotations

import random

import pytest
import torch

from dsv41.core.batch import Chunk, build_step
from dsv41.core.cache import KVPool, SequenceState
from dsv41.core.config import preset

IMG = 7  # the image token id of these steps


def _expected(cfg, chunks, starts):
    """The step's rows written out one token at a time from the definitions."""
    n_gram = max(cfg.engram_max_ngram_size, 1)
    rows = dict(ids=[], pos=[], seq=[], img=[], ngram=[], ngram_img=[], dec=[], logit=[])
    n_dec = 0
    for b, (ch, start) in enumerate(zip(chunks, starts)):
        toks, flags = ch.state.tokens, ch.state.is_image
        for j, t in enumerate(ch.ids):
            p = start + j
            rows["ids"].append(t)
            rows["pos"].append(p)
            rows["seq"].append(b)
            rows["img"].append(not ch.text_only and t == IMG)
            rows["ngram"].append([toks[p - s] if p - s >= 0 else -1 for s in range(n_gram)])
            rows["ngram_img"].append([p - s >= 0 and flags[p - s] for s in range(n_gram)])
            if p >= ch.decoder_from:
                if ch.logits == "all" or (ch.logits == "last" and j == len(ch.ids) - 1):
                    rows["logit"].append(n_dec)
                rows["dec"].append(len(rows["ids"]) - 1)
                n_dec += 1
    return rows, n_dec


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_step_rows_match_their_definitions(seed):
    cfg = preset("tiny")
    rng = random.Random(seed)
    pool = KVPool(cfg, block_size=16, swa_blocks=512, global_blocks=512)
    states = [SequenceState() for _ in range(4)]
    for step in range(4):
        chunks = []
        for b in rng.sample(range(4), rng.randint(1, 4)):
            st = states[b]
            n = rng.choice([1, 2, 5, 37, 80])  # (80: past host_tensor's typed-array threshold)
            ids = [IMG if rng.random() < 0.2 else rng.randrange(cfg.vocab_size) for _ in range(n)]
            text_only = rng.random() < 0.3
            n_img = 0 if text_only else ids.count(IMG)
            chunks.append(Chunk(st, ids, decoder_from=rng.choice([0, st.length + rng.randint(0, n + 1)]),
                                logits=rng.choice(["last", "all", "none"]), text_only=text_only,
                                image_embeds=torch.zeros(n_img, cfg.hidden_size) if n_img else None))
        starts = [ch.state.length for ch in chunks]
        batch = build_step(cfg, pool, chunks, "cpu", IMG)
        want, n_dec = _expected(cfg, chunks, starts)  # (the states now hold this step's tokens)
        where = f"seed {seed}, step {step}"
        for name, dtype in (("ids", torch.long), ("positions", torch.long), ("seq", torch.long),
                            ("is_image", torch.bool), ("ngram_ids", torch.long), ("ngram_image", torch.bool)):
            assert getattr(batch, name).dtype == dtype, (where, name)
        assert batch.ids.tolist() == want["ids"], where
        assert batch.positions.tolist() == want["pos"], where
        assert batch.seq.tolist() == want["seq"], where
        assert batch.is_image.tolist() == want["img"], where
        assert batch.ngram_ids.tolist() == want["ngram"], where
        assert batch.ngram_image.tolist() == want["ngram_img"], where
        assert torch.equal(batch.ngram_host[0], batch.ngram_ids) and torch.equal(batch.ngram_host[1], batch.ngram_image)
        all_rows = len(want["dec"]) == len(want["ids"])
        assert (batch.decoder_rows is None) == all_rows, where
        if not all_rows:
            assert batch.decoder_rows.tolist() == want["dec"], where
        all_logits = len(want["logit"]) == n_dec
        assert (batch.logit_rows is None) == all_logits, where
        if not all_logits:
            assert batch.logit_rows.tolist() == want["logit"], where
        for ch, start in zip(chunks, starts):
            assert ch.state.length == start + len(ch.ids), where


def test_step_refuses_bad_tokens_before_changing_state():
    cfg = preset("tiny")
    pool = KVPool(cfg, block_size=16, swa_blocks=8, global_blocks=8)
    st = SequenceState()
    with pytest.raises(ValueError, match=f"token id {cfg.vocab_size} is outside the vocabulary"):
        build_step(cfg, pool, [Chunk(st, [1, 2, cfg.vocab_size, 3])], "cpu")
    with pytest.raises(ValueError, match="token id -1 is outside"):
        build_step(cfg, pool, [Chunk(st, [-1])], "cpu")
    with pytest.raises(ValueError, match="at least one token"):
        build_step(cfg, pool, [Chunk(st, [])], "cpu")
    assert st.length == 0 and st.tokens == []
