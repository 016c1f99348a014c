"""The mHC steps with the next sublayer's input norm folded in (fused ops `mhc_mix_norm`,
`mhc_enter_norm`).

`mhc_mix_norm`: `mega_mhc.mhc_mix` with its `norm` option: the coefficient epilogue (the second
launch, or the main kernel's last program per token tile: DSV41_MHC_COEF) also RMS-normalises
the token's x_hat row (fp32 math, as the `rms_norm` kernel), so the norm costs no launch of its
own. Without `fn` there is no epilogue: the mix, then the `rms_norm` kernel (the composition).

`mhc_enter_norm`: `mhc_mixes.mhc_mixes` with its `collapse_norm` option: the same epilogue first
collapses the token's streams with `pre` (as the `mhc_collapse` kernel), stores x_hat and
normalises it: the collapse and the norm launch nothing of their own.

Interpreter-tested against the compositions (tests/test_triton_mega_mhc.py); unverified on
hardware.
"""

from __future__ import annotations

import torch

from ...backends.fused import mhc_enter_norm as mhc_enter_norm_ref  # noqa: F401  (the oracle)
from ...backends.fused import mhc_mix_norm as mhc_mix_norm_ref  # noqa: F401  (the oracle)
from .mega_mhc import mhc_mix
from .mhc_mixes import mhc_mixes
from .rms_norm import rms_norm


def mhc_mix_norm(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, pre: torch.Tensor,
                 fn: torch.Tensor | None, scale: torch.Tensor | None, base: torch.Tensor | None, norm_eps: float,
                 hc_eps: float, iters: int, norm_weight: torch.Tensor, eps: float) -> tuple:
    """`ops.mhc_mix_norm`: (x_new, x_hat, coef or None, rms_norm(x_hat, norm_weight, eps))."""
    if fn is None:
        x_new, x_hat, coef = mhc_mix(x, y, post, comb, pre, None, None, None, norm_eps, hc_eps, iters)
        return x_new, x_hat, coef, rms_norm(x_hat, norm_weight, eps)
    return mhc_mix(x, y, post, comb, pre, fn, scale, base, norm_eps, hc_eps, iters, norm=(norm_weight, eps))


def mhc_enter_norm(x: torch.Tensor, pre: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                   norm_eps: float, hc_eps: float, iters: int, norm_weight: torch.Tensor, eps: float) -> tuple:
    """`ops.mhc_enter_norm`: ((pre, post, comb) of x, mhc_collapse(x, pre), its rms_norm)."""
    c_pre, c_post, c_comb, x_hat, x_norm = mhc_mixes(x, fn, scale, base, norm_eps, hc_eps, iters,
                                                     collapse_norm=(pre, norm_weight, eps))
    return (c_pre, c_post, c_comb), x_hat, x_norm


OPS = {"mhc_mix_norm": mhc_mix_norm, "mhc_enter_norm": mhc_enter_norm}
