"""`ops.rope_tables` on devices without fp64 and without a host read.

Positions reach 2^20, so p * f in fp32 loses the angle (one fp32 ulp of 1e6 rad is 0.06 rad).
Split p = a * 2^10 + b (0 <= b < 2^10, -2^10 <= a < 2^10: negative positions occur, e.g. the
padding rows and window slots before a sequence's start): the angle tables of a * 2^10 * f and of
b * f are computed once per frequency vector on the host in fp64 (2048 + 1024 rows), and each position's cos / sin
come from the angle-sum identities in fp32: a few fp32 ulps from the fp64 reference, no fp64
on the device, nothing read back, so it can run inside a captured graph (after the tables of
each frequency vector exist: the first call makes them, i.e. the warm-up before capture).
"""

from __future__ import annotations

import torch

SPLIT = 10  # p = a * 2^SPLIT + b


def angle_tables(inv_freq: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(cos, sin) of a * 2^SPLIT * f for a in [-2^SPLIT, 2^SPLIT) (row a + 2^SPLIT), then (cos,
    sin) of b * f for b in [0, 2^SPLIT): fp32 [2^(SPLIT+1), F] and [2^SPLIT, F], made once per
    frequency vector (in fp64 on the host). They are held by the frequency tensor itself (with
    its version: an in-place change makes them again), so they live as long as it does and a
    later tensor at the same address never finds them (a cache keyed by the address handed a
    second model the first one's angles)."""
    held = getattr(inv_freq, "_dsv41_angle_tables", None)
    if held is None or held[0] != inv_freq._version:
        f = inv_freq.detach().cpu().double()  # once per frequency vector
        steps = torch.arange(1 << SPLIT, dtype=torch.float64).unsqueeze(1)
        high = torch.arange(-(1 << SPLIT), 1 << SPLIT, dtype=torch.float64).unsqueeze(1)  # row a + 2^SPLIT
        hi, lo = high * (1 << SPLIT) * f, steps * f
        held = (inv_freq._version, tuple(t.float().to(inv_freq.device) for t in (hi.cos(), hi.sin(), lo.cos(), lo.sin())))
        inv_freq._dsv41_angle_tables = held
    return held[1]


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [T, R/2] fp32 of positions (-2^20 <= p < 2^20) times inv_freq."""
    ca, sa, cb, sb = angle_tables(inv_freq)
    p = positions.long()
    a, b = (p >> SPLIT) + (1 << SPLIT), p & ((1 << SPLIT) - 1)  # (arithmetic shift: floor for p < 0)
    ca, sa, cb, sb = ca[a], sa[a], cb[b], sb[b]
    return ca * cb - sa * sb, sa * cb + ca * sb
