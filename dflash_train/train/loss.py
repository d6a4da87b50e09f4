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


class _ChunkedLMHeadLoss(torch.autograd.Function):
    """sum(w * CE(hidden @ W^T, labels)) / denom, with the input gradient computed in forward.

    Also returns, without gradient, the rank of each label among the logits and its probability.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, denom, chunk_tokens):
        # hidden [N, H], labels/weights [N], denom: scalar tensor. Chunks hold whole blocks.
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        loss_sum = torch.zeros((), device=hidden.device, dtype=torch.float32)
        scale = 1.0 / denom.float().clamp_min(1e-6)
        ranks, probs_of_label = [], []
        for start in range(0, hidden.shape[0], chunk_tokens):
            sl = slice(start, start + chunk_tokens)
            logits = lm_head_logits(hidden[sl], weight).float()  # [c, V]: the one LM-head pass
            lab, w = labels[sl], weights[sl]
            lse = torch.logsumexp(logits, dim=-1)
            label_logit = logits.gather(1, lab[:, None]).squeeze(1)
            loss_sum += ((lse - label_logit) * w).sum()
            # Rank of the label among all logits gives hit@k without a top-k sort.
            ranks.append((logits > label_logit[:, None]).sum(-1))
            probs_of_label.append((label_logit - lse).exp())
            if grad_hidden is not None:
                probs = logits.sub_(lse[:, None]).exp_()  # softmax, reusing the logits buffer
                probs.scatter_add_(1, lab[:, None], torch.full_like(probs[:, :1], -1.0))
                probs.mul_((w * scale)[:, None])
                grad_hidden[sl] = probs.to(weight.dtype) @ weight
            del logits
        ctx.save_for_backward(grad_hidden)
        rank = torch.cat(ranks)
        label_prob = torch.cat(probs_of_label)
        ctx.mark_non_differentiable(rank, label_prob)
        return loss_sum * scale, rank, label_prob

    @staticmethod
    def backward(ctx, grad_loss, _grad_rank, _grad_prob):
        (grad_hidden,) = ctx.saved_tensors
        grad = None if grad_hidden is None else grad_hidden * grad_loss.to(grad_hidden.dtype)
        return grad, None, None, None, None, None


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
) -> tuple[Tensor, dict[str, Tensor]]:
    """Weighted block cross-entropy and its metrics from one LM-head pass per chunk.

    hidden[R,A,B,H] are the drafter outputs (final norm applied); block position 0 (the anchor) is
    never scored. labels[R,A,K] are ids[a+k] for k = 1..B-1 (same position, no shift),
    label_valid[R,A,K] marks in-bounds response labels, keep[R,A] the real anchors. ``denom`` is
    the sum of weights over every rank and micro-batch of the optimizer step, so the loss is
    normalised globally. Returns the loss and summed statistics (see ``block_metrics``).
    """
    num_rows, num_anchors, block_size, hidden_size = hidden.shape
    num_pred = block_size - 1
    weights = loss_weights(keep, label_valid, gamma)  # [R,A,K]
    flat_hidden = hidden[:, :, 1:].reshape(-1, hidden_size)
    flat_labels = labels.reshape(-1).clamp_min(0)
    chunk = max(1, chunk_tokens // num_pred) * num_pred  # whole blocks per chunk
    loss, rank, label_prob = _ChunkedLMHeadLoss.apply(
        flat_hidden, lm_head_weight, flat_labels, weights.reshape(-1), denom, chunk
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
