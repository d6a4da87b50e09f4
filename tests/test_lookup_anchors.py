"""``train.lookup_anchor_weight``: which anchors prompt lookup would copy (checked against the eval's
n-gram proposer), the weighted draw (0 never draws them, the default leaves the draw untouched, the
weights are followed), and training with it (golden losses at the default, exact resume)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from dflash_train.data.anchors import sample_anchors, sample_packed_anchors
from dflash_train.data.lookup_anchors import lookup_anchor_weights, lookup_copies_block
from dflash_train.eval.proposers import NgramProposer
from tests.train_helpers import logged_losses, tiny_config, train_stopped_by_sigterm

WIDTH = 5  # the round: the anchor and 4 labels


def copies_by_the_eval_proposer(ids, loss_mask, starts, n, width):
    """Per anchor of one row, written out with the eval's ``NgramProposer`` on the anchor's own
    conversation (``starts``: its first positions): does its block equal every scored label?"""
    bounds = [*starts, len(ids)]
    copied = []
    for a in range(len(ids) - 1):
        begin = max(s for s in starts if s <= a)
        end = min(b for b in bounds if b > a)
        draft = NgramProposer(n).propose(ids[begin : a + 1], None, width).tokens
        scored = [k for k in range(1, width) if a + k < end and loss_mask[a + k]]
        copied.append(all(draft[k - 1] == ids[a + k] for k in scored))
    return copied


@pytest.mark.parametrize("packed", [False, True])
def test_lookup_copies_exactly_where_the_eval_proposer_does(packed):
    rng = random.Random(1)
    for _ in range(12):
        rows, length, n = 3, rng.randrange(8, 40), rng.randrange(1, 4)
        ids = [[rng.randrange(4) for _ in range(length)] for _ in range(rows)]
        mask = [[rng.random() < 0.8 for _ in range(length)] for _ in range(rows)]
        starts = [sorted({0, *rng.sample(range(1, length), 3)}) if packed else [0] for _ in range(rows)]
        positions = [[a - max(s for s in st if s <= a) for a in range(length)] for st in starts]
        got = lookup_copies_block(
            torch.tensor(ids),
            torch.tensor(mask),
            torch.tensor(positions) if packed else None,
            ngram_n=n,
            width=WIDTH,
        )
        want = [copies_by_the_eval_proposer(i, m, s, n, WIDTH) for i, m, s in zip(ids, mask, starts)]
        assert got.tolist() == want


LOOP = [7, 8, 9, 10, 11, 12] * 6  # a 6-token loop: from its second period lookup copies every block


def looping_row():
    ids = torch.tensor([[1, 2, 3, 4, *LOOP]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, :4] = False  # the prompt
    return ids, mask


def weights(ids, mask, weight, position_ids=None):
    train = SimpleNamespace(lookup_anchor_weight=weight, lookup_anchor_ngram_n=3)
    return lookup_anchor_weights(ids, mask, position_ids, train, WIDTH)


def test_weight_zero_never_draws_an_anchor_lookup_copies():
    ids, mask = looping_row()
    copied = lookup_copies_block(ids, mask, None, ngram_n=3, width=WIDTH)[0]
    # The first period and the anchors that start the second (suffixes not yet recurring) are not
    # copied; everything after is.
    assert not copied[4:10].any() and copied[12:-1].all()
    weight = weights(ids, mask, 0.0)
    packed_positions = torch.arange(ids.shape[1])[None]
    for seed in range(20):
        anchors, keep = sample_anchors(mask, 64, seed, 0, torch.tensor([seed]), weight)
        assert keep.any() and not copied[anchors[keep]].any()
        anchors, keep = sample_packed_anchors(
            mask, packed_positions, torch.full_like(ids, seed), 64, 1.0, seed, 0, weight
        )
        assert keep.any() and not copied[anchors[keep]].any()
    assert weights(ids, mask, 1.0) is None  # the default: the draw is not touched at all


def test_the_draw_follows_the_weights():
    """Two valid anchors per row, one copied by lookup with weight 1/4: drawn first in 1/5 of the
    rows (a draw without replacement proportional to the weights)."""
    rows = 4000
    mask = torch.zeros(rows, 4, dtype=torch.bool)
    mask[:, :3] = True  # valid anchors 0 and 1
    weight = torch.tensor([[0.25, 1.0, 1.0]]).expand(rows, 3)
    anchors, keep = sample_anchors(mask, 1, 0, 0, torch.arange(rows), weight)
    share = (anchors[:, 0] == 0).double().mean().item()
    assert keep.all() and abs(share - 0.2) < 0.025
    again, _ = sample_anchors(mask, 1, 0, 0, torch.arange(rows), weight)
    assert torch.equal(anchors, again)  # a pure function of (seed, epoch, sample index, weights)
    other_epoch, _ = sample_anchors(mask, 1, 0, 1, torch.arange(rows), weight)
    assert not torch.equal(anchors, other_epoch)


@pytest.mark.usefixtures("one_thread")
def test_a_run_with_the_weight_resumes_with_the_uninterrupted_losses(train_task, tmp_path):
    """SIGTERM inside step 4, resume: the same anchors and losses as the run without a stop, which
    differ from the uniform draw's; another weight on resume is refused."""
    from dflash_train.train.trainer import train

    extra = ("train.lookup_anchor_weight=0.0", "train.max_steps=8", "checkpoint.every_steps=100")
    train(tiny_config(train_task, tmp_path / "full", *extra))
    full = logged_losses(tmp_path / "full")
    train(tiny_config(train_task, tmp_path / "uniform", *extra[1:]))
    assert logged_losses(tmp_path / "uniform") != full

    out = tmp_path / "resumed"
    first = train_stopped_by_sigterm(tiny_config(train_task, out, *extra))
    assert first["step"] == 4
    with pytest.raises(ValueError, match="train.lookup_anchor_weight"):
        train(tiny_config(train_task, out, "train.lookup_anchor_weight=0.5", *extra[1:]))
    assert train(tiny_config(train_task, out, *extra))["step"] == 8
    assert logged_losses(out) == full


def test_the_weight_is_validated():
    from dflash_train.config import load_config

    base = ["target.path=x", "output_dir=y"]
    for bad in (
        "train.lookup_anchor_weight=-1",
        "train.lookup_anchor_weight=inf",
        "train.lookup_anchor_ngram_n=0",
    ):
        with pytest.raises(ValueError, match="lookup_anchor"):
            load_config("tiny-cpu", [*base, bad])


@pytest.mark.gpu
def test_cuda_finds_and_draws_what_the_cpu_does():
    """The lookup and the weighted draw on CUDA, at two shapes in turn, equal the CPU's (the keys'
    float64 log may differ in its last bit between devices: the draw is compared, not the keys)."""
    rng = random.Random(3)
    for rows, length in ((4, 96), (2, 257)):
        ids = torch.tensor([[rng.randrange(5) for _ in range(length)] for _ in range(rows)])
        mask = torch.rand(rows, length, generator=torch.Generator().manual_seed(length)) < 0.9
        index = torch.arange(rows)
        results = []
        for device in ("cpu", "cuda"):
            weight = weights(ids.to(device), mask.to(device), 0.25)
            anchors, keep = sample_anchors(mask.to(device), 16, 5, 2, index.to(device), weight)
            results.append((weight.cpu(), anchors.cpu(), keep.cpu()))
        assert all(torch.equal(a, b) for a, b in zip(*results))
