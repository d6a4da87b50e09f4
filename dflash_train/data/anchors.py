"""Anchor sampling (DESIGN.md §1): a fixed number of anchors per row with a keep-mask.

Valid anchors are positions ``a`` with ``loss_mask[a]`` and ``loss_mask[a + 1]``. Each row draws
``min(A, #valid)`` of them uniformly without replacement, sorted ascending and padded to exactly
``A``; padding slots have ``keep = False`` and anchor value 0 (always in range, never scored).

The draw is the A smallest of independent uniform random keys over the valid positions, which is
a uniformly random subset. Keys come from a counter-based hash (splitmix64) of
(seed, epoch, sample_index, position) computed with int64 tensor ops, so the result is a pure
function of those four numbers: identical on CPU and CUDA, across resumes, and independent of the
batch a row lands in. Shapes are fixed and nothing syncs with the host (no nonzero, no randperm).
Integer overflow in torch wraps in two's complement on every backend, which the hash relies on.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash_train.hashing import shift_right_logical, splitmix64

# Legend: R rows, L sequence, A anchors.
INT64_MAX = 2**63 - 1


def anchor_keys(seed: int, epoch: int, sample_index: torch.Tensor, length: int) -> torch.Tensor:
    """Uniform random keys in [0, 2**62) per (row, position): [R, length] int64."""
    device = sample_index.device
    base = splitmix64(torch.tensor([seed], dtype=torch.int64, device=device))
    base = splitmix64(base ^ torch.tensor([epoch], dtype=torch.int64, device=device))
    row = splitmix64(base ^ sample_index.to(torch.int64))  # [R]
    positions = torch.arange(length, dtype=torch.int64, device=device)
    keys = splitmix64(row[:, None] ^ splitmix64(positions)[None, :])
    return shift_right_logical(keys, 2)  # top 62 bits: non-negative, below the invalid key


def sample_anchors(
    loss_mask: torch.Tensor,
    num_anchors: int,
    seed: int,
    epoch: int,
    sample_index: torch.Tensor,
    position_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample anchors for a batch: ``(anchors [R, A] long, keep [R, A] bool)``.

    ``loss_mask`` is [R, L] bool, ``sample_index`` [R] long (the global row index; filler rows
    with -1 have an all-false mask and so get no anchors). ``position_weight`` [R, L-1] (>= 0, None =
    uniform) draws proportionally to it instead (``weighted_keys``); weight 0 is never drawn.
    """
    num_rows, length = loss_mask.shape
    if num_anchors < 1 or length < 2:
        raise ValueError(f"sample_anchors needs num_anchors >= 1 and L >= 2, got A={num_anchors}, L={length}")
    valid = loss_mask[:, :-1] & loss_mask[:, 1:]  # [R, L-1]: position L-1 has no next token
    keys = anchor_keys(seed, epoch, sample_index, length - 1)
    if position_weight is not None:
        keys = weighted_keys(keys, position_weight)
    keys = torch.where(valid, keys, torch.full_like(keys, INT64_MAX))
    k = min(num_anchors, length - 1)
    smallest, positions = torch.topk(keys, k, dim=1, largest=False)  # [R, k]
    return ascending_padded(positions, smallest < INT64_MAX, length, num_anchors)


def weighted_keys(keys: Tensor, weight: Tensor) -> Tensor:
    """Keys whose A smallest are a draw without replacement with probabilities proportional to
    ``weight`` (Efraimidis and Spirakis, 2006: the smallest E / w of independent E ~ Exp(1)).

    E = -log(u) with u the uniform key scaled into (0, 1]; E / w is a non-negative float64, whose
    bits read as int64 keep its order, so every caller keeps comparing int64 keys. Weight 0 gives
    the invalid key: never drawn. Still a pure function of (seed, epoch, sample index, position) and
    the weights.
    """
    uniform = (keys.to(torch.float64) + 0.5) / float(2**62)
    exponential = -torch.log(uniform)
    # A key rounding up to 2**62 gives -log(1) = -0.0, whose sign bit would read as the smallest key.
    exponential = torch.where(exponential > 0, exponential, torch.zeros_like(exponential))
    weighted = (exponential / weight.to(torch.float64).clamp(min=1e-300)).view(torch.int64)
    return torch.where(weight > 0, weighted, torch.full_like(keys, INT64_MAX))


def packed_anchor_keys(seed: int, epoch: int, token_sample_index: Tensor, position_ids: Tensor) -> Tensor:
    """``anchor_keys`` of every token from its conversation's index and its position inside it.

    [R, L] int64 in [0, 2**62). A conversation draws exactly the keys it would draw alone (row index
    = its sample index, position = its own position), wherever it lands in a packed row.
    """
    device = token_sample_index.device
    base = splitmix64(torch.tensor([seed], dtype=torch.int64, device=device))
    base = splitmix64(base ^ torch.tensor([epoch], dtype=torch.int64, device=device))
    row = splitmix64(base ^ token_sample_index.to(torch.int64))
    return shift_right_logical(splitmix64(row ^ splitmix64(position_ids.to(torch.int64))), 2)


def sample_packed_anchors(
    loss_mask: Tensor,
    position_ids: Tensor,
    token_sample_index: Tensor,
    num_anchors: int,
    anchors_per_token: float,
    seed: int,
    epoch: int,
    position_weight: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Anchors of packed rows, budgeted per conversation: ``(anchors [R, A], keep [R, A])``.

    A position a is valid when a and a + 1 are response tokens of the same conversation. Each
    conversation of n tokens may hold at most ``ceil(anchors_per_token * n)`` anchors (its valid
    positions with the smallest keys); when the caps of a row add up to more than A, every
    conversation gets its first anchor before any gets its second (ties by key). So a short
    conversation is never starved by a long neighbour, and the row keeps exactly A slots.
    Fixed shapes, no host sync, a pure function of (seed, epoch, sample index, position).
    ``position_weight`` [R, L-1] weights the draw inside each conversation as in ``sample_anchors``.
    """
    num_rows, length = loss_mask.shape
    if num_anchors < 1 or length < 2 or anchors_per_token <= 0:
        raise ValueError(
            f"sample_packed_anchors needs A >= 1, L >= 2 and anchors_per_token > 0, got "
            f"A={num_anchors}, L={length}, anchors_per_token={anchors_per_token}"
        )
    same = position_ids[:, 1:] == position_ids[:, :-1] + 1
    valid = loss_mask[:, :-1] & loss_mask[:, 1:] & same  # [R, L-1]
    keys = packed_anchor_keys(seed, epoch, token_sample_index, position_ids)[:, :-1]
    if position_weight is not None:
        keys = weighted_keys(keys, position_weight)
        valid = valid & (position_weight > 0)
    keys = torch.where(valid, keys, torch.full_like(keys, INT64_MAX))
    segment = (position_ids == 0).long().cumsum(dim=1) - 1  # [R, L]: conversation (or tail) number
    rank = rank_within_segment(keys, segment[:, :-1])
    sizes = torch.zeros(num_rows, length, dtype=torch.long, device=loss_mask.device)
    sizes.scatter_add_(1, segment, torch.ones_like(segment))
    cap = torch.ceil(sizes.gather(1, segment[:, :-1]).double() * anchors_per_token).long()
    chosen = valid & (rank < cap)
    # Priority: lower rank within its conversation first, then the smaller key.
    priority_rank = torch.where(chosen, rank, torch.full_like(rank, length))
    by_key = torch.sort(keys, dim=1, stable=True).indices
    by_rank = torch.sort(priority_rank.gather(1, by_key), dim=1, stable=True).indices
    order = by_key.gather(1, by_rank)  # [R, L-1] positions, best first
    k = min(num_anchors, length - 1)
    positions = order[:, :k]
    return ascending_padded(positions, chosen.gather(1, positions), length, num_anchors)


def ascending_padded(positions: Tensor, keep: Tensor, length: int, num_anchors: int) -> tuple[Tensor, Tensor]:
    """Chosen ``positions`` [R, k] (``keep`` marks the real ones) -> (anchors, keep) [R, num_anchors]:
    kept anchors ascending, then padding slots (anchor 0, keep False) up to ``num_anchors``. The
    padding slots' order is irrelevant: they all become anchor 0, so tie order cannot change it."""
    order_key, _ = torch.sort(torch.where(keep, positions, positions + length), dim=1)
    keep = order_key < length
    anchors = torch.where(keep, order_key, torch.zeros_like(order_key))
    pad = num_anchors - positions.shape[1]
    if pad > 0:
        anchors = torch.cat([anchors, anchors.new_zeros(anchors.shape[0], pad)], dim=1)
        keep = torch.cat([keep, keep.new_zeros(keep.shape[0], pad)], dim=1)
    return anchors, keep


def rank_within_segment(keys: Tensor, segment: Tensor) -> Tensor:
    """[R, N]: the rank of each key among the keys of its segment (0 = smallest; ties by position)."""
    num_rows, size = keys.shape
    by_key = torch.sort(keys, dim=1, stable=True).indices
    by_segment = torch.sort(segment.gather(1, by_key), dim=1, stable=True).indices
    order = by_key.gather(1, by_segment)  # grouped by segment, keys ascending inside
    counts = torch.zeros(num_rows, size + 1, dtype=torch.long, device=keys.device)
    counts.scatter_add_(1, segment, torch.ones_like(segment))
    starts = counts.cumsum(dim=1) - counts  # first slot of each segment in ``order``
    slots = torch.arange(size, device=keys.device).expand(num_rows, -1)
    rank_sorted = slots - starts.gather(1, segment.gather(1, order))
    return torch.empty_like(rank_sorted).scatter_(1, order, rank_sorted)
