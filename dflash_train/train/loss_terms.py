"""Per-chunk terms of the DFlash loss: label statistics, the teacher's distribution, the weighted
objective with its logits gradient, and the D-PACE position weights.

Shapes (legend): c tokens of one chunk, V vocab, K predicted positions per block.

Written as plain tensor expressions so torch.compile fuses each into a few passes over the bf16
logits (``loss._compiled``); eager mode materialises fp32 temporaries of the chunk's size. Every
function computes in at least fp32 (fp64 inputs stay fp64, which the golden tests use).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def label_statistics(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(log-sum-exp [c], label logit [c], tie-aware rank of the label [c]) of logits [c, V].

    rank = number of ids a greedy decoder prefers over the label: a strictly larger logit, or an
    equal logit at a lower id (torch.argmax returns the first maximal index). So ``rank == 0`` is
    exactly ``argmax == label`` and ``rank < k`` is "the label is among the first k ids of the
    stable descending order": a tie never counts as a hit unless greedy decoding picks the label.
    """
    logits_f = logits.to(_compute_dtype(logits))
    lse = torch.logsumexp(logits_f, dim=-1)
    label_logit = logits_f.gather(1, labels[:, None]).squeeze(1)
    ids = torch.arange(logits.shape[1], device=logits.device)
    above = logits_f > label_logit[:, None]
    tied_before = (logits_f == label_logit[:, None]) & (ids < labels[:, None])
    rank = (above | tied_before).sum(-1)
    return lse, label_logit, rank


def teacher_distribution(teacher_logits: Tensor, topk: int) -> tuple[Tensor, Tensor]:
    """The teacher's probabilities [c, V] and their negative entropy sum p log p [c].

    ``topk == 0``: the full softmax. ``topk > 0``: the teacher's top ``topk`` ids, renormalised
    (zero elsewhere); the student is still scored against its full-vocabulary log-softmax.
    """
    t = teacher_logits.to(_compute_dtype(teacher_logits))
    if topk == 0:
        log_p = torch.log_softmax(t, dim=-1)
        probs = log_p.exp()
        return probs, (probs * log_p).sum(-1)
    values, ids = t.topk(topk, dim=-1)
    log_p = torch.log_softmax(values, dim=-1)
    probs = torch.zeros_like(t).scatter_(1, ids, log_p.exp())
    return probs, (log_p.exp() * log_p).sum(-1)


def loss_and_gradient(
    logits: Tensor,
    lse: Tensor,
    label_logit: Tensor,
    labels: Tensor,
    weights: Tensor,
    grad_scale: Tensor | None,
    teacher: tuple[Tensor, Tensor] | None,
    ce_coef: float,
    kl_coef: float,
) -> tuple[Tensor, Tensor | None]:
    """sum over tokens of w * (ce_coef * CE + kl_coef * KL(teacher || student)), and its gradient.

    The gradient with respect to the logits is w * grad_scale * ((ce_coef + kl_coef) * softmax -
    ce_coef * onehot(label) - kl_coef * teacher), in the logits' dtype (None without
    ``grad_scale``). Tokens of weight 0 are selected away: their loss and gradient are exactly 0
    even when their logits are not finite.
    """
    live = weights > 0
    zero = torch.zeros((), device=logits.device, dtype=lse.dtype)
    per_token = ce_coef * (lse - label_logit) if ce_coef else torch.zeros_like(lse)
    logits_f = logits.to(_compute_dtype(logits))
    if teacher is not None:
        probs_t, neg_entropy = teacher
        # KL = sum p_t (log p_t - log p_s) with log p_s = logits - lse and sum p_t = 1.
        kl = neg_entropy - (probs_t * logits_f).sum(-1) + lse
        per_token = per_token + kl_coef * kl
    loss_sum = torch.where(live, per_token * weights, zero).sum()
    if grad_scale is None:
        return loss_sum, None
    if logits_f.dtype != logits.dtype:  # softmax in place: the upcast copy is no longer needed
        grad = logits_f.sub_(lse[:, None]).exp_()
    else:  # logits_f is the caller's tensor: never modify an input
        grad = (logits_f - lse[:, None]).exp()
    total_coef = ce_coef + (kl_coef if teacher is not None else 0.0)
    if total_coef != 1.0:
        grad = grad.mul_(total_coef)
    if ce_coef:
        is_label = torch.arange(logits.shape[1], device=logits.device) == labels[:, None]
        grad = torch.where(is_label, grad - ce_coef, grad)
    if teacher is not None:
        grad = grad.sub_(teacher[0] * kl_coef)
    row_scale = torch.where(live, weights.to(lse.dtype) * grad_scale, zero)
    grad = torch.where(live[:, None], grad * row_scale[:, None], zero)
    return loss_sum, grad.to(logits.dtype)


def dpace_weights(label_prob: Tensor, valid: Tensor, alpha: float) -> Tensor:
    """D-PACE position weights [..., K] from the drafter's detached label probabilities [..., K].

    Following Wu et al. (arXiv 2605.18810): the acceptance of block position k is estimated by the
    smoothed confidence s_k = alpha + (1 - alpha) * q_k (q_k the probability of the label); the
    expected accepted length is surrogated by T = sum_j P_j with the prefix acceptance
    P_j = prod_{i<=j} s_i, and position k gets the weight dT / d log s_k = sum_{j>=k} P_j: a
    position weighs as much as the accepted length that depends on it. Unscored positions count as
    accepted (s = 1) and contribute no P_j; their weight is 0. No gradient flows through the weights.
    """
    q = label_prob.detach().to(torch.promote_types(label_prob.dtype, torch.float32))
    one = torch.ones((), device=q.device, dtype=q.dtype)
    smooth = torch.where(valid, alpha + (1.0 - alpha) * q, one)
    prefix = torch.cumprod(smooth, dim=-1)
    contribution = torch.where(valid, prefix, torch.zeros_like(prefix))
    suffix = contribution.flip(-1).cumsum(-1).flip(-1)
    return torch.where(valid, suffix, torch.zeros_like(suffix))
