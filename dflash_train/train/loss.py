"""The DFlash loss and its metrics from one LM-head pass per chunk of block tokens.

Shapes (legend): R rows, A anchors, B block size, K = B - 1 predicted positions, H hidden, V vocab,
N = R*A*K scored tokens, c tokens of one chunk.

The frozen target LM head turns the drafter's hidden states into logits. Materialising all
``[N, V]`` logits is impossible at scale (N = 8K block tokens x 248K vocab = 8 GB in fp32), and
computing them again for backward, metrics and top-k is what made earlier systems slow. Here each
chunk of whole blocks goes through the LM head exactly once, in forward: that single pass yields
the loss, the gradient with respect to the hidden states (the head is frozen, so no weight gradient
is needed), and every metric. Backward only scales the stored gradient.

Objectives (``LossOptions``, docs/training.md "Loss options"): hard-label cross-entropy (``ce``),
forward KL to the target's own next-token distribution (``kl``, the teacher's logits are computed
chunk by chunk in the same pass), or their sum; position weights are the fixed decay
exp(-(k-1)/gamma) or D-PACE weights (Wu et al., "D-PACE: Dynamic Position-Aware Cross-Entropy for
Parallel Speculative Drafting", arXiv 2605.18810) from the drafter's own detached label probabilities.
Entries of weight 0 (filler anchors, prompt or out-of-row labels) are *selected away* with
``torch.where``, never multiplied by 0, so a non-finite value there cannot reach the loss, the
gradient or a metric.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash_train.models.drafter import DraftOutput
from dflash_train.train import loss_terms
from dflash_train.train.loss_options import DEFAULT_OPTIONS, LossOptions
from dflash_train.train.loss_terms import dpace_weights
from dflash_train.train.variant_terms import MarkovGrads, SelectorGrads, confidence_loss, total_variation_term

TOPK = (1, 4, 16)
# Rows of the per-position statistics tensor returned with the loss.
STAT_NAMES = ("weight", "valid", "top1", "top4", "top16", "label_prob")


def lm_head_logits(hidden: Tensor, weight: Tensor) -> Tensor:
    """The student's LM-head matmul; a separate function so tests can count calls."""
    return hidden @ weight.t()


def teacher_logits(hidden: Tensor, weight: Tensor) -> Tensor:
    """The teacher's LM-head matmul (the target's final-norm hidden states); counted apart from the
    student's so tests can check that the student's head still runs once per chunk."""
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


def teacher_block_hidden(final_hidden: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """The teacher's hidden state for each block label: final_hidden[R,L,H] -> [R,A,K,H].

    The label of block position k is ids[a+k]; the target predicts that token from position a+k-1,
    so the teacher of block position k is the target's final-norm output at a+k-1 (positions a ..
    a+B-2). Positions past the row are clamped (their labels are invalid and carry weight 0).
    """
    seq_len, hidden_size = final_hidden.shape[1], final_hidden.shape[2]
    offsets = torch.arange(0, block_size - 1, device=anchors.device)
    positions = (anchors[..., None] + offsets).clamp(max=seq_len - 1)  # [R,A,K]
    index = positions.flatten(1)[..., None].expand(-1, -1, hidden_size)
    return final_hidden.gather(1, index).view(*positions.shape, hidden_size)


def loss_weights(keep: Tensor, label_valid: Tensor, gamma: float) -> Tensor:
    """w[r,a,k] = keep * inbounds * loss_mask * exp(-(k-1)/gamma) for predicted positions k = 1..B-1.

    ``label_valid[R,A,K]`` already folds in-bounds and the loss mask of the label position.
    """
    num_pred = label_valid.shape[-1]
    k = torch.arange(num_pred, device=label_valid.device, dtype=torch.float32)  # k-1 for k = 1..B-1
    decay = torch.exp(-k / gamma)
    return keep[..., None].float() * label_valid.float() * decay


def denominator_weights(
    keep: Tensor, label_valid: Tensor, gamma: float, options: LossOptions = DEFAULT_OPTIONS
) -> Tensor:
    """What one micro-batch adds to the loss denominator (sum it, then over micro-batches and ranks).

    ``decay``: the decay weights themselves, so the loss is a weighted mean. ``dpace``: one per kept
    block, so the loss is the D-PACE objective per block: its weights come from the drafter's own
    predictions, which do not exist before the forward pass, so they cannot normalise a loss whose
    denominator must be known, across micro-batches, before the first backward.
    """
    if options.weighting == "dpace":
        return keep.float()
    return loss_weights(keep, label_valid, gamma)


@dataclass(frozen=True)
class _ChunkSpec:
    """Static arguments of the chunked loss (whole blocks per chunk)."""

    chunk_tokens: int
    num_pred: int
    fused: bool
    options: LossOptions
    selector_top_k: int = 0


@functools.cache
def _compiled(fn):
    """``fn`` compiled once per process (CUDA): the fp32 [c, V] temporaries of eager mode become a
    few fused passes over the bf16 logits (~25 GB -> ~3 GB of traffic per 2K-token chunk at a 248K
    vocab). Created on first use so importing this module stays cheap."""
    return torch.compile(fn)


def _terms(name: str, fused: bool):
    fn = getattr(loss_terms, name)
    return _compiled(fn) if fused else fn


def chunk_weights(
    label_prob: Tensor,
    valid: Tensor,
    decay_weights: Tensor | None,
    sl: slice,
    opts: LossOptions,
    num_pred: int,
) -> Tensor:
    """Weights [c] of one chunk's tokens: its slice of the decay weights, or D-PACE weights from the
    chunk's own label probabilities (a chunk holds whole blocks of ``num_pred`` tokens)."""
    if opts.weighting != "dpace":
        return decay_weights[sl]
    per_block = dpace_weights(label_prob.view(-1, num_pred), valid.view(-1, num_pred), opts.dpace_alpha)
    return per_block.view(-1)


class _ChunkedLMHeadLoss(torch.autograd.Function):
    """sum(w * objective(hidden @ W^T)) / denom, with the input gradient computed in forward.

    Also returns, without gradient, each label's tie-aware rank among the logits, its probability,
    the weight each token got (D-PACE weights are only known here), with DFlash2's selector inputs
    (``gate`` [N, r], ``table`` [V, r]) whether the selector's pick is the label, and with a teacher
    for DSpark's TV term or confidence target the probability ``1 - TV / 2`` that the target accepts
    the draft (empty tensors otherwise). DSpark's Markov head adds ``latent @ bias_table^T``
    (latent [N, r], bias_table [V, r]) to the logits before everything else.
    """

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        teacher_hidden,
        labels,
        valid,
        decay_weights,
        denom,
        spec,
        gate,
        table,
        latent,
        bias_table,
    ):
        # hidden [N, H]; teacher_hidden [N, H] or None; labels/valid/decay_weights [N]; denom scalar.
        opts, num_pred = spec.options, spec.num_pred
        needs_grad = ctx.needs_input_grad[0]
        grad_hidden = torch.empty_like(hidden) if needs_grad else None
        selector = SelectorGrads.start(gate, table, needs_grad)
        markov = MarkovGrads.start(latent, bias_table, needs_grad)
        acc_dtype = torch.promote_types(hidden.dtype, torch.float32)  # fp64 in the golden tests
        loss_sum = torch.zeros((), device=hidden.device, dtype=acc_dtype)
        scale = 1.0 / denom.to(acc_dtype).clamp_min(1e-6)
        ranks, probs_of_label, used, accepts = [], [], [], []
        for start in range(0, hidden.shape[0], spec.chunk_tokens):
            sl = slice(start, start + spec.chunk_tokens)
            logits = lm_head_logits(hidden[sl], weight)  # [c, V]: the student's one LM-head pass
            if markov is not None:
                logits = logits + markov.bias(sl, logits.dtype)
            lse, label_logit, rank = _terms("label_statistics", spec.fused)(logits, labels[sl])
            label_prob = (label_logit - lse).exp()
            w = chunk_weights(label_prob, valid[sl], decay_weights, sl, opts, num_pred)
            teacher, t_logits = None, None
            if opts.needs_teacher:  # the teacher's head pass; its [c, V] logits live only for this chunk
                t_logits = teacher_logits(teacher_hidden[sl], weight)
            if opts.uses_kl:
                teacher = _terms("teacher_distribution", spec.fused)(t_logits, opts.kl_topk)
                if not opts.needs_accept_rate:
                    t_logits = None  # KL alone: the teacher's logits are done with
            chunk_loss, grad_logits = _terms("loss_and_gradient", spec.fused)(
                logits, lse, label_logit, labels[sl], w, scale if needs_grad else None,
                teacher, opts.ce_coef, opts.kl_coef,
            )  # fmt: skip
            if selector is not None:
                chunk_loss = chunk_loss + selector.add_chunk(
                    logits, labels[sl], sl, w, spec, scale, grad_logits
                )
            if opts.needs_accept_rate:
                tv_loss, accept = total_variation_term(
                    logits, lse, t_logits, w * opts.tv_weight, scale if needs_grad else None, grad_logits
                )
                chunk_loss = chunk_loss + tv_loss
                accepts.append(accept)
            loss_sum += chunk_loss
            ranks.append(rank)
            probs_of_label.append(label_prob)
            used.append(w)
            if grad_logits is not None:
                grad_hidden[sl] = grad_logits.to(weight.dtype) @ weight
                if markov is not None:
                    markov.add_grads(grad_logits, sl)
            del logits, grad_logits, teacher, t_logits
        ctx.save_for_backward(grad_hidden, *SelectorGrads.grads_of(selector), *MarkovGrads.grads_of(markov))
        rank, label_prob, used_weights = torch.cat(ranks), torch.cat(probs_of_label), torch.cat(used)
        empty = hidden.new_zeros(0)
        correct = empty.bool() if selector is None else torch.cat(selector.correct)
        accept = torch.cat(accepts) if accepts else empty
        ctx.mark_non_differentiable(rank, label_prob, used_weights, correct, accept)
        return loss_sum * scale, rank, label_prob, used_weights, correct, accept

    @staticmethod
    def backward(ctx, grad_loss, *_grads_of_statistics):
        grads = [None if g is None else g * grad_loss.to(g.dtype) for g in ctx.saved_tensors]
        grad_hidden, gate, table, latent, bias_table = grads
        return grad_hidden, None, None, None, None, None, None, None, gate, table, latent, bias_table


def chunked_lm_head_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    weights: Tensor,
    denom: Tensor,
    chunk_tokens: int,
    fused: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """The decay-weighted CE core on flat tokens: hidden [N, H], labels/weights [N] -> (loss, rank,
    label probability). For benchmarks of the chunked LM head alone."""
    spec = _ChunkSpec(chunk_tokens, 1, fused, DEFAULT_OPTIONS)
    loss, rank, label_prob, _, _, _ = _ChunkedLMHeadLoss.apply(
        hidden, weight, None, labels, weights > 0, weights, denom, spec, None, None, None, None
    )
    return loss, rank, label_prob


def dflash_loss(
    hidden: Tensor, lm_head_weight: Tensor, labels: Tensor, label_valid: Tensor, keep: Tensor, **kwargs
):
    """``draft_loss`` of a DFlash drafter's block outputs hidden[R,A,B,H] (final norm applied):
    block position 0, the anchor, is never scored; position k is scored against ids[a+k]."""
    return draft_loss(
        DraftOutput(hidden=hidden[:, :, 1:]), lm_head_weight, labels, label_valid, keep, **kwargs
    )


def draft_loss(
    out: DraftOutput,
    lm_head_weight: Tensor,
    labels: Tensor,
    label_valid: Tensor,
    keep: Tensor,
    *,
    gamma: float,
    denom: Tensor,
    chunk_tokens: int = 2048,
    fused: bool = False,
    options: LossOptions = DEFAULT_OPTIONS,
    teacher_hidden: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The block loss of ``options`` and its metrics from one student LM-head pass per chunk.

    ``out`` is the drafter's ``forward_train(..., heads=True)``: ``out.hidden[R,A,K,H]`` are the
    final-norm states of the K scored slots, the k-th (1-based) predicting labels[R,A,K] = ids[a+k]
    (no shift); DFlash2's selector inputs and DSpark's Markov and confidence heads add their terms
    (``train/variant_terms.py``). label_valid[R,A,K] marks in-bounds response
    labels, keep[R,A] the real anchors. ``denom`` is the sum of ``denominator_weights`` over every
    rank and micro-batch of the optimizer step, so the loss is normalised globally.
    ``teacher_hidden[R,A,K,H]`` (``teacher_block_hidden``) is required by a KL loss and DSpark's
    TV / confidence terms. ``fused`` runs
    each chunk's softmax, rank and gradient through compiled kernels (CUDA). Returns the loss and
    summed statistics (see ``block_metrics``).
    """
    num_rows, num_anchors, num_pred, hidden_size = out.hidden.shape
    check_loss_inputs(options, teacher_hidden, (num_rows, num_anchors, num_pred, hidden_size), lm_head_weight)
    valid = label_valid & keep[..., None]
    decay = loss_weights(keep, label_valid, gamma) if options.weighting == "decay" else None
    flat_teacher = None if teacher_hidden is None else teacher_hidden.reshape(-1, hidden_size)
    spec = _ChunkSpec(
        max(1, chunk_tokens // num_pred) * num_pred, num_pred, fused, options, out.selector_top_k
    )
    loss, rank, label_prob, weights, correct, accept = _ChunkedLMHeadLoss.apply(
        out.hidden.reshape(-1, hidden_size),
        lm_head_weight,
        flat_teacher if options.needs_teacher else None,
        labels.reshape(-1).clamp_min(0),
        valid.reshape(-1),
        None if decay is None else decay.reshape(-1),
        denom,
        spec,
        flat_rows(out.selector_gate),
        out.selector_table,
        flat_rows(out.markov_latent),
        out.markov_table,
    )
    shape = (num_rows, num_anchors, num_pred)
    served = correct.view(shape) if correct.numel() else None
    stats = block_metrics(weights.view(shape), valid, rank.view(shape), label_prob.view(shape), keep, served)
    if out.confidence is not None and options.confidence_weight > 0:
        confidence, stats["confidence_abs_err"] = confidence_loss(
            out.confidence, accept.view(shape), weights.view(shape), valid, denom, options.confidence_weight
        )
        loss = loss + confidence
    return loss, stats


def flat_rows(x: Tensor | None) -> Tensor | None:
    """[..., r] -> [N, r] (None stays None)."""
    return None if x is None else x.reshape(-1, x.shape[-1])


def check_loss_inputs(
    options: LossOptions, teacher_hidden: Tensor | None, shape: tuple[int, ...], weight: Tensor
) -> None:
    """A KL loss (and DSpark's TV / confidence terms) need the teacher's hidden states of every scored
    token, and a top-k within V."""
    if not options.needs_teacher:
        return
    if teacher_hidden is None or tuple(teacher_hidden.shape) != shape:
        got = None if teacher_hidden is None else tuple(teacher_hidden.shape)
        raise ValueError(
            f"train.loss={options.loss!r} (tv_weight={options.tv_weight}, confidence_weight="
            f"{options.confidence_weight}) needs teacher hidden states of shape {shape} (teacher_block_hidden "
            f"of the target's final-norm output), got {got}."
        )
    if options.kl_topk > weight.shape[0]:
        raise ValueError(
            f"train.kl_topk={options.kl_topk} exceeds the vocabulary ({weight.shape[0]}): use 0 for the "
            "full vocabulary or a smaller k."
        )


def block_metrics(
    weights: Tensor,
    valid: Tensor,
    rank: Tensor,
    label_prob: Tensor,
    keep: Tensor,
    served_correct: Tensor | None = None,
) -> dict[str, Tensor]:
    """Per-position sums (top-1/4/16 hits, label probability, counts) and simulated acceptance.

    A top-1 hit is exactly greedy decoding's choice (argmax, ties to the lowest id); top-k counts
    the label among the first k ids in that order. tau per block = 1 + number of leading positions
    whose top-1 prediction is right, the real greedy acceptance length when the labels are the
    target's greedy continuation. ``served_correct`` (DFlash2: the selector's teacher-forced pick
    is the label) replaces the top-1 hit in ``top1`` and tau, and the head's own top-1 becomes
    ``head_top1``. Invalid entries are selected away (``torch.where``), so a NaN there never reaches
    a sum. All values are sums on the device (no host sync).
    """
    validf = valid.float()
    zero = torch.zeros((), device=weights.device)
    stats = {
        "weight": torch.where(valid, weights, zero).sum(),
        "valid": validf.sum((0, 1)),
        "label_prob": torch.where(valid, label_prob.float(), zero).sum((0, 1)),
    }
    for k in TOPK:
        stats[f"top{k}"] = ((rank < k) & valid).float().sum((0, 1))
    correct = (rank == 0) & valid
    if served_correct is not None:
        stats["head_top1"] = stats["top1"]
        correct = served_correct & valid
        stats["top1"] = correct.float().sum((0, 1))
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
    if "head_top1" in host:
        out["head_acc_by_pos"] = [round(float(x), 5) for x in host["head_top1"] / valid]
    if "confidence_abs_err" in host:
        out["confidence_abs_error"] = float(host["confidence_abs_err"] / valid.sum())
    out["label_prob_by_pos"] = [round(float(x), 5) for x in host["label_prob"] / valid]
    out["scored_tokens"] = float(host["valid"].sum())
    return out
