"""A counter-based hash (splitmix64) on int64 tensors: the randomness of anchors and of token draws.

Every random choice the project makes (which anchors a row trains on, which token a sampled row
draws) is a pure function of integers (seed, epoch, row key, position or step) hashed here, so it
is identical on CPU and CUDA, across resumes and whatever batch a row lands in. Integer overflow in
torch wraps in two's complement on every backend, which the hash relies on.
"""

from __future__ import annotations

import torch

GOLDEN = 0x9E3779B97F4A7C15 - 2**64  # splitmix64 constants as signed int64
MIX1 = 0xBF58476D1CE4E5B9 - 2**64
MIX2 = 0x94D049BB133111EB - 2**64


def shift_right_logical(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x >>> bits`` on int64: torch's ``>>`` is arithmetic, so clear the sign-extended bits."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser of ``x + golden``: a bijective, well-mixed int64 -> int64 hash."""
    z = x + GOLDEN
    z = (z ^ shift_right_logical(z, 30)) * MIX1
    z = (z ^ shift_right_logical(z, 27)) * MIX2
    return z ^ shift_right_logical(z, 31)
