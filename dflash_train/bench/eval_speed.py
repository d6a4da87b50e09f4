"""``dflash-train bench eval``: how long an exact-mode evaluation (``eval --tau-mode exact``) takes,
phase by phase, and optionally against real decoding of the same prompts.

Exact mode: one batched greedy generation (``generate``), then one feature pass, one batched drafter
pass and a host simulation of the rounds (``features``, ``drafter``, ``simulation``; the same calls
``dflash-train eval`` makes). A short untimed warm-up comes first (kernel selection, allocator
growth). Reported: the phase seconds, prompts per minute, generated tokens/s, tau per method (a
random drafter's means nothing), the exact phases' peak GPU memory and the bound GatedDeltaNet
kernels.

``--decode`` also decodes every prompt for real (``eval --tau-mode decode``: the plain reference,
then each method round by round, batch 1) and reports its seconds, the plain reference's alone
(decode mode pays it whatever the drafter's tau), its own peak GPU memory (the peak is reset
before it) and how many times longer decode mode took.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch

from dflash_train.bench.progress import StepProgress
from dflash_train.bench.workload import (
    Workload,
    WorkloadOptions,
    add_workload_arguments,
    load_workload,
    synchronize,
)

HELP = "Exact-mode evaluation time per phase (generate, features, drafter, simulation), prompts/min."
METHODS = ("dflash", "ngram", "ddtree")


@dataclass(frozen=True, kw_only=True)
class EvalBenchOptions(WorkloadOptions):
    """What ``dflash-train bench eval`` measures; the defaults are the CLI's."""

    num_prompts: int = 164
    max_new_tokens: int = 512
    # Prompts per batched greedy generation, and the generation engine (auto, slots, padded).
    batch_size: int = 32
    generation_engine: str = "auto"
    # Block tokens (anchors x block size) per feature + drafter pass.
    drafter_batch_tokens: int = 65536
    # Comma list of dflash, ngram, ddtree (ddtree needs --ddtree-budget).
    methods: str = "dflash,ngram"
    ddtree_budget: int = 0
    # Also decode every prompt for real (decode mode), timed.
    decode: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = set(self.method_list) - set(METHODS)
        if unknown or not self.method_list:
            raise ValueError(f"--methods {self.methods!r}: a comma list of {', '.join(METHODS)}")
        if ("ddtree" in self.method_list) != (self.ddtree_budget > 0):
            raise ValueError(
                "ddtree needs --ddtree-budget N > 0, and --ddtree-budget needs ddtree in --methods"
            )
        if self.batch_size < 1 or self.drafter_batch_tokens < 1:
            raise ValueError("--batch-size and --drafter-batch-tokens must be >= 1")

    @property
    def method_list(self) -> list[str]:
        return [m for m in self.methods.split(",") if m]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser, num_prompts=164, max_new_tokens=512)
    parser.add_argument("--batch-size", type=int, default=32, help="prompts per batched greedy generation")
    parser.add_argument("--generation-engine", choices=["auto", "slots", "padded"], default="auto")
    parser.add_argument("--drafter-batch-tokens", type=int, default=65536)
    parser.add_argument("--methods", default="dflash,ngram", help="comma list of dflash, ngram, ddtree")
    parser.add_argument("--ddtree-budget", type=int, default=0)
    parser.add_argument(
        "--decode", action="store_true", help="also decode every prompt for real (decode mode), timed"
    )


def run_eval_bench(options: EvalBenchOptions) -> dict[str, Any]:
    """Load the workload, warm up, time the exact-mode phases (and decode mode with ``--decode``)."""
    from dflash_train.models.target_kernels import bound_kernels

    work = load_workload(options)
    with StepProgress("eval", 3 + options.decode, options) as progress:
        with progress.step("warm-up"):
            warm = dataclasses.replace(options, max_new_tokens=8)
            exact_phases(warm, work, work.prompts[:2], progress=None)
        reset_peak(work.device)
        result = exact_phases(options, work, work.prompts, progress)
        result["peak_gib"] = peak_gib(work.device)  # the exact phases' own, before decode mode's
        if options.decode:
            with progress.step("decode mode"):
                reset_peak(work.device)
                result["decode"] = decode_mode(options, work) | {"peak_gib": peak_gib(work.device)}
    total = result["timings"]["total"]
    result.update(
        prompts_per_min=len(work.prompts) / (total / 60) if total else None,
        new_tokens_per_s=result["tokens"] / total if total else None,
        kernels=bound_kernels(work.model),
    )
    if options.decode:
        result["decode_vs_exact"] = result["decode"]["seconds"] / total
    return {**work.header(options), **result}


def reset_peak(device: torch.device) -> None:
    """Start a new peak of GPU memory (CUDA only)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    """GiB allocated at most since the last ``reset_peak``; None off CUDA."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def exact_phases(
    options: EvalBenchOptions, work: Workload, prompts, progress: StepProgress | None
) -> dict[str, Any]:
    """Greedy continuations, then the exact generations: phase seconds, tau per method, tokens."""
    from dflash_train.eval.exact import exact_generations
    from dflash_train.eval.generate import greedy_continuations
    from dflash_train.eval.summary import summarize_rounds

    # The warm-up runs inside one step of its own: no nested bar or time limit then.
    step = progress.step if progress else (lambda label: contextlib.nullcontext())
    started = time.perf_counter()
    with step("generate"):
        continuations = greedy_continuations(
            work.model, prompts, max_new_tokens=options.max_new_tokens, eos_token_ids=work.eos,
            pad_token_id=work.pad, batch_size=options.batch_size, engine=options.generation_engine,
        )  # fmt: skip
        synchronize(work.device)
    timings = {"generate": time.perf_counter() - started}
    with step("features, drafter, simulation"):
        generations, exact_timings = exact_generations(
            work.model, work.drafter, prompts, continuations, max_new_tokens=options.max_new_tokens,
            eos_token_ids=work.eos, methods=options.method_list, ddtree_budget=options.ddtree_budget,
            drafter_batch_tokens=options.drafter_batch_tokens, pad_token_id=work.pad,
        )  # fmt: skip
    timings.update(exact_timings)
    timings["total"] = sum(timings.values())
    block = work.drafter.config.block_size
    taus = {name: summarize_rounds(gens, block)["tau"] for name, gens in generations.items()}
    return {"timings": timings, "tau": taus, "tokens": sum(len(c) for c in continuations)}


def decode_mode(options: EvalBenchOptions, work: Workload) -> dict[str, Any]:
    """Real decoding of every prompt (plain reference, then each chain method): seconds, the plain
    reference's share, tau per method."""
    from dflash_train.eval.runner import evaluate

    started = time.perf_counter()
    report = evaluate(
        work.model, work.tokenizer, work.drafter, work.prompts, max_new_tokens=options.max_new_tokens,
        methods=options.method_list, ddtree_budget=options.ddtree_budget, eos_token_ids=work.eos,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    baseline = report["baseline"]
    return {
        "seconds": seconds,
        "plain_reference_s": baseline["tokens"] / baseline["tokens_per_s"]
        if baseline["tokens_per_s"]
        else None,
        "tau": {name: summary["tau"] for name, summary in report["methods"].items()},
        "decode_engine": report["decode_engine"],
    }


# The mode's entry points (bench/modes.py).
Options = EvalBenchOptions
run = run_eval_bench
