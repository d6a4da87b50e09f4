"""The decode step's CUDA graphs and the lifetimes they share (memory pool, stream).

``StepGraphs`` keeps one graph per step key (kv bucket, token limit, stop count, sampling): a key
first runs ``WARM_UP_STEPS`` eager steps, then is captured once and replayed from then on, also by
later calls of the engine. Three rules keep the captures valid on any call sequence:

- **A fresh pool after a drop.** All graphs share one private memory pool, and the engine drops
  every graph when a call needs a larger cache, more generated tokens or more stop ids. The CUDA
  caching allocator keeps a pool alive while it still holds blocks (a captured matmul leaves its
  workspace there), and a capture into a pool whose graphs were all destroyed trips its
  ``use_count > 0`` assertion. So ``drop`` forgets the pool handle with the graphs, and the next
  capture takes a new one; the old pool is freed once nothing in it is in use.
- **Warm-up on the capture stream.** Lazy allocations of a warm-up (cuBLAS workspaces are per
  stream, kernel autotuning, compilation) land where the capture will look for them, instead of
  being made again inside the capture, in the pool.
- **One stream per engine**, made once, for every warm-up and every capture (not a new stream, and
  its own workspace, per warm-up).

The CUDA primitives sit behind ``GraphRuntime`` so the rules are testable without a GPU: a stand-in
runtime that enforces the allocator's rule sees every capture, warm-up and drop
(tests/test_step_graphs.py).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Protocol

import torch

WARM_UP_STEPS = 2  # eager steps per key before its capture (lazy init, autotuning, compilation)


class Graph(Protocol):
    def replay(self) -> None: ...


class GraphRuntime(Protocol):
    """The CUDA graph primitives ``StepGraphs`` uses."""

    def new_pool(self) -> Hashable: ...

    def new_stream(self) -> object: ...

    def run_on(self, stream: object, fn: Callable[[], None]) -> None: ...

    def capture(self, fn: Callable[[], None], pool: Hashable, stream: object) -> Graph: ...


class CudaGraphRuntime:
    """``GraphRuntime`` on torch.cuda."""

    def new_pool(self):
        return torch.cuda.graph_pool_handle()

    def new_stream(self):
        return torch.cuda.Stream()

    def run_on(self, stream, fn):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)

    def capture(self, fn, pool, stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            fn()
        return graph


class StepGraphs:
    """One captured graph per step key; see the module docstring for the lifetime rules."""

    def __init__(self, runtime: GraphRuntime | None = None):
        self.runtime = runtime or CudaGraphRuntime()
        self.graphs: dict[Hashable, Graph] = {}
        self.warm_ups: dict[Hashable, int] = {}
        self.pool: Hashable | None = None
        self.stream: object | None = None
        self.num_captures = 0  # over the engine's life (benchmarks, tests)

    def __len__(self) -> int:
        return len(self.graphs)

    def run(self, key: Hashable, step: Callable[[], None]) -> None:
        """Run ``step`` once: eagerly while ``key`` warms up, then from its graph."""
        graph = self.graphs.get(key)
        if graph is None:
            if self.warm_ups.get(key, 0) < WARM_UP_STEPS:
                self.warm_ups[key] = self.warm_ups.get(key, 0) + 1
                self.runtime.run_on(self.capture_stream(), step)
                return
            graph = self.graphs[key] = self.capture(step)
        graph.replay()

    def capture(self, step: Callable[[], None]) -> Graph:
        """``step`` recorded (not run) into the engine's pool, on the engine's stream."""
        if self.pool is None:
            self.pool = self.runtime.new_pool()
        self.num_captures += 1
        return self.runtime.capture(step, self.pool, self.capture_stream())

    def capture_stream(self) -> object:
        if self.stream is None:
            self.stream = self.runtime.new_stream()
        return self.stream

    def drop(self) -> None:
        """Forget every graph and, with them, their pool (the next capture takes a fresh one)."""
        self.graphs.clear()
        self.warm_ups.clear()
        self.pool = None
