"""What the trainer feeds the loss: the target's own LM head, and a normalisation over every rank
(a 2-rank step and one process over the same global batch give the same loss and gradients)."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_train.train.parallel import unwrap
from dflash_train.train.trainer import TrainHooks, train
from tests.train_helpers import become_rank, spawn_ranks, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


def first_step_loss(out_dir) -> float:
    row = json.loads((Path(out_dir) / "metrics.jsonl").read_text().splitlines()[0])
    assert row["step"] == 1
    return row["loss"]


def test_the_loss_is_scored_with_the_targets_lm_head(task, tmp_path):
    perturbed = tmp_path / "target"
    shutil.copytree(task["target"], perturbed)
    weights_file = perturbed / "model.safetensors"
    weights = load_file(str(weights_file))
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])  # untied
    gen = torch.Generator().manual_seed(0)
    weights["lm_head.weight"] = weights["lm_head.weight"] + torch.randn(
        weights["lm_head.weight"].shape, generator=gen
    )
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    train(tiny_config(task, tmp_path / "a", "train.max_steps=1"))
    train(tiny_config({**task, "target": str(perturbed)}, tmp_path / "b", "train.max_steps=1"))
    # Same data, anchors, features (the decoder is unchanged) and drafter init: only the head differs.
    assert abs(first_step_loss(tmp_path / "a") - first_step_loss(tmp_path / "b")) > 1e-3


# ----------------------------------------------------------------------------- cross-rank normalisation


class BothRanks:
    """The batches of ranks 0 and 1 of a 2-rank run, alternating: with ``train.grad_accum=2`` one
    process steps over exactly the global batch of the 2-rank run's first step."""

    def __init__(self, ranks):
        self.ranks, self.turn = ranks, 0

    def next_batch(self):
        batch = self.ranks[self.turn].next_batch()
        self.turn = 1 - self.turn
        return batch

    def __getattr__(self, name):
        return getattr(self.ranks[0], name)


def gradient_saver(path: Path) -> TrainHooks:
    """Saves the drafter's gradients of the first step, after backward and before the update."""

    def save(run):
        if run.step == 0 and run.info.is_main:
            grads = {n: p.grad.detach().clone() for n, p in unwrap(run.model).named_parameters()}
            torch.save(grads, path)

    return TrainHooks(after_backward=save)


def two_rank_worker(rank: int, port: int, task: dict, out_dir: str, grads_path: str) -> None:
    become_rank(rank, 2, port)
    train(
        tiny_config(task, out_dir, "train.max_steps=1", "train.parallel=ddp"),
        gradient_saver(Path(grads_path)),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_and_one_process_over_the_same_global_batch_agree(task, tmp_path, monkeypatch):
    two = tmp_path / "two"
    spawn_ranks(two_rank_worker, (free_port(), task, str(two), str(tmp_path / "two.pt")), nprocs=2)

    import dflash_train.data.loader as loader

    build = loader.build_train_data

    def both_ranks(cfg, tokenizer, *, seed, rank=0, world_size=1, **kwargs):
        assert world_size == 1
        return BothRanks([build(cfg, tokenizer, seed=seed, rank=r, world_size=2, **kwargs) for r in (0, 1)])

    monkeypatch.setattr(loader, "build_train_data", both_ranks)
    one = tmp_path / "one"
    train(
        tiny_config(task, one, "train.max_steps=1", "train.grad_accum=2"), gradient_saver(tmp_path / "one.pt")
    )

    assert first_step_loss(one) == pytest.approx(first_step_loss(two), rel=1e-6)
    grads_one, grads_two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert set(grads_one) == set(grads_two) and grads_one
    for name, grad in grads_one.items():
        # Not just proportional: AdamW would hide a constant factor (e.g. a mean over ranks).
        torch.testing.assert_close(grads_two[name], grad, rtol=1e-5, atol=1e-8, msg=name)
