"""Acceptance numbers of a list of requests, the same for exact (simulated) and decoded rounds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dflash_train.eval.speculative import Generation


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, 0 when the denominator is 0."""
    return numerator / denominator if denominator else 0.0


def summarize_rounds(generations: Sequence[Generation], block_size: int) -> dict[str, Any]:
    """tau, per-position acceptance, acceptance-length histogram, rounds and tokens.

    tau: per request the mean of accepted + 1 over its rounds, then the mean over requests that
    had at least one round (a request that ended right after prefill, e.g. an immediate EOS, has
    no tau). per_position_acceptance[k-1]: among rounds that drafted position k, the fraction that
    accepted it. Both lists cover block positions 1..B-1, or up to the longest draft where a round
    drafted more (``ngram+dflash``'s lookup rounds may: ``simulate.simulate_ngram_then_dflash``).
    """
    accepted = [a for g in generations for a in g.num_accepted]
    drafted = [d for g in generations for d in g.num_drafted]
    block_size = max([block_size, *(d + 1 for d in drafted)])
    with_rounds = [g for g in generations if g.num_rounds > 0]
    return {
        "tau": sum(g.tau for g in with_rounds) / len(with_rounds) if with_rounds else None,
        "per_position_acceptance": [
            ratio(sum(a >= k for a in accepted), sum(d >= k for d in drafted)) for k in range(1, block_size)
        ],
        "accept_length_histogram": [sum(a == n for a in accepted) for n in range(block_size)],
        "rounds": len(accepted),
        "tokens": sum(len(g.tokens) for g in generations),
        "per_request_tau": [g.tau if g.num_rounds else None for g in generations],
    }
