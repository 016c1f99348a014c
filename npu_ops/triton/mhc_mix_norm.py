"""The mHC step after a sublayer and the next sublayer's input norm (fused op `mhc_mix_norm`).

`mega_mhc.mhc_mix` with its `norm` option: the coefficient epilogue (the second launch, or the
main kernel's last program per token tile with FUSED_COEF) also RMS-normalises the token's x_hat
row (fp32 math, as the `rms_norm` kernel), so the norm costs no launch of its own. Without `fn`
there is no epilogue: the mix, then the `rms_norm` kernel (the composition). Interpreter-tested
against the composition (tests/test_triton_fused.py); unverified on hardware.
"""

from __future__ import annotations

import torch

from .mega_mhc import mhc_mix
from .rms_norm import rms_norm


def mhc_mix_norm(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, pre: torch.Tensor,
                 fn: torch.Tensor | None, scale: torch.Tensor | None, base: torch.Tensor | None, norm_eps: float,
                 hc_eps: float, iters: int, norm_weight: torch.Tensor, eps: float) -> tuple:
    """`ops.mhc_mix_norm`: (x_new, x_hat, coef or None, rms_norm(x_hat, norm_weight, eps))."""
    if fn is None:
        x_new, x_hat, coef = mhc_mix(x, y, post, comb, pre, None, None, None, norm_eps, hc_eps, iters)
        return x_new, x_hat, coef, rms_norm(x_hat, norm_weight, eps)
    return mhc_mix(x, y, post, comb, pre, fn, scale, base, norm_eps, hc_eps, iters, norm=(norm_weight, eps))


OPS = {"mhc_mix_norm": mhc_mix_norm}
