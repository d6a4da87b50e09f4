"""``dflash-train bench``: the mode registry, the train mode, and what every mode shares (progress
bar, time limit per step). The other modes: tests/test_bench_modes.py, tests/test_packing_bench.py."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from dflash_train.cli import build_parser, main


def test_tiny_bench_runs_on_cpu_and_reports_the_contract_keys(tmp_path):
    profile = tmp_path / "profile.txt"
    cmd = [
        sys.executable, "-m", "dflash_train.cli", "bench", "train", "--preset", "tiny", "--steps", "1",
        "--warmup", "1", "--device", "cpu", "--profile", str(profile), "--json",
    ]  # fmt: skip
    out = subprocess.run(
        cmd, capture_output=True, text=True, check=True, env={"OMP_NUM_THREADS": "1", **os.environ}
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("tokens_per_s", "mfu", "step_s", "peak_mem_gb", "target_s", "drafter_s"):
        assert key in result
    assert result["tokens_per_s"] > 0 and result["block_size"] == 8 and result["num_anchors"] == 32
    assert "Self CPU" in profile.read_text()  # the kernel table of one profiled step
    assert result["tflop_per_step"] > 0 and result["target_kernels"]["chunk_gated_delta_rule"] == "torch"
    assert result["target_kernels"]["compile"] == "none (target.compile off)"  # tiny: compile off
    # the progress bar on stderr: 1 warm-up + 1 timed + 1 profiled step
    assert "bench train" in out.stderr and "3/3" in out.stderr


def test_bench_without_a_mode_is_the_train_mode():
    """The commands of earlier versions (``dflash-train bench --preset ...``) still run."""
    legacy = build_parser().parse_args(["bench", "--preset", "qwen3.6-27b", "--seq-len", "64", "--json"])
    explicit = build_parser().parse_args(["bench", "train", "--preset", "qwen3.6-27b", "--seq-len", "64"])
    assert legacy.bench_mode == explicit.bench_mode == "train"
    assert vars(legacy) == {**vars(explicit), "json": True}
    assert build_parser().parse_args(["bench"]).bench_mode == "train"
    # --json before or after the mode
    assert build_parser().parse_args(["bench", "--json", "train"]).json is True
    assert build_parser().parse_args(["bench", "checkpoint", "--dir", "d", "--json"]).json is True


def test_bench_help_lists_every_registered_mode(capsys):
    from dflash_train.bench.modes import MODES

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert set(MODES) >= {"train", "lengths", "eval", "checkpoint", "decode"}
    for name, module in MODES.items():
        assert name in out
        for attribute in ("HELP", "Options", "add_arguments", "run"):
            assert hasattr(module, attribute), (name, attribute)


def test_every_mode_has_json_progress_and_a_step_timeout(capsys):
    from dflash_train.bench.modes import MODES
    from dflash_train.bench.progress import StepLimits

    for mode, module in MODES.items():
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", mode, "--help"])
        out = capsys.readouterr().out
        for option in ("--json", "--step-timeout-s", "--no-progress"):
            assert option in out, (mode, option)
        assert issubclass(module.Options, StepLimits), mode  # its run gets the limits and the bar


def test_other_commands_do_not_import_the_bench_modes():
    """The modes import torch: parsing any other command, or the top-level --help, must not."""
    code = "import sys; from dflash_train.cli import build_parser; build_parser().parse_args(['export', 'a', 'b']); "
    code += "print(sorted(m for m in sys.modules if m in ('torch', 'dflash_train.bench.modes')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_step_past_its_time_limit_stops_the_bench_with_one_line(monkeypatch, capsys):
    import dflash_train.train.colocated as colocated

    monkeypatch.setattr(colocated, "train_step", lambda *args, **kwargs: time.sleep(30))
    started = time.perf_counter()
    code = main(["bench", "--preset", "tiny", "--device", "cpu", "--warmup", "1", "--step-timeout-s", "0.5"])
    assert code == 1 and time.perf_counter() - started < 25
    err = capsys.readouterr().err
    assert "bench train: warm-up 1/1 ran past --step-timeout-s 0.5" in err


def test_step_progress_counts_steps_and_limits_each_one():
    from dflash_train.bench.progress import StepLimits, StepProgress, StepTimeout

    with StepProgress("x", 3, StepLimits(step_timeout_s=0.2, progress=False)) as progress:
        for index in range(2):
            with progress.step(f"step {index}"):
                time.sleep(0.05)  # well within the limit
        with pytest.raises(StepTimeout, match="bench x: slow ran past --step-timeout-s 0.2"):
            with progress.step("slow"):
                time.sleep(5)
    assert progress.done == 2
    with pytest.raises(ValueError, match="--step-timeout-s -1"):
        StepLimits(step_timeout_s=-1)


def test_a_step_stuck_past_its_limit_ends_the_process_with_every_stack():
    """A step that never returns to the bench (here: it swallows the timeout) is ended by
    faulthandler after the grace period, with the stacks on stderr."""
    code = textwrap.dedent(
        """
        import time
        from dflash_train.bench import progress
        progress.HARD_STOP_GRACE_S = 0.3
        with progress.time_limit(0.2, "stuck"):
            try:
                time.sleep(10)
            except progress.StepTimeout:
                time.sleep(10)
        """
    )
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and time.perf_counter() - started < 8
    assert "Timeout" in out.stderr and "time.sleep" not in out.stdout


def test_time_calls_ms_runs_warmup_then_times_each_call():
    from dflash_train.bench.timing import time_calls_ms

    calls = []
    times = time_calls_ms(lambda: calls.append(1), 4, warmup=2, device="cpu")
    assert len(calls) == 6 and len(times) == 4 and all(t >= 0 for t in times)


def test_bench_reports_compilation_apart_from_the_timed_steps(monkeypatch):
    """Without warm-up the first timed step compiles the drafter layers: counted and warned about."""
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


def test_drafter_only_flops_count_the_teacher_head_the_step_runs():
    """``--drafter-only --loss kl``: the features (final hidden state included) are computed once,
    but every timed step still runs the teacher's LM head over the scored tokens, so its FLOPs count."""
    from dflash_train.bench.train_step import BenchOptions, run_bench
    from dflash_train.models.presets import tiny_hybrid_target_config

    tflop = {}
    for loss in ("ce", "kl"):
        options = BenchOptions(preset="tiny", drafter_only=True, loss=loss, steps=1, warmup=0, device="cpu")
        tflop[loss] = run_bench(options)["tflop_per_step"]
    target = tiny_hybrid_target_config()
    head = 2.0 * 32 * (8 - 1) * target.hidden_size * target.vocab_size  # anchors x draft tokens x H x V
    assert tflop["kl"] - tflop["ce"] == pytest.approx(head / 1e12)


def test_bench_reports_the_attention_backend_the_drafter_trained_with():
    """``--attention-backend flex`` on a CPU trains on chunked SDPA (flex has no CPU backward): the
    result names what ran, not what was asked for."""
    from dflash_train.bench.train_step import BenchOptions, run_bench

    options = BenchOptions(preset="tiny", attention_backend="flex", steps=1, warmup=0, device="cpu")
    assert run_bench(options)["attention_backend"] == "sdpa"


def test_the_timed_steps_start_after_the_device_has_finished_earlier_work(monkeypatch):
    """On CUDA the clock of the timed steps starts after a sync, also without warm-up steps: the
    work queued before them (building the weights, the drafter-only feature pass) is not theirs."""
    import dflash_train.bench.train_step as bench_train
    from dflash_train.bench.train_step import BenchOptions, bench_config, build_bench_run

    options = BenchOptions(preset="tiny", drafter_only=True, steps=1, warmup=0, device="cpu")
    cfg, seq_len, _ = bench_config(options)
    run = build_bench_run(cfg, 1, seq_len, bench_train.pick_device("cpu"), drafter_only=True)
    events = []

    class Clock:
        @staticmethod
        def perf_counter():
            events.append("clock")
            return float(len(events))

    monkeypatch.setattr(bench_train, "time", Clock)
    monkeypatch.setattr(bench_train, "_sync", lambda device: events.append("sync"))
    bench_train.time_train_steps(run, steps=1, warmup=0)
    # clocks: warm-up start and end, then the timed steps' start and end
    timed_start = [i for i, event in enumerate(events) if event == "clock"][2]
    assert "sync" in events[:timed_start]
