# dsv41 serving image for Atlas 800 A3 (8 NPUs, 16 dies): vllm-ascend's image with our wheel on top.
# UNBUILT AND UNVERIFIED: no Docker daemon or NPU was available to this project (images/README.md).
#
# Build from the repository root after `python3 -m pip wheel --no-deps -w dist .`:
#   docker build -f images/atlas-a3.Dockerfile -t dsv41:atlas-a3 .
# BASE_IMAGE: vllm-ascend's DeepSeek-V4.1-Flash image for A3 (its kernels are built for the A3 SoC;
# its vLLM knows the DeepSeek-V4.1 config and the SWA bounded-replay cache spec our plugin uses);
# any A3 (`-a3`) vllm-ascend image whose vLLM is that new works (docs/serving.md, "Version pairs").
ARG BASE_IMAGE=quay.io/ascend/vllm-ascend:deepseek-v4.1-flash-a3
FROM ${BASE_IMAGE}

# --no-deps: torch, torch_npu, triton-ascend, vllm and vllm-ascend come from the base image as one
# validated set; our wheel is pure Python and must not move any of them.
COPY dist/dsv41-*.whl /tmp/wheels/
RUN python3 -m pip install --no-cache-dir --no-deps /tmp/wheels/dsv41-*.whl \
    && rm -rf /tmp/wheels \
    && python3 -c "from importlib.metadata import entry_points as e; assert 'dsv41' in e(group='vllm.general_plugins').names"

COPY images/ascend-entrypoint.sh /usr/local/bin/dsv41-entrypoint

# Torch-NPU allocator: expandable segments reduce fragmentation over long serving runs.
ENV PYTORCH_NPU_ALLOC_CONF=expandable_segments:True

EXPOSE 8000
# `docker run ... IMAGE MODEL_DIR [vLLM flags]` runs `dsv41 serve MODEL_DIR [vLLM flags]`.
ENTRYPOINT ["/usr/local/bin/dsv41-entrypoint"]
