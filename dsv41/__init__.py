"""dsv41: DeepSeek-V4.1-Flash on Ascend NPUs, NVIDIA GPUs and a CPU reference path.

The subpackages live in the repository's top-level folders (``core/``, ``backends/``,
``npu_ops/``, ``graphs/``, ``deploy/``) and are mapped into this namespace by pyproject.toml.
"""

__version__ = "0.1.0"
