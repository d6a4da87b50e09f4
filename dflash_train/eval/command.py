"""``dflash-train eval``: load target, drafter and prompt files, measure, report (``run_eval``).

Exact mode (the default at T = 0): batched greedy continuations, one feature pass and one drafter
pass, simulated rounds (``eval/exact.py``); the first ``decode_prompts`` prompts of each file are
also decoded for real for the lossless verdict and tokens/s. Decode mode: every prompt is decoded
round by round (``eval/runner.evaluate``). Either way the numbers are reported per prompt file and
overall (``eval/report.py``). With ``--output-dir`` the export directory itself, its SERVING.md is
rewritten with the numbers that choose between the drafter alone and llama.cpp's lookup first.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dflash_train.eval.engines import resolve_decode_engine
from dflash_train.eval.exact import exact_measure
from dflash_train.eval.generate import greedy_continuations, pad_token_for
from dflash_train.eval.options import EvalOptions
from dflash_train.eval.prompts import BadPromptRows, PromptFile, load_prompt_file, target_context
from dflash_train.eval.report import ProgressBars, finish_report
from dflash_train.eval.runner import default_eos_ids, evaluate
from dflash_train.eval.speculative import Generation
from dflash_train.eval.verdict import verdict
from dflash_train.models.dtypes import parse_device


def run_eval(options: EvalOptions) -> dict[str, Any]:
    """Run one evaluation; returns the flat result dict (``--json``), also written to
    ``options.output_dir/eval.json`` with ``acceptance.png`` when an output directory is given."""
    device = resolve_device(options.device)
    dtype = resolve_eval_dtype(options.dtype, device)
    torch.manual_seed(options.seed)
    target_model, tokenizer = load_eval_target(options.target, dtype, device, options.allow_slow_kernels)
    if options.decode_engine == "static":  # refuse before any (long) exact-mode phase, not after it
        resolve_decode_engine(target_model, "static")
    drafter = load_eval_drafter(options.drafter, device, dtype)
    drafter.set_draft_p_min(options.draft_p_min)  # refused before any phase runs
    frozen = check_drafter_fits(drafter.config, target_model, tokenizer)
    bad_rows = BadPromptRows(options.max_bad_rows)
    files = [
        load_prompt_file(
            path,
            tokenizer,
            thinking=options.thinking_flag,
            num_prompts=options.num_prompts,
            bad_rows=bad_rows,
            context=target_context(target_model, options.max_new_tokens),
        )
        for path in options.prompts
    ]
    measured = measure(target_model, frozen, tokenizer, drafter, files, options)
    extra = {
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "tau_mode": options.resolved_tau_mode,
        "draft_p_min": options.draft_p_min,
        "ngram_n": options.ngram_n,  # also the loop test of the diagnosis
        **lookup_fields(options, drafter.config.num_verify_tokens),
        **engine_fields(measured["decode_report"]),
    }
    result = finish_report(measured, files, options, drafter.config.num_verify_tokens, extra)
    refresh_serving_notes(options, drafter.config)
    return result


def lookup_fields(options: EvalOptions, block_size: int) -> dict[str, Any]:
    """``ngram_min_match`` and the resolved ``ngram_max_draft`` of ``ngram+dflash`` (None where it
    did not run); with a key-size sweep also ``ngram_dflash_key_sizes``, method name -> key size of
    every lookup-first method, which SERVING.md reads to serve the best of them
    (``models/serving.py``). A single key size adds nothing: its record stays what it always was."""
    combined = options.resolved_tau_mode == "exact" and "ngram+dflash" in options.exact_methods
    fields: dict[str, Any] = {
        "ngram_min_match": options.ngram_min_match[0] if combined else None,
        "ngram_max_draft": (options.ngram_max_draft or block_size - 1) if combined else None,
    }
    if len(options.ngram_min_match) > 1:
        fields["ngram_dflash_key_sizes"] = options.combined_key_sizes
    return fields


def refresh_serving_notes(options: EvalOptions, config) -> None:
    """``--output-dir`` the drafter's export itself: rewrite its SERVING.md, which then states this
    eval's numbers for llama.cpp's lookup-first combination (``models/serving.py``)."""
    from dflash_train.models.serving import SERVING_NOTES_NAME, write_serving_notes

    export = Path(options.drafter)
    if not options.output_dir or Path(options.output_dir).resolve() != export.resolve():
        return
    if (export / SERVING_NOTES_NAME).is_file():
        write_serving_notes(config, export, options.target)


def measure(
    target_model, frozen, tokenizer, drafter, files: Sequence[PromptFile], options: EvalOptions
) -> dict:
    """Per method, one Generation per prompt (all files concatenated), the decode report of the
    decoded prompts, and phase timings."""
    prompts = [p for f in files for p in f.prompts]
    eos = default_eos_ids(target_model, tokenizer)
    timings: dict[str, float] = {}
    bars = ProgressBars(enabled=options.progress)
    diagnoses: list = []
    if options.resolved_tau_mode == "exact":
        generations, diagnoses = exact_mode(
            target_model, frozen, tokenizer, drafter, prompts, eos, options, timings, bars
        )
        decoded = [
            start + i
            for start, f in zip(file_starts(files), files)
            for i in range(min(options.decode_prompts, len(f.prompts)))
        ]
    else:
        generations, decoded = {}, list(range(len(prompts)))
    decode_report = None
    if decoded:
        started = time.perf_counter()
        methods = decoded_methods(target_model, options)
        decode_report = evaluate(
            target_model, tokenizer, drafter, [prompts[i] for i in decoded],
            max_new_tokens=options.max_new_tokens, temperature=options.temperature, methods=methods,
            ngram_n=options.ngram_n, ddtree_budget=options.ddtree_budget, ddtree_topk=options.ddtree_topk,
            eos_token_ids=eos, seed=options.seed,
            on_prompt=bars.decode_callback(len(decoded), methods), decode_engine=options.decode_engine,
        )  # fmt: skip
        timings["decode"] = time.perf_counter() - started
        print(f"eval: real decoding on {describe_engines(decode_report)}", file=sys.stderr)
        if not generations:
            generations = {m: decode_report["generations"][m] for m in options.methods}
    bars.close()
    divergences = [] if decode_report is None else collect_divergences(decode_report, decoded, files)
    return {
        "generations": generations,
        "diagnoses": diagnoses,
        "decoded": decoded,
        "decode_report": decode_report,
        "divergences": divergences,
        "verdict": verdict(divergences, len(decoded), options.temperature),
        "timings": timings,
    }


def engine_fields(decode_report: dict | None) -> dict[str, Any]:
    """``decode_engine`` (plain decoding's) and ``decode_engines`` per method; None without real decoding."""
    if decode_report is None:
        return {"decode_engine": None, "decode_engines": None}
    methods = {name: summary["decode_engine"] for name, summary in decode_report["methods"].items()}
    return {
        "decode_engine": decode_report["decode_engine"],
        "decode_engines": {"plain": decode_report["decode_engine"], **methods},
    }


def describe_engines(decode_report: dict) -> str:
    """One line: which engine each decoded method ran on (static-cudagraph, static-eager, eager-dynamic)."""
    engines = engine_fields(decode_report)["decode_engines"]
    return ", ".join(f"{name}: {engine}" for name, engine in engines.items())


def decoded_methods(target_model, options: EvalOptions) -> list[str]:
    """The methods decoded for real. Exact mode reports DDTree tau for GatedDeltaNet targets, but
    real tree decoding cannot run on them (one recurrent state, many branches): its lossless check
    is skipped there, with a note. Decode mode keeps it and so raises the clear refusal."""
    from dflash_train.eval.target_session import decoder_layers

    hybrid = any(hasattr(layer, "linear_attn") for layer in decoder_layers(target_model))
    if options.resolved_tau_mode == "exact" and hybrid and "ddtree" in options.methods:
        print(
            "eval: DDTree is not decoded for real on GatedDeltaNet targets (no per-branch state): "
            "its tau is exact-mode only, its lossless check is skipped",
            file=sys.stderr,
        )
        return [m for m in options.methods if m != "ddtree"]
    return list(options.methods)


def exact_mode(
    target_model, frozen, tokenizer, drafter, prompts, eos, options, timings, bars
) -> tuple[dict[str, list[Generation]], list]:
    """Greedy continuations (timed as ``generate``), then ``exact_measure``: the generations of
    ``options.exact_methods`` and the per-prompt diagnosis of the DFlash drafts."""
    device = next(target_model.parameters()).device
    batch_size = options.batch_size or (32 if device.type == "cuda" else 8)
    pad = pad_token_for(tokenizer, eos)
    started = time.perf_counter()
    continuations = greedy_continuations(
        target_model, prompts, max_new_tokens=options.max_new_tokens, eos_token_ids=eos, pad_token_id=pad,
        batch_size=batch_size, on_rows=bars.generation_counter("generate", len(prompts)),
        engine=options.generation_engine,
    )  # fmt: skip
    timings["generate"] = time.perf_counter() - started
    result = exact_measure(
        frozen, drafter, prompts, continuations,
        max_new_tokens=options.max_new_tokens, eos_token_ids=eos, methods=options.exact_methods,
        ngram_n=options.ngram_n, ngram_min_match=options.ngram_min_match[0],
        ngram_max_draft=options.ngram_max_draft,
        ddtree_budget=options.ddtree_budget, ddtree_topk=options.ddtree_topk,
        drafter_batch_tokens=options.drafter_batch_tokens, pad_token_id=pad,
        on_progress=bars.exact_callback(len(prompts), options.exact_methods),
    )  # fmt: skip
    timings.update(result.timings)
    return result.generations, result.diagnoses


def file_starts(files: Sequence[PromptFile]) -> list[int]:
    """Index of each file's first prompt in the concatenated prompt list."""
    starts, total = [], 0
    for f in files:
        starts.append(total)
        total += len(f.prompts)
    return starts


def locate(index: int, files: Sequence[PromptFile]) -> tuple[str, int]:
    """(file, prompt index within it) of a prompt of the concatenated list."""
    for start, f in zip(file_starts(files), files, strict=True):
        if index < start + len(f.prompts):
            return f.path, index - start
    raise IndexError(index)


def collect_divergences(
    decode_report: dict, decoded: Sequence[int], files: Sequence[PromptFile]
) -> list[dict]:
    """Every method's divergences, with the prompt's file and its index within the file."""
    found = []
    for summary in decode_report["methods"].values():
        for d in summary.get("divergences", []):
            path, index = locate(decoded[d["prompt"]], files)
            found.append({**d, "file": path, "prompt": index})
    return found


# ----------------------------------------------------------------------------- loading


def resolve_device(name: str) -> torch.device:
    """``auto`` = CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return parse_device(name, "--device")


def resolve_eval_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` = bfloat16 on GPU, float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def load_eval_target(path: str, dtype: torch.dtype, device: torch.device, allow_slow_kernels: bool = False):
    """The target causal LM (eval mode) and its tokenizer, which eval needs for the prompts.

    On CUDA a GatedDeltaNet target must run on the fast kernels (fla conv bound, the guard training
    uses): a silent PyTorch fallback would make every timing and the whole run several times slower.
    """
    from dflash_train.models.target import bind_fla_causal_conv, check_fast_kernels, load_causal_lm

    target_model, tokenizer = load_causal_lm(path, dtype=dtype, device=device)
    if tokenizer is None:
        raise ValueError(f"target {path!r} has no tokenizer: eval needs one to encode the prompts")
    if device.type == "cuda":
        bind_fla_causal_conv(target_model, device)
        try:
            check_fast_kernels(target_model, device, allow_slow_kernels)
        except RuntimeError as err:  # the guard's own refusal: name eval's switch, exit as a usage error
            raise ValueError(f"{err} For eval: --allow-slow-kernels.") from None
    return target_model.eval(), tokenizer


def load_eval_drafter(path: str, device: torch.device, dtype: torch.dtype):
    """An exported drafter directory, or a training checkpoint / run dir (exported to a temp dir first)."""
    from dflash_train.models.export import export_checkpoint, load_drafter

    if (Path(path) / "config.json").is_file():
        drafter, _ = load_drafter(path, device=str(device), dtype=dtype)
    else:
        with tempfile.TemporaryDirectory(prefix="dflash-eval-") as tmp:
            export_checkpoint(path, tmp, dtype="float32")
            drafter, _ = load_drafter(tmp, device=str(device), dtype=dtype)
    return drafter.eval()


def check_drafter_fits(config, target_model, tokenizer):
    """The drafter's ``FrozenTarget`` view of the target, after the same checks training makes
    (``validate_target_for_drafter``) plus the target depth the drafter was trained against."""
    from dflash_train.models.target import FrozenTarget, validate_target_for_drafter

    frozen = FrozenTarget(target_model, tokenizer, list(config.target_layer_ids), kernels={})
    if config.num_target_layers != frozen.num_layers:
        raise ValueError(
            f"the drafter was trained for a {config.num_target_layers}-layer target, --target has "
            f"{frozen.num_layers} layers: evaluate it against the target it was trained for"
        )
    validate_target_for_drafter(frozen, config)
    return frozen
