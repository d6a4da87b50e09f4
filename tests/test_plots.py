"""Plots drawn by default: ``curves.png`` beside a run's metrics.jsonl, ``acceptance.png`` beside
eval.json, and ``dflash-train plot DIR`` redrawing both (matplotlib's Agg canvas, small fixtures)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dflash_train.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def metrics_rows() -> list[dict]:
    """Six logged steps, evaluations at 2 and 4 on two prompt files, then a resume that logs step 4 again."""
    rows = []
    for step in range(1, 6):
        row = {
            "step": step,
            "loss": 5.0 / step,
            "tau": 1.0 + 0.2 * step,
            "lr": 1e-3 * step,
            "tokens_per_s": 900.0,
        }
        if step in (2, 4):
            row.update(
                {"eval_tau": 1.5, "eval_tau/code": 1.2 + 0.1 * step, "eval_tau/chat": 1.1 + 0.05 * step}
            )
        if step == 2:
            row["eval_ngram_tau"] = 1.3
        rows.append(row)
    rows.append({**rows[3], "loss": 0.5, "tau": None})  # step 4 again after a resume; tau not finite
    return rows


def write_metrics(directory: Path, rows: list[dict]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return directory


def eval_result() -> dict:
    """eval.json's shape: two prompt files, DFlash / n-gram / DDTree per file."""

    def methods(scale: float) -> dict:
        return {
            name: {"per_position_acceptance": [scale * f / k for k in range(1, 8)], "tau": 1 + 3 * scale * f}
            for name, f in (("dflash", 0.9), ("ngram", 0.5), ("ddtree", 1.0))
        }

    return {"tau_mode": "exact", "per_file": [{"file": "a/code.jsonl", "methods": methods(1.0)},
            {"file": "b/chat.jsonl", "methods": methods(0.6)}]}  # fmt: skip


def assert_drawn(path: Path) -> None:
    """A PNG with something on it (more than a blank canvas)."""
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_MAGIC
    assert len(np.unique(imread(path).reshape(-1, 4), axis=0)) > 10


def test_curves_have_loss_tau_per_heldout_file_lr_and_throughput(tmp_path):
    from dflash_train.train.plots import curves_figure, read_metrics

    rows = read_metrics(write_metrics(tmp_path, metrics_rows()) / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]  # the resumed step 4 replaced the first
    fig = curves_figure(rows, title="run")
    loss, tau, lr, speed = fig.axes
    assert [ax.get_title() for ax in fig.axes] == [
        "training loss", "tau (tokens per target forward)", "learning rate", "tokens/s (real, all ranks)",
    ]  # fmt: skip
    labels = [line.get_label() for line in tau.get_lines()]
    assert labels == ["training tau (random anchors)", "held-out chat", "held-out code", "n-gram, held-out"]
    code = tau.get_lines()[2]
    assert list(code.get_xdata()) == [2, 4] and list(code.get_ydata()) == pytest.approx([1.4, 1.6])
    assert list(loss.get_lines()[0].get_ydata()) == pytest.approx([5.0, 2.5, 5 / 3, 0.5, 1.0])
    assert list(tau.get_lines()[0].get_xdata()) == [1, 2, 3, 5]  # the resumed row's null tau is left out
    assert (
        list(lr.get_lines()[0].get_xdata()) == [1, 2, 3, 4, 5] and speed.get_lines()[0].get_ydata()[0] == 900
    )


def test_acceptance_has_one_panel_per_prompt_file_and_a_line_per_method():
    from dflash_train.eval.plots import acceptance_figure

    fig = acceptance_figure(eval_result()["per_file"], title="t")
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in visible] == ["code.jsonl", "chat.jsonl"]
    labels = [line.get_label() for line in visible[1].get_lines()]
    assert labels == ["DFlash (tau 2.62)", "n-gram (tau 1.90)", "DDTree (tau 2.80)"]
    assert list(visible[0].get_lines()[0].get_xdata()) == list(range(1, 8))


def test_the_metrics_logger_draws_curves_at_each_evaluation_and_at_close(tmp_path):
    from dflash_train.config import LoggingConfig
    from dflash_train.train.logging import MetricsLogger

    logger = MetricsLogger(
        tmp_path, LoggingConfig(progress_bar="off"), total_steps=4, is_main=True, config_dict={}
    )
    curves = tmp_path / "curves.png"
    logger.log(1, {"loss": 3.0, "tau": 1.1, "lr": 1e-3, "tokens_per_s": 10.0})
    assert not curves.exists()  # no evaluation yet: nothing new to show
    logger.log(
        2, {"loss": 2.0, "tau": 1.2, "lr": 1e-3, "tokens_per_s": 10.0, "eval_tau": 1.4, "eval_tau/x": 1.4}
    )
    assert_drawn(curves)
    at_eval = curves.stat().st_mtime_ns, curves.read_bytes()
    logger.log(3, {"loss": 1.0, "tau": 1.3, "lr": 1e-3, "tokens_per_s": 10.0})
    assert curves.read_bytes() == at_eval[1]
    logger.close()
    assert curves.read_bytes() != at_eval[1]  # the end of the run: step 3 is on it now


def test_a_run_ending_on_an_evaluation_is_drawn_once(tmp_path, monkeypatch):
    import dflash_train.train.plots as plots
    from dflash_train.config import LoggingConfig
    from dflash_train.train.logging import MetricsLogger

    drawn = []
    monkeypatch.setattr(plots, "redraw_curves", drawn.append)
    logger = MetricsLogger(
        tmp_path, LoggingConfig(progress_bar="off"), total_steps=2, is_main=True, config_dict={}
    )
    logger.log(1, {"loss": 2.0})
    logger.log(2, {"loss": 1.0, "eval_tau": 1.5})  # the last step's evaluation
    logger.close()
    assert drawn == [tmp_path]  # at the evaluation; nothing new to draw at close


def test_a_failing_plot_never_stops_training(tmp_path, monkeypatch, capsys):
    import dflash_train.train.plots as plots
    from dflash_train.config import LoggingConfig
    from dflash_train.train.logging import MetricsLogger

    def broken(directory):
        raise RuntimeError("no fonts")

    monkeypatch.setattr(plots, "redraw_curves", broken)
    logger = MetricsLogger(
        tmp_path, LoggingConfig(progress_bar="off"), total_steps=2, is_main=True, config_dict={}
    )
    logger.log(1, {"loss": 1.0, "eval_tau": 1.0})
    logger.close()
    out = capsys.readouterr().out
    assert out.count("curves.png not drawn (RuntimeError: no fonts)") == 1  # reported once
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 1.0


def test_plot_command_redraws_a_run_and_an_eval_dir(tmp_path, capsys):
    run = write_metrics(tmp_path / "run", metrics_rows())
    evaluated = tmp_path / "eval"
    evaluated.mkdir()
    (evaluated / "eval.json").write_text(json.dumps(eval_result()))
    assert main(["plot", str(run), str(evaluated), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result == {
        str(run): [str(run / "curves.png")],
        str(evaluated): [str(evaluated / "acceptance.png")],
    }
    assert_drawn(run / "curves.png")
    assert_drawn(evaluated / "acceptance.png")
    assert main(["plot", str(tmp_path)]) == 1
    assert "no metrics.jsonl (a training run) nor eval.json" in capsys.readouterr().err
