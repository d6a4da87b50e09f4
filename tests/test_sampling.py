"""Batched sampling: nucleus draws, left padding and batch compaction change nothing about a row."""

import pytest
import torch

from dflash_train.generate import sampling
from dflash_train.generate.sampling import (
    Sampling,
    choose_tokens,
    row_streams,
    row_uniforms,
    sample_batch,
    step_keys,
)
from dflash_train.tiny import build_tiny_target


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_inverse_cdf_nucleus_draws():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(1000, 4)
    uniforms = (torch.arange(1000, dtype=torch.float32) + 0.5) / 1000
    drawn = choose_tokens(logits, uniforms, Sampling(temperature=1.0))
    assert torch.bincount(drawn, minlength=4).tolist() == [500, 300, 150, 50]
    nucleus = choose_tokens(logits, uniforms, Sampling(temperature=1.0, top_p=0.7))  # keeps 0.5 + 0.3
    assert torch.bincount(nucleus, minlength=4).tolist() == [625, 375, 0, 0]
    assert choose_tokens(logits[:3], uniforms[:3], Sampling()).tolist() == [0, 0, 0]  # greedy
    keys, steps = torch.tensor([7, 7, 8]), step_keys(5, "cpu")
    u = row_uniforms(row_streams(0, keys), steps[3])
    assert u[0] == u[1] and u[0] != u[2] and bool(((u >= 0) & (u < 1)).all())
    assert row_uniforms(row_streams(1, keys), steps[3])[0] != u[0]
    assert row_uniforms(row_streams(0, keys), steps[4])[0] != u[0]


def generate(model, prompts, keys, stop_ids, **kw):
    opts = dict(max_new_tokens=12, stop_ids=stop_ids, pad_id=0, sampling=Sampling(temperature=1.0, seed=3))
    return [(g.token_ids, g.finished) for g in sample_batch(model, prompts, keys, **(opts | kw))]


@pytest.mark.parametrize("kind", ["qwen3", "hybrid"])
def test_a_row_samples_the_same_alone_or_left_padded_in_a_batch(kind):
    model = build_tiny_target(kind, vocab_size=64, seed=1)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15]]
    batched = generate(model, prompts, [10, 11, 12], {63})
    alone = [generate(model, [p], [k], {63})[0] for p, k in zip(prompts, [10, 11, 12])]
    assert batched == alone
    other_key = generate(model, prompts[:1], [99], {63})[0]
    assert other_key != alone[0]


@pytest.mark.parametrize("kind", ["qwen3", "hybrid"])
def test_finished_rows_leave_the_batch_without_changing_the_others(monkeypatch, kind):
    model = build_tiny_target(kind, vocab_size=64, seed=2)
    prompts = [[1 + i, 2 + i, 3 + i] for i in range(8)]
    greedy = Sampling()
    first = [
        g.token_ids[0]
        for g in sample_batch(
            model, prompts, list(range(8)), max_new_tokens=1, stop_ids={63}, pad_id=0, sampling=greedy
        )
    ]
    stops = set(first[:6]) - set(first[6:])
    assert len(stops) >= 1  # some rows end at their first token
    calls = []
    real_compact = sampling.compact_cache
    monkeypatch.setattr(
        sampling, "compact_cache", lambda cache, keep: calls.append(len(keep)) or real_compact(cache, keep)
    )
    batched = generate(model, prompts, list(range(8)), stops, sampling=greedy, max_new_tokens=16)
    assert calls and calls[0] <= 4
    alone = [
        generate(model, [p], [k], stops, sampling=greedy, max_new_tokens=16)[0] for k, p in enumerate(prompts)
    ]
    assert batched == alone
    assert any(fin and not ids for ids, fin in batched)  # a row that stopped at once: finished, no tokens
    with_stops = sample_batch(
        model, prompts, list(range(8)), max_new_tokens=16, stop_ids=stops, pad_id=0, sampling=greedy
    )
    assert all((g.stop_id in stops) if g.finished else g.stop_id is None for g in with_stops)
