"""The DFlash loss and its metrics from one LM-head pass per chunk of block tokens.

Shapes (legend): R rows, A anchors, B block size, K = B - 1 predicted positions, H hidden, V vocab,
N = R*A*K scored tokens.

The frozen target LM head turns the drafter's hidden states into logits. Materialising all
``[N, V]`` logits is impossible at scale (N = 8K block tokens x 248K vocab = 8 GB in fp32), and
computing them again for backward, metrics and top-k is what made earlier systems slow. Here each
chunk of whole blocks goes through the LM head exactly once, in forward: that single pass yields
the weighted cross-entropy, the gradient with respect to the hidden states (the head is frozen, so
no weight gradient is needed), and every metric. Backward only scales the stored gradient.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

TOPK = (1, 4, 16)
# Rows of the per-position statistics tensor returned with the loss.
STAT_NAMES = ("weight", "valid", "top1", "top4", "top16", "label_prob")


def lm_head_logits(hidden: Tensor, weight: Tensor) -> Tensor:
    """The LM-head matmul; a separate function so tests can count calls."""
    return hidden @ weight.t()


def block_targets(
    input_ids: Tensor, loss_mask: Tensor, anchors: Tensor, block_size: int
) -> tuple[Tensor, Tensor]:
    """Labels ids[a+k] for k = 1..B-1 (same position as the prediction, no shift) and their validity.

    A label is valid when a+k is inside the row and is a response token (loss_mask).
    """
    seq_len = input_ids.shape[1]
    offsets = torch.arange(1, block_size, device=anchors.device)
    positions = anchors[..., None] + offsets  # [R,A,K]
    in_bounds = positions < seq_len
    flat = positions.clamp(max=seq_len - 1).flatten(1)
    labels = input_ids.gather(1, flat).view_as(positions)
    label_valid = in_bounds & loss_mask.gather(1, flat).view_as(positions).bool()
    return labels, label_valid


def loss_weights(keep: Tensor, label_valid: Tensor, gamma: float) -> Tensor:
    """w[r,a,k] = keep * inbounds * loss_mask * exp(-(k-1)/gamma) for predicted positions k = 1..B-1.

    ``label_valid[R,A,K]`` already folds in-bounds and the loss mask of the label position.
    """
    num_pred = label_valid.shape[-1]
    k = torch.arange(num_pred, device=label_valid.device, dtype=torch.float32)  # k-1 for k = 1..B-1
    decay = torch.exp(-k / gamma)
    return keep[..., None].float() * label_valid.float() * decay


def chunk_loss_terms(
    logits: Tensor, labels: Tensor, grad_scale: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Everything the loss needs from one chunk of LM-head logits [c, V].

    Returns the log-sum-exp [c], the label logit [c], the label's rank among the logits [c] (hit@k
    without a top-k sort) and, when ``grad_scale`` [c] is given, d(loss)/d(logits) =
    (softmax - onehot(label)) * grad_scale in the logits' dtype. Written as plain tensor
    expressions so torch.compile fuses them into a few passes over the bf16 logits; eager mode
    materialises fp32 temporaries of the chunk's size instead.
    """
    logits32 = logits.float()
    lse = torch.logsumexp(logits32, dim=-1)
    label_logit = logits32.gather(1, labels[:, None]).squeeze(1)
    rank = (logits32 > label_logit[:, None]).sum(-1)
    if grad_scale is None:
        return lse, label_logit, rank, None
    probs = logits32.sub_(lse[:, None]).exp_()  # softmax in place: logits32 is no longer needed
    is_label = torch.arange(logits.shape[1], device=logits.device) == labels[:, None]
    grad = torch.where(is_label, probs - 1.0, probs).mul_(grad_scale[:, None])
    return lse, label_logit, rank, grad.to(logits.dtype)


@functools.cache
def compiled_chunk_loss_terms():
    """``chunk_loss_terms`` compiled once per process (CUDA): ~25 GB -> ~3 GB of memory traffic per
    2K-token chunk at a 248K vocab. Created on first use so importing this module stays cheap."""
    return torch.compile(chunk_loss_terms)


class _ChunkedLMHeadLoss(torch.autograd.Function):
    """sum(w * CE(hidden @ W^T, labels)) / denom, with the input gradient computed in forward.

    Also returns, without gradient, the rank of each label among the logits and its probability.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, denom, chunk_tokens, fused):
        # hidden [N, H], labels/weights [N], denom: scalar tensor. Chunks hold whole blocks.
        terms = compiled_chunk_loss_terms() if fused else chunk_loss_terms
        needs_grad = ctx.needs_input_grad[0]
        grad_hidden = torch.empty_like(hidden) if needs_grad else None
        loss_sum = torch.zeros((), device=hidden.device, dtype=torch.float32)
        scale = 1.0 / denom.float().clamp_min(1e-6)
        ranks, probs_of_label = [], []
        for start in range(0, hidden.shape[0], chunk_tokens):
            sl = slice(start, start + chunk_tokens)
            logits = lm_head_logits(hidden[sl], weight)  # [c, V]: the one LM-head pass
            w = weights[sl]
            lse, label_logit, rank, grad_logits = terms(logits, labels[sl], w * scale if needs_grad else None)
            loss_sum += ((lse - label_logit) * w).sum()
            ranks.append(rank)
            probs_of_label.append((label_logit - lse).exp())
            if grad_logits is not None:
                grad_hidden[sl] = grad_logits.to(weight.dtype) @ weight
            del logits, grad_logits
        ctx.save_for_backward(grad_hidden)
        rank = torch.cat(ranks)
        label_prob = torch.cat(probs_of_label)
        ctx.mark_non_differentiable(rank, label_prob)
        return loss_sum * scale, rank, label_prob

    @staticmethod
    def backward(ctx, grad_loss, _grad_rank, _grad_prob):
        (grad_hidden,) = ctx.saved_tensors
        grad = None if grad_hidden is None else grad_hidden * grad_loss.to(grad_hidden.dtype)
        return grad, None, None, None, None, None, None


def dflash_loss(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    label_valid: Tensor,
    keep: Tensor,
    *,
    gamma: float,
    denom: Tensor,
    chunk_tokens: int = 2048,
    fused: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Weighted block cross-entropy and its metrics from one LM-head pass per chunk.

    hidden[R,A,B,H] are the drafter outputs (final norm applied); block position 0 (the anchor) is
    never scored. labels[R,A,K] are ids[a+k] for k = 1..B-1 (same position, no shift),
    label_valid[R,A,K] marks in-bounds response labels, keep[R,A] the real anchors. ``denom`` is
    the sum of weights over every rank and micro-batch of the optimizer step, so the loss is
    normalised globally. ``fused`` runs each chunk's softmax, rank and gradient through the compiled
    ``chunk_loss_terms`` (CUDA). Returns the loss and summed statistics (see ``block_metrics``).
    """
    num_rows, num_anchors, block_size, hidden_size = hidden.shape
    num_pred = block_size - 1
    weights = loss_weights(keep, label_valid, gamma)  # [R,A,K]
    flat_hidden = hidden[:, :, 1:].reshape(-1, hidden_size)
    flat_labels = labels.reshape(-1).clamp_min(0)
    chunk = max(1, chunk_tokens // num_pred) * num_pred  # whole blocks per chunk
    loss, rank, label_prob = _ChunkedLMHeadLoss.apply(
        flat_hidden, lm_head_weight, flat_labels, weights.reshape(-1), denom, chunk, fused
    )
    shape = (num_rows, num_anchors, num_pred)
    stats = block_metrics(
        weights, label_valid & keep[..., None], rank.view(shape), label_prob.view(shape), keep
    )
    return loss, stats


def block_metrics(
    weights: Tensor, valid: Tensor, rank: Tensor, label_prob: Tensor, keep: Tensor
) -> dict[str, Tensor]:
    """Per-position sums (top-1/4/16 hits, label probability, counts) and simulated acceptance.

    tau per block = 1 + number of leading positions whose top-1 prediction is right, which is the
    real greedy acceptance length when the labels are the target's greedy continuation. All values
    are sums on the device (no host sync); ``summarize_metrics`` turns them into means.
    """
    validf = valid.float()
    stats = {
        "weight": weights.sum(),
        "valid": validf.sum((0, 1)),
        "label_prob": (label_prob * validf).sum((0, 1)),
    }
    for k in TOPK:
        stats[f"top{k}"] = ((rank < k) & valid).float().sum((0, 1))
    correct = (rank == 0) & valid
    accepted = correct.long().cumprod(dim=-1).sum(-1)  # [R,A]
    stats["tau_sum"] = ((1 + accepted).float() * keep.float()).sum()
    stats["blocks"] = keep.float().sum()
    return stats


def add_metrics(total: dict[str, Tensor] | None, new: dict[str, Tensor]) -> dict[str, Tensor]:
    """Accumulate ``block_metrics`` sums across micro-batches."""
    if total is None:
        return {k: v.detach().clone() for k, v in new.items()}
    for k, v in new.items():
        total[k] += v.detach()
    return total


def summarize_metrics(total: dict[str, Tensor]) -> dict[str, float | list[float]]:
    """Means from summed statistics (call after the cross-rank all-reduce, on a log step)."""
    host = {k: v.double().cpu() for k, v in total.items()}  # one host transfer per log step
    valid = host["valid"].clamp_min(1)
    out: dict[str, float | list[float]] = {
        "tau": float(host["tau_sum"] / max(float(host["blocks"]), 1.0)),
        "acc": float(host["top1"].sum() / valid.sum()),
    }
    for k in TOPK:
        out[f"top{k}_by_pos"] = [round(float(x), 5) for x in host[f"top{k}"] / valid]
    out["acc_by_pos"] = out.pop("top1_by_pos")
    out["label_prob_by_pos"] = [round(float(x), 5) for x in host["label_prob"] / valid]
    out["scored_tokens"] = float(host["valid"].sum())
    return out
