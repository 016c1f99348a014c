# dsv41 serving image for NVIDIA GPUs: vLLM's official OpenAI-server image with our wheel on top.
# UNBUILT AND UNVERIFIED: no Docker daemon was available to this project (images/README.md).
#
# Build from the repository root after `python3 -m pip wheel --no-deps -w dist .`:
#   docker build -f images/gpu.Dockerfile -t dsv41:gpu .
# BASE_IMAGE: vLLM 0.32.0, the version whose APIs the plugin is tested against (CPU build in CI).
ARG BASE_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${BASE_IMAGE}

# --no-deps: torch, triton and vllm come from the base image; our wheel is pure Python.
COPY dist/dsv41-*.whl /tmp/wheels/
RUN python3 -m pip install --no-cache-dir --no-deps /tmp/wheels/dsv41-*.whl \
    && rm -rf /tmp/wheels \
    && python3 -c "from importlib.metadata import entry_points as e; assert 'dsv41' in e(group='vllm.general_plugins').names"

EXPOSE 8000
# `docker run ... IMAGE MODEL_DIR [vLLM flags]` runs `dsv41 serve MODEL_DIR [vLLM flags]`
# (the base image's entry point is `vllm serve`, which would pick vLLM's own model class).
ENTRYPOINT ["dsv41", "serve"]
