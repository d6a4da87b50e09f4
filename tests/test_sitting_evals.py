"""A sitting's stop never loses the held-out evaluation due at its step: a stop (``train.steps_per_process``,
``train.time_limit_s``, SIGTERM) on an evaluation step carries that evaluation in the checkpoint and the
next sitting runs it first, so metrics.jsonl and ``export-best`` hold every evaluation of the
uninterrupted run, each once, with the same numbers."""

import json
import os
import signal

import pytest

from dflash_train.train import checkpoint as ckpt
from dflash_train.train.trainer import TrainHooks, train
from tests import test_heldout_eval
from tests.test_heldout_eval import eval_overrides, metric_rows
from tests.train_helpers import tiny_config

# The held-out prompt files and the uninterrupted evaluated run of test_heldout_eval, as fixtures here.
prompt_files = test_heldout_eval.prompt_files
evaluated_run = test_heldout_eval.evaluated_run

pytestmark = pytest.mark.usefixtures("one_thread")

# The evaluated run's numbers that do not depend on when or in which process the evaluation ran.
TIMING_KEYS = ("time_eval_s", "time_eval_setup_s", "elapsed_s")


def evaluations(out) -> dict[int, dict]:
    """The evaluation rows of metrics.jsonl by step; fails if a step was evaluated twice."""
    rows = [r for r in metric_rows(out) if "eval_tau" in r]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"a step evaluated twice: {steps}"
    return {r["step"]: r for r in rows}


def assert_same_evaluations(out, reference_out) -> None:
    """The evaluations of ``out`` are those of the uninterrupted run: same steps, same taus."""
    ours, theirs = evaluations(out), evaluations(reference_out)
    assert sorted(ours) == sorted(theirs) == [5, 10, 12]
    for step, row in theirs.items():
        for key in ("eval_tau", "eval_tau/repeat", "eval_tau/chat", "eval_acc_by_pos"):
            assert ours[step][key] == row[key], (step, key)
    best = json.loads((out / "export-best" / "eval.json").read_text())
    reference_best = json.loads((reference_out / "export-best" / "eval.json").read_text())
    assert (best["step"], best["eval_tau"]) == (reference_best["step"], reference_best["eval_tau"])


def test_sittings_that_stop_on_evaluation_steps_carry_each_evaluation_to_the_next(
    task, prompt_files, tmp_path, evaluated_run
):
    """Sittings of 5 steps with an evaluation every 5 stop exactly on the evaluation steps; the second
    sitting dies after running the carried evaluation of step 5 (before any checkpoint), so the third
    runs it again: still one evaluation row per step."""
    reference_out, _, _ = evaluated_run
    out = tmp_path / "run"
    overrides = ["logging.every_steps=3", *eval_overrides(prompt_files), "train.steps_per_process=5"]
    first = train(tiny_config(task, out, *overrides))
    assert (first["step"], first["finished"], first["stopped"]) == (5, False, "steps_per_process")
    assert "eval_tau" not in metric_rows(out)[-1]  # carried: the checkpoint of step 5 owes it

    def die_in_step_7(run):
        if run.step == 7:
            raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        train(tiny_config(task, out, *overrides), TrainHooks(after_step=die_in_step_7))
    assert 5 in evaluations(out)  # the carried evaluation ran first
    assert ckpt.latest_checkpoint(out).name == "step-00000005"
    third = train(tiny_config(task, out, *overrides))
    assert (third["step"], third["stopped"]) == (10, "steps_per_process")
    last = train(tiny_config(task, out, *overrides))
    assert last["finished"] and last["export"]
    assert_same_evaluations(out, reference_out)
    steps = [r["step"] for r in metric_rows(out)]
    # One training row per logged step, plus the carried evaluations' rows (steps 5 and 10).
    assert steps == [3, 5, 5, 6, 9, 10, 10, 12]


def test_a_sigterm_in_the_last_step_leaves_the_final_evaluation_to_the_next_process(
    task, prompt_files, tmp_path, evaluated_run
):
    """A SIGTERM during step 12 of 12: the checkpoint is saved at once, the run is not finished
    (no export yet), and the next process runs the final evaluation, then exports."""
    reference_out, _, _ = evaluated_run
    out = tmp_path / "run"

    def sigterm_during_step_12(run):
        if run.step == 11:
            os.kill(os.getpid(), signal.SIGTERM)

    overrides = ["logging.every_steps=3", *eval_overrides(prompt_files)]
    first = train(tiny_config(task, out, *overrides), TrainHooks(after_backward=sigterm_during_step_12))
    assert (first["step"], first["finished"], first["stopped"], first["export"]) == (
        12,
        False,
        "signal",
        None,
    )
    assert sorted(evaluations(out)) == [5, 10]
    assert not (out / "export").exists()
    executed = []
    second = train(
        tiny_config(task, out, *overrides), TrainHooks(after_step=lambda run: executed.append(run.step))
    )
    assert executed == [] and second["finished"] and second["export"]
    assert_same_evaluations(out, reference_out)


def test_a_sigterm_while_the_held_out_continuations_are_generated_stops_after_the_first_step(
    task, prompt_files, tmp_path, monkeypatch
):
    """The held-out setup (the target's greedy continuations: minutes on a large target) runs before
    the loop; a SIGTERM then (a preemption) must stop the process at the first step boundary with a
    checkpoint, not be held until the run's end."""
    from dflash_train.train import colocated

    real_build = colocated.build_heldout_eval

    def build_during_a_sigterm(run):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_build(run)

    monkeypatch.setattr(colocated, "build_heldout_eval", build_during_a_sigterm)
    out = tmp_path / "run"
    result = train(tiny_config(task, out, *eval_overrides(prompt_files)))
    assert (result["step"], result["finished"], result["stopped"]) == (1, False, "signal")
    assert ckpt.latest_checkpoint(out).name == "step-00000001"
