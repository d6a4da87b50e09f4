"""Fixed-shape batching, epoch order, data-parallel sharding, resume and stats."""

import json
from collections import Counter

import numpy as np
import pytest
import torch

from dflash_train.config import DataConfig
from dflash_train.data import Batch, build_train_data
from dflash_train.tiny import build_tokenizer

BUCKETS = [64, 128, 256]
BUDGET = 512  # rows per batch: 8, 4, 2


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    rows = []
    for i in range(37):
        reply = "for i in range(10):\n    print(i * i)\n" * (1 + i % 9)
        rows.append(
            {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": reply}]}
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_data(tokenizer, data_file, tmp_path, rank=0, world_size=1, seed=0, **overrides):
    settings = dict(
        seq_buckets=BUCKETS, token_budget=BUDGET, cache_dir=str(tmp_path / "cache"), num_workers=1
    )
    cfg = DataConfig(paths=[str(data_file)], **(settings | overrides))
    return build_train_data(cfg, tokenizer, seed=seed, rank=rank, world_size=world_size)


def one_epoch(data) -> list[Batch]:
    return list(data)


def test_batches_have_fixed_shapes_per_bucket(tokenizer, data_file, tmp_path):
    data = make_data(tokenizer, data_file, tmp_path)
    lengths = data.tokenized.lengths
    assert data.stats.rows_per_batch == {64: 8, 128: 4, 256: 2}
    seen = Counter()
    for batch in one_epoch(data):
        rows, length = batch.shape
        assert length in BUCKETS and rows == BUDGET // length
        assert batch.input_ids.dtype == torch.long and batch.sample_index.dtype == torch.long
        assert batch.loss_mask.dtype == torch.bool and batch.attention_mask.dtype == torch.bool
        for r, index in enumerate(batch.sample_index.tolist()):
            if index < 0:  # filler row
                assert not batch.attention_mask[r].any() and not batch.loss_mask[r].any()
                assert batch.input_ids[r].eq(tokenizer.pad_token_id).all()
                continue
            seen[index] += 1
            n = int(lengths[index])
            assert min(b for b in BUCKETS if b >= n) == length  # smallest bucket that fits
            ids, mask = data.tokenized.row(index)
            assert batch.input_ids[r, :n].tolist() == ids.tolist()
            assert batch.loss_mask[r, :n].tolist() == mask.tolist()
            assert batch.attention_mask[r].sum() == n and not batch.loss_mask[r, n:].any()
    assert seen == Counter(range(37))  # every row exactly once per epoch


def test_padding_waste_and_stats(tokenizer, data_file, tmp_path):
    data = make_data(tokenizer, data_file, tmp_path)
    batches = one_epoch(data)
    total = sum(b.input_ids.numel() for b in batches)
    real = sum(int(b.attention_mask.sum()) for b in batches)
    assert data.stats.padding_waste == pytest.approx(1 - real / total)
    assert data.stats.num_rows == 37 and data.stats.num_tokens == real
    assert data.stats.num_response_tokens == sum(int(b.loss_mask.sum()) for b in batches)
    assert sum(data.stats.rows_per_bucket.values()) == 37
    assert data.stats.steps_per_epoch == len(batches) == len(data)


def test_order_is_deterministic_and_changes_with_epoch_and_seed(tokenizer, data_file, tmp_path):
    a = make_data(tokenizer, data_file, tmp_path)
    b = make_data(tokenizer, data_file, tmp_path)
    order = [batch.sample_index.tolist() for batch in one_epoch(a)]
    assert order == [batch.sample_index.tolist() for batch in one_epoch(b)]
    assert order != [batch.sample_index.tolist() for batch in one_epoch(a)]  # epoch 1 differs
    other = make_data(tokenizer, data_file, tmp_path, seed=1)
    assert order != [batch.sample_index.tolist() for batch in one_epoch(other)]


def test_ranks_get_equal_steps_same_shapes_and_disjoint_rows(tokenizer, data_file, tmp_path):
    ranks = [make_data(tokenizer, data_file, tmp_path, rank=r, world_size=2) for r in range(2)]
    assert ranks[0].steps_per_epoch == ranks[1].steps_per_epoch
    epochs = [one_epoch(r) for r in ranks]
    seen = Counter()
    for b0, b1 in zip(*epochs):
        assert b0.shape == b1.shape  # same bucket on every rank at every step
        for batch in (b0, b1):
            seen.update(i for i in batch.sample_index.tolist() if i >= 0)
    assert seen == Counter(range(37))  # sharding covers the data exactly once
    stats = ranks[0].stats
    for length, num_batches in stats.batches_per_bucket.items():
        needed = -(-stats.rows_per_bucket[length] // stats.rows_per_batch[length])
        assert num_batches % 2 == 0 and needed <= num_batches < needed + 2  # filler batches only


@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_replays_the_uninterrupted_sequence(tokenizer, data_file, tmp_path, world_size):
    def stream(data, num_steps):
        out = []
        while len(out) < num_steps:
            for batch in data:
                out.append((batch.epoch, batch.sample_index.tolist()))
                if len(out) == num_steps:
                    return out
        return out

    for rank in range(world_size):
        reference = make_data(tokenizer, data_file, tmp_path, rank=rank, world_size=world_size)
        steps = reference.steps_per_epoch
        full = stream(reference, 3 * steps)
        for cut in (1, steps - 1, steps, steps + 2, 2 * steps):  # incl. the epoch boundary
            first = make_data(tokenizer, data_file, tmp_path, rank=rank, world_size=world_size)
            head = stream(first, cut)
            state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
            resumed = make_data(tokenizer, data_file, tmp_path, rank=rank, world_size=world_size)
            resumed.load_state_dict(state)
            assert head + stream(resumed, 3 * steps - cut) == full, (rank, cut)


def test_next_batch_crosses_epochs_and_matches_iteration(tokenizer, data_file, tmp_path):
    iterated = make_data(tokenizer, data_file, tmp_path)
    expected = [(b.epoch, b.sample_index.tolist()) for _ in range(2) for b in iterated]
    stepped = make_data(tokenizer, data_file, tmp_path)
    got = []
    for _ in range(len(expected)):
        batch, epoch = stepped.next_batch()
        assert batch.epoch == epoch
        got.append((epoch, batch.sample_index.tolist()))
    assert got == expected and stepped.state_dict()["epoch"] == 2
    assert set(stepped.log_stats()) >= {"rows", "tokens", "padding_waste", "skipped_rows"}


def test_state_dict_after_last_batch_points_to_next_epoch(tokenizer, data_file, tmp_path):
    data = make_data(tokenizer, data_file, tmp_path)
    for _ in data:
        state = data.state_dict()
    assert state == {"epoch": 1, "position": 0, "steps_per_epoch": data.steps_per_epoch}
    assert data.epoch == 1 and data.position == 0


def test_resume_with_different_data_is_refused(tokenizer, data_file, tmp_path):
    data = make_data(tokenizer, data_file, tmp_path)
    with pytest.raises(ValueError, match="data changed since the checkpoint"):
        data.load_state_dict({"epoch": 0, "position": 0, "steps_per_epoch": data.steps_per_epoch + 1})


@pytest.mark.parametrize("packing", [False, True])
def test_steps_per_epoch_at_another_world_size_is_what_that_world_size_builds(
    tokenizer, data_file, tmp_path, packing
):
    """A resume on another number of ranks checks the data against the checkpoint's epoch with it."""
    data = make_data(tokenizer, data_file, tmp_path, packing=packing)
    for world_size in (1, 2, 3, 7):
        built = make_data(tokenizer, data_file, tmp_path, world_size=world_size, packing=packing)
        assert data.steps_per_epoch_at(world_size) == built.steps_per_epoch
    assert data.steps_per_epoch_at(2) < data.steps_per_epoch


def test_overlong_truncate_and_drop(tokenizer, data_file, tmp_path):
    longest = [64, 128]
    truncate = make_data(tokenizer, data_file, tmp_path, overlong="truncate")
    num_long = int((truncate.tokenized.lengths > 128).sum())
    assert num_long > 0
    truncated = make_data(tokenizer, data_file, tmp_path, overlong="truncate", seq_buckets=longest)
    assert truncated.stats.skips.get("overlong_truncated") == num_long
    assert truncated.stats.num_rows == 37
    for batch in one_epoch(truncated):
        assert batch.shape[1] in longest
        assert (batch.loss_mask[:, :-1] & batch.loss_mask[:, 1:]).any(dim=1)[batch.sample_index >= 0].all()
    dropped = make_data(tokenizer, data_file, tmp_path, overlong="drop", seq_buckets=longest)
    assert dropped.stats.skips == {"overlong_dropped": num_long}
    assert dropped.stats.num_rows == 37 - num_long


def test_truncation_that_cuts_off_the_whole_response_drops_the_row(tokenizer, tmp_path):
    path = tmp_path / "long_prompt.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": "q " * 80},
                {"role": "assistant", "content": "def add(a, b)"},
            ]
        },
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "def add(a, b)"}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = make_data(tokenizer, path, tmp_path, seq_buckets=[32, 64], token_budget=64)
    assert data.stats.skips == {"truncated_without_anchor": 1}
    assert data.stats.num_rows == 1


def test_batch_to_moves_every_tensor(tokenizer, data_file, tmp_path):
    batch = next(iter(make_data(tokenizer, data_file, tmp_path)))
    moved = batch.to("cpu")
    assert isinstance(moved, Batch) and moved.epoch == batch.epoch
    assert torch.equal(moved.input_ids, batch.input_ids)
    assert np.array_equal(moved.sample_index.numpy(), batch.sample_index.numpy())


def distributed_worker(rank, init_file, good_path, bad_path, cache_dir, results):
    """One rank of a 2-process gloo group: a good dataset, then one with a malformed line."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        tokenizer = build_tokenizer()
        for path in (good_path, bad_path):
            cfg = DataConfig(paths=[path], seq_buckets=BUCKETS, token_budget=BUDGET, cache_dir=cache_dir)
            try:
                data = build_train_data(cfg, tokenizer, seed=0, rank=rank, world_size=2)
                results.put((rank, path, "ok", data.steps_per_epoch))
            except ValueError as err:
                results.put((rank, path, "error", str(err)))
    finally:
        dist.destroy_process_group()


def test_rank0_builds_the_cache_and_failures_reach_every_rank(data_file, tmp_path):
    import multiprocessing

    bad = tmp_path / "bad.jsonl"
    bad.write_text(data_file.read_text().splitlines()[0] + "\n{oops\n")
    ctx = multiprocessing.get_context("fork")  # children inherit the imports: seconds, not tens
    results = ctx.Queue()
    args = (str(tmp_path / "init"), str(data_file), str(bad), str(tmp_path / "cache"), results)
    procs = [ctx.Process(target=distributed_worker, args=(rank, *args)) for rank in range(2)]
    for p in procs:
        p.start()
    outcomes = {
        (r, path): (kind, value) for r, path, kind, value in (results.get(timeout=120) for _ in range(4))
    }
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    good = [outcomes[(r, str(data_file))] for r in range(2)]
    assert good[0][0] == "ok" and good[0] == good[1]
    assert outcomes[(0, str(bad))][0] == "error" and "bad.jsonl:2" in outcomes[(0, str(bad))][1]
    assert outcomes[(1, str(bad))][0] == "error" and "failed on rank 0" in outcomes[(1, str(bad))][1]
    assert len(list((tmp_path / "cache").iterdir())) == 1  # one cache, no leftover staging dirs
