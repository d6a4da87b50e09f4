"""The lossless verdict: identical tokens, or divergences that are numerical ties, or a bug.

At T = 0 speculative decoding must reproduce the target's plain greedy output. In float32 it does,
token for token. In bf16 a B-token verify forward and a 1-token decode step sum in a different
order and round differently, so where the target's top two logits are (nearly) tied the argmax can
flip; from there the two outputs legitimately go separate ways. Such a divergence is reported with
its top-2 gap, and called a tie when

    gap <= TIE_ULPS * eps(dtype) * scale,    scale = max |logit| at that position,

i.e. within a few units in the last place of the logits' own magnitude (bf16: eps = 2^-7, so at a
logit scale of 20 the threshold is 0.625; float32: eps = 2^-23, about 1e-5 at that scale). A
divergence above the threshold is a clear-margin difference: a bug, and the summary says so.

Fields: ``lossless`` (every decoded output identical), ``lossless_up_to_ties`` (every divergence is
a tie), ``divergences`` (one dict each: method, prompt, position, tokens, gap, threshold, tie).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

# Units in the last place of the logit scale within which a top-2 gap counts as a numerical tie.
TIE_ULPS = 4


def tie_threshold(scale: float, dtype: torch.dtype) -> float:
    """The largest top-2 gap that still counts as a tie for logits of magnitude ``scale`` in ``dtype``."""
    return TIE_ULPS * torch.finfo(dtype).eps * max(scale, 1.0)


def first_difference(reference: Sequence[int], output: Sequence[int]) -> int:
    """Index of the first differing token (the shorter length when one is a prefix of the other)."""
    return next(
        (i for i, (a, b) in enumerate(zip(reference, output)) if a != b),
        min(len(reference), len(output)),
    )


@torch.no_grad()
def describe_divergence(target_model, prompt, reference_output, output, prompt_index: int) -> dict[str, Any]:
    """Where a speculative output first differs from the reference, the target's top-2 logit gap
    there (one plain forward over prompt + reference prefix) and whether that gap is a tie."""
    position = first_difference(reference_output, output)
    param = next(target_model.parameters())
    ids = torch.tensor([[*prompt, *reference_output[:position]]], device=param.device)
    logits = target_model(ids, logits_to_keep=1).logits[0, -1].float()
    top2 = logits.topk(2).values
    gap, scale = float(top2[0] - top2[1]), float(logits.abs().max())
    threshold = tie_threshold(scale, param.dtype)
    return {
        "prompt": prompt_index,
        "position": position,
        "reference_token": reference_output[position] if position < len(reference_output) else None,
        "speculative_token": output[position] if position < len(output) else None,
        "reference_top2_gap": gap,
        "logit_scale": scale,
        "tie_threshold": threshold,
        "is_tie": gap <= threshold,
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
    kind = "tie" if d["is_tie"] else "CLEAR MARGIN (bug)"
    where = f"{d['file']} " if d.get("file") else ""
    return (
        f"divergence [{d.get('method', '?')}] {where}prompt {d['prompt']} token {d['position']}: "
        f"target {d['reference_token']} vs speculative {d['speculative_token']}, "
        f"top-2 gap {d['reference_top2_gap']:.4g} (tie threshold {d['tie_threshold']:.3g}): {kind}"
    )


def verdict_line(result: dict[str, Any]) -> str:
    """The summary line of the lossless check."""
    if result.get("lossless") is None:
        return "lossless: not checked (exact mode decodes nothing unless --decode-prompts N; sampling is never token-identical)"
    if result["lossless"]:
        return "lossless: yes (speculative output identical to plain greedy decoding)"
    if result["lossless_up_to_ties"]:
        return "lossless up to ties: every divergence is at a numerical near-tie of the target's top-2 logits"
    return (
        f"ERROR: speculative output differs from the target at a clear margin: bug "
        f"({result['num_clear_divergences']} divergence(s) above the tie threshold)"
    )
