"""Split placement (train/split.py): target ranks stream features to drafter ranks over gloo.

Every multi-rank test launches real processes the way torchrun does (RANK, WORLD_SIZE,
MASTER_ADDR/PORT, LOCAL_RANK env vars) running this file as a worker, with one CPU thread each
so that colocated and split runs execute the same kernels and can be compared bit for bit.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the quick brown fox jumps over lazy dog def add return class point print range".split()


# ----------------------------------------------------------------------------- launching


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(spec: dict, world_size: int, run_dir: Path, timeout_s: float = 120) -> tuple[list[int], float]:
    """Run ``world_size`` worker processes torchrun-style; return their exit codes and the wall time."""
    result_dir = run_dir / "results"
    result_dir.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "result_dir": str(result_dir)}
    port, procs = free_port(), []
    for rank in range(world_size):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env["OMP_NUM_THREADS"] = "1"
        if world_size > 1:
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        log = open(run_dir / f"rank{rank}.log", "a")  # noqa: SIM115 (closed with the process below)
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, __file__, json.dumps(spec)],
                    env=env,
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                ),
                log,
            )
        )
    start, codes = time.monotonic(), []
    try:
        for proc, log in procs:
            codes.append(proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - start))))
            log.close()
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
    return codes, time.monotonic() - start


def losses(output_dir: Path, key: str = "loss") -> list[float]:
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    return [r[key] for r in rows]


def logs(run_dir: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(run_dir.glob("rank*.log")))


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_hybrid_dir):
    """The tiny hybrid target, 48 chat rows and the recipe overrides every run shares."""
    import random

    root = tmp_path_factory.mktemp("split")
    rng = random.Random(0)
    with open(root / "chat.jsonl", "w") as f:
        for _ in range(48):
            question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
            answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"messages": messages}) + "\n")
    overrides = [
        f"target.path={tiny_hybrid_dir}",
        f"data.paths=[{root / 'chat.jsonl'}]",
        f"data.cache_dir={root / 'cache'}",
        "target.target_layer_ids=[0,2]",
        "logging.every_steps=1",
        "train.max_steps=6",
        "checkpoint.every_steps=3",
    ]
    return root, overrides


def split_overrides(target_ranks: int, max_in_flight: int) -> list[str]:
    return [
        "train.placement=split",
        f"train.target_ranks={target_ranks}",
        f"train.max_in_flight={max_in_flight}",
    ]


def final_drafter(output_dir: Path) -> dict:
    from dflash_train.models.export import read_dcp_model_state

    return read_dcp_model_state(output_dir / "checkpoints" / "step-00000006" / "model_optim")


# ----------------------------------------------------------------------------- unit tests


def test_layout_validates_rank_counts_and_assigns_every_micro_batch_once():
    from dflash_train.train.split import SplitLayout, pipeline_depth

    with pytest.raises(ValueError, match="target_ranks"):
        SplitLayout.create(target_ranks=2, world_size=2, rank=0)
    with pytest.raises(ValueError, match="target_ranks"):
        SplitLayout.create(target_ranks=0, world_size=3, rank=0)
    with pytest.raises(ValueError, match="max_in_flight"):
        pipeline_depth(0, 1)
    assert (pipeline_depth(2, 1), pipeline_depth(1, 2), pipeline_depth(4, 2)) == (2, 0, 2)
    layout = SplitLayout.create(target_ranks=3, world_size=5, rank=0)  # 3 target : 2 drafter
    owners = [layout.producer(m, d) for m in range(6) for d in range(2)]
    assert sorted(owners) == [0] * 4 + [1] * 4 + [2] * 4  # balanced round robin
    two_to_one = SplitLayout.create(target_ranks=2, world_size=3, rank=0)
    assert [two_to_one.producer(m, 0) for m in range(4)] == [0, 1, 0, 1]


class FakeWork:
    def __init__(self, log: list):
        self.done, self.log = False, log

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> None:
        self.log.append("wait")
        self.done = True


def test_feature_sender_waits_on_the_oldest_send_beyond_max_in_flight():
    import torch

    from dflash_train.train.split import FeatureSender

    log: list = []
    works: list[FakeWork] = []

    def isend(tensor, dst):
        works.append(FakeWork(log))
        log.append(("send", dst))
        return works[-1]

    sender = FeatureSender(max_in_flight=2, device=torch.device("cpu"), isend=isend)
    for _ in range(4):
        sender.send_features(3, torch.zeros(2, 5))
    assert log == [("send", 3), ("send", 3), "wait", ("send", 3), "wait", ("send", 3)]
    assert [w.done for w in works] == [True, True, False, False]  # the oldest ones were waited on
    assert sender.depth_max == 2 and sender.bytes == 4 * 10 * 4
    works[2].done = True  # received meanwhile: reaped without waiting
    sender.send_features(3, torch.zeros(2, 5))
    assert log[-1] == ("send", 3) and log.count("wait") == 2
    sender.send_features(4, torch.zeros(1))  # another drafter has its own queue
    assert log[-1] == ("send", 4) and log.count("wait") == 2


# ----------------------------------------------------------------------------- multi-process runs


def test_one_target_two_drafters_match_colocated_world_two_and_resume(setup):
    """1 target : 2 drafter ranks == colocated with 2 ranks, bit for bit, across a stop and a resume.

    Target rank 0 votes "stop" at step 3 (as a SIGTERM on that rank would): every rank stops
    together, drafter rank 0 saves step 3, the drafters drain the 2 steps the target ran ahead
    (max_in_flight 2, grad_accum 1), and a second launch resumes to step 6.
    """
    root, overrides = setup
    colocated, split = root / "colocated2", root / "split12"
    codes, _ = launch(
        {"mode": "colocated", "overrides": [*overrides, f"output_dir={colocated}"]}, 2, colocated
    )
    assert codes == [0, 0], logs(colocated)
    spec = {"mode": "split", "overrides": [*overrides, f"output_dir={split}", *split_overrides(1, 2)]}
    codes, _ = launch({**spec, "stop_rank": 0, "stop_step": 2}, 3, split)
    assert codes == [0, 0, 0], logs(split)
    assert (split / "checkpoints" / "step-00000003" / "COMMITTED").is_file()
    assert not (split / "export").exists()
    codes, _ = launch(spec, 3, split)
    assert codes == [0, 0, 0], logs(split)
    # Exact, not approximate: the same kernels (one thread each) run on the same fp32 inputs, the
    # features cross gloo byte for byte, and the drafter-group reductions sum the same 2 values.
    assert losses(split) == losses(colocated)
    assert losses(split, "grad_norm") == losses(colocated, "grad_norm")
    ours, theirs = final_drafter(split), final_drafter(colocated)
    assert ours.keys() == theirs.keys() and all(ours[k].equal(theirs[k]) for k in ours)
    depth_max = losses(split, "split_queue_depth_max")
    assert max(depth_max) <= 2 and max(depth_max) >= 1
    assert all(value > 0 for value in losses(split, "split_feature_bytes_per_s"))


def test_two_targets_one_drafter_match_colocated_world_one_with_grad_accum(setup):
    """2 target : 1 drafter ranks (micro-batches alternate between the target ranks) == 1 process."""
    import torch

    root, overrides = setup
    overrides = [*overrides, "train.grad_accum=2"]
    colocated, split = root / "colocated1", root / "split21"
    codes, _ = launch(
        {"mode": "colocated", "overrides": [*overrides, f"output_dir={colocated}"]}, 1, colocated
    )
    assert codes == [0], logs(colocated)
    spec = {"mode": "split", "overrides": [*overrides, f"output_dir={split}", *split_overrides(2, 1)]}
    codes, _ = launch({**spec, "record_checkpoint_threads": True}, 3, split)
    assert codes == [0, 0, 0], logs(split)
    # As colocated: run_info.json (with the kernels target rank 0 bound) and background checkpoint writes.
    info = json.loads((split / "run_info.json").read_text())
    assert info["placement"] == "split" and (info["target_ranks"], info["drafter_ranks"]) == (2, 1)
    assert info["target_kernels"]["chunk_gated_delta_rule"] == "torch" and info["world_size"] == 3
    threads = (split / "results" / "checkpoint-threads.txt").read_text().split()
    assert len(threads) == 2 and all(name.startswith("checkpoint") for name in threads), threads
    assert losses(split) == losses(colocated)
    assert max(losses(split, "split_queue_depth_max")) == 1  # max_in_flight=1 holds
    ours, theirs = final_drafter(split), final_drafter(colocated)
    assert all(ours[k].equal(theirs[k]) for k in theirs)
    # The data files' fingerprints (target rank 0's, sent to the drafters) as colocated records them.
    data_files = [
        torch.load(run / "checkpoints" / "step-00000006" / "state.pt", weights_only=False)["data_files"]
        for run in (split, colocated)
    ]
    assert data_files[0] == data_files[1] and data_files[0][0]["rows"] == 48


def test_a_crashing_target_rank_fails_every_rank_without_hanging(setup):
    root, overrides = setup
    run_dir = root / "crash"
    spec = {
        "mode": "split",
        "overrides": [*overrides, f"output_dir={run_dir}", *split_overrides(1, 2)],
        "fail_rank": 0,
        "fail_step": 2,
        "timeout": 30,
    }
    codes, seconds = launch(spec, 3, run_dir, timeout_s=90)
    assert all(code != 0 for code in codes), logs(run_dir)
    assert seconds < 60
    assert "injected target failure" in logs(run_dir)
    assert not (run_dir / "checkpoints" / "step-00000003").exists()


def test_a_tokenization_bug_on_target_rank_0_fails_every_rank_at_once(setup):
    """Any exception while rank 0 tokenizes (here a planted TypeError) reaches every rank as the same
    error within seconds, instead of leaving the others in a collective until train.dist_timeout_s."""
    root, overrides = setup
    run_dir = root / "tokenize-bug"
    spec = {
        "mode": "split",
        # A fresh cache directory: the planted failure is in building the token cache.
        "overrides": [
            *overrides,
            f"output_dir={run_dir}",
            f"data.cache_dir={run_dir / 'cache'}",
            *split_overrides(1, 2),
        ],
        "plant_tokenize_error": True,
        "timeout": 300,
    }
    codes, seconds = launch(spec, 3, run_dir, timeout_s=200)
    assert all(code != 0 for code in codes), logs(run_dir)
    failures = [json.loads((run_dir / "results" / f"rank{r}.json").read_text()) for r in range(3)]
    for failure in failures:
        assert failure["error"].startswith(
            "RuntimeError: data preparation failed on rank 0: TypeError: planted"
        ), failure
    failed_at = [f["time"] for f in failures]
    assert max(failed_at) - min(failed_at) < 10, failed_at  # together, not one by one at a timeout
    assert seconds < 150


@pytest.mark.parametrize("failed_step,async_write", [(3, "false"), (6, "true")])
def test_a_failed_save_stops_the_target_ranks_with_the_drafters_at_once(setup, failed_step, async_write):
    """The commit of a save fails for lack of space (drafter rank 0; synchronous at step 3, or the
    background commit of the last save, found after the loop): the target rank stops with the
    drafters' one-line error within seconds, not at a gloo error when they exit or at
    train.dist_timeout_s."""
    root, overrides = setup
    run_dir = root / f"save-fails-{failed_step}"
    spec = {
        "mode": "split",
        "overrides": [
            *overrides,
            f"output_dir={run_dir}",
            f"checkpoint.async_write={async_write}",
            *split_overrides(1, 2),
        ],
        "fail_save_step": failed_step,
        "record_logger_close": True,
        "timeout": 300,
    }
    codes, seconds = launch(spec, 3, run_dir, timeout_s=200)
    assert all(code != 0 for code in codes), logs(run_dir)
    failures = [json.loads((run_dir / "results" / f"rank{r}.json").read_text()) for r in range(3)]
    for failure in failures:
        assert failure["error"].startswith(
            f"CheckpointWriteError: checkpoint of step {failed_step} not saved: "
        )
    # The target rank (0) has drafter rank 0's (global 1) line, which names the full disk.
    assert "no space left on the device" in failures[1]["error"]
    assert (
        failures[0]["error"].startswith(failures[1]["error"])
        and "target rank 0 stopped" in failures[0]["error"]
    )
    failed_at = [f["time"] for f in failures]
    assert max(failed_at) - min(failed_at) < 10, failed_at
    assert seconds < 150
    # The drafter ranks (1, 2) closed their metrics logger on the way out (rows, TensorBoard, wandb).
    assert sorted(p.name for p in (run_dir / "results").glob("logger-closed-*")) == [
        "logger-closed-rank1",
        "logger-closed-rank2",
    ]


def test_a_sigterm_in_the_target_ranks_last_save_vote_waits_for_the_commit_and_export(setup):
    """Every rank gets SIGTERM after the last step, the target rank while it waits for the last
    save's outcome (the time limit of a scheduler lands on all ranks at once): as the drafter ranks
    do, it finishes that vote first and exits cleanly, so the run is committed and exported (before,
    the signal killed the target rank there and the drafter ranks failed on the lost peer)."""
    root, overrides = setup
    run_dir = root / "sigterm-last-vote"
    spec = {
        "mode": "split",
        "overrides": [*overrides, f"output_dir={run_dir}", *split_overrides(1, 2)],
        "sigterm_on_save_vote": 3,  # the target rank's votes: steps 3 and 6, then the last commit's
    }
    codes, _ = launch(spec, 3, run_dir)
    assert codes == [0, 0, 0], logs(run_dir)
    assert (run_dir / "checkpoints" / "step-00000006" / "COMMITTED").is_file()
    assert (run_dir / "export" / "model.safetensors").is_file()
    assert "SIGTERM received after the last step" in (run_dir / "rank0.log").read_text()


def test_a_colocated_checkpoint_owing_an_evaluation_resumes_split_and_finishes(setup):
    """A colocated sitting that stopped on an evaluation step owes that evaluation; split placement
    runs none (it refuses eval.prompts), so it says so and drops it: the split run finishes and its
    checkpoints owe nothing (before, it never counted as finished and every rerun re-exported)."""
    import torch

    root, overrides = setup
    run_dir = root / "owed-then-split"
    evaluated = [
        f"eval.prompts=[{root / 'chat.jsonl'}]", "eval.every_steps=3", "eval.num_prompts=2", "eval.max_new_tokens=8",
    ]  # fmt: skip
    colocated = {"mode": "colocated", "overrides": [*overrides, f"output_dir={run_dir}", *evaluated]}
    codes, _ = launch(
        {**colocated, "overrides": [*colocated["overrides"], "train.steps_per_process=3"]}, 1, run_dir
    )
    assert codes == [0], logs(run_dir)
    state = torch.load(run_dir / "checkpoints" / "step-00000003" / "state.pt", weights_only=False)
    assert state["owed_eval_step"] == 3  # stopped on its evaluation step
    codes, _ = launch(
        {"mode": "split", "overrides": [*overrides, f"output_dir={run_dir}", *split_overrides(1, 1)]},
        2,
        run_dir,
    )
    assert codes == [0, 0], logs(run_dir)
    drafter = json.loads((run_dir / "results" / "rank1.json").read_text())
    assert drafter["finished"] is True and drafter["step"] == 6, drafter
    state = torch.load(run_dir / "checkpoints" / "step-00000006" / "state.pt", weights_only=False)
    assert state["owed_eval_step"] is None
    said = "".join(p.read_text() for p in run_dir.glob("rank*.log"))
    assert "the one owed at step 3 is not run" in said


def test_a_refused_resume_stops_the_target_ranks_with_the_drafters(setup):
    """A resume the drafter ranks refuse (here a changed train.gamma) is the same one-line error on
    the target ranks, at once, not a gloo error when the drafters exit."""
    root, overrides = setup
    run_dir = root / "refused-resume"
    codes, _ = launch({"mode": "colocated", "overrides": [*overrides, f"output_dir={run_dir}"]}, 1, run_dir)
    assert codes == [0], logs(run_dir)
    spec = {
        "mode": "split",
        "overrides": [*overrides, f"output_dir={run_dir}", "train.gamma=3", *split_overrides(1, 2)],
        "timeout": 300,
    }
    codes, seconds = launch(spec, 2, run_dir, timeout_s=200)
    assert all(code != 0 for code in codes), logs(run_dir)
    failures = [json.loads((run_dir / "results" / f"rank{r}.json").read_text()) for r in range(2)]
    for failure in failures:
        assert failure["error"].startswith(
            "ValueError: refusing to resume: train.gamma: checkpoint 0.0 -> now 3.0"
        )
    assert "target rank 0 stopped with the drafter ranks" in failures[0]["error"]
    failed_at = [f["time"] for f in failures]
    assert max(failed_at) - min(failed_at) < 10, failed_at
    assert seconds < 150


def test_a_data_position_mismatch_stops_every_rank_at_once_with_one_line(setup):
    """The target rank reports another data position than the drafters' at the save of step 3 (a
    planted off-by-one): every rank, the other drafter rank and the target rank included, raises the
    same one-line error within seconds, and no checkpoint of step 3 is written. A regression (only
    drafter rank 0 raising) leaves the others waiting until train.dist_timeout_s (30 s here)."""
    root, overrides = setup
    run_dir = root / "position-mismatch"
    spec = {
        "mode": "split",
        "overrides": [*overrides, f"output_dir={run_dir}", *split_overrides(1, 2)],
        "shift_target_position_at": 3,
        "timeout": 30,
    }
    codes, seconds = launch(spec, 3, run_dir, timeout_s=150)
    assert all(code != 0 for code in codes), logs(run_dir)
    failures = [json.loads((run_dir / "results" / f"rank{r}.json").read_text()) for r in range(3)]
    errors = {failure["error"] for failure in failures}
    assert len(errors) == 1, errors  # the same line on every rank
    (error,) = errors
    assert (
        error.startswith("RuntimeError: split data positions disagree at step 3: drafter ")
        and "\n" not in error
    )
    failed_at = [f["time"] for f in failures]
    assert max(failed_at) - min(failed_at) < 10, failed_at
    assert not (run_dir / "checkpoints" / "step-00000003").exists()


def test_a_checkpoint_the_drafters_cannot_read_stops_the_target_ranks_with_them(setup):
    """Not only a refused resume: any failure of the drafter ranks' resume (here a planted read
    error of the checkpoint's shards) is the same line on every rank, at once, instead of the target
    ranks waiting for the resume point (until train.dist_timeout_s on NCCL)."""
    root, overrides = setup
    run_dir = root / "unreadable-checkpoint"
    codes, _ = launch({"mode": "colocated", "overrides": [*overrides, f"output_dir={run_dir}"]}, 1, run_dir)
    assert codes == [0], logs(run_dir)
    spec = {
        "mode": "split",
        "overrides": [*overrides, f"output_dir={run_dir}", *split_overrides(1, 2)],
        "fail_resume": True,
        "timeout": 30,
    }
    codes, seconds = launch(spec, 3, run_dir, timeout_s=150)
    assert all(code != 0 for code in codes), logs(run_dir)
    failures = [json.loads((run_dir / "results" / f"rank{r}.json").read_text()) for r in range(3)]
    expected = "RuntimeError: resuming failed on drafter rank 0: OSError: planted unreadable shard"
    for failure in failures:
        assert failure["error"].startswith(expected), failure
    assert "target rank 0 stopped with the drafter ranks" in failures[0]["error"]
    failed_at = [f["time"] for f in failures]
    assert max(failed_at) - min(failed_at) < 10, failed_at


@pytest.mark.parametrize(
    "planted,expected",
    [
        ("build_target", "target rank 0: RuntimeError: planted build_target failure"),
        ("build_optimizer", "drafter rank 0: RuntimeError: planted build_optimizer failure"),
        ("metrics_log", "drafter rank 0: RuntimeError: opening the metrics log in "),
    ],
)
def test_a_start_up_failure_of_either_role_stops_every_rank_at_once_with_one_line(setup, planted, expected):
    """A start-up step only one role does fails: building the target on the target rank (before the
    roles first meet, in the data preparation), building the drafters' optimizer (before they meet
    at the resume), or opening the metrics log on drafter rank 0 (output_dir/metrics.jsonl is a
    directory; after the last start-up collective, while the target rank goes on to stream). Every
    rank raises the same one-line error within seconds. Before, the other role waited for the failed
    one in its next collective: here gloo's "Connection closed by peer" once the failed ranks exit,
    on NCCL until train.dist_timeout_s."""
    root, overrides = setup
    run_dir = root / f"start-up-fails-{planted}"
    if planted == "metrics_log":
        (run_dir / "metrics.jsonl").mkdir(parents=True)
    spec = {
        "mode": "split",
        "overrides": [*overrides, f"output_dir={run_dir}", *split_overrides(1, 2)],
        "fail_builder": None if planted == "metrics_log" else planted,
        "timeout": 30,
    }
    codes, seconds = launch(spec, 3, run_dir, timeout_s=150)
    assert all(code != 0 for code in codes), logs(run_dir)
    assert seconds < 100
    failures = [json.loads((run_dir / "results" / f"rank{r}.json").read_text()) for r in range(3)]
    errors = {failure["error"] for failure in failures}
    assert len(errors) == 1, errors  # the same line on every rank
    (error,) = errors
    assert error.startswith(f"RuntimeError: split start-up failed on {expected}") and "\n" not in error
    failed_at = [f["time"] for f in failures]
    assert max(failed_at) - min(failed_at) < 10, failed_at  # together, not one by one at a timeout


# ----------------------------------------------------------------------------- worker (one rank)


def worker(spec: dict) -> None:
    import torch

    torch.set_num_threads(1)
    from dflash_train.config import load_config
    from dflash_train.train import trainer
    from dflash_train.train.parallel import finish_distributed
    from dflash_train.train.split import SplitHooks, train_split

    cfg = load_config("tiny-cpu", [*spec["overrides"], f"train.dist_timeout_s={spec.get('timeout', 60)}"])
    rank = int(os.environ.get("RANK", "0"))

    def request_stop(r: int, step: int) -> bool:
        return r == spec.get("stop_rank") and step == spec.get("stop_step")

    def before_target_forward(r: int, step: int) -> None:
        if r == spec.get("fail_rank") and step == spec.get("fail_step"):
            raise RuntimeError(f"injected target failure on rank {r} at step {step}")

    if spec.get("record_checkpoint_threads"):
        import threading

        from dflash_train.train import checkpoint as ckpt

        real_save = ckpt.save_checkpoint

        def recording_save(*args, **kwargs):
            with open(Path(spec["result_dir"], "checkpoint-threads.txt"), "a") as f:
                f.write(threading.current_thread().name + "\n")
            return real_save(*args, **kwargs)

        ckpt.save_checkpoint = recording_save
    if spec.get("record_logger_close"):
        from dflash_train.train import split

        real_open_logger = split.open_logger

        def recording_open_logger(run):
            logger = real_open_logger(run)
            close = logger.close
            closed = Path(spec["result_dir"], f"logger-closed-rank{rank}")
            logger.close = lambda **kwargs: closed.touch() or close(**kwargs)
            return logger

        split.open_logger = recording_open_logger
    if spec.get("fail_save_step"):
        import errno

        from dflash_train.train import checkpoint as ckpt

        real_fsync = ckpt._fsync_file

        def fsync_on_a_full_disk(path):
            if path.name == ckpt.STATE_NAME and f"step-{spec['fail_save_step']:08d}" in str(path.parent):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real_fsync(path)

        ckpt._fsync_file = fsync_on_a_full_disk
    if spec.get("shift_target_position_at"):
        from dflash_train.train import split

        real_report = split.FeatureProducer.report

        def shifted_report(self, done):
            report = real_report(self, done)
            if done == spec["shift_target_position_at"]:
                report["data"] = {**report["data"], "position": report["data"]["position"] + 1}
            return report

        split.FeatureProducer.report = shifted_report
    if spec.get("sigterm_on_save_vote") and rank == 0:
        import signal

        from dflash_train.train import split

        real_vote, votes = split.share_save_outcome, []

        def signalled_vote(*args, **kwargs):
            votes.append(1)
            if len(votes) == spec["sigterm_on_save_vote"]:
                os.kill(os.getpid(), signal.SIGTERM)
            return real_vote(*args, **kwargs)

        split.share_save_outcome = signalled_vote
    if spec.get("fail_resume"):
        from dflash_train.train import checkpoint as ckpt

        def unreadable(*args, **kwargs):
            raise OSError("planted unreadable shard")

        ckpt.load_sharded_state = unreadable
    if spec.get("fail_builder"):
        from dflash_train.train import builders

        def planted_builder(*args, **kwargs):
            raise RuntimeError(f"planted {spec['fail_builder']} failure")

        setattr(builders, spec["fail_builder"], planted_builder)
    if spec.get("plant_tokenize_error"):
        from dflash_train.data import cache

        def broken_check(tokenizer):
            raise TypeError("planted tokenization failure")

        cache.check_tokenizer = broken_check
    try:
        if spec["mode"] == "split":
            hooks = SplitHooks(request_stop=request_stop, before_target_forward=before_target_forward)
            result = train_split(cfg, hooks)
        else:
            result = trainer.train(cfg)
    except Exception as err:
        failure = {"error": f"{type(err).__name__}: {err}", "time": time.time()}
        Path(spec["result_dir"], f"rank{rank}.json").write_text(json.dumps(failure))
        raise
    Path(spec["result_dir"], f"rank{rank}.json").write_text(json.dumps(result, default=str))
    finish_distributed()  # as `dflash-train train` does (trainer.run_training)


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]))
