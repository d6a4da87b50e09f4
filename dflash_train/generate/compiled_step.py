"""The slot engine's decode step under torch.compile (``SlotEngine(compile_decode=)``), and its count of
compilations.

``CompiledStep`` compiles the engine's forward and draw once per sampling setting: every size that
differs between calls is a symbol of that one compilation, never a constant compiled again for.

- What varies is a tensor size or value, marked dynamic where the engine allocates it
  (``SlotEngine.mark_dynamic``): the attended length reaches the step as the size of a view
  (``kv_index[:kv_length]``, not a Python int: an int compiles as a constant first and again when it
  changes, dynamo's automatic dynamic shapes); the cache capacity, the generated-token width and
  the stop-id count as the sizes of the buffers that grow between calls; the token limit as a value
  (``token_limit``, a 0-d tensor). The slot count and the model's shapes stay constants.
- Each marked size is its own symbol (no duck shaping): by default sizes equal at the first
  compilation share a symbol, and the guard that they stay equal fails later (a bucket of 512 beside
  a generated-token buffer of 512), compiling again.
- The attended part of the cache is never its whole storage (one spare index,
  ``SlotCache(spare_index=True)``): a slice as long as the storage is contiguous, and the
  attention's reshape would branch on that (a graph for bucket == capacity, one for the rest).
- The stop-id buffer has at least 2 entries: a dimension of size 1 is specialised.

``dynamic=True`` would also compile once, but makes every size a symbol (the slot count and every
buffer size): its compilation took 3.7x as long on CPU (docs/performance.md, Generation round 3).

What remains a new compilation: a new sampling setting (temperature and top-p are Python floats,
specialised: greedy and sampled are different code), another model or slot count. ``CompiledStep``
counts the calls that compiled and the seconds they took (regen, synth and ``bench generation``
report them): a compilation runs in the eager warm-up steps of a key, outside the CUDA graphs, and
every new process pays it again.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

# The backend ``CompiledStep`` compiles with. Tests of the compile count may switch it to "eager"
# (dynamo's tracing and guards without inductor's code generation); synth, regen and eval never do.
COMPILE_BACKEND = "inductor"
# ``--compile-decode`` of regen and synth: the slot engine's ``compile_decode`` (auto = its default).
COMPILE_DECODE = {"auto": None, "on": True, "off": False}


def compile_decode_choice(value: str) -> bool | None:
    """``SlotEngine(compile_decode=)`` for a ``--compile-decode`` value (auto, on, off)."""
    if value not in COMPILE_DECODE:
        raise ValueError(f"--compile-decode {value!r}: use one of {list(COMPILE_DECODE)}")
    return COMPILE_DECODE[value]


def default_compile_decode(device: torch.device, hybrid: bool) -> bool:
    """Compile the decode step on CUDA for attention-only targets, with either attention: on one H200
    at SmolLM2-135M's shape it cut the grouped step at 1,024 slots from 9.6 to 5.6 ms (1,536 -> 520
    kernels; docs/performance.md), compilation excluded, and with flex (whose attention becomes part of
    the step's graph) it ran 1.33x the compiled grouped step on an H100. Hybrid (GatedDeltaNet)
    targets keep the eager step until the compiled one is measured on them (``compile_decode=True``
    asks for it); on a CPU it is slower. Under a forced-eager stance (``eager_forced``) nothing
    compiles: the eager step."""
    return device.type == "cuda" and not hybrid and not eager_forced()


def eager_forced() -> bool:
    """Whether ``torch.compiler.set_stance("force_eager")`` is in effect (the in-training held-out
    evaluation's ``untouched_training_state``): every torch.compile'd function, the compiled step's
    and FlexAttention's kernel included, then runs its Python uncompiled."""
    from torch._dynamo import eval_frame

    return getattr(getattr(eval_frame, "_stance", None), "stance", "default") == "force_eager"


def compiled_graph_count() -> int:
    """Graphs dynamo has compiled in this process (any function), the counter ``CompiledStep`` reads."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def inductor_options(backend: str) -> dict | None:
    """Inductor's deterministic mode for the step. By default inductor chooses among a reduction's
    kernel configs (block size, warps: the order of its sums) by timing them on the GPU when the step
    first runs, so what else the GPU is doing then can decide how a process rounds, and one flipped
    near-tie changes a greedy reply from there on. The exact eval's reference continuation differed
    between eval processes on the same prompts (docs/quality.md, "All 92,597 rows"; this is a
    candidate cause). Deterministic mode chooses by heuristics, never by timing."""
    return {"deterministic": True} if backend == "inductor" else None


class CompiledStep:
    """``step_body`` under torch.compile: the decode forward and the draw as fused kernels (RMSNorm,
    RoPE, SwiGLU, residual adds, the sampling tail), captured into the engine's graphs like the eager
    step; compiled once per sampling setting (module docstring). ``num_compiles`` counts the calls
    that compiled and ``compile_seconds`` their wall time (the compilation and that one step)."""

    def __init__(self, step_body: Callable[..., None]):
        # A process may hold several settings and engines (bench generation, synth's sampled prompts
        # and greedy replies): keep them all compiled rather than let the default limit of 8 per code
        # object send later ones back to the eager step, unnoticed.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.compiled = torch.compile(
            step_body, dynamic=None, backend=COMPILE_BACKEND, options=inductor_options(COMPILE_BACKEND)
        )
        self.num_compiles = 0
        self.compile_seconds = 0.0

    def __call__(self, *args) -> None:
        # Runs in eager warm-up steps and captures only (a replayed graph calls no Python): the
        # counter read and the clock cost nothing per replayed step.
        before, started = compiled_graph_count(), time.perf_counter()
        with torch.fx.experimental._config.patch(use_duck_shape=False):  # module docstring
            self.compiled(*args)
        if compiled_graph_count() != before:
            self.num_compiles += 1
            self.compile_seconds += time.perf_counter() - started


def compile_report(generator) -> dict[str, float]:
    """What regen, synth and ``bench generation`` report of a generator's decode compilations:
    ``decode_compiles`` (calls of the step that compiled) and ``decode_compile_s`` (their seconds);
    0 for an engine that compiles nothing (the eager step, the padded engine, an endpoint)."""
    step = getattr(generator, "step_body", None)
    if not isinstance(step, CompiledStep):
        return {"decode_compiles": 0, "decode_compile_s": 0.0}
    return {"decode_compiles": step.num_compiles, "decode_compile_s": round(step.compile_seconds, 2)}
