"""Per-chunk loss terms of the drafter variants, computed from the chunk's one LM-head pass.

Shapes (legend): c tokens of one chunk, N scored tokens, V vocab, K selector candidates, r rank
(the selector's or the Markov head's).

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
import torch.nn.functional as F
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

    @staticmethod
    def grads_of(selector: SelectorGrads | None) -> tuple[Tensor | None, Tensor | None]:
        """The gradients of the gate and of the codebook (None without a selector or a gradient)."""
        if selector is None or selector.grad_table is None:
            return None, None
        return selector.grad_gate, selector.grad_table.to(selector.table.dtype)


# ----------------------------------------------------------------------------- DSpark


class MarkovGrads:
    """DSpark's Markov bias ``latent @ table^T`` (latent [N, r] = ``markov_w1[gold previous]``, table
    [V, r] = ``markov_w2.weight``) added to each chunk's logits, and, with a gradient, the gradients of
    latent and table from the chunk's logits gradient (the bias enters the logits as a sum)."""

    def __init__(self, latent: Tensor, table: Tensor, needs_grad: bool):
        self.latent, self.table = latent, table
        accumulate = torch.promote_types(table.dtype, torch.float32)
        self.grad_latent = torch.zeros_like(latent) if needs_grad else None
        self.grad_table = (
            torch.zeros(table.shape, device=table.device, dtype=accumulate) if needs_grad else None
        )

    @classmethod
    def start(cls, latent: Tensor | None, table: Tensor | None, needs_grad: bool) -> MarkovGrads | None:
        return None if latent is None else cls(latent, table, needs_grad)

    def bias(self, sl: slice, dtype: torch.dtype) -> Tensor:
        """The bias [c, V] of tokens ``sl``: a rank-r matmul next to the LM head's H x V."""
        return (self.latent[sl] @ self.table.t()).to(dtype)

    def add_grads(self, grad_logits: Tensor, sl: slice) -> None:
        grad = grad_logits.to(self.table.dtype)
        self.grad_latent[sl] = grad @ self.table
        self.grad_table += (grad.t() @ self.latent[sl]).to(self.grad_table.dtype)

    @staticmethod
    def grads_of(markov: MarkovGrads | None) -> tuple[Tensor | None, Tensor | None]:
        if markov is None or markov.grad_table is None:
            return None, None
        return markov.grad_latent, markov.grad_table.to(markov.table.dtype)


def total_variation_term(
    logits: Tensor,
    lse: Tensor,
    teacher_logits: Tensor,
    weights: Tensor,
    grad_scale: Tensor | None,
    grad_logits: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """DSpark's L1 term: ``sum_t w * |p_draft - p_target|_1`` over the chunk, and the acceptance
    probability ``clamp(1 - |p_draft - p_target|_1 / 2, 0, 1)`` [c] of speculative sampling (the
    confidence head's target; DeepSpec's ``accept_rate``). The term's logits gradient
    ``w * scale * p * (s - <p, s>)`` with ``s = sign(p - q)`` is added into ``grad_logits`` in place.
    Weight-0 tokens are selected away (a non-finite row there stays out of the loss and gradient)."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    probs = (logits.to(dtype) - lse[:, None]).exp()
    teacher = torch.softmax(teacher_logits.to(dtype), dim=-1)
    diff = probs - teacher
    tv = diff.abs().sum(-1)
    accept = (1.0 - 0.5 * tv).clamp(0.0, 1.0)
    live = weights > 0
    zero = torch.zeros((), device=logits.device, dtype=dtype)
    loss_sum = torch.where(live, tv * weights.to(dtype), zero).sum()
    if grad_logits is not None and grad_scale is not None:
        sign = diff.sign()
        grad = probs * (sign - (probs * sign).sum(-1, keepdim=True))
        row_scale = torch.where(live, weights.to(dtype) * grad_scale, zero)
        grad_logits += torch.where(live[:, None], grad * row_scale[:, None], zero).to(grad_logits.dtype)
    return loss_sum, accept.detach()


def confidence_loss(
    confidence: Tensor, accept: Tensor, weights: Tensor, valid: Tensor, denom: Tensor, factor: float
) -> tuple[Tensor, Tensor]:
    """DSpark's confidence head: ``factor * sum(w * BCE(confidence, accept)) / denom`` over the valid
    slots, with the chunks' detached acceptance probabilities as targets (DeepSpec weighs it with
    the same position weights as the token loss), and the summed |sigmoid(confidence) - accept|."""
    logits = confidence.float()
    target = accept.to(logits.dtype)
    per_slot = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    zero = torch.zeros((), device=logits.device, dtype=logits.dtype)
    scale = 1.0 / denom.to(logits.dtype).clamp_min(1e-6)
    loss = factor * torch.where(valid, per_slot * weights.to(logits.dtype), zero).sum() * scale
    error = torch.where(valid, (logits.detach().sigmoid() - target).abs(), zero).sum()
    return loss, error
