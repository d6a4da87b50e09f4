"""Speed round 2 on one H200 at the Qwen3.6-27B shape (random weights), one process, one target.

Sections (results appended to $OUT/speed.jsonl as they come, a table printed last):
  target   the truncated target's feature pass at 1 x 4096 (and 1 x 32768) under each binding:
           regions = compile_target_regions + transformers' GatedDeltaNet forward (the old default),
           regions+fused = the same with models/gated_delta_net.py's fused forward (the default),
           eager = neither (the bf16 noise floor of the feature error);
           the GPU-busy fraction of one profiled forward, and each variant's feature error
  step     full train steps at 1 x 4096 / 512 anchors and 1 x 32768 / 2048 with the fastest
           binding (profile table of one 4K step under $OUT)
  drafter  the drafter-only step at 8,000 tokens / 1,024 anchors
  fp8      target.fp8 (torchao float8, whole decoder layers compiled) feature pass and full steps
           at 4K and 32K
Every section stops at --budget-s (wall clock since start) so $OUT always has what finished.

Usage: PYTHONPATH=. python scripts/gpu_speed_round2.py [--only target,step,drafter,fp8] [--budget-s 500]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
import traceback
from pathlib import Path

import torch

OUT = Path(os.environ.get("OUT", "gpu-logs"))
RESULTS: list[dict] = []
STARTED = time.perf_counter()


def record(section: str, name: str, **values) -> None:
    row = {"section": section, "name": name, "at_s": round(time.perf_counter() - STARTED, 1), **values}
    RESULTS.append(row)
    with open(OUT / "speed.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def bench_cfg(seq_len: int, anchors: int, **changes):
    from dflash_train.bench.train_step import BenchOptions, bench_config

    options = BenchOptions(
        preset="qwen3.6-27b", seq_len=seq_len, num_anchors=anchors, attention_backend="flex",
        compile=True, target_compile=False,
    )  # fmt: skip
    cfg, _, _ = bench_config(dataclasses.replace(options, **changes))
    return cfg


def timed_ms(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


class Bindings:
    """Switch one loaded target between the compile / GatedDeltaNet-forward variants."""

    def __init__(self, target):
        from dflash_train.models.target_kernels import compile_target_regions, gated_delta_net_layers

        self.model = target.model
        self.gdn = gated_delta_net_layers(self.model)
        compile_target_regions(self.model)
        self.regions = [
            m for m in self.model.modules() if getattr(m, "_compiled_call_impl", None) is not None
        ]
        self.region_impls = {id(m): m._compiled_call_impl for m in self.regions}

    def apply(self, variant: str) -> None:
        from dflash_train.models.gated_delta_net import (
            bind_fused_gated_delta_net,
            unbind_fused_gated_delta_net,
        )

        regions, compile_mode_fused = variant.split("+") if "+" in variant else (variant, "")
        for m in self.regions:
            m._compiled_call_impl = self.region_impls[id(m)] if regions == "regions" else None
        if compile_mode_fused == "fused":
            bind_fused_gated_delta_net(self.gdn)
        else:
            unbind_fused_gated_delta_net(self.gdn)


def gpu_busy_fraction(fn, path: Path) -> float:
    """Sum of CUDA kernel time / wall time of one call of ``fn`` (1.0 = no launch gaps)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    averages = prof.key_averages()
    busy_us = sum(getattr(e, "self_device_time_total", 0.0) for e in averages)
    path.write_text(averages.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90))
    return busy_us / wall_us


def load_27b_target(compile_regions: bool = False, **target_changes):
    from dflash_train.models.target import load_target

    cfg = bench_cfg(4096, 512)
    cfg.target = dataclasses.replace(cfg.target, **target_changes)
    t0 = time.perf_counter()
    target = load_target(
        cfg.target, torch.device("cuda"), truncate_unused_layers=True, compile_regions=compile_regions
    )
    return target, round(time.perf_counter() - t0, 1)


def section_target(args, state) -> None:
    target, build_s = load_27b_target()
    state["target"] = target
    record("target", "build", seconds=build_s, kernels=target.kernels)
    bindings = state["bindings"] = Bindings(target)
    ids = torch.randint(0, target.vocab_size, (1, 4096), device="cuda")
    mask = torch.ones_like(ids)
    reference = None
    best = (float("inf"), "regions")
    for variant in args.variants.split(","):
        if time.perf_counter() - STARTED > args.budget_s:
            record("target", variant, skipped="budget")
            continue
        bindings.apply(variant)
        t0 = time.perf_counter()
        features = target.features(ids, mask).float()  # compiles here
        first_s = round(time.perf_counter() - t0, 1)
        ms = timed_ms(lambda: target.features(ids, mask), iters=10, warmup=2)
        if reference is None:
            reference, err = features, 0.0
        else:
            err = float((features - reference).norm() / reference.norm())
        busy = gpu_busy_fraction(lambda: target.features(ids, mask), OUT / f"profile_target_{variant}.txt")
        record(
            "target",
            variant,
            ms_4k=round(ms, 1),
            first_call_s=first_s,
            rel_err_vs_regions=err,
            gpu_busy=round(busy, 3),
        )
        best = min(best, (ms, variant))
        del features
    state["best_variant"] = best[1]
    bindings.apply(best[1])
    for variant in (("regions", best[1]) if best[1] != "regions" else ("regions",)) if args.long else ():
        if time.perf_counter() - STARTED > args.budget_s:
            break
        bindings.apply(variant)
        long_ids = torch.randint(0, target.vocab_size, (1, 32768), device="cuda")
        ms = timed_ms(lambda ids=long_ids: target.features(ids, torch.ones_like(ids)), iters=3, warmup=1)
        record("target", f"{variant} 32K", ms_32k=round(ms, 1))
    bindings.apply(best[1])


def time_step(target, seq_len: int, anchors: int, steps: int, warmup: int, *, drafter_only=False, profile=""):
    from dflash_train.bench.train_step import build_bench_run, profile_train_step, time_train_steps
    from dflash_train.train.flops import mfu, train_step_flops

    cfg = bench_cfg(seq_len, anchors)
    run = None
    try:
        t0 = time.perf_counter()
        torch.cuda.reset_peak_memory_stats()
        run = build_bench_run(cfg, 1, seq_len, torch.device("cuda"), drafter_only=drafter_only, target=target)
        result = time_train_steps(run, steps, warmup)
        if profile:
            profile_train_step(run, str(OUT / profile))
        flops = train_step_flops(
            run.target.config, run.draft_config, seq_len=seq_len, num_anchors=anchors, rows=1
        )
        total = flops["total"] - (flops["target"] if drafter_only else 0.0)
        return {
            "tokens_per_s": round(seq_len / result["step_s"]),
            "mfu": round(mfu(total, result["step_s"]), 3),
            "wall_s": round(time.perf_counter() - t0, 1),
            **{k: round(v, 4) for k, v in result.items()},
        }
    except torch.OutOfMemoryError as exc:
        return {"oom": str(exc)[:300], "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9}
    finally:
        if run is not None and drafter_only:
            del run.target.features
        del run
        torch.cuda.empty_cache()


def section_step(args, state) -> None:
    target = state.get("target")
    if target is None:
        target, build_s = load_27b_target()
        state["target"], state["bindings"] = target, Bindings(target)
        state["bindings"].apply(args.variant)
        record("step", "build", seconds=build_s)
    variant = state.get("best_variant", args.variant)
    for seq_len, anchors, steps, warmup in ((4096, 512, 5, 2), (32768, 2048, 2, 1)):
        if time.perf_counter() - STARTED > args.budget_s:
            record("step", f"1x{seq_len}", skipped="budget")
            continue
        profile = "profile_step_4k.txt" if seq_len == 4096 else ""
        record(
            "step",
            f"1x{seq_len}/{anchors} {variant}",
            **time_step(target, seq_len, anchors, steps, warmup, profile=profile),
        )


def section_drafter(args, state) -> None:
    target = state.get("target")
    if target is None:
        target, _ = load_27b_target()
        state["target"] = target
    record("drafter", "1x8000/1024 drafter-only", **time_step(target, 8000, 1024, 3, 1, drafter_only=True))


def section_fp8(args, state) -> None:
    state.pop("target", None)
    state.pop("bindings", None)
    torch.cuda.empty_cache()
    # load_target compiles an FP8 target's whole decoder layers (compile_target_layers).
    target, build_s = load_27b_target(compile_regions=True, fp8=True, compile=True)
    record("fp8", "build", seconds=build_s, kernels=target.kernels)
    ids = torch.randint(0, target.vocab_size, (1, 4096), device="cuda")
    ms = timed_ms(lambda: target.features(ids, torch.ones_like(ids)), iters=10, warmup=2)
    record("fp8", "target 4K", ms_4k=round(ms, 1))
    for seq_len, anchors, steps, warmup in ((4096, 512, 5, 2), (32768, 2048, 2, 1)):
        if time.perf_counter() - STARTED > args.budget_s:
            record("fp8", f"1x{seq_len}", skipped="budget")
            continue
        record("fp8", f"1x{seq_len}/{anchors}", **time_step(target, seq_len, anchors, steps, warmup))


SECTIONS = {"target": section_target, "step": section_step, "drafter": section_drafter, "fp8": section_fp8}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="target,step,drafter")
    parser.add_argument("--budget-s", type=float, default=500.0)
    parser.add_argument(
        "--variant", default="regions+fused", help="binding when the target section is skipped"
    )
    parser.add_argument(
        "--variants",
        default="eager,regions,regions+fused",
        help="target bindings to compare (eager = no compile, transformers' forward); the first is the reference",
    )
    parser.add_argument("--long", action="store_true", help="also time the 32K feature pass per variant")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    state: dict = {}
    for name in args.only.split(","):
        if time.perf_counter() - STARTED > args.budget_s:
            record(name, "skipped", reason="budget")
            continue
        try:
            SECTIONS[name](args, state)
        except Exception as exc:  # one failed section must not cost the others
            traceback.print_exc()
            record(name, "FAILED", error=f"{type(exc).__name__}: {exc}"[:800])
    print("\n| section | name | values |\n|---|---|---|")
    for row in RESULTS:
        values = {k: v for k, v in row.items() if k not in ("section", "name")}
        print(f"| {row['section']} | {row['name']} | {values} |")


if __name__ == "__main__":
    main()
