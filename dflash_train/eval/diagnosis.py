"""Why a drafter's exact tau is what it is: numbers beside the sequential tau (DESIGN.md §7).

Exact mode drafts at EVERY candidate anchor of the greedy continuation ``C`` in one batched pass
(``eval/exact.py``); the sequential simulation then uses only the anchors where rounds start. The
other anchors are free, and they answer what the sequential tau alone cannot:

- ``anchors``: the training metric's definition, tau = 1 + sum_k prod_{j<=k} correct[j], teacher
  forced, over ALL anchors ``j = 0 .. len(C) - 2`` (block ``[C[j], MASK...]`` scored against
  ``C[j+1 .. j+B-1]``, positions past the continuation not scored and not correct, as out-of-row
  labels in training). On training prompts it is the training tau without anchor sampling, so
  "training tau vs this" is memorisation-free, and "this vs the sequential tau" is the
  anchor-placement gap (rounds start right after a rejection, random anchors anywhere);
- ``rounds``: the same teacher-forced numbers over the rounds the sequential simulation ran;
- ``loop`` / ``outside_loops``: those rounds split by whether n-gram prompt lookup with its copy
  continued past the text's end (the ``ngram-overlap`` method, same n) drafting at that same round
  start would have had its whole block accepted: a reproducible definition of "inside a repetition
  loop", loops of any period included (the padded ``ngram`` draft copies only p tokens of a loop of
  period p < B - 1, so it would count such a loop's rounds as outside);
- ``after_rejection`` / ``other_rounds``: rounds whose previous round rejected a draft (accepted
  fewer than it drafted), and the others (the first round, rounds after a fully accepted one).

A round that drafts nothing (the last one when a single token is left before ``max_new_tokens``)
is in ``rounds`` (as in the sequential tau) but in none of the four split groups: it is neither
inside nor outside a loop, and its tau of 1 says nothing about the drafter.

Every group is a ``BlockStats``: blocks, tau pooled over blocks (emitted tokens / blocks: the
training metric's averaging, not the per-request mean the headline tau uses) and per block position
k the teacher-forced accuracy (draft k == the continuation token there, whatever happened before
k) among blocks that scored k. Per-prompt stats add up, so any subset of prompts (a file, a rank's
shard) is summarised by summing.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_train.eval.simulate import NgramIndex, matched_prefix, request_limit, round_starts
from dflash_train.eval.speculative import Generation
from dflash_train.models.variant import NO_DRAFT

GROUPS = ("anchors", "rounds", "loop", "outside_loops", "after_rejection", "other_rounds")


@dataclass
class BlockStats:
    """Sums over a set of scored blocks: count, emitted tokens (accepted + 1 each), and per block
    position k = 1..B-1 the teacher-forced hits and the blocks that scored k."""

    num_positions: int
    blocks: int = 0
    emitted: int = 0
    correct: list[int] = field(default_factory=list)
    scored: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.correct = self.correct or [0] * self.num_positions
        self.scored = self.scored or [0] * self.num_positions

    def add(self, draft: Sequence[int], truth: Sequence[int], accepted: int) -> None:
        """One block: ``draft[k-1]`` scored against ``truth[k-1]`` for k = 1..len(truth)."""
        for k, (d, t) in enumerate(zip(draft, truth, strict=False)):
            self.scored[k] += 1
            self.correct[k] += int(d == t)
        self.blocks += 1
        self.emitted += accepted + 1

    def add_anchors(self, drafts: torch.Tensor, continuation: Sequence[int], length: int) -> None:
        """Every anchor j of ``drafts[A, B-1]`` at once: draft k against ``continuation[j + k]``,
        scored where ``j + k < length`` (the training metric's in-row labels) and draft k exists."""
        num_anchors = min(drafts.shape[0], max(length - 1, 0))
        if num_anchors == 0:
            return
        drafts = drafts[:num_anchors].long()
        positions = torch.arange(num_anchors)[:, None] + torch.arange(1, self.num_positions + 1)  # [A, K]
        scored = (positions < length) & (drafts != NO_DRAFT)  # a stopped block drafts no slot after it
        # truth[j, k-1] = continuation[j + k]; the padding is never scored (windows, not indexing:
        # advanced indexing costs milliseconds here on CPU).
        padded = torch.tensor([*continuation[:length], *[0] * self.num_positions], dtype=torch.long)
        truth = padded.unfold(0, self.num_positions, 1)[1 : num_anchors + 1]
        correct = (drafts == truth) & scored
        leading = correct.long().cumprod(dim=-1).sum(-1)  # prod_{j<=k} correct[j], summed over k
        self.blocks += num_anchors
        self.emitted += int((leading + 1).sum())
        self.correct = [a + b for a, b in zip(self.correct, correct.sum(0).tolist(), strict=True)]
        self.scored = [a + b for a, b in zip(self.scored, scored.sum(0).tolist(), strict=True)]

    def merge(self, other: BlockStats) -> BlockStats:
        """The sum of two sets of blocks (a new object)."""
        return BlockStats(
            self.num_positions,
            self.blocks + other.blocks,
            self.emitted + other.emitted,
            [a + b for a, b in zip(self.correct, other.correct, strict=True)],
            [a + b for a, b in zip(self.scored, other.scored, strict=True)],
        )

    def summary(self) -> dict[str, Any]:
        """``blocks``, ``tau`` (None without blocks) and ``accuracy_by_pos`` (None where no block
        scored that position)."""
        return {
            "blocks": self.blocks,
            "tau": self.emitted / self.blocks if self.blocks else None,
            "accuracy_by_pos": [c / s if s else None for c, s in zip(self.correct, self.scored, strict=True)],
        }


def diagnose_request(
    prompt: Sequence[int],
    continuation: Sequence[int],
    drafts: torch.Tensor | Sequence[Sequence[int]],
    generation: Generation,
    *,
    ngram_n: int,
    block_size: int,
    max_new_tokens: int,
    eos_token_ids: Collection[int],
) -> dict[str, BlockStats]:
    """Every ``GROUPS`` entry of one request. ``drafts[j]`` are the drafter's B-1 tokens at anchor j
    (the round that starts with j + 1 tokens emitted; ``AnchorDrafts.tokens``, ``[A, B-1]``),
    ``generation`` the DFlash chain's simulated rounds on ``continuation``."""
    table = torch.as_tensor(drafts, dtype=torch.long).view(-1, block_size - 1)
    stats = {name: BlockStats(block_size - 1) for name in GROUPS}
    length = min(request_limit(continuation, max_new_tokens, eos_token_ids), len(continuation))
    stats["anchors"].add_anchors(table, continuation, length)
    drafts = table.tolist()
    index = NgramIndex([*prompt, *continuation], ngram_n)
    rejected_before = False
    for out, drafted, accepted in zip(
        round_starts(generation), generation.num_drafted, generation.num_accepted, strict=True
    ):
        draft, truth = drafts[out - 1][:drafted], continuation[out : out + drafted]
        ngram_draft = index.propose_copied_on(len(prompt) + out, block_size)[:drafted]
        in_loop = matched_prefix(ngram_draft, continuation, out, eos_token_ids) == drafted
        stats["rounds"].add(draft, truth, accepted)
        if drafted > 0:
            stats["loop" if in_loop else "outside_loops"].add(draft, truth, accepted)
            stats["after_rejection" if rejected_before else "other_rounds"].add(draft, truth, accepted)
        rejected_before = accepted < drafted
    return stats


def merge_requests(requests: Sequence[dict[str, BlockStats]], block_size: int) -> dict[str, BlockStats]:
    """The ``GROUPS`` of several requests added up."""
    total = {name: BlockStats(block_size - 1) for name in GROUPS}
    for request in requests:
        total = {name: total[name].merge(request[name]) for name in GROUPS}
    return total


def summarize_diagnosis(requests: Sequence[dict[str, BlockStats]], block_size: int) -> dict[str, Any]:
    """The JSON numbers of a set of requests: ``random_anchor_tau``, ``pooled_round_tau``,
    ``loop_round_fraction``, ``tau_in_loops``, ``tau_outside_loops``, and every group's summary."""
    total = merge_requests(requests, block_size)
    groups = {name: stats.summary() for name, stats in total.items()}
    loop, outside = total["loop"].blocks, total["outside_loops"].blocks
    return {
        "random_anchor_tau": groups["anchors"]["tau"],
        "pooled_round_tau": groups["rounds"]["tau"],
        "loop_round_fraction": loop / (loop + outside) if loop + outside else None,
        "tau_in_loops": groups["loop"]["tau"],
        "tau_outside_loops": groups["outside_loops"]["tau"],
        "groups": groups,
    }
