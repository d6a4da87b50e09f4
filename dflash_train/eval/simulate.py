"""Host simulation of greedy speculative decoding along a known greedy continuation.

At T = 0 speculative decoding emits exactly the target's greedy continuation ``C`` of the prompt
(lossless), so the context of every round is ``prompt + C[:out]`` where ``out`` is the number of
tokens emitted so far, and the target's choice at every verified position is the next token of
``C``. A round that starts with ``out`` tokens emitted therefore accepts the longest prefix of its
drafts equal to ``C[out:]`` and advances ``out`` by accepted + 1, with no target call. What the
drafts are depends only on that context, so they can be computed before the simulation (the
drafter, batched over every candidate anchor: ``eval/exact.py``) or during it (n-gram lookup).

The bookkeeping follows ``speculative.decode`` exactly: the prefill emits ``C[0]``; a round drafts
``min(B-1, max_new_tokens - out - 1)`` tokens; the request stops at ``max_new_tokens`` or after an
EOS token, and a round stops accepting right after an EOS draft (``acceptance.stop_after_eos``).
DDTree walks the tree built from the drafter's top-K (``ddtree.build_tree``) along ``C``: the child
whose token is the next continuation token is the one the target's greedy choice would select.

``simulate_ngram(..., overlap=True)`` is the eval's method ``ngram-overlap``: the n-gram lookup with
its copy continued past the end of the text instead of padded (``copied_on``), which inside a
repetition loop of period p < B-1 proposes the loop's next B-1 tokens where ``ngram`` copies p and pads.

``simulate_ngram_then_dflash`` is the combination llama.cpp serves with ``--spec-type
ngram-simple,draft-dflash`` (its prompt lookup when that proposes a draft, the drafter's block
otherwise), simulated the same way.

Each function returns a ``speculative.Generation`` (tokens = the continuation, wall time 0), so
exact and decode mode are summarised by the same code.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch

from dflash_train.eval.ddtree import build_tree
from dflash_train.eval.ngram_simple import NgramSimpleIndex
from dflash_train.eval.speculative import Generation
from dflash_train.models.variant import drafted_tokens

# out -> the B-1 draft tokens of the round that starts with ``out`` tokens emitted.
DraftFn = Callable[[int], Sequence[int]]


def request_limit(continuation: Sequence[int], max_new_tokens: int, eos: Collection[int]) -> int:
    """The ``max_new_tokens`` the continuation was generated under, as far as it can tell.

    A continuation that stops without EOS before ``max_new_tokens`` was generated with a smaller
    limit; simulating past its end would compare drafts against tokens that do not exist.
    """
    if continuation and continuation[-1] in eos:
        return max_new_tokens
    return min(max_new_tokens, len(continuation))


def simulate_rounds(
    continuation: Sequence[int],
    max_new_tokens: int,
    eos: Collection[int],
    block_size: int,
    accept: Callable[[int, int], tuple[int, int]],
) -> Generation:
    """The round loop every simulation shares (chain, tree, lookup first, scripts/lookup_rules.py):
    ``accept(out, max_drafts) -> (drafted, accepted)``."""
    limit = request_limit(continuation, max_new_tokens, eos)
    gen = Generation(tokens=list(continuation[:limit]))
    out = 1
    # A round that accepts an EOS draft ends past it (out > len): the request is over.
    while out < limit and out <= len(continuation) and continuation[out - 1] not in eos:
        num_drafted, num_accepted = accept(out, min(block_size - 1, limit - out - 1))
        gen.num_drafted.append(num_drafted)
        gen.num_accepted.append(num_accepted)
        out += num_accepted + 1
    return gen


def matched_prefix(draft: Sequence[int], continuation: Sequence[int], out: int, eos: Collection[int]) -> int:
    """How many of ``draft`` equal ``continuation[out:]``, stopping right after an accepted EOS."""
    accepted = 0
    while (
        accepted < len(draft)
        and out + accepted < len(continuation)
        and draft[accepted] == continuation[out + accepted]
    ):
        accepted += 1
        if draft[accepted - 1] in eos:
            break
    return accepted


def simulate_chain(
    continuation: Sequence[int],
    drafts_at: DraftFn,
    *,
    block_size: int,
    max_new_tokens: int,
    eos_token_ids: Collection[int],
) -> Generation:
    """Chain speculative decoding of one request, from the drafts each round would propose."""

    def accept(out: int, max_drafts: int) -> tuple[int, int]:
        draft = drafted_tokens(list(drafts_at(out))[:max_drafts])  # a block stopped early drafts fewer
        return len(draft), matched_prefix(draft, continuation, out, eos_token_ids)

    return simulate_rounds(continuation, max_new_tokens, eos_token_ids, block_size, accept)


def simulate_tree(
    continuation: Sequence[int],
    topk_at: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    *,
    block_size: int,
    budget: int,
    max_new_tokens: int,
    eos_token_ids: Collection[int],
) -> Generation:
    """DDTree decoding of one request: ``topk_at(out)`` gives the ``[B-1, K]`` top-k tokens and
    log-probs of the round's drafter pass; the tree is walked along the continuation."""

    def accept(out: int, max_drafts: int) -> tuple[int, int]:
        tokens, logprobs = topk_at(out)
        tree = build_tree(continuation[out - 1], tokens, logprobs, budget, max_depth=max_drafts)
        kids, node, accepted = tree.children(), 0, 0
        while out + accepted < len(continuation) and continuation[out + accepted] in kids[node]:
            node = kids[node][continuation[out + accepted]]
            accepted += 1
            if continuation[out + accepted - 1] in eos_token_ids:
                break
        return max(tree.depths), accepted

    return simulate_rounds(continuation, max_new_tokens, eos_token_ids, block_size, accept)


class NgramIndex:
    """Prompt lookup over a growing sequence, identical to ``NgramProposer.lookup`` at every prefix.

    ``NgramProposer.lookup`` scans backwards for the most recent earlier match of the last n
    (then n-1, ..., 1) tokens: O(length) per round. Here every n-gram that lies entirely before the
    last token is kept in a dict (size -> n-gram -> latest start), extended as the sequence grows,
    so a lookup costs n dict probes.
    """

    def __init__(self, ids: Sequence[int], n: int):
        self.ids, self.n = list(ids), n
        self.latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(n + 1)]
        self.indexed = 0  # n-grams ending before this index are in ``latest``

    def lookup(self, length: int, max_tokens: int) -> list[int]:
        """The continuation the proposer finds for ``ids[:length]`` (empty if no match): what followed
        the most recent earlier occurrence of its longest recurring suffix of n .. 1 tokens."""
        source = self.source(length)
        return [] if source is None else self.ids[source : min(source + max_tokens, length)]

    def source(self, length: int, starts: list[dict[tuple[int, ...], int]] | None = None) -> int | None:
        """Where that continuation starts in ``ids`` (None: no match); ``starts`` (size -> n-gram ->
        start, default the latest) picks which earlier occurrence."""
        self._index_until(length - 1)
        for size in range(min(self.n, length - 1), 0, -1):
            start = (starts or self.latest)[size].get(tuple(self.ids[length - size : length]))
            if start is not None:
                return start + size
        return None

    def _index_until(self, end: int) -> None:
        assert end >= self.indexed, "NgramIndex only grows: look up increasing lengths"
        for stop in range(self.indexed + 1, end + 1):
            for size in range(1, self.n + 1):
                if stop - size >= 0:
                    self.latest[size][tuple(self.ids[stop - size : stop])] = stop - size
        self.indexed = max(self.indexed, end)

    def propose(self, length: int, block_size: int) -> list[int]:
        """``NgramProposer.propose`` for ``ids[:length]``: B-1 tokens, padded with the last one."""
        return padded_block(self.lookup(length, block_size - 1) or [self.ids[length - 1]], block_size)

    def propose_copied_on(self, length: int, block_size: int) -> list[int]:
        """``propose`` from the same match, its copy continued past the end of ``ids[:length]``
        instead of padded (``copied_on``); without a match the same fallback, the last token
        padded. Where the match lies at least B-1 tokens back the two are the same draft."""
        source = self.source(length)
        if source is None:
            return padded_block([self.ids[length - 1]], block_size)
        return copied_on(self.ids, length, source, block_size - 1)


def padded_block(span: Sequence[int], block_size: int) -> list[int]:
    """A non-empty proposed span as B-1 draft tokens, padded by repeating its last token (as
    ``NgramProposer`` pads)."""
    return [*span, *[span[-1]] * (block_size - 1 - len(span))]


def copied_on(ids: Sequence[int], length: int, source: int, count: int) -> list[int]:
    """``count`` tokens copied from ``ids[source:]`` as continuing ``ids[:length]``: past the end the
    copy reads what it has itself appended (an overlapping copy; in a loop of period p, token k is
    the one p back)."""
    span = list(ids[source:length])
    for k in range(count):
        span.append(span[k])
    return span[length - source :]


def simulate_ngram(
    prompt: Sequence[int],
    continuation: Sequence[int],
    *,
    n: int,
    block_size: int,
    max_new_tokens: int,
    eos_token_ids: Collection[int],
    overlap: bool = False,
) -> Generation:
    """n-gram prompt lookup: each round proposes from ``prompt + continuation[:out]``; ``overlap``
    copies on past the end of the text instead of padding (method ``ngram-overlap``)."""
    index = NgramIndex([*prompt, *continuation], n)
    propose = index.propose_copied_on if overlap else index.propose
    return simulate_chain(
        continuation,
        lambda out: propose(len(prompt) + out, block_size),
        block_size=block_size,
        max_new_tokens=max_new_tokens,
        eos_token_ids=eos_token_ids,
    )


def simulate_ngram_then_dflash(
    prompt: Sequence[int],
    continuation: Sequence[int],
    drafts_at: DraftFn,
    *,
    key_size: int,
    block_size: int,
    max_new_tokens: int,
    eos_token_ids: Collection[int],
    max_draft: int = 0,
) -> Generation:
    """Prompt lookup first, the drafter otherwise (method ``ngram+dflash``), by llama.cpp's rule for
    ``--spec-type ngram-simple,draft-dflash`` (``eval/ngram_simple.py``).

    A round drafts ``ngram-simple``'s proposal for ``prompt + C[:out]`` (key size ``key_size``, at
    most ``max_draft`` tokens, 0 = B-1; between ``key_size`` and ``max_draft`` tokens, unpadded) when
    there is one, and the drafter's block ``drafts_at(out)`` otherwise; either is cut to the tokens
    the request has left, minus one. A lookup round drafts (and can accept) more than B-1 tokens
    when ``max_draft`` > B-1.
    """
    max_draft = max_draft or block_size - 1
    index = NgramSimpleIndex([*prompt, *continuation], key_size, max_draft)

    def accept(out: int, max_drafts: int) -> tuple[int, int]:
        draft = index.draft(len(prompt) + out) or drafted_tokens(list(drafts_at(out))[: block_size - 1])
        draft = draft[:max_drafts]
        return len(draft), matched_prefix(draft, continuation, out, eos_token_ids)

    widest = max(block_size, max_draft + 1)  # the round: the last token and the longest draft
    return simulate_rounds(continuation, max_new_tokens, eos_token_ids, widest, accept)


def round_starts(generation: Generation) -> list[int]:
    """``out`` (tokens emitted before it) of every round of a simulated or decoded request."""
    starts, out = [], 1
    for accepted in generation.num_accepted:
        starts.append(out)
        out += accepted + 1
    return starts
