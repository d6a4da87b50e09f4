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
