"""Timing of device work for benchmarks: CUDA events on a GPU, the wall clock on CPU."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def time_calls_ms(
    fn: Callable[[], object], iters: int, *, warmup: int = 0, device: torch.device | str | None = None
) -> list[float]:
    """Milliseconds of each of ``iters`` calls of ``fn`` after ``warmup`` untimed ones.

    On CUDA each call is bracketed by events and synchronised, so the time is the GPU's, not the
    launch's. ``device`` defaults to CUDA when it is available.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    on_cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return times
