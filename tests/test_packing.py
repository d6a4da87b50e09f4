"""Packing (data.packing): packed rows, their epoch plan and resume, per-conversation anchors, the
drafter's document masks, and the loss of a packed row against the same conversations unpacked."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dflash_train.config import DataConfig, load_config
from dflash_train.data import build_train_data
from dflash_train.data.anchors import sample_anchors, sample_packed_anchors
from dflash_train.data.batching import assemble_batch, assemble_packed_batch, first_fit_decreasing
from dflash_train.models.masks import (
    ChunkedSdpaAttention,
    LayerMaskSpec,
    build_flex_block_mask,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*")
BUCKETS, BUDGET = [64, 128, 256], 512


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    rows = []
    for i in range(41):
        reply = "for i in range(10):\n    print(i * i)\n" * (1 + i % 7) + ("x " * 200 if i == 5 else "")
        rows.append(
            {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": reply}]}
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_data(tokenizer, data_file, tmp_path, rank=0, world_size=1, seed=0, **overrides):
    settings = dict(
        seq_buckets=BUCKETS,
        token_budget=BUDGET,
        cache_dir=str(tmp_path / "cache"),
        num_workers=1,
        packing=True,
    )
    cfg = DataConfig(paths=[str(data_file)], **(settings | overrides))
    return build_train_data(cfg, tokenizer, seed=seed, rank=rank, world_size=world_size)


def conversations_of(batch) -> list[tuple[int, int, int]]:
    """(sample index, row, start) of every conversation in a packed batch."""
    found = []
    for r in range(batch.shape[0]):
        index, positions = batch.token_sample_index[r].tolist(), batch.position_ids[r].tolist()
        found += [(index[p], r, p) for p in range(len(index)) if positions[p] == 0 and index[p] >= 0]
    return found


# ------------------------------------------------------------------------------------ batching


def test_first_fit_decreasing_fills_bins_within_capacity():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 100, size=500)
    bins = first_fit_decreasing(lengths, rng.permutation(500), capacity=128, window=64)
    members = np.concatenate(bins)
    assert sorted(members.tolist()) == list(range(500))  # every item exactly once
    assert max(lengths[b].sum() for b in bins) <= 128
    # Tighter than one item per bin, and near the ideal: sum / capacity.
    assert len(bins) < 500 and len(bins) <= 1.15 * lengths.sum() / 128 + 8


def test_packed_rows_hold_whole_conversations_with_their_own_positions(tokenizer, data_file, tmp_path):
    data = make_data(tokenizer, data_file, tmp_path)
    rows = BUDGET // BUCKETS[-1]
    seen = []
    for batch in data:
        assert batch.shape == (rows, BUCKETS[-1]) and batch.packed
        for index, r, start in conversations_of(batch):
            ids, mask = data.tokenized.row(index)
            n = min(len(ids), BUCKETS[-1])
            assert batch.input_ids[r, start : start + n].tolist() == list(ids[:n])
            assert batch.loss_mask[r, start : start + n].tolist() == list(mask[:n])
            assert batch.position_ids[r, start : start + n].tolist() == list(range(n))
            seen.append(index)
        assert (batch.attention_mask == (batch.token_sample_index >= 0)).all()
    assert sorted(seen) == sorted(int(i) for i in data.row_index)  # each conversation once per epoch
    assert data.stats.packing and data.stats.conversations_per_row > 1.5


def test_packing_wastes_less_than_buckets(tokenizer, data_file, tmp_path):
    packed = make_data(tokenizer, data_file, tmp_path)
    bucketed = make_data(tokenizer, data_file, tmp_path, packing=False)
    assert packed.stats.padding_waste < bucketed.stats.padding_waste
    assert packed.stats.num_tokens == bucketed.stats.num_tokens


def test_overlong_conversation_follows_the_policy(tokenizer, data_file, tmp_path):
    dropped = make_data(tokenizer, data_file, tmp_path, overlong="drop")
    truncated = make_data(tokenizer, data_file, tmp_path, overlong="truncate")
    assert dropped.stats.skips.get("overlong_dropped") == 1
    assert truncated.stats.skips.get("overlong_truncated") == 1
    longest = int(np.argmax(truncated.tokenized.lengths))
    for batch in truncated:
        for index, r, start in conversations_of(batch):
            if index == longest:
                assert start == 0 and (batch.token_sample_index[r] == index).all()  # a full row alone


def plan(data, epoch):
    return [
        [
            sorted(int(i) for i in b.token_sample_index.flatten().unique() if i >= 0)
            for b in [data.batch_at(epoch, s)]
        ]
        for s in range(data.steps_per_epoch)
    ]


def test_plan_is_deterministic_per_seed_and_epoch_with_fixed_steps(tokenizer, data_file, tmp_path):
    a, b = make_data(tokenizer, data_file, tmp_path), make_data(tokenizer, data_file, tmp_path)
    other_seed = make_data(tokenizer, data_file, tmp_path, seed=1)
    assert plan(a, 0) == plan(b, 0) and plan(a, 1) == plan(b, 1)
    assert plan(a, 0) != plan(a, 1) and plan(a, 0) != plan(other_seed, 0)
    for epoch in range(4):  # the same number of steps every epoch, every conversation once
        assert len(a.pack.groups(epoch)) == a.steps_per_epoch
        members = [m for group in a.pack.groups(epoch) for rank in group for row in rank for m in row]
        assert sorted(members) == list(range(len(a.row_index)))


def test_resume_replays_the_same_packed_batches(tokenizer, data_file, tmp_path):
    full = make_data(tokenizer, data_file, tmp_path)
    stream = [full.next_batch()[0] for _ in range(full.steps_per_epoch + 3)]
    first = make_data(tokenizer, data_file, tmp_path)
    for _ in range(full.steps_per_epoch - 1):
        first.next_batch()
    resumed = make_data(tokenizer, data_file, tmp_path)
    resumed.load_state_dict(first.state_dict())
    for expected in stream[full.steps_per_epoch - 1 :]:
        got = resumed.next_batch()[0]
        assert torch.equal(got.input_ids, expected.input_ids)
        assert torch.equal(got.token_sample_index, expected.token_sample_index)


def test_ranks_share_one_shape_and_split_the_conversations(tokenizer, data_file, tmp_path):
    ranks = [make_data(tokenizer, data_file, tmp_path, rank=r, world_size=2) for r in range(2)]
    assert ranks[0].steps_per_epoch == ranks[1].steps_per_epoch
    seen = [i for data in ranks for batch in data for i, _, _ in conversations_of(batch)]
    assert sorted(seen) == sorted(int(i) for i in ranks[0].row_index)


def test_packing_refuses_split_placement():
    with pytest.raises(ValueError, match="placement=split"):
        load_config("tiny-cpu", ["data.packing=true", "train.placement=split", "train.target_ranks=1"])


# ------------------------------------------------------------------------------------ anchors


def toy_packed(lengths_per_row, length, response_from=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows, indices, k = [], [], 0
    for lengths in lengths_per_row:
        row = []
        for n in lengths:
            ids = torch.randint(0, 250, (n,), generator=g).numpy()
            mask = np.arange(n) >= response_from
            row.append((ids, mask))
        rows.append(row)
        indices.append(list(range(k, k + len(lengths))))
        k += len(lengths)
    return assemble_packed_batch(rows, indices, len(rows), length, pad_id=0), rows, indices


def packed_anchor_draw(batch, num_anchors, per_token, seed=3, epoch=1):
    return sample_packed_anchors(
        batch.loss_mask, batch.position_ids, batch.token_sample_index, num_anchors, per_token, seed, epoch
    )


def test_packed_anchors_stay_inside_one_conversation():
    batch, _, _ = toy_packed([[10, 7, 12], [20, 3]], length=40)
    anchors, keep = packed_anchor_draw(batch, num_anchors=40, per_token=1.0)
    for r in range(2):
        for a in anchors[r][keep[r]].tolist():
            assert batch.loss_mask[r, a] and batch.loss_mask[r, a + 1]
            assert batch.token_sample_index[r, a] == batch.token_sample_index[r, a + 1]
    # All valid positions (a in [2, n-2]) are anchors when nothing caps them: 7 + 4 + 9 and 17 + 0.
    assert keep.sum(dim=1).tolist() == [20, 17]


def test_anchor_budget_is_per_conversation_and_never_starves_a_short_one():
    batch, _, _ = toy_packed([[60, 6, 60]], length=128)
    anchors, keep = packed_anchor_draw(batch, num_anchors=12, per_token=12 / 128)
    owners = batch.token_sample_index[0, anchors[0][keep[0]]].tolist()
    counts = [owners.count(c) for c in range(3)]
    # Caps ceil(60 * 12/128) = 6, 6 and ceil(6 * 12/128) = 1 add up to 13 > 12 slots: the short one
    # keeps its anchor and one long conversation gives up its sixth.
    assert counts[1] == 1 and sorted([counts[0], counts[2]]) == [5, 6]
    # When the caps add up to more than the row's slots, every conversation keeps its first anchor.
    many, _, _ = toy_packed([[8] * 8], length=64)
    anchors, keep = packed_anchor_draw(many, num_anchors=8, per_token=1.0)
    assert sorted(many.token_sample_index[0, anchors[0][keep[0]]].tolist()) == list(range(8))


def test_one_conversation_draws_the_same_anchors_packed_or_alone():
    batch, rows, indices = toy_packed([[9, 30, 14]], length=64)
    packed, keep = packed_anchor_draw(batch, num_anchors=64, per_token=5 / 30)
    start = 9
    alone = assemble_batch([rows[0][1]], [indices[0][1]], 1, 64, pad_id=0)
    single, single_keep = sample_anchors(alone.loss_mask, 5, 3, 1, alone.sample_index)
    mine = [a - start for a in packed[0][keep[0]].tolist() if batch.token_sample_index[0, a] == indices[0][1]]
    assert mine == single[0][single_keep[0]].tolist()


# ------------------------------------------------------------------------------------ masks


def dense_visible(spec, anchors, context_start, context_len, block):
    """DESIGN.md visibility plus the conversation bound, pair by pair: [R, A*B, P + A*B]."""
    rows, num_anchors = anchors.shape
    out = torch.zeros(rows, num_anchors * block, context_len + num_anchors * block, dtype=torch.bool)
    for r in range(rows):
        for i in range(num_anchors * block):
            s, k = divmod(i, block)
            a, lo = int(anchors[r, s]), int(context_start[r, s])
            for p in range(context_len):
                ok = lo <= p < a and (spec.window is None or p >= a + k - (spec.window - 1))
                out[r, i, p] = ok
            for j in range(num_anchors * block):
                t, kk = divmod(j, block)
                out[r, i, context_len + j] = t == s and (not spec.causal or kk <= k)
    return out


@pytest.mark.parametrize("spec", [LayerMaskSpec(None, False), LayerMaskSpec(8, True)])
def test_block_masks_never_reach_another_conversation(spec):
    block, context_len = 4, 300
    anchors = torch.tensor([[3, 40, 41, 190, 250, 299], [0, 10, 60, 61, 270, 280]])
    context_start = torch.tensor([[0, 30, 41, 41, 140, 140], [0, 5, 5, 61, 61, 275]])
    expected = dense_visible(spec, anchors, context_start, context_len, block)
    sdpa = ChunkedSdpaAttention(anchors, context_len, block, spec, chunk=6, context_start=context_start)
    assert torch.equal(sdpa.masks[0][:, 0], expected)
    flex = build_flex_block_mask(anchors, context_len, block, spec, context_start=context_start)
    rows, queries, keys = (torch.arange(n) for n in expected.shape)
    pairs = flex.mask_mod(rows[:, None, None], 0, queries[None, :, None], keys[None, None, :])
    assert torch.equal(pairs, expected)
    reference = build_flex_block_mask(
        anchors, context_len, block, spec, method="create_block_mask", context_start=context_start
    )
    # The analytic tile classification honours the bound exactly as evaluating the rule does.
    assert torch.equal(flex.to_dense(), reference.to_dense())
    assert torch.equal(flex.kv_num_blocks, reference.kv_num_blocks)
    assert torch.equal(flex.full_kv_num_blocks, reference.full_kv_num_blocks)
    unbounded = dense_visible(spec, anchors, torch.zeros_like(context_start), context_len, block)
    assert not torch.equal(expected, unbounded)  # the bound hides context the plain rule shows


def test_data_stats_reports_the_waste_of_both_modes(data_file, tmp_path, tiny_hybrid_dir, capsys):
    from dflash_train.data.stats import run_data_stats

    overrides = [
        f"target.path={tiny_hybrid_dir}",
        f"data.paths=[{data_file}]",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"data.seq_buckets={BUCKETS}".replace(" ", ""),
        f"data.token_budget={BUDGET}",
    ]
    bucketed = run_data_stats("tiny-cpu", overrides)
    packed = run_data_stats("tiny-cpu", [*overrides, "data.packing=true"])
    assert "padding waste: buckets" in capsys.readouterr().out
    assert not bucketed["packing"] and packed["packing"]
    for result in (bucketed, packed):  # the same two numbers whichever mode the recipe uses
        assert result["padding_waste_buckets"] == bucketed["padding_waste"]
        assert result["padding_waste_packed"] == packed["padding_waste"]
    assert packed["padding_waste"] < bucketed["padding_waste"] and packed["conversations_per_row"] > 1


def test_a_later_epoch_that_packs_worse_keeps_the_step_count(monkeypatch):
    """Epoch 0 fixes the capacity; a draw needing more rows is redrawn, and at worst epoch 0's rows
    come back in a new order: never more steps, never a dropped conversation."""
    import dflash_train.data.packing as packing

    lengths = np.random.default_rng(0).integers(5, 60, size=200)
    plan = packing.PackingPlan(lengths, seed=0, capacity=64, rows=4, window=50, world_size=2)
    worse = [np.array([i]) for i in range(200)]  # one conversation per row: far over capacity
    draws = []
    monkeypatch.setattr(plan, "_draw", lambda epoch, attempt: draws.append(attempt) or worse)
    rows = plan.packed_rows(3)
    assert draws == list(range(packing.MAX_ATTEMPTS))  # every redraw tried, then the fallback
    as_tuples = [tuple(r.tolist()) for r in rows]
    base = [tuple(r.tolist()) for r in plan.base]
    assert sorted(as_tuples) == sorted(base) and as_tuples != base
    assert len(plan.groups(3)) == plan.steps_per_epoch
