"""Top-p (nucleus) draws by an exact threshold (searched without a sort inside the compiled decode
step, read off one sort eagerly), then inverse-CDF sampling in token-id order.

The nucleus is defined by the sorted order (probabilities descending, ties by token id): a token is
in it when the mass before it in that order is below ``top_p``, so the most likely token always is.
That set is a prefix of the order, hence "every token above one threshold probability, plus the
first few tokens, by id, tied at it". Every step is a fixed-shape tensor operation without host
syncs, so the draw can be captured in the decode step's CUDA graph:

- **Integer masses.** A probability ``p`` weighs ``floor(p * 2**60)`` (``masses``). Sums of these
  integers are exact in any order, so the threshold found, and the token drawn, are the same on CPU
  and GPU, compiled or eager, in any batch (a token below 2**-60 is never drawn; the old float32
  cumsum rounded the masses at ~1e-7 instead, so a nucleus boundary within that of ``top_p`` can
  come out differently than before).
- **Threshold search.** Non-negative float32s order like their int32 bit patterns, and a
  probability's pattern lies in [0, 2**30). The threshold is the smallest pattern ``b`` whose mass
  strictly above it is below the limit. Compiled, it is found digit by digit: 10 rounds of 7 masked
  sums over the vocabulary (the sums of a round read the same tensor, so the compiler fuses them into
  one pass; no sort). Eagerly, unfused, those rounds (or a histogram per round) cost more than a sort
  (on an H100 a histogram search took 11.0 ms against the sort's 6.5 at 1,024 x 49,152), so the
  eager draw sorts the patterns once and reads the threshold off the exact cumulative masses.
- **Ties at the threshold.** The j-th token (by id) with pattern ``b`` has ``mass_above + j * m``
  before it in the sorted order (``m`` the mass of the threshold value), so the first
  ``ceil((limit - mass_above) / m)`` of them are in: exactly what the stable sort keeps.
- **The draw.** The cumulative nucleus mass in token-id order (one cumsum of the masses above the
  threshold, plus the admitted ties' share) against ``floor(u * total)``: the first token whose
  cumulative mass exceeds it. A uniform therefore maps to tokens in id order, not in the sorted
  order of the earlier sampler: the same (seed, key, step) draws from the same distribution, but
  generally another token than before.

Outside a compiled region the draw runs eagerly (the sort, on CPU and CUDA alike: no host syncs,
captured as it is in the decode step's CUDA graph); the compiled decode step traces it into its own
graph (the masked-sum rounds). After the caller's softmax everything is exact integer arithmetic on
the same nucleus, so both give the same token. A standalone
``torch.compile`` of the draw with a dynamic batch does not build on torch 2.11 (inductor fails to
generate the int64 cumsum over the vocabulary, a split scan, on an H100), so there is none.

Shapes: R rows, V vocab.
"""

from __future__ import annotations

import math

import torch

MASS_BITS = 60  # a probability p weighs floor(p * 2**60); the sum of a row's masses stays < 2**63
PATTERN_BITS = 30  # float32 patterns of probabilities in [0, 1] lie in [0, 2**30) (1.0 is 0x3F800000)
SEARCH_DIGIT_BITS = 3  # traced into a compiled step: 10 rounds of 7 masked sums, one fused pass each


def masses(probs: torch.Tensor) -> torch.Tensor:
    """Integer masses floor(p * 2**60) of float32 probabilities (int64, same shape; exact: scaling by
    a power of two and truncating a non-negative float lose nothing else)."""
    return (probs * 2.0**MASS_BITS).to(torch.int64)


def mass_limit(top_p: float) -> int | None:
    """The integer bound the mass before a nucleus token stays below; None for ``top_p`` 1 (the
    whole vocabulary, as the sorted sampler never masked there either)."""
    return None if top_p >= 1 else math.ceil(top_p * 2**MASS_BITS)


def threshold_search(
    patterns: torch.Tensor, weights: torch.Tensor, limit: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the nucleus's threshold pattern [R, 1] int32, the mass above it [R, 1] int64): searched
    digit by digit inside a compiled region (``searched_threshold``), read off a sort eagerly
    (``sorted_threshold``, faster there). Both give the same nucleus, so the same tokens."""
    if torch.compiler.is_compiling():
        return searched_threshold(patterns, weights, limit)
    return sorted_threshold(patterns, weights, limit)


def searched_threshold(
    patterns: torch.Tensor, weights: torch.Tensor, limit: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(smallest pattern b with mass above b below ``limit`` [R, 1] int32, that mass [R, 1] int64).

    The search keeps b in (low, low + num_slices * step]; each round finds the mass above the
    thresholds between the slices and moves to the slice where it falls below the limit (it never
    grows as b grows), fixing ``SEARCH_DIGIT_BITS`` bits of b. The upper end's mass is carried along,
    so the mass above the answer costs no extra pass.
    """
    num_slices = 2**SEARCH_DIGIT_BITS
    low = torch.full_like(patterns[:, :1], -1)  # the answer is > low; low itself is never evaluated
    mass_at_high = torch.zeros_like(weights[:, :1])  # above 2**30 - 1: nothing
    step = 2**PATTERN_BITS
    for _ in range(PATTERN_BITS // SEARCH_DIGIT_BITS):
        step //= num_slices
        above = masked_masses_above(patterns, weights, low, step, num_slices, mass_at_high)  # non-increasing
        num_heavy = (above >= limit).sum(-1, keepdim=True)  # thresholds 1..n still carry >= limit
        low = low + (num_heavy * step).to(low.dtype)
        next_high_mass = above.gather(-1, num_heavy.clamp(max=num_slices - 2))
        mass_at_high = torch.where(num_heavy < num_slices - 1, next_high_mass, mass_at_high)
    return (low + 1).to(torch.int32), mass_at_high


def masked_masses_above(patterns, weights, low, step: int, num_slices: int, mass_at_high) -> torch.Tensor:
    """The mass above each threshold ``low + k * step``, k = 1 .. num_slices - 1 [R, num_slices - 1],
    as masked sums of the same tensor: a compiler fuses them into one pass over the vocabulary."""
    sums = [
        torch.where(patterns > low + k * step, weights, 0).sum(-1, keepdim=True) for k in range(1, num_slices)
    ]
    return torch.cat(sums, dim=-1)


def sorted_threshold(
    patterns: torch.Tensor, weights: torch.Tensor, limit: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pattern of the last token the sorted definition keeps, and the mass above it: the patterns
    sorted descending, their masses summed exactly (int64) before each. That pattern is the search's
    b (the mass above it is below the limit, and above any lower pattern the next token's share
    reaches it), except when the nucleus is the whole row: then both admit every token. Eagerly one
    sort and a few passes (on an H100 the search's eager histogram rounds took 1.7-2.4x a sort)."""
    ordered = patterns.sort(dim=-1, descending=True).values
    ordered_masses = masses(ordered.view(torch.float32))
    kept = ((ordered_masses.cumsum(-1) - ordered_masses) < limit).sum(-1, keepdim=True)  # >= 1
    threshold = ordered.gather(-1, kept - 1)
    return threshold, torch.where(patterns > threshold, weights, 0).sum(-1, keepdim=True)


def nucleus_bounds(
    patterns: torch.Tensor, weights: torch.Tensor, limit: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The nucleus of probabilities given as their float32 ``patterns`` (int32) and ``masses``, as
    (threshold pattern [R, 1] int32, how many tokens tied at it are in [R, 1] int64): every token
    above the threshold is in, and the first ones by id of those at it."""
    vocab = patterns.shape[-1]
    if limit is None:  # everything: every pattern is >= 0, and all tokens at 0 are in
        zeros = torch.zeros_like(patterns[:, :1])
        return zeros, torch.full_like(zeros, vocab, dtype=torch.int64)
    threshold, mass_above = threshold_search(patterns, weights, limit)
    tie_mass = masses(threshold.view(torch.float32))
    needed = limit - mass_above  # >= 1
    quota = torch.where(tie_mass > 0, (needed + tie_mass - 1) // tie_mass.clamp(min=1), vocab)
    return threshold, quota


def nucleus_mask(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which tokens are in each row's nucleus: bool [R, V]."""
    patterns = probs.view(torch.int32)
    threshold, quota = nucleus_bounds(patterns, masses(probs), mass_limit(top_p))
    tied = patterns == threshold
    return (patterns > threshold) | (tied & (tied.cumsum(-1) <= quota))


def nucleus_tokens(probs: torch.Tensor, uniforms: torch.Tensor, top_p: float) -> torch.Tensor:
    """One token per row from its nucleus, by inverse CDF in token-id order: [R] int64.

    ``probs`` [R, V] float32 (contiguous), ``uniforms`` [R] in [0, 1) (``sampling.row_uniforms``).
    Eager here; traced into the graph of a compiled caller (see the module docstring).
    """
    return draw_below_limit(probs, uniforms, mass_limit(top_p))


def draw_below_limit(probs: torch.Tensor, uniforms: torch.Tensor, limit: int | None) -> torch.Tensor:
    """``nucleus_tokens`` for the integer ``mass_limit``."""
    patterns, weights = probs.view(torch.int32), masses(probs)
    threshold, quota = nucleus_bounds(patterns, weights, limit)
    tie_mass = masses(threshold.view(torch.float32))
    admitted_ties = torch.minimum((patterns == threshold).cumsum(-1), quota)  # ties in, up to each id
    cdf = torch.where(patterns > threshold, weights, 0).cumsum(-1) + tie_mass * admitted_ties
    total = cdf[:, -1:]  # >= 1: the most likely token weighs >= 2**60 / V
    target = (uniforms.to(torch.float64)[:, None] * total.to(torch.float64)).floor().to(torch.int64)
    target = torch.minimum(target.clamp(min=0), total - 1)  # a uniform rounded up to 1.0 stays inside
    return (cdf <= target).sum(-1)  # the first token whose cumulative mass exceeds the target
