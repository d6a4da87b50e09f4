"""A save that fails for lack of space (a writer seam raising ``OSError(ENOSPC)`` in the middle of a
shard or of the commit), on one process and on two gloo ranks: every rank stops with one line that
names the path, the bytes needed and free, and the intact checkpoint; the staging folder is gone; and
the previous checkpoint resumes bit for bit. Before a save that would not fit, one warning per run."""

import errno
import json
import os
import re
from pathlib import Path

import pytest

from dflash_train.train import checkpoint as ckpt
from dflash_train.train import checkpoint_space as space
from dflash_train.train.trainer import run_training, train
from tests.test_train_distributed import free_port
from tests.train_helpers import (
    become_rank,
    rank_outcomes,
    spawn_ranks,
    tiny_config,
    tiny_overrides,
    train_and_record,
)

pytestmark = pytest.mark.usefixtures("one_thread")

FAILED_STEP = 8
# One line: what failed where, the bytes, and the checkpoint a restart continues from.
MESSAGE = (
    r"checkpoint of step 8 not saved: .*needs about [\d,]+ bytes \(.*GiB\) \(the size of step-00000004\), "
    r"[\d,]+ bytes \(.*\) free; the newest committed checkpoint, step 4 \(.*step-00000004\), is intact"
)


def losses(out_dir) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows]


def disk_full() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def fail_mid_shard(monkeypatch_setattr) -> None:
    """The DCP writer of step 8 writes part of a shard file, then the disk is full."""
    real = ckpt._storage_writer

    def writer(path):
        storage = real(path)
        if f"step-{FAILED_STEP:08d}" in str(path):

            def write_data(plan, planner):
                (Path(path) / "__partial.distcp").write_bytes(b"\0" * 64)
                raise disk_full()

            storage.write_data = write_data
        return storage

    monkeypatch_setattr(ckpt, "_storage_writer", writer)


def fail_mid_commit(monkeypatch_setattr) -> None:
    """Step 8's shards are on disk; the commit's state.pt does not fit."""
    real = ckpt._fsync_file

    def fsync(path):
        if path.name == ckpt.STATE_NAME and f"step-{FAILED_STEP:08d}" in str(path.parent):
            raise disk_full()
        real(path)

    monkeypatch_setattr(ckpt, "_fsync_file", fsync)


FAULTS = {"shard": fail_mid_shard, "commit": fail_mid_commit}


def assert_failed_cleanly(out) -> None:
    assert not ckpt.staging_folder(out, FAILED_STEP).exists()
    assert not ckpt.step_folder(out, FAILED_STEP).exists()
    assert ckpt.latest_checkpoint(out).name == "step-00000004"


@pytest.mark.parametrize("where,async_write", [("shard", "true"), ("commit", "false")])
def test_a_full_disk_stops_the_run_with_one_line_and_the_last_checkpoint_resumes(
    task, tmp_path, monkeypatch, where, async_write
):
    out = tmp_path / "run"
    overrides = tiny_overrides(task, out, f"checkpoint.async_write={async_write}")
    with monkeypatch.context() as patch:
        FAULTS[where](patch.setattr)
        with pytest.raises(SystemExit) as stopped:
            run_training("tiny-cpu", overrides)  # what `dflash-train train` runs
    message = str(stopped.value.code)
    assert message.startswith("dflash-train train: error: ") and "\n" not in message
    assert "no space left on the device (OSError) writing" in message
    assert ckpt.staging_folder(out, FAILED_STEP).name in message or "state.pt" in message
    assert re.search(MESSAGE, message), message
    assert_failed_cleanly(out)
    before = losses(out)
    # Asynchronous: the failure surfaces at the next save (step 12); synchronous: at once.
    assert [s for s, _ in before] == list(range(1, 13 if async_write == "true" else 9))
    train(tiny_config(task, out, f"checkpoint.async_write={async_write}"))
    after = losses(out)  # the failed run's rows after step 4 replaced by the resumed run's
    assert [s for s, _ in after] == list(range(1, 13))
    assert after[: len(before)] == before  # bit for bit, at every step both runs ran


def rank_worker(rank: int, world: int, port: int, task: dict, out: str, where: str, result_dir: str):
    """One rank: train with the fault on rank 1 (mid-shard) or rank 0 (mid-commit), or none."""
    become_rank(rank, world, port)
    if (where == "shard" and rank == 1) or (where == "commit" and rank == 0):
        FAULTS[where](lambda obj, name, value: setattr(obj, name, value))
    outcome = {"rank": rank}
    try:
        outcome["step"] = train(tiny_config(task, out))["step"]
    except space.CheckpointWriteError as err:
        outcome["error"] = str(err)
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(outcome))


def run_two_ranks(task, out, where, tmp_path) -> list[dict]:
    results = tmp_path / f"results-{where}"
    results.mkdir()
    spawn_ranks(rank_worker, (2, free_port(), task, str(out), where, str(results)), nprocs=2)
    return [json.loads((results / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("where", ["shard", "commit"])
def test_a_full_disk_on_one_of_two_ranks_stops_both_and_the_last_checkpoint_resumes(task, tmp_path, where):
    out = tmp_path / "run"
    outcomes = run_two_ranks(task, out, where, tmp_path)
    failing = 1 if where == "shard" else 0
    for o in outcomes:
        assert "error" in o, o  # every rank stopped, none hung or went on
        assert re.search(MESSAGE, o["error"]), o["error"]
    assert "no space left on the device" in outcomes[failing]["error"]
    assert_failed_cleanly(out)
    before = losses(out)
    assert [s for s, _ in before] == list(range(1, 13))  # asynchronous: found at the step-12 save
    assert [o.get("step") for o in run_two_ranks(task, out, "none", tmp_path)] == [12, 12]
    assert losses(out) == before  # steps 5..12 logged again in place of the failed run's, bit for bit


def test_a_save_that_would_not_fit_warns_once_per_run(task, tmp_path, monkeypatch):
    monkeypatch.setattr(space, "free_bytes", lambda output_dir: 1000)
    with pytest.warns(UserWarning, match=r"the checkpoint of step 4 may not fit.*1,000 bytes") as caught:
        train(tiny_config(task, tmp_path / "run"))  # saves at 4, 8 and 12
    assert len([w for w in caught if "may not fit" in str(w.message)]) == 1
    assert "an estimate" in str(caught[0].message)  # the first save has no earlier one to measure


def test_a_full_disk_behind_another_error_is_named_with_the_bytes(tmp_path, monkeypatch):
    """A full disk can reach DCP as torch's zip-writer RuntimeError (``unexpected pos``)."""
    last = ckpt.step_folder(tmp_path, 4)
    last.mkdir(parents=True)
    (last / ckpt.COMMIT_MARKER).write_text("4\n")
    (last / "shard").write_bytes(b"\0" * 5000)
    monkeypatch.setattr(space, "free_bytes", lambda output_dir: 700)
    error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    message = space.describe_failure(tmp_path, 8, space.failure_cause(tmp_path, 8, error, 10), num_params=10)
    assert "unexpected pos 704 vs 598 (RuntimeError) writing" in message
    assert "most likely because the disk is full" in message and "\n" not in message
    assert "needs about 5,002 bytes" in message and "700 bytes (0.00 GiB) free" in message
    assert "step 4 (" in message and "is intact" in message


def staging_fails_worker(rank: int, port: int, task: dict, out: str, async_write: str) -> None:
    """Rank 1 alone fails before DCP's write of step 8 starts: its staging copy (asynchronous: host
    memory runs out) or the creation of its writer (synchronous); every rank writes how it ended."""
    become_rank(rank, 2, port)
    if rank == 1:
        real = ckpt._storage_writer

        def writer(path):
            if f"step-{FAILED_STEP:08d}" in str(path) and async_write == "false":
                raise PermissionError(13, "Permission denied", str(path))
            storage = real(path)
            if f"step-{FAILED_STEP:08d}" in str(path):

                def stage(state_dict):
                    raise RuntimeError("out of host memory staging the checkpoint")

                storage.stage = stage
            return storage

        ckpt._storage_writer = writer
    # A rank left waiting in DCP's write or in the save's vote fails after 20 s, not the default 30 min.
    overrides = ("train.parallel=ddp", f"checkpoint.async_write={async_write}", "train.dist_timeout_s=20")
    train_and_record(rank, task, out, *overrides)


@pytest.mark.parametrize("async_write", ["true", "false"])
def test_a_save_that_fails_on_one_rank_before_the_write_stops_both_with_its_error(
    task, tmp_path, async_write
):
    """Rank 1 fails before it enters DCP's write (its collectives over the checkpoint group), while
    rank 0 is inside it: every rank raises the same line, naming rank 1 and the step, instead of rank 0
    waiting in the write for a rank that never comes (until its exit or ``train.dist_timeout_s``)."""
    out = tmp_path / "run"
    out.mkdir()
    spawn_ranks(staging_fails_worker, (free_port(), task, str(out), async_write), nprocs=2, timeout_s=120)
    outcomes = rank_outcomes(out)
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith("CheckpointWriteError: checkpoint of step 8 not saved: on rank 1: ")
    cause = "out of host memory" if async_write == "true" else "Permission denied"
    assert cause in outcomes[0] and re.search(MESSAGE, outcomes[0]), outcomes[0]
    assert_failed_cleanly(out)


def test_an_error_while_a_save_is_in_flight_is_not_replaced_by_that_saves_failure(
    task, tmp_path, monkeypatch, capsys
):
    """A non-finite loss stops the run at step 5 while the background commit of step 4 fails (a full
    disk): the run raises the error that stopped it, not the commit's raw OSError that the exit's wait
    for the save in flight used to raise in its place; the failed save is logged in one line."""
    from dflash_train.train.trainer import NonFiniteError, TrainHooks

    def full_disk(output_dir, step, **state):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "save_checkpoint", full_disk)

    def nan_at_step_5(run):
        if run.step == 4:
            next(run.model.parameters()).grad.fill_(float("nan"))

    cfg = tiny_config(task, tmp_path / "run", "checkpoint.async_write=true")
    with pytest.raises(NonFiniteError, match="non-finite loss"):
        train(cfg, TrainHooks(after_backward=nan_at_step_5))
    assert "the save of step 4 in flight failed too: OSError: " in capsys.readouterr().out
    assert ckpt.latest_checkpoint(tmp_path / "run") is None


def probe_fails_worker(rank: int, port: int, task: dict, out: str, where: str) -> None:
    """Rank 0's probes of the disk fail (a stale file handle of a network file system): its check of
    the space before the first save (``where="warning"``), or the sizes and free space that describe
    rank 0's own failed staging of step 8 (``where="description"``); every rank writes how it ended."""
    become_rank(rank, 2, port)

    def stale_handle(*args, **kwargs):
        raise OSError(errno.ESTALE, "Stale file handle")

    if rank == 0 and where == "warning":
        space.space_warning = stale_handle
    if rank == 0 and where == "description":
        space.free_bytes = stale_handle
        real = ckpt._storage_writer

        def writer(path):
            if f"step-{FAILED_STEP:08d}" in str(path):
                raise PermissionError(13, "Permission denied", str(path))
            return real(path)

        ckpt._storage_writer = writer
    overrides = ("train.parallel=ddp", "checkpoint.async_write=false", "train.dist_timeout_s=20")
    train_and_record(rank, task, out, *overrides)


@pytest.mark.parametrize("where", ["warning", "description"])
def test_a_failing_probe_of_the_disk_on_one_rank_does_not_stop_it_alone(task, tmp_path, where):
    """The space check before a save and the description of a failed save probe the disk outside the
    save's votes: their OSError stopped rank 0 alone, and rank 1 waited for it in the next vote (on
    NCCL until train.dist_timeout_s). Now a failed check is a warning and the run trains on; a failed
    description still stops both ranks with the save's one line, saying it could not be described."""
    out = tmp_path / "run"
    out.mkdir()
    spawn_ranks(probe_fails_worker, (free_port(), task, str(out), where), nprocs=2, timeout_s=120)
    outcomes = rank_outcomes(out)
    if where == "warning":
        assert outcomes == ["trained 12 steps"] * 2, outcomes
        return
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith(
        "CheckpointWriteError: checkpoint of step 8 not saved: on rank 0: PermissionError: "
    ), outcomes[0]
    assert "describing it failed too (OSError: [Errno 116] Stale file handle)" in outcomes[0]
