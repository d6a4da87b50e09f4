"""The compiled decode step compiles once per sampling setting, whatever a run of calls varies.

regen and synth make many engine calls whose prompts, and so attended-length buckets and cache
capacity, differ from call to call; synth also alternates token limits, stop ids and sampling. Each
compilation takes seconds or more (paid again by every process, inside the rows/s), so a step that
recompiles for any of them can be slower end to end than the eager one (docs/performance.md). Here a call sequence
varies all of these on CPU and the engine's own count of compilations (``SlotEngine.step_body``, the
figure regen, synth and ``bench generation`` report) must stay at one per sampling setting; every
call's tokens must be the eager engine's.

``COMPILE_BACKEND`` "eager" runs dynamo (its tracing, guards and recompilations) without inductor's
code generation, which would make the sequence minutes on CPU; "inductor" runs the real compiler
over a shorter sequence (its guards too).
"""

from __future__ import annotations

import pytest
import torch

from dflash_train.generate import compiled_step
from dflash_train.generate.compiled_step import CompiledStep
from dflash_train.generate.engine import SlotEngine
from dflash_train.generate.sampling import Sampling
from dflash_train.tiny import build_tiny_target, sharpen

pytestmark = pytest.mark.usefixtures("one_thread_module")

GREEDY, SAMPLED = Sampling(seed=1), Sampling(temperature=0.7, top_p=0.9, seed=3)


def prompts(num_rows: int, shortest: int, longest: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (num_rows,), generator=gen).tolist()
    return [torch.randint(1, 64, (n,), generator=gen).tolist() for n in lengths]


# (prompts, max_new_tokens, stop ids, sampling): what regen and synth vary from call to call.
CALLS = [
    (prompts(7, 2, 12, 0), 16, {5}, GREEDY),  # buckets 16 (= the token limit) to the whole capacity
    (prompts(7, 2, 12, 1), 20, {5}, GREEDY),  # another token limit
    (prompts(7, 10, 30, 2), 20, {5}, GREEDY),  # longer prompts: the cache grows
    (prompts(2, 2, 6, 3), 20, {5}, GREEDY),  # fewer rows than slots
    (prompts(7, 2, 12, 4), 30, {5}, GREEDY),  # a higher token limit: the token buffers grow
    (prompts(7, 2, 12, 5), 30, {5, 7, 9}, GREEDY),  # more stop ids: the stop buffer grows
    (prompts(7, 2, 50, 6), 30, {5, 7, 9}, Sampling(seed=4)),  # grows again; another seed
    (prompts(7, 2, 12, 7), 16, {5, 7}, SAMPLED),  # a new sampling setting: one compilation
    (prompts(7, 2, 40, 8), 30, {5}, GREEDY),  # back to greedy: compiled already
]
SHORT_CALLS = [CALLS[0], CALLS[2], CALLS[4], CALLS[5]]


def generate(engine, call):
    rows, max_new_tokens, stops, sampling = call
    keys = [10 * len(rows) + i for i in range(len(rows))]
    return engine.generate(
        rows, keys, max_new_tokens=max_new_tokens, stop_ids=stops, pad_id=0, sampling=sampling
    )


def compiles_over(calls, compiled: SlotEngine, eager: SlotEngine) -> list[int]:
    """The compiled engine's count of compilations after each call; every call's tokens the eager
    engine's."""
    compiles = []
    for call in calls:
        assert generate(compiled, call) == generate(eager, call)
        compiles.append(compiled.step_body.num_compiles)
    return compiles


def one_per_setting(calls) -> list[int]:
    """The sampling settings met up to each call: the count of compilations the design allows."""
    return [len({(c[3].temperature, c[3].top_p) for c in calls[: i + 1]}) for i in range(len(calls))]


@pytest.mark.parametrize(
    "backend, calls, attention",
    [("eager", CALLS, "grouped"), ("inductor", SHORT_CALLS, "grouped"), ("eager", CALLS, "flex")],
)
def test_the_compiled_step_compiles_once_per_sampling_setting(monkeypatch, backend, calls, attention):
    """Also with flex inside the step: its BlockMask built in the graph from the live positions."""
    monkeypatch.setattr(compiled_step, "COMPILE_BACKEND", backend)
    torch._dynamo.reset()  # no compiled entry of an earlier test serves these calls
    model = sharpen(build_tiny_target("qwen3", vocab_size=64, seed=1))
    compiled = SlotEngine(model, num_slots=3, kv_bucket=8, compile_decode=True, decode_attention=attention)
    eager = SlotEngine(model, num_slots=3, kv_bucket=8, compile_decode=False, decode_attention=attention)
    # a count that grows with the calls (a bucket, a limit or a growth compiling again) fails here
    assert compiles_over(calls, compiled, eager) == one_per_setting(calls)
    assert compiled.step_body.compile_seconds > 0


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["grouped", "flex"])
def test_the_graphed_compiled_step_compiles_once_per_sampling_setting_on_cuda(attention):
    """The same calls on CUDA, inductor inside the engine's CUDA graphs (warm-ups and captures), fp32
    against the eager step without graphs."""
    torch._dynamo.reset()
    model = sharpen(build_tiny_target("qwen3", vocab_size=64, seed=1)).cuda()
    compiled = SlotEngine(
        model, num_slots=3, kv_bucket=8, compile_decode=True, use_cuda_graphs=True, decode_attention=attention
    )
    eager = SlotEngine(
        model,
        num_slots=3,
        kv_bucket=8,
        compile_decode=False,
        use_cuda_graphs=False,
        decode_attention=attention,
    )
    assert compiles_over(CALLS, compiled, eager) == one_per_setting(CALLS)
    # The compiled code ran inside captured graphs, captured again after the calls' growths dropped
    # them: more captures than compilations. (Not more than calls: flex attends the whole capacity,
    # one graph per cache size, so it captured 5 times over these 9 calls on an H100; grouped captures
    # one per attended bucket.)
    assert compiled.graphs.num_captures > one_per_setting(CALLS)[-1]


def test_the_inductor_step_chooses_its_kernels_without_timing_them(monkeypatch):
    """Inductor's default picks a reduction's kernel config by timing it on the GPU, so the step's
    rounding (and a bf16 greedy reply) could differ between processes; deterministic mode does not."""
    seen = {}

    def fake_compile(fn, **kwargs):
        seen.update(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(compiled_step, "COMPILE_BACKEND", "inductor")
    CompiledStep(lambda: None)
    assert seen["backend"] == "inductor" and seen["options"] == {"deterministic": True}
    assert isinstance(torch._inductor.config.deterministic, bool)  # an option this torch knows
    monkeypatch.setattr(compiled_step, "COMPILE_BACKEND", "eager")  # dynamo alone: no options
    CompiledStep(lambda: None)
    assert seen["options"] is None
