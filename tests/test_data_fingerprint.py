"""Every checkpoint records a fingerprint of each data file (size, rows, a content hash), and a resume
against a file that changed under the same epoch length is refused, naming the file and what changed,
unless ``checkpoint.allow_data_change=true``; checkpoints written before fingerprints still resume."""

import dataclasses
import json
import random
import shutil
import socket
from pathlib import Path

import pytest
import torch

from dflash_train.data.fingerprint import EDGE_BYTES, SMALL_FILE_BYTES, file_fingerprint
from dflash_train.train import checkpoint as ckpt
from dflash_train.train.trainer import train
from tests.train_helpers import become_rank, rank_outcomes, spawn_ranks, tiny_config, train_and_record

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def own_data(task, tmp_path):
    """The task with a copy of its data file that the test may change."""
    data = tmp_path / "data" / "chat.jsonl"
    data.parent.mkdir()
    shutil.copy(task["data"], data)
    return {**task, "data": str(data)}


@pytest.fixture
def four_steps(own_data, tmp_path):
    out = tmp_path / "run"
    train(tiny_config(own_data, out, "train.steps_per_process=4"))
    return out


def shuffle_rows(path: str) -> None:
    """The same rows in another order: same size, same rows, same epoch length, other batches."""
    lines = Path(path).read_text().splitlines(keepends=True)
    random.Random(1).shuffle(lines)
    Path(path).write_text("".join(lines))


def test_a_checkpoint_records_each_data_file(own_data, four_steps):
    state = torch.load(ckpt.step_folder(four_steps, 4) / ckpt.STATE_NAME, weights_only=False)
    (record,) = state["data_files"]
    data = Path(own_data["data"])
    assert record["path"] == str(data) and record["size"] == data.stat().st_size
    assert record["rows"] == 48 and record["hashed"] == "whole file"
    assert record == {**file_fingerprint(str(data), rows=48), "lengths": record["lengths"]}
    assert len(record["lengths"]) == 16  # a hash of the rows' lengths in tokens


def test_a_resume_on_the_same_file_tokenized_to_other_lengths_is_refused(own_data, tmp_path):
    """The target's chat template changed between two sittings: the file is the same, but every row
    is one token longer, and the epoch plan (rows grouped by length) would put other rows at the
    saved position under the same steps per epoch. Only the file was fingerprinted, so it resumed."""
    target = tmp_path / "target"
    shutil.copytree(own_data["target"], target)
    task = {**own_data, "target": str(target)}
    out = tmp_path / "run"
    train(tiny_config(task, out, "train.steps_per_process=4"))
    template = target / "chat_template.jinja"
    text = template.read_text()
    user_turn = "'<|im_start|>' + message['role']"
    assert text.count(user_turn) == 1
    template.write_text(text.replace(user_turn, "'<|im_start|><|im_start|>' + message['role']"))
    with pytest.raises(ValueError) as refused:
        train(tiny_config(task, out, "train.steps_per_process=4"))
    assert str(refused.value).startswith(
        f"refusing to resume: data file {own_data['data']} changed since the checkpoint: the same rows "
        "tokenized to other lengths (the target's tokenizer or chat template"
    ), refused.value
    assert ckpt.latest_checkpoint(out).name == "step-00000004"  # nothing trained


def test_a_resume_on_a_changed_file_is_refused_naming_it(own_data, four_steps):
    shuffle_rows(own_data["data"])
    with pytest.raises(ValueError) as refused:
        train(tiny_config(own_data, four_steps, "train.steps_per_process=4"))
    message = str(refused.value)
    assert message.startswith(
        f"refusing to resume: data file {own_data['data']} changed since the checkpoint"
    )
    assert "contents (sha256 of the whole file) differ" in message and "size" not in message.split("(")[1]
    assert "checkpoint.allow_data_change=true" in message and "\n" not in message
    assert ckpt.latest_checkpoint(four_steps).name == "step-00000004"  # nothing trained


def test_a_grown_file_names_its_size_and_rows(own_data, four_steps, task):
    with open(own_data["data"], "a") as f:  # two rows more: the epoch keeps its length here
        f.write("".join(Path(task["data"]).read_text().splitlines(keepends=True)[:2]))
    with pytest.raises(ValueError, match=r"size \d+ -> \d+ bytes, rows 48 -> 50"):
        train(tiny_config(own_data, four_steps, "train.steps_per_process=4"))


def test_allow_data_change_resumes_on_the_changed_file(own_data, four_steps):
    shuffle_rows(own_data["data"])
    with pytest.warns(UserWarning, match=r"resuming on changed data .*checkpoint.allow_data_change=true"):
        result = train(
            tiny_config(
                own_data, four_steps, "train.steps_per_process=4", "checkpoint.allow_data_change=true"
            )
        )
    assert result["step"] == 8
    state = torch.load(ckpt.step_folder(four_steps, 8) / ckpt.STATE_NAME, weights_only=False)
    assert state["data_files"][0]["sha256"] == file_fingerprint(own_data["data"], rows=48)["sha256"]


def test_a_moved_file_with_the_same_contents_resumes(own_data, four_steps, tmp_path):
    moved = tmp_path / "moved.jsonl"
    shutil.move(own_data["data"], moved)
    with pytest.warns(UserWarning, match="changed data.paths"):
        result = train(tiny_config({**own_data, "data": str(moved)}, four_steps, "train.steps_per_process=4"))
    assert result["step"] == 8


def test_the_same_file_named_from_another_folder_resumes(own_data, tmp_path, monkeypatch):
    """The token cache is keyed by the files' absolute paths, so a process that names the same file
    otherwise (relative to another working directory) loads the first process's cache. Its file
    names were the first process's, relative to that folder: the fingerprint looked for a file that
    is not there ('not a local file') and the resume was refused as if the data had changed."""
    data = Path(own_data["data"])
    monkeypatch.chdir(data.parent.parent)
    relative = str(data.relative_to(data.parent.parent))
    out = tmp_path / "run"
    train(tiny_config({**own_data, "data": relative}, out, "train.steps_per_process=4"))
    monkeypatch.chdir(tmp_path.parent)
    with pytest.warns(UserWarning, match="changed data.paths"):
        result = train(tiny_config(own_data, out, "train.steps_per_process=4"))
    assert result["step"] == 8
    state = torch.load(ckpt.step_folder(out, 8) / ckpt.STATE_NAME, weights_only=False)
    assert state["data_files"][0]["path"] == str(data)


def test_a_checkpoint_without_fingerprints_resumes_with_a_notice(own_data, four_steps, capsys):
    path = ckpt.step_folder(four_steps, 4) / ckpt.STATE_NAME
    state = torch.load(path, weights_only=False)
    del state["data_files"]
    torch.save(state, path)
    capsys.readouterr()
    assert train(tiny_config(own_data, four_steps, "train.steps_per_process=4"))["step"] == 8
    notice = [line for line in capsys.readouterr().out.splitlines() if "fingerprint" in line]
    assert len(notice) == 1 and "records no data file fingerprints" in notice[0]


def test_large_files_hash_their_first_and_last_bytes(tmp_path):
    big = tmp_path / "big.jsonl"
    row = json.dumps({"messages": [{"role": "user", "content": "x" * 100}]}) + "\n"
    big.write_text(row * (SMALL_FILE_BYTES // len(row) + 10))
    record = file_fingerprint(str(big), rows=1)
    assert record["hashed"] == f"first and last {EDGE_BYTES >> 20} MiB"
    data = bytearray(big.read_bytes())
    data[-5] ^= 1  # the last row edited in place: same size
    big.write_bytes(bytes(data))
    assert file_fingerprint(str(big), rows=1)["sha256"] != record["sha256"]


def test_a_hub_dataset_name_is_fingerprinted_by_its_rows():
    assert file_fingerprint("org/some-dataset", rows=7) == {
        "path": "org/some-dataset",
        "size": None,
        "rows": 7,
        "sha256": None,
        "hashed": "not a local file",
    }


def rank_worker(rank: int, port: int, task: dict, rank1_data: str, out_dir: str) -> None:
    """Rank 1 reads ``rank1_data`` where rank 0 reads the task's file (a node with another copy)."""
    become_rank(rank, 2, port)
    from dflash_train.data import loader

    if rank == 1:
        real = loader.load_or_build

        def other_copy(cfg, tokenizer, **kwargs):
            return real(dataclasses.replace(cfg, paths=[rank1_data]), tokenizer, **kwargs)

        loader.load_or_build = other_copy
    try:
        outcome = f"trained {train(tiny_config(task, out_dir, 'train.parallel=ddp'))['step']} steps"
    except ValueError as err:
        outcome = str(err)
    Path(out_dir, f"rank{rank}.txt").write_text(outcome)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ranks_that_read_different_copies_of_a_file_are_stopped_before_training(own_data, tmp_path):
    """Rank 1's copy of the data file has the rows in another order (the same epoch length, other
    batches): every rank refuses with the same line before the first step, instead of two ranks
    training on different data."""
    shuffled = tmp_path / "rank1" / "chat.jsonl"
    shuffled.parent.mkdir()
    shutil.copy(own_data["data"], shuffled)
    shuffle_rows(str(shuffled))
    out = tmp_path / "run"
    out.mkdir()
    spawn_ranks(rank_worker, (free_port(), own_data, str(shuffled), str(out)), nprocs=2, timeout_s=150)
    outcomes = rank_outcomes(out)
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith(
        f"the ranks read different data: rank 1: data file {shuffled} (rank 0: {own_data['data']}) differs "
        "from rank 0's: contents (sha256 of the whole file) differ"
    ), outcomes[0]
    assert not (out / "checkpoints").exists()


def missing_copy_worker(rank: int, port: int, task: dict, out_dir: str) -> None:
    """Rank 1 cannot read the data file (a node without it); every rank writes how it ended."""
    become_rank(rank, 2, port)
    from dflash_train.data import loader

    if rank == 1:

        def no_file(cfg, tokenizer, **kwargs):
            raise FileNotFoundError(f"{cfg.paths[0]}: no such file on this node")

        loader.load_or_build = no_file
    train_and_record(rank, task, out_dir, "train.parallel=ddp")


def test_a_rank_that_cannot_read_the_data_stops_every_rank_with_its_error(own_data, tmp_path):
    """Rank 1 fails to load the data that rank 0 tokenized: every rank raises the same ValueError
    naming rank 1 and its error before the first step, instead of rank 0 waiting in the data check's
    gather for a rank that already left."""
    out = tmp_path / "run"
    out.mkdir()
    spawn_ranks(missing_copy_worker, (free_port(), own_data, str(out)), nprocs=2, timeout_s=150)
    outcomes = rank_outcomes(out)
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith(
        f"ValueError: rank 1 could not read the data: FileNotFoundError: {own_data['data']}: no such file"
    ), outcomes[0]
    assert not (out / "checkpoints").exists()
