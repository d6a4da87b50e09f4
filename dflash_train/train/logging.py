"""Rank-0 output: ``log_main`` for messages, ``MetricsLogger`` for per-step metrics.

Rank 0 by default; ``set_main_rank`` moves it (split placement logs from the first drafter rank).

``MetricsLogger`` writes every logged step to ``run_dir/metrics.jsonl`` (one JSON object a line,
the record that always exists), drives a progress bar or prints one human line per logging step,
redraws ``curves.png`` beside it after every held-out evaluation and when closed (train/plots.py),
and optionally mirrors scalars to TensorBoard and Weights & Biases (imported lazily, only when
enabled). It only ever receives Python numbers: the trainer does its ``.item()`` calls on logging
steps, so ``advance`` can run every step without a host sync.

Metric names the human line and the progress bar know (others are recorded but not printed):
``loss``, ``lr``, ``grad_norm``, ``tau``, ``eval_tau`` and ``eval_ngram_tau`` (held-out acceptance,
on evaluation steps), ``tokens_per_s``, ``mfu`` (a fraction; hidden when 0, e.g.
on CPU), ``peak_mem_gb`` (1e9 bytes). ``last`` holds the most recent logged metrics.
A list value holds one number per scored block position: index i is block position i + 1
(position 0, the anchor, is never scored) and is logged to TensorBoard/wandb as
``{name}/pos_{i + 1}``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, TextIO

import torch.distributed as dist
from tqdm import tqdm

from dflash_train.config import LoggingConfig

# Steps in the moving window behind the ETA (long enough to smooth logging/checkpoint steps out).
ETA_WINDOW_STEPS = 50


# Global rank that prints. 0 except in split placement, where rank 0 runs the target and the
# drafter ranks (which log the metrics) start at ``train.target_ranks``.
_main_rank = 0


def set_main_rank(rank: int) -> int:
    """Make global rank ``rank`` the one that prints; returns the previous one (to restore it)."""
    global _main_rank
    previous, _main_rank = _main_rank, rank
    return previous


def is_main_process() -> bool:
    """The logging rank (``set_main_rank``, default 0) of the process group, or the only process."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == _main_rank


def log_main(msg: str) -> None:
    """Print ``msg`` to stdout on the logging rank only, without breaking an active progress bar."""
    if is_main_process():
        tqdm.write(msg, file=sys.stdout)
        sys.stdout.flush()


class MetricsLogger:
    """Per-step metrics of a training run, written by rank 0 (every method is a no-op elsewhere).

    ``advance(step)`` is called after every optimizer step with the number of completed steps;
    ``log(step, metrics)`` on logging steps with Python numbers (or lists of them). ``start_step``
    is the step a resumed run starts from, so the bar and the ETA count only the remaining steps.
    Optional backends are checked on every rank so that a missing package fails all ranks alike.
    """

    def __init__(
        self,
        run_dir: Path,
        cfg: LoggingConfig,
        *,
        total_steps: int,
        is_main: bool,
        config_dict: dict,
        start_step: int = 0,
        redo_eval_at_start: bool = False,
    ) -> None:
        self.is_main = is_main
        self.total_steps = total_steps
        self.last: dict[str, Any] = {}
        summary_writer_cls = import_summary_writer() if cfg.tensorboard else None
        wandb = import_wandb() if cfg.wandb else None
        if not is_main:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self._tensorboard = open_summary_writer(summary_writer_cls, run_dir / "tensorboard", start_step)
        self._wandb_run = (
            wandb.init(project=cfg.wandb_project, config=config_dict, dir=str(run_dir), name=run_dir.name)
            if wandb
            else None
        )
        drop_rows_to_redo(run_dir / "metrics.jsonl", start_step, redo_eval_at_start)
        self._metrics_path = run_dir / "metrics.jsonl"
        self._jsonl: TextIO | None = open(self._metrics_path, "a")  # closed in close()
        self._written_bytes = self._metrics_path.stat().st_size  # the end of the last whole row
        self._closed = False
        self._unwritten: list[str] = []  # rows a failed write keeps for the next logging step
        self._run_dir = run_dir
        use_bar = cfg.progress_bar == "on" or (cfg.progress_bar == "auto" and sys.stderr.isatty())
        self._bar = (
            tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stderr)
            if use_bar
            else None
        )
        self._start_time = time.perf_counter()
        self._plot_failed, self._undrawn_rows = False, False
        # (step, time) at each advance; the window opens at the first finished step, so start-up and
        # compilation before it do not inflate the ETA.
        self._step_times: deque[tuple[int, float]] = deque(maxlen=ETA_WINDOW_STEPS)

    def advance(self, step: int) -> None:
        """Record that ``step`` optimizer steps are done (every step; no host sync, Python ints only)."""
        if not self.is_main:
            return
        if not self._step_times or step > self._step_times[-1][0]:
            self._step_times.append((step, time.perf_counter()))
        if self._bar is not None and step > self._bar.n:
            self._bar.update(step - self._bar.n)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record ``metrics`` of logging step ``step`` in every enabled sink."""
        if not self.is_main:
            return
        self.advance(step)
        check_metrics(metrics)
        self.last = dict(metrics)
        record = {"step": step, "elapsed_s": round(time.perf_counter() - self._start_time, 3), **metrics}
        self._unwritten.append(json.dumps(finite_or_null(record)) + "\n")
        self.write_rows()
        self._undrawn_rows = True
        scalars = flatten_scalars(metrics)
        if self._tensorboard is not None:
            for name, value in scalars.items():
                self._tensorboard.add_scalar(name, value, step)
        if self._wandb_run is not None:
            self._wandb_run.log(scalars, step=step)
        if self._bar is not None:
            postfix = {k: metrics[k] for k in ("loss", "tau", "eval_tau", "tokens_per_s") if k in metrics}
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in postfix.items()}, refresh=False)
        else:
            log_main(self.format_line(step, metrics))
        if "eval_tau" in metrics:  # a held-out evaluation: its point on the curves
            self.draw_curves()

    def write_rows(self) -> None:
        """Append the rows not yet in ``metrics.jsonl``. A write that fails (a full disk) must not
        stop rank 0 alone, since its peers would wait in the next collective: the rows stay in memory,
        the file is cut back to its last whole row, a warning says so and the next logging step tries
        again. A checkpoint that cannot be written stops every rank together (``checkpoint.py``)."""
        try:
            if self._jsonl is None:  # the last failure closed it
                with open(self._metrics_path, "r+b") as f:
                    f.truncate(self._written_bytes)  # a torn row of the failed write
                self._jsonl = open(self._metrics_path, "a")
            self._jsonl.write("".join(self._unwritten))
            self._jsonl.flush()
            self._written_bytes = os.fstat(self._jsonl.fileno()).st_size
        except OSError as err:
            if self._jsonl is not None:
                try:
                    self._jsonl.close()  # closes the file even when its buffer cannot be flushed
                except OSError:
                    pass  # the same failure again: the rows are still in self._unwritten
                self._jsonl = None
            log_main(
                f"warning: metrics.jsonl not written ({type(err).__name__}: {err}); "
                f"{len(self._unwritten)} rows kept in memory, written at the next logging step"
            )
            return
        self._unwritten = []

    def draw_curves(self) -> None:
        """Redraw ``curves.png`` beside ``metrics.jsonl`` (train/plots.py). A plot that fails is
        reported once and training goes on: this is a deliberate recovery boundary."""
        from dflash_train.train.plots import redraw_curves

        self._undrawn_rows = False
        try:
            redraw_curves(self._run_dir)
        except Exception as err:  # a figure must never stop a run
            if not self._plot_failed:
                log_main(
                    f"warning: curves.png not drawn ({type(err).__name__}: {err}); metrics.jsonl is complete"
                )
            self._plot_failed = True

    def eta_seconds(self, step: int) -> float | None:
        """Remaining time from the moving average step time; None until two steps were timed."""
        if not self.is_main or len(self._step_times) < 2:
            return None
        (first_step, first_time), (last_step, last_time) = self._step_times[0], self._step_times[-1]
        if last_step <= first_step:
            return None
        return (last_time - first_time) / (last_step - first_step) * max(self.total_steps - step, 0)

    def format_line(self, step: int, metrics: dict[str, Any]) -> str:
        """One human line: ``step 20/300 | loss 3.1416 | lr 2.00e-03 | ... | ETA 4m10s``."""
        parts = [f"step {step}/{self.total_steps}"]
        formats = {
            "loss": "loss {:.4f}",
            "lr": "lr {:.2e}",
            "grad_norm": "grad {:.3f}",
            "tau": "tau {:.3f}",
            "eval_tau": "eval tau {:.3f}",
            "eval_ngram_tau": "n-gram {:.3f}",
        }
        parts += [fmt.format(metrics[k]) for k, fmt in formats.items() if k in metrics]
        parts += [
            f"{k.removeprefix('eval_tau/')} {v:.3f}" for k, v in metrics.items() if k.startswith("eval_tau/")
        ]
        if "tokens_per_s" in metrics:
            parts.append(f"{format_count(metrics['tokens_per_s'])} tok/s")
        if metrics.get("mfu"):
            parts.append(f"MFU {100 * metrics['mfu']:.1f}%")
        eta = self.eta_seconds(step)
        if eta is not None:
            parts.append(f"ETA {format_duration(eta)}")
        if "peak_mem_gb" in metrics:
            parts.append(f"mem {metrics['peak_mem_gb']:.1f} GB")
        return " | ".join(parts)

    def close(self, failed: bool = False) -> None:
        """Flush and close every sink (idempotent); ``failed``: the run raised (wandb marks it failed)."""
        if not self.is_main or self._closed:
            return
        self._closed = True
        if self._unwritten:
            self.write_rows()
        if self._unwritten:
            log_main(
                f"warning: {len(self._unwritten)} rows of metrics were never written to {self._metrics_path}"
            )
        if self._jsonl is not None:
            self._jsonl.close()
        if self._undrawn_rows:  # the end of the run, unless its last row (an evaluation) is drawn
            self.draw_curves()
        if self._bar is not None:
            self._bar.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb_run is not None:
            self._wandb_run.finish(exit_code=1 if failed else None)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        """Close, also when the run raised: the rows, curves and backends are flushed and finished
        then, and a failure to close is logged without replacing the run's error."""
        if exc_type is None:
            self.close()
            return
        try:
            self.close(failed=True)
        except Exception as err:  # a recovery boundary: the run's own error is the one to see
            log_main(f"warning: closing the metrics log failed too: {type(err).__name__}: {err}")


def drop_rows_to_redo(path: Path, start_step: int, redo_eval: bool) -> None:
    """Before a run continues at ``start_step``: drop the rows of ``path`` it will log again, so every
    step keeps one training row. Those are the rows of later steps (a process that died after logging
    them, before their checkpoint committed), the evaluation rows of ``start_step`` when its held-out
    evaluation runs again (``redo_eval``: an earlier try of the owed evaluation got as far as logging
    it) and a line torn by a kill. Rewritten to a temporary file, then renamed over ``path``."""
    if not path.is_file():
        return
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line torn by a kill
            row = None
        redone = row is None or row["step"] > start_step
        redone = redone or (redo_eval and row["step"] == start_step and "eval_tau" in row)
        if redone:
            dropped += 1
        else:
            kept.append(line)
    if not dropped:
        return
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text("".join(f"{line}\n" for line in kept))
    os.replace(staging, path)
    log_main(f"{path}: dropped {dropped} rows of steps this run logs again (from step {start_step + 1})")


def open_summary_writer(summary_writer_cls: type | None, log_dir: Path, start_step: int):
    """TensorBoard's writer for a run that continues at ``start_step``, or None when it is off.

    Where an earlier process may have logged (a resume, or a start over an earlier run's events),
    ``purge_step`` hides its events of the steps this run logs again, from ``start_step + 1`` on: the
    rows ``drop_rows_to_redo`` drops from metrics.jsonl. A first start has nothing to hide."""
    if summary_writer_cls is None:
        return None
    earlier = start_step > 0 or log_dir.exists()
    purge = {"purge_step": start_step + 1} if earlier else {}
    return summary_writer_cls(log_dir=str(log_dir), **purge)


def import_summary_writer() -> type:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise ImportError(
            "logging.tensorboard=true needs the tensorboard package: `pip install tensorboard` "
            "(or `pip install dflash-train[tensorboard]`), or set logging.tensorboard=false."
        ) from err
    return SummaryWriter


def import_wandb() -> Any:
    try:
        import wandb
    except ImportError as err:
        raise ImportError(
            "logging.wandb=true needs the wandb package: `pip install wandb` "
            "(or `pip install dflash-train[wandb]`), or set logging.wandb=false."
        ) from err
    return wandb


def check_metrics(metrics: dict[str, Any]) -> None:
    """Metrics must already be Python numbers: a tensor here would mean a hidden host sync."""
    for name, value in metrics.items():
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, int | float) for v in values):
            raise TypeError(
                f"metric {name!r} is {type(value).__name__}: pass Python floats/ints or lists of them "
                "(call .item()/.tolist() once, on logging steps)."
            )


def finite_or_null(value: Any) -> Any:
    """JSON has no NaN/Infinity: write non-finite floats as null so any JSON reader parses the file."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, list):
        return [finite_or_null(v) for v in value]
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    return value


def flatten_scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """Scalars as they are; per-position lists as ``{name}/pos_{k}`` for block positions k >= 1."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if isinstance(value, list):
            out.update({f"{name}/pos_{i + 1}": float(v) for i, v in enumerate(value)})
        else:
            out[name] = float(value)
    return out


def format_duration(seconds: float) -> str:
    """``42s``, ``4m10s``, ``3h05m``, ``2d07h``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def format_count(value: float) -> str:
    """``950``, ``12.3K``, ``1.25M``."""
    if value >= 1e6:
        return f"{value / 1e6:.2f}M"
    if value >= 1e3:
        return f"{value / 1e3:.1f}K"
    return f"{value:.0f}"
