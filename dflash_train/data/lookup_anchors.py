"""Anchors whose whole block prompt lookup would copy, and their sampling weight
(``train.lookup_anchor_weight``; docs/quality.md, "Anchors where lookup cannot copy").

Served with prompt lookup first (llama.cpp's ``ngram-simple,draft-dflash``, the eval's
``ngram+dflash``), the drafter drafts where lookup has nothing to copy; in repetition loops lookup
copies whole blocks for free. An anchor ``a`` is *copied by lookup* when the eval's n-gram baseline
(``eval.proposers.NgramProposer``: the most recent earlier occurrence of the longest recurring
suffix of n .. 1 tokens of ``ids[:a + 1]``, the B-1 tokens after it, padded with the last; with no
match the anchor token repeated) proposes exactly the block's labels ``ids[a + 1 .. a + B - 1]``,
at every label the loss scores (in the row, in the loss mask, in the anchor's own conversation of a
packed row). ``tests/test_lookup_anchors.py`` checks this against the eval's proposer.

Vectorised over a micro-batch, on its device, with no host sync: for each suffix size s the
s-gram ending at every position gets an exact integer code (a dense rank of (code of the (s-1)-gram
before it, token), so no hash can collide), a stable sort by (conversation, code) puts every
occurrence right after the previous one, and the proposal is a gather. n sorts of R x L elements
per micro-batch, a pure function of the tokens, hence of (seed, epoch, sample index) like the draw.

Shapes: R rows, L sequence, W the round (B, or B + 1 for DSpark), n the lookup size.
"""

from __future__ import annotations

import torch
from torch import Tensor


def lookup_anchor_weights(
    input_ids: Tensor, loss_mask: Tensor, position_ids: Tensor | None, train, width: int
) -> Tensor | None:
    """Per candidate anchor ``[R, L-1]`` float64: ``train.lookup_anchor_weight`` where lookup (n =
    ``train.lookup_anchor_ngram_n``) copies the block of ``width`` (the round), 1 elsewhere; None at
    weight 1 (the uniform draw, left exactly as it was)."""
    if train.lookup_anchor_weight == 1.0:
        return None
    copied = lookup_copies_block(
        input_ids, loss_mask, position_ids, ngram_n=train.lookup_anchor_ngram_n, width=width
    )
    ones = torch.ones(copied.shape, dtype=torch.float64, device=copied.device)
    return torch.where(copied, ones * train.lookup_anchor_weight, ones)


def lookup_copies_block(
    input_ids: Tensor, loss_mask: Tensor, position_ids: Tensor | None, *, ngram_n: int, width: int
) -> Tensor:
    """``[R, L-1]`` bool: the eval's n-gram proposer on the anchor's conversation up to the anchor
    proposes every scored label of its block (module docstring)."""
    num_rows, length = input_ids.shape
    device = input_ids.device
    if position_ids is None:
        position_ids = torch.arange(length, device=device).expand(num_rows, length)
    start = proposal_starts(input_ids, position_ids, ngram_n)[:, :-1]  # [R, L-1]
    anchor = torch.arange(length - 1, device=device)[:, None]  # [L-1, 1]
    k = torch.arange(1, width, device=device)  # [W-1] label offsets

    def at(values: Tensor, columns: Tensor) -> Tensor:  # values[r, columns[r, a, k]] -> [R, L-1, W-1]
        return values.gather(1, columns.reshape(columns.shape[0], -1)).view(columns.shape)

    # The proposal's k-th token is ids[min(start + k - 1, a)]: past the text it repeats the anchor's.
    proposed = at(input_ids, torch.minimum(start[..., None] + k - 1, anchor))
    label_at = (anchor + k).clamp(max=length - 1).expand(num_rows, -1, -1)  # [R, L-1, W-1]
    scored = (anchor + k < length) & at(loss_mask, label_at)
    scored &= at(position_ids, label_at) == position_ids[:, :-1, None] + k  # the anchor's conversation
    return ((proposed == at(input_ids, label_at)) | ~scored).all(dim=-1)


def proposal_starts(input_ids: Tensor, position_ids: Tensor, ngram_n: int) -> Tensor:
    """``[R, L]``: where the n-gram proposer's continuation for ``ids[:p + 1]`` starts (the token after
    the latest earlier occurrence of the longest recurring suffix of n .. 1 tokens), or ``p`` when
    no suffix recurs (the proposer then repeats the last token)."""
    num_rows, length = input_ids.shape
    device = input_ids.device
    column = torch.arange(length, device=device).expand(num_rows, length)
    flat_index = column + torch.arange(num_rows, device=device)[:, None] * length
    # A conversation: the positions since the last position id 0 (an unpacked row is one), named by
    # the flat index of its first position (never shared between rows).
    row_start = flat_index[:, :1].expand(num_rows, length)
    text = torch.where(position_ids == 0, flat_index, row_start).cummax(dim=1).values
    start = column.clone()
    codes = input_ids.to(torch.int64)
    for size in range(1, ngram_n + 1):
        if size > 1:  # the s-gram ending at p: (the (s-1)-gram ending at p-1, token p), ranked densely
            previous = torch.cat([codes.new_zeros(num_rows, 1), codes[:, :-1]], dim=1)
            codes = dense_rank(previous * 2**31 + input_ids)
        # An s-gram that would reach before its conversation never matches: a code of its own.
        whole = position_ids >= size - 1
        earlier = latest_earlier_occurrence(torch.where(whole, codes, -1 - flat_index), text)
        # Sizes grow: a longer recurring suffix replaces a shorter one's proposal.
        start = torch.where((earlier >= 0) & whole, earlier + 1, start)
    return start


def dense_rank(values: Tensor) -> Tensor:
    """Equal values get equal ranks, distinct values distinct ones (0 .. #distinct - 1); like
    ``torch.unique(return_inverse=True)`` without its host sync."""
    flat = values.flatten()
    ordered, order = torch.sort(flat, stable=True)
    new = torch.ones_like(ordered, dtype=torch.int64)
    new[1:] = (ordered[1:] != ordered[:-1]).long()
    return torch.empty_like(flat).scatter_(0, order, new.cumsum(0) - 1).view_as(values)


def latest_earlier_occurrence(codes: Tensor, text: Tensor) -> Tensor:
    """``[R, L]``: the largest column ``q < p`` of the same row and conversation (``text``) with
    ``codes[q] == codes[p]``, -1 when there is none."""
    length = codes.shape[1]
    flat_codes, flat_text = codes.flatten(), text.flatten()
    order = torch.argsort(flat_codes, stable=True)  # positions ascending within a code
    order = order[torch.argsort(flat_text[order], stable=True)]  # then grouped by conversation
    same = (flat_codes[order[1:]] == flat_codes[order[:-1]]) & (flat_text[order[1:]] == flat_text[order[:-1]])
    previous = torch.full_like(order, -1)
    previous[1:] = torch.where(same, order[:-1], previous[1:])
    found = torch.empty_like(previous).scatter_(0, order, previous)
    return torch.where(found >= 0, found % length, found).view_as(codes)
