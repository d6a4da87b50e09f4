"""Which drafted tokens the target accepts, and the token it adds itself (the bonus).

Greedy (T = 0): accept the longest prefix where ``draft[k] == argmax(target logits at k)``; the
bonus is the target's argmax right after it. The output is then the target's own greedy decoding.

Sampling (T > 0): standard speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023).
Draft token x at step k, drawn from the drafter's q, is kept with probability ``min(1, p(x)/q(x))``;
on rejection the replacement is drawn from ``normalise(max(p - q, 0))`` and the round ends. A
deterministic drafter (argmax drafts) has a one-hot q, so this is "keep x with probability p(x),
otherwise sample from p with x removed". If every draft survives, the bonus is drawn from p at the
next position. Every emitted token is thereby distributed exactly as the target's own sampling.

Shapes: D drafted tokens, V vocab; target logits are ``[D+1, V]`` (one row per verified position).
"""

from __future__ import annotations

import torch


def accept_greedy(draft: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """(number of accepted draft tokens, the target's next token after them)."""
    choices = target_logits.argmax(dim=-1).tolist()  # host sync: the loop branches on it
    num_accepted = 0
    while num_accepted < len(draft) and draft[num_accepted] == choices[num_accepted]:
        num_accepted += 1
    return num_accepted, choices[num_accepted]


def stop_after_eos(tokens: list[int], num_accepted: int, eos_token_ids) -> int:
    """Accepted drafts up to and including the first EOS among them: a request ends at EOS, so
    drafts after it are never emitted and must not count as accepted."""
    for k in range(num_accepted):
        if tokens[k] in eos_token_ids:
            return k + 1
    return num_accepted


def target_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Softmax at ``temperature`` in float32 (the distribution the plain sampler uses)."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def accept_sampled(
    draft: list[int],
    target_logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> tuple[int, int]:
    """Speculative rejection sampling; ``draft_probs[D, V]`` is q, or None for a one-hot (greedy) q."""
    p = target_probs(target_logits, temperature)
    for k, token in enumerate(draft):
        p_k = p[k]
        if draft_probs is None:
            keep_prob = p_k[token]
            residual = p_k.clone()
            residual[token] = 0.0
        else:
            q_k = draft_probs[k].to(p_k)
            keep_prob = torch.clamp(p_k[token] / q_k[token], max=1.0)
            residual = torch.clamp(p_k - q_k, min=0.0)
        uniform = torch.rand((), generator=generator, device=p.device)
        if uniform < keep_prob:
            continue
        # p == q on the support makes the residual empty; rejection then had probability 0, but
        # guard against float rounding by falling back to p.
        return k, sample(residual if residual.sum() > 0 else p_k, generator)
    return len(draft), sample(p[len(draft)], generator)


def choose_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """The target's own next token from one row of logits: argmax at T = 0, else a sample."""
    if temperature <= 0:
        return int(logits.argmax())
    return sample(target_probs(logits, temperature), generator)
