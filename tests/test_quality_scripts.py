"""The GPU drivers' bookkeeping (scripts/gpu_quality.py, scripts/gpu_data_scale.py), without a model:
where a run is, the scale subsets cut once, and the synth bundle that carries prompts to a fresh machine."""

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parents[1] / "scripts"


@pytest.fixture(scope="module")
def scale():
    sys.path.insert(0, str(SCRIPTS))
    try:
        yield script("gpu_data_scale")
    finally:
        sys.path.remove(str(SCRIPTS))


def script(name: str):
    """scripts/NAME.py as a module."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def scale_args(tmp_path, **overrides):
    values = dict(
        work=tmp_path / "work",
        out=tmp_path / "out",
        scales="4,8,20",
        steps=100,
        epochs=0,
        variant=[],
        prompts=None,
        regen_rows=[],
    )
    return argparse.Namespace(**(values | overrides))


def test_run_status_reads_the_newest_sitting(scale, tmp_path):
    args = scale_args(tmp_path)
    assert scale.quality.run_status(args, "a") == {
        "step": 0,
        "total_steps": None,
        "finished": False,
        "sittings": 0,
    }
    run = args.work / "run-a"
    run.mkdir(parents=True)
    rows = [
        {"sitting": 1, "end_step": 40, "total_steps": 100, "finished": False, "stopped": "time_limit"},
        {"sitting": 2, "end_step": 100, "total_steps": 100, "finished": True, "stopped": None},
    ]
    (run / "sittings.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert scale.quality.run_status(args, "a")["step"] == 40
    (run / "sittings.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    status = scale.quality.run_status(args, "a")
    assert status["finished"] and status["sittings"] == 2 and status["step"] == 100


def test_a_runs_own_data_paths_come_after_the_common_ones(scale, tmp_path):
    args = scale_args(tmp_path, recipe="tiny-cpu", target="T", common="train.max_steps=5 data.paths=[x]")
    command = scale.quality.train_command(args, "a", ["data.paths=[mine]"], {"train_rows": Path("rows")}, 540)
    assert (
        command.index("data.paths=[mine]")
        > command.index("data.paths=[x]")
        > command.index("data.paths=[rows]")
    )
    assert "train.time_limit_s=540" in command


def test_scale_subsets_are_cut_once_and_the_last_takes_what_regen_made(scale, tmp_path):
    args = scale_args(tmp_path, epochs=3)
    args.work.mkdir()
    regen = args.work / "regen.jsonl"
    regen.write_text("".join(f'{{"row": {i}}}\n' for i in range(10)))
    status = {"regen": {"done": 6, "total": 12}}  # regen still running: only the 4 and 8 row subsets
    runs = scale.scale_runs(args, status)
    assert [name for name, _ in runs] == ["rows-4", "rows-4-epochs", "rows-8", "rows-8-epochs"]
    assert "train.num_epochs=3" in runs[1][1] and "train.max_steps=100" in runs[0][1]
    regen.write_text("".join(f'{{"row": {i}}}\n' for i in range(10, 22)))  # the rows change under it
    status["regen"] |= {"done": 12, "exhausted": True}  # finished with fewer rows than the last scale
    runs = scale.scale_runs(args, status)
    assert [name for name, _ in runs][-2:] == ["rows-20", "rows-20-epochs"]
    assert (args.work / "regen-4.jsonl").read_text().splitlines()[0] == '{"row": 0}'  # never rewritten
    assert status["subsets"] == {"4": 4, "8": 8, "20": 12}


def test_variants_give_a_run_per_scale_and_variant(scale, tmp_path):
    args = scale_args(tmp_path, scales="4", variant=["d2|drafter.variant=dflash2", "base|"])
    args.work.mkdir()
    (args.work / "regen.jsonl").write_text("".join(f'{{"row": {i}}}\n' for i in range(6)))
    runs = scale.scale_runs(args, {"regen": {"done": 6, "total": 6}})
    assert [name for name, _ in runs] == ["rows-4-d2", "rows-4-base"]
    assert runs[0][1][-1] == "drafter.variant=dflash2" and runs[1][1][-1] == "train.max_steps=100"


def test_a_variant_can_run_at_one_scale_only(scale, tmp_path):
    args = scale_args(tmp_path, scales="4,6", variant=["base|", "lk@4|train.lookup_anchor_weight=0"])
    args.work.mkdir()
    (args.work / "regen.jsonl").write_text("".join(f'{{"row": {i}}}\n' for i in range(6)))
    runs = scale.scale_runs(args, {"regen": {"done": 6, "total": 6}})
    assert [name for name, _ in runs] == ["rows-4-base", "rows-4-lk", "rows-6-base"]
    assert runs[1][1][-1] == "train.lookup_anchor_weight=0"


def test_given_prompts_replace_the_synth_stage(scale, tmp_path):
    import lzma

    source = tmp_path / "prompts.jsonl.xz"
    source.write_bytes(lzma.compress(b"".join(b'{"row": %d}\n' % i for i in range(5))))
    args = scale_args(tmp_path, prompts=source, num_rows=100)
    args.work.mkdir()
    status = {}
    scale.given_prompts(args, status)
    assert (args.work / "prompts.jsonl").read_bytes() == lzma.decompress(source.read_bytes())
    assert args.num_rows == 5 and status["synth"]["done"] == status["synth"]["total"] == 5


def test_given_rows_in_two_parts_replace_synth_and_regen(scale, tmp_path):
    import lzma

    rows = b"".join(b'{"row": %d}\n' % i for i in range(7))
    packed = lzma.compress(rows)
    parts = [tmp_path / "rows.part00", tmp_path / "rows.part01"]  # `split`'s names: no suffix
    parts[0].write_bytes(packed[:10])
    parts[1].write_bytes(packed[10:])
    args = scale_args(tmp_path, regen_rows=parts, scales="4,20")
    args.work.mkdir()
    status = {}
    scale.given_rows(args, status)
    assert (args.work / "regen.jsonl").read_bytes() == rows
    assert status["regen"]["done"] == status["regen"]["total"] == 7
    runs = scale.scale_runs(args, status)  # regen counts as finished: the last scale takes all 7 rows
    assert [name for name, _ in runs] == ["rows-4", "rows-20"] and status["subsets"] == {"4": 4, "20": 7}


def test_the_synth_bundle_carries_prompts_heldout_files_and_state_to_a_fresh_machine(
    scale, tmp_path, monkeypatch
):
    args = scale_args(tmp_path, synth_from=None)
    (args.work / "prompts.heldout").mkdir(parents=True)
    files = {
        "prompts.jsonl": "x" * 5000,
        "prompts.jsonl.state.json": "{}",
        "prompts.heldout/code.jsonl": "c",
        "prompts.heldout/math.jsonl": "m",
    }
    for name, text in files.items():
        (args.work / name).write_text(text)
    monkeypatch.setattr(scale.bundles, "PART_BYTES", 64)  # several parts
    scale.bundles.bundle_synth(args)
    parts = sorted(p.name for p in args.out.iterdir())
    assert len(parts) > 1 and all(p.startswith("synth.part") for p in parts)
    fresh = scale_args(tmp_path, work=tmp_path / "fresh", synth_from=args.out)
    fresh.work.mkdir()
    scale.bundles.restore_synth(fresh)
    assert {name: (fresh.work / name).read_text() for name in files} == files


def test_a_training_sitting_leaves_the_evals_time_in_the_budget(scale, tmp_path, monkeypatch):
    """A job that must end measured: its sitting's limit is the budget less the reserved eval time,
    and no sitting starts when only the reserve is left."""
    quality = sys.modules["gpu_quality"]
    limits = []
    monkeypatch.setattr(quality, "run_status", lambda args, name: {"finished": False, "step": 0, "total_steps": 9, "sittings": 0})  # fmt: skip
    monkeypatch.setattr(quality, "train_command", lambda args, name, overrides, files, limit: limits.append(limit) or ["true"])  # fmt: skip
    monkeypatch.setattr(quality, "cli", lambda *command: ["true"])
    monkeypatch.setattr(quality, "logs_dir", lambda args: tmp_path)
    args = argparse.Namespace(train_seconds=1000, parallel=0, budget_s=700, started=quality.time.monotonic())
    quality.train_sitting(args, [("a", [])], {}, reserve_s=250)
    assert len(limits) == 1 and 410 <= limits[0] <= 420  # 700 - 30 - 250, less the test's own time
    args.budget_s = 300  # 300 - 30 - 250 = 20 s: below a minute, nothing starts
    quality.train_sitting(args, [("a", [])], {}, reserve_s=250)
    assert len(limits) == 1


def test_regenerated_rows_come_back_in_xz_parts_that_given_rows_joins(scale, tmp_path):
    """Once regen has every row, the rows go to --out in xz parts (each under the limit of a call's
    files) beside training; a later lease's ``--regen-rows`` parts rebuild them byte for byte."""
    import random

    rng = random.Random(0)
    rows = "".join(json.dumps({"row": i, "text": f"{rng.getrandbits(2400):x}"}) + "\n" for i in range(400))
    args = scale_args(tmp_path)
    args.work.mkdir()
    (args.work / "regen.jsonl").write_text(rows)
    assert scale.bundles.bundle_rows(args, {"regen": {"done": 399, "total": 400}}) is None  # not finished yet
    status = {"regen": {"done": 400, "total": 400}}
    scale.bundles.bundle_rows(args, status, part_bytes=50_000).wait()
    parts = sorted(args.out.glob("regen-rows.part*.jsonl.xz"))
    assert len(parts) >= 2 and all(p.stat().st_size <= 50_000 for p in parts)
    assert (args.out / "regen-rows.complete").exists()
    assert scale.bundles.bundle_rows(args, status) is None  # once

    later = scale_args(tmp_path / "later", regen_rows=parts)
    later.work.mkdir(parents=True)
    given = {}
    scale.given_rows(later, given)
    assert (later.work / "regen.jsonl").read_text() == rows and given["regen"]["done"] == 400


def test_a_job_cut_inside_regen_brings_back_its_complete_rows(scale, tmp_path):
    """The budget ran out inside regen: the complete lines so far come back in xz parts (a line
    torn by the kill is left out), nothing once regen has every row."""
    import lzma

    args = scale_args(tmp_path)
    args.work.mkdir()
    rows = "".join(json.dumps({"row": i}) + "\n" for i in range(5))
    (args.work / "regen.jsonl").write_text(rows + '{"row": 5, "te')
    status = {"regen": {"done": 5, "total": 9}}
    scale.bundles.bundle_partial_rows(args, status, part_bytes=40)
    parts = sorted(args.out.glob("regen-partial-5.part*.jsonl.xz"))
    assert len(parts) >= 2 and status["regen_partial_rows"] == 5
    assert lzma.decompress(b"".join(p.read_bytes() for p in parts)).decode() == rows
    finished = scale_args(tmp_path / "finished")
    finished.work.mkdir(parents=True)
    (finished.work / "regen.jsonl").write_text(rows)
    scale.bundles.bundle_partial_rows(finished, {"regen": {"done": 5, "total": 5}})
    assert not finished.out.exists()


def test_given_rows_for_the_first_prompts_leave_regen_the_rest(scale, tmp_path):
    """--regen-rows from a lease cut inside regen, with the same --prompts: synth is replaced,
    regen is not (it continues from the given rows); rows for every prompt replace both."""
    import lzma

    prompts = tmp_path / "prompts.jsonl.xz"
    prompts.write_bytes(lzma.compress(b"".join(b'{"row": %d}\n' % i for i in range(7))))
    given = tmp_path / "rows.jsonl.xz"
    given.write_bytes(lzma.compress(b"".join(b'{"row": %d, "reply": 1}\n' % i for i in range(4))))
    args = scale_args(tmp_path, prompts=prompts, regen_rows=[given], num_rows=100)
    args.work.mkdir()
    status = {}
    scale.given_prompts(args, status)
    scale.given_rows(args, status)
    assert status["synth"]["done"] == 7 and status["regen"]["done"] == 4 and status["regen"]["total"] == 7
    assert scale.skipped_stages(args, status) == {"synth"}
    status["regen"].update(done=7, seconds_per_row=0.5)  # regen finished the rest on an earlier call
    scale.given_rows(args, status)  # the next call of the same job keeps the record
    assert status["regen"]["done"] == 7 and status["regen"]["seconds_per_row"] == 0.5
    assert scale.skipped_stages(args, status) == {"synth", "regen"}


def test_a_job_without_train_or_eval_cuts_no_subsets_and_prepares_no_data(scale, tmp_path, monkeypatch):
    args = scale_args(tmp_path, scales="4")
    args.work.mkdir()
    (args.work / "regen.jsonl").write_text("".join(f'{{"row": {i}}}\n' for i in range(6)))
    monkeypatch.setattr(scale.quality, "prepare_data", lambda args: pytest.fail("prepared data"))
    status = {"regen": {"done": 6, "total": 6}}
    scale.train_and_eval(args, status, ["regen"])
    assert not (args.work / "regen-4.jsonl").exists() and "runs" not in status


def test_a_runs_export_comes_back_in_tar_parts_once_per_change(scale, tmp_path):
    """The drafter a lease trained outlives the machine: its export comes back as tar parts (each
    under the limit of a call's files) that rebuild it byte for byte, rewritten only when it changed."""
    import os
    import random
    import subprocess

    quality = sys.modules["gpu_quality"]
    args = scale_args(tmp_path)
    export = args.work / "run-d2" / "export"
    export.mkdir(parents=True)
    (export / "config.json").write_text('{"architectures": ["DFlashDraftModel"]}')
    (export / "model.safetensors").write_bytes(random.Random(0).randbytes(100_000))
    (args.work / "run-none").mkdir()  # a run with no export yet: nothing to bring back
    args.out.mkdir()
    quality.bundle_exports(args, ["d2", "none"], part_bytes=30_000)
    parts = sorted(args.out.glob("export-d2.part*.tar"))
    assert len(parts) >= 4 and all(p.stat().st_size <= 30_000 for p in parts)
    assert not list(args.out.glob("export-none*"))
    back = tmp_path / "back"
    back.mkdir()
    (back / "whole.tar").write_bytes(b"".join(p.read_bytes() for p in parts))
    subprocess.run(["tar", "xf", "whole.tar"], cwd=back, check=True)
    for name in ("config.json", "model.safetensors"):
        assert (back / "export-d2" / name).read_bytes() == (export / name).read_bytes()

    os.utime(parts[0], ns=(1, 1))  # an unchanged export is not written again
    quality.bundle_exports(args, ["d2"], part_bytes=30_000)
    assert parts[0].stat().st_mtime_ns == 1
    (export / "model.safetensors").write_bytes(random.Random(1).randbytes(10_000))  # a later sitting's export
    quality.bundle_exports(args, ["d2"], part_bytes=30_000)
    assert [p.name for p in sorted(args.out.glob("export-d2.part*.tar"))] == ["export-d2.part00.tar"]


def test_bring_back_fits_a_calls_files_and_sends_each_version_once(tmp_path):
    """scripts/gpu_bring_back.sh: the small results every call, the rest once each within 8 files a
    call, oldest first; rows only once they are whole; a file rewritten later comes back again."""
    import os
    import subprocess

    job = tmp_path / "job"
    job.mkdir()
    (job / "status.json").write_text("{}")
    (job / "regen-rows.part00.jsonl.xz").write_bytes(b"r" * 10)  # no regen-rows.complete yet
    for i in range(9):
        part = job / f"export-d2.part{i:02d}.tar"
        part.write_bytes(b"x" * 100)
        os.utime(part, (1000 + i, 1000 + i))

    def call() -> list[str]:
        out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
        out.mkdir()
        env = {**os.environ, "OUT": str(out)}
        subprocess.run(
            ["bash", str(SCRIPTS / "gpu_bring_back.sh"), str(job)], env=env, check=True, capture_output=True
        )
        return sorted(p.name for p in out.iterdir())

    first = call()
    assert len(first) == 8 and "status.json" in first and "export-d2.part06.tar" in first
    assert "regen-rows.part00.jsonl.xz" not in first and "export-d2.part07.tar" not in first
    (job / "regen-rows.complete").touch()
    second = call()
    assert second == [
        "export-d2.part07.tar",
        "export-d2.part08.tar",
        "regen-rows.part00.jsonl.xz",
        "status.json",
    ]
    assert call() == ["status.json"]
    (job / "export-d2.part00.tar").write_bytes(b"y" * 50)  # a later export
    assert call() == ["export-d2.part00.tar", "status.json"]


def test_a_data_scale_job_evaluates_unfinished_runs_only_when_asked(scale):
    """A detached job is one invocation: with --eval-unfinished a run its budget cut short is
    evaluated at its newest checkpoint (gpu_quality.export_dir), else only finished runs are."""
    assert scale.parse_args(["--target", "t"]).eval_unfinished is False
    assert scale.parse_args(["--target", "t", "--eval-unfinished"]).eval_unfinished is True


def test_synth_args_reach_the_synth_command(scale, tmp_path, monkeypatch):
    """--synth-args (e.g. --stop-loops) are passed to every synth call of the stage."""
    commands = []
    monkeypatch.setattr(
        scale, "stepped", lambda args, status, stage, command, *rest: commands.append(command(64))
    )
    monkeypatch.setattr(scale.bundles, "bundle_synth", lambda args: None)
    args = scale_args(
        tmp_path, target="T", task_file="chat-tasks", heldout_per_task=2, synth_batch_size=8,
        max_prompt_tokens=256, max_samples=0, synth_args="--stop-loops", device="", num_rows=64, synth_step_rows=64,
    )  # fmt: skip
    scale.synth_stage(args, {})
    (command,) = commands
    assert command[0] == "synth" and "--stop-loops" in command and command[-1] == "--json"


def test_the_status_names_the_code_it_was_measured_with(scale, tmp_path):
    args = scale.parse_args(
        ["--target", "T", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    )
    args.work.mkdir()
    scale.write_status(args, {})
    written = json.loads((args.out / "status.json").read_text())
    assert written["source"] == scale.source_digest() and len(written["source"]) == 12


def test_lookup_rules_lookup_first_is_the_evals_ngram_then_dflash():
    """scripts/lookup_rules.py's rules on one request whose reply repeats a span of its prompt:
    ``lookup-first`` gives the eval's own ``ngram+dflash`` rounds, the oracle is never below either
    proposal alone, and a drafter that never agrees keeps ``agree1`` on the drafter's blocks."""
    rules = script("lookup_rules")
    from dflash_train.eval.simulate import simulate_ngram, simulate_ngram_then_dflash

    span = list(range(10, 40))
    prompt, continuation = [3, *span, 4, 5], [6, 7, *span, 8, 9, 2]
    block_size, key, max_draft = 8, 3, 12
    sequence = [*prompt, *continuation]
    # the drafter is right on its first two tokens at every anchor, wrong after them
    right = [sequence[len(prompt) + out : len(prompt) + out + 2] for out in range(1, 40)]
    drafts = torch_rows([[*r, *[1] * (block_size - 1 - len(r))] for r in right])
    run = rule_runs(rules, rules.RULES, prompt, continuation, drafts, block_size, key, max_draft, 64)
    evals = simulate_ngram_then_dflash(
        prompt, continuation, lambda out: drafts[out - 1].tolist(), key_size=key,
        block_size=block_size, max_new_tokens=64, eos_token_ids={2}, max_draft=max_draft,
    )  # fmt: skip
    assert run["lookup-first"].num_accepted == evals.num_accepted
    assert run["lookup"].tau > 1 and run["dflash"].tau < run["lookup-first"].tau
    assert run["oracle"].tau >= max(run["lookup"].tau, run["dflash"].tau, run["lookup-first"].tau)
    ngram = simulate_ngram(
        prompt, continuation, n=3, block_size=block_size, max_new_tokens=64, eos_token_ids={2}
    )
    assert run["ngram"].num_accepted == ngram.num_accepted  # the eval's own baseline, round for round
    wrong = torch_rows([[1] * (block_size - 1)] * 39)
    agree = rules.simulate(
        "agree1", prompt, continuation, wrong, eos={2}, block_size=block_size, key=key,
        max_draft=max_draft, max_new_tokens=64,
    )  # fmt: skip
    assert agree.num_accepted == [0] * len(agree.num_accepted)


def test_lookup_rules_overlapping_copy_drafts_a_loop_past_the_texts_end():
    """In a loop of period 5 llama.cpp's lookup (key 3) copies the 4 tokens the text holds after the
    match; copied on, the same match drafts up to the draft limit and is accepted as far."""
    rules = script("lookup_rules")
    prompt, continuation = [3, 4, 5, 6, 7, 8, 9], [*[20, 21, 22, 23, 24] * 30, 2]
    block_size, max_draft = 8, 24
    drafts = torch_rows([[1] * (block_size - 1)] * len(continuation))  # a drafter that is never right
    chosen = ("lookup", "lookup-overlap", "lookup-overlap-first", "ngram", "ngram-overlap")
    run = rule_runs(rules, chosen, prompt, continuation, drafts, block_size, 3, max_draft, 128)
    copied = [a for a, d in zip(run["lookup"].num_accepted, run["lookup"].num_drafted, strict=True) if d]
    assert copied and max(copied) == 4  # the text after the latest match, never more
    assert max(run["lookup-overlap"].num_accepted) == max_draft
    assert run["lookup-overlap-first"].tau >= run["lookup-overlap"].tau > 1.5 * run["lookup"].tau
    assert run["ngram-overlap"].tau > run["ngram"].tau


def rule_runs(rules, names, prompt, continuation, drafts, block_size, key, max_draft, max_new_tokens):
    """scripts/lookup_rules.py's ``simulate`` of one request under each rule in ``names`` (EOS 2)."""
    return {
        rule: rules.simulate(
            rule,
            prompt,
            continuation,
            drafts,
            eos={2},
            block_size=block_size,
            key=key,
            max_draft=max_draft,
            max_new_tokens=max_new_tokens,
        )  # fmt: skip
        for rule in names
    }


def torch_rows(rows):
    import torch

    return torch.tensor(rows)


def test_lookup_variants_periodic_copy_follows_a_short_loop_the_evals_ngram_pads():
    """scripts/lookup_variants_cpu.py: ``recent`` is the eval's ``ngram`` round for round; in a loop
    of period 2 it copies two tokens and pads, while the overlapping copy drafts whole blocks."""
    variants = script("lookup_variants_cpu")
    from dflash_train.eval.simulate import simulate_ngram

    prompt, reply = [5, 6, 7, 8], [*[30, 31] * 40, 2]
    taus = variants.lookup_taus(prompt, reply, {2}, n=3, block_size=8, limit=64)
    evals = simulate_ngram(prompt, reply, n=3, block_size=8, max_new_tokens=64, eos_token_ids={2})
    assert taus["recent"] == evals.tau
    assert taus["recent"] < 3.5 and taus["periodic"] > 6  # ~2 (+1) per round against 7 (+1)
    assert taus["earliest"] > taus["recent"]  # the loop's first occurrence has the most after it


def test_the_results_table_puts_the_drafter_beside_both_lookups(scale, monkeypatch):
    """table.txt: per file, tau, the eval's n-gram lookup and its ratio, then the overlapping copy
    (ngram-overlap) and its ratio; the diagnosis after them does not repeat either."""
    quality = sys.modules["gpu_quality"]
    monkeypatch.setattr(quality, "run_status", lambda args, name: {"step": 9, "total_steps": 9})
    row = {
        "file": "/x/code.jsonl",
        "tau": 6.0,
        "ngram_tau": 3.0,
        "ngram_overlap_tau": 4.0,
        "random_anchor_tau": 7.5,
    }
    text = quality.table(argparse.Namespace(), ["d2"], {"d2:heldout": {"per_file": [row]}})
    header, line = text.splitlines()[:2]
    assert header.split()[4:9] == ["tau", "ngram", "ratio", "overlap", "ratio"]
    assert line.split()[4:9] == ["6.000", "3.000", "2.00", "4.000", "1.50"]
    assert line.split()[9:] == ["random_anchor_tau=7.5"]


def test_a_torn_sittings_row_is_skipped_and_said(scale, tmp_path, capsys):
    """run_status reads a run's sittings.jsonl past a row torn by a killed process (and says so)."""
    quality = sys.modules["gpu_quality"]
    run = tmp_path / "run-a"
    run.mkdir()
    row = {"end_step": 40, "total_steps": 90, "finished": False}
    (run / "sittings.jsonl").write_text(json.dumps(row) + "\n" + '{"end_step": 8')
    status = quality.run_status(argparse.Namespace(work=tmp_path), "a")
    assert status["step"] == 40 and status["sittings"] == 1
    assert "skipped 1 unreadable line" in capsys.readouterr().err
