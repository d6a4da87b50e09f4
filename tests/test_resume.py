"""Resume continues where the run stopped: each step runs exactly once and gives the uninterrupted
run's loss, bit for bit on CPU, after a SIGTERM, a SIGKILL of a real ``dflash-train train`` process
or a kill in the middle of a save; a drafter that differs from the checkpoint's is refused."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_train.train import checkpoint as ckpt
from dflash_train.train.trainer import TrainHooks, train
from tests import test_heldout_eval
from tests.test_heldout_eval import eval_overrides
from tests.train_helpers import tiny_config, tiny_overrides, train_stopped_by_sigterm

# The held-out prompt files of test_heldout_eval, as a fixture here.
prompt_files = test_heldout_eval.prompt_files

REPO = Path(__file__).parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


pytestmark = pytest.mark.usefixtures("one_thread")


def metric_rows(out_dir) -> list[dict]:
    """Every row of metrics.jsonl in order."""
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def step_recorder(executed: list[int], **hooks) -> TrainHooks:
    return TrainHooks(after_step=lambda run: executed.append(run.step), **hooks)


@pytest.fixture(scope="module")
def uninterrupted(train_task, tmp_path_factory):
    """Per-step losses of the uninterrupted 12-step run, from a ``dflash-train train`` process."""
    out = tmp_path_factory.mktemp("full") / "run"
    subprocess.run(cli_train_command(train_task, out), env=ENV, check=True, capture_output=True)
    rows = metric_rows(out)
    assert [r["step"] for r in rows] == list(range(1, 13))
    return [r["loss"] for r in rows]


def cli_train_command(task, out_dir, *extra) -> list[str]:
    script = Path(sys.executable).with_name("dflash-train")
    launcher = [str(script)] if script.is_file() else [sys.executable, "-m", "dflash_train.cli"]
    return [*launcher, "train", "tiny-cpu", *tiny_overrides(task, out_dir, *extra)]


def test_sigterm_resume_runs_each_step_once_with_the_uninterrupted_losses(task, tmp_path, uninterrupted):
    out = tmp_path / "run"

    def sigterm_during_step_6(run):
        if run.step == 5:  # steps done so far: the signal lands inside the 6th step
            os.kill(os.getpid(), signal.SIGTERM)

    first, second = [], []
    result = train(tiny_config(task, out), step_recorder(first, after_backward=sigterm_during_step_6))
    assert result["step"] == 6 and result["export"] is None and first == [1, 2, 3, 4, 5, 6]
    assert ckpt.latest_checkpoint(out).name == "step-00000006"
    result = train(tiny_config(task, out), step_recorder(second))
    assert second == list(range(7, 13)) and result["step"] == 12  # resumed, not restarted
    rows = metric_rows(out)
    assert [r["step"] for r in rows] == list(range(1, 13))  # each step logged exactly once
    assert [r["loss"] for r in rows] == uninterrupted  # bit-exact on CPU


def test_sigkill_of_a_real_train_process_restarts_bit_for_bit(task, tmp_path, uninterrupted):
    out = tmp_path / "run"
    # A save every 2 steps: the first one leaves 10 steps in which the kill lands.
    command = cli_train_command(task, out, "checkpoint.every_steps=2")
    proc = subprocess.Popen(command, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while ckpt.latest_checkpoint(out) is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.kill()  # SIGKILL: no handler runs, nothing is flushed or saved
    stderr = proc.communicate()[1].decode()[-2000:]
    assert proc.returncode == -signal.SIGKILL, f"the run ended before it was killed: {stderr}"
    saved = int(ckpt.latest_checkpoint(out).name.removeprefix("step-"))
    assert saved < 12, "the run finished before the kill; nothing was resumed"
    restart = subprocess.run(command, env=ENV, capture_output=True, text=True)
    assert restart.returncode == 0, restart.stderr[-2000:]
    rows = metric_rows(out)  # the killed process's rows after its checkpoint were logged again
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert [r["loss"] for r in rows] == uninterrupted


KILL_DURING_SAVE = """
import os, signal, sys
from dflash_train.train import checkpoint as ckpt
from dflash_train.train.trainer import train
from tests.train_helpers import tiny_config
real = ckpt._fsync_file
def fsync_then_die(path):
    real(path)
    if path.name == "state.pt" and "step-00000008" in str(path.parent):
        os.kill(os.getpid(), signal.SIGKILL)  # dies mid-save: no commit marker for step 8
ckpt._fsync_file = fsync_then_die
task = {"target": sys.argv[1], "data": sys.argv[2], "cache": sys.argv[3]}
train(tiny_config(task, sys.argv[4]))
"""


def test_sigkill_during_a_save_resumes_from_the_last_committed_step(task, tmp_path, uninterrupted):
    out = tmp_path / "run"
    args = [sys.executable, "-c", KILL_DURING_SAVE, task["target"], task["data"], task["cache"], str(out)]
    proc = subprocess.run(args, env=ENV, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert any(p.name.startswith(".tmp-step-00000008") for p in ckpt.checkpoints_root(out).iterdir())
    assert ckpt.latest_checkpoint(out).name == "step-00000004"
    # Steps 5-8 are logged again on resume. The commit of step 8 runs on the writer's thread while the
    # loop goes on, so on a busy machine step 9 (or later) can be logged before the kill lands.
    logged = [r["step"] for r in metric_rows(out)]
    assert logged == list(range(1, len(logged) + 1)) and 8 <= len(logged) < 12, logged
    executed = []
    assert train(tiny_config(task, out), step_recorder(executed))["step"] == 12
    assert executed == list(range(5, 13))
    rows = metric_rows(out)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert [r["loss"] for r in rows] == uninterrupted


SIGTERM_DURING_FINAL_COMMIT = """
import os, signal, sys
from dflash_train.train import checkpoint as ckpt
from dflash_train.train.trainer import train
from tests.train_helpers import tiny_config
real_close = ckpt.CheckpointWriter.close
def close_after_a_sigterm(self):
    os.kill(os.getpid(), signal.SIGTERM)  # a time limit that lands after the last step
    real_close(self)
ckpt.CheckpointWriter.close = close_after_a_sigterm
task = {"target": sys.argv[1], "data": sys.argv[2], "cache": sys.argv[3]}
train(tiny_config(task, sys.argv[4], "train.max_steps=4"))
"""


def test_a_sigterm_after_the_last_step_waits_for_the_final_commit_and_export(task, tmp_path):
    """The loop is done and the last checkpoint is being committed when SIGTERM arrives (the case
    of a run that stopped within seconds of its signal and left no checkpoint): the commit and the
    export complete, and the run exits cleanly saying so."""
    out = tmp_path / "run"
    args = [
        sys.executable,
        "-c",
        SIGTERM_DURING_FINAL_COMMIT,
        task["target"],
        task["data"],
        task["cache"],
        str(out),
    ]
    proc = subprocess.run(args, env=ENV, capture_output=True, text=True)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "SIGTERM received after the last step" in proc.stderr
    assert ckpt.latest_checkpoint(out).name == "step-00000004"
    assert (out / "export" / "config.json").is_file()


def test_a_sigterm_during_the_last_step_without_an_evaluation_owed_says_the_run_is_finished(
    task, tmp_path, capsys
):
    """It saves, exports and is done: telling the user to run the command again was wrong."""
    result = train_stopped_by_sigterm(tiny_config(task, tmp_path / "run", "train.max_steps=4"), during_step=4)
    assert (result["step"], result["finished"]) == (4, True) and result["export"]
    told = capsys.readouterr().out
    assert "SIGTERM during the last step" in told and "the run is finished" in told
    assert "not finished" not in told


def test_a_resume_from_a_named_checkpoint_sets_the_abandoned_later_ones_aside(task, tmp_path, capsys):
    """Steps 4, 8 and 12 exist; the run restarts from step 4 by path and is stopped at step 6. Its
    step 6 is then the newest checkpoint (keep_last kept it), and ``resume: auto`` continues it."""
    out = tmp_path / "run"
    train(tiny_config(task, out, "checkpoint.keep_last=3"))
    assert [p.name for p in ckpt.committed_checkpoints(out)] == [f"step-{s:08d}" for s in (4, 8, 12)]
    capsys.readouterr()

    def sigterm_during_step_6(run):
        if run.step == 5:
            os.kill(os.getpid(), signal.SIGTERM)

    resume = f"checkpoint.resume={ckpt.step_folder(out, 4)}"
    hooks = TrainHooks(after_backward=sigterm_during_step_6)
    assert train(tiny_config(task, out, "checkpoint.keep_last=3", resume), hooks)["step"] == 6
    log = capsys.readouterr().out
    assert "moved the abandoned run's later checkpoints step-00000008, step-00000012 to" in log
    # The same command would go back to step 4 again and set step 6 aside: the advice is resume=auto.
    assert "run the command again with checkpoint.resume=auto to continue from this checkpoint" in log
    assert "run the same command again" not in log
    assert [p.name for p in ckpt.committed_checkpoints(out)] == ["step-00000004", "step-00000006"]
    (aside,) = ckpt.checkpoints_root(out).glob("abandoned-*")
    assert sorted(p.name for p in aside.iterdir()) == ["step-00000008", "step-00000012"]
    executed = []
    train(tiny_config(task, out, "checkpoint.keep_last=3"), step_recorder(executed))
    assert executed == list(range(7, 13))  # resume: auto continued the new run, not step 12


def test_a_stopped_or_failed_run_started_with_resume_never_is_told_to_continue_with_resume_auto(
    task, tmp_path, capsys, monkeypatch
):
    """``checkpoint.resume=never`` sets every checkpoint aside and starts over: running that same
    command again after a SIGTERM (or a failed export) would throw the steps this process trained
    away. The advice names ``checkpoint.resume=auto``, and following it continues the run."""
    out = tmp_path / "run"
    stopped = train_stopped_by_sigterm(tiny_config(task, out, "checkpoint.resume=never"), during_step=6)
    assert (stopped["step"], stopped["finished"]) == (6, False)
    told = capsys.readouterr().out
    assert "run the command again with checkpoint.resume=auto to continue from this checkpoint" in told
    assert "checkpoint.resume=never would start over" in told
    assert "run the same command again" not in told
    from dflash_train.train import run as run_module

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(run_module, "write_export", full_disk)
    executed = []
    with pytest.raises(RuntimeError, match="writing the export of step 12 failed") as failed:
        train(tiny_config(task, out), step_recorder(executed))
    assert executed == list(range(7, 13))  # resume=auto continued the run
    assert "run the same command again" in str(failed.value)  # that command was resume=auto
    executed = []
    with pytest.raises(RuntimeError, match="writing the export of step 12 failed") as failed:
        checkpoint = ckpt.step_folder(out, 12)
        train(tiny_config(task, out, f"checkpoint.resume={checkpoint}"), step_recorder(executed))
    assert executed == []
    assert "run the command again with checkpoint.resume=auto to write the export" in str(failed.value)
    assert "run the same command again" not in str(failed.value)


# ----------------------------------------------------------------------------- refused resumes


@pytest.fixture(scope="module")
def four_step_run(train_task, tmp_path_factory):
    out = tmp_path_factory.mktemp("four") / "run"
    train(tiny_config(train_task, out, "train.max_steps=4"))
    return out


def resume_copy(task, four_step_run, tmp_path, *extra):
    """Resume a copy of the 4-step run (max_steps 4: the checks run, then nothing is left to do)."""
    out = tmp_path / "run"
    shutil.copytree(four_step_run, out)
    return train(tiny_config(task, out, "train.max_steps=4", *extra))


@pytest.mark.parametrize(
    "change,key",
    [
        ("drafter.block_size=4", "drafter.block_size"),
        ("drafter.mask_token_id=5", "drafter.mask_token_id"),
        ("drafter.is_causal=false", "drafter.is_causal"),
        ("drafter.sliding_window=16", "drafter.sliding_window"),
        ("drafter.layer_types=[full_attention,full_attention]", "drafter.layer_types"),
        ("drafter.rope_theta=500.0", "drafter.rope_theta"),
        ("drafter.intermediate_size=64", "drafter.intermediate_size"),
        ("drafter.preset=from-target", "drafter.preset"),
    ],
)
def test_resume_refuses_a_changed_drafter_naming_the_key(task, four_step_run, tmp_path, change, key):
    with pytest.raises(
        ValueError, match=rf"refusing to resume: .*{key}: checkpoint .*allow_changed=\[.*{key}"
    ):
        resume_copy(task, four_step_run, tmp_path, change)


@pytest.mark.parametrize(
    "change,key",
    [
        ("data.packing=true", "data.packing"),
        ("data.thinking=false", "data.thinking"),
        ("train.dtype=bfloat16", "train.dtype"),
        ("train.lr=1e-3", "train.lr"),
        ("train.betas=[0.9,0.99]", "train.betas"),
        ("train.warmup_ratio=0.5", "train.warmup_ratio"),
        ("train.min_lr_ratio=0.5", "train.min_lr_ratio"),
        ("train.clip_grad_norm=0.5", "train.clip_grad_norm"),
    ],
)
def test_resume_refuses_changed_data_or_numerics_naming_the_key(task, four_step_run, tmp_path, change, key):
    with pytest.raises(
        ValueError, match=rf"refusing to resume: .*{key}: checkpoint .*allow_changed=\[.*{key}"
    ):
        resume_copy(task, four_step_run, tmp_path, change)


def test_allowed_change_of_dtype_resumes(task, four_step_run, tmp_path):
    allow = "checkpoint.allow_changed=[train.dtype]"
    assert resume_copy(task, four_step_run, tmp_path, "train.dtype=bfloat16", allow)["step"] == 4


def test_an_allowed_change_of_the_learning_rate_applies_from_the_resumed_step(task, four_step_run, tmp_path):
    """The optimizer and scheduler states hold the LR they were saved with: an allowed train.lr must
    replace it (it was ignored, the run went on at the checkpoint's LR)."""
    lr_at_step_5 = {}
    for lr in ("3e-3", "6e-3"):  # the four-step run's LR, then twice it
        out = tmp_path / lr
        shutil.copytree(four_step_run, out)
        allow = "checkpoint.allow_changed=[train.max_steps,train.lr]"
        train(tiny_config(task, out, "train.max_steps=6", f"train.lr={lr}", allow))
        lr_at_step_5[lr] = next(r["lr"] for r in metric_rows(out) if r["step"] == 5)
    assert lr_at_step_5["3e-3"] > 0
    assert lr_at_step_5["6e-3"] == pytest.approx(2 * lr_at_step_5["3e-3"], rel=1e-6)


def test_allowed_change_of_shape_still_fails_with_a_clear_message(task, four_step_run, tmp_path):
    allow = "checkpoint.allow_changed=[drafter.intermediate_size,drafter_config.intermediate_size]"
    with pytest.raises(
        ValueError, match=r"another architecture.*mlp\.gate_proj\.weight: checkpoint \[128, 64\]"
    ):
        resume_copy(task, four_step_run, tmp_path, "drafter.intermediate_size=64", allow)


def test_allowed_semantic_change_resumes(task, four_step_run, tmp_path):
    allow = "checkpoint.allow_changed=[drafter.mask_token_id,drafter_config.dflash_config.mask_token_id]"
    assert resume_copy(task, four_step_run, tmp_path, "drafter.mask_token_id=5", allow)["step"] == 4


def test_changed_data_paths_resume_with_a_warning(task, four_step_run, tmp_path):
    moved = tmp_path / "moved.jsonl"
    shutil.copy(task["data"], moved)
    with pytest.warns(UserWarning, match=r"changed data.paths"):
        result = resume_copy(task, four_step_run, tmp_path, f"data.paths=[{moved}]")
    assert result["step"] == 4


def test_a_fresh_start_sets_the_earlier_runs_checkpoints_aside(task, tmp_path, capsys):
    """``resume: never`` into an output_dir holding an earlier run's steps 8 and 12: the new run is
    stopped at step 6, its steps 4 and 6 are kept (keep_last would have pruned them under the old,
    later steps) and ``resume: auto`` continues the new run, not the earlier run's step 12."""
    out = tmp_path / "run"
    train(tiny_config(task, out))
    assert [p.name for p in ckpt.committed_checkpoints(out)] == ["step-00000008", "step-00000012"]
    capsys.readouterr()

    def sigterm_during_step_6(run):
        if run.step == 5:
            os.kill(os.getpid(), signal.SIGTERM)

    hooks = TrainHooks(after_backward=sigterm_during_step_6)
    assert train(tiny_config(task, out, "checkpoint.resume=never"), hooks)["step"] == 6
    log = capsys.readouterr().out
    assert [p.name for p in ckpt.committed_checkpoints(out)] == ["step-00000004", "step-00000006"]
    assert "set aside the earlier run's step-00000008, step-00000012, sittings.jsonl in" in log
    # The earlier run's sittings went with them: the new run's log starts at its own first sitting.
    sittings = [json.loads(line) for line in (out / "sittings.jsonl").read_text().splitlines()]
    assert [(r["sitting"], r["start_step"]) for r in sittings] == [(1, 0)]
    assert len(list((out / "checkpoints").glob("abandoned-*/sittings.jsonl"))) == 1
    executed = []
    train(tiny_config(task, out), step_recorder(executed))
    assert executed == list(range(7, 13))


def test_a_fresh_start_resumed_before_its_first_evaluation_writes_its_own_export_best(
    task, prompt_files, tmp_path
):
    """``resume: never`` into an output_dir holding an earlier run's export-best (of step 1, a tau no
    drafter here reaches), the new run stopped at step 4 before any evaluation, then resumed: its
    evaluations were measured against the earlier run's best, so export-best stayed the earlier
    run's drafter and eval_tau_best its tau. The fresh start sets it aside with the checkpoints."""
    out = tmp_path / "run"
    earlier = out / "export-best"
    earlier.mkdir(parents=True)
    (earlier / "eval.json").write_text(json.dumps({"step": 1, "eval_tau": 99.0}))

    def sigterm_during_step_4(run):
        if run.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    overrides = eval_overrides(prompt_files)
    hooks = TrainHooks(after_backward=sigterm_during_step_4)
    assert train(tiny_config(task, out, "checkpoint.resume=never", *overrides), hooks)["step"] == 4
    train(tiny_config(task, out, *overrides))
    evaluated = [r for r in metric_rows(out) if "eval_tau" in r]
    assert [r["step"] for r in evaluated] == [5, 10, 12]
    best = max(evaluated, key=lambda r: r["eval_tau"])  # the first of equal maxima
    assert json.loads((earlier / "eval.json").read_text())["step"] == best["step"]
    assert evaluated[-1]["eval_tau_best"] == best["eval_tau"]
