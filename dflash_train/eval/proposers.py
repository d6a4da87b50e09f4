"""Draft proposers: who guesses the next B-1 tokens each speculative round.

The decode loop (``speculative.py``) only talks to the ``Proposer`` interface, so it is tested with
proposers whose behaviour is known exactly (``OracleProposer`` is always right, ``WrongProposer``
always wrong) before any trained drafter exists, and the n-gram baseline and the DFlash drafter
plug into the same loop.

Protocol per request: ``start(prompt_ids)``, then once per round
``propose(accepted_ids, new_features, block_size)`` where ``accepted_ids`` is prompt + output so
far (its last token is the freshly chosen bonus token, which the target has not run yet) and
``new_features[P_new, n*H]`` are the target features of the positions committed since the previous
call (all prompt positions on the first call; None when the proposer needs no features). Drafts
never enter a proposer's state, so no rollback hook is needed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash_train.models.variant import DEFAULT_VARIANT, drafted_tokens, get_variant


@dataclass
class Draft:
    """B-1 draft tokens; ``probs[B-1, V]`` is the distribution they were sampled from, or None when
    the proposer is deterministic (rejection sampling then treats q as one-hot)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


class Proposer(ABC):
    """Proposes the block after the last accepted token. Subclasses that can rank alternatives
    implement ``propose_topk`` (needed by DDTree)."""

    def start(self, prompt_ids: Sequence[int]) -> None:
        """Reset per-request state (stateless proposers need nothing)."""
        return None

    @abstractmethod
    def propose(
        self, accepted_ids: Sequence[int], new_features: torch.Tensor | None, block_size: int
    ) -> Draft:
        """B-1 draft tokens for positions len(accepted_ids) .. len(accepted_ids)+B-2."""

    def propose_topk(
        self, accepted_ids: Sequence[int], new_features: torch.Tensor | None, block_size: int, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per draft position the top-k tokens and their log-probs, best first: two ``[B-1, k]`` tensors."""
        raise NotImplementedError(
            f"{type(self).__name__} has no token distribution; DDTree needs top-k log-probs"
        )


class NgramProposer(Proposer):
    """Prompt lookup: find the most recent earlier occurrence of the last n (then n-1, ..., 1) tokens
    in prompt + generated text and propose what followed it; pad by repeating the last proposed token."""

    def __init__(self, n: int = 3):
        if n < 1:
            raise ValueError(f"ngram n={n}: use n >= 1")
        self.n = n

    def propose(
        self, accepted_ids: Sequence[int], new_features: torch.Tensor | None, block_size: int
    ) -> Draft:
        ids = list(accepted_ids)
        continuation = self.lookup(ids, block_size - 1)
        if not continuation:
            continuation = [ids[-1]]
        pad = [continuation[-1]] * (block_size - 1 - len(continuation))
        return Draft(tokens=continuation + pad)

    def lookup(self, ids: list[int], max_tokens: int) -> list[int]:
        """Continuation of the longest suffix n-gram's most recent earlier match (empty if none)."""
        for size in range(min(self.n, len(ids) - 1), 0, -1):
            pattern = ids[-size:]
            # An earlier match must end before the suffix itself ends, hence start <= len - size - 1.
            for start in range(len(ids) - size - 1, -1, -1):
                if ids[start : start + size] == pattern:
                    return ids[start + size : start + size + max_tokens]
        return []


class OracleProposer(Proposer):
    """Knows the target's continuation (prompt + greedy output) and proposes it: always accepted at T=0.

    For DDTree tests ``propose_topk`` puts the true token at rank ``truth_ranks[k % len]`` for draft
    position k, the other ranks filled with other tokens, so a tree must branch to find it.
    """

    def __init__(self, reference_ids: Sequence[int], vocab_size: int, truth_ranks: Sequence[int] = (0,)):
        self.reference = list(reference_ids)
        self.vocab_size = vocab_size
        self.truth_ranks = list(truth_ranks)

    def _truth(self, position: int) -> int:
        return self.reference[position] if position < len(self.reference) else 0

    def propose(
        self, accepted_ids: Sequence[int], new_features: torch.Tensor | None, block_size: int
    ) -> Draft:
        start = len(accepted_ids)
        return Draft(tokens=[self._truth(start + k) for k in range(block_size - 1)])

    def propose_topk(self, accepted_ids, new_features, block_size, k):
        tokens = torch.empty(block_size - 1, k, dtype=torch.long)
        for d in range(block_size - 1):
            truth = self._truth(len(accepted_ids) + d)
            others = [(truth + 1 + j) % self.vocab_size for j in range(k - 1)]
            rank = min(self.truth_ranks[d % len(self.truth_ranks)], k - 1)
            tokens[d] = torch.tensor(others[:rank] + [truth] + others[rank:])
        return tokens, ranked_logprobs(block_size - 1, k)


class WrongProposer(OracleProposer):
    """Always proposes a token different from the target's greedy choice: nothing is ever accepted."""

    def propose(self, accepted_ids, new_features, block_size):
        truth = super().propose(accepted_ids, new_features, block_size).tokens
        return Draft(tokens=[(t + 1) % self.vocab_size for t in truth])


class RandomProposer(Proposer):
    """Uniformly random drafts (and random top-k trees) from a seeded generator."""

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, accepted_ids, new_features, block_size):
        return Draft(
            tokens=torch.randint(self.vocab_size, (block_size - 1,), generator=self.generator).tolist()
        )

    def propose_topk(self, accepted_ids, new_features, block_size, k):
        tokens = torch.stack(
            [torch.randperm(self.vocab_size, generator=self.generator)[:k] for _ in range(block_size - 1)]
        )
        return tokens, ranked_logprobs(block_size - 1, k)


def ranked_logprobs(num_positions: int, k: int) -> torch.Tensor:
    """Made-up descending log-probs (a confident distribution: rank 0 far ahead of rank 1, so a
    best-first tree grows the rank-0 chain first) for proposers without a real distribution."""
    ranked = torch.log_softmax(-2.0 * torch.arange(k, dtype=torch.float32), dim=0)
    return ranked.expand(num_positions, k).clone()


class DFlashProposer(Proposer):
    """The trained drafter: block ``[last token, MASK * (B-1)]`` at position start = position of the
    last token, attending to the cached context features of all positions < start; the target's
    frozen LM head and the drafter's variant turn the block's hidden states into its drafts
    (``draft_tokens``: argmax, DFlash2's selector walk or DSpark's Markov chain).

    ``drafter`` implements the inference contract of docs/CONTRACTS.md: ``new_context_cache()``,
    ``extend_context(cache, features[1, P, n*H])``,
    ``forward_block(block_ids[1, B], start, cache, embed_tokens) -> hidden[1, B, H]`` and, for a
    variant, ``draft_tokens(hidden[M, B, H], first_ids[M], lm_head) -> drafts[M, D]`` (without it:
    the argmax of the LM head at block positions 1..B-1). The decode loop's
    ``block_size`` is the round width D + 1 (``config.num_verify_tokens``: B, or B + 1 for DSpark).
    """

    def __init__(self, drafter, target_embed, target_lm_head, block_size: int, mask_token_id: int):
        self.drafter = drafter
        self.embed = target_embed
        self.lm_head = target_lm_head
        self.block_size = block_size
        self.round_size = getattr(getattr(drafter, "config", None), "num_verify_tokens", block_size)
        self.mask_token_id = mask_token_id
        self.cache = None
        self.num_context = 0

    def start(self, prompt_ids: Sequence[int]) -> None:
        self.cache = self.drafter.new_context_cache()
        self.num_context = 0

    @torch.no_grad()
    def block_hidden(self, accepted_ids: Sequence[int], new_features: torch.Tensor | None) -> torch.Tensor:
        """The drafter's hidden states ``[1, B, H]`` of the block after the last accepted token."""
        if new_features is not None and new_features.shape[0] > 0:
            self.drafter.extend_context(self.cache, new_features.unsqueeze(0).to(self._feature_dtype()))
            self.num_context += new_features.shape[0]
        start = len(accepted_ids) - 1
        # The bonus token has no target feature yet: the context must end right before it.
        assert self.num_context == start, (
            f"drafter context has {self.num_context} positions, block starts at {start}"
        )
        block = torch.full(
            (1, self.block_size), self.mask_token_id, dtype=torch.long, device=self.embed.weight.device
        )
        block[0, 0] = accepted_ids[-1]
        return self.drafter.forward_block(block, start, self.cache, self.embed)

    def block_logits(self, accepted_ids: Sequence[int], new_features: torch.Tensor | None) -> torch.Tensor:
        """Draft logits ``[B-1, V]`` (float32) of the parallel head for the block after the last token."""
        hidden = self.block_hidden(accepted_ids, new_features)
        return self.lm_head(hidden[0, 1:].to(self.lm_head.weight.dtype)).float()

    def _feature_dtype(self) -> torch.dtype:
        param = next(iter(self.drafter.parameters()), None) if hasattr(self.drafter, "parameters") else None
        return param.dtype if param is not None else self.embed.weight.dtype

    def _check_block_size(self, block_size: int) -> None:
        if block_size != self.round_size:
            raise ValueError(
                f"the drafter was trained with block size {self.block_size} ({self.round_size - 1} drafts per "
                f"round), the loop asked for rounds of {block_size}"
            )

    def propose(self, accepted_ids, new_features, block_size):
        self._check_block_size(block_size)
        hidden = self.block_hidden(accepted_ids, new_features)
        if not hasattr(self.drafter, "draft_tokens"):  # the DFlash contract: argmax of the LM head
            return Draft(tokens=self.lm_head(hidden[0, 1:].to(self.lm_head.weight.dtype)).argmax(-1).tolist())
        first = torch.tensor([accepted_ids[-1]], device=hidden.device)
        drafts = self.drafter.draft_tokens(hidden, first, self.lm_head)[0].tolist()
        return Draft(tokens=drafted_tokens(drafts))  # a block stopped early drafts fewer

    def propose_topk(self, accepted_ids, new_features, block_size, k):
        self._check_block_size(block_size)
        variant = get_variant(getattr(self.drafter.config, "variant", DEFAULT_VARIANT))
        if not variant.drafts_by_head_argmax:
            raise NotImplementedError(
                f"DDTree top-k is the parallel head's; a {variant.name} drafter drafts with "
                f"{variant.drafting_procedure}"
            )
        logprobs = torch.log_softmax(self.block_logits(accepted_ids, new_features), dim=-1)
        top = logprobs.topk(k, dim=-1)
        return top.indices.cpu(), top.values.cpu()
