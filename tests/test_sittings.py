"""Training in several sittings: ``train.steps_per_process`` / ``train.time_limit_s`` end a process at
a step boundary with a checkpoint and ``finished: false``; the same command continues the run, and
the sittings together give the per-step losses of one uninterrupted run, bit for bit on CPU."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_train.config import load_config
from dflash_train.train import checkpoint as ckpt
from dflash_train.train.sitting import Sitting, append_sitting, last_sitting
from dflash_train.train.trainer import TrainHooks, train
from tests.train_helpers import become_rank, logged_losses, spawn_ranks, tiny_config, tiny_overrides

REPO = Path(__file__).parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def uninterrupted(train_task, tmp_path_factory, one_thread_module):
    """Per-step losses of the uninterrupted 12-step run."""
    out = tmp_path_factory.mktemp("whole") / "run"
    train(tiny_config(train_task, out))
    losses = logged_losses(out)
    assert sorted(losses) == list(range(1, 13))
    return losses


def cli_train(task, out_dir, *extra) -> dict:
    """One ``dflash-train train --json`` process; its result (the last stdout line)."""
    command = [
        sys.executable,
        "-m",
        "dflash_train.cli",
        "train",
        "tiny-cpu",
        *tiny_overrides(task, out_dir, *extra),
    ]
    done = subprocess.run([*command, "--json"], env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"stdout": done.stdout, **json.loads(done.stdout.strip().splitlines()[-1])}


def test_three_processes_of_five_steps_give_the_uninterrupted_losses(task, tmp_path, uninterrupted):
    out = tmp_path / "run"
    results = [cli_train(task, out, "train.steps_per_process=5") for _ in range(3)]
    assert [(r["step"], r["finished"], r["stopped"]) for r in results] == [
        (5, False, "steps_per_process"),
        (10, False, "steps_per_process"),
        (12, True, None),
    ]
    assert results[0]["export"] is None and results[1]["export"] is None and results[2]["export"]
    assert "the run is not finished: run the same command again" in results[0]["stdout"]
    assert ckpt.latest_checkpoint(out).name == "step-00000012"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))  # no step lost or repeated
    assert {r["step"]: r["loss"] for r in rows} == uninterrupted  # bit-exact on CPU
    sittings = [json.loads(line) for line in (out / "sittings.jsonl").read_text().splitlines()]
    assert [(s["sitting"], s["start_step"], s["end_step"], s["finished"]) for s in sittings] == [
        (1, 0, 5, False),
        (2, 5, 10, False),
        (3, 10, 12, True),
    ]
    assert "export_s" in sittings[2] and "export_s" not in sittings[0]


KILL_DURING_THE_FINAL_SAVE = """
import os, signal, sys
from dflash_train.train import checkpoint as ckpt
from dflash_train.train.trainer import train
from tests.train_helpers import tiny_config
real = ckpt._fsync_file
def fsync_then_die(path):
    real(path)
    if path.name == "state.pt" and "step-00000006" in str(path.parent):
        os.kill(os.getpid(), signal.SIGKILL)  # dies in the sitting's final save: no commit of step 6
ckpt._fsync_file = fsync_then_die
task = {"target": sys.argv[1], "data": sys.argv[2], "cache": sys.argv[3]}
train(tiny_config(task, sys.argv[4], "train.steps_per_process=6"))
"""


def test_a_kill_in_the_final_save_leaves_no_step_logged_twice(task, tmp_path, uninterrupted):
    """The sitting logged steps 5 and 6, then died writing step 6's checkpoint: the next sitting
    resumes from step 4 and logs 5 and 6 again, in place of the rows the dead one left."""
    out = tmp_path / "run"
    args = [
        sys.executable,
        "-c",
        KILL_DURING_THE_FINAL_SAVE,
        task["target"],
        task["data"],
        task["cache"],
        str(out),
    ]
    proc = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert ckpt.latest_checkpoint(out).name == "step-00000004"
    assert max(logged_losses(out)) == 6  # the dead sitting's rows of steps 5 and 6 are there
    result = train(tiny_config(task, out))
    assert result["finished"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert {r["step"]: r["loss"] for r in rows} == uninterrupted


class FakeClock:
    """Seconds that pass only when a test says so: every step takes ``step_s``."""

    def __init__(self, step_s: float):
        self.now, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        return self.now

    def tick(self, run) -> None:
        self.now += self.step_s


def test_a_time_limit_ends_the_process_before_it_with_room_for_the_final_save(task, tmp_path, uninterrupted):
    out, limit = tmp_path / "run", 100.0
    first = FakeClock(step_s=10.0)
    result = train(
        tiny_config(task, out, f"train.time_limit_s={limit}"),
        TrainHooks(after_backward=first.tick, clock=first),
    )
    assert not result["finished"] and result["stopped"] == "time_limit" and result["export"] is None
    record, step = last_sitting(out), result["step"]
    assert record["stopped"] == "time_limit" and record["end_step"] == step < 12
    # The assumed save before one was measured; checkpoint.every_steps=4 puts a periodic save at 4, 8.
    params = json.loads((out / "run_info.json").read_text())["drafter_params"]
    save, margin = 5 + 12 * params / 250e6, 2.0
    assert first.now + save + margin <= limit  # ended before its limit, the final save included
    periodic = save if step % 4 == 0 else 0.0
    assert first.now + periodic + 10 + save + margin > limit  # and as late as that allows
    second = FakeClock(step_s=10.0)
    result = train(
        tiny_config(task, out, f"train.time_limit_s={limit}"),
        TrainHooks(after_backward=second.tick, clock=second),
    )
    assert result["finished"] and result["step"] == 12 and result["export"]
    assert logged_losses(out) == uninterrupted


def sitting(**overrides) -> Sitting:
    values = dict(time_limit_s=100.0, steps_per_process=0, start_step=0, total_steps=20, started=0.0)
    values |= dict(save_s=5.0, export_s=5.0, eval_s=0.0)
    s = Sitting(**(values | overrides))
    s.clock = lambda: s.now
    s.now, s.step_s = 0.0, [10.0, 10.0]
    return s


def never(step: int) -> bool:
    return False


def test_the_vote_reserves_the_next_step_the_final_save_and_at_the_end_evaluation_and_export():
    s = sitting()
    s.now = 80.0  # 80 + 10 (a step) + 5 (the save) + 2 (margin) = 97: room for one more
    assert not s.wants_stop(8, never, never) and s.stopped is None
    assert s.wants_stop(8, never, lambda step: step == 8)  # this step's periodic save leaves none
    assert s.stopped == "time_limit"
    # Before the last step: its evaluation and the export must fit as well.
    s = sitting(total_steps=9, eval_s=20.0)
    s.now = 60.0
    assert s.wants_stop(8, lambda step: step == 9, never)
    assert not sitting(total_steps=9).wants_stop(8, never, never)  # no evaluation: it fits
    # The run's last step is never a sitting's end: the run finishes in this process.
    s = sitting(total_steps=9)
    s.now = 1000.0
    assert not s.wants_stop(9, never, never)


def test_a_step_that_compiled_is_not_budgeted_as_the_next_one():
    """A bucketed run compiles once per new bucket; before, the slowest of those compilations was
    budgeted as every later step, and each sitting stopped that much before its limit."""
    compiles = [0]
    s = sitting(time_limit_s=400.0, total_steps=5000)
    s.compile_count, s.step_s = (lambda: compiles[0]), []

    def step(seconds: float, compiles_now: bool = False) -> None:
        s.begin_step()
        s.now += seconds
        compiles[0] += compiles_now
        s.end_step()

    step(30.0, compiles_now=True)  # the first step compiles
    assert s.step_estimate() == 30.0  # nothing else measured yet: the compiling step stands in
    for _ in range(50):
        step(0.1)
    step(22.0, compiles_now=True)  # a bucket met for the first time
    for _ in range(50):
        step(0.1)
    assert s.step_estimate() == pytest.approx(0.1)
    s.now = 400.0 - 0.1 - 5.0 - 8.0 - 1.0  # a step, the final save, the 2% margin: room for one more
    assert not s.wants_stop(102, never, never)
    assert s.measured["compiling_steps"] == 2 and s.measured["compiling_step_s"] == 30.0  # the slowest
    step(5.0)  # a slow step that compiled nothing (a stall) still counts
    assert s.step_estimate() == 5.0


def test_a_row_appended_after_a_torn_line_stays_readable(tmp_path, capsys):
    """A process killed while writing its row leaves a line without its newline: the next row must
    start a line of its own, and the reader says what it skipped."""
    log = tmp_path / "sittings.jsonl"
    log.write_text(json.dumps({"sitting": 1, "end_step": 5}) + "\n" + '{"sitting": 2, "end_st')
    assert last_sitting(tmp_path) == {"sitting": 1, "end_step": 5}
    assert "1 unreadable line" in capsys.readouterr().out
    append_sitting(tmp_path, {"end_step": 12})
    lines = log.read_text().splitlines()
    assert len(lines) == 3 and lines[1] == '{"sitting": 2, "end_st'
    assert last_sitting(tmp_path) == {"sitting": 3, "end_step": 12}
    assert "unreadable" not in capsys.readouterr().out


def test_steps_per_process_count_from_where_the_process_started():
    s = sitting(time_limit_s=0.0, steps_per_process=3, start_step=6)
    assert [s.wants_stop(step, never, never) for step in (7, 8, 9)] == [False, False, True]
    assert s.stopped == "steps_per_process"
    assert not sitting(time_limit_s=0.0, steps_per_process=3, start_step=6, total_steps=9).wants_stop(
        9, never, never
    )


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        (["train.time_limit_s=-1"], ValueError, "must be >= 0"),
        (["train.steps_per_process=5", "checkpoint.resume=never"], ValueError, "checkpoint.resume=auto"),
        # A named checkpoint: every sitting (the same command) would resume it and set aside the last one's.
        (
            ["train.time_limit_s=540", "checkpoint.resume=/runs/x/checkpoints/step-00000004"],
            ValueError,
            "same place",
        ),
        (
            ["train.time_limit_s=540", "train.placement=split", "train.target_ranks=1"],
            NotImplementedError,
            "placement=colocated",
        ),
    ],
)
def test_sitting_settings_that_cannot_work_are_refused_with_the_fix(overrides, error, match):
    with pytest.raises(error, match=match):
        load_config("tiny-cpu", ["output_dir=/tmp/x", *overrides])


def two_rank_worker(rank: int, world: int, port: int, task: dict, out_dir: str, result_dir: str):
    """Only rank 1's clock runs out: both ranks must stop after the same step."""
    become_rank(rank, world, port)
    clock = FakeClock(step_s=10.0 if rank == 1 else 0.0)
    cfg = tiny_config(task, out_dir, "train.parallel=ddp", "train.time_limit_s=100")
    result = train(cfg, TrainHooks(after_backward=clock.tick, clock=clock))
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(result, default=str))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_stop_is_decided_by_every_rank_together(task, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    spawn_ranks(two_rank_worker, (2, free_port(), task, str(tmp_path / "run"), str(results)), nprocs=2)
    outcomes = [json.loads((results / f"rank{r}.json").read_text()) for r in range(2)]
    assert outcomes[0]["step"] == outcomes[1]["step"] < 12
    assert [o["finished"] for o in outcomes] == [False, False]
    assert outcomes[0]["stopped"] == "another_rank" and outcomes[1]["stopped"] == "time_limit"
