"""The speculative decode loop (DESIGN.md §1, Inference) and plain decoding as its reference.

Prefill the target on the prompt; the target's own choice at the last prompt position is the first
output token. Each round: the proposer drafts B-1 tokens after the last token (the bonus), ONE
target forward runs ``[last token, drafts...]``, the longest agreeing prefix is accepted (greedy or
rejection sampling, ``acceptance.py``), the target's own next token is appended as the new bonus,
and the target's cache is rolled back to the accepted prefix. A round therefore emits
accepted + 1 tokens; tau for a request is the mean of that over its rounds.

Near ``max_new_tokens`` a round drafts only ``remaining - 1`` tokens, so the output never overshoots;
with ``max_new_tokens = 1 + m*B`` every round is full. Stops at ``max_new_tokens`` or an EOS token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch

from dflash_train.eval.acceptance import accept_greedy, accept_sampled, choose_token, stop_after_eos
from dflash_train.eval.proposers import Proposer
from dflash_train.eval.target_session import TargetSession


@dataclass
class Round:
    """What one round produced: ``tokens`` (accepted drafts + bonus) and the target features of the
    positions it committed (the previous bonus and the accepted drafts), for the proposer."""

    tokens: list[int]
    num_drafted: int
    num_accepted: int
    new_features: torch.Tensor | None


@dataclass
class Generation:
    """One request's output and acceptance record."""

    tokens: list[int] = field(default_factory=list)
    num_drafted: list[int] = field(default_factory=list)  # per round
    num_accepted: list[int] = field(default_factory=list)  # per round
    wall_s: float = 0.0

    @property
    def num_rounds(self) -> int:
        return len(self.num_accepted)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per round (accepted + 1); 0 when no round ran."""
        return sum(a + 1 for a in self.num_accepted) / max(self.num_rounds, 1)


RoundFn = Callable[[TargetSession, Proposer | None, list[int], torch.Tensor | None, int], Round]


def decode(
    session: TargetSession,
    prompt_ids: Sequence[int],
    run_round: RoundFn,
    *,
    proposer: Proposer | None = None,
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_ids: Collection[int] = (),
    generator: torch.Generator | None = None,
) -> Generation:
    """Prefill, then ``run_round`` until ``max_new_tokens`` or EOS. Wall time includes the prefill."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: use >= 1")
    _synchronize(session.device)  # earlier queued GPU work (a previous request) must not count here
    started = time.perf_counter()
    if proposer is not None:
        proposer.start(prompt_ids)
    prefill = session.prefill(torch.tensor(prompt_ids, dtype=torch.long))
    ids = [*prompt_ids, choose_token(prefill.logits[-1], temperature, generator)]
    new_features = prefill.features
    gen = Generation()
    while not _finished(ids[len(prompt_ids) :], max_new_tokens, eos_token_ids):
        remaining = max_new_tokens - (len(ids) - len(prompt_ids))
        result = run_round(session, proposer, ids, new_features, remaining)
        ids += result.tokens
        new_features = result.new_features
        gen.num_drafted.append(result.num_drafted)
        gen.num_accepted.append(result.num_accepted)
    gen.tokens = _truncate_at_eos(ids[len(prompt_ids) :], eos_token_ids)
    _synchronize(session.device)
    gen.wall_s = time.perf_counter() - started
    return gen


def chain_round(
    session: TargetSession,
    proposer: Proposer,
    ids: list[int],
    new_features: torch.Tensor | None,
    remaining: int,
    *,
    block_size: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    eos_token_ids: Collection[int] = (),
) -> Round:
    """One chain round: draft B-1, verify ``[last, drafts]`` in one forward, accept, commit."""
    draft = proposer.propose(ids, new_features, block_size)
    num_drafts = min(block_size - 1, remaining - 1)
    tokens = draft.tokens[:num_drafts]
    verified = session.verify(torch.tensor([ids[-1], *tokens], dtype=torch.long))
    if temperature <= 0:
        num_accepted, bonus = accept_greedy(tokens, verified.logits)
    else:
        probs = None if draft.probs is None else draft.probs[:num_drafts]
        num_accepted, bonus = accept_sampled(tokens, verified.logits, temperature, generator, probs)
    num_accepted = stop_after_eos(tokens, num_accepted, eos_token_ids)  # the bonus is then past EOS
    session.commit(num_accepted + 1)
    features = None if verified.features is None else verified.features[: num_accepted + 1]
    # A proposer may draft fewer than B-1 tokens (prompt lookup with a short match): count those drafted.
    return Round(tokens[:num_accepted] + [bonus], len(tokens), num_accepted, features)


def plain_round(
    session: TargetSession,
    proposer: Proposer | None,
    ids: list[int],
    new_features: torch.Tensor | None,
    remaining: int,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> Round:
    """Plain autoregressive decoding: one target forward per token (the reference and the baseline)."""
    verified = session.verify(torch.tensor([ids[-1]], dtype=torch.long))
    session.commit(1)
    return Round([choose_token(verified.logits[-1], temperature, generator)], 0, 0, None)


def speculative_generate(
    session: TargetSession,
    proposer: Proposer,
    prompt_ids: Sequence[int],
    *,
    block_size: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_ids: Collection[int] = (),
    generator: torch.Generator | None = None,
) -> Generation:
    """Chain speculative decoding of one request."""
    if block_size < 2:
        raise ValueError(f"block_size={block_size}: use >= 2 (the last token plus at least one draft)")

    def run_round(session, proposer, ids, new_features, remaining):
        return chain_round(
            session,
            proposer,
            ids,
            new_features,
            remaining,
            block_size=block_size,
            temperature=temperature,
            generator=generator,
            eos_token_ids=eos_token_ids,
        )

    return decode(
        session,
        prompt_ids,
        run_round,
        proposer=proposer,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        eos_token_ids=eos_token_ids,
        generator=generator,
    )


def plain_generate(
    session: TargetSession,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_ids: Collection[int] = (),
    generator: torch.Generator | None = None,
) -> Generation:
    """The target's own decoding, one token per forward, with the same cache code as verification."""

    def run_round(session, proposer, ids, new_features, remaining):
        return plain_round(
            session, proposer, ids, new_features, remaining, temperature=temperature, generator=generator
        )

    return decode(
        session,
        prompt_ids,
        run_round,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        eos_token_ids=eos_token_ids,
        generator=generator,
    )


def _finished(output: list[int], max_new_tokens: int, eos_token_ids: Collection[int]) -> bool:
    return len(output) >= max_new_tokens or any(t in eos_token_ids for t in output)


def _truncate_at_eos(output: list[int], eos_token_ids: Collection[int]) -> list[int]:
    for i, token in enumerate(output):
        if token in eos_token_ids:
            return output[: i + 1]
    return output


def _synchronize(device: torch.device) -> None:
    # Timing must include queued GPU work; the loop already syncs each round, this covers the ends.
    if device.type == "cuda":
        torch.cuda.synchronize(device)
