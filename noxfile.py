"""Test environments. `nox` runs the default sessions; `nox -s NAME` runs one.

- tests: the CPU test suite (reference numerics, model invariants, engine, CLI) on torch 2.13 CPU.
- triton: the Triton kernels (npu_ops/triton) under upstream Triton's interpreter (TRITON_INTERPRET=1).
- triton_ascend: the same kernels under triton-ascend's front end / interpreter (no CANN needed);
  proves a kernel uses only what Ascend accepts. Its `triton` package clashes with upstream's,
  hence a separate session.
Further environments (upstream Triton / triton-ascend interpreters, vLLM CPU, MindSpore) are
separate sessions because their packages conflict with each other.
"""

import nox

nox.options.sessions = ["tests", "triton", "triton_ascend"]
nox.options.reuse_existing_virtualenvs = True

TORCH = "torch==2.13.0"  # the CPU build; an unpinned torch would pull a multi-GB CUDA build


@nox.session
def tests(session: nox.Session) -> None:
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.run("pytest", "-q", *session.posargs)


def triton_tests() -> list[str]:
    """Every kernel's interpreter test file (one per kernel: tests/test_triton_*.py)."""
    import glob

    return sorted(glob.glob("tests/test_triton_*.py"))


@nox.session
def triton(session: nox.Session) -> None:
    session.install(TORCH, "numpy", "triton==3.7.1")
    session.install("-e", ".[test]")
    session.run("pytest", "-q", *triton_tests(), *session.posargs, env={"TRITON_INTERPRET": "1"})


@nox.session
def triton_ascend(session: nox.Session) -> None:
    # numpy < 2.4: triton-ascend 3.2's interpreter calls int() on 1-element arrays (for
    # `range(pid, n, step)`), which numpy 2.4 rejects ("only 0-dimensional arrays ...").
    session.install(TORCH, "numpy<2.4", "pybind11", "triton-ascend==3.2.0")
    session.install("-e", ".[test]")
    session.run("pytest", "-q", *triton_tests(), *session.posargs, env={"TRITON_INTERPRET": "1"})
