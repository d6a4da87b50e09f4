"""``curves.png``: a training run's curves from its ``metrics.jsonl``.

Four panels over optimizer steps: the loss; tau (the training metric on random anchors, and the
held-out exact tau of every ``eval.prompts`` file, ``eval_tau/<file>``, with the n-gram baseline
when logged); the learning rate; training throughput (real tokens/s). ``MetricsLogger`` redraws it
beside ``metrics.jsonl`` after every logged evaluation and when the run closes; ``dflash-train plot
RUN_DIR`` redraws it from the file. A step may have two rows (the training row of a process that
stopped on an evaluation step, then the evaluation row of the next process): they are merged, the
later row's values winning. Rendered with matplotlib's Agg canvas (no pyplot).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METRICS_JSONL = "metrics.jsonl"
CURVES_PNG = "curves.png"
HELDOUT_PREFIX = "eval_tau/"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl`` by step, the rows of one step merged (later values win)."""
    rows: dict[int, dict[str, Any]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[int(row["step"])] = {**rows.get(int(row["step"]), {}), **row}
    return [rows[step] for step in sorted(rows)]


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that hold a number under ``key`` (null = not finite: skipped)."""
    points = [(row["step"], row[key]) for row in rows if isinstance(row.get(key), int | float)]
    return [step for step, _ in points], [value for _, value in points]


def plot_curves(rows: list[dict[str, Any]], path: str | Path, *, title: str = "") -> str:
    """Write ``curves_figure(rows)`` to ``path``; returns the path."""
    curves_figure(rows, title=title).savefig(path, dpi=110)
    return str(path)


def curves_figure(rows: list[dict[str, Any]], *, title: str = ""):
    """The four panels of ``rows`` (``read_metrics``): loss, tau, learning rate, tokens/s."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(11, 7))
    (loss_ax, tau_ax), (lr_ax, speed_ax) = fig.subplots(2, 2, sharex=True)
    draw_line(loss_ax, rows, "loss", "training loss")
    draw_tau_panel(tau_ax, rows)
    draw_line(lr_ax, rows, "lr", "learning rate")
    draw_line(speed_ax, rows, "tokens_per_s", "tokens/s (real, all ranks)")
    for ax in (lr_ax, speed_ax):
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (loss_ax, tau_ax, lr_ax, speed_ax):
        ax.grid(alpha=0.3)
    fig.suptitle(title or "training curves")
    fig.tight_layout()
    return fig


def draw_line(ax, rows: list[dict[str, Any]], key: str, label: str) -> None:
    steps, values = series(rows, key)
    ax.plot(steps, values, marker="." if len(steps) < 50 else None)
    ax.set_title(label, fontsize=10)


def draw_tau_panel(ax, rows: list[dict[str, Any]]) -> None:
    """Training tau as a line; held-out tau per file (and n-gram's) as marked lines at eval steps."""
    steps, values = series(rows, "tau")
    ax.plot(steps, values, label="training tau (random anchors)")
    held_out = sorted({key for row in rows for key in row if key.startswith(HELDOUT_PREFIX)})
    for key in held_out:
        ax.plot(*series(rows, key), marker="o", label=f"held-out {key.removeprefix(HELDOUT_PREFIX)}")
    if not held_out and series(rows, "eval_tau")[0]:
        ax.plot(*series(rows, "eval_tau"), marker="o", label="held-out tau")
    if series(rows, "eval_ngram_tau")[0]:
        ax.plot(*series(rows, "eval_ngram_tau"), "k:", marker="x", label="n-gram, held-out")
    ax.set_title("tau (tokens per target forward)", fontsize=10)
    ax.legend(fontsize=8)


def redraw_curves(directory: str | Path) -> str | None:
    """``directory/curves.png`` from ``directory/metrics.jsonl``; None when there is no such file
    or it has no rows yet."""
    source = Path(directory) / METRICS_JSONL
    if not source.is_file():
        return None
    rows = read_metrics(source)
    if not rows:
        return None
    return plot_curves(rows, Path(directory) / CURVES_PNG, title=f"training curves: {Path(directory).name}")
