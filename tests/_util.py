"""Small helpers shared by the tests."""

import torch


def rand_prompt(cfg, n, gen, low=5):
    """Random token ids that avoid the special ids (0..4: bos, eos, pad, noise, image)."""
    return torch.randint(low, cfg.vocab_size, (n,), generator=gen)


def dsv41(*args, check=True):
    """Run the `dsv41` command line in a subprocess (one intra-op thread: on a small busy machine
    OpenMP spinning is much slower); with `check`, assert it succeeded."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "dsv41.deploy.cli", *args], capture_output=True, text=True,
                       timeout=300, env=env, check=False)
    if check:
        assert p.returncode == 0, p.stderr
    return p
