"""Reference single-pass mHC: coefficient prediction with Sinkhorn, collapse and residual update."""

from __future__ import annotations

import torch

from ..registry import register
from .basic import einsum, exact_fn, mm


@register("sinkhorn")
def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    c = exact_fn(lambda z: torch.softmax(z, dim=-1), logits.float()) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


@register("mhc_mixes")
def mhc_mixes(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
              norm_eps: float, hc_eps: float, iters: int):
    t, n, d = x.shape
    xf = x.float().reshape(t, n * d)
    m = mm(xf, fn.float().t()) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm_eps)
    scale, base = scale.float(), base.float()
    pre = exact_fn(torch.sigmoid, scale[0] * m[:, :n] + base[:n]) + hc_eps
    post = 2 * exact_fn(torch.sigmoid, scale[1] * m[:, n:2 * n] + base[n:2 * n])
    logits = (scale[2] * m[:, 2 * n:] + base[2 * n:]).reshape(t, n, n)
    return pre, post, sinkhorn(logits, iters, hc_eps)


@register("mhc_collapse")
def mhc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return einsum("tn,tnd->td", pre.float(), x.float()).to(x.dtype)


@register("mhc_update")
def mhc_update(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    # comb[i][j] weighs input stream i into output stream j (transposed w.r.t. "comb @ X").
    mixed = einsum("tij,tid->tjd", comb.float(), x.float())
    return (post.float().unsqueeze(-1) * y.float().unsqueeze(1) + mixed).to(x.dtype)


@register("mhc_mix")
def mhc_mix(x, y, post, comb, pre, fn, scale, base, norm_eps, hc_eps, iters):
    x_new = mhc_update(x, y, post, comb)
    x_hat = mhc_collapse(x_new, pre)
    coef = mhc_mixes(x_new, fn, scale, base, norm_eps, hc_eps, iters) if fn is not None else None
    return x_new, x_hat, coef
