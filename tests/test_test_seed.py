"""tests/conftest.py's seed handling: fixed by default, varied by --seed or DSV41_TEST_SEED, shown
in the report header and on every failure."""

import re
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()
PROBE = """
import random
import torch

def test_report_seed(fresh_seed, rng):
    print("SEED", fresh_seed, "RNG", int(torch.randint(0, 10**9, (1,), generator=rng)),
          "GLOBAL", int(torch.randint(0, 10**9, (1,))), random.random())

def test_fails():
    assert False
"""


def _run(pytester, *args):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_probe=PROBE)
    res = pytester.runpytest_inprocess("-s", "-p", "no:cacheprovider", *args)
    res.assert_outcomes(passed=1, failed=1)
    out = res.stdout.str()
    line = re.search(r"SEED .*", out).group(0)
    return out, line


def test_default_seed_is_fixed_and_reported(pytester, monkeypatch):
    monkeypatch.delenv("DSV41_TEST_SEED", raising=False)
    out, first = _run(pytester)
    _, second = _run(pytester)
    assert first == second  # the same draws on every run
    assert "dsv41 test seed: 20261130" in out  # the header
    assert "seed 20261130: replay with `pytest --seed 20261130 test_probe.py::test_fails`" in out  # the failure


def test_seed_option_and_environment(pytester, monkeypatch):
    monkeypatch.setenv("DSV41_TEST_SEED", "11")
    out_env, env = _run(pytester)
    assert env.startswith("SEED 11 ") and "dsv41 test seed: 11" in out_env
    out_opt, opt = _run(pytester, "--seed", "12")  # the option wins over the environment
    assert opt.startswith("SEED 12 ") and "replay with `pytest --seed 12" in out_opt
    assert env.split()[3] != opt.split()[3]  # the rng fixture follows the seed
    assert env.split()[5] != opt.split()[5]  # and so do the global generators


def test_bad_environment_seed_is_a_usage_error(pytester, monkeypatch):
    monkeypatch.setenv("DSV41_TEST_SEED", "abc")
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_probe=PROBE)
    res = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    assert "DSV41_TEST_SEED must be an integer, got 'abc'" in res.stderr.str()
