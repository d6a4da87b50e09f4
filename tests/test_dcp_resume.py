"""Sharded (DCP) checkpoints across ranks on CPU (gloo, FSDP2): a SIGKILL of one of two ranks in the
middle of a save leaves the previous checkpoint, which resumes bit for bit; a 2-rank checkpoint
resumes on 1 and on 3 ranks with exactly the losses of the same state loaded unsharded; a run sized
by epochs keeps its length and LR schedule when resumed on another number of ranks."""

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dflash_train.train import checkpoint as ckpt
from dflash_train.train.trainer import train
from tests.test_train_distributed import free_port
from tests.train_helpers import become_rank, spawn_ranks, tiny_config

FSDP = ["train.parallel=fsdp", "checkpoint.every_steps=4"]


pytestmark = pytest.mark.usefixtures("one_thread")


def rows(out_dir) -> list[dict]:
    path = Path(out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def worker(rank: int, world: int, port: int, task: dict, runs: list, extra: list, die_at: int):
    """One rank: train each output dir of ``runs`` in turn; rank 1 dies mid-save of step ``die_at``."""
    become_rank(rank, world, port)
    if rank == 1 and die_at:
        real_writer = ckpt._storage_writer

        def writer_that_dies(path):
            writer = real_writer(path)
            write_data = writer.write_data

            def write_then_die(plan, planner):
                written = write_data(plan, planner)
                written.wait()  # this rank's shard is on disk; the coordinator has not heard back
                if f"step-{die_at:08d}" in str(path):
                    os.kill(os.getpid(), signal.SIGKILL)
                return written

            writer.write_data = write_then_die
            return writer

        ckpt._storage_writer = writer_that_dies
    for out_dir in runs:
        train(tiny_config(task, out_dir, *extra))


def launch(task, world: int, runs: list, extra: list, die_at: int = 0) -> None:
    spawn_ranks(worker, (world, free_port(), task, [str(r) for r in runs], extra, die_at), nprocs=world)


def test_sigkill_of_one_rank_mid_save_keeps_the_previous_checkpoint(task, tmp_path):
    out = tmp_path / "run"
    extra = [*FSDP, "train.max_steps=8"]
    # torch.multiprocessing reports the killed rank 1, or rank 0 failing on the closed connection
    with pytest.raises(Exception, match="terminated with"):
        launch(task, 2, [out], extra, die_at=8)
    staged = ckpt.staging_folder(out, 8)
    assert (staged / "model_optim" / "__1_0.distcp").is_file()  # rank 1 had written its shard
    assert not (staged / ckpt.COMMIT_MARKER).exists() and not ckpt.step_folder(out, 8).exists()
    assert ckpt.latest_checkpoint(out).name == "step-00000004"
    first = rows(out)
    assert [r["step"] for r in first] == list(range(1, 9))  # steps 5-8 ran before the save died
    launch(task, 2, [out], extra)
    resumed = rows(out)  # the dead run's rows of steps 5-8 replaced by the resumed run's
    assert [r["step"] for r in resumed] == list(range(1, 9))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in first]  # bit for bit
    assert ckpt.latest_checkpoint(out).name == "step-00000008"


@pytest.fixture(scope="module")
def two_rank_checkpoint(train_task, tmp_path_factory):
    """Step 4 of a 2-rank FSDP2 run, sharded, and the same state in the older single-file layout."""
    out = tmp_path_factory.mktemp("two_ranks") / "run"
    launch(train_task, 2, [out], [*FSDP, "train.max_steps=6"])  # saves steps 4 and 6
    sharded = ckpt.step_folder(out, 4)
    assert {p.name for p in (sharded / "model_optim").glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    return sharded, single_file_copy(sharded, out.parent / "single-file")


def single_file_copy(sharded: Path, folder: Path) -> Path:
    """The checkpoint in the older layout, read through DCP's own converter (not the trainer's load)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder.mkdir()
    dcp_to_torch_save(sharded / "model_optim", folder / "full.pt")
    full = torch.load(folder / "full.pt", weights_only=False)
    save_file({k: v.contiguous() for k, v in full["model"].items()}, str(folder / "drafter.safetensors"))
    state = torch.load(sharded / "state.pt", weights_only=False)
    torch.save({**state, "optimizer": full["optim"]}, folder / "state.pt")
    for name in ("drafter_config.json", "config.yaml", ckpt.COMMIT_MARKER):
        shutil.copy(sharded / name, folder / name)
    (folder / "full.pt").unlink()
    return folder


def fresh_run_from(checkpoint: Path, out: Path) -> Path:
    """A new output_dir whose only checkpoint is a copy of ``checkpoint`` (as step 4)."""
    shutil.copytree(checkpoint, ckpt.step_folder(out, 4))
    return out


def test_two_rank_checkpoint_resumes_on_one_rank(task, two_rank_checkpoint, tmp_path, capsys):
    sharded, single_file = two_rank_checkpoint
    results = []
    for name, source in (("sharded", sharded), ("single", single_file)):
        out = fresh_run_from(source, tmp_path / name)
        # Synchronous saves here (the multi-rank runs write asynchronously, the default).
        train(tiny_config(task, out, *FSDP, "train.max_steps=6", "checkpoint.async_write=false"))
        results.append(rows(out))
        assert ckpt.is_sharded(ckpt.step_folder(out, 6))
    assert [r["step"] for r in results[0]] == [5, 6]
    assert [r["loss"] for r in results[0]] == [r["loss"] for r in results[1]]
    assert "resuming a 2-rank checkpoint on 1 ranks: data position" in capsys.readouterr().out


def test_two_rank_checkpoint_resumes_on_three_ranks(task, two_rank_checkpoint, tmp_path):
    sharded, single_file = two_rank_checkpoint
    outs = [fresh_run_from(sharded, tmp_path / "sharded"), fresh_run_from(single_file, tmp_path / "single")]
    launch(task, 3, outs, [*FSDP, "train.max_steps=6"])
    dcp_rows, reference = rows(outs[0]), rows(outs[1])
    assert [r["step"] for r in dcp_rows] == [5, 6]
    assert [r["loss"] for r in dcp_rows] == [r["loss"] for r in reference]


# ----------------------------------------------------------------------------- the schedule across world sizes

# No train.max_steps: the run's length comes from num_epochs and the steps per epoch, which depend
# on the world size (this task: 23 steps per epoch on 1 rank, 12 on 2).
BY_EPOCHS = ["train.max_steps=0", "train.num_epochs=1", "checkpoint.every_steps=4", "checkpoint.keep_last=10"]


def lr_by_step(out_dir) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in rows(out_dir)}


@pytest.mark.parametrize("saved_world,resumed_world", [(2, 1), (1, 2)])
def test_resume_on_another_world_size_keeps_the_length_and_the_lr_schedule(
    task, tmp_path, saved_world, resumed_world, capsys
):
    """The run started on ``saved_world`` ranks is continued from its step-4 checkpoint on
    ``resumed_world`` ranks: it ends at the uninterrupted run's last step with the same LR at every
    step (the schedule is the one the run started with, kept in the checkpoint)."""
    full = tmp_path / "full"
    if saved_world == 1:
        train(tiny_config(task, full, *BY_EPOCHS))
    else:
        launch(task, saved_world, [full], BY_EPOCHS)
    expected = lr_by_step(full)
    total = max(expected)
    assert total == {1: 23, 2: 12}[saved_world]  # the length really depends on the world size
    resumed = fresh_run_from(ckpt.step_folder(full, 4), tmp_path / "resumed")
    if resumed_world == 1:
        result = train(tiny_config(task, resumed, *BY_EPOCHS))
        assert result["step"] == total and result["export"] is not None
    else:
        launch(task, resumed_world, [resumed], BY_EPOCHS)
    assert (resumed / "export" / "model.safetensors").is_file()
    got = lr_by_step(resumed)
    assert sorted(got) == list(range(5, total + 1))  # each remaining step once, none past the end
    assert got == {s: expected[s] for s in range(5, total + 1)}
    state = torch.load(ckpt.step_folder(resumed, total) / ckpt.STATE_NAME, weights_only=False)
    assert state["world_size"] == resumed_world and state["step"] == total
    if resumed_world == 1:
        assert f"resuming a {saved_world}-rank checkpoint on 1 ranks" in capsys.readouterr().out


# ----------------------------------------------------------------------------- other data across world sizes


def test_resume_on_another_world_size_refuses_other_data_naming_what_changed(
    task, two_rank_checkpoint, tmp_path
):
    """Other data passes only with checkpoint.allow_data_change (the fingerprints differ), and only
    as long as the epoch has the checkpoint's steps: on another number of ranks that is checked at
    the checkpoint's world size, not skipped because the data position is remapped."""
    from tests.train_helpers import write_repeat_task

    sharded, _ = two_rank_checkpoint
    fewer = write_repeat_task(tmp_path / "fewer.jsonl", rows=24, seed=1)
    out = fresh_run_from(sharded, tmp_path / "other-data")
    allow = "checkpoint.allow_data_change=true"
    cfg = tiny_config(task, out, *FSDP, "train.max_steps=6", f"data.paths=[{fewer}]", allow)
    with pytest.warns(UserWarning, match="changed data.paths"):
        with pytest.raises(ValueError, match=r"data changed since the checkpoint") as refused:
            train(cfg)
    message = str(refused.value)
    assert f"data.paths: checkpoint [{task['data']!r}] -> now [{str(fewer)!r}]" in message
    assert "12 steps per epoch on its 2 ranks; the data now gives 6 on 2 ranks" in message
    assert not rows(out)  # nothing trained


def test_resume_on_another_world_size_with_the_same_data_moved_keeps_its_layout(
    task, two_rank_checkpoint, tmp_path
):
    sharded, _ = two_rank_checkpoint
    moved = tmp_path / "moved.jsonl"
    shutil.copy(task["data"], moved)
    out = fresh_run_from(sharded, tmp_path / "moved-data")
    with pytest.warns(UserWarning, match="changed data.paths"):
        result = train(tiny_config(task, out, *FSDP, "train.max_steps=6", f"data.paths=[{moved}]"))
    assert result["step"] == 6
