"""The decode step's graph lifetimes hold on any call sequence (generate/step_graphs.py).

On a GPU, ``synth --task-file chat-tasks`` died with the caching allocator's ``use_count > 0``
assertion: the engine dropped every graph (its cache grew, the token limit grew, more stop ids came)
and captured the next one into the same pool handle, which the allocator still held (a captured
matmul's workspace) with no graph left. A stand-in runtime enforces that rule on the CPU: a capture
records the step (it runs at replay, as a CUDA graph's kernels do), a pool whose graphs were all
destroyed refuses further captures, and every warm-up and capture names its stream.
The GPU tests run the same call sequences on real CUDA graphs, and ``synth`` with a two-turn task.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from dflash_train.generate.engine import SlotEngine
from dflash_train.generate.sampling import PaddedEngine, Sampling
from dflash_train.generate.step_graphs import WARM_UP_STEPS, StepGraphs
from dflash_train.tiny import build_tiny_target, sharpen

pytestmark = pytest.mark.usefixtures("one_thread_module")

GREEDY, SAMPLED = Sampling(), Sampling(temperature=0.7, top_p=0.9, seed=3)


class AllocatorRuleRuntime:
    """The CUDA caching allocator's rule for private pools, with recorded (not run) captures."""

    def __init__(self):
        self.live_graphs: dict[int, int] = {}  # pool -> graphs captured into it and not destroyed
        self.retired: set[int] = set()  # pools whose graphs were all destroyed
        self.streams: list[object] = []
        self.warm_up_streams: list[object] = []
        self.capture_streams: list[object] = []

    def new_pool(self):
        pool = len(self.live_graphs) + len(self.retired) + 1
        self.live_graphs[pool] = 0
        return pool

    def new_stream(self):
        self.streams.append(object())
        return self.streams[-1]

    def run_on(self, stream, fn):
        self.warm_up_streams.append(stream)
        fn()

    def capture(self, fn, pool, stream):
        if pool in self.retired:
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED (a retired pool)")
        self.capture_streams.append(stream)
        self.live_graphs[pool] += 1
        graph = RecordedGraph(fn)
        weakref.finalize(graph, self.release, pool)
        return graph

    def release(self, pool):
        self.live_graphs[pool] -= 1
        if self.live_graphs[pool] == 0:
            del self.live_graphs[pool]
            self.retired.add(pool)


class RecordedGraph:
    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()


def test_a_capture_after_a_drop_takes_a_fresh_pool():
    runtime = AllocatorRuleRuntime()
    graphs = StepGraphs(runtime)
    ran = []
    for key in ("a", "b", "a"):
        for _ in range(WARM_UP_STEPS + 1):
            graphs.run(key, lambda key=key: ran.append(key))
        graphs.drop()
    assert ran == ["a"] * 3 + ["b"] * 3 + ["a"] * 3  # warm-ups run, the capture records, the replay runs
    assert graphs.num_captures == 3 and len(runtime.retired) == 3


def test_warm_ups_and_captures_share_one_stream_per_engine():
    runtime = AllocatorRuleRuntime()
    graphs = StepGraphs(runtime)
    for key in ("a", "b"):
        for _ in range(WARM_UP_STEPS + 2):
            graphs.run(key, lambda: None)
    assert len(runtime.streams) == 1
    assert set(runtime.warm_up_streams) == set(runtime.capture_streams) == {runtime.streams[0]}


def prompts_of(lengths, vocab_size=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def generate(engine, prompts, sampling, max_new_tokens, stop_ids):
    keys = [100 + i for i in range(len(prompts))]
    return engine.generate(
        prompts, keys, max_new_tokens=max_new_tokens, stop_ids=stop_ids, pad_id=0, sampling=sampling
    )


# Each call grows what the engine must reallocate (the cache, the token buffer, the stop buffer),
# between calls that replay the graphs already captured: the sequence of a two-turn synth.
GROWING_CALLS = [
    ([6, 9, 4], 12, {7}, GREEDY),
    ([6, 9, 4], 12, {7}, SAMPLED),
    ([30, 41, 25], 12, {7}, GREEDY),  # longer prompts: a larger cache
    ([5, 8], 40, {7}, SAMPLED),  # more new tokens: a wider token buffer
    ([5, 8, 3], 40, {7, 9, 11}, GREEDY),  # more stop ids: a larger stop buffer
    ([7, 7], 10, {7}, GREEDY),  # back to a small call: replays
]


@pytest.mark.parametrize("kind", ["qwen3", "hybrid"])
def test_calls_that_grow_the_engines_buffers_capture_into_live_pools_only(kind):
    model = sharpen(build_tiny_target(kind, vocab_size=64, seed=1))
    runtime = AllocatorRuleRuntime()
    engine = SlotEngine(model, num_slots=2, kv_bucket=16, use_cuda_graphs=True, graph_runtime=runtime)
    for lengths, max_new_tokens, stops, sampling in GROWING_CALLS:
        prompts = prompts_of(lengths)
        want = generate(PaddedEngine(model, num_slots=len(prompts)), prompts, sampling, max_new_tokens, stops)
        assert generate(engine, prompts, sampling, max_new_tokens, stops) == want
    assert engine.graphs.num_captures >= 4 and runtime.retired  # graphs were dropped and captured again
    assert len(runtime.streams) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("decode_attention", ["grouped", "flex"])
@pytest.mark.parametrize("kind", ["qwen3", "hybrid"])
def test_real_graphs_survive_calls_that_grow_the_engines_buffers(kind, decode_attention):
    """bf16 on CUDA (the dtype that crashed): every call of the growing sequence completes, twice over,
    and greedy calls equal the padded engine's tokens up to ties (compared on the eager engine)."""
    model = sharpen(build_tiny_target(kind, vocab_size=64, seed=1)).cuda().bfloat16()
    options = {"num_slots": 3, "kv_bucket": 16, "decode_attention": decode_attention, "compile_decode": False}
    # the eager step's graphs: the compiled step's are tests/test_compiled_step.py's
    graphed = SlotEngine(model, use_cuda_graphs=True, **options)
    eager = SlotEngine(model, use_cuda_graphs=False, **options)
    for lengths, max_new_tokens, stops, sampling in GROWING_CALLS * 2:
        prompts = prompts_of(lengths)
        got = generate(graphed, prompts, sampling, max_new_tokens, stops)
        assert got == generate(eager, prompts, sampling, max_new_tokens, stops)
    assert graphed.graphs.num_captures >= 4
