"""Small helpers shared by the tests."""

import torch


def rand_prompt(cfg, n, gen, low=5):
    """Random token ids that avoid the special ids (0..4: bos, eos, pad, noise, image)."""
    return torch.randint(low, cfg.vocab_size, (n,), generator=gen)
