"""Anchor sampling: validity, uniformity, determinism, fixed shapes (DESIGN.md §1)."""

import pytest
import torch

from dflash_train.data.anchors import sample_anchors
from dflash_train.hashing import splitmix64


def make_mask():
    mask = torch.zeros(4, 24, dtype=torch.bool)
    mask[0, 4:20] = True  # 15 valid anchors (4..18)
    mask[1, 3] = True  # a single response token: no valid anchor
    mask[2, 2:4] = True  # exactly one valid anchor (2)
    mask[2, 10:13] = True  # two more (10, 11)
    mask[3, 22:24] = True  # one valid anchor at the very end (22)
    return mask


def valid_positions(mask_row):
    return {a for a in range(len(mask_row) - 1) if mask_row[a] and mask_row[a + 1]}


def test_splitmix64_matches_reference():
    # First outputs of the reference splitmix64 generator seeded with 0 (0xE220A8397B1DCDAF, ...).
    state = torch.tensor([0, 0x9E3779B97F4A7C15 - 2**64], dtype=torch.int64)
    expected = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]
    assert [v % 2**64 for v in splitmix64(state).tolist()] == expected


@pytest.mark.parametrize("num_anchors", [1, 3, 8, 40])
def test_shapes_validity_sorting_and_keep_count(num_anchors):
    mask = make_mask()
    anchors, keep = sample_anchors(mask, num_anchors, seed=1, epoch=0, sample_index=torch.arange(4))
    assert anchors.shape == keep.shape == (4, num_anchors)
    assert anchors.dtype == torch.long and keep.dtype == torch.bool
    for r in range(4):
        valid = valid_positions(mask[r])
        kept = anchors[r][keep[r]].tolist()
        assert len(kept) == min(num_anchors, len(valid))
        assert set(kept) <= valid and len(set(kept)) == len(kept)
        assert kept == sorted(kept)
        assert keep[r].tolist() == [True] * len(kept) + [False] * (num_anchors - len(kept))
        assert anchors[r][~keep[r]].eq(0).all()  # documented pad value


def test_determinism_and_epochs_differ():
    mask = make_mask()
    index = torch.tensor([7, 8, 9, 10])
    a1 = sample_anchors(mask, 4, seed=3, epoch=5, sample_index=index)
    a2 = sample_anchors(mask, 4, seed=3, epoch=5, sample_index=index)
    assert torch.equal(a1[0], a2[0]) and torch.equal(a1[1], a2[1])
    draws = {
        tuple(sample_anchors(mask, 4, seed=3, epoch=e, sample_index=index)[0][0].tolist()) for e in range(6)
    }
    assert len(draws) > 3
    other_seed = sample_anchors(mask, 4, seed=4, epoch=5, sample_index=index)[0][0]
    assert not torch.equal(other_seed, a1[0][0])


def test_a_row_draws_the_same_anchors_in_any_batch():
    """Pure function of (seed, epoch, sample_index, position): batch placement does not matter."""
    mask = make_mask()
    index = torch.tensor([11, 12, 13, 14])
    full, _ = sample_anchors(mask, 5, seed=0, epoch=2, sample_index=index)
    flipped, _ = sample_anchors(mask.flip(0), 5, seed=0, epoch=2, sample_index=index.flip(0))
    assert torch.equal(full, flipped.flip(0))
    alone, _ = sample_anchors(mask[2:3], 5, seed=0, epoch=2, sample_index=index[2:3])
    assert torch.equal(alone[0], full[2])


def test_uniform_over_valid_positions():
    """Chi-square of per-position counts over many epochs, 8 valid positions, 3 drawn each time."""
    mask = torch.zeros(1, 12, dtype=torch.bool)
    mask[0, 2:11] = True  # valid anchors 2..9
    num_epochs, num_anchors = 2000, 3
    counts = torch.zeros(12)
    pairs = set()
    for epoch in range(num_epochs):
        anchors, keep = sample_anchors(mask, num_anchors, seed=0, epoch=epoch, sample_index=torch.tensor([0]))
        counts.index_add_(0, anchors[0][keep[0]], torch.ones(int(keep.sum())))
        pairs.add(tuple(anchors[0].tolist()))
    expected = num_epochs * num_anchors / 8
    observed = counts[2:10]
    assert counts[:2].sum() == 0 and counts[10:].sum() == 0
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 24.3  # 7 degrees of freedom, p = 0.001
    assert len(pairs) == 56  # every 3-subset of 8 positions shows up


def test_filler_rows_get_no_anchors():
    mask = torch.zeros(2, 16, dtype=torch.bool)
    anchors, keep = sample_anchors(mask, 4, seed=0, epoch=0, sample_index=torch.tensor([-1, -1]))
    assert not keep.any() and anchors.eq(0).all()


@pytest.mark.gpu
def test_cpu_and_cuda_draw_identical_anchors():
    mask = make_mask()
    index = torch.arange(4)
    cpu = sample_anchors(mask, 6, seed=9, epoch=1, sample_index=index)
    gpu = sample_anchors(mask.cuda(), 6, seed=9, epoch=1, sample_index=index.cuda())
    assert torch.equal(cpu[0], gpu[0].cpu()) and torch.equal(cpu[1], gpu[1].cpu())
