"""vLLM plugin: registers `Dsv41ForCausalLM` (our model class) with vLLM.

Entry point (pyproject): group `vllm.general_plugins`, name `dsv41`, value
`dsv41.deploy.vllm:register`. vLLM (and vllm-ascend) ship their own `DeepseekV41ForCausalLM`;
ours has a distinct architecture name, selected per server with
`--hf-overrides '{"architectures": ["Dsv41ForCausalLM"]}'` (what `dsv41 serve` passes).
Nothing here imports vllm at `import dsv41`; `register()` runs inside vLLM's processes.
"""

ARCHITECTURE = "Dsv41ForCausalLM"
PLUGIN_NAME = "dsv41"


def register() -> None:
    """Register the model class lazily ("module:Class"), once per process."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "dsv41.deploy.vllm.model:Dsv41ForCausalLM")
