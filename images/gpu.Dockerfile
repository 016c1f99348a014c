# dsv41 serving image for NVIDIA GPUs: vLLM's official OpenAI-server image with our wheel on top.
# UNBUILT AND UNVERIFIED: no Docker daemon was available to this project (images/README.md).
#
# Build from the repository root after `python3 -m pip wheel --no-deps -w dist .`:
#   docker build -f images/gpu.Dockerfile -t dsv41:gpu .
# BASE_IMAGE defaults to GPU_IMAGE of images/versions.env (vLLM 0.32.0, the version whose APIs the
# plugin is tested against in CI's CPU build); pin a digest with --build-arg BASE_IMAGE=...@sha256:...
ARG BASE_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${BASE_IMAGE}

# --no-deps: torch, triton and vllm come from the base image; our wheel is pure Python.
ARG ALLOW_VERSION_DRIFT=0
COPY dist/dsv41-*.whl /tmp/wheels/
COPY images/versions.env images/check_versions.py /opt/dsv41/
RUN python3 -m pip install --no-cache-dir --no-deps /tmp/wheels/dsv41-*.whl \
    && rm -rf /tmp/wheels \
    && python3 -c "from importlib.metadata import entry_points as e; assert 'dsv41' in e(group='vllm.general_plugins').names" \
    && ALLOW_VERSION_DRIFT=${ALLOW_VERSION_DRIFT} python3 /opt/dsv41/check_versions.py gpu /opt/dsv41/versions.env

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=10s --start-period=3600s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ.get('DSV41_HEALTH_URL', 'http://127.0.0.1:8000/health'), timeout=5)"]
# `docker run ... IMAGE MODEL_DIR [vLLM flags]` runs `dsv41 serve MODEL_DIR [vLLM flags]`
# (the base image's entry point is `vllm serve`, which would pick vLLM's own model class).
ENTRYPOINT ["dsv41", "serve"]
