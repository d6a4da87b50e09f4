"""Trainer support pieces: metrics logging, the FLOP model behind MFU, and fault handling."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dflash_train.config import DrafterConfig, LoggingConfig
from dflash_train.models import presets
from dflash_train.train.faults import GracefulStop, Watchdog, any_rank_flags, any_rank_true
from dflash_train.train.flops import causal_key_count, mfu, train_step_flops
from dflash_train.train.logging import MetricsLogger, format_duration, log_main
from tests.train_helpers import spawn_ranks

TFLOP = 1e12


def make_logger(tmp_path, *, is_main=True, total_steps=100, **cfg):
    cfg.setdefault("progress_bar", "off")
    return MetricsLogger(
        tmp_path, LoggingConfig(**cfg), total_steps=total_steps, is_main=is_main, config_dict={"a": 1}
    )


# ----------------------------------------------------------------------------- logging


def test_metrics_jsonl_has_one_object_per_log_call(tmp_path):
    logger = make_logger(tmp_path)
    for step in range(1, 4):
        logger.advance(step)
    logger.log(3, {"loss": 2.5, "lr": 1e-3, "num_skipped": 0, "acc": [0.5, 0.25]})
    logger.log(4, {"loss": float("nan")})
    logger.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert records[0]["step"] == 3 and records[0]["loss"] == 2.5 and records[0]["acc"] == [0.5, 0.25]
    assert records[0]["num_skipped"] == 0 and records[0]["elapsed_s"] >= 0
    # NaN is not JSON: it is written as null so strict readers still parse the file.
    assert records[1]["step"] == 4 and records[1]["loss"] is None and "NaN" not in lines[1]


def test_metrics_jsonl_is_flushed_before_close(tmp_path):
    logger = make_logger(tmp_path)
    logger.log(1, {"loss": 1.0})
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 1.0
    logger.close()


def test_tensor_metric_is_rejected(tmp_path):
    logger = make_logger(tmp_path)
    with pytest.raises(TypeError, match="'loss'.*item"):
        logger.log(1, {"loss": torch.tensor(1.0)})
    logger.close()


def test_non_main_rank_writes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    logger = make_logger(run_dir, is_main=False, progress_bar="on")
    logger.advance(1)
    logger.log(1, {"loss": 1.0, "tau": 2.0})
    logger.close()
    assert not run_dir.exists()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_line_mode_prints_one_human_line_per_log(tmp_path, capsys):
    logger = make_logger(tmp_path, total_steps=300)
    logger.advance(19)
    logger.advance(20)
    metrics = {
        "loss": 3.14159,
        "lr": 2e-3,
        "grad_norm": 0.5123,
        "tau": 1.8421,
        "tokens_per_s": 12345.0,
        "mfu": 0.412,
        "peak_mem_gb": 28.54,
    }
    logger.log(20, metrics)
    assert logger.last == metrics
    logger.log(21, {"loss": 3.0, "mfu": 0.0})  # MFU is not measured on CPU: not printed
    logger.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[1].startswith("step 21/300 | loss 3.0000") and "MFU" not in lines[1]
    line = lines[0]
    assert line.startswith("step 20/300 | loss 3.1416 | lr 2.00e-03 | grad 0.512 | tau 1.842 | 12.3K tok/s")
    assert "| MFU 41.2% |" in line and "| ETA " in line and line.endswith("| mem 28.5 GB")


def test_progress_bar_mode_prints_no_lines(tmp_path, capsys):
    logger = make_logger(tmp_path, progress_bar="on", total_steps=10)
    for step in range(1, 6):
        logger.advance(step)
    logger.log(5, {"loss": 2.0, "tau": 1.5, "tokens_per_s": 1000.0})
    logger.close()
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "5/10" in captured.err and "loss=2" in captured.err and "tau=1.5" in captured.err


def test_eta_from_moving_average_step_time(tmp_path):
    logger = make_logger(tmp_path, total_steps=100)
    assert logger.eta_seconds(0) is None
    before = time.perf_counter()
    logger.advance(1)
    time.sleep(0.05)
    logger.advance(2)
    longest_step = time.perf_counter() - before
    assert 98 * 0.05 <= logger.eta_seconds(2) <= 98 * longest_step
    assert logger.eta_seconds(100) == 0.0
    logger.close()


def test_format_duration():
    assert [format_duration(s) for s in (5, 250, 3 * 3600 + 300, 2 * 86400 + 7 * 3600)] == [
        "5s",
        "4m10s",
        "3h05m",
        "2d07h",
    ]


def test_log_main_prints_without_process_group(capsys):
    log_main("hello")
    assert capsys.readouterr().out == "hello\n"


def test_tensorboard_missing_gives_install_hint(tmp_path, monkeypatch):
    # Simulate an environment without tensorboard, whether or not it is installed here.
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        make_logger(tmp_path, tensorboard=True)
    # Every rank checks, so a missing package cannot leave rank 0 failing alone.
    with pytest.raises(ImportError, match="pip install tensorboard"):
        make_logger(tmp_path / "rank1", is_main=False, tensorboard=True)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_tensorboard_writes_events_when_installed(tmp_path):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"pip install tensorboard.*dflash-train\[tensorboard\]"):
            make_logger(tmp_path, tensorboard=True)
        return
    logger = make_logger(tmp_path, tensorboard=True)
    logger.log(1, {"loss": 1.0, "acc": [0.5, 0.25]})
    logger.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_tensorboard_hides_the_steps_a_killed_process_logged_past_its_checkpoint(tmp_path, monkeypatch):
    """A resume from step 7 logs steps 8, 9, ... again: TensorBoard must purge what an earlier process
    logged from step 8 on (metrics.jsonl drops those rows), as it does for a fresh start over an
    earlier run's events; a first start has nothing to purge."""
    import dflash_train.train.logging as logging_module

    opened = []

    class RecordingWriter:
        def __init__(self, **kwargs):
            opened.append(kwargs)
            Path(kwargs["log_dir"]).mkdir(parents=True, exist_ok=True)

        def add_scalar(self, *args):
            pass

        def close(self):
            pass

    monkeypatch.setattr(logging_module, "import_summary_writer", lambda: RecordingWriter)
    make_logger(tmp_path, tensorboard=True).close()
    resumed = LoggingConfig(progress_bar="off", tensorboard=True)
    MetricsLogger(tmp_path, resumed, total_steps=100, is_main=True, config_dict={}, start_step=7).close()
    make_logger(tmp_path, tensorboard=True).close()  # checkpoint.resume=never over the same folder
    assert [kwargs.get("purge_step") for kwargs in opened] == [None, 8, 1]


def test_wandb_missing_gives_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match="pip install wandb"):
        make_logger(tmp_path, wandb=True)


def test_a_logger_left_by_an_error_marks_the_wandb_run_failed_and_keeps_the_error(tmp_path, monkeypatch):
    """``with logger:`` closes it on the way out of a failed run: wandb's run finishes as failed (a
    finished run would read as a success), and a sink that fails to close does not hide the error."""
    import dflash_train.train.logging as logging_module

    finished = []

    class RecordingRun:
        def log(self, *args, **kwargs):
            pass

        def finish(self, exit_code=None):
            finished.append(exit_code)
            if len(finished) == 3:
                raise RuntimeError("wandb service gone")

    wandb = type("FakeWandb", (), {"init": staticmethod(lambda **kwargs: RecordingRun())})
    monkeypatch.setattr(logging_module, "import_wandb", lambda: wandb)
    with make_logger(tmp_path / "ok", wandb=True):
        pass
    with pytest.raises(ValueError, match="the run's error"), make_logger(tmp_path / "failed", wandb=True):
        raise ValueError("the run's error")
    with pytest.raises(ValueError, match="the run's error"), make_logger(tmp_path / "both", wandb=True):
        raise ValueError("the run's error")
    assert finished == [None, 1, 1]


# ----------------------------------------------------------------------------- FLOPs


def qwen36_27b_flops(**shape):
    target = presets.qwen36_27b_target_config()
    drafter = presets.resolve_drafter_config(DrafterConfig(preset="qwen3.6-27b"), target)
    return train_step_flops(target, drafter, **shape)


def test_flops_match_design_budget_for_qwen36_27b():
    """DESIGN.md section 4: ~323 TFLOP per 4,096-token row with 512 anchors x 16."""
    f = {k: v / TFLOP for k, v in qwen36_27b_flops(seq_len=4096, num_anchors=512).items()}
    assert f["total"] == pytest.approx(323, rel=0.1)
    assert f["target"] == pytest.approx(200, rel=0.1)
    # Drafter layers 26 fwd + 52 bwd, plus ~3 for fc and the context k/v projections.
    assert f["drafter_fwd"] + f["drafter_bwd"] == pytest.approx(26 + 52 + 3, rel=0.1)
    assert f["drafter_bwd"] == pytest.approx(2 * f["drafter_fwd"], rel=0.1)
    assert f["lm_head_fwd"] == pytest.approx(21, rel=0.1)
    assert f["lm_head_bwd"] == f["lm_head_fwd"]
    parts = sum(v for k, v in f.items() if k != "total")
    assert f["total"] == pytest.approx(parts)


def test_flops_scale_with_rows_and_count_only_truncated_target():
    one = qwen36_27b_flops(seq_len=4096, num_anchors=512)
    four = qwen36_27b_flops(seq_len=4096, num_anchors=512, rows=4)
    assert four["total"] == pytest.approx(4 * one["total"])
    target = presets.qwen36_27b_target_config()
    early = presets.resolve_drafter_config(
        DrafterConfig(preset="qwen3.6-27b"), target, target_layer_ids=[1, 15]
    )
    truncated = train_step_flops(target, early, seq_len=4096, num_anchors=512)
    assert truncated["target"] == pytest.approx(one["target"] * 16 / 62, rel=0.02)


def test_flops_dense_qwen3_target_and_tiny_shapes():
    target = presets.qwen3_8b_target_config()
    drafter = presets.resolve_drafter_config(DrafterConfig(preset="qwen3-8b"), target)
    f = train_step_flops(target, drafter, seq_len=4096, num_anchors=512)
    # 34 layers of Qwen3-8B (~0.19B matmul params each) on 4,096 tokens plus causal attention.
    params = 4096 * (2 * 4096 + 2 * 1024) + 3 * 4096 * 12288
    attention = 4 * 32 * 128 * 4096 * 4097 / 2
    assert f["target"] == pytest.approx(34 * (2 * 4096 * params + attention))
    tiny = presets.tiny_hybrid_target_config()
    tiny_drafter = presets.resolve_drafter_config(
        DrafterConfig(preset="tiny", block_size=8), tiny, target_layer_ids=[0, 1, 2], mask_token_id=3
    )
    g = train_step_flops(tiny, tiny_drafter, seq_len=256, num_anchors=16)
    assert all(v > 0 for v in g.values())
    assert g["lm_head_fwd"] == 2 * 16 * 7 * 64 * 320


def test_causal_key_count_with_window():
    assert causal_key_count(4, None) == 1 + 2 + 3 + 4
    assert causal_key_count(5, 2) == 1 + 2 + 2 + 2 + 2
    assert causal_key_count(3, 8) == causal_key_count(3)


def test_mfu():
    assert mfu(798e12, 1.0) == pytest.approx(1.0)
    assert mfu(323e12, 1.0, peak_flops=646e12) == pytest.approx(0.5)
    assert mfu(1.0, 0.0) == 0.0


# ----------------------------------------------------------------------------- faults


def test_graceful_stop_sets_flag_on_sigterm_and_restores_handler():
    previous = signal.getsignal(signal.SIGTERM)
    with GracefulStop() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not stop.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stop.requested and stop.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is previous


def test_graceful_stop_sigint_is_optional():
    previous = signal.getsignal(signal.SIGINT)
    with GracefulStop() as stop:
        assert signal.getsignal(signal.SIGINT) is previous
    with GracefulStop(handle_sigint=True) as stop:
        signal.raise_signal(signal.SIGINT)
        assert stop.requested and stop.signal_name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is previous


def test_watchdog_dumps_stacks_once_per_stall(tmp_path, capfd):
    dump = tmp_path / "watchdog.txt"
    with Watchdog(0.2, dump_path=dump) as watchdog:
        watchdog.beat(7)
        deadline = time.monotonic() + 10
        while watchdog.num_dumps == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.6)  # still stalled: no second dump for the same stall
        assert watchdog.num_dumps == 1
        watchdog.beat(8)
        deadline = time.monotonic() + 10
        while watchdog.num_dumps == 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert watchdog.num_dumps == 2
    text = dump.read_text()
    assert "last step 7" in text and "last step 8" in text
    assert "test_watchdog_dumps_stacks_once_per_stall" in text  # the main thread's stack
    assert "watchdog" in capfd.readouterr().err


def test_watchdog_quiet_while_beating_and_disabled_at_zero(tmp_path):
    dump = tmp_path / "watchdog.txt"
    with Watchdog(0.5, dump_path=dump) as watchdog:
        for step in range(10):
            watchdog.beat(step)
            time.sleep(0.03)
    assert watchdog.num_dumps == 0 and not dump.exists()
    disabled = Watchdog(0, dump_path=dump)
    assert disabled._thread is None
    disabled.close()


def test_any_rank_true_without_process_group():
    assert any_rank_true(True, "cpu") is True
    assert any_rank_true(False, "cpu") is False
    assert any_rank_flags([True, False], "cpu") == [True, False]


def _any_rank_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        results = [
            any_rank_true(rank == 1, "cpu"),
            any_rank_true(False, "cpu"),
            *any_rank_flags([rank == 0, False, True], "cpu"),
        ]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def test_any_rank_true_across_two_gloo_ranks(tmp_path):
    spawn_ranks(_any_rank_worker, (2, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert results == [True, False, True, False, True], f"rank {rank}"


def test_log_main_prints_only_on_the_logging_rank(monkeypatch, capsys):
    from dflash_train.train import logging as train_logging

    monkeypatch.setattr(train_logging.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(train_logging.dist, "get_rank", lambda: 2)
    train_logging.log_main("from rank 2, default logging rank 0")
    previous = train_logging.set_main_rank(2)
    try:
        train_logging.log_main("from rank 2, now the logging rank")
    finally:
        train_logging.set_main_rank(previous)
    out = capsys.readouterr().out
    assert "now the logging rank" in out and "default logging rank 0" not in out


def test_a_failed_metrics_write_keeps_the_rows_and_never_stops_rank_0_alone(tmp_path, capsys):
    """A full disk during a metrics write: rank 0 must not raise alone (its peers would wait in the
    next collective). The torn row is cut back, the rows wait in memory with a warning, and the next
    logging step writes them all, whole and in order."""
    logger = make_logger(tmp_path)
    logger.log(1, {"loss": 3.0})
    real = logger._jsonl

    class FullDisk:  # writes half of what it is given, then fails like a full disk
        def write(self, text):
            real.write(text[: len(text) // 2])
            real.flush()

        def flush(self):
            raise OSError(28, "No space left on device")

        def close(self):
            real.close()

        def fileno(self):
            return real.fileno()

    logger._jsonl = FullDisk()
    logger.log(2, {"loss": 2.0})  # no exception
    assert "metrics.jsonl not written (OSError" in capsys.readouterr().out
    logger.log(3, {"loss": 1.0})
    logger.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in records] == [(1, 3.0), (2, 2.0), (3, 1.0)]
