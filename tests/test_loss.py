import pytest
import torch
from torch import Tensor

from dflash_train.train import loss as loss_mod
from dflash_train.train.loss import (
    LossOptions,
    add_metrics,
    block_targets,
    denominator_weights,
    dflash_loss,
    loss_weights,
    summarize_metrics,
)


def make_case(seed=0, rows=2, anchors=5, block=4, hidden=16, vocab=50):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, anchors, block, hidden, generator=g, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=g) * 0.3
    labels = torch.randint(0, vocab, (rows, anchors, block - 1), generator=g)
    valid = torch.rand(rows, anchors, block - 1, generator=g) > 0.2
    keep = torch.rand(rows, anchors, generator=g) > 0.3
    return h, w, labels, valid, keep


def naive_dflash_loss(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    label_valid: Tensor,
    keep: Tensor,
    *,
    gamma: float,
    denom: Tensor,
) -> Tensor:
    """Reference: full logits and plain cross-entropy, written straight from DESIGN.md."""
    weights = loss_weights(keep, label_valid, gamma)
    logits = (hidden[:, :, 1:] @ lm_head_weight.t()).float()
    ce = torch.nn.functional.cross_entropy(
        logits.flatten(0, 2), labels.reshape(-1).clamp_min(0), reduction="none"
    )
    return (ce * weights.reshape(-1)).sum() / denom.float().clamp_min(1e-6)


@pytest.mark.parametrize("chunk_tokens", [1, 3, 7, 1000])
def test_chunked_loss_equals_naive_loss_and_gradients(chunk_tokens):
    h, w, labels, valid, keep = make_case()
    denom = loss_weights(keep, valid, 7.0).sum() * 1.5  # as if other ranks contributed weight too
    loss, _ = dflash_loss(h, w, labels, valid, keep, gamma=7.0, denom=denom, chunk_tokens=chunk_tokens)
    (grad,) = torch.autograd.grad(loss * 3.0, h)
    h2 = h.detach().clone().requires_grad_(True)
    ref = naive_dflash_loss(h2, w, labels, valid, keep, gamma=7.0, denom=denom)
    (ref_grad,) = torch.autograd.grad(ref * 3.0, h2)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)
    assert grad[:, :, 0].abs().sum() == 0  # the anchor position is never scored


def test_loss_weights_follow_the_design_formula():
    keep = torch.tensor([[True, False]])
    valid = torch.tensor([[[True, True, False, True], [True, True, True, True]]])
    w = loss_weights(keep, valid, gamma=7.0)
    expected = torch.tensor([1.0, torch.exp(torch.tensor(-1 / 7)), 0.0, torch.exp(torch.tensor(-3 / 7))])
    torch.testing.assert_close(w[0, 0], expected)
    assert w[0, 1].sum() == 0


def test_one_lm_head_pass_per_chunk(monkeypatch):
    calls = []
    real = loss_mod.lm_head_logits
    monkeypatch.setattr(loss_mod, "lm_head_logits", lambda h, w: calls.append(h.shape[0]) or real(h, w))
    h, w, labels, valid, keep = make_case(rows=2, anchors=5, block=4)  # 30 scored tokens
    loss, stats = dflash_loss(h, w, labels, valid, keep, gamma=7.0, denom=torch.tensor(10.0), chunk_tokens=9)
    loss.backward()
    summarize_metrics(stats)
    assert calls == [9, 9, 9, 3]  # forward only: backward, metrics and top-k reuse it


def test_metrics_match_hand_computed_values():
    vocab = 8
    w = torch.eye(vocab)
    # One row, two anchors, block 4 -> three predicted positions each; logits = one-hot of a chosen id.
    chosen = torch.tensor([[[0, 1, 2, 3], [0, 5, 6, 7]]])
    h = torch.nn.functional.one_hot(chosen, vocab).float() * 10
    labels = torch.tensor(
        [[[1, 2, 4], [5, 0, 7]]]
    )  # block 0: right, right, wrong; block 1: right, wrong, right
    valid = torch.ones(1, 2, 3, dtype=torch.bool)
    keep = torch.ones(1, 2, dtype=torch.bool)
    _, stats = dflash_loss(h, w, labels, valid, keep, gamma=7.0, denom=torch.tensor(1.0))
    out = summarize_metrics(add_metrics(None, stats))
    assert out["tau"] == pytest.approx((3 + 2) / 2)  # accepted prefix lengths 2 and 1
    assert out["acc_by_pos"] == [1.0, 0.5, 0.5]
    # Block 0, position 3: label 4 ties at logit 0 with ids 0, 1, 2, which greedy order puts first
    # (after id 3), so it is 5th, not in the top 4; block 1's label 0 is 2nd.
    assert out["top4_by_pos"] == [1.0, 1.0, 0.5]
    assert out["label_prob_by_pos"][0] > 0.99


def test_no_valid_tokens_gives_zero_loss_not_nan():
    h, w, labels, valid, keep = make_case()
    keep = torch.zeros_like(keep)
    loss, stats = dflash_loss(h, w, labels, valid, keep, gamma=7.0, denom=torch.tensor(0.0))
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(h.grad).all()
    assert summarize_metrics(stats)["tau"] == 0.0


def test_block_targets_are_same_position_labels():
    ids = torch.arange(100, 110)[None]  # ids[p] = 100 + p
    loss_mask = torch.zeros(1, 10, dtype=torch.bool)
    loss_mask[0, 3:9] = True
    anchors = torch.tensor([[3, 7]])
    labels, valid = block_targets(ids, loss_mask, anchors, block_size=4)
    assert labels.tolist() == [[[104, 105, 106], [108, 109, 109]]]  # a+k for k=1..3 (clamped past the end)
    assert valid.tolist() == [
        [[True, True, True], [True, False, False]]
    ]  # 9 is a prompt token, 10 is out of bounds


@pytest.mark.gpu
def test_compiled_chunk_terms_match_the_naive_loss_on_cuda():
    h, w, labels, valid, keep = (t.cuda() for t in make_case(rows=3, anchors=40, block=8, vocab=3000))
    h = h.detach().requires_grad_(True)
    denom = loss_weights(keep, valid, 7.0).sum()
    results = []
    for fused in (False, True):
        loss, stats = dflash_loss(
            h, w, labels, valid, keep, gamma=7.0, denom=denom, chunk_tokens=50, fused=fused
        )
        (grad,) = torch.autograd.grad(loss, h)
        results.append((loss, grad, stats["top1"], stats["label_prob"]))
    ref = naive_dflash_loss(h, w, labels, valid, keep, gamma=7.0, denom=denom)
    torch.testing.assert_close(results[1][0], ref, rtol=1e-5, atol=1e-6)
    for eager, fused in zip(results[0], results[1], strict=True):
        torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------- weight-0 entries


@pytest.mark.parametrize(
    "options",
    [
        LossOptions(),
        LossOptions(weighting="dpace"),
        LossOptions(loss="ce+kl", kl_topk=5),
    ],
    ids=["ce", "dpace", "ce+kl"],
)
def test_nan_in_a_weight_zero_block_reaches_neither_loss_gradient_nor_metrics(options):
    h, w, labels, valid, keep = make_case(rows=2, anchors=5, block=4)
    keep[0, 1], keep[1, 3] = False, True
    valid[1, 3, 2] = False  # an out-of-row / prompt label inside a kept block
    planted = h.detach().clone()
    planted[0, 1] = float("nan")  # a filler block (keep = 0)
    planted[1, 3, 3] = float("inf")  # the hidden state of the invalid label
    planted.requires_grad_(True)
    teacher = torch.randn(2, 5, 3, 16)
    teacher[0, 1] = float("nan")
    denom = denominator_weights(keep, valid, 7.0, options).sum()
    loss, stats = dflash_loss(
        planted, w, labels, valid, keep, gamma=7.0, denom=denom, chunk_tokens=6,
        options=options, teacher_hidden=teacher,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, planted)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert grad[0, 1].abs().sum() == 0 and grad[1, 3, 3].abs().sum() == 0
    assert all(torch.isfinite(v).all() for v in stats.values())
    # The finite entries give the same loss as a run without the planted values.
    clean, _ = dflash_loss(
        h, w, labels, valid, keep, gamma=7.0, denom=denom, chunk_tokens=6,
        options=options, teacher_hidden=teacher.nan_to_num(0.0),
    )  # fmt: skip
    torch.testing.assert_close(loss, clean)


# ----------------------------------------------------------------------------- greedy ties


def greedy_ranks(logits: Tensor, labels: Tensor) -> Tensor:
    """Reference: the label's place in greedy order (descending logit, ties to the lower id)."""
    order = torch.sort(-logits, dim=-1, stable=True).indices
    return (order == labels[..., None]).int().argmax(-1)


def test_top1_is_argmax_and_ties_go_to_the_lower_id():
    vocab = 6
    w = torch.eye(vocab)
    # Every logit is 0 or 1: ties everywhere. Labels tie with the maximum at a lower or higher id.
    logits = torch.tensor([[[0, 1, 0, 0, 1, 0], [0, 1, 0, 0, 1, 0], [1, 1, 1, 1, 1, 1]]]).float()
    h = torch.cat([torch.zeros(1, 1, vocab), logits], dim=1)[None]  # [1,1,4,V], position 0 unscored
    labels = torch.tensor([[[1, 4, 3]]])  # hit (first max), miss (tied, later id), miss (5 ids before it)
    valid = torch.ones(1, 1, 3, dtype=torch.bool)
    keep = torch.ones(1, 1, dtype=torch.bool)
    _, stats = dflash_loss(h, w, labels, valid, keep, gamma=7.0, denom=torch.tensor(1.0))
    out = summarize_metrics(stats)
    assert out["acc_by_pos"] == [1.0, 0.0, 0.0]
    assert out["top4_by_pos"] == [1.0, 1.0, 1.0]  # ranks 0, 1, 3
    assert out["tau"] == 2.0  # one accepted, then the tie at position 2 rejects like greedy decoding


def test_hits_match_greedy_order_on_heavily_tied_logits():
    g = torch.Generator().manual_seed(3)
    vocab, rows, anchors, block = 20, 3, 8, 5
    h = torch.randint(0, 3, (rows, anchors, block, vocab), generator=g).float()  # logits = h (W = I)
    labels = torch.randint(0, vocab, (rows, anchors, block - 1), generator=g)
    valid = torch.ones(rows, anchors, block - 1, dtype=torch.bool)
    keep = torch.ones(rows, anchors, dtype=torch.bool)
    _, stats = dflash_loss(
        h, torch.eye(vocab), labels, valid, keep, gamma=7.0, denom=torch.tensor(1.0), chunk_tokens=8
    )
    logits = h[:, :, 1:]
    ranks = greedy_ranks(logits, labels)
    assert torch.equal(stats["top1"], (logits.argmax(-1) == labels).float().sum((0, 1)))
    for k in (1, 4, 16):
        assert torch.equal(stats[f"top{k}"], (ranks < k).float().sum((0, 1)))
    accepted = (logits.argmax(-1) == labels).long().cumprod(-1).sum(-1)
    assert stats["tau_sum"] == (1 + accepted).sum()
