"""Quality runs on a real small target (docs/quality.md): drafters trained on one GPU in sittings,
each measured, once its run is finished, with the exact eval on held-out sets AND its own training
prompts.

    python3 scripts/gpu_quality.py --target DIR --data DATA_DIR --budget-s 540 --train-seconds 420 \
        --run "base|" --run "dense|data.packing=true train.num_anchors=512 train.anchors_per_token=1.0"

One call is one sitting: every unfinished run trains (side by side, or ``--parallel N`` at a time) in
a process with ``train.time_limit_s`` (docs/training.md, "Training in several sittings"), which saves
and exits before its limit; the same command again continues every run from its newest checkpoint in
``--work`` (kept on a warm machine between calls), until each says finished. Runs that finish are
evaluated in the same call when the budget leaves ``--eval-seconds``, else in the next one (an eval
already made for a run's last step is not repeated). Where each run is (step of total, sittings,
finished) is printed and kept in ``summary.json``.

Data: ``--data DATA_DIR`` with ``regen.jsonl.gz`` (training rows: the target's replies) and
``heldout_synth.jsonl.gz`` (prompts never trained on), or ``--train-rows FILE`` and ``--heldout FILE``
(repeatable: e.g. synth's per-task held-out files). ``evalsets/handwritten.jsonl`` is always a held-out
set, and the first ``--train-prompts`` training rows are a prompt set too, so memorisation (training
prompts vs held-out) and the anchor-placement gap (random-anchor vs sequential tau) can be told apart.

Everything a call leaves goes to ``--out`` (default ``$OUT`` or ./gpu-logs), rewritten after each
stage so that a call cut short still returns them: ``summary.json`` (where each run is, the eval
reports), ``table.txt`` (the table), ``logs.tar.gz`` (every train and eval log, each run's
metrics.jsonl and sittings.jsonl) and each run's newest export as ``export-NAME.partNN.tar`` (parts of
at most 15 MiB; ``cat export-NAME.part*.tar | tar x``).

Dry run on a CPU (a few minutes, numbers meaningless): ``python3 scripts/gpu_quality.py --dry-run``
trains the tiny-cpu recipe against ``builtin:demo-target`` on its own regeneration of the hand-written
prompts, in sittings of ``train.steps_per_process`` steps, and evaluates it on 4 prompts per set.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from gpu_bundles import PART_BYTES  # a call brings back files of at most 16 MiB

REPO = Path(__file__).resolve().parents[1]
HANDWRITTEN = REPO / "evalsets" / "handwritten.jsonl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="", help="HF target directory (or builtin:demo-target)")
    parser.add_argument("--data", type=Path, help="folder with regen.jsonl.gz, heldout_synth.jsonl.gz")
    parser.add_argument("--train-rows", type=Path, help="training rows (JSONL, maybe .gz) instead of --data")
    parser.add_argument("--heldout", type=Path, action="append", default=[], help="a held-out prompt file")
    parser.add_argument("--recipe", default="smollm2-135m")
    parser.add_argument(
        "--run", action="append", default=[], help="NAME|overrides (space-separated key=value); repeatable"
    )
    parser.add_argument("--common", default="", help="overrides given to every run")
    parser.add_argument("--budget-s", type=float, default=540, help="this call's wall time, all stages")
    parser.add_argument("--train-seconds", type=float, default=420, help="train.time_limit_s of a sitting")
    parser.add_argument("--parallel", type=int, default=0, help="runs training at once (0 = all)")
    parser.add_argument(
        "--eval-seconds", type=int, default=200, help="cap per eval (started only if it fits)"
    )
    parser.add_argument("--eval-prompts", type=int, default=128, help="prompts per held-out file (0 = all)")
    parser.add_argument(
        "--train-prompts", type=int, default=64, help="training rows measured as a prompt set"
    )
    parser.add_argument("--eval-unfinished", action="store_true", help="also evaluate unfinished runs")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--eval-batch-size", type=int, default=128)
    parser.add_argument("--eval-args", default="--baseline ngram", help="extra eval flags for every run")
    parser.add_argument("--max-rows", type=int, default=0, help="train on the first N rows (0 = all)")
    parser.add_argument("--device", default="", help="pass --device to eval (cpu for a dry run)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/quality"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-logs"))
    parser.add_argument("--dry-run", action="store_true", help="CPU wiring check (see the header)")
    args = parser.parse_args(argv)
    if args.dry_run:
        dry_run_defaults(args)
    if not args.target or not (args.data or args.train_rows):
        parser.error("--target and --data (or --train-rows) are required, unless --dry-run")
    args.started = time.monotonic()
    return args


def dry_run_defaults(args: argparse.Namespace) -> None:
    """The tiny CPU set-up: demo target, tiny-cpu recipe, sittings of 20 steps, 4 prompts per set."""
    args.target = args.target or "builtin:demo-target"
    args.recipe, args.device = "tiny-cpu", args.device or "cpu"
    args.common = f"train.max_steps=50 train.steps_per_process=20 checkpoint.every_steps=20 {args.common}"
    args.eval_prompts, args.train_prompts, args.max_new_tokens, args.eval_batch_size = 4, 4, 32, 4
    args.run = args.run or ["base|"]
    if not (args.data or args.train_rows):
        args.data = dry_run_data(args)


def dry_run_data(args: argparse.Namespace) -> Path:
    """The target's own replies to the hand-written prompts (training rows) and 8 of them held out."""
    data = args.work / "dry-data"
    if not (data / "regen.jsonl.gz").exists():
        data.mkdir(parents=True, exist_ok=True)
        regen = data / "regen.jsonl"
        run_cli(
            ["regen", "--target", args.target, "--data", str(HANDWRITTEN), "--output", str(regen)]
            + ["--max-new-tokens", "48", "--batch-size", "16", "--device", "cpu"],
            data / "regen.log",
        )
        write_gz(data / "regen.jsonl.gz", regen.read_text().splitlines(keepends=True))
        write_gz(data / "heldout_synth.jsonl.gz", HANDWRITTEN.read_text().splitlines(keepends=True)[:8])
    return data


def write_gz(path: Path, lines: list[str]) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.writelines(lines)


def read_maybe_gz(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [line for line in handle if line.strip()]


def prepare_data(args: argparse.Namespace) -> dict[str, Path]:
    """The training rows (a plain JSONL file used in place, else decompressed or cut once into the
    work folder) and the prompt sets, by file stem."""
    args.work.mkdir(parents=True, exist_ok=True)
    source = args.train_rows or args.data / "regen.jsonl.gz"
    files = {"train_rows": source, "train_prompts": args.work / "train_prompts.jsonl"}
    if source.suffix == ".gz" or args.max_rows:
        files["train_rows"] = args.work / "regen.jsonl"
        stat = source.stat()
        made_from = json.dumps([str(source.resolve()), stat.st_size, stat.st_mtime, args.max_rows])
        marker = args.work / "regen.source.json"
        if not marker.exists() or marker.read_text() != made_from:
            rows = read_maybe_gz(source)
            files["train_rows"].write_text("".join(rows[: args.max_rows] if args.max_rows else rows))
            marker.write_text(made_from)
    with open(files["train_rows"], encoding="utf-8") as handle:
        first = [line for _, line in zip(range(args.train_prompts), handle)]
    files["train_prompts"].write_text("".join(first))
    heldout = list(args.heldout) + ([args.data / "heldout_synth.jsonl.gz"] if args.data else [])
    for path in heldout:
        name = path.name.removesuffix(".gz").removesuffix(".jsonl")
        files[name] = args.work / f"{name}.jsonl"
        files[name].write_text("".join(read_maybe_gz(path)))
    files["handwritten"] = HANDWRITTEN
    print(
        f"data: {files['train_rows']}; prompt sets {', '.join(k for k in files if k != 'train_rows')}",
        flush=True,
    )
    return files


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "dflash_train.cli", *args]


def run_cli(args: list[str], log: Path, timeout: float | None = None) -> int:
    """One ``dflash-train`` command with its output in ``log``; killed (its process group) at ``timeout``."""
    with open(log, "a") as handle:
        proc = subprocess.Popen(
            cli(*args), stdout=handle, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
        )
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            handle.write(f"\n[killed at its {timeout:.0f} s timeout]\n")
            return -signal.SIGKILL


def remaining(args: argparse.Namespace) -> float:
    return args.budget_s - (time.monotonic() - args.started)


def logs_dir(args: argparse.Namespace) -> Path:
    path = args.work / "logs"
    path.mkdir(parents=True, exist_ok=True)
    return path


# ----------------------------------------------------------------------------- training in sittings


def run_status(args: argparse.Namespace, name: str) -> dict:
    """Where a run is: the newest row of its sittings.jsonl (nothing yet: not started)."""
    path = args.work / f"run-{name}" / "sittings.jsonl"
    rows, torn = [], 0
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:  # a row torn by a process killed while writing it
            torn += 1
    if torn:
        print(f"{path}: skipped {torn} unreadable line(s) (torn rows)", file=sys.stderr)
    if not rows:
        return {"step": 0, "total_steps": None, "finished": False, "sittings": 0}
    last = rows[-1]
    keep = ("end_step", "total_steps", "finished", "stopped", "elapsed_s", "step_s", "save_s")
    return {"step": last["end_step"], "sittings": len(rows), **{k: last.get(k) for k in keep}}


def train_command(args: argparse.Namespace, name: str, overrides: list[str], files: dict, limit_s: float):
    return [
        "train",
        args.recipe,
        f"target.path={args.target}",
        f"data.paths=[{files['train_rows']}]",
        f"output_dir={args.work / ('run-' + name)}",
        # One cache for every run: it is keyed by the data files and tokenizer, so runs on the same
        # rows share one build (58-79 s each for 92,597 rows) and runs on other rows get their own.
        f"data.cache_dir={args.work / 'cache'}",
        f"train.time_limit_s={limit_s:.0f}",
        *args.common.split(),
        *overrides,  # last: a run's own data.paths (e.g. a data-scale subset) wins
        "--json",
    ]


def train_sitting(
    args: argparse.Namespace, runs: list[tuple[str, list[str]]], files: dict, reserve_s: float = 0.0
) -> dict[str, int]:
    """One sitting of every unfinished run (``--parallel`` at a time) within the call's budget, less
    ``reserve_s`` kept for what follows (the eval of a job that must end measured).

    ``train.time_limit_s`` makes each process save and exit before its limit; SIGTERM at the limit
    plus a grace period, then SIGKILL, are only backstops."""
    todo = [(n, o) for n, o in runs if not run_status(args, n)["finished"]]
    codes: dict[str, int] = {}
    width = args.parallel or len(todo) or 1
    for first in range(0, len(todo), width):
        limit = min(args.train_seconds, remaining(args) - 30 - reserve_s)
        if limit < min(60, args.train_seconds):
            print(f"training: {remaining(args):.0f} s left in the budget, no sitting started", flush=True)
            break
        procs = {}
        for name, overrides in todo[first : first + width]:
            command = train_command(args, name, overrides, files, limit)
            print("train:", " ".join(command[1:]), flush=True)
            handle = open(logs_dir(args) / f"train-{name}.log", "a")
            procs[name] = (
                subprocess.Popen(
                    cli(*command), stdout=handle, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
                ),
                handle,
            )
        codes.update(wait_all(procs, deadline=time.monotonic() + limit + 60, grace=60))
    for name, _ in runs:
        status = run_status(args, name)
        where = "finished" if status["finished"] else "not finished: run the same command again"
        print(
            f"run {name}: step {status['step']} of {status['total_steps']}, {status['sittings']} sittings, {where}",
            flush=True,
        )
    return codes


def wait_all(procs: dict, deadline: float, grace: float) -> dict[str, int]:
    """Wait for every process; past ``deadline`` SIGTERM (saves at the step boundary), then SIGKILL."""
    codes: dict[str, int] = {}
    termed = None
    while len(codes) < len(procs):
        for name, (proc, handle) in procs.items():
            if name not in codes and proc.poll() is not None:
                codes[name] = proc.returncode
                handle.close()
        now = time.monotonic()
        if len(codes) < len(procs) and now > deadline and termed is None:
            termed = now
            for name, (proc, _) in procs.items():
                if name not in codes:
                    os.killpg(proc.pid, signal.SIGTERM)
        elif termed is not None and now > termed + grace:
            for name, (proc, _) in procs.items():
                if name not in codes:
                    os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(0.5)
    return codes


# ----------------------------------------------------------------------------- evaluation


def export_dir(args: argparse.Namespace, name: str) -> Path | None:
    """The finished run's export; with ``--eval-unfinished`` one made from the newest checkpoint."""
    run = args.work / f"run-{name}"
    if run_status(args, name)["finished"]:
        return run / "export" if (run / "export" / "config.json").exists() else None
    if not args.eval_unfinished or not (run / "checkpoints").exists():
        return None
    partial = run / "export-partial"
    run_cli(["export", str(run), str(partial)], logs_dir(args) / f"train-{name}.log", timeout=300)
    return partial if (partial / "config.json").exists() else None


def eval_command(args, export: Path, prompts: list[str], num: int, out_dir: Path, engine: str) -> list[str]:
    return [
        "eval",
        "--generation-engine",
        engine,
        "--target",
        args.target,
        "--drafter",
        str(export),
        "--prompts",
        *prompts,
        "--num-prompts",
        str(num),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--batch-size",
        str(args.eval_batch_size),
        "--no-progress",
        "--output-dir",
        str(out_dir),
        *args.eval_args.split(),
        *(["--device", args.device] if args.device else []),
        "--json",
    ]


def eval_all(args: argparse.Namespace, names: list[str], files: dict) -> dict[str, dict]:
    """Held-out and training-prompt evals of every finished run, side by side, if ``--eval-seconds``
    fit in the budget; a failure is retried once on the padded generation engine. Results are kept in
    the work folder, so a run's eval at its last step is never repeated."""
    store = args.work / "evals.json"
    reports = json.loads(store.read_text()) if store.exists() else {}
    heldout = [str(p) for k, p in files.items() if k not in ("train_rows", "train_prompts")]
    todo = {}
    for name in names:
        step = run_status(args, name)["step"]
        due = [
            (label, prompts, num)
            for label, prompts, num in (
                ("heldout", heldout, args.eval_prompts),
                ("train", [str(files["train_prompts"])], 0),
            )
            if reports.get(f"{name}:{label}", {}).get("step") != step or "error" in reports[f"{name}:{label}"]
        ]
        export = export_dir(args, name) if due else None
        todo.update(
            {f"{name}:{label}": (step, export, prompts, num) for label, prompts, num in due if export}
        )
    for engine in ("auto", "padded"):
        if not todo:
            break
        if remaining(args) < args.eval_seconds + 10:
            print(
                f"evals {sorted(todo)}: {remaining(args):.0f} s left, deferred to the next call", flush=True
            )
            break
        done = run_evals(args, todo, engine)
        reports.update(done)
        store.write_text(json.dumps(reports, indent=1))
        todo = {key: value for key, value in todo.items() if "error" in done[key]}
    return reports


def run_evals(args, todo: dict, engine: str) -> dict[str, dict]:
    """Every eval of ``todo`` at once, each killed at ``--eval-seconds``; the report of each."""
    procs = {}
    for key, (_, export, prompts, num) in todo.items():
        slug = key.replace(":", "-")
        command = eval_command(args, export, prompts, num, args.work / f"eval-{slug}", engine)
        handle = open(logs_dir(args) / f"eval-{slug}.log", "a")
        handle.write(f"\n[{engine} generation engine]\n")
        handle.flush()
        proc = subprocess.Popen(
            cli(*command), stdout=handle, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
        )
        procs[key] = (proc, handle)
    wait_all(procs, deadline=time.monotonic() + min(args.eval_seconds, remaining(args) - 5), grace=5)
    reports = {}
    for key, (step, _, _, _) in todo.items():
        lines = (logs_dir(args) / f"eval-{key.replace(':', '-')}.log").read_text().strip().splitlines()
        try:
            reports[key] = {"step": step, **json.loads(lines[-1])}
        except (ValueError, IndexError):
            reports[key] = {"step": step, "error": "\n".join(lines[-8:])[-600:]}
    return reports


# ----------------------------------------------------------------------------- results


def table(args: argparse.Namespace, names: list[str], reports: dict[str, dict]) -> str:
    # ngram: the eval's prompt lookup; overlap: the same copied on past the text's end (ngram-overlap)
    header = f"{'run':12} {'step':>11} | {'prompts':16} {'tau':>6} {'ngram':>6} {'ratio':>5} {'overlap':>7} {'ratio':>5}"
    lines = [f"{header}  diagnosis"]
    for name in names:
        status = run_status(args, name)
        where = f"{status['step']}/{status['total_steps']}"
        for label in ("heldout", "train"):
            report = reports.get(f"{name}:{label}")
            if not report or "error" in report:
                lines.append(
                    f"{name:12} {where:>11} | {label}: {'eval failed' if report else 'not evaluated'}"
                )
                continue
            for row in report.get("per_file") or []:
                columns = ("tau", "ngram_tau", "ngram_overlap_tau")
                tau, ngram, overlap = (row.get(key) or float("nan") for key in columns)
                diag = {k: v for k, v in row.items() if isinstance(v, float) and k not in columns}
                text = " ".join(f"{k}={v:.3g}" for k, v in list(diag.items())[:8])
                file = Path(row["file"]).stem[:16]
                lines.append(
                    f"{name:12} {where:>11} | {file:16} {tau:6.3f} {ngram:6.3f} {tau / ngram:5.2f} "
                    f"{overlap:7.3f} {tau / overlap:5.2f}  {text}"
                )
    return "\n".join(lines)


def write_results(args: argparse.Namespace, summary: dict, names: list[str], reports: dict) -> None:
    """summary.json, table.txt and logs.tar.gz under --out (rewritten after every stage)."""
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {**summary, "status": {n: run_status(args, n) for n in names}, "eval": reports}
    summary["finished"] = all(s["finished"] for s in summary["status"].values())
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    (args.out / "table.txt").write_text(table(args, names, reports) + "\n")
    with tarfile.open(args.out / "logs.tar.gz.tmp", "w:gz") as tar:
        tar.add(logs_dir(args), arcname="logs")
        for name in names:
            for file in ("metrics.jsonl", "sittings.jsonl"):
                path = args.work / f"run-{name}" / file
                if path.exists():
                    tar.add(path, arcname=f"run-{name}/{file}")
    shutil.move(args.out / "logs.tar.gz.tmp", args.out / "logs.tar.gz")
    bundle_exports(args, names)


def bundle_exports(args: argparse.Namespace, names: list[str], part_bytes: int = PART_BYTES) -> None:
    """Each run's newest export (``export`` once finished, else ``export-partial``) as an uncompressed
    tar in parts, ``export-NAME.partNN.tar`` under --out, so that the drafter a lease trained outlives
    the machine: ``cat export-NAME.part*.tar | tar x`` gives ``export-NAME/`` (for eval, serve-check,
    llama.cpp). Rewritten only when the export changed (``export-NAME.stamp``: its files, sizes and
    modification times)."""
    for name in names:
        run = args.work / f"run-{name}"
        export = next(
            (run / d for d in ("export", "export-partial") if (run / d / "config.json").exists()), None
        )
        if export is None:
            continue
        files = sorted(p for p in export.rglob("*") if p.is_file())
        stamp = "\n".join(f"{p.relative_to(export)} {p.stat().st_size} {p.stat().st_mtime_ns}" for p in files)
        stamp_file = args.out / f"export-{name}.stamp"
        if stamp_file.exists() and stamp_file.read_text() == f"{export.name}\n{stamp}":
            continue
        whole = args.work / f"export-{name}.tar"
        with tarfile.open(whole, "w") as tar:
            tar.add(export, arcname=f"export-{name}")
        data = whole.read_bytes()
        whole.unlink()
        for old in args.out.glob(f"export-{name}.part*.tar"):
            old.unlink()
        for i in range(0, len(data), part_bytes):
            (args.out / f"export-{name}.part{i // part_bytes:02d}.tar").write_bytes(data[i : i + part_bytes])
        stamp_file.write_text(f"{export.name}\n{stamp}")


def parse_runs(specs: list[str]) -> list[tuple[str, list[str]]]:
    runs = []
    for spec in specs or ["base|"]:
        name, _, overrides = spec.partition("|")
        runs.append((name.strip(), overrides.split()))
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs, names = parse_runs(args.run), [name for name, _ in parse_runs(args.run)]
    files = prepare_data(args)
    summary = {
        "runs": {name: " ".join(o) for name, o in runs},
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    write_results(args, summary, names, {})
    summary["train_exit_codes"] = train_sitting(args, runs, files)
    write_results(args, summary, names, {})
    reports = eval_all(args, names, files)
    write_results(args, summary, names, reports)
    print(table(args, names, reports), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
