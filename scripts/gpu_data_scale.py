"""The data-scale curve on one GPU (docs/quality.md, "Data at scale"): steered synth of 120K prompts
with held-out prompts per task -> regen -> the drafter trained on 8.7K / 30K / 100K of the rows in
sittings -> the exact eval on every task's held-out prompts, the hand-written set and training prompts.

    python3 scripts/gpu_data_scale.py --target /tmp/smol --budget-s 540        # the same command per call

Each device call runs this once, within ``--budget-s``; every stage resumes where the last call left
it in ``--work`` (git-ignored ``runs/``, kept on a warm machine between calls), and every subprocess
runs under a timeout inside the budget:
  synth  ``dflash-train synth --task-file chat-tasks --heldout-per-task 200`` in steps of
         ``--synth-step-rows`` (a step starts only when the last one's pace says it ends in time);
  regen  the training prompts (never the held-out ones), in steps of ``--regen-step-rows``;
  train  once regen has N rows, ``regen-N.jsonl`` (its first N rows, written once, never changed) and
         the run ``rows-N`` on it: ``train.max_steps=--steps`` for the equal-steps curve (and
         ``rows-N-epochs`` with ``train.num_epochs=--epochs`` when given), one sitting per call
         (``train.time_limit_s``, ``scripts/gpu_quality.py``);
  eval   each finished run, on the per-task held-out files, evalsets/handwritten.jsonl and its own
         first training rows.
Under ``--out`` (``$OUT``), rewritten after every stage so that a call cut short still returns them:
``status.json`` (each stage's latest result and where every run is; ``done`` once all is measured;
``source``, the code's digest, gpu_figures' ``source_digest``),
gpu_quality's ``summary.json``, ``table.txt`` and ``logs.tar.gz``, and ``synth.tar.gz`` (the prompts,
held-out files and synth state, split into ``synth.partNN.tar.gz`` past 15 MiB), and once regen is
done ``regen-rows.partNN.jsonl.xz`` (the rows, for a later lease's ``--regen-rows``), or at the end of a
job whose budget ran out inside regen ``regen-partial-N.partNN.jsonl.xz`` (its first N rows: the same
``--prompts`` with those parts as ``--regen-rows`` continue regen where they end), and each run's
newest export as ``export-NAME.partNN.tar`` (``scripts/gpu_bring_back.sh`` brings all of it back
within a call's 8 files). A fresh machine continues the synth from that bundle: copy it into a carried folder and pass ``--synth-from DIR``.
Prompts made earlier skip the synth stage (``--prompts``), and replies regenerated earlier skip
synth and regen (``--regen-rows``: 33,000 rows are ~15 MB with xz, one carried file).

Dry run on a CPU (the wiring end to end, numbers meaningless): ``python3 scripts/gpu_data_scale.py
--dry-run`` (``builtin:demo-target``, tiny-cpu recipe, a few rows per task, scales 4 and 8, sittings of
``train.steps_per_process``); run it again until ``status.json`` says done.
"""

from __future__ import annotations

import argparse
import gzip
import json
import lzma
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_bundles as bundles  # noqa: E402
import gpu_quality as quality  # noqa: E402
from gpu_figures import source_digest  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="", help="HF directory of the target on this machine")
    p.add_argument("--work", type=Path, default=Path("runs/data-scale"))
    p.add_argument("--out", type=Path, default=Path(quality.os.environ.get("OUT") or "gpu-logs"))
    p.add_argument("--budget-s", type=float, default=540, help="this call's wall time, all stages")
    p.add_argument("--stages", default="synth,regen,train,eval")
    p.add_argument(
        "--synth-from", type=Path, help="a folder with synth.tar.gz (or parts) from an earlier call"
    )
    p.add_argument(
        "--prompts",
        type=Path,
        help="training prompts made earlier (JSONL, or .xz/.gz: datasets/smollm2-135m-tasks/prompts.jsonl.xz) "
        "instead of the synth stage; give their held-out files with --heldout",
    )
    p.add_argument(
        "--regen-rows",
        type=Path,
        action="append",
        default=[],
        help="training rows regenerated earlier (JSONL, xz or gzip; repeat for the parts of one file "
        "split in two, joined in order) instead of the synth and regen stages (with --prompts and fewer "
        "rows than prompts: regen continues with the prompts they do not answer)",
    )
    p.add_argument("--num-rows", type=int, default=120_000, help="training prompts kept after the filters")
    p.add_argument("--task-file", default="chat-tasks")
    p.add_argument("--heldout-per-task", type=int, default=200)
    p.add_argument("--synth-batch-size", type=int, default=1024)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--max-samples", type=int, default=0, help="synth --max-samples (0 = 20 per row)")
    p.add_argument("--synth-step-rows", type=int, default=8192)
    p.add_argument("--synth-args", default="", help="more synth flags, e.g. --stop-loops")
    p.add_argument("--regen-batch-size", type=int, default=1024)
    p.add_argument("--regen-max-new-tokens", type=int, default=512)
    p.add_argument("--regen-step-rows", type=int, default=8192)
    p.add_argument(
        "--regen-compile-decode",
        choices=["auto", "on", "off"],
        default="auto",
        help="regen --compile-decode (off: the graphed eager step, 174 rows/s measured at batch 2,048)",
    )
    p.add_argument("--device", default="", help="synth/regen/eval --device (cpu for a dry run)")
    p.add_argument("--scales", default="8700,30000,100000", help="training rows of each run")
    p.add_argument("--steps", type=int, default=6000, help="equal-steps runs: train.max_steps (0 = none)")
    p.add_argument(
        "--epochs", type=int, default=0, help="also equal-epochs runs: train.num_epochs (0 = none)"
    )
    p.add_argument("--recipe", default="smollm2-135m")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME|overrides: a run per scale named rows-N-NAME with these overrides; NAME@N|overrides: "
        "at scale N only (repeatable; default one run per scale, rows-N, the recipe as it is)",
    )
    p.add_argument("--common", default="", help="overrides for every run")
    p.add_argument("--train-seconds", type=float, default=420, help="train.time_limit_s of a sitting")
    p.add_argument("--parallel", type=int, default=0, help="runs training at once (0 = all ready)")
    p.add_argument("--eval-seconds", type=int, default=240)
    p.add_argument("--eval-prompts", type=int, default=128, help="prompts per held-out file (0 = all)")
    p.add_argument("--train-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=512, help="eval continuation length")
    p.add_argument(
        "--heldout", type=Path, action="append", default=[], help="another held-out prompt file (repeatable)"
    )
    p.add_argument("--eval-batch-size", type=int, default=128)
    p.add_argument("--eval-args", default="--baseline ngram --ddtree-budget 32")
    p.add_argument(
        "--eval-unfinished",
        action="store_true",
        help="also evaluate a run its training budget cut short, at its newest checkpoint (a detached "
        "job that must end measured; without it only finished runs are evaluated)",
    )
    p.add_argument("--dry-run", action="store_true", help="CPU wiring check (see the header)")
    args = p.parse_args(argv)
    if args.dry_run:
        dry_run_defaults(args)
    if not args.target:
        p.error("--target is required, unless --dry-run")
    args.started, args.max_rows = time.monotonic(), 0
    args.source = source_digest()  # once: a later call may replace the job's tree while it runs
    args.extra_heldout = list(args.heldout)
    return args


def dry_run_defaults(args: argparse.Namespace) -> None:
    args.target = args.target or "builtin:demo-target"
    args.recipe, args.device = "tiny-cpu", args.device or "cpu"
    # The demo target is a code-continuation model: ~1 sample in 20 ends its user turn in 32 tokens,
    # and its two-turn chat task runs out of samples (its budget spent: the stage goes on without it).
    args.num_rows, args.heldout_per_task = 12, 1
    args.synth_batch_size, args.max_prompt_tokens, args.synth_step_rows = 64, 32, 12
    args.regen_batch_size, args.regen_max_new_tokens, args.regen_step_rows = 16, 48, 8
    args.scales, args.steps, args.train_seconds = "4,8", 40, 120
    args.common = f"train.steps_per_process=15 checkpoint.every_steps=10 logging.every_steps=5 {args.common}"
    args.eval_prompts, args.train_prompts, args.max_new_tokens, args.eval_batch_size = 2, 2, 24, 4
    args.eval_seconds, args.eval_args = 150, "--baseline ngram"


# ----------------------------------------------------------------------------- stages


def stepped(args, status: dict, stage: str, command, progress, total: int, step_rows: int) -> None:
    """``command(limit)`` for limit = done + step_rows, ... up to ``total``, each call resuming the
    previous (``progress(result)``: rows done), while the last call's pace says the next one ends
    inside the budget. The first call of a stage takes a quarter step, to measure the pace."""
    record = status.setdefault(stage, {})
    while record.get("done", 0) < total and not record.get("exhausted"):
        pace, before = record.get("seconds_per_row", 0.0), record.get("done", 0)
        limit = min(total, before + (step_rows if pace else max(1, step_rows // 4)))
        needed = 60 + pace * (limit - before)  # start-up (model load) + the rows
        if needed > quality.remaining(args) - 30:
            print(
                f"{stage}: {quality.remaining(args):.0f} s left, a step needs ~{needed:.0f} s; next call",
                flush=True,
            )
            return
        t0, log = time.monotonic(), quality.logs_dir(args) / f"{stage}.log"
        code = quality.run_cli(command(limit), log, timeout=quality.remaining(args) - 20)
        result = last_json(log)
        if code != 0 or result is None:
            record["error"] = f"exit {code}; see logs/{stage}.log"
            return
        record.update(result, error=None, done=progress(result), total=total)
        rows = record["done"] - before
        record["seconds_per_row"] = max(time.monotonic() - t0 - 30, 1.0) / rows if rows > 0 else pace
        # No new rows (regen: rows that keep failing), or synth's sample budget spent at the full
        # count: more calls would add nothing. (Short of the full count a larger limit raises it.)
        record["exhausted"] = rows <= 0 or (limit >= total and result.get("complete") is False)
        write_status(args, status)


def last_json(log: Path) -> dict | None:
    try:
        return json.loads(log.read_text().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def synth_stage(args, status: dict) -> None:
    prompts = args.work / "prompts.jsonl"

    def command(limit: int) -> list[str]:
        return [
            "synth",
            "--target",
            args.target,
            "--output",
            str(prompts),
            "--num-rows",
            str(limit),
            "--task-file",
            args.task_file,
            "--heldout-per-task",
            str(args.heldout_per_task),
            "--batch-size",
            str(args.synth_batch_size),
            "--max-prompt-tokens",
            str(args.max_prompt_tokens),
            "--max-samples",
            str(args.max_samples),
            *args.synth_args.split(),
            *(["--device", args.device] if args.device else []),
            "--json",
        ]

    stepped(args, status, "synth", command, lambda r: r["rows"], args.num_rows, args.synth_step_rows)
    bundles.bundle_synth(args)


def regen_stage(args, status: dict) -> None:
    synth = status.get("synth", {})
    if synth.get("done", 0) < args.num_rows and not synth.get("exhausted"):
        return  # the prompts are not all there yet
    prompts, regen = args.work / "prompts.jsonl", args.work / "regen.jsonl"
    available = sum(1 for _ in open(prompts, "rb"))

    def command(limit: int) -> list[str]:
        return [
            "regen",
            "--target",
            args.target,
            "--data",
            str(prompts),
            "--output",
            str(regen),
            "--max-rows",
            str(limit),
            "--batch-size",
            str(args.regen_batch_size),
            "--max-new-tokens",
            str(args.regen_max_new_tokens),
            "--compile-decode",
            args.regen_compile_decode,
            *(["--device", args.device] if args.device else []),
            "--json",
        ]

    handled = lambda r: r["rows_done"] + r["rows_skipped"]  # noqa: E731 (input rows, new or already done)
    stepped(args, status, "regen", command, handled, available, args.regen_step_rows)


def scale_runs(args, status: dict) -> list[tuple[str, list[str]]]:
    """The runs whose rows exist: ``regen-N.jsonl`` (the first N regenerated rows, all of them when
    regen finished with fewer) is cut once and never rewritten: a run's data must not change."""
    regen, record = args.work / "regen.jsonl", status.get("regen", {})
    done = sum(1 for _ in open(regen, "rb")) if regen.exists() else 0
    finished = record.get("total") is not None and (
        record.get("done", 0) >= record["total"] or record.get("exhausted")
    )
    runs, subsets = [], status.setdefault("subsets", {})
    for scale in [int(s) for s in args.scales.split(",")]:
        subset = args.work / f"regen-{scale}.jsonl"
        if done < scale and done in subsets.values():
            continue  # regen made fewer rows than this scale, and a smaller scale already has them all
        if not subset.exists() and (done >= scale or (finished and done > 0)):
            with open(regen, encoding="utf-8") as source, open(subset.with_suffix(".tmp"), "w") as out:
                out.writelines(line for _, line in zip(range(scale), source))
            subset.with_suffix(".tmp").rename(subset)
            subsets[str(scale)] = sum(1 for _ in open(subset, "rb"))
        if subset.exists():
            data = f"data.paths=[{subset}]"
            for suffix, overrides in variants(args, scale):
                if args.steps:
                    runs.append(
                        (f"rows-{scale}{suffix}", [data, f"train.max_steps={args.steps}", *overrides])
                    )
                if args.epochs:
                    epochs = ["train.max_steps=0", f"train.num_epochs={args.epochs}"]
                    runs.append((f"rows-{scale}-epochs{suffix}", [data, *epochs, *overrides]))
    return runs


def variants(args, scale: int) -> list[tuple[str, list[str]]]:
    """(run-name suffix, overrides) of each ``--variant`` that runs at ``scale`` (one unnamed run
    without any): ``NAME@N|overrides`` runs at scale N only, ``NAME|overrides`` at every scale."""
    if not args.variant:
        return [("", [])]
    chosen = []
    for spec, overrides in quality.parse_runs(args.variant):
        name, _, at = spec.partition("@")
        if not at or int(at) == scale:
            chosen.append((f"-{name}", overrides))
    return chosen


def heldout_sets(args) -> list[Path]:
    """synth's held-out prompt files, one per task (a task that kept none has none to measure)."""
    folder = args.work / "prompts.heldout"
    return sorted(p for p in folder.glob("*.jsonl") if p.stat().st_size) if folder.exists() else []


def train_and_eval(args, status: dict, stages: list[str]) -> None:
    if "train" not in stages and "eval" not in stages:
        return  # a synth or regen job: no subsets cut, no training data prepared
    runs = scale_runs(args, status)
    names = [name for name, _ in runs]
    if not runs:
        return
    args.train_rows, args.data = args.work / "regen.jsonl", None
    args.heldout = heldout_sets(args) + [p for p in args.extra_heldout if p not in heldout_sets(args)]
    args.run = [f"{n}|{' '.join(o)}" for n, o in runs]
    files = quality.prepare_data(args)
    summary = {"runs": {n: " ".join(o) for n, o in runs}}
    if "train" in stages:
        # Its last sitting leaves the eval's time; with --eval-unfinished a run cut short is
        # evaluated at its newest checkpoint, so the job ends measured.
        reserve = args.eval_seconds + 10 if "eval" in stages else 0.0
        summary["train_exit_codes"] = quality.train_sitting(args, runs, files, reserve_s=reserve)
        quality.write_results(args, summary, names, {})
    reports = quality.eval_all(args, names, files) if "eval" in stages else {}
    quality.write_results(args, summary, names, reports)
    status["runs"] = {n: quality.run_status(args, n) for n in names}
    status["evaluated"] = sorted(k for k, v in reports.items() if "error" not in v)


# ----------------------------------------------------------------------------- given files


def given_prompts(args, status: dict) -> None:
    """``--prompts``: the training prompts decompressed once into the work folder; the synth stage
    is then done with their count."""
    if args.prompts is None:
        return
    prompts = args.work / "prompts.jsonl"
    if not prompts.exists():
        opener = {".xz": lzma.open, ".gz": gzip.open}.get(args.prompts.suffix, open)
        with opener(args.prompts, "rb") as source, open(prompts.with_suffix(".tmp"), "wb") as out:
            shutil.copyfileobj(source, out)
        prompts.with_suffix(".tmp").rename(prompts)
    rows = sum(1 for _ in open(prompts, "rb"))
    args.num_rows = rows
    status["synth"] = {"done": rows, "total": rows, "given": str(args.prompts)}


def given_rows(args, status: dict) -> None:
    """``--regen-rows``: replies regenerated on an earlier machine (the parts of one compressed file,
    joined in order) become the work folder's ``regen.jsonl`` once; the regen stage is then done with
    their count, so a lease spends its minutes on training instead of regenerating them."""
    if not args.regen_rows:
        return
    regen = args.work / "regen.jsonl"
    if not regen.exists():
        joined = args.work / "regen-given"
        with open(joined, "wb") as out:
            for part in args.regen_rows:
                out.write(part.read_bytes())
        with open(joined, "rb") as head:  # by content: the parts of a split file have no suffix to go by
            magic = head.read(6)
        opener = lzma.open if magic == b"\xfd7zXZ\x00" else gzip.open if magic[:2] == b"\x1f\x8b" else open
        with opener(joined, "rb") as source, open(regen.with_suffix(".tmp"), "wb") as out:
            shutil.copyfileobj(source, out)
        regen.with_suffix(".tmp").rename(regen)
        joined.unlink()
    rows = sum(1 for _ in open(regen, "rb"))
    given = [str(p) for p in args.regen_rows]
    if args.prompts is None:
        status["synth"] = {"done": rows, "total": rows, "given": "regenerated rows"}
        status["regen"] = {"done": rows, "total": rows, "given": given}
        return
    # Replies to the first of the given prompts (a lease cut short): regen continues with the rest,
    # skipping the rows it finds by key; a record from an earlier call of this job keeps its pace.
    record = status.setdefault("regen", {})
    record.update(done=max(record.get("done", 0), rows), total=args.num_rows, given=given)


def skipped_stages(args, status: dict) -> set[str]:
    """The stages that given files replace: synth by ``--prompts`` or ``--regen-rows``, regen by
    ``--regen-rows`` that answer every prompt (with fewer, regen continues where they end)."""
    skipped = {"synth"} if args.prompts is not None or args.regen_rows else set()
    regen = status.get("regen", {})
    if args.regen_rows and regen.get("done", 0) >= regen.get("total", 0):
        skipped.add("regen")
    return skipped


def write_status(args, status: dict) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    runs = status.get("runs") or {}
    status["done"] = (
        bool(runs)
        and all(s["finished"] for s in runs.values())
        and len(status.get("evaluated", [])) >= 2 * len(runs)
    )
    status["elapsed_s"] = round(time.monotonic() - args.started, 1)
    status["source"] = args.source  # the code by content: the device's git history can lag
    (args.work / "status.json").write_text(json.dumps(status, indent=1))
    (args.out / "status.json").write_text(json.dumps(status, indent=1))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    bundles.restore_synth(args)
    saved = args.work / "status.json"
    status = json.loads(saved.read_text()) if saved.exists() else {}
    stages = args.stages.split(",")
    given_prompts(args, status)
    given_rows(args, status)
    stages = [stage for stage in stages if stage not in skipped_stages(args, status)]
    for stage, run in (("synth", synth_stage), ("regen", regen_stage)):
        if stage in stages:
            run(args, status)
            write_status(args, status)
    bundling = bundles.bundle_rows(args, status) if "regen" in stages else None
    train_and_eval(args, status, stages)
    if bundling is not None:
        bundling.wait()
    if "regen" in stages:
        bundles.bundle_partial_rows(args, status)
    write_status(args, status)
    print(json.dumps({k: status.get(k) for k in ("done", "runs", "evaluated", "elapsed_s")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
