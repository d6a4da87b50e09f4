"""Shared pieces of the training tests: a learnable toy task, a confident tiny target, a config."""

import faulthandler
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_train.config import load_config
from dflash_train.tiny import save_tiny_target

WORDS = ["def", "add", "return", "self", "print", "range", "class", "Point", "the", "quick", "fox"]


def write_repeat_task(path: Path, rows: int = 48, seed: int = 0) -> Path:
    """A learnable toy task: the response repeats a short random phrase several times."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            phrase = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 4)))
            messages = [
                {"role": "user", "content": f"repeat: {phrase}"},
                {"role": "assistant", "content": " ".join([phrase] * 6)},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def confident_tiny_target(directory: Path) -> Path:
    """The tiny hybrid target with an LM head as sharp as a trained model's.

    At the default 0.02 init the random head maps any hidden state to near-uniform logits, so a
    drafter could only learn by inflating its final norm over thousands of steps.
    """
    from transformers import AutoModelForCausalLM

    save_tiny_target(directory, kind="hybrid", seed=0)
    model = AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
    model.save_pretrained(directory)
    return directory


def tiny_config(task, out_dir, *extra):
    return load_config("tiny-cpu", tiny_overrides(task, out_dir, *extra))


def tiny_overrides(task, out_dir, *extra) -> list[str]:
    """The dotted overrides of the ``tiny-cpu`` recipe that make the tests' small fast run."""
    return [
        f"target.path={task['target']}",
        f"data.paths=[{task['data']}]",
        f"data.cache_dir={task['cache']}",
        f"output_dir={out_dir}",
        "target.target_layer_ids=[0,2]",
        "data.seq_buckets=[64,128]",
        "data.token_budget=256",
        "train.num_anchors=8",
        "train.max_steps=12",
        "train.lr=3e-3",
        "logging.every_steps=1",
        "logging.progress_bar=off",
        "checkpoint.every_steps=4",
        "train.dist_timeout_s=120",  # a wedged 2-rank test fails in minutes, not half an hour
        *extra,
    ]


def train_stopped_by_sigterm(config, during_step: int = 4) -> dict:
    """``train(config)`` with a SIGTERM during step ``during_step`` (it saves at that step's end and stops)."""
    import signal

    from dflash_train.train.trainer import TrainHooks, train

    def sigterm(run):
        if run.step == during_step - 1:
            os.kill(os.getpid(), signal.SIGTERM)

    return train(config, TrainHooks(after_backward=sigterm))


def logged_losses(out_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def become_rank(rank: int, world: int, port: int) -> None:
    """Inside a spawned worker: the torchrun environment of ``rank`` of ``world`` on a local port,
    and one CPU thread (ranks compare bit for bit with a one-thread single process)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)


def train_and_record(rank: int, task: dict, out_dir: str, *overrides: str) -> None:
    """Inside a spawned worker: train the tiny run and write how this rank ended to
    ``out_dir/rank{rank}.txt`` ("trained N steps", or the error's type and message)."""
    from dflash_train.train.trainer import train

    try:
        outcome = f"trained {train(tiny_config(task, out_dir, *overrides))['step']} steps"
    except Exception as err:  # the outcome of each rank, whatever it is, is what the test compares
        outcome = f"{type(err).__name__}: {err}"
    Path(out_dir, f"rank{rank}.txt").write_text(outcome)


def rank_outcomes(out_dir, world: int = 2) -> list[str]:
    """What each rank wrote to ``out_dir/rank{r}.txt``."""
    return [(Path(out_dir) / f"rank{r}.txt").read_text() for r in range(world)]


def _bounded_worker(index: int, fn, dump_after_s: float, *args) -> None:
    # A wedged rank prints every thread's stack and exits, so the test fails with the place it hung.
    faulthandler.dump_traceback_later(dump_after_s, exit=True, file=sys.stderr)
    try:
        fn(index, *args)
    finally:
        # Free the run (DDP/FSDP modules hold the process group) before the group is destroyed: a
        # DDP module collected after destroy_process_group once hung a rank in its destructor.
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(fn, args: tuple, nprocs: int, timeout_s: float = 300.0) -> None:
    """``mp.spawn(fn, args, nprocs)`` that can never hang the test session.

    Each child destroys its process group after ``fn`` returns (``fn`` must not), dumps its stacks
    and exits after ``timeout_s - 30`` seconds; the parent kills what is left at ``timeout_s`` and
    fails the test, instead of joining forever.
    """
    context = mp.start_processes(
        _bounded_worker, args=(fn, timeout_s - 30, *args), nprocs=nprocs, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=2):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{nprocs}-rank run of {fn.__name__} did not finish in {timeout_s:.0f} s")
