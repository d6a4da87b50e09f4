"""Top-p (nucleus) draws without sorting the vocabulary: an exact threshold search, then inverse-CDF
sampling in token-id order.

The nucleus is defined by the sorted order (probabilities descending, ties by token id): a token is
in it when the mass before it in that order is below ``top_p``, so the most likely token always is.
That set is a prefix of the order, hence "every token above one threshold probability, plus the
first few tokens, by id, tied at it". Nothing here sorts; every step is a fixed-shape tensor
operation without host syncs, so the draw can be captured in the decode step's CUDA graph:

- **Integer masses.** A probability ``p`` weighs ``floor(p * 2**60)`` (``masses``). Sums of these
  integers are exact in any order, so the threshold found, and the token drawn, are the same on CPU
  and GPU, compiled or eager, in any batch (a token below 2**-60 is never drawn; the old float32
  cumsum rounded the masses at ~1e-7 instead, so a nucleus boundary within that of ``top_p`` can
  come out differently than before).
- **Threshold search.** Non-negative float32s order like their int32 bit patterns, and a
  probability's pattern lies in [0, 2**30). The threshold is the smallest pattern ``b`` whose mass
  strictly above it is below the limit, found digit by digit: compiled, 10 rounds of 7 masked sums
  over the vocabulary (the sums of a round read the same tensor, so the compiler fuses them into one
  pass); eager, 3 rounds of a 1,024-slice mass histogram (one scatter each).
- **Ties at the threshold.** The j-th token (by id) with pattern ``b`` has ``mass_above + j * m``
  before it in the sorted order (``m`` the mass of the threshold value), so the first
  ``ceil((limit - mass_above) / m)`` of them are in: exactly what the stable sort keeps.
- **The draw.** The cumulative nucleus mass in token-id order (one cumsum of the masses above the
  threshold, plus the admitted ties' share) against ``floor(u * total)``: the first token whose
  cumulative mass exceeds it. A uniform therefore maps to tokens in id order, not in the sorted
  order of the earlier sampler: the same (seed, key, step) draws from the same distribution, but
  generally another token than before.

Outside a compiled region the draw runs eagerly (the histogram rounds, on CPU and CUDA alike: plain
tensor operations without host syncs, captured as they are in the decode step's CUDA graph); the
compiled decode step traces it into its own graph (the masked-sum rounds). After the caller's
softmax everything is integer arithmetic, so both give the same token. A standalone
``torch.compile`` of the draw with a dynamic batch does not build on torch 2.11 (inductor fails to
generate the int64 cumsum over the vocabulary, a split scan, on an H100), so there is none.

Shapes: R rows, V vocab.
"""

from __future__ import annotations

import math

import torch

MASS_BITS = 60  # a probability p weighs floor(p * 2**60); the sum of a row's masses stays < 2**63
PATTERN_BITS = 30  # float32 patterns of probabilities in [0, 1] lie in [0, 2**30) (1.0 is 0x3F800000)
COMPILED_DIGIT_BITS = 3  # traced into a compiled step: 10 rounds of 7 masked sums, one fused pass each
EAGER_DIGIT_BITS = 10  # eager: 3 rounds of one 1,024-slice histogram (a scatter) each


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
    """(smallest pattern b with mass above b below ``limit`` [R, 1] int32, that mass [R, 1] int64).

    The search keeps b in (low, low + num_slices * step]; each round finds the mass above the
    thresholds between the slices and moves to the slice where it falls below the limit (it never
    grows as b grows), fixing ``digit_bits`` bits of b. The upper end's mass is carried along, so
    the mass above the answer costs no extra pass. Both ways of finding the masses are exact, so
    compiled and eager searches end on the same b.
    """
    compiling = torch.compiler.is_compiling()
    digit_bits = COMPILED_DIGIT_BITS if compiling else EAGER_DIGIT_BITS
    masses_above = masked_masses_above if compiling else binned_masses_above
    num_slices = 2**digit_bits
    if not compiling:
        patterns = patterns.long()  # the histogram's column arithmetic, in scatter's index dtype
    low = torch.full_like(patterns[:, :1], -1)  # the answer is > low; low itself is never evaluated
    mass_at_high = torch.zeros_like(weights[:, :1])  # above 2**30 - 1: nothing
    step = 2**PATTERN_BITS
    for _ in range(PATTERN_BITS // digit_bits):
        step //= num_slices
        above = masses_above(patterns, weights, low, step, num_slices, mass_at_high)  # non-increasing
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


def binned_masses_above(patterns, weights, low, step: int, num_slices: int, mass_at_high) -> torch.Tensor:
    """``masked_masses_above`` from one histogram (eager; int64 ``patterns``): a token lies in slice j
    of the interval when its pattern is in (low + j * step, low + (j + 1) * step], and above
    threshold k exactly when j >= k; the slices' masses summed from the top, plus the mass above the
    interval."""
    # column j + 1: slice j; column 0: at or below low, column num_slices + 1: above the interval
    columns = ((patterns - (low + 1 - step)) >> (step.bit_length() - 1)).clamp_(0, num_slices + 1)
    binned = weights.new_zeros((weights.shape[0], num_slices + 2)).scatter_add_(-1, columns, weights)
    return binned[:, 2 : num_slices + 1].flip(-1).cumsum(-1).flip(-1) + mass_at_high


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
