"""Test environments. `nox` runs the default sessions; `nox -s NAME` runs one.

- tests: the CPU test suite (reference numerics, model invariants, engine, CLI) on torch 2.13 CPU.
Further environments (upstream Triton / triton-ascend interpreters, vLLM CPU, MindSpore) are
separate sessions because their packages conflict with each other.
"""

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

TORCH = "torch==2.13.0"  # the CPU build; an unpinned torch would pull a multi-GB CUDA build


@nox.session
def tests(session: nox.Session) -> None:
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.run("pytest", "-q", *session.posargs)
