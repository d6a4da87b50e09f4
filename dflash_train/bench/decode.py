"""``dflash-train bench decode``: real decoding speed at batch 1 (``eval --tau-mode decode``), per
decode engine.

Each engine (``dynamic``: HF dynamic cache, eager; ``static``: static KV cache and CUDA graphs for
the target's T = 1 / T = B steps and the drafter's block step) runs ``eval.runner.evaluate`` on the
same prompts (its untimed warm-up first: kernel selection and graph captures), so the numbers are
what ``eval`` reports: plain and DFlash tokens/s, the speedup, tau. Then whether the engines emit
the same tokens: in bf16 they can part at exact logit ties (a T = B verify and a T = 1 step round
differently, and so do the engines' attention kernels), so each engine's DFlash output is also
judged against its plain output by the eval's tie-aware verdict (a divergence within bf16 rounding
is a tie; a wider margin or a length difference is a bug). Without ``--drafter`` a random drafter
times the block step (its tau is ~1 and means nothing).
"""

from __future__ import annotations

import argparse
import time
import traceback
from dataclasses import dataclass
from typing import Any

from dflash_train.bench.progress import StepProgress
from dflash_train.bench.workload import Workload, WorkloadOptions, add_workload_arguments, load_workload

HELP = "Batch-1 speculative decoding speed per decode engine: plain and DFlash tokens/s, speedup."
ENGINES = ("dynamic", "static", "auto")


@dataclass(frozen=True, kw_only=True)
class DecodeBenchOptions(WorkloadOptions):
    """What ``dflash-train bench decode`` measures; the defaults are the CLI's."""

    prompt_len: int = 64
    # Comma list of decode engines (eval.engines): dynamic, static, auto.
    engines: str = "dynamic,static"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.engine_list or set(self.engine_list) - set(ENGINES):
            raise ValueError(f"--engines {self.engines!r}: a comma list of {', '.join(ENGINES)}")

    @property
    def engine_list(self) -> list[str]:
        return [e for e in self.engines.split(",") if e]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser, num_prompts=8, max_new_tokens=256)
    parser.set_defaults(prompt_len=64)
    parser.add_argument("--engines", default="dynamic,static", help="comma list of dynamic, static, auto")


def run_decode_bench(options: DecodeBenchOptions) -> dict[str, Any]:
    """Every engine on the workload's prompts, then which prompts' outputs agree across engines."""
    work = load_workload(options)
    rows: dict[str, dict] = {}
    with StepProgress("decode", len(options.engine_list), options) as progress:
        for engine in options.engine_list:
            with progress.step(engine):
                rows[engine] = run_engine_guarded(options, work, engine)
    outputs = {name: row.pop("_outputs") for name, row in rows.items() if "_outputs" in row}
    return {**work.header(options), "identical_outputs": compare_outputs(outputs), "engines": rows}


def run_engine_guarded(options: DecodeBenchOptions, work: Workload, engine: str) -> dict[str, Any]:
    """``run_engine``, or the error it raised: one engine failing (a capture error, its time limit)
    must not hide the other engines' numbers, so this is a deliberate recovery boundary."""
    try:
        return run_engine(options, work, engine)
    except Exception as err:  # recorded in the result, its traceback on stderr
        traceback.print_exc()
        return {"error": f"{type(err).__name__}: {err}"}


def run_engine(options: DecodeBenchOptions, work: Workload, engine: str) -> dict[str, Any]:
    """One engine: plain and DFlash tokens/s, speedup, tau, the verdict, and the generated tokens."""
    from dflash_train.eval.runner import evaluate
    from dflash_train.eval.verdict import verdict

    started = time.perf_counter()
    report = evaluate(
        work.model, work.tokenizer, work.drafter, work.prompts, max_new_tokens=options.max_new_tokens,
        methods=("dflash",), eos_token_ids=work.eos, decode_engine=engine,
    )  # fmt: skip
    dflash = report["methods"]["dflash"]
    checked = verdict(dflash["divergences"], len(work.prompts), 0.0)
    return {
        "decode_engine": report["decode_engine"],
        "plain_tokens_per_s": report["baseline"]["tokens_per_s"],
        "dflash_tokens_per_s": dflash["tokens_per_s"],
        "speedup": dflash["speedup"],
        "tau": dflash["tau"],
        "lossless": dflash["lossless"],
        "lossless_up_to_ties": checked["lossless_up_to_ties"],
        "clear_divergences": checked["num_clear_divergences"],
        "wall_with_warm_up_s": time.perf_counter() - started,  # the warm-up and graph captures too
        "_outputs": {name: [g.tokens for g in gens] for name, gens in report["generations"].items()},
    }


def compare_outputs(outputs: dict[str, dict[str, list]]) -> dict[str, dict[str, int]]:
    """Per other engine: how many prompts' tokens equal the first engine's, per method (plain, dflash)."""
    names = list(outputs)
    if len(names) < 2:
        return {}
    first = outputs[names[0]]
    return {
        f"{names[0]}_vs_{other}": {
            method: sum(a == b for a, b in zip(tokens, outputs[other][method], strict=True))
            for method, tokens in first.items()
        }
        for other in names[1:]
    }


# The mode's entry points (bench/modes.py).
Options = DecodeBenchOptions
run = run_decode_bench
