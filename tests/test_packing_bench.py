"""``dflash-train bench lengths``: buckets against packing on a length distribution."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflash_train.bench.lengths import LENGTH_DISTRIBUTIONS, load_lengths
from dflash_train.cli import main


def test_named_distributions_are_seeded_and_clipped():
    for name in LENGTH_DISTRIBUTIONS:
        lengths, responses, _ = load_lengths(name, 4096)
        again, _, _ = load_lengths(name, 4096)
        assert np.array_equal(lengths, again) and lengths.max() <= 4096 and lengths.min() >= 8
        assert (responses < lengths).all() and (responses >= 2).all()
    short, _, _ = load_lengths("short-chat", 4096)
    assert np.median(short) < 512  # most of a short-chat mix fits well under the smallest bucket


def test_length_file_errors_name_file_and_line(tmp_path):
    path = tmp_path / "lengths.jsonl"
    path.write_text('{"length": 12, "response_tokens": 5}\n40\n{"tokens": 3}\n')
    with pytest.raises(ValueError, match=r"lengths.jsonl:3: expected an integer or an object with 'length'"):
        load_lengths(str(path), 256)
    with pytest.raises(ValueError, match="not a file nor one of"):
        load_lengths(str(tmp_path / "missing.jsonl"), 256)
    path.write_text('{"length": 12, "response_tokens": 5}\n{"num_tokens": 40}\n')
    lengths, responses, _ = load_lengths(str(path), 256)
    assert lengths.tolist() == [12, 40] and responses.tolist() == [8, 28]  # one row lacks a count: 30% prompt


def test_tiny_length_bench_compares_buckets_and_packing(tmp_path, capsys):
    rng = np.random.default_rng(0)
    path = tmp_path / "lengths.jsonl"
    path.write_text("".join(json.dumps({"length": int(n)}) + "\n" for n in rng.integers(12, 90, size=48)))
    args = ["bench", "lengths", str(path), "--preset", "tiny", "--steps", "2", "--warmup", "0", "--json"]
    assert main(args) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert "bench lengths buckets" in captured.err and "bench lengths packing" in captured.err  # the bars
    buckets, packing = result["modes"]["buckets"], result["modes"]["packing"]
    assert result["conversations"] == 48 and result["buckets"] == [64, 128, 256]
    assert packing["padding_waste_epoch"] < buckets["padding_waste_epoch"]
    assert (
        packing["conversations_per_row"] > 2 and buckets["batch_shapes"] >= 1 and packing["batch_shapes"] == 1
    )
    for mode in (buckets, packing):
        assert mode["real_tokens_per_s"] > 0 and 0 <= mode["padding_waste_timed"] < 1
        assert mode["real_tokens_per_s"] <= mode["batch_tokens_per_s"]
    assert result["packing_speedup"] > 0
    assert result["target_kernels"]["compile"] == "none (target.compile off)"  # tiny: compile off


def test_every_bucket_compiles_its_layer_graphs_once_before_the_timed_steps(tmp_path, monkeypatch):
    """Five buckets x the tiny drafter's 2 layer graphs per shape = 10 compiled graphs of one code
    object: past dynamo's default limit of 8, which would leave the last shapes eager for the run."""
    import torch
    from torch._dynamo.utils import counters

    from dflash_train.bench.lengths import LengthsBenchOptions, run_length_bench
    from dflash_train.bench.train_step import bench_config

    compile_module = torch.nn.Module.compile  # dynamo's graph count does not depend on the backend
    monkeypatch.setattr(
        torch.nn.Module, "compile", lambda self, **kw: compile_module(self, **{**kw, "backend": "eager"})
    )
    rng = np.random.default_rng(0)
    path = tmp_path / "lengths.jsonl"
    path.write_text("".join(json.dumps({"length": int(n)}) + "\n" for n in rng.integers(10, 250, size=40)))
    args = LengthsBenchOptions(preset="tiny", lengths=str(path), compile=True, steps=2, warmup=0)
    cfg, seq_len, _ = bench_config(args)
    # The default limit, restored afterwards. Not monkeypatch: its undo leaves dynamo's config
    # entry hidden ("recompile_limit does not exist"), which breaks every later flex_attention call.
    with torch._dynamo.config.patch(recompile_limit=8):
        torch._dynamo.reset()
        counters.clear()
        try:
            result = run_length_bench(args, cfg, seq_len, torch.device("cpu"), buckets=[16, 32, 64, 128, 256])
            graphs = counters["stats"]["unique_graphs"]
        finally:
            torch._dynamo.reset()
    buckets, packing = result["modes"]["buckets"], result["modes"]["packing"]
    # layer 0 (input without gradient) and layer 1 per shape; packing's one shape is the 256 bucket's
    assert buckets["batch_shapes"] == 5 and graphs == 10
    assert buckets["compiled_graphs_warmup"] == 10 and packing["compiled_graphs_warmup"] == 0
    for mode in (buckets, packing):
        assert mode["compiled_graphs_timed"] == 0 and mode["eager_fallbacks"] == 0
        assert mode["warmup_s"] > 0


def test_the_lengths_mode_times_the_full_step_only():
    from dflash_train.bench.lengths import LengthsBenchOptions

    with pytest.raises(ValueError, match="drop --drafter-only/--profile"):
        LengthsBenchOptions(preset="tiny", lengths="short-chat", drafter_only=True)
