"""The slot engine's decode step, profiled: its time against its memory-traffic floor, and where the
GPU time goes by operator (the share spent copying).

A decode step of a memory-bound target must read the weights once, each slot's live K/V once, and
read and write the GatedDeltaNet states of every slot. At the H200's measured device-copy bandwidth
(4.16 TB/s, DESIGN.md §4) that traffic is the step's floor; ``step_over_floor`` is the measured
graphed step over it (1.0 is the ideal). The K/V counted is what the slots hold (positions + 1 per
slot, finished slots included: they keep stepping until the next host check), not the bucket or the
capacity.

One wave of ``batch_size`` rows is admitted and a window of steps after the warm-up and graph
capture is timed (graphed engine) or profiled (eager engine, torch.profiler); the call is then cut
short (the rest of the generation is not needed).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.autograd import DeviceType

from dflash_train.generate.engine import SlotEngine
from dflash_train.generate.sampling import Sampling

COPY_BANDWIDTH = 4.16e12  # bytes/s: device copy on one H200 (DESIGN.md §4)
COPY_OPS = {"aten::copy_", "aten::clone", "aten::_to_copy", "aten::contiguous", "aten::cat", "aten::index"}
FIRST_STEP, TIMED_STEPS, PROFILED_STEPS = 24, 32, 16


class WindowDone(Exception):
    """Raised from inside the engine's loop once the window is measured (ends the call early)."""


def profile_decode(model, prompts, stops, batch_size: int, args, out_dir: Path, compiled=False) -> dict:
    """The graphed step timed and an eager step profiled; ``compiled``: both with ``compile_decode``."""
    rows = (prompts * (batch_size // len(prompts) + 1))[:batch_size]  # every slot busy in the window
    options = {
        "check_every": args.check_every,
        "kv_bucket": args.kv_bucket or None,
        "compile_decode": compiled,
    }
    engine = SlotEngine(model, num_slots=batch_size, **options)
    step_s, live_tokens = time_window(engine, rows, stops, args)
    per_step = traffic_per_step(engine, live_tokens)
    floor_s = per_step["total"] / COPY_BANDWIDTH
    eager = SlotEngine(model, num_slots=batch_size, use_cuda_graphs=False, **options)
    table, shares = profile_window(eager, rows, stops, args)
    path = out_dir / f"decode_profile_{batch_size}{'_compiled' if compiled else ''}.txt"
    path.write_text(table)
    return {
        "status": "ok",
        "decode_attention": engine.decode_attention,
        "cuda_graphs": engine.use_cuda_graphs,
        "step_ms": step_s * 1e3,
        "live_tokens_per_slot": live_tokens / batch_size,
        "traffic_bytes_per_step": {k: int(v) for k, v in per_step.items()},
        "floor_ms": floor_s * 1e3,
        "step_over_floor": step_s / floor_s,
        **shares,
        "kernel_table": str(path),
    }


def run_until(engine: SlotEngine, rows, stops, args, on_step) -> None:
    """Generate ``rows`` with ``on_step(index)`` called before every decode step, until it raises WindowDone."""
    real_step = engine.step
    count = 0

    def step(spec):
        nonlocal count
        on_step(count)
        count += 1
        return real_step(spec)

    engine.step = step
    try:
        engine.generate(
            rows, list(range(len(rows))), max_new_tokens=args.max_new_tokens, stop_ids=stops, pad_id=0,
            sampling=Sampling(temperature=args.temperature),
        )  # fmt: skip
    except WindowDone:
        return
    raise ValueError(
        f"the generation ended before {FIRST_STEP + TIMED_STEPS} decode steps: raise --max-new-tokens"
    )


def time_window(engine: SlotEngine, rows, stops, args) -> tuple[float, float]:
    """(seconds per step, mean live tokens over all slots) over TIMED_STEPS steps."""
    marks: dict[str, float] = {}

    def on_step(index: int) -> None:
        if index in (FIRST_STEP, FIRST_STEP + TIMED_STEPS):
            synchronize(engine.device)  # host sync: the window's edges
            name = "start" if index == FIRST_STEP else "end"
            marks[name] = time.perf_counter()
            marks[f"live_{name}"] = float((engine.positions + 1).sum())
        if index == FIRST_STEP + TIMED_STEPS:
            raise WindowDone

    run_until(engine, rows, stops, args, on_step)
    live = (marks["live_start"] + marks["live_end"]) / 2
    return (marks["end"] - marks["start"]) / TIMED_STEPS, live


def traffic_per_step(engine: SlotEngine, live_tokens: float) -> dict[str, float]:
    """Bytes a decode step must move: weights, live K/V, GatedDeltaNet states (read and written)."""
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    kv_per_token, states = 0, 0
    for layer in engine.cache.layers:
        if hasattr(layer, "keys"):
            kv_per_token += (
                layer.keys[0, :, 0].numel() + layer.values[0, :, 0].numel()
            ) * layer.keys.element_size()
        else:
            tensors = [*layer.conv_states.values(), *layer.recurrent_states.values()]
            states += 2 * sum(t.numel() * t.element_size() for t in tensors if t is not None)
    kv = kv_per_token * live_tokens
    return {"weights": weights, "kv": kv, "states": states, "total": weights + kv + states}


def profile_window(engine: SlotEngine, rows, stops, args) -> tuple[str, dict]:
    """torch.profiler over PROFILED_STEPS eager steps: (kernel table, copy share of device time)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities)

    def on_step(index: int) -> None:
        if index == FIRST_STEP:
            synchronize(engine.device)
            profiler.start()
        if index == FIRST_STEP + PROFILED_STEPS:
            synchronize(engine.device)
            profiler.stop()
            raise WindowDone

    run_until(engine, rows, stops, args, on_step)
    events = profiler.key_averages()
    on_device = engine.device.type == "cuda"
    sort_by = "self_device_time_total" if on_device else "self_cpu_time_total"
    total = sum(
        getattr(e, sort_by) for e in events if not on_device or e.device_type == DeviceType.CUDA
    )  # kernels only on CUDA (an operator's device time is its kernels')
    copies = sum(getattr(e, sort_by) for e in events if e.key in COPY_OPS)
    # Kernel launches per step (CUDA only: a CPU run has no kernels to count).
    kernels = sum(e.count for e in events if e.device_type == DeviceType.CUDA) if on_device else None
    shares = {
        "profiled_steps": PROFILED_STEPS,
        "kernels_per_step": kernels / PROFILED_STEPS if kernels is not None else None,
        "device_ms_per_step": total / 1e3 / PROFILED_STEPS,
        "copy_share": copies / total if total else float("nan"),
        "top_operators": [
            {"name": e.key, "ms_per_step": getattr(e, sort_by) / 1e3 / PROFILED_STEPS}
            for e in sorted(events, key=lambda e: -getattr(e, sort_by))[:8]
        ],
    }
    return events.table(sort_by=sort_by, row_limit=30), shares


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
