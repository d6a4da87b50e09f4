"""Phase timing without host syncs: CUDA events recorded in-stream, read only on log steps."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


class PhaseTimer:
    """Accumulates wall time per named phase (target / drafter / optimizer ...)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[str, object, object]] = []
        self.totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.pending.append((name, start, end))
        else:  # CPU work is synchronous, the clock is exact
            t0 = time.perf_counter()
            yield
            self.totals[name] += time.perf_counter() - t0

    def collect(self) -> dict[str, float]:
        """Seconds per phase since the last collect; synchronises the device (log steps only)."""
        if self.pending:
            torch.cuda.synchronize()
            for name, start, end in self.pending:
                self.totals[name] += start.elapsed_time(end) / 1000.0
            self.pending.clear()
        out = dict(self.totals)
        self.totals.clear()
        return out
