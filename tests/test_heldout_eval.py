"""Acceptance measured during training (``eval.*``): exact tau of the drafter on held-out prompts at
the configured steps and at the end, per file, the n-gram baseline once, ``export-best`` holding the
best step's drafter, the same training losses as without it, and two ranks (DDP, FSDP2) that agree."""

import json
import os
import random
import signal
from pathlib import Path

import pytest
import torch

from dflash_train.config import load_config
from dflash_train.train.run import TrainHooks
from tests.train_helpers import (
    WORDS,
    become_rank,
    logged_losses,
    rank_outcomes,
    spawn_ranks,
    tiny_config,
    tiny_overrides,
    train_and_record,
)

MAX_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory):
    """Two held-out files: repeat requests like the training task, and other chat requests."""
    root = tmp_path_factory.mktemp("prompts")
    repeat, chat = root / "repeat.jsonl", root / "chat.jsonl"
    repeat.write_text(
        "".join(json.dumps({"prompt": f"repeat: {WORDS[i]} {WORDS[i + 3]}"}) + "\n" for i in range(5))
    )
    chat.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"{WORDS[i]} the fox"}]}) + "\n"
            for i in range(3)
        )
    )
    return [str(repeat), str(chat)]


def eval_overrides(prompt_files, every_steps=5):
    return [
        f"eval.prompts=[{','.join(prompt_files)}]",
        f"eval.every_steps={every_steps}",
        f"eval.max_new_tokens={MAX_NEW_TOKENS}",
        "eval.batch_size=3",
    ]


def metric_rows(out_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def reference_tau(task, prompt_files, drafter_dir) -> dict[str, float | None]:
    """Exact tau of an exported drafter, computed here from scratch: overall and per file; the same
    for ``ngram+dflash`` and the random-anchor tau, and the overall diagnosis (None: no block)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_train.eval.exact import exact_acceptance
    from dflash_train.eval.generate import greedy_continuations, pad_token_for
    from dflash_train.eval.prompts import load_prompts
    from dflash_train.eval.runner import default_eos_ids
    from dflash_train.models.export import load_drafter
    from dflash_train.models.serving import LOOKUP_MAX_DRAFT

    model = AutoModelForCausalLM.from_pretrained(task["target"], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(task["target"])
    drafter, _ = load_drafter(drafter_dir, dtype=torch.float32)
    eos = default_eos_ids(model, tokenizer)
    pad = pad_token_for(tokenizer, eos)
    groups = [(f"/{Path(path).stem}", load_prompts(path, tokenizer)) for path in prompt_files]
    groups.append(("", [p for _, prompts in groups for p in prompts]))
    taus = {}
    for suffix, prompts in groups:
        continuations = greedy_continuations(
            model, prompts, max_new_tokens=MAX_NEW_TOKENS, eos_token_ids=eos, pad_token_id=pad, batch_size=4
        )
        result = exact_acceptance(
            model, drafter.eval(), prompts, continuations, max_new_tokens=MAX_NEW_TOKENS, eos_token_ids=eos,
            pad_token_id=pad, methods=("dflash", "ngram+dflash"), ngram_max_draft=LOOKUP_MAX_DRAFT,
        )  # fmt: skip
        taus[f"eval_tau{suffix}"] = result["methods"]["dflash"]["tau"]
        taus[f"eval_ngram_dflash_tau{suffix}"] = result["methods"]["ngram+dflash"]["tau"]
        taus[f"eval_random_anchor_tau{suffix}"] = result["diagnosis"]["random_anchor_tau"]
    diagnosis = result["diagnosis"]  # all prompts: the last group
    taus.update(
        eval_loop_round_frac=diagnosis["loop_round_fraction"],
        eval_tau_in_loops=diagnosis["tau_in_loops"],
        eval_tau_outside_loops=diagnosis["tau_outside_loops"],
        eval_random_anchor_acc_by_pos=diagnosis["groups"]["anchors"]["accuracy_by_pos"],
        eval_acc_by_pos_after_reject=diagnosis["groups"]["after_rejection"]["accuracy_by_pos"],
        eval_acc_by_pos_other_rounds=diagnosis["groups"]["other_rounds"]["accuracy_by_pos"],
    )
    return taus


def assert_matches_reference(row: dict, reference: dict) -> None:
    """Every reference number in the metrics row (null in metrics.jsonl where the reference is None)."""
    for key, value in reference.items():
        if value is None or isinstance(value, list) and None in value:
            assert row[key] == value, key
        else:
            assert row[key] == pytest.approx(value, abs=1e-9), key


@pytest.fixture(scope="module")
def evaluated_run(train_task, prompt_files, tmp_path_factory):
    """A 12-step run logging every 3 steps and evaluating every 5 (and at the end)."""
    from dflash_train.train.trainer import train

    out = tmp_path_factory.mktemp("eval_run") / "run"
    cfg = tiny_config(train_task, out, "logging.every_steps=3", *eval_overrides(prompt_files))
    rng_states: list = []
    result = train(cfg, rng_recorder(rng_states))
    return out, result, rng_states


def rng_recorder(states: list) -> TrainHooks:
    """Records the training run's RNG streams after every optimizer step."""
    return TrainHooks(after_step=lambda run: states.append((torch.get_rng_state(), random.getstate())))


def test_eval_runs_at_the_configured_steps_and_at_the_end(evaluated_run):
    out, result, _ = evaluated_run
    rows = metric_rows(out)
    assert result["step"] == 12
    evaluated = [r["step"] for r in rows if "eval_tau" in r]
    assert evaluated == [5, 10, 12]
    assert [r["step"] for r in rows] == [3, 5, 6, 9, 10, 12]  # eval steps get a row of their own
    for row in rows:
        if "eval_tau" not in row:
            continue
        assert 1.0 <= row["eval_tau"] <= 8.0  # block 8: at most 7 accepted + the bonus token
        assert {"eval_tau/repeat", "eval_tau/chat", "eval_tau_best", "time_eval_s"} <= set(row)
        assert len(row["eval_acc_by_pos"]) == 7 and row["time_eval_s"] > 0
        assert 1.0 <= row["eval_random_anchor_tau"] <= 8.0 and 1.0 <= row["eval_ngram_dflash_tau"] <= 8.0
        assert {"eval_random_anchor_tau/repeat", "eval_ngram_dflash_tau/chat", "eval_loop_round_frac"} <= set(
            row
        )
        for key in (
            "eval_random_anchor_acc_by_pos",
            "eval_acc_by_pos_after_reject",
            "eval_acc_by_pos_other_rounds",
        ):
            assert len(row[key]) == 7, key
        assert all("loss" in r for r in rows)
    ngram_rows = [r["step"] for r in rows if "eval_ngram_tau" in r]
    assert ngram_rows == [5]  # once: the n-gram baseline does not train
    assert {"eval_ngram_tau/repeat", "eval_ngram_tau/chat"} <= set(rows[1])
    # beside it the same lookup copied on past the text's end (the eval's ngram-overlap), also once
    assert [r["step"] for r in rows if "eval_ngram_overlap_tau" in r] == [5]
    assert {"eval_ngram_overlap_tau/repeat", "eval_ngram_overlap_tau/chat"} <= set(rows[1])


def test_final_eval_tau_is_the_exact_tau_of_the_export(evaluated_run, task, prompt_files):
    out, result, _ = evaluated_run
    final = metric_rows(out)[-1]
    reference = reference_tau(task, prompt_files, result["export"])
    assert_matches_reference(final, reference)


def test_export_best_is_the_best_step(evaluated_run, task, prompt_files):
    out, _, _ = evaluated_run
    evaluated = [r for r in metric_rows(out) if "eval_tau" in r]
    best = max(evaluated, key=lambda r: r["eval_tau"])  # the first of equal maxima
    record = json.loads((out / "export-best" / "eval.json").read_text())
    assert record["step"] == best["step"] and record["eval_tau"] == best["eval_tau"]
    assert evaluated[-1]["eval_tau_best"] == best["eval_tau"]
    assert (out / "export").is_dir() and not (out / ".export-best.tmp").exists()
    assert reference_tau(task, prompt_files, out / "export-best")["eval_tau"] == pytest.approx(
        best["eval_tau"], abs=1e-9
    )
    # its serving commands name the folder it is served from, not the one it was written in
    notes = (out / "export-best" / "SERVING.md").read_text()
    assert str((out / "export-best").resolve()) in notes and ".export-best.tmp" not in notes


def test_eval_leaves_the_training_losses_unchanged(evaluated_run, task, tmp_path):
    from dflash_train.train.trainer import train

    out, _, rng_with_eval = evaluated_run
    rng_without: list = []
    train(tiny_config(task, tmp_path / "plain"), rng_recorder(rng_without))  # a row at every step
    assert len(rng_with_eval) == len(rng_without) == 12
    for (torch_with, python_with), (torch_without, python_without) in zip(rng_with_eval, rng_without):
        assert torch.equal(torch_with, torch_without) and python_with == python_without
    without = logged_losses(tmp_path / "plain")
    with_eval = {r["step"]: r["loss_last"] for r in metric_rows(out)}  # "loss" is a window mean
    assert len(with_eval) == 6
    assert with_eval == {step: without[step] for step in with_eval}  # bit for bit, after evals too


def test_eval_is_off_by_default(task):
    cfg = tiny_config(task, "unused")
    assert cfg.eval.prompts == []


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        (
            ["train.placement=split", "train.target_ranks=1", "eval.prompts=[a.jsonl]"],
            NotImplementedError,
            "colocated",
        ),
        (["eval.prompts=[x/a.jsonl,y/a.jsonl]"], ValueError, "rename or merge"),
        (["eval.prompts=[a.jsonl]", "eval.every_steps=-1"], ValueError, "eval.every_steps"),
        (["eval.prompts=[a.jsonl]", "eval.max_new_tokens=1"], ValueError, "eval.max_new_tokens"),
        (["eval.promts=[a.jsonl]"], ValueError, "did you mean 'eval.prompts'"),
        (["eval.prompts=[x/a.jsonl]", "eval.best_by=b"], ValueError, "eval.best_by='b' names no file"),
    ],
)
def test_eval_config_errors_say_what_to_change(task, overrides, error, match):
    with pytest.raises(error, match=match):
        load_config("tiny-cpu", tiny_overrides(task, "unused", *overrides))


def test_a_missing_prompt_file_fails_at_the_start(task, tmp_path):
    from dflash_train.train.trainer import train

    cfg = tiny_config(task, tmp_path / "run", f"eval.prompts=[{tmp_path / 'nope.jsonl'}]")
    with pytest.raises(ValueError, match=r"eval.prompts: .*nope.jsonl.* not found"):
        train(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()  # before any step


# ----------------------------------------------------------------------------- two ranks


def rank_worker(rank: int, port: int, task: dict, out_dir: str, extra: list) -> None:
    become_rank(rank, 2, port)
    from dflash_train.train.heldout_eval import drafter_copy
    from dflash_train.train.trainer import train

    sums = {}

    def record_eval_weights(run):  # every rank: under FSDP2 the copy's gather is a collective
        if run.step == run.total_steps:
            sums.update({n: float(t.double().sum()) for n, t in drafter_copy(run).state_dict().items()})

    result = train(tiny_config(task, out_dir, *extra), TrainHooks(after_step=record_eval_weights))
    Path(out_dir, f"result{rank}.json").write_text(json.dumps({**result, "weight_sums": sums}))


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_evaluate_together(task, prompt_files, tmp_path, parallel):
    from tests.test_train_distributed import free_port

    out = tmp_path / "run"
    extra = [f"train.parallel={parallel}", "train.max_steps=6", *eval_overrides(prompt_files, every_steps=3)]
    spawn_ranks(rank_worker, (free_port(), task, str(out), extra), nprocs=2)
    results = [json.loads((out / f"result{r}.json").read_text()) for r in range(2)]
    assert [r["step"] for r in results] == [6, 6]
    # Each rank evaluates its prompts with the full weights (FSDP2: gathered), the final export's.
    from safetensors.torch import load_file

    exported = load_file(Path(results[0]["export"]) / "model.safetensors")
    expected = {n: float(t.double().sum()) for n, t in exported.items()}
    assert results[0]["weight_sums"] == results[1]["weight_sums"] == pytest.approx(expected, rel=1e-12)
    rows = metric_rows(out)
    assert [r["step"] for r in rows if "eval_tau" in r] == [3, 6]
    # The prompts were split over the ranks and gathered: the tau of all of them, of the final weights.
    reference = reference_tau(task, prompt_files, results[0]["export"])
    assert_matches_reference(rows[-1], reference)
    assert json.loads((out / "export-best" / "eval.json").read_text())["step"] in (3, 6)


def test_a_resumed_run_keeps_the_best_export_of_its_first_part(task, prompt_files, tmp_path):
    from dflash_train.train.trainer import train

    out = tmp_path / "run"

    def sigterm_during_step_7(run):
        if run.step == 6:
            os.kill(os.getpid(), signal.SIGTERM)

    overrides = ["logging.every_steps=3", *eval_overrides(prompt_files)]
    first = train(tiny_config(task, out, *overrides), TrainHooks(after_backward=sigterm_during_step_7))
    assert first["step"] == 7 and json.loads((out / "export-best" / "eval.json").read_text())["step"] == 5
    train(tiny_config(task, out, *overrides))
    evaluated = [r for r in metric_rows(out) if "eval_tau" in r]
    assert [r["step"] for r in evaluated] == [5, 10, 12]
    best = max(evaluated, key=lambda r: r["eval_tau"])  # the first of equal maxima
    assert json.loads((out / "export-best" / "eval.json").read_text())["step"] == best["step"]
    assert evaluated[-1]["eval_tau_best"] == best["eval_tau"]


def test_eval_best_by_picks_export_best_by_one_files_tau(task, prompt_files, tmp_path, monkeypatch):
    """eval.best_by=chat: export-best is the step with the best eval_tau/chat, not eval_tau. The
    tiny drafter's taus barely move, so planted per-step values (the real per-file numbers otherwise)
    make the two choices differ: eval_tau is best at step 5, eval_tau/chat at step 10."""
    from dflash_train.train import heldout_eval
    from dflash_train.train.trainer import train

    planted = {"eval_tau": [3.0, 1.0, 2.0], "eval_tau/chat": [1.5, 2.5, 2.0]}
    calls = []
    real = heldout_eval.acceptance_metrics

    def planted_metrics(prefix, *args):
        metrics, overall = real(prefix, *args)
        if prefix == "eval_tau":
            metrics.update({key: values[len(calls)] for key, values in planted.items()})
            calls.append(prefix)
        return metrics, overall

    monkeypatch.setattr(heldout_eval, "acceptance_metrics", planted_metrics)
    out = tmp_path / "run"
    train(tiny_config(task, out, "logging.every_steps=3", "eval.best_by=chat", *eval_overrides(prompt_files)))
    assert len(calls) == 3  # steps 5, 10, 12
    record = json.loads((out / "export-best" / "eval.json").read_text())
    assert record["step"] == 10 and record["eval_tau/chat"] == 2.5
    assert [r["eval_tau_best"] for r in metric_rows(out) if "eval_tau" in r] == [1.5, 2.5, 2.5]


def test_diagnosis_metrics_name_each_group_and_file():
    """The hand-built requests of tests/test_eval_exact.py: A rejects (no loops), B loops (always right)."""
    import math

    from dflash_train.eval.diagnosis import diagnose_request
    from dflash_train.eval.simulate import simulate_chain
    from dflash_train.train.heldout_eval import diagnosis_metrics
    from tests.test_eval_exact import PERIOD, drafts_from

    def stats(continuation, right_at):
        drafts = drafts_from(continuation, right_at)
        common = dict(block_size=4, max_new_tokens=len(continuation), eos_token_ids=set())
        generation = simulate_chain(continuation, lambda out: drafts[out - 1], **common)
        return diagnose_request([100], continuation, drafts, generation, ngram_n=3, **common)

    right = {0: (1, 2), 3: (1, 2, 3), 7: (1, 2, 3), 11: (1, 3)}
    a = stats(list(range(1, 17)), lambda j, k: k in right.get(j, ()))
    b = stats(PERIOD * 3, lambda j, k: True)
    metrics = diagnosis_metrics([a, b], [0, 1], ["rejects", "loops"], 4)
    assert metrics["eval_random_anchor_tau/rejects"] == pytest.approx(24 / 15)
    assert metrics["eval_random_anchor_tau/loops"] == pytest.approx((21 * 4 + 3 + 2) / 23)
    assert metrics["eval_random_anchor_tau"] == pytest.approx((24 + 89) / (15 + 23))
    assert metrics["eval_acc_by_pos_after_reject"] == pytest.approx([0.5, 1.0, 1.0])  # A's only
    # 3 rounds of A, 6 of B (its last drafts 2: position 3 scored in 5)
    assert metrics["eval_acc_by_pos_other_rounds"] == pytest.approx([1.0, 8 / 9, 7 / 8])
    assert metrics["eval_loop_round_frac"] == pytest.approx(4 / 11)  # B's 4 of the 5 + 6 rounds that draft
    assert metrics["eval_tau_in_loops"] == pytest.approx(15 / 4)
    assert metrics["eval_tau_outside_loops"] == pytest.approx((14 + 8) / 7)
    assert len(metrics["eval_random_anchor_acc_by_pos"]) == 3
    # A group without blocks is NaN (null in metrics.jsonl), never a made-up 0.
    assert all(
        math.isnan(x) for x in diagnosis_metrics([b], [0], ["loops"], 4)["eval_acc_by_pos_after_reject"]
    )


def missing_file_worker(rank: int, port: int, task: dict, out_dir: str, prompts: list) -> None:
    """Rank 1 is a node without the prompt files (its paths do not exist)."""
    become_rank(rank, 2, port)
    from dflash_train.train.trainer import train

    paths = prompts if rank == 0 else [str(Path(out_dir) / "elsewhere" / Path(p).name) for p in prompts]
    extra = ["train.parallel=ddp", "train.max_steps=2", *eval_overrides(paths)]
    try:
        outcome = f"trained {train(tiny_config(task, out_dir, *extra))['step']} steps"
    except ValueError as err:
        outcome = f"ValueError: {err}"
    except Exception as err:  # what a peer's exit looks like: not the error a user can act on
        outcome = f"{type(err).__name__}: {err}"
    Path(out_dir, f"rank{rank}.txt").write_text(outcome)


def test_prompt_files_missing_on_one_rank_stop_every_rank_with_the_same_error(task, prompt_files, tmp_path):
    from tests.test_train_distributed import free_port

    out = tmp_path / "run"
    out.mkdir()
    spawn_ranks(missing_file_worker, (free_port(), task, str(out), prompt_files), nprocs=2, timeout_s=150)
    outcomes = rank_outcomes(out)
    for outcome in outcomes:
        assert outcome.startswith("ValueError: eval.prompts: [") and "] not found on rank 1; fix" in outcome
    assert outcomes[0] == outcomes[1] and "rank 0" not in outcomes[0]


def export_best_fails_worker(rank: int, port: int, task: dict, out_dir: str, prompts: list) -> None:
    """Rank 0's write of ``export-best`` fails (a full disk); every rank writes how it ended."""
    become_rank(rank, 2, port)
    from dflash_train.train import heldout_eval

    if rank == 0:

        def full_disk(run, drafter, record):
            raise OSError(28, "No space left on device")

        heldout_eval.write_export_best = full_disk
    extra = ["train.parallel=ddp", "train.max_steps=4", *eval_overrides(prompts, every_steps=3)]
    train_and_record(rank, task, out_dir, *extra)


def test_a_failed_export_best_stops_every_rank_with_its_error(task, prompt_files, tmp_path):
    """Rank 0 cannot write ``export-best`` after the step-3 evaluation: every rank raises the same
    error naming it, instead of the other ranks waiting at the evaluation's barrier."""
    from tests.test_train_distributed import free_port

    out = tmp_path / "run"
    out.mkdir()
    spawn_ranks(
        export_best_fails_worker, (free_port(), task, str(out), prompt_files), nprocs=2, timeout_s=150
    )
    outcomes = rank_outcomes(out)
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith(
        "RuntimeError: eval: writing export-best of step 3 failed on rank 0: OSError:"
    )


def eval_fails_worker(rank: int, port: int, task: dict, out_dir: str, prompts: list, where: str) -> None:
    """Rank 1 alone fails inside the held-out work it does by itself: generating its prompts'
    continuations at the start (``setup``), the n-gram baseline of them after that (``ngram``) or
    evaluating them at step 3 (``eval``)."""
    become_rank(rank, 2, port)
    from dflash_train.eval import exact, generate, simulate

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of memory (injected)")

    if rank == 1 and where == "setup":
        generate.greedy_continuations = out_of_memory
    if rank == 1 and where == "eval":
        exact.exact_measure = out_of_memory
    if rank == 1 and where == "ngram":
        simulate.simulate_ngram = out_of_memory
    # A rank left waiting in the evaluation's gather fails after 20 s, not the default 30 min.
    extra = ["train.parallel=ddp", "train.max_steps=4", "train.dist_timeout_s=20"]
    extra += ["eval.ngram=true"] if where == "ngram" else []
    train_and_record(rank, task, out_dir, *extra, *eval_overrides(prompts, every_steps=3))


@pytest.mark.parametrize("where", ["setup", "ngram", "eval"])
def test_a_held_out_evaluation_that_fails_on_one_rank_stops_every_rank_with_its_error(
    task, prompt_files, tmp_path, where
):
    """Rank 1's part of the held-out evaluation raises while rank 0's succeeds: every rank raises the
    same error naming rank 1, instead of rank 0 waiting in the gather of results (or the first
    step's collective) for a rank that left."""
    from tests.test_train_distributed import free_port

    out = tmp_path / "run"
    out.mkdir()
    spawn_ranks(
        eval_fails_worker, (free_port(), task, str(out), prompt_files, where), nprocs=2, timeout_s=120
    )
    outcomes = rank_outcomes(out)
    assert outcomes[0] == outcomes[1], outcomes
    what = {
        "setup": "generating the held-out continuations",
        "ngram": "the n-gram baseline of the held-out prompts",
        "eval": "the held-out evaluation of step 3",
    }[where]
    assert outcomes[0].startswith(
        f"RuntimeError: eval: {what} failed on rank 1: RuntimeError: out of memory (injected); "
    ), outcomes[0]


def gather_fails_worker(rank: int, port: int, task: dict, out_dir: str, prompts: list) -> None:
    """FSDP2: rank 1 fails inside the gather of the drafter's full state for the step-3 evaluation (out
    of memory for the full weights), a collective the other rank is still in."""
    become_rank(rank, 2, port)
    from torch.distributed.checkpoint import state_dict

    if rank == 1:

        def out_of_memory(*args, **kwargs):
            raise RuntimeError("out of memory (injected)")

        state_dict.get_model_state_dict = out_of_memory
    extra = ["train.parallel=fsdp", "train.max_steps=4", "train.dist_timeout_s=20"]
    train_and_record(rank, task, out_dir, *extra, *eval_overrides(prompts, every_steps=3))


def test_a_gather_for_the_evaluation_that_fails_on_one_rank_stops_that_rank_with_its_error(
    task, prompt_files, tmp_path
):
    """A rank whose part of a collective failed cannot meet the others in another one (they are still
    in the first: the two would be paired, on NCCL a hang until train.dist_timeout_s): it stops at
    once with its own error, and the other rank fails as soon as it finds it gone."""
    import time

    from tests.test_train_distributed import free_port

    out = tmp_path / "run"
    out.mkdir()
    started = time.monotonic()
    spawn_ranks(gather_fails_worker, (free_port(), task, str(out), prompt_files), nprocs=2, timeout_s=120)
    outcomes = rank_outcomes(out)
    assert outcomes[1].startswith(
        "RuntimeError: eval: gathering the drafter's full state for the held-out evaluation of step 3 "
        "failed on rank 1: RuntimeError: out of memory (injected); "
    ), outcomes
    assert outcomes[0].startswith(
        "RuntimeError: eval: gathering the drafter's full state for the held-out evaluation of step 3 "
        "failed on rank 0: "
    ), outcomes
    assert time.monotonic() - started < 20, "a rank waited for the other until train.dist_timeout_s"


def test_ranks_that_recover_export_best_at_once_all_find_it(tmp_path, monkeypatch):
    """A writer died between its two renames (export-best -> .export-best.old, staging -> export-best);
    on the next start every rank finds export-best missing at once and moves the copy back. The
    ranks that lost that race raised FileNotFoundError alone, outside any vote, and the others
    waited for them in the next collective."""
    import threading

    from dflash_train.train.heldout_eval import recover_export_best

    old = tmp_path / ".export-best.old"
    old.mkdir()
    (old / "eval.json").write_text("{}")
    both_checked = threading.Barrier(2)
    real_rename = Path.rename

    def rename_after_both_checked(self, target):
        both_checked.wait(timeout=10)
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename_after_both_checked)
    found, errors = [], []

    def rank() -> None:
        try:
            found.append(recover_export_best(tmp_path))
        except Exception as err:  # what each "rank" ended with is what the test compares
            errors.append(err)

    ranks = [threading.Thread(target=rank) for _ in range(2)]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join(timeout=20)
    assert errors == [] and found == [tmp_path / "export-best"] * 2
    assert (tmp_path / "export-best" / "eval.json").is_file() and not old.exists()


@pytest.mark.gpu
def test_training_with_eval_prompts_on_cuda_evaluates_an_attention_only_targets_drafter(
    task, prompt_files, tiny_qwen3_dir, tmp_path
):
    """A CUDA run with ``eval.prompts`` on an attention-only target (whose decode step defaults to flex
    attention compiled): the held-out continuations are generated under the evaluation's forced-eager
    stance, where that step once failed its CUDA-graph capture before the first training step."""
    from dflash_train.train.trainer import train

    out = tmp_path / "run"
    overrides = [f"target.path={tiny_qwen3_dir}", "target.target_layer_ids=[0,1]", "train.device=cuda"]
    cfg = tiny_config(
        task, out, "train.max_steps=4", *overrides, *eval_overrides(prompt_files, every_steps=2)
    )
    assert train(cfg)["step"] == 4
    evaluated = [(row["step"], row["eval_tau"]) for row in metric_rows(out) if "eval_tau" in row]
    assert [step for step, _ in evaluated] == [2, 4] and all(tau >= 1.0 for _, tau in evaluated)
