"""Trainer behaviour on CPU with the tiny hybrid target: learning, exact resume, faults, ranks."""

import json
import math
import os
from pathlib import Path

import pytest
import torch

from dflash_train.train import checkpoint as ckpt
from dflash_train.train.trainer import NonFiniteError, TrainHooks, train
from tests.train_helpers import logged_losses, tiny_config

GOLDEN = Path(__file__).parent / "golden" / "tiny_train_losses.json"


pytestmark = pytest.mark.usefixtures("one_thread")


def test_loss_falls_and_result_names_checkpoint_and_export(task, tmp_path):
    result = train(tiny_config(task, tmp_path / "run", "train.max_steps=40", "checkpoint.every_steps=100"))
    losses = logged_losses(tmp_path / "run")
    first, last = sum(losses[s] for s in range(1, 6)) / 5, sum(losses[s] for s in range(36, 41)) / 5
    assert last < first - 0.3, losses
    assert set(result) >= {"step", "loss", "tau", "checkpoint", "export"} and result["step"] == 40
    assert Path(result["checkpoint"], ckpt.COMMIT_MARKER).is_file()
    assert (Path(result["export"]) / "model.safetensors").is_file()
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    assert info["target_kernels"]["chunk_gated_delta_rule"] == "torch" and info["world_size"] == 1
    assert info["launch_dir"] == os.getcwd()  # where the recipe's relative paths mean something


def test_golden_losses_of_a_fixed_seed_run(task, tmp_path):
    """Per-step losses of a 30-step run; a numerics change must update the file on purpose."""
    train(tiny_config(task, tmp_path / "run", "train.max_steps=30", "checkpoint.every_steps=100"))
    losses = [logged_losses(tmp_path / "run")[s] for s in range(1, 31)]
    if os.environ.get("DFLASH_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({"losses": losses}, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())["losses"]
    # Tight, not bit-exact: CPU kernels differ slightly between instruction sets (AVX2 vs AVX-512).
    assert losses == pytest.approx(golden, rel=1e-4, abs=1e-5)


def test_logged_loss_is_the_mean_over_the_logging_interval(task, tmp_path):
    """Like tau and acc, a row's loss covers every step since the previous row; loss_last is the last."""
    train(tiny_config(task, tmp_path / "every", "train.max_steps=8", "checkpoint.every_steps=100"))
    sparse = tmp_path / "sparse"
    train(
        tiny_config(task, sparse, "train.max_steps=8", "checkpoint.every_steps=100", "logging.every_steps=4")
    )
    per_step = logged_losses(tmp_path / "every")
    rows = [json.loads(line) for line in (sparse / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [4, 8]
    for row in rows:
        window = [per_step[s] for s in range(row["step"] - 3, row["step"] + 1)]
        assert row["loss"] == pytest.approx(sum(window) / 4, rel=1e-6)
        assert row["loss_last"] == per_step[row["step"]]
    assert rows[0]["loss"] != rows[0]["loss_last"]


def test_nonfinite_gradient_stops_before_the_update(task, tmp_path):
    params, seen = {}, {}

    def poison_at_step_3(run):
        if run.step == 2:
            seen["run"] = run
            params.update({n: p.detach().clone() for n, p in run.model.named_parameters()})
            next(run.model.parameters()).grad.fill_(float("nan"))

    hooks = TrainHooks(after_backward=poison_at_step_3)
    # the 3rd step, as the progress line and metrics.jsonl number it
    with pytest.raises(NonFiniteError, match="^step 3: non-finite .* stopped before the optimizer step"):
        train(tiny_config(task, tmp_path / "run"), hooks)
    assert seen["run"].step == 2  # the step counter did not advance
    assert all(torch.equal(p, params[n]) for n, p in seen["run"].model.named_parameters())
    assert ckpt.latest_checkpoint(tmp_path / "run") is None  # every_steps=4: nothing saved before step 3


def test_a_failed_run_closes_its_metrics_logger(task, tmp_path, monkeypatch):
    """The loop raising (a non-finite step under train.nonfinite=stop) still closes the logger: its
    rows, curves, TensorBoard and wandb runs are flushed and finished, not left to the exit."""
    import dflash_train.train.colocated as colocated

    closed, real_open_logger = [], colocated.open_logger

    def open_recording_logger(run):
        logger = real_open_logger(run)
        close = logger.close
        logger.close = lambda **kwargs: closed.append(True) or close(**kwargs)
        return logger

    monkeypatch.setattr(colocated, "open_logger", open_recording_logger)

    def poison(run):
        if run.step == 1:
            next(run.model.parameters()).grad.fill_(float("nan"))

    with pytest.raises(NonFiniteError, match="^step 2: non-finite"):
        train(tiny_config(task, tmp_path / "run"), TrainHooks(after_backward=poison))
    assert closed


def test_nonfinite_skip_policy_counts_and_continues(task, tmp_path):
    def poison(run):
        if run.step == 2:
            next(run.model.parameters()).grad.fill_(float("nan"))

    result = train(
        tiny_config(task, tmp_path / "run", "train.nonfinite=skip", "train.max_steps=4"),
        TrainHooks(after_backward=poison),
    )
    assert result["step"] == 4
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["skipped_steps"] == 1


@pytest.mark.gpu
def test_cuda_run_with_flex_attention_compile_and_bf16(task, tmp_path):
    cfg = tiny_config(
        task,
        tmp_path / "run",
        "train.device=cuda",
        "train.dtype=bfloat16",
        "target.dtype=bfloat16",
        "train.attention_backend=flex",
        "train.compile=true",
        "train.max_steps=40",
        "checkpoint.every_steps=100",
    )
    result = train(cfg)
    losses = logged_losses(tmp_path / "run")
    assert result["step"] == 40 and all(map(math.isfinite, losses.values()))
    assert sum(losses[s] for s in range(36, 41)) < sum(losses[s] for s in range(1, 6)) - 0.3, losses


def test_activation_checkpointing_gives_the_same_losses(task, tmp_path, monkeypatch):
    import torch.utils.checkpoint as torch_checkpoint

    plain = tmp_path / "plain"
    checkpointed = tmp_path / "checkpointed"
    train(tiny_config(task, plain, "train.max_steps=4"))
    calls = []
    real = torch_checkpoint.checkpoint
    monkeypatch.setattr(torch_checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    train(tiny_config(task, checkpointed, "train.max_steps=4", "train.activation_checkpointing=true"))
    assert len(calls) >= 4 * 2  # every drafter layer (2) of every step
    assert logged_losses(checkpointed) == pytest.approx(logged_losses(plain), rel=1e-6)


def test_flex_recipe_on_a_cpu_trains_with_sdpa_and_says_so(task, tmp_path, capsys):
    """The GPU recipes ask for flex attention, which PyTorch cannot train on a CPU: the run uses the
    chunked SDPA path (the same masks) with a one-line notice naming the key, and trains exactly as
    train.attention_backend=sdpa does."""
    train(tiny_config(task, tmp_path / "sdpa", "train.max_steps=2", "train.attention_backend=sdpa"))
    assert "train.attention_backend" not in capsys.readouterr().out
    result = train(tiny_config(task, tmp_path / "flex", "train.max_steps=2", "train.attention_backend=flex"))
    notices = [line for line in capsys.readouterr().out.splitlines() if "train.attention_backend" in line]
    assert result["step"] == 2
    assert len(notices) == 1 and "flex" in notices[0] and "sdpa" in notices[0] and "cpu" in notices[0]
    assert logged_losses(tmp_path / "flex") == logged_losses(tmp_path / "sdpa")
