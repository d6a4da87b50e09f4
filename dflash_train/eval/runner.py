"""``dflash-train eval``: real speculative decoding with the trained drafter against the target.

For every prompt: plain target decoding (the reference output and the timed baseline), then each
method (DFlash chain, optional n-gram prompt lookup, optional DDTree) on the same prompt. Reported
per method: tau (per request the mean of accepted + 1 over rounds, then the mean over requests),
lossless (T = 0: identical tokens to the reference, every prompt), per-position acceptance,
rounds, tokens/s and the speedup over plain decoding. Speed numbers only mean something on a GPU.

This is ``--tau-mode decode`` (and the lossless check of exact mode). ``evaluate`` is the Python
API; ``eval/command.py`` runs it for the CLI; ``eval/exact.py`` is the batched exact mode.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash_train.eval.ddtree import check_tree_variant, ddtree_generate
from dflash_train.eval.engines import DynamicEngine, build_decode_engine
from dflash_train.eval.proposers import DFlashProposer, NgramProposer, Proposer
from dflash_train.eval.speculative import Generation, plain_generate, speculative_generate
from dflash_train.eval.summary import summarize_rounds
from dflash_train.eval.verdict import describe_divergence

__all__ = ["Method", "build_method", "describe_divergence", "evaluate", "summarize"]

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
    on_prompt: Callable[[str, Generation], None] | None = None,
    decode_engine: str = "auto",
) -> dict[str, Any]:
    """Run plain decoding and every method on every prompt.

    Returns ``{"baseline": ..., "methods": {name: summary}, "generations": {"plain" | name: [Generation]}}``.

    ``drafter`` follows the inference contract of docs/CONTRACTS.md and has ``.config`` with
    ``block_size``, ``mask_token_id``, ``target_layer_ids``; it may be None when no method needs it.
    ``block_size`` (default: the drafter's, else 16) applies to drafter-free methods.
    ``on_prompt(method_name, generation)`` is called after each request (``"plain"`` for the
    reference), for progress bars. ``decode_engine`` (``engines.DECODE_ENGINES``): ``auto`` runs the
    static-cache engine (CUDA graphs on a GPU) where the target supports it; the report's
    ``decode_engine`` fields say which engine produced each number.
    """
    resolved = [
        m
        if isinstance(m, Method)
        else build_method(m, target_model, drafter, block_size, ngram_n, ddtree_budget, ddtree_topk)
        for m in methods
    ]
    eos = set(default_eos_ids(target_model, tokenizer) if eos_token_ids is None else eos_token_ids)
    device = next(target_model.parameters()).device
    engine = engine_for(target_model, decode_engine, resolved, prompts_token_ids, max_new_tokens)
    if device.type == "cuda":
        _warm_up(target_model, resolved, prompts_token_ids[0], eos, temperature, seed, engine)
    references = []
    for i, prompt in enumerate(prompts_token_ids):
        generator = _generator(device, temperature, seed, i)
        references.append(
            _run_plain(target_model, prompt, max_new_tokens, temperature, eos, generator, engine)
        )
        if on_prompt is not None:
            on_prompt("plain", references[-1])
    report: dict[str, Any] = {
        "decode_engine": engine.name,
        "baseline": {**summarize_plain(references), "decode_engine": engine.name},
        "methods": {},
        "generations": {"plain": references},
    }
    for method in resolved:
        summary, generations = evaluate_method(
            target_model, method, prompts_token_ids, references, max_new_tokens, temperature, eos, seed,
            on_prompt=None if on_prompt is None else lambda gen, name=method.name: on_prompt(name, gen),
            engine=engine,
        )  # fmt: skip
        summary["decode_engine"] = engine.method_engine(method.ddtree_budget > 0)
        summary["speedup"] = _ratio(summary["tokens_per_s"], report["baseline"]["tokens_per_s"])
        report["methods"][method.name] = summary
        report["generations"][method.name] = generations
    return report


def engine_for(target_model, decode_engine: str, methods: Sequence[Method], prompts, max_new_tokens: int):
    """The decode engine for these methods and prompts (sized for the longest request and the warm-up)."""
    chains = [m for m in methods if m.ddtree_budget == 0]
    block_sizes = sorted({m.block_size for m in chains}) or [1]
    layer_ids = next((m.target_layer_ids for m in chains if m.target_layer_ids), ())
    max_block = max(block_sizes)
    max_length = max((len(p) for p in prompts), default=1) + max(max_new_tokens, 2 * max_block, 8) + max_block
    return build_decode_engine(
        target_model,
        decode_engine,
        max_length=max_length,
        block_sizes=block_sizes,
        target_layer_ids=layer_ids,
    )


def evaluate_method(
    target_model,
    method: Method,
    prompts,
    references,
    max_new_tokens,
    temperature,
    eos,
    seed,
    on_prompt=None,
    engine=None,
) -> dict[str, Any]:
    """Every prompt with one method: (summary against the plain-decoding references, generations)."""  # fmt: skip
    device = next(target_model.parameters()).device
    generations = []
    for i, (prompt, reference) in enumerate(zip(prompts, references, strict=True)):
        generator = _generator(device, temperature, seed, i)
        generations.append(
            run_method(
                target_model,
                method,
                prompt,
                reference.tokens,
                max_new_tokens,
                temperature,
                eos,
                generator,
                engine,
            )
        )
        if on_prompt is not None:
            on_prompt(generations[-1])
    summary = summarize(generations, references, temperature, method.block_size)
    summary["divergences"] = [
        {
            "method": method.name,
            **describe_divergence(target_model, prompts[i], references[i].tokens, generations[i].tokens, i),
        }
        for i in summary["mismatched_prompts"]
    ]
    return summary, generations


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
        size = block_size or (drafter.config.num_verify_tokens if drafter is not None else 16)
        return Method("ngram", lambda prompt, ref: NgramProposer(ngram_n), block_size=size)
    if drafter is None:
        raise ValueError(f"eval method {name!r} needs a drafter")
    config = drafter.config
    embed, lm_head = target_model.get_input_embeddings(), target_model.get_output_embeddings()

    def make_proposer(prompt, ref):
        return DFlashProposer(drafter, embed, lm_head, config.block_size, config.mask_token_id)

    if name == "ddtree" and ddtree_budget < 1:
        raise ValueError("eval method 'ddtree' needs ddtree_budget >= 1 (--ddtree-budget N)")
    check_tree_variant(name == "ddtree", config)
    return Method(
        name,
        make_proposer,
        block_size=config.num_verify_tokens,  # a round verifies the last token and the drafts
        target_layer_ids=tuple(config.target_layer_ids),
        ddtree_budget=ddtree_budget if name == "ddtree" else 0,
        ddtree_topk=ddtree_topk,
    )


def run_method(
    target_model,
    method: Method,
    prompt,
    reference_output,
    max_new_tokens,
    temperature,
    eos,
    generator,
    engine=None,
) -> Generation:
    """One request with one method, on a fresh (or, static engine, reset) session and proposer."""
    engine = DynamicEngine(target_model) if engine is None else engine
    tree = method.ddtree_budget > 0
    proposer = engine.proposer(method.make_proposer(list(prompt), [*prompt, *reference_output]), tree=tree)
    with engine.session(method.target_layer_ids, tree=tree) as session:
        if tree:
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


def _run_plain(target_model, prompt, max_new_tokens, temperature, eos, generator, engine=None) -> Generation:
    engine = DynamicEngine(target_model) if engine is None else engine
    with engine.session() as session:
        return plain_generate(
            session,
            prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            eos_token_ids=eos,
            generator=generator,
        )


def _warm_up(target_model, methods: Sequence[Method], prompt, eos, temperature, seed, engine) -> None:
    # The first CUDA forwards pay for kernel selection, allocator growth and (static engine) the CUDA
    # graph captures of the T = 1, T = B and drafter steps; keep them out of timing.
    device = next(target_model.parameters()).device
    _run_plain(target_model, prompt, 8, temperature, eos, _generator(device, temperature, seed, 0), engine)
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
            engine,
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


def summarize_plain(references: Sequence[Generation]) -> dict[str, Any]:
    tokens = sum(len(g.tokens) for g in references)
    wall = sum(g.wall_s for g in references)
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": _ratio(tokens, wall)}


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0
