"""``dflash-train bench generation`` on CPU: engines side by side, the agreement verdict and the
decode-step profile, in one JSON object (the GPU figures come from the same mode on one H200)."""

from __future__ import annotations

import json

import pytest

from dflash_train.cli import main

pytestmark = pytest.mark.usefixtures("one_thread_module")


def test_the_generation_mode_reports_engines_agreement_and_the_decode_profile(tmp_path, capsys):
    out = tmp_path / "generation.json"
    code = main([
        "bench", "generation", "--preset", "tiny-qwen3", "--device", "cpu", "--num-prompts", "3",
        "--batch-sizes", "2", "--max-new-tokens", "64", "--engines", "padded,slots,slots-flex",
        "--profile", "--sampler-shapes", "3x256,2x1000", "--attention-shapes", "3x256", "--out", str(out), "--no-progress", "--json",
    ])  # fmt: skip
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result == json.loads(out.read_text()) | {"out": str(out)}
    assert [(r["engine"], r["status"]) for r in result["runs"]] == [
        ("padded", "ok"), ("slots", "ok"), ("slots-flex", "ok"),
    ]  # fmt: skip
    assert [r["decode_attention"] for r in result["runs"][1:]] == ["grouped", "flex"]
    assert all(a["rows_identical"] == 3 and a["num_clear_divergences"] == 0 for a in result["agreement"])
    profile = result["profiles"][0]
    assert profile["status"] == "ok" and profile["step_ms"] > 0 and profile["step_over_floor"] > 1
    assert profile["traffic_bytes_per_step"]["kv"] > 0 and 0 <= profile["copy_share"] < 1
    assert profile["compile_decode"] is False and profile["kernels_per_step"] is None  # no kernels on a CPU
    assert [(r["rows"], r["vocab"], r["status"]) for r in result["sampler"]] == [
        (3, 256, "ok"),
        (2, 1000, "ok"),
    ]
    for record in result["sampler"]:
        assert record["sort_ms"] > 0 and record["exact_ms"] > 0 and record["exact_compiled_ms"] > 0
        assert record["nucleus_rows_differing"] == 0
    (attention,) = result["attention"]
    assert (attention["slots"], attention["kv"], attention["status"]) == (3, 256, "ok")
    # tiny-qwen3's head layout, each kernel timed and equal to the fp32 reference (fp32 here)
    assert (attention["heads"], attention["kv_heads"]) == (4, 2)
    assert 0 < attention["live_mb"] < attention["bucket_mb"]
    for kernel in ("grouped", "grouped_compiled", "flex", "flex_unpadded", "sdpa_gqa"):
        assert attention[f"{kernel}_ms"] > 0 and attention[f"{kernel}_max_abs_diff"] < 1e-5, kernel


def test_the_generation_mode_reports_the_compiled_steps_compilations(tmp_path, capsys, monkeypatch):
    """Per run: the decode step's compilations in the warm-up and in the timed run, with their seconds
    (dynamo's eager backend here: tracing and guards, no code generation)."""
    import torch

    from dflash_train.generate import compiled_step

    monkeypatch.setattr(compiled_step, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()  # no compiled entry of an earlier test serves this run
    out = tmp_path / "generation.json"
    code = main([
        "bench", "generation", "--preset", "tiny-qwen3", "--device", "cpu", "--num-prompts", "5",
        "--batch-sizes", "2", "--max-new-tokens", "24", "--engines", "slots-uncompiled,slots-compiled",
        "--out", str(out), "--no-progress", "--json",
    ])  # fmt: skip
    assert code == 0
    uncompiled, compiled = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"]
    for key in ("warmup_decode_compiles", "decode_compiles", "warmup_decode_compile_s", "decode_compile_s"):
        assert uncompiled[key] == 0
    # one compilation in the warm-up serves the timed run's longer prompts (a grown cache) too
    assert compiled["status"] == "ok" and compiled["warmup_decode_compiles"] == 1
    assert compiled["decode_compiles"] == 0 and compiled["decode_compile_s"] == 0.0
    assert 0 < compiled["warmup_decode_compile_s"] <= compiled["warmup_s"]


def test_bad_engine_lists_are_refused_with_the_choices(capsys):
    code = main(["bench", "generation", "--preset", "tiny-qwen3", "--engines", "slots,paged"])
    assert code != 0
    assert "a comma list of padded, slots, slots-flex" in capsys.readouterr().err


def test_malformed_sampler_shapes_are_refused_with_the_format(capsys):
    code = main(["bench", "generation", "--preset", "tiny-qwen3", "--sampler-shapes", "1024,49152"])
    assert code != 0
    assert "a comma list of ROWSxVOCAB" in capsys.readouterr().err


def test_attention_shapes_are_buckets(capsys):
    code = main(["bench", "generation", "--preset", "tiny-qwen3", "--attention-shapes", "1024x300"])
    assert code != 0
    assert "KV is a multiple of 256" in capsys.readouterr().err


def test_engine_names_pin_the_attention_and_the_compilation_they_name():
    """A name that names an attention or a compilation pins it; the rest take the engine's defaults
    (on CUDA flex and compiled, so ``slots-compiled`` alone no longer says which attention ran)."""
    from dflash_train.bench.generation import GenerationBenchOptions, make_engine
    from dflash_train.tiny import build_tiny_target

    model = build_tiny_target("qwen3", vocab_size=64, seed=1)
    options = GenerationBenchOptions(preset="tiny-qwen3")
    expected = {
        "slots": ("grouped", False),  # the CPU's defaults
        "slots-compiled": ("grouped", True),
        "slots-uncompiled": ("grouped", False),
        "slots-flex": ("flex", False),
        "slots-flex-compiled": ("flex", True),
        "slots-grouped-compiled": ("grouped", True),
    }
    for name, (attention, compiled) in expected.items():
        engine = make_engine(name, model, 2, options)
        assert (engine.decode_attention, engine.compile_decode) == (attention, compiled), name
