"""Exact greedy acceptance in batched passes: no round-by-round decoding (``--tau-mode exact``).

At T = 0 speculative decoding emits exactly the target's greedy continuation, so every round's
context is a prefix of it (``eval/simulate.py``). Given the continuations (``eval/generate.py``,
or precomputed: the target is frozen, so in-training eval generates them once):

1. features: ONE teacher-forced target pass over ``prompt + continuation`` per batch of rows,
   RIGHT-padded (a causal model's outputs at the real positions cannot see the padding after
   them, and positions are the unpadded run's), through ``FrozenTarget.features`` — the very
   capture training uses (outputs of ``target_layer_ids``, truncated after the last of them);
2. drafter: ONE batched pass over the blocks of every candidate anchor of the continuation, with
   the drafter's training forward. Its visibility is the inference visibility (context p < a,
   block ``[token at a, MASK...]``; the golden test ``test_training_block_equals_inference_block``
   pins training-mode block logits == inference-mode block logits); the target's LM head turns
   block positions 1..B-1 into argmax drafts (and top-K log-probs for DDTree), chunk by chunk;
3. simulation on the host for DFlash, n-gram (``ngram-overlap``: its copy continued past the end
   of the text instead of padded), DDTree and ``ngram+dflash`` (prompt lookup first,
   the drafter otherwise; ``ngram+dflash@K`` the same at key size K; ``ngram-simple`` its lookup
   alone), and the diagnosis of the DFlash drafts (``eval/diagnosis.py``: the training metric over
   every anchor, tau inside / outside repetition loops, after a rejection).

Because the drafter only ever sees features of accepted positions, and those are positions of the
continuation, nothing here needs a GatedDeltaNet state rollback or per-branch state: DDTree tau is
available for hybrid targets too.

Shapes: R rows, L padded length, A anchors per row, B block size, K top-k, H hidden, V vocab.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash_train.eval.ddtree import check_tree_variant
from dflash_train.eval.diagnosis import BlockStats, diagnose_request, summarize_diagnosis
from dflash_train.eval.generate import length_sorted_batches
from dflash_train.eval.ngram_simple import COMBINED_METHOD, LOOKUP_ALONE_METHOD, swept_key_size
from dflash_train.eval.simulate import (
    request_limit,
    simulate_chain,
    simulate_ngram,
    simulate_ngram_then_dflash,
    simulate_tree,
)
from dflash_train.eval.speculative import Generation
from dflash_train.eval.summary import summarize_rounds
from dflash_train.models.variant import get_variant

# Besides these, ``ngram+dflash@K`` for any key size K >= 1 (``ngram_simple.combined_methods``).
EXACT_METHODS = ("dflash", "ngram", "ngram-overlap", "ddtree", COMBINED_METHOD, LOOKUP_ALONE_METHOD)
DRAFTER_METHODS = ("dflash", "ddtree", COMBINED_METHOD)  # the methods that need the drafter pass


def needs_drafter(method: str) -> bool:
    """Whether ``method``'s simulation reads the drafter's blocks (every method but the n-gram)."""
    return method in DRAFTER_METHODS or swept_key_size(method) is not None


@dataclass
class ExactResult:
    """What ``exact_measure`` returns: per method one simulated ``Generation`` per prompt; per prompt
    the diagnosis groups of the DFlash drafts (``diagnosis.diagnose_request``; empty when not
    diagnosed); and phase timings in seconds (``features``, ``drafter``, ``simulation``)."""

    generations: dict[str, list[Generation]]
    diagnoses: list[dict[str, BlockStats]]
    timings: dict[str, float]


@dataclass
class AnchorDrafts:
    """One prompt's drafter proposals at every candidate anchor: row j is the round that starts with
    j + 1 tokens emitted (anchor position ``prompt_len + j``). ``topk_*`` only for DDTree."""

    tokens: torch.Tensor  # [A, D] the drafts (D = B-1; B for DSpark): argmax, or the variant's pick
    topk_tokens: torch.Tensor | None = None  # [A, B-1, K]
    topk_logprobs: torch.Tensor | None = None  # [A, B-1, K]


def as_frozen_target(target: Any, target_layer_ids: Sequence[int]):
    """A ``FrozenTarget`` for ``target`` (returned as is when it already is one)."""
    from dflash_train.models.target import FrozenTarget

    if isinstance(target, FrozenTarget):
        if list(target.target_layer_ids) != list(target_layer_ids):
            raise ValueError(
                f"the drafter reads target layers {list(target_layer_ids)}, the FrozenTarget captures "
                f"{list(target.target_layer_ids)}: build the FrozenTarget with the drafter's target_layer_ids."
            )
        return target
    return FrozenTarget(target, None, list(target_layer_ids), kernels={})


def drafter_config(drafter: torch.nn.Module):
    """The ``DFlashDraftConfig`` of a drafter, also when wrapped (DDP's ``.module``)."""
    inner = getattr(drafter, "module", drafter)
    if not hasattr(inner, "config"):
        raise TypeError(f"{type(drafter).__name__} has no .config: pass the DFlash drafter module")
    return inner.config


def _sync(device: torch.device) -> None:
    # Phase timings must include the queued GPU work of that phase.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def anchor_drafts(
    target,
    drafter: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    num_anchors: Sequence[int],
    *,
    topk: int = 0,
    pad_token_id: int = 0,
    timings: dict[str, float],
) -> list[AnchorDrafts]:
    """Features and drafter proposals for ONE batch of rows ``sequences`` (prompt + continuation)."""
    config = drafter_config(drafter)
    device = target.device
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
    ids = ids.to(device)
    started = time.perf_counter()
    features = target.features(ids)  # right padding: no mask needed, see the module docstring
    _sync(device)
    timings["features"] = timings.get("features", 0.0) + time.perf_counter() - started
    started = time.perf_counter()
    a_max = max(max(num_anchors), 1)
    offsets = torch.arange(a_max)
    anchors = torch.tensor(prompt_lengths)[:, None] + offsets
    keep = offsets[None] < torch.tensor(num_anchors)[:, None]
    inputs = (features, ids, anchors.to(device), keep.to(device), target.embed_tokens, "sdpa", 64)
    # Eval needs no fixed shapes: trimming skips context keys no query sees.
    if get_variant(config.variant).drafts_by_head_argmax:
        hidden = drafter(*inputs, sdpa_trim_context=True)  # [R, A, B, H]
        result = block_proposals(hidden[:, :, config.first_scored_slot :], target.lm_head, topk)
        del hidden
    else:  # the variant's own drafting procedure, inside the drafter's forward
        drafts = drafter(*inputs, sdpa_trim_context=True, drafts_with=target.lm_head)
        result = (drafts.cpu(), None, None)
    _sync(device)
    timings["drafter"] = timings.get("drafter", 0.0) + time.perf_counter() - started
    del features
    assert result[0].shape[-1] == config.num_draft_tokens
    return [
        AnchorDrafts(
            tokens=result[0][r, : num_anchors[r]],
            topk_tokens=None if result[1] is None else result[1][r, : num_anchors[r]],
            topk_logprobs=None if result[2] is None else result[2][r, : num_anchors[r]],
        )
        for r in range(len(sequences))
    ]


def block_proposals(
    hidden: torch.Tensor, lm_head: torch.nn.Module, topk: int, chunk_tokens: int = 2048
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Draft hidden states [R, A, B-1, H] -> argmax [R, A, B-1] (and top-k tokens / log-probs
    [R, A, B-1, K]) on the CPU, through the LM head in chunks (R*A*(B-1) x V logits never exist)."""
    flat = hidden.flatten(0, 2)
    argmax, top_tokens, top_logprobs = [], [], []
    for start in range(0, flat.shape[0], chunk_tokens):
        logits = lm_head(flat[start : start + chunk_tokens].to(lm_head.weight.dtype)).float()
        argmax.append(logits.argmax(-1).cpu())
        if topk > 0:
            top = torch.log_softmax(logits, dim=-1).topk(topk, dim=-1)
            top_tokens.append(top.indices.cpu())
            top_logprobs.append(top.values.cpu())
    shape = hidden.shape[:3]
    tokens = torch.cat(argmax).view(shape)
    if topk <= 0:
        return tokens, None, None
    return tokens, torch.cat(top_tokens).view(*shape, topk), torch.cat(top_logprobs).view(*shape, topk)


def drafter_batches(lengths: Sequence[int], num_anchors: Sequence[int], block_size: int, budget: int):
    """Row batches whose drafter pass holds at most ``budget`` block tokens (at least one row)."""
    batches: list[list[int]] = []
    for group in length_sorted_batches(lengths, len(lengths) or 1):
        current: list[int] = []
        for i in group:
            widest = max([num_anchors[j] for j in current] + [num_anchors[i], 1])
            if current and (len(current) + 1) * widest * block_size > budget:
                batches.append(current)
                current = []
            current.append(i)
        if current:
            batches.append(current)
    return batches


def exact_acceptance(
    target,
    drafter: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    **options: Any,
) -> dict[str, Any]:
    """Exact greedy tau of every method on ``prompts`` given the target's greedy ``continuations``.

    ``target`` is a ``FrozenTarget`` or a HF causal LM (features of the drafter's
    ``target_layer_ids`` are captured as in training); ``drafter`` the DFlash module (a DDP/FSDP
    wrapper is fine: it is called as a module, so the wrapper's hooks run; under FSDP call this on
    every rank with the same prompts, so every rank makes the same drafter calls). ``continuations``
    come from ``generate.greedy_continuations`` with the same ``max_new_tokens`` and EOS ids; the
    target is frozen, so a caller evaluating repeatedly generates them once. ``options`` are
    ``exact_measure``'s. Returns ``{"methods": {name: summarize_rounds(...)}, "diagnosis":
    summarize_diagnosis(...) or None, "timings": {"features", "drafter", "simulation"}}`` (seconds).
    """
    result = exact_measure(target, drafter, prompts, continuations, **options)
    block_size = drafter_config(drafter).num_verify_tokens
    summaries = {name: summarize_rounds(gens, block_size) for name, gens in result.generations.items()}
    diagnosis = summarize_diagnosis(result.diagnoses, block_size) if result.diagnoses else None
    return {"methods": summaries, "diagnosis": diagnosis, "timings": result.timings}


def exact_generations(
    target, drafter: torch.nn.Module, prompts, continuations, **options: Any
) -> tuple[dict[str, list[Generation]], dict[str, float]]:
    """Per method, one simulated ``Generation`` per prompt (``exact_measure``), and timings."""
    result = exact_measure(target, drafter, prompts, continuations, **{"diagnose": False, **options})
    return result.generations, result.timings


def exact_measure(
    target,
    drafter: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_token_ids: Collection[int],
    methods: Sequence[str] = ("dflash",),
    ngram_n: int = 3,
    ngram_min_match: int = 3,
    ngram_max_draft: int = 0,
    ddtree_budget: int = 0,
    ddtree_topk: int = 8,
    drafter_batch_tokens: int = 65536,
    pad_token_id: int = 0,
    diagnose: bool = True,
    on_progress: Callable[[str, int, float | None], None] | None = None,
) -> ExactResult:
    """Every method's simulated rounds on every prompt, and (``diagnose`` with ``dflash`` among
    ``methods``) the diagnosis of the DFlash drafts, loops judged by n-gram lookup with ``ngram_n``.
    ``ngram_min_match`` and ``ngram_max_draft`` (0 = B-1) are the key size and the draft limit of
    ``ngram+dflash``'s lookup (``simulate.simulate_ngram_then_dflash``: llama.cpp's ngram-simple);
    ``ngram+dflash@K`` among ``methods`` is the same lookup with key size K, from the same drafts.
    ``on_progress(phase, num_done, running_tau)`` reports progress."""
    unknown = [m for m in methods if m not in EXACT_METHODS and swept_key_size(m) is None]
    if unknown:
        raise ValueError(
            f"unknown eval methods {unknown}; use some of {list(EXACT_METHODS)} or ngram+dflash@K (K >= 1)"
        )
    if "ddtree" in methods and ddtree_budget < 1:
        raise ValueError("method 'ddtree' needs ddtree_budget >= 1 (--ddtree-budget N)")
    if len(prompts) != len(continuations):
        raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations")
    config = drafter_config(drafter)
    check_tree_variant("ddtree" in methods, config)
    timings: dict[str, float] = {"features": 0.0, "drafter": 0.0, "simulation": 0.0}
    drafts: list[AnchorDrafts | None] = [None] * len(prompts)
    if any(needs_drafter(m) for m in methods):
        drafts = draft_all(
            as_frozen_target(target, config.target_layer_ids),
            drafter,
            prompts,
            continuations,
            max_new_tokens=max_new_tokens,
            eos_token_ids=eos_token_ids,
            topk=ddtree_topk if "ddtree" in methods else 0,
            budget=drafter_batch_tokens,
            pad_token_id=pad_token_id,
            timings=timings,
            on_rows=None if on_progress is None else lambda n: on_progress("drafter", n, None),
        )
    started = time.perf_counter()
    common = {
        "block_size": config.num_verify_tokens,  # the round: the last token and the drafts
        "max_new_tokens": max_new_tokens,
        "eos_token_ids": eos_token_ids,
    }
    generations = {
        method: simulate_method(
            method,
            prompts,
            continuations,
            drafts,
            ngram_n=ngram_n,
            ngram_min_match=ngram_min_match,
            ngram_max_draft=ngram_max_draft,
            ddtree_budget=ddtree_budget,
            on_progress=on_progress,
            **common,
        )  # fmt: skip
        for method in methods
    }
    diagnoses = []
    if diagnose and "dflash" in methods:
        diagnoses = [
            diagnose_request(p, c, d.tokens, g, ngram_n=ngram_n, **common)
            for p, c, d, g in zip(prompts, continuations, drafts, generations["dflash"], strict=True)
        ]
    timings["simulation"] = time.perf_counter() - started
    return ExactResult(generations=generations, diagnoses=diagnoses, timings=timings)


def draft_all(
    target, drafter, prompts, continuations, *, max_new_tokens, eos_token_ids, topk, budget,
    pad_token_id, timings, on_rows=None,
) -> list[AnchorDrafts]:  # fmt: skip
    """``anchor_drafts`` over every prompt, in row batches of at most ``budget`` block tokens."""
    block_size = drafter_config(drafter).block_size
    # Rounds start with 1 .. limit-1 tokens emitted: one candidate anchor each. A continuation that
    # ends at EOS has limit max_new_tokens but no round after its EOS: anchors stop inside it.
    num_anchors = [
        max(min(request_limit(c, max_new_tokens, eos_token_ids), len(c)) - 1, 0) for c in continuations
    ]
    sequences = [[*p, *c] for p, c in zip(prompts, continuations, strict=True)]
    drafts: list[AnchorDrafts | None] = [None] * len(prompts)
    for batch in drafter_batches([len(s) for s in sequences], num_anchors, block_size, budget):
        results = anchor_drafts(
            target,
            drafter,
            [sequences[i] for i in batch],
            [len(prompts[i]) for i in batch],
            [num_anchors[i] for i in batch],
            topk=topk,
            pad_token_id=pad_token_id,
            timings=timings,
        )
        for i, result in zip(batch, results, strict=True):
            drafts[i] = result
        if on_rows is not None:
            on_rows(len(batch))
    return [d for d in drafts if d is not None]


def simulate_method(
    method: str,
    prompts,
    continuations,
    drafts: Sequence[AnchorDrafts | None],
    block_size: int,
    max_new_tokens: int,
    eos_token_ids: Collection[int],
    *,
    ngram_n: int,
    ddtree_budget: int,
    ngram_min_match: int = 3,
    ngram_max_draft: int = 0,
    on_progress: Callable[[str, int, float | None], None] | None = None,
) -> list[Generation]:
    """Host simulation of ``method`` on every prompt (``eval/simulate.py``); ``ngram+dflash@K`` is
    ``ngram+dflash`` with key size K instead of ``ngram_min_match``."""
    key_size = swept_key_size(method)
    generations = []
    for i, continuation in enumerate(continuations):
        common = {"block_size": block_size, "max_new_tokens": max_new_tokens, "eos_token_ids": eos_token_ids}
        if method in ("ngram", "ngram-overlap"):
            overlap = method == "ngram-overlap"
            gen = simulate_ngram(prompts[i], continuation, n=ngram_n, overlap=overlap, **common)
        elif method == "ddtree":
            table = drafts[i]
            gen = simulate_tree(
                continuation,
                lambda out, t=table: (t.topk_tokens[out - 1], t.topk_logprobs[out - 1]),
                budget=ddtree_budget,
                **common,
            )
        elif method == LOOKUP_ALONE_METHOD:  # ngram+dflash's lookup with a drafter that never drafts
            gen = simulate_ngram_then_dflash(
                prompts[i], continuation, lambda out: [], key_size=ngram_min_match,
                max_draft=ngram_max_draft, **common,
            )  # fmt: skip
        elif method == COMBINED_METHOD or key_size is not None:
            tokens = drafts[i].tokens.tolist()
            gen = simulate_ngram_then_dflash(
                prompts[i], continuation, lambda out, t=tokens: t[out - 1],
                key_size=key_size or ngram_min_match, max_draft=ngram_max_draft, **common,
            )  # fmt: skip
        else:
            tokens = drafts[i].tokens.tolist()
            gen = simulate_chain(continuation, lambda out, t=tokens: t[out - 1], **common)
        generations.append(gen)
        if on_progress is not None:
            with_rounds = [g.tau for g in generations if g.num_rounds]
            on_progress(method, 1, sum(with_rounds) / len(with_rounds) if with_rounds else None)
    return generations
