"""Per-chunk loss terms of the drafter variants, computed from the chunk's one LM-head pass.

Shapes (legend): c tokens of one chunk, V vocab, K selector candidates, r selector rank.

DFlash2's selector (``models/dflash2.py``) is trained with a K-way cross-entropy over the parallel
head's top-K candidates of each position, scored against the gold predecessor, with the gold token
injected in place of the K-th candidate when the head did not rank it in its top K (as the public
DFlash2 trainers do: TorchSpec's DFlash2 wrapper, the injection of the reference training code).
The candidates' unary scores are the chunk's own logits, so the term's gradient reaches the drafter
through those logits (folded into the chunk's logits gradient, no second LM-head matmul) and through
``hidden_projection``; the successor codebook gets its gradient here. Like the other terms, every
gradient is computed in the forward pass and entries of weight 0 are selected away.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class SelectorChunk:
    """One chunk's selector term: ``loss_sum`` (weighted), the served pick's correctness
    ``correct`` [c] (the gold token is among the head's top K and scores best), and with a gradient
    scale: the candidates [c, K] and the gradient of their unary logits [c, K] (to scatter into the
    chunk's logits gradient), the gradient of the gate [c, r] and of the successor codebook [V, r]."""

    loss_sum: Tensor
    correct: Tensor
    candidates: Tensor | None = None
    grad_unary: Tensor | None = None
    grad_gate: Tensor | None = None
    grad_table: Tensor | None = None


def selector_term(
    logits: Tensor,
    labels: Tensor,
    gate: Tensor,
    table: Tensor,
    top_k: int,
    weights: Tensor,
    grad_scale: Tensor | None,
) -> SelectorChunk:
    """K-way cross-entropy of the selector's scores ``unary + <gate, table[candidate]>`` over the top-K
    of ``logits`` [c, V] (gold ``labels`` [c] injected as the K-th candidate when missing), weighted
    by ``weights`` [c]; gate [c, r] is ``predecessor_codebook[gold previous] * hidden_projection(h)``,
    table [V, r] the successor codebook. Scores in float32 (fp64 stays fp64)."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    unary, candidates = logits.to(dtype).topk(top_k, dim=-1)
    hit = (candidates == labels[:, None]).any(-1)
    label_logit = logits.to(dtype).gather(1, labels[:, None])[:, 0]
    candidates = torch.cat([candidates[:, :-1], torch.where(hit, candidates[:, -1], labels)[:, None]], dim=1)
    unary = torch.cat([unary[:, :-1], torch.where(hit, unary[:, -1], label_logit)[:, None]], dim=1)
    target = (candidates == labels[:, None]).to(torch.int8).argmax(-1)  # the gold token's slot
    successors = table[candidates].to(dtype)  # [c, K, r]
    gate_f = gate.to(dtype)
    scores = unary + (successors * gate_f[:, None]).sum(-1)
    lse = torch.logsumexp(scores, dim=-1)
    per_token = lse - scores.gather(1, target[:, None])[:, 0]
    live = weights > 0
    zero = torch.zeros((), device=logits.device, dtype=dtype)
    loss_sum = torch.where(live, per_token * weights.to(dtype), zero).sum()
    correct = hit & (scores.argmax(-1) == target)
    if grad_scale is None:
        return SelectorChunk(loss_sum=loss_sum, correct=correct)
    grad = (scores - lse[:, None]).exp()
    grad = torch.where(torch.arange(top_k, device=grad.device) == target[:, None], grad - 1.0, grad)
    row_scale = torch.where(live, weights.to(dtype) * grad_scale, zero)
    grad = torch.where(live[:, None], grad * row_scale[:, None], zero)  # [c, K]; NaN rows of weight 0 too
    grad_gate = (grad[:, :, None] * successors).sum(1)
    contributions = (grad[:, :, None] * gate_f[:, None]).flatten(0, 1)  # [c*K, r]
    grad_table = torch.zeros(table.shape, device=table.device, dtype=dtype)
    grad_table.index_add_(0, candidates.flatten(), contributions)
    return SelectorChunk(loss_sum, correct, candidates, grad, grad_gate.to(gate.dtype), grad_table)


class SelectorGrads:
    """DFlash2's selector term across the chunks of one call: the served-pick correctness and, with a
    gradient, the gradients of the gate [N, r] and of the successor codebook [V, r]."""

    def __init__(self, gate: Tensor, table: Tensor, needs_grad: bool):
        self.gate, self.table = gate, table
        self.correct: list[Tensor] = []
        self.grad_gate = torch.zeros_like(gate) if needs_grad else None
        # Summed over chunks in at least fp32 (a bf16 codebook would lose the small per-chunk parts).
        accumulate = torch.promote_types(table.dtype, torch.float32)
        self.grad_table = (
            torch.zeros(table.shape, device=table.device, dtype=accumulate) if needs_grad else None
        )

    @classmethod
    def start(cls, gate: Tensor | None, table: Tensor | None, needs_grad: bool) -> SelectorGrads | None:
        return None if gate is None else cls(gate, table, needs_grad)

    def add_chunk(self, logits, labels, sl, w, spec, scale, grad_logits) -> Tensor:
        """The chunk's weighted selector loss (tokens ``sl``, position weights ``w`` times
        ``spec.options.selector_weight``); its unary gradient is added into ``grad_logits``."""
        term = selector_term(
            logits, labels, self.gate[sl], self.table, spec.selector_top_k, w * spec.options.selector_weight,
            scale if grad_logits is not None else None,
        )  # fmt: skip
        self.correct.append(term.correct)
        if grad_logits is not None:
            grad_logits.scatter_add_(1, term.candidates, term.grad_unary.to(grad_logits.dtype))
            self.grad_gate[sl] = term.grad_gate
            self.grad_table += term.grad_table
        return term.loss_sum

    def grads(self) -> tuple[Tensor | None, Tensor | None]:
        if self.grad_table is None:
            return None, None
        return self.grad_gate, self.grad_table.to(self.table.dtype)
