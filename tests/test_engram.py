"""Engram token-side math: primes, multipliers, compression map, hashed row ids.

The row-id oracle below is written straight from the spec text with Python ints and loops;
it does not call the implementation.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dsv41.core.config import ModelConfig, preset
from dsv41.core.engram import (
    build_compression_map,
    engram_multipliers,
    engram_primes,
    engram_row_ids,
)
from dsv41.core.tokenizer import build_tiny_tokenizer

MASK64 = (1 << 64) - 1


def _to_i64(x: int) -> int:
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


def _oracle_rows(tokens, image, start, mults, primes, pad, max_ngram, n_heads):
    """Plain-Python reading of the spec: rolling XOR of tok[p-s]*mult[s]; slots before the
    start or on an image token, and all older slots behind them, are pad; row = hash mod
    prime + offset (sum of the earlier primes)."""
    out = []
    for p in range(start, len(tokens)):
        slots = []
        blocked = False
        for s in range(max_ngram):
            q = p - s
            if q < 0 or image[q]:
                blocked = True
            slots.append(pad if blocked else tokens[q])
        row = []
        for n in range(2, max_ngram + 1):
            h = 0
            for s in range(n):
                h ^= _to_i64(slots[s] * int(mults[s]))
            h = _to_i64(h)
            for head in range(n_heads):
                k = (n - 2) * n_heads + head
                row.append(h % primes[k] + sum(primes[:k]))
        out.append(row)
    return out


# ---- primes and multipliers --------------------------------------------------------------

def test_full_config_primes():
    cfg = ModelConfig()
    primes = engram_primes(cfg)
    assert len(primes) == 2
    assert [len(p) for p in primes] == [24, 24]
    assert primes[0][0] == 16000057
    assert primes[1][0] == 16000477
    assert [sum(p) for p in primes] == [384006168, 384016682] == cfg.engram_num_embeddings
    flat = primes[0] + primes[1]
    assert flat == sorted(set(flat))  # strictly increasing: consecutive, none shared


def test_tiny_preset_table_sizes_come_from_primes():
    cfg = preset("tiny")
    primes = engram_primes(cfg)
    assert cfg.engram_num_embeddings == [sum(p) for p in primes]
    assert all(len(p) == (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads for p in primes)
    assert primes[0][0] > cfg.engram_vocab_size


def test_multipliers_published_values():
    cfg = ModelConfig()
    m1 = engram_multipliers(cfg, 1)
    m14 = engram_multipliers(cfg, 14)
    assert m1.dtype == np.int64 and m1.shape == (4,)
    assert int(m1[0]) == 76632096046245
    assert int(m14[0]) == 67716810739261
    bound = (np.iinfo(np.int64).max // cfg.engram_compressed_vocab_size) // 2
    for m in (m1, m14):
        assert np.all(m % 2 == 1)
        assert np.all((m >= 1) & (m < 2 * bound + 1))


def test_multipliers_need_compressed_vocab():
    cfg = preset("tiny").replace(engram_compressed_vocab_size=0)  # not recorded
    with pytest.raises(ValueError):
        engram_multipliers(cfg, 1)
    m = engram_multipliers(cfg, 1, compressed_vocab_size=300)
    assert m.shape == (cfg.engram_max_ngram_size,) and np.all(m % 2 == 1)


# ---- row ids ----------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_row_ids_match_python_oracle(seed):
    rng = random.Random(seed)
    cfg = ModelConfig()
    primes = engram_primes(cfg)[seed % 2]
    layer = cfg.engram_layer_ids[seed % 2]
    mults = engram_multipliers(cfg, layer)
    V = cfg.engram_compressed_vocab_size
    pad = rng.randrange(V)
    N = rng.randrange(20, 60)
    tokens = [rng.randrange(V) for _ in range(N)]
    image = [rng.random() < 0.15 for _ in range(N)]
    start = rng.randrange(0, N // 2)
    got = engram_row_ids(torch.tensor(tokens), torch.tensor(image), start, mults, primes,
                         pad, cfg.engram_max_ngram_size, cfg.engram_n_heads)
    want = _oracle_rows(tokens, image, start, mults, primes, pad,
                        cfg.engram_max_ngram_size, cfg.engram_n_heads)
    assert got.dtype == torch.int64
    assert got.shape == (N - start, 24)
    assert got.tolist() == want
    assert (got >= 0).all() and (got < sum(primes)).all()


def test_row_ids_oracle_small_config_and_wrapping():
    """Tiny table sizes, 2 heads, large (overflowing) multipliers and no image mask."""
    rng = random.Random(7)
    primes = [1009, 1013, 1019, 1021, 1031, 1033]
    mults = np.array([(1 << 62) + 12345, (1 << 61) + 99, 3, (1 << 62) - 1], dtype=np.int64)
    tokens = [rng.randrange(50000) for _ in range(30)]
    got = engram_row_ids(torch.tensor(tokens), None, 0, mults, primes, 2, 4, 2)
    want = _oracle_rows(tokens, [False] * 30, 0, mults, primes, 2, 4, 2)
    assert got.tolist() == want


def test_image_positions_and_slots_behind_are_pad():
    cfg = ModelConfig()
    primes = engram_primes(cfg)[0]
    mults = engram_multipliers(cfg, 1)
    pad = 7
    N, img = 12, 5
    tokens = list(range(100, 100 + N))
    image = [i == img for i in range(N)]
    got = engram_row_ids(torch.tensor(tokens), torch.tensor(image), 0, mults, primes, pad, 4, 8)
    all_pad = torch.full((N,), pad, dtype=torch.int64)
    ref_pad = engram_row_ids(all_pad, None, 0, mults, primes, pad, 4, 8)
    # an image token at p: every slot is pad
    assert got[img].tolist() == ref_pad[img].tolist()
    # position img+1: slot 0 is the token, slots 1.. (the image and all older) are pad
    seq = torch.tensor([pad, pad, pad, tokens[img + 1]])
    expect = engram_row_ids(seq, None, 3, mults, primes, pad, 4, 8)
    assert got[img + 1].tolist() == expect[0].tolist()
    # position img+2: slots 0,1 real, slots 2,3 pad
    seq = torch.tensor([pad, pad, tokens[img + 1], tokens[img + 2]])
    expect = engram_row_ids(seq, None, 3, mults, primes, pad, 4, 8)
    assert got[img + 2].tolist() == expect[0].tolist()
    # far enough after the image the rows are unaffected
    no_img = engram_row_ids(torch.tensor(tokens), None, 0, mults, primes, pad, 4, 8)
    assert got[img + 4:].tolist() == no_img[img + 4:].tolist()
    assert got[:img].tolist() == no_img[:img].tolist()
    # sequence start: position 0 has slots 1..3 pad
    seq = torch.tensor([pad, pad, pad, tokens[0]])
    assert no_img[0].tolist() == engram_row_ids(seq, None, 3, mults, primes, pad, 4, 8)[0].tolist()


def test_row_ids_start_slices_full_computation():
    cfg = ModelConfig()
    primes = engram_primes(cfg)[1]
    mults = engram_multipliers(cfg, 14)
    g = torch.Generator().manual_seed(3)
    toks = torch.randint(0, cfg.engram_compressed_vocab_size, (40,), generator=g)
    img = torch.rand(40, generator=g) < 0.1
    full = engram_row_ids(toks, img, 0, mults, primes, 5, 4, 8)
    part = engram_row_ids(toks, img, 33, mults, primes, 5, 4, 8)
    assert torch.equal(full[33:], part)


# ---- compression map --------------------------------------------------------------------

def test_compression_map_tiny_tokenizer_deterministic():
    tok = build_tiny_tokenizer()
    m1, n1 = build_compression_map(tok)
    m2, n2 = build_compression_map(build_tiny_tokenizer())
    assert m1.dtype == np.int64 and m1.shape == (512,)
    assert n1 == n2 and np.array_equal(m1, m2)
    assert 0 < n1 <= 512 and m1.max() == n1 - 1
    # first-seen order: specials 0..8 are distinct keys seen first
    assert m1[:9].tolist() == list(range(9))
    # the first occurrence of each compressed id is increasing
    first = [int(np.argmax(m1 == c)) for c in range(n1)]
    assert first == sorted(first)
    cfg = preset("tiny")
    assert n1 == cfg.engram_compressed_vocab_size  # the tiny preset records the real size
    pad = int(m1[cfg.engram_pad_token_id])
    assert pad == 2
    # larger model vocab: extra ids add nothing and map to the pad's compressed id
    m3, n3 = build_compression_map(tok, vocab_size=600, pad_token_id=cfg.engram_pad_token_id)
    assert n3 == n1 and np.array_equal(m3[:512], m1) and np.all(m3[512:] == pad)


def test_compression_map_merges_case_accent_and_space_variants():
    from tokenizers import Tokenizer, models

    vocab = {"<pad>": 0, "Hello": 1, "hello": 2, "héllo": 3, " ": 4, "\u00a0": 5, "HÉLLO": 6,
             "world": 7, "\n\n": 8, "  ": 9, " Hello": 10, "\u0301": 11, "x": 12}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    m, n = build_compression_map(tok)
    assert m.tolist()[:1] == [0]
    assert m[1] == m[2] == m[3] == m[6] == m[10]  # case, accent, leading space
    assert m[4] == m[5] == m[8] == m[9]  # lone space sentinel: all whitespace tokens -> " "
    assert m[4] != m[1] and m[7] not in (m[1], m[4])
    # a combining accent alone normalises to "" and is keyed by its decoded text
    assert m[11] not in (m[0], m[1], m[4], m[7])
    assert n == 6
    assert m.tolist() == [0, 1, 1, 1, 2, 2, 1, 3, 2, 2, 1, 4, 5]
