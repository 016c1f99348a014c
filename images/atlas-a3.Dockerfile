# dsv41 serving image for Atlas 800 A3 (8 NPUs, 16 dies): vllm-ascend's image with our wheel on top.
# UNBUILT AND UNVERIFIED: no Docker daemon or NPU was available to this project (images/README.md).
#
# Build from the repository root after `python3 -m pip wheel --no-deps -w dist .`:
#   docker build -f images/atlas-a3.Dockerfile -t dsv41:atlas-a3 .
# BASE_IMAGE defaults to ASCEND_A3_IMAGE of images/versions.env (the one place of the version set; a test
# keeps this default equal to it). No digest is published in the sources we could read: pin one
# with --build-arg BASE_IMAGE=<name>@sha256:<digest>.
ARG BASE_IMAGE=quay.io/ascend/vllm-ascend:deepseek-v4.1-flash-a3
FROM ${BASE_IMAGE}

# --no-deps: torch, torch_npu, triton-ascend, vllm and vllm-ascend come from the base image as one
# validated set; our wheel is pure Python and must not move any of them. check_versions.py fails
# the build when the base's set differs from versions.env (ALLOW_VERSION_DRIFT=1 builds anyway).
ARG ALLOW_VERSION_DRIFT=0
COPY dist/dsv41-*.whl /tmp/wheels/
COPY images/versions.env images/check_versions.py /opt/dsv41/
RUN python3 -m pip install --no-cache-dir --no-deps /tmp/wheels/dsv41-*.whl \
    && rm -rf /tmp/wheels \
    && python3 -c "from importlib.metadata import entry_points as e; assert 'dsv41' in e(group='vllm.general_plugins').names" \
    && ALLOW_VERSION_DRIFT=${ALLOW_VERSION_DRIFT} python3 /opt/dsv41/check_versions.py ascend /opt/dsv41/versions.env

COPY images/ascend-entrypoint.sh /usr/local/bin/dsv41-entrypoint

# No PYTORCH_NPU_ALLOC_CONF here: vllm-ascend sets its own allocator configuration.
EXPOSE 8000
# vLLM's /health answers 200 once the engine is up; loading the full model takes many minutes.
# DSV41_HEALTH_URL overrides the address (e.g. when serving on another --port).
HEALTHCHECK --interval=30s --timeout=10s --start-period=3600s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ.get('DSV41_HEALTH_URL', 'http://127.0.0.1:8000/health'), timeout=5)"]
# `docker run ... IMAGE MODEL_DIR [vLLM flags]` runs `dsv41 serve MODEL_DIR [vLLM flags]`.
ENTRYPOINT ["/usr/local/bin/dsv41-entrypoint"]
