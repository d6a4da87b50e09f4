"""The lossless verdict: identical tokens, or divergences that are numerical ties, or a bug.

At T = 0 speculative decoding must reproduce the target's plain greedy output. In float32 it does,
token for token. In bf16 a B-token verify forward and a 1-token decode step sum in a different
order and round differently, so where two tokens' logits are (nearly) tied the argmax can flip
between them; from there the two outputs legitimately go separate ways. A tie is a property of the
pair (reference token, emitted token) at the first difference: both tokens exist and, in one plain
target forward over the prompt and the reference prefix,

    |logit[reference] - logit[speculative]| <= TIE_ULPS * eps(dtype) * scale,
    scale = max |logit| at that position,

i.e. the two logits lie within a few units in the last place of the logits' own magnitude (bf16:
eps = 2^-7, so at a logit scale of 20 the threshold is 0.625; float32: eps = 2^-23, about 1e-5 at
that scale). The margin is taken both ways: an emitted token far above the reference's means the
plain reference itself emitted a clearly lower-ranked token, which is no tie either. A small top-2
gap of the target proves nothing about the emitted token (it may be ranked last), so it is
reported only as context. A length-only difference (one output ends where the other goes on) is
never a tie: rounding changes which token is chosen, not whether one is. Anything else is a
clear-margin difference: a bug, and the summary says so.

Fields: ``lossless`` (every decoded output identical), ``lossless_up_to_ties`` (every divergence is
a tie), ``divergences`` (one dict each: method, prompt, position, tokens, logit margin, the emitted
token's rank, top-2 gap, threshold, tie).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

# Units in the last place of the logit scale within which a top-2 gap counts as a numerical tie.
TIE_ULPS = 4


def tie_threshold(scale: float, dtype: torch.dtype) -> float:
    """The largest logit difference between two tokens that still counts as a tie for logits of
    magnitude ``scale`` in ``dtype``."""
    return TIE_ULPS * torch.finfo(dtype).eps * max(scale, 1.0)


def first_difference(reference: Sequence[int], output: Sequence[int]) -> int:
    """Index of the first differing token (the shorter length when one is a prefix of the other)."""
    return next(
        (i for i, (a, b) in enumerate(zip(reference, output)) if a != b),
        min(len(reference), len(output)),
    )


@torch.no_grad()
def describe_divergence(target_model, prompt, reference_output, output, prompt_index: int) -> dict[str, Any]:
    """Where a speculative output first differs from the reference, and whether the pair of tokens
    there is a numerical tie: one plain target forward over prompt + reference prefix gives both
    tokens' logits (``logit_margin`` = reference minus speculative), the emitted token's rank and,
    as context, the target's top-2 gap. A missing token (a length-only difference) is never a tie."""
    position = first_difference(reference_output, output)
    param = next(target_model.parameters())
    ids = torch.tensor([[*prompt, *reference_output[:position]]], device=param.device)
    logits = target_model(ids, logits_to_keep=1).logits[0, -1].float()
    top2 = logits.topk(2).values
    scale = float(logits.abs().max())
    threshold = tie_threshold(scale, param.dtype)
    reference_token = reference_output[position] if position < len(reference_output) else None
    speculative_token = output[position] if position < len(output) else None
    margin = rank = None
    if reference_token is not None and speculative_token is not None:
        margin = float(logits[reference_token] - logits[speculative_token])
        rank = int((logits > logits[speculative_token]).sum())
    return {
        "prompt": prompt_index,
        "position": position,
        "reference_token": reference_token,
        "speculative_token": speculative_token,
        "logit_margin": margin,
        "speculative_rank": rank,
        "reference_top2_gap": float(top2[0] - top2[1]),
        "logit_scale": scale,
        "tie_threshold": threshold,
        "is_tie": margin is not None and abs(margin) <= threshold,
    }


def verdict(divergences: Sequence[dict[str, Any]], num_decoded: int, temperature: float) -> dict[str, Any]:
    """``lossless`` / ``lossless_up_to_ties`` / ``num_clear_divergences`` over decoded prompts
    (None when nothing was decoded or when sampling, where outputs differ by design)."""
    if num_decoded == 0 or temperature > 0:
        return {"lossless": None, "lossless_up_to_ties": None, "num_clear_divergences": 0}
    clear = [d for d in divergences if not d["is_tie"]]
    return {
        "lossless": not divergences,
        "lossless_up_to_ties": not clear,
        "num_clear_divergences": len(clear),
    }


def divergence_line(d: dict[str, Any]) -> str:
    """One printed line per divergence."""
    file = f"{d['file']} " if d.get("file") else ""
    where = f"divergence [{d.get('method', '?')}] {file}prompt {d['prompt']} token {d['position']}: "
    if d["logit_margin"] is None:
        ended = "speculative" if d["speculative_token"] is None else "target"
        return f"{where}the {ended} output ends here, the other goes on: LENGTH DIFFERENCE (bug)"
    kind = "tie" if d["is_tie"] else "CLEAR MARGIN (bug)"
    return (
        f"{where}target {d['reference_token']} vs speculative {d['speculative_token']} "
        f"(target's rank {d['speculative_rank']}), logit margin {d['logit_margin']:.4g} "
        f"(tie threshold {d['tie_threshold']:.3g}; target top-2 gap {d['reference_top2_gap']:.4g}): {kind}"
    )


def verdict_line(result: dict[str, Any]) -> str:
    """The summary line of the lossless check."""
    if result.get("lossless") is None:
        return "lossless: not checked (exact mode decodes nothing unless --decode-prompts N; sampling is never token-identical)"
    if result["lossless"]:
        return "lossless: yes (speculative output identical to plain greedy decoding)"
    if result["lossless_up_to_ties"]:
        return "lossless up to ties: at every divergence the target's and the emitted token's logits are numerically tied"
    return (
        f"ERROR: speculative output differs from the target at a clear margin: bug "
        f"({result['num_clear_divergences']} divergence(s) that are not numerical ties)"
    )
