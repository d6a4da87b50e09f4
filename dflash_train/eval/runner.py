"""``dflash-train eval``: real speculative decoding with the trained drafter against the target.

For every prompt: plain target decoding (the reference output and the timed baseline), then each
method (DFlash chain, optional n-gram prompt lookup, optional DDTree) on the same prompt. Reported
per method: tau (per request the mean of accepted + 1 over rounds, then the mean over requests),
lossless (T = 0: identical tokens to the reference, every prompt), per-position acceptance,
rounds, tokens/s and the speedup over plain decoding. Speed numbers only mean something on a GPU.

``evaluate`` is the Python API (used by the demo and the tests); ``run_eval`` wraps it for the CLI.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash_train.eval.ddtree import ddtree_generate
from dflash_train.eval.proposers import DFlashProposer, NgramProposer, Proposer
from dflash_train.eval.speculative import Generation, plain_generate, speculative_generate
from dflash_train.eval.summary import summarize_rounds
from dflash_train.eval.target_session import TargetSession

METHOD_NAMES = ("dflash", "ngram", "ddtree")


@dataclass(frozen=True)
class Method:
    """One way of drafting. ``make_proposer(prompt_ids, reference_ids)`` builds a fresh proposer per
    request (``reference_ids`` = prompt + the target's reference output, for test oracles);
    ``ddtree_budget > 0`` verifies a tree instead of a chain."""

    name: str
    make_proposer: Callable[[list[int], list[int]], Proposer]
    block_size: int
    target_layer_ids: tuple[int, ...] = ()
    ddtree_budget: int = 0
    ddtree_topk: int = 8


def evaluate(
    target_model: torch.nn.Module,
    tokenizer: Any,
    drafter: Any | None,
    prompts_token_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    methods: Sequence[str | Method] = ("dflash",),
    block_size: int | None = None,
    ngram_n: int = 3,
    ddtree_budget: int = 0,
    ddtree_topk: int = 8,
    eos_token_ids: Collection[int] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Run plain decoding and every method on every prompt; return ``{"baseline": ..., "methods": {...}}``.

    ``drafter`` follows the inference contract of docs/CONTRACTS.md and has ``.config`` with
    ``block_size``, ``mask_token_id``, ``target_layer_ids``; it may be None when no method needs it.
    ``block_size`` (default: the drafter's, else 16) applies to drafter-free methods.
    """
    resolved = [
        m
        if isinstance(m, Method)
        else build_method(m, target_model, drafter, block_size, ngram_n, ddtree_budget, ddtree_topk)
        for m in methods
    ]
    eos = set(default_eos_ids(target_model, tokenizer) if eos_token_ids is None else eos_token_ids)
    device = next(target_model.parameters()).device
    if device.type == "cuda":
        _warm_up(target_model, resolved, prompts_token_ids[0], eos, temperature, seed)
    references = [
        _run_plain(
            target_model, prompt, max_new_tokens, temperature, eos, _generator(device, temperature, seed, i)
        )
        for i, prompt in enumerate(prompts_token_ids)
    ]
    report: dict[str, Any] = {"baseline": summarize_plain(references), "methods": {}}
    for method in resolved:
        summary = evaluate_method(
            target_model, method, prompts_token_ids, references, max_new_tokens, temperature, eos, seed
        )
        summary["speedup"] = _ratio(summary["tokens_per_s"], report["baseline"]["tokens_per_s"])
        report["methods"][method.name] = summary
    return report


def evaluate_method(
    target_model, method: Method, prompts, references, max_new_tokens, temperature, eos, seed
) -> dict[str, Any]:
    """Every prompt with one method, summarised against the plain-decoding references."""
    device = next(target_model.parameters()).device
    generations = [
        run_method(
            target_model,
            method,
            prompt,
            reference.tokens,
            max_new_tokens,
            temperature,
            eos,
            _generator(device, temperature, seed, i),
        )
        for i, (prompt, reference) in enumerate(zip(prompts, references, strict=True))
    ]
    summary = summarize(generations, references, temperature, method.block_size)
    summary["divergences"] = [
        describe_divergence(target_model, prompts[i], references[i].tokens, generations[i].tokens, i)
        for i in summary["mismatched_prompts"]
    ]
    return summary


def build_method(
    name: str,
    target_model,
    drafter,
    block_size: int | None,
    ngram_n: int,
    ddtree_budget: int,
    ddtree_topk: int,
) -> Method:
    """A named method: ``dflash`` (chain), ``ddtree`` (tree from the drafter) or ``ngram`` (prompt lookup)."""
    if name not in METHOD_NAMES:
        raise ValueError(f"unknown eval method {name!r}; use one of {list(METHOD_NAMES)}")
    if name == "ngram":
        size = block_size or (drafter.config.block_size if drafter is not None else 16)
        return Method("ngram", lambda prompt, ref: NgramProposer(ngram_n), block_size=size)
    if drafter is None:
        raise ValueError(f"eval method {name!r} needs a drafter")
    config = drafter.config
    embed, lm_head = target_model.get_input_embeddings(), target_model.get_output_embeddings()

    def make_proposer(prompt, ref):
        return DFlashProposer(drafter, embed, lm_head, config.block_size, config.mask_token_id)

    if name == "ddtree" and ddtree_budget < 1:
        raise ValueError("eval method 'ddtree' needs ddtree_budget >= 1 (--ddtree-budget N)")
    return Method(
        name,
        make_proposer,
        block_size=config.block_size,
        target_layer_ids=tuple(config.target_layer_ids),
        ddtree_budget=ddtree_budget if name == "ddtree" else 0,
        ddtree_topk=ddtree_topk,
    )


def run_method(
    target_model, method: Method, prompt, reference_output, max_new_tokens, temperature, eos, generator
) -> Generation:
    """One request with one method, on a fresh session and a fresh proposer."""
    proposer = method.make_proposer(list(prompt), [*prompt, *reference_output])
    with TargetSession(target_model, method.target_layer_ids) as session:
        if method.ddtree_budget > 0:
            return ddtree_generate(
                session,
                proposer,
                prompt,
                block_size=method.block_size,
                budget=method.ddtree_budget,
                topk=method.ddtree_topk,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                eos_token_ids=eos,
            )
        return speculative_generate(
            session,
            proposer,
            prompt,
            block_size=method.block_size,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            eos_token_ids=eos,
            generator=generator,
        )


def _run_plain(target_model, prompt, max_new_tokens, temperature, eos, generator) -> Generation:
    with TargetSession(target_model) as session:
        return plain_generate(
            session,
            prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            eos_token_ids=eos,
            generator=generator,
        )


def _warm_up(target_model, methods: Sequence[Method], prompt, eos, temperature, seed) -> None:
    # The first CUDA forwards pay for kernel selection and allocator growth; keep them out of timing.
    device = next(target_model.parameters()).device
    _run_plain(target_model, prompt, 8, temperature, eos, _generator(device, temperature, seed, 0))
    for method in methods:
        run_method(
            target_model,
            method,
            prompt,
            [],
            2 * method.block_size,
            temperature,
            eos,
            _generator(device, temperature, seed, 0),
        )


def _generator(device: torch.device, temperature: float, seed: int, index: int) -> torch.Generator | None:
    # One generator per request, seeded by its index: a sampled run is reproducible prompt by prompt.
    if temperature <= 0:
        return None
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)


def default_eos_ids(target_model, tokenizer) -> set[int]:
    """EOS ids from the tokenizer and the model's (generation) config."""
    ids: set[int] = set()
    for source in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(target_model.config, "eos_token_id", None),
        getattr(getattr(target_model, "generation_config", None), "eos_token_id", None),
    ):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return ids


# -- reporting ------------------------------------------------------------------------------------
def summarize(
    generations: Sequence[Generation], references: Sequence[Generation], temperature: float, block_size: int
) -> dict[str, Any]:
    """``summarize_rounds`` plus lossless, the mismatching prompts, wall time and tokens/s."""
    wall = sum(g.wall_s for g in generations)
    mismatched = [
        i for i, (g, r) in enumerate(zip(generations, references, strict=True)) if g.tokens != r.tokens
    ]
    summary = summarize_rounds(generations, block_size)
    return {
        **summary,
        # Token-for-token equality is the lossless criterion at T = 0 only; sampled outputs differ by design.
        "lossless": (not mismatched) if temperature <= 0 else None,
        "mismatched_prompts": mismatched if temperature <= 0 else [],
        "wall_s": wall,
        "tokens_per_s": _ratio(summary["tokens"], wall),
    }


@torch.no_grad()
def describe_divergence(target_model, prompt, reference_output, output, prompt_index: int) -> dict[str, Any]:
    """Where a speculative output first differs from the reference, and how close the target's top
    two logits were there. In bf16 a block verify and a one-token step round differently, so a
    near-tie (gap ~ 1e-2) can flip; a large gap means a real bug."""
    position = next(
        (i for i, (a, b) in enumerate(zip(reference_output, output)) if a != b),
        min(len(reference_output), len(output)),
    )
    device = next(target_model.parameters()).device
    ids = torch.tensor([[*prompt, *reference_output[:position]]], device=device)
    top2 = target_model(ids).logits[0, -1].float().topk(2).values
    return {
        "prompt": prompt_index,
        "position": position,
        "reference_token": reference_output[position] if position < len(reference_output) else None,
        "speculative_token": output[position] if position < len(output) else None,
        "reference_top2_gap": float(top2[0] - top2[1]),
    }


def summarize_plain(references: Sequence[Generation]) -> dict[str, Any]:
    tokens = sum(len(g.tokens) for g in references)
    wall = sum(g.wall_s for g in references)
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": _ratio(tokens, wall)}


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0


# -- CLI ------------------------------------------------------------------------------------------
def run_eval(args: argparse.Namespace) -> dict[str, Any]:
    """``dflash-train eval``: load target, drafter and prompts, run ``evaluate``, flatten the report."""
    from dflash_train.eval.prompts import load_prompts
    from dflash_train.models.target import load_causal_lm

    device = _resolve_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(args.seed)
    target_model, tokenizer = load_causal_lm(args.target, dtype=dtype, device=device)
    if tokenizer is None:
        raise ValueError(f"target {args.target!r} has no tokenizer: eval needs one to encode the prompts")
    target_model.eval()
    drafter = load_eval_drafter(args.drafter, device, dtype)
    _check_drafter_fits(drafter.config, target_model)
    thinking = {"on": True, "off": False, "default": None}[args.thinking]
    prompts = load_prompts(args.prompts, tokenizer, thinking=thinking, num_prompts=args.num_prompts)
    methods = (
        ["dflash"]
        + (["ngram"] if args.baseline == "ngram" else [])
        + (["ddtree"] if args.ddtree_budget > 0 else [])
    )
    report = evaluate(
        target_model,
        tokenizer,
        drafter,
        prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        methods=methods,
        ngram_n=args.ngram_n,
        ddtree_budget=args.ddtree_budget,
        seed=args.seed,
    )
    return flatten_report(report, num_prompts=len(prompts), device=str(device))


def flatten_report(report: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The CLI's result dict: the DFlash chain's numbers at top level, other methods prefixed."""
    methods, baseline = report["methods"], report["baseline"]
    main = methods.get("dflash", {})
    result: dict[str, Any] = {
        "tau": main.get("tau"),
        # True only if every evaluated method reproduced the reference exactly (None when sampling).
        "lossless": _all_lossless(methods.values()),
        "tokens_per_s": main.get("tokens_per_s"),
        "baseline_tokens_per_s": baseline["tokens_per_s"],
        "speedup": main.get("speedup"),
        "ngram_tau": methods.get("ngram", {}).get("tau"),
        "ddtree_tau": methods.get("ddtree", {}).get("tau"),
        "per_position_acceptance": main.get("per_position_acceptance"),
        "rounds": main.get("rounds"),
        "tokens": main.get("tokens"),
        **extra,
    }
    for name in ("ngram", "ddtree"):
        if name in methods:
            for key in ("lossless", "tokens_per_s", "speedup"):
                result[f"{name}_{key}"] = methods[name][key]
    return result


def _all_lossless(summaries) -> bool | None:
    flags = [s["lossless"] for s in summaries]
    return None if any(f is None for f in flags) else all(flags)


def load_eval_drafter(path: str, device: torch.device, dtype: torch.dtype):
    """An exported drafter directory, or a training checkpoint / run dir (exported to a temp dir first)."""
    from pathlib import Path

    from dflash_train.models.export import export_checkpoint, load_drafter

    if (Path(path) / "config.json").is_file():
        drafter, _ = load_drafter(path, device=str(device), dtype=dtype)
    else:
        with tempfile.TemporaryDirectory(prefix="dflash-eval-") as tmp:
            export_checkpoint(path, tmp, dtype="float32")
            drafter, _ = load_drafter(tmp, device=str(device), dtype=dtype)
    return drafter.eval()


def _check_drafter_fits(config, target_model) -> None:
    num_layers = getattr(target_model.config, "num_hidden_layers", None)
    if num_layers is not None and config.num_target_layers != num_layers:
        raise ValueError(
            f"the drafter was trained for a {config.num_target_layers}-layer target, --target has {num_layers} layers"
        )
    vocab = target_model.get_input_embeddings().weight.shape[0]
    if not 0 <= config.mask_token_id < vocab:
        raise ValueError(
            f"drafter mask_token_id {config.mask_token_id} is outside the target's vocab ({vocab})"
        )


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
