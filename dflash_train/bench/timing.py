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


def time_graphed(call: Callable[[], object], device: torch.device, repeats: int) -> dict[str, float]:
    """{"ms": per call, "first_call_s"} of work the decode step runs inside a CUDA graph: on CUDA two
    eager warm-ups on a side stream (the first one's wall time, compilation included, is
    ``first_call_s``), then one capture replayed ``repeats`` times between CUDA events; on CPU (dry
    runs) timed eagerly. What ``call`` returns is kept alive with the graph."""
    if device.type != "cuda":
        started = time.perf_counter()
        call()
        first_call_s = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(repeats):
            call()
        return {"ms": (time.perf_counter() - started) / repeats * 1e3, "first_call_s": first_call_s}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        started = time.perf_counter()
        call()
        torch.cuda.synchronize()  # host sync: the first call's wall time, compilation included
        first_call_s = time.perf_counter() - started
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = call()  # noqa: F841 (the graph's output stays allocated while it replays)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()  # host sync: read the events
    return {"ms": begin.elapsed_time(end) / repeats, "first_call_s": first_call_s}
