"""Repetition loops in generated rows, for stopping them early.

Greedy decoding of a small target often ends in a loop: the same block of tokens again and again
until the token limit (SmolLM2-135M-Instruct: 42% of 512-token replies, docs/quality.md). Where such a
row is dropped anyway (synth rejects a turn that hit its limit), every step after the loop began is
wasted work. A row is taken to loop when its last ``max(3 * p, min_span)`` tokens repeat one block of
p tokens, for some period p <= ``max_period``: at least three whole blocks and ``min_span`` tokens
(so a short run such as ``"   "`` or ``"0 0 0"`` is not a loop). A greedy row that meets this rarely
leaves the loop again; one that would have is dropped too, which is the option's cost.

Shapes: S slots (rows), T generated-token capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoopStop:
    """When a row counts as looping (see the module docstring)."""

    max_period: int = 64
    min_span: int = 64

    def __post_init__(self):
        if self.max_period < 1 or self.min_span < 2:
            raise ValueError(
                f"LoopStop(max_period={self.max_period}, min_span={self.min_span}): use >= 1 and >= 2"
            )

    @property
    def window(self) -> int:
        """The most trailing tokens any period's test reads."""
        return max(3 * self.max_period, self.min_span)


def looping_rows(generated: torch.Tensor, counts: torch.Tensor, stop: LoopStop) -> torch.Tensor:
    """Which rows end in a loop: bool [S], from their tokens ``generated`` [S, T] (row r's first
    ``counts[r]`` are its own) and ``counts`` [S]. Tensor ops only (one small pass per period)."""
    window = min(stop.window, generated.shape[1])
    offsets = torch.arange(window, device=generated.device)
    index = (counts[:, None] - window + offsets).clamp(min=0)  # [S, window], the row's last tokens
    tail = generated.gather(1, index)
    found = torch.zeros_like(counts, dtype=torch.bool)
    for period in range(1, stop.max_period + 1):
        span = max(3 * period, stop.min_span)
        if span > window:
            break
        last = tail[:, window - span :]
        periodic = (last[:, period:] == last[:, :-period]).all(dim=-1)
        found |= periodic & (counts >= span)
    return found
