"""The reference backend's numerics mode: `exact` (default) or `official`.

* `exact`: fp32 math with fp64 contractions, each result rounded once; activations are bf16
  only where the model stores them (between sublayers, the KV formats). Batch-invariant: a
  one-token decode step computes the same bits as the same row of a prefill.
* `official`: also rounds to bf16 exactly where the official inference code holds a bf16
  tensor (MODEL.md section 3, "Where the official code rounds"), to reproduce its logits as
  closely as rounding allows:
  - inside every expert, routed (FP4) and shared (FP8) alike: the w1 and w3 outputs; the
    clamped SwiGLU product times the routing weight, before w2's FP8 activation quantisation;
    each expert's w2 output, summed in fp32 in expert-id order;
  - the indexer's head weights (`weights_proj` returns bf16; the folded scale
    (index_head_dim * index_n_heads)^-0.5 is a power of two in every preset, so rounding the
    scaled weights is the same);
  - the ratio-2 compressor's pooled latent, before its RMSNorm;
  - attention probabilities, rounded against the running maximum of their 64-entry block of
    the official entry list (valid window entries first, then the global entries), as the
    official kernel's online softmax does (`reference.attention.official_block_probabilities`).
  Contractions still accumulate in fp64 and round once, so this mode is batch-invariant too.
  Not emulated: the fp32 (rather than fp64) sum of expert partials across model-parallel
  ranks; the official prefill's shorter window list for a prompt shorter than the window.

Every other Linear already returns bf16 in both modes. The setting is read by the reference ops
only; device kernels keep their own arithmetic. `dsv41 run --numerics` sets it.
"""

from __future__ import annotations

import contextlib

MODES = ("exact", "official")

_mode = "exact"


def mode() -> str:
    """The current mode, one of `MODES`."""
    return _mode


def official() -> bool:
    """Whether the reference rounds at the official code's bf16 points."""
    return _mode == "official"


def set_mode(name: str) -> str:
    """Select the mode for the whole process; returns the previous one."""
    global _mode
    if name not in MODES:
        raise ValueError(f"numerics mode must be one of {', '.join(MODES)}, got {name!r}")
    old, _mode = _mode, name
    return old


@contextlib.contextmanager
def numerics(name: str):
    """Run a block under mode `name`, restoring the previous mode afterwards."""
    old = set_mode(name)
    try:
        yield
    finally:
        set_mode(old)
