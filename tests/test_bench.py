import json
import subprocess
import sys


def test_tiny_bench_runs_on_cpu_and_reports_the_contract_keys(tmp_path):
    profile = tmp_path / "profile.txt"
    cmd = [
        sys.executable,
        "-m",
        "dflash_train.cli",
        "bench",
        "--preset",
        "tiny",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--device",
        "cpu",
        "--profile",
        str(profile),
        "--json",
    ]
    out = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        check=True,
        env={"OMP_NUM_THREADS": "1", **__import__("os").environ},
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("tokens_per_s", "mfu", "step_s", "peak_mem_gb", "target_s", "drafter_s"):
        assert key in result
    assert result["tokens_per_s"] > 0 and result["block_size"] == 8 and result["num_anchors"] == 32
    assert "Self CPU" in profile.read_text()  # the kernel table of one profiled step
    assert result["tflop_per_step"] > 0 and result["target_kernels"]["chunk_gated_delta_rule"] == "torch"


def test_time_calls_ms_runs_warmup_then_times_each_call():
    from dflash_train.bench.timing import time_calls_ms

    calls = []
    times = time_calls_ms(lambda: calls.append(1), 4, warmup=2, device="cpu")
    assert len(calls) == 6 and len(times) == 4 and all(t >= 0 for t in times)


def test_bench_reports_compilation_apart_from_the_timed_steps(monkeypatch):
    """Without warm-up the first timed step compiles the drafter layers: counted and warned about."""
    import pytest
    import torch
    from torch._dynamo.utils import counters

    from dflash_train.bench.train_step import BenchOptions, run_bench

    compile_module = torch.nn.Module.compile  # dynamo's graph count does not depend on the backend
    monkeypatch.setattr(
        torch.nn.Module, "compile", lambda self, **kw: compile_module(self, **{**kw, "backend": "eager"})
    )
    torch._dynamo.reset()
    counters.clear()
    try:
        warmed = run_bench(BenchOptions(preset="tiny", compile=True, steps=1, warmup=1, device="cpu"))
        torch._dynamo.reset()
        with pytest.warns(RuntimeWarning, match="compiled during the timed steps"):
            cold = run_bench(BenchOptions(preset="tiny", compile=True, steps=1, warmup=0, device="cpu"))
    finally:
        torch._dynamo.reset()
    # one shape: layer 0 (its input needs no gradient) and layer 1 are two graphs
    assert (warmed["compiled_graphs_warmup"], warmed["compiled_graphs_timed"]) == (2, 0)
    assert (cold["compiled_graphs_warmup"], cold["compiled_graphs_timed"]) == (0, 2)
    assert warmed["eager_fallbacks"] == cold["eager_fallbacks"] == 0 and warmed["warmup_s"] > 0


def test_drafter_recompile_limit_covers_every_bucket_variant():
    from dflash_train.config import DataConfig
    from dflash_train.train.builders import drafter_recompile_limit

    qwen36 = ["sliding_attention"] * 4 + ["full_attention"]  # layer 0 sliding without input gradient
    assert drafter_recompile_limit(qwen36, DataConfig(seq_buckets=[1024, 2048, 4096])) == 2 * 3 * 3
    assert drafter_recompile_limit(qwen36, DataConfig(seq_buckets=[1024, 2048, 4096], packing=True)) == 2 * 3
    assert drafter_recompile_limit(["full_attention"] * 5, DataConfig(seq_buckets=[256, 512])) == 2 * 2 * 2
