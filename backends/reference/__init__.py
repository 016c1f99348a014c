"""Plain-torch reference implementations of every op (fp32 math): the oracle."""

from . import attention, basic, mhc, moe, sampling  # noqa: F401  (register on import)
