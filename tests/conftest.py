import os
import random
import zlib

import pytest
import torch

from dsv41.core.config import preset
from dsv41.core.weights import build_model


# The tiny model's ops are small: extra intra-op threads only add synchronisation, and with
# another busy process on a 2-core machine OpenMP's spinning makes them up to 10x slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_cfg():
    return preset("tiny")


@pytest.fixture(scope="module")
def fresh_seed():
    """A new seed every run (printed, so a failure can be replayed with DSV41_TEST_SEED)."""
    seed = int(os.environ.get("DSV41_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"\n[dsv41] test seed {seed} (set DSV41_TEST_SEED={seed} to replay)")
    return seed


@pytest.fixture(scope="module")
def tiny_model(tiny_cfg, fresh_seed):
    """The tiny preset with freshly seeded random weights in storage formats."""
    return build_model(tiny_cfg, seed=fresh_seed)


@pytest.fixture
def rng(fresh_seed, request):
    # crc32, not hash(): str hashes change from process to process, which would break replay
    return torch.Generator().manual_seed(fresh_seed + zlib.crc32(request.node.name.encode()) % 1000)

