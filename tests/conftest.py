"""Shared fixtures and the test seed.

Every test's randomness derives from one seed: DEFAULT_SEED unless `pytest --seed N` or the
environment variable DSV41_TEST_SEED=N says otherwise (the option wins). The seed is printed in
the report header and attached to every failed test's report, so a failure is replayed by
running the same test with that seed. Before each test the global torch / random / numpy
generators are seeded from (seed, test id), so a test that forgets an explicit generator is
still reproducible and independent of which other tests ran before it.
"""

import os
import random
import zlib

import pytest
import torch

from dsv41.core.config import preset
from dsv41.core.weights import build_model

DEFAULT_SEED = 20261130
SEED_ENV = "DSV41_TEST_SEED"

# The tiny model's ops are small: extra intra-op threads only add synchronisation, and with
# another busy process on a 2-core machine OpenMP's spinning makes them up to 10x slower.
torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--seed", type=int, default=None,
                     help=f"seed of every test's randomness (default: ${SEED_ENV}, else {DEFAULT_SEED})")


def _session_seed(config) -> int:
    opt = config.getoption("--seed")
    if opt is not None:
        return opt
    env = os.environ.get(SEED_ENV, "").strip()
    if env:
        try:
            return int(env)
        except ValueError:
            raise pytest.UsageError(f"{SEED_ENV} must be an integer, got {env!r}") from None
    return DEFAULT_SEED


def pytest_configure(config):
    config.dsv41_seed = _session_seed(config)


def pytest_collection_modifyitems(config, items):
    """The `slow` tests first, the rest in file order: under pytest-xdist (the nox sessions run one
    worker per core, one test at a time to whichever is free) the longest tests then start at once
    and the short ones fill in around them, instead of a long one starting last and running alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_report_header(config):
    return f"dsv41 test seed: {config.dsv41_seed} (replay with --seed {config.dsv41_seed} or {SEED_ENV})"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Attach the seed to a failed test's report (shown with its traceback)."""
    outcome = yield
    rep = outcome.get_result()
    if rep.failed:
        seed = item.config.dsv41_seed
        rep.sections.append(("dsv41 test seed", f"seed {seed}: replay with `pytest --seed {seed} {item.nodeid}`"))


def _test_seed(seed: int, name: str) -> int:
    # crc32, not hash(): str hashes change from process to process, which would break replay
    return (seed + zlib.crc32(name.encode())) % 2**31


@pytest.fixture(autouse=True)
def _seed_global_generators(request):
    """Seed the global generators per test (a test's draws do not depend on the tests before it)."""
    s = _test_seed(request.config.dsv41_seed, request.node.nodeid)
    torch.manual_seed(s)
    random.seed(s)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with the test environment
        return
    np.random.seed(s)


@pytest.fixture(scope="session")
def tiny_cfg():
    return preset("tiny")


@pytest.fixture(scope="session")
def fresh_seed(request):
    """The session's test seed (fixed by default; `--seed` / DSV41_TEST_SEED vary it)."""
    return request.config.dsv41_seed


@pytest.fixture(scope="module")
def tiny_model(tiny_cfg, fresh_seed):
    """The tiny preset with seeded random weights in storage formats."""
    return build_model(tiny_cfg, seed=fresh_seed)


@pytest.fixture
def rng(fresh_seed, request):
    """A generator seeded from (session seed, test name)."""
    return torch.Generator().manual_seed(fresh_seed + zlib.crc32(request.node.name.encode()) % 1000)


@pytest.fixture
def official_reference():
    """The reference ops in the official numerics mode (backends/numerics.py) for the test: the
    device kernels round where the official code rounds, so they are compared with that mode.
    Modules use it through `pytestmark = [..., pytest.mark.usefixtures("official_reference")]`."""
    from dsv41.backends.numerics import numerics

    with numerics("official"):
        yield
