"""The eval's ``ngram-overlap``: the n-gram lookup's match copied on past the end of the text instead
of padded. In a loop of period p < B-1 it drafts the loop's next B-1 tokens where ``ngram`` copies p
and pads; where the match lies at least B-1 tokens back the two draft the same tokens.
"""

from __future__ import annotations

import random

from dflash_train.eval.proposers import NgramProposer
from dflash_train.eval.simulate import NgramIndex, simulate_ngram

EOS = 2


def run(prompt, continuation, *, overlap: bool, block_size: int = 16, max_new_tokens: int = 64):
    return simulate_ngram(
        prompt, continuation, n=3, block_size=block_size, max_new_tokens=max_new_tokens,
        eos_token_ids={EOS}, overlap=overlap,
    )  # fmt: skip


def overlapping_copy(ids: list[int], block_size: int) -> list[int]:
    """The direct-search reference: what followed the proposer's match, repeated to B-1 tokens (the
    copy reads what it appended, so it cycles through that span); no match: the last token."""
    span = NgramProposer(3).lookup(ids, len(ids)) or [ids[-1]]
    return [span[k % len(span)] for k in range(block_size - 1)]


def test_in_a_loop_of_period_3_the_overlapping_copy_drafts_whole_blocks():
    """Prompt [10, 11, 12], reply the same 3 tokens 11 times then EOS, block 16 (15 drafts).

    ``ngram``: the match of the last tokens lies 3 back, so a round copies 3 loop tokens and pads with
    the third; the loop's next token is not that one, so every round accepts 3 (out 1, 5, ..., 29),
    and the round at 33 drafts against the EOS and accepts 0: tau = (8 * 4 + 1) / 9 = 33 / 9.
    ``ngram-overlap``: the same match copied on is the loop's next 15 tokens: rounds at 1 and 17
    accept 15, the round at 33 accepts 0: tau = (16 + 16 + 1) / 3 = 11."""
    prompt, reply = [10, 11, 12], [*[10, 11, 12] * 11, EOS]
    padded, copied = run(prompt, reply, overlap=False), run(prompt, reply, overlap=True)
    assert padded.num_accepted == [3] * 8 + [0] and padded.tau == 33 / 9
    assert copied.num_accepted == [15, 15, 0] and copied.tau == 11.0
    assert copied.tokens == padded.tokens == reply


def test_outside_loops_the_overlapping_copy_is_the_ngram_lookup():
    """A reply that repeats a 30-token span of its prompt (each match 30 back, more than B-1): the two
    methods accept the same rounds, with lookup in play (whole blocks accepted)."""
    span = list(range(10, 40))
    prompt, reply = [3, *span, 4, 5], [6, 7, *span, 8, 9, EOS]
    padded, copied = run(prompt, reply, overlap=False), run(prompt, reply, overlap=True)
    assert copied.num_accepted == padded.num_accepted and max(padded.num_accepted) == 15


def test_the_overlapping_copy_is_the_cycled_match_and_the_padded_one_where_the_match_is_far():
    """At every prefix of random sequences: ``propose_copied_on`` is the direct-search reference, and
    equals ``propose`` wherever no match exists or the match lies at least B-1 tokens back."""
    rng = random.Random(0)
    block_size, num_far, num_differ = 6, 0, 0
    for _ in range(40):
        ids = [rng.randrange(4) for _ in range(rng.randint(2, 60))]
        index = NgramIndex(ids, 3)
        for length in range(1, len(ids) + 1):
            copied = index.propose_copied_on(length, block_size)
            assert copied == overlapping_copy(ids[:length], block_size)
            source = index.source(length)
            if source is None or length - source >= block_size - 1:
                num_far += 1
                assert copied == index.propose(length, block_size)
            else:
                num_differ += copied != index.propose(length, block_size)
    assert num_far > 100 and num_differ > 100  # both kinds of prefix occur
