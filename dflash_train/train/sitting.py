"""Training in several sittings: one process's share of a run, ended by ``train.time_limit_s`` or
``train.steps_per_process`` at a step boundary with a checkpoint, so that the next process with the
same command resumes from it (``checkpoint.resume: auto``) and the run goes on as if uninterrupted.

Why: a machine lent by the call (a GPU for at most 10 minutes a command, a preemptible queue) can
give a run of 30 minutes only as several processes. The process must end *before* its limit, with
the checkpoint committed, so it stops when the time left would not cover what comes next: the rest
of this step (an evaluation or periodic save due at it), one more step, the final save, and at the
run's last step its held-out evaluation and export. Those costs are measured as the process goes
(the slowest step of this process but its first and those that compiled: a shape met for the
first time, a one-time cost; each evaluation and save), and the previous sitting's measured final save, evaluation and export, from
``output_dir/sittings.jsonl``, stand in for what this one has not measured yet; before any, a save
is assumed to write 12 bytes per drafter parameter at 250 MB/s.

Each rank votes with its own clock; the vote rides on the step's one all-reduce
(``step.optimizer_update``), so every rank stops after the same step. A process always trains at
least one step, so a sequence of sittings always progresses. The run's last step is never a
sitting's stop: the held-out evaluation and export happen only in the process that finishes the run.

``sittings.jsonl`` (rank 0) gets one row per process: the steps it trained, whether the run is
finished, why it stopped, its wall time and the measured costs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_train.generate.compiled_step import compiled_graph_count
from dflash_train.train.logging import log_main

SITTINGS_LOG = "sittings.jsonl"
# The assumed write speed of a checkpoint before one was measured, bytes per second.
ASSUMED_WRITE_BYTES_PER_S = 250e6
# Bytes per drafter parameter in a checkpoint (fp32 weights and AdamW's two moments) and an export
# (the full fp32 state gathered, written in bf16).
CHECKPOINT_BYTES_PER_PARAM, EXPORT_BYTES_PER_PARAM = 12, 6


@dataclass
class Sitting:
    """The limits and measured costs of this process's share of the run; ``wants_stop`` is its vote.

    Times are seconds on ``clock`` since ``started`` (the start of ``train()``, so loading the
    target, the data and the checkpoint count; the interpreter's start and imports before it do not).
    """

    time_limit_s: float
    steps_per_process: int
    start_step: int
    total_steps: int
    started: float
    clock: Callable[[], float] = time.monotonic
    step_s: list[float] = field(default_factory=list)  # iterations of this process, eval and save left out
    compiling_step_s: list[float] = field(default_factory=list)  # iterations in which dynamo compiled
    compile_count: Callable[[], int] = compiled_graph_count
    eval_s: float = 0.0
    save_s: float = 0.0
    export_s: float = 0.0
    measured: dict[str, float] = field(default_factory=dict)  # what this process measured (the log row)
    stopped: str | None = None
    iteration_start: float = 0.0
    iteration_extra: float = 0.0  # evaluation and save time inside the current iteration
    iteration_compiles: int = 0  # compile_count() when the current iteration began

    @classmethod
    def begin(cls, run, started: float, clock: Callable[[], float]) -> Sitting:
        """The sitting of ``run`` (just built and resumed), with its cost estimates before any measurement."""
        from dflash_train.train.parallel import unwrap

        num_params = sum(p.numel() for p in unwrap(run.model).parameters())
        previous = last_sitting(run.cfg.output_dir)
        sitting = cls(
            time_limit_s=run.cfg.train.time_limit_s,
            steps_per_process=run.cfg.train.steps_per_process,
            start_step=run.step,
            total_steps=run.total_steps,
            started=started,
            clock=clock,
            save_s=previous.get("save_s")
            or 5 + CHECKPOINT_BYTES_PER_PARAM * num_params / ASSUMED_WRITE_BYTES_PER_S,
            export_s=previous.get("export_s")
            or 5 + EXPORT_BYTES_PER_PARAM * num_params / ASSUMED_WRITE_BYTES_PER_S,
            # Until measured (``timed``): the last sitting's, else the held-out setup's time, a bound.
            eval_s=previous.get("eval_s") or 0.0,
        )
        sitting.measured["startup_s"] = round(sitting.elapsed(), 3)
        return sitting

    def elapsed(self) -> float:
        return self.clock() - self.started

    def begin_step(self) -> None:
        self.iteration_start, self.iteration_extra = self.clock(), 0.0
        self.iteration_compiles = self.compile_count()

    def end_step(self) -> None:
        seconds = self.clock() - self.iteration_start - self.iteration_extra
        compiled = self.compile_count() != self.iteration_compiles
        (self.compiling_step_s if compiled else self.step_s).append(seconds)
        if compiled:
            self.measured["compiling_steps"] = len(self.compiling_step_s)
            self.measured["compiling_step_s"] = max(self.compiling_step_s)

    def timed(self, kind: str, work: Callable[[], Any]) -> Any:
        """Run ``work`` and keep its duration: ``eval_s`` (an evaluation), ``save_s`` (a save) or
        ``eval_setup_s`` (the held-out continuations, which bound an evaluation until one is measured)."""
        t0 = self.clock()
        value = work()
        seconds = self.clock() - t0
        self.iteration_extra += seconds
        self.measured[kind] = max(self.measured.get(kind, 0.0), seconds)
        if kind == "eval_s":  # measured: it replaces the estimate
            self.eval_s = self.measured[kind]
        elif kind == "save_s":  # a periodic save may be asynchronous (staging only): never below a full one
            self.save_s = max(self.save_s, seconds)
        elif not self.eval_s:
            self.eval_s = seconds
        return value

    def step_estimate(self) -> float:
        """The slowest step of this process but its first (warm-up) and those that compiled, or, before
        any such step, the slowest that compiled, or the one in progress.

        A step that compiled met a shape for the first time (a new length bucket's attention, say):
        the steps after it reuse the compiled code, and a later step that meets another new shape is
        one that no estimate from past steps foresees. Counting those steps made every sitting of
        a bucketed run budget a compilation per step and stop that much before its limit."""
        done = self.step_s[1:] or self.step_s or self.compiling_step_s
        return max(done) if done else self.clock() - self.iteration_start

    def wants_stop(
        self, step: int, eval_due: Callable[[int], bool], periodic_save: Callable[[int], bool]
    ) -> bool:
        """This rank's vote at the end of ``step`` (1-based, the step in progress): stop after it?

        ``eval_due(s)`` / ``periodic_save(s)``: whether step s runs the held-out evaluation / a
        periodic save (when not stopping). Sets ``stopped`` to the reason.
        """
        if step >= self.total_steps:
            return False  # the last step: the run finishes in this process
        if self.steps_per_process and step - self.start_step >= self.steps_per_process:
            self.stopped = "steps_per_process"
            return True
        if not self.time_limit_s:
            return False
        one_step = self.step_estimate()
        rest = (self.eval_s if eval_due(step) else 0.0) + (self.save_s if periodic_save(step) else 0.0)
        last = step + 1 == self.total_steps  # the next step would finish the run: evaluation, export
        finish = ((self.eval_s if eval_due(step + 1) else 0.0) + self.export_s) if last else 0.0
        margin = max(2.0, 0.02 * self.time_limit_s)
        if self.elapsed() + rest + one_step + finish + self.save_s + margin > self.time_limit_s:
            self.stopped = "time_limit"
            return True
        return False

    def record(self, run, export_s: float | None) -> dict[str, Any]:
        """The log row of this sitting (rank 0 appends it to ``sittings.jsonl``)."""
        if export_s is not None:
            self.measured["export_s"] = round(export_s, 3)
        return {
            "start_step": self.start_step,
            "end_step": run.step,
            "total_steps": run.total_steps,
            "finished": run.finished,
            "stopped": self.stopped,
            "elapsed_s": round(self.elapsed(), 3),
            "time_limit_s": self.time_limit_s,
            "steps_per_process": self.steps_per_process,
            "step_s": round(self.step_estimate(), 4) if self.step_s or self.compiling_step_s else None,
            **{k: round(v, 3) for k, v in self.measured.items()},
        }


def last_sitting(output_dir: str | Path) -> dict[str, Any]:
    """The newest readable row of ``output_dir/sittings.jsonl`` ({} when there is none). Unreadable
    lines after it (a torn row of a process killed while writing it) are skipped and counted."""
    path = Path(output_dir) / SITTINGS_LOG
    if not path.is_file():
        return {}
    skipped, row = 0, {}
    for line in reversed(path.read_text().splitlines()):
        try:
            row = json.loads(line)
            break
        except ValueError:
            skipped += 1
    if skipped:
        log_main(
            f"{path}: skipped {skipped} unreadable line(s) after its newest readable row (a process killed "
            "while writing its row); the cost estimates come from that row"
        )
    return row


def append_sitting(output_dir: str | Path, row: dict[str, Any]) -> None:
    """Append one sitting's row, numbered after the rows already there. A torn last line (a process
    killed while writing its row) is ended first, so that the new row is a line of its own."""
    path = Path(output_dir) / SITTINGS_LOG
    text = path.read_text() if path.is_file() else ""
    torn = "\n" if text and not text.endswith("\n") else ""
    with open(path, "a") as fh:
        fh.write(torn + json.dumps({"sitting": len(text.splitlines()) + 1, **row}) + "\n")


def stop_message(
    reason: str, saved: Path | None, step: int, total: int, owed_eval: bool = False, resume: str = "auto"
) -> str:
    """What a sitting that was asked to stop prints (``owed_eval``: it stopped on a held-out
    evaluation step, whose evaluation the next process runs first; ``resume``: the run's
    ``checkpoint.resume``, ``continue_advice``). Asked during the last step with no evaluation owed,
    the run is finished (``Run.finished``): it exports and nothing is left to run."""
    why = {
        "time_limit": "train.time_limit_s reached",
        "steps_per_process": "train.steps_per_process reached",
        "signal": "SIGTERM",
        "another_rank": "another rank voted to stop (SIGTERM or its time limit)",
    }.get(reason, reason)
    if step >= total and not owed_eval:
        return f"{why} during the last step: saved {saved} at step {step} of {total}; the run is finished"
    owed = f"; the held-out evaluation of step {step} runs first" if owed_eval else ""
    advice = continue_advice(resume, "to continue from this checkpoint")
    return f"{why}: saved {saved} at step {step} of {total}; the run is not finished: {advice}{owed}"


def continue_advice(resume: str, purpose: str) -> str:
    """How to go on from the run's newest checkpoint (``purpose``: "to continue from this checkpoint",
    ...), given the ``checkpoint.resume`` of the command that ran. With ``auto`` it is the same command;
    a command that names ``never`` (it starts over) or a checkpoint (it goes back to that one) would
    set aside the checkpoints this process wrote and train their steps again, so the advice names
    ``checkpoint.resume=auto`` instead."""
    if resume == "auto":
        return f"run the same command again {purpose} (checkpoint.resume: auto)"
    would = "start over" if resume == "never" else "go back to that checkpoint"
    return (
        f"run the command again with checkpoint.resume=auto {purpose} (this command's "
        f"checkpoint.resume={resume} would {would}, setting the newer checkpoints aside)"
    )
