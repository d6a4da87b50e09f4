"""What each train-step optimisation buys at the Qwen3.6-27B shape, in one process on one GPU.

Builds the bench run once (random weights, target truncated to its feature layers) and measures:
  step        full train steps, target uncompiled, then with compile_target_regions, then 2 rows
  shapes      32K and 64K rows (64K also with activation checkpointing), drafter-only 8,000 tokens
  profile     one profiled step per variant (kernel tables under $OUT)
  loss        the chunked LM-head loss fwd+bwd at 7,680 scored tokens: eager vs compiled chunk terms
  mask        BlockMask builds: analytic vs create_block_mask, full and sliding layers
  flex        flex attention fwd+bwd of one drafter layer: default kernel config vs max-autotune
Results are appended to $OUT/ablation.jsonl as they come; a table is printed last.

Usage: python scripts/gpu_ablation.py [--only step,loss,...] [--seq-len 4096] [--num-anchors 512]
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

from dflash_train.bench.timing import time_calls_ms

OUT = Path(os.environ.get("OUT", "gpu-logs"))
RESULTS: list[dict] = []


def record(section: str, name: str, **values) -> None:
    row = {"section": section, "name": name, **values}
    RESULTS.append(row)
    with open(OUT / "ablation.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def cuda_ms(fn, iters: int = 10, warmup: int = 3) -> float:
    """Median CUDA time of ``fn`` in milliseconds."""
    return statistics.median(time_calls_ms(fn, iters, warmup=warmup, device="cuda"))


def bench_args(seq_len: int, anchors: int, rows: int = 1):
    from dflash_train.bench.train_step import BenchOptions

    return BenchOptions(
        preset="qwen3.6-27b",
        seq_len=seq_len,
        num_anchors=anchors,
        rows=rows,
        attention_backend="flex",
        activation_checkpointing=False,
        loss_chunk_tokens=2048,
        compile=True,
        target_compile=False,
    )


def section_step(args) -> None:
    from dflash_train.bench.train_step import (
        SyntheticData,
        bench_config,
        build_bench_run,
        profile_train_step,
        time_train_steps,
    )
    from dflash_train.models.target_kernels import compile_target_regions

    cfg, seq_len, anchors = bench_config(bench_args(args.seq_len, args.num_anchors))
    t0 = time.perf_counter()
    run = build_bench_run(cfg, 1, seq_len, torch.device("cuda"))
    record("step", "build", seconds=round(time.perf_counter() - t0, 1))
    t0 = time.perf_counter()
    result = time_train_steps(run, args.steps, args.warmup)
    record("step", "1 row, target eager", wall_incl_warmup_s=round(time.perf_counter() - t0, 1), **result)
    profile_train_step(run, str(OUT / "profile_target_eager.txt"))
    t0 = time.perf_counter()
    compile_target_regions(run.target.model)
    result = time_train_steps(run, args.steps, args.warmup)
    record("step", "1 row, target compiled", wall_incl_warmup_s=round(time.perf_counter() - t0, 1), **result)
    profile_train_step(run, str(OUT / "profile_target_compiled.txt"))
    run.data = SyntheticData(2, seq_len, run.target.vocab_size, run.info.device)
    result = time_train_steps(run, max(2, args.steps - 2), args.warmup)
    record("step", "2 rows, target compiled", **result)


def section_loss(args) -> None:
    from dflash_train.train.loss import chunked_lm_head_loss

    torch.manual_seed(0)
    dev, vocab, hidden_size = "cuda", 248320, 5120
    tokens = args.num_anchors * 15
    weight = (torch.randn(vocab, hidden_size, device=dev) * 0.02).bfloat16()
    hidden = torch.randn(tokens, hidden_size, device=dev).bfloat16().requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens,), device=dev)
    weights = torch.rand(tokens, device=dev)
    denom = weights.sum()
    grads = {}
    for fused in (False, True):

        def step(fused=fused):
            hidden.grad = None
            loss, _, _ = chunked_lm_head_loss(hidden, weight, labels, weights, denom, 2040, fused)
            loss.backward()
            return loss

        loss = step()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = cuda_ms(step)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        grads[fused] = (float(loss), hidden.grad.float().clone())
        record("loss", "compiled" if fused else "eager", ms=round(ms, 2), transient_gib=round(peak, 2))
    (l0, g0), (l1, g1) = grads[False], grads[True]
    record(
        "loss",
        "agreement",
        loss_rel=abs(l1 - l0) / abs(l0),
        grad_rel=float((g1 - g0).norm() / g0.norm()),
    )


def section_mask(args) -> None:
    from dflash_train.models.masks import LayerMaskSpec, build_flex_block_mask

    anchors = torch.sort(torch.randperm(args.seq_len - 1, device="cuda")[: args.num_anchors])[0][None]
    for spec in (LayerMaskSpec(None, False), LayerMaskSpec(2048, True)):
        for method in ("analytic", "create_block_mask"):
            ms = cuda_ms(
                lambda method=method, spec=spec: build_flex_block_mask(
                    anchors, args.seq_len, 16, spec, method=method
                )
            )
            record("mask", f"{method} window={spec.window}", ms=round(ms, 3))


def section_flex(args) -> None:
    from torch.nn.attention.flex_attention import flex_attention

    from dflash_train.models.masks import LayerMaskSpec, build_flex_block_mask

    torch.manual_seed(0)
    anchors = torch.sort(torch.randperm(args.seq_len - 1, device="cuda")[: args.num_anchors])[0][None]
    queries = args.num_anchors * 16
    mask = build_flex_block_mask(anchors, args.seq_len, 16, LayerMaskSpec(None, False))
    q = torch.randn(1, 32, queries, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(
        1, 8, args.seq_len + queries, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True
    )
    v = torch.randn_like(k, requires_grad=True)
    grad_out = torch.randn_like(q)
    for mode in ("default", "max-autotune-no-cudagraphs"):
        fn = torch.compile(flex_attention, dynamic=False, mode=None if mode == "default" else mode)
        t0 = time.perf_counter()

        def fwd_bwd(fn=fn):
            out = fn(q, k, v, block_mask=mask, enable_gqa=True)
            out.backward(grad_out)

        fwd_bwd()
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        record("flex", mode, fwd_bwd_ms=round(cuda_ms(fwd_bwd), 2), first_call_s=round(first, 1))


def section_shapes(args) -> None:
    """Long rows on one shared target: 32K (the previous system's shape), then 64K without and with
    activation checkpointing, then the drafter-only 8,000-token row; each OOM is recorded."""
    from dflash_train.bench.train_step import bench_config, build_bench_run, time_train_steps
    from dflash_train.models.target import load_target

    deadline = time.perf_counter() + args.shapes_budget_s
    cfg, _, _ = bench_config(bench_args(4096, 512))
    target = load_target(cfg.target, torch.device("cuda"), truncate_unused_layers=True, compile_regions=True)
    shapes = [
        (32768, 2048, False, False),
        (65536, 4096, False, False),
        (65536, 4096, True, False),
        (8000, 1024, False, True),
    ]
    for seq_len, anchors, checkpointing, drafter_only in shapes:
        name = f"1x{seq_len}/{anchors}{' ckpt' if checkpointing else ''}{' drafter-only' if drafter_only else ''}"
        if time.perf_counter() > deadline:
            record("shapes", name, skipped="time budget")
            continue
        shape_args = dataclasses.replace(bench_args(seq_len, anchors), activation_checkpointing=checkpointing)
        cfg, _, _ = bench_config(shape_args)
        run = None
        try:
            t0 = time.perf_counter()
            torch.cuda.reset_peak_memory_stats()
            run = build_bench_run(
                cfg, 1, seq_len, torch.device("cuda"), drafter_only=drafter_only, target=target
            )
            result = time_train_steps(run, 2, 1)
            record(
                "shapes",
                name,
                tokens_per_s=round(seq_len / result["step_s"]),
                wall_s=round(time.perf_counter() - t0, 1),
                **result,
            )
        except torch.OutOfMemoryError as exc:
            record("shapes", name, oom=str(exc)[:200], peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9)
        finally:
            if run is not None and drafter_only:
                del run.target.features  # the instance attribute the drafter-only bench set
            del run
            torch.cuda.empty_cache()


SECTIONS = {
    "step": section_step,
    "shapes": section_shapes,
    "loss": section_loss,
    "mask": section_mask,
    "flex": section_flex,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default=",".join(SECTIONS))
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--num-anchors", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--shapes-budget-s", type=float, default=330.0)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    for name in args.only.split(","):
        t0 = time.perf_counter()
        try:
            SECTIONS[name](args)
        except Exception as exc:  # one failed section must not cost the others
            traceback.print_exc()
            record(name, "FAILED", error=f"{type(exc).__name__}: {exc}"[:500])
        record(name, "section_wall", seconds=round(time.perf_counter() - t0, 1))
        torch.cuda.empty_cache()
    print("\n| section | name | values |\n|---|---|---|")
    for row in RESULTS:
        values = {
            k: (round(v, 4) if isinstance(v, float) else v)
            for k, v in row.items()
            if k not in ("section", "name")
        }
        print(f"| {row['section']} | {row['name']} | {values} |")


if __name__ == "__main__":
    main()
