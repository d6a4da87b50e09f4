"""Two-rank training on CPU (gloo): DDP and FSDP2 train, and a NaN on one rank stops both."""

import json
import socket
from pathlib import Path

import pytest
import torch

from tests.train_helpers import (
    become_rank,
    logged_losses,
    rank_outcomes,
    spawn_ranks,
    tiny_config,
    tiny_overrides,
    train_and_record,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(
    rank: int, world: int, port: int, task: dict, out_dir: str, extra: list, mode: str, result_dir: str
):
    become_rank(rank, world, port)
    from dflash_train.train.trainer import NonFiniteError, TrainHooks, train

    outcome = {"rank": rank}
    snapshot = {}

    def poison_on_rank_1(run):
        if run.step == 2:
            snapshot.update({n: p.detach().clone() for n, p in run.model.named_parameters()})
            snapshot["run"] = run
            if rank == 1:
                next(run.model.parameters()).grad.fill_(float("nan"))

    hooks = TrainHooks(after_backward=poison_on_rank_1) if mode == "nan" else None
    try:
        outcome["result"] = train(tiny_config(task, out_dir, *extra), hooks)
    except NonFiniteError as err:
        run = snapshot.pop("run")
        outcome["error"] = str(err)
        outcome["params_unchanged"] = all(
            torch.equal(p, snapshot[n]) for n, p in run.model.named_parameters()
        )
        outcome["step"] = run.step
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(outcome, default=str))


def run_two_ranks(task, out_dir, extra, mode, tmp_path):
    result_dir = tmp_path / "results"
    result_dir.mkdir(exist_ok=True)
    spawn_ranks(worker, (2, free_port(), task, str(out_dir), extra, mode, str(result_dir)), nprocs=2)
    return [json.loads((result_dir / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture
def task(train_task):
    return train_task


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_train_and_the_loss_falls(task, tmp_path, parallel):
    extra = [f"train.parallel={parallel}", "train.max_steps=30", "checkpoint.every_steps=100"]
    outcomes = run_two_ranks(task, tmp_path / "run", extra, "train", tmp_path)
    assert [o["result"]["step"] for o in outcomes] == [30, 30]
    losses = logged_losses(tmp_path / "run")
    assert sum(losses[s] for s in range(26, 31)) < sum(losses[s] for s in range(1, 6)) - 1.0, losses
    assert Path(outcomes[0]["result"]["export"], "model.safetensors").is_file()


def test_nan_on_one_rank_stops_both_before_the_step(task, tmp_path):
    outcomes = run_two_ranks(task, tmp_path / "run", ["train.parallel=ddp"], "nan", tmp_path)
    for o in outcomes:
        assert "stopped before the optimizer step" in o["error"], o
        assert o["params_unchanged"] and o["step"] == 2


def export_fails_worker(rank: int, port: int, task: dict, out_dir: str) -> None:
    """Rank 0's write of the final export fails (a full disk); every rank writes how it ended."""
    become_rank(rank, 2, port)
    from dflash_train.models import export

    if rank == 0:

        def full_disk(*args, **kwargs):
            raise OSError(28, "No space left on device")

        export.save_drafter = full_disk
    extra = ["train.parallel=ddp", "train.max_steps=2"]
    train_and_record(rank, task, out_dir, *extra)


def run_info_fails_worker(rank: int, port: int, task: dict, out_dir: str) -> None:
    """Rank 0 cannot write config.yaml at the start (a read-only or full output_dir)."""
    become_rank(rank, 2, port)
    from dflash_train.config import RunConfig

    if rank == 0:
        to_yaml = RunConfig.to_yaml

        def read_only(self, path=None):
            if path is not None:
                raise PermissionError(13, "Permission denied", str(path))
            return to_yaml(self)

        RunConfig.to_yaml = read_only
    train_and_record(rank, task, out_dir, "train.parallel=ddp", "train.max_steps=2")


def test_a_failed_run_info_write_stops_every_rank_with_its_error(task, tmp_path):
    """Rank 0 cannot write config.yaml and run_info.json: every rank raises the same error before the
    first step, instead of the other ranks waiting for rank 0 in the first step's collective."""
    out = tmp_path / "run"
    out.mkdir()
    spawn_ranks(run_info_fails_worker, (free_port(), task, str(out)), nprocs=2, timeout_s=150)
    outcomes = rank_outcomes(out)
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith(
        f"RuntimeError: writing config.yaml and run_info.json to {out} failed: PermissionError:"
    )


def two_rank_ddp_worker(rank: int, port: int, task: dict, out_dir: str) -> None:
    become_rank(rank, 2, port)
    train_and_record(rank, task, out_dir, "train.parallel=ddp", "train.max_steps=2")


def test_a_metrics_log_rank_0_cannot_open_stops_every_rank_with_its_error(task, tmp_path):
    """Rank 0 alone opens metrics.jsonl (here a directory stands in its place): every rank raises the
    same error naming the log, instead of rank 1 failing on a closed connection in its first
    collective (gloo) or waiting there until train.dist_timeout_s (NCCL)."""
    out = tmp_path / "run"
    (out / "metrics.jsonl").mkdir(parents=True)
    spawn_ranks(two_rank_ddp_worker, (free_port(), task, str(out)), nprocs=2, timeout_s=150)
    outcomes = rank_outcomes(out)
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith(f"RuntimeError: opening the metrics log in {out} failed: "), outcomes


def test_a_failed_export_stops_every_rank_with_its_error(task, tmp_path):
    """Rank 0 cannot write the final export: every rank raises the same error naming it (the last
    checkpoint is committed), instead of the other ranks waiting at the export's barrier."""
    out = tmp_path / "run"
    out.mkdir()
    spawn_ranks(export_fails_worker, (free_port(), task, str(out)), nprocs=2, timeout_s=150)
    outcomes = rank_outcomes(out)
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith("RuntimeError: writing the export of step 2 failed on rank 0: OSError:")


def cli_worker(rank: int, port: int, task: dict, out_dir: str, result_dir: str) -> None:
    """What `dflash-train train` runs on each torchrun rank."""
    become_rank(rank, 2, port)
    import torch.distributed as dist

    from dflash_train.train.trainer import run_training

    result = run_training("tiny-cpu", tiny_overrides(task, out_dir, "train.parallel=ddp"))
    outcome = {"step": result["step"], "group_left": not dist.is_initialized()}
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(outcome))


def test_a_finished_run_leaves_the_process_group_before_the_process_exits(task, tmp_path):
    """Left to the interpreter's teardown, gloo's threads could abort a finished rank (SIGABRT,
    "terminate called without an active exception"), seen as a flaky split-placement test."""
    results = tmp_path / "results"
    results.mkdir()
    spawn_ranks(cli_worker, (free_port(), task, str(tmp_path / "run"), str(results)), nprocs=2)
    outcomes = [json.loads((results / f"rank{r}.json").read_text()) for r in range(2)]
    assert outcomes == [{"step": 12, "group_left": True}] * 2


def resume_fault_worker(rank: int, port: int, task: dict, out_dir: str, fault: str) -> None:
    """Two sittings of a 2-rank run; in the second, rank 1 alone resumes otherwise than rank 0: it lists
    only the older checkpoint (``older``: a stale listing of a shared file system), none (``none``:
    output_dir on a disk of its own node), or cannot read the checkpoint (``unreadable``)."""
    become_rank(rank, 2, port)
    extra = ["train.parallel=ddp", "train.max_steps=8", "checkpoint.every_steps=2", "train.dist_timeout_s=20"]
    train_and_record(rank, task, out_dir, *extra, "train.steps_per_process=4")
    from dflash_train.train import checkpoint as ckpt

    if rank == 1 and fault == "unreadable":

        def unreadable(path):
            raise PermissionError(13, "Permission denied", str(path / "state.pt"))

        ckpt.load_checkpoint = unreadable
    elif rank == 1:
        committed = ckpt.committed_checkpoints(out_dir)
        ckpt.latest_checkpoint = lambda output_dir: committed[-2] if fault == "older" else None
    train_and_record(rank, task, out_dir, *extra)


@pytest.mark.parametrize("seen", ["older", "none"])
def test_ranks_that_see_different_checkpoints_to_resume_stop_before_training(task, tmp_path, seen):
    """``checkpoint.resume: auto`` picks the newest checkpoint of output_dir: a rank that lists another
    one (or none) would resume other weights, step and data position than rank 0, and the ranks would
    train apart until one waited for the others at the run's end. Every rank refuses with one line."""
    out = tmp_path / "run"
    out.mkdir()
    spawn_ranks(resume_fault_worker, (free_port(), task, str(out), seen), nprocs=2, timeout_s=150)
    outcomes = rank_outcomes(out)
    assert outcomes[0] == outcomes[1], outcomes
    step = "checkpoints/step-00000002" if seen == "older" else "no checkpoint"
    assert outcomes[0].startswith(
        f"ValueError: checkpoint.resume=auto: the ranks see different checkpoints in {out}: rank 0 "
        f"{out}/checkpoints/step-00000004, rank 1 " + (f"{out}/{step}" if seen == "older" else step)
    ), outcomes
    # Nothing trained on: no checkpoint beyond the first sitting's, no metrics row of a later step.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    assert max(logged_losses(out)) == 4


def test_a_checkpoint_one_rank_cannot_read_stops_every_rank_with_its_error(task, tmp_path):
    """Before, rank 0 went on into the sharded load's collectives and waited for rank 1 until it
    exited (then failed on the closed connection): now both raise the same line within seconds."""
    out = tmp_path / "run"
    out.mkdir()
    spawn_ranks(resume_fault_worker, (free_port(), task, str(out), "unreadable"), nprocs=2, timeout_s=150)
    outcomes = rank_outcomes(out)
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith(
        f"RuntimeError: resume: reading {out}/checkpoints/step-00000004 failed on rank 1: PermissionError: "
    ), outcomes
    assert max(logged_losses(out)) == 4  # nothing trained on


def start_up_fails_worker(rank: int, port: int, task: dict, out_dir: str, planted: str) -> None:
    """Rank 1 alone fails one start-up step (``planted``: a builder of ``train.colocated``): a target
    or drafter path only rank 0's node has, or memory another process holds on rank 1's GPU."""
    become_rank(rank, 2, port)
    from dflash_train.train import colocated

    if rank == 1:

        def planted_failure(*args, **kwargs):
            raise RuntimeError(f"planted {planted} failure")

        setattr(colocated, planted, planted_failure)
    train_and_record(
        rank, task, out_dir, "train.parallel=ddp", "train.max_steps=2", "train.dist_timeout_s=20"
    )


@pytest.mark.parametrize("planted", ["build_target", "new_drafter", "build_optimizer"])
def test_a_start_up_failure_on_one_rank_stops_every_rank_at_once_with_one_line(task, tmp_path, planted):
    """Each rank builds its target, drafter and optimizer alone before the ranks first meet (DDP's
    wrapper, the data broadcast). One rank failing there left the others waiting in that collective:
    on gloo until the failed rank's connection closed (another error on each rank), on NCCL until
    train.dist_timeout_s (30 min by default). Now every rank raises the same line at once."""
    out = tmp_path / "run"
    out.mkdir()
    spawn_ranks(start_up_fails_worker, (free_port(), task, str(out), planted), nprocs=2, timeout_s=150)
    outcomes = rank_outcomes(out)
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0] == f"RuntimeError: start-up failed on rank 1: RuntimeError: planted {planted} failure"
