"""Quality runs on a real small target (docs/quality.md): several drafters trained side by side on one
GPU, each then measured with the exact eval on held-out sets AND on its own training prompts.

    python3 scripts/gpu_quality.py --target DIR --data DATA_DIR --train-seconds 300 \
        --run "base|" --run "dense|data.packing=true train.num_anchors=512 train.anchors_per_token=1.0"

DATA_DIR holds ``regen.jsonl.gz`` (the target's replies to synthesized prompts) and
``heldout_synth.jsonl.gz`` (prompts never regenerated nor trained on); ``evalsets/handwritten.jsonl``
is the second held-out set, and the first ``--train-prompts`` training rows are the third prompt set,
so memorisation (training prompts vs held-out) and the anchor-placement gap (random-anchor vs
sequential tau on the same prompts) can be told apart. Every run trains under a time cap: at the cap
it gets SIGTERM, saves at the step boundary and is exported from that checkpoint, so one device call
always ends with every drafter measured. Each run's train log, metrics.jsonl and eval JSON go to
``--out`` (default ``$OUT`` or ./gpu-logs) as they finish; ``summary.json`` and a table come last.

Dry run on a CPU (minutes): ``--recipe tiny-cpu --target builtin:demo-target --data DIR`` with a
small regen file, ``--device cpu``.
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="HF target directory (or builtin:demo-target)")
    parser.add_argument(
        "--data", required=True, type=Path, help="folder with regen.jsonl.gz, heldout_synth.jsonl.gz"
    )
    parser.add_argument("--recipe", default="smollm2-135m")
    parser.add_argument(
        "--run", action="append", default=[], help="NAME|overrides (space-separated key=value); repeatable"
    )
    parser.add_argument("--common", default="", help="overrides given to every run")
    parser.add_argument("--train-seconds", type=int, default=300, help="SIGTERM cap per training run")
    parser.add_argument("--eval-seconds", type=int, default=300, help="cap per eval")
    parser.add_argument("--eval-prompts", type=int, default=128, help="prompts per held-out file (0 = all)")
    parser.add_argument(
        "--train-prompts", type=int, default=64, help="training rows measured as a prompt set"
    )
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--eval-batch-size", type=int, default=128)
    parser.add_argument("--eval-args", default="--baseline ngram", help="extra eval flags for every run")
    parser.add_argument("--max-rows", type=int, default=0, help="train on the first N regen rows (0 = all)")
    parser.add_argument("--device", default="", help="pass --device to eval (cpu for a dry run)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/quality"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-logs"))
    return parser.parse_args()


def read_maybe_gz(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [line for line in handle if line.strip()]


def prepare_data(args: argparse.Namespace) -> dict[str, Path]:
    """Plain JSONL copies in the work folder: the training rows and the three prompt sets."""
    args.work.mkdir(parents=True, exist_ok=True)
    rows = read_maybe_gz(args.data / "regen.jsonl.gz")
    if args.max_rows:
        rows = rows[: args.max_rows]
    files = {"train_rows": args.work / "regen.jsonl", "train_prompts": args.work / "train_prompts.jsonl"}
    files["train_rows"].write_text("".join(rows))
    files["train_prompts"].write_text("".join(rows[: args.train_prompts]))
    heldout = args.work / "heldout_synth.jsonl"
    heldout.write_text("".join(read_maybe_gz(args.data / "heldout_synth.jsonl.gz")))
    files["heldout_synth"] = heldout
    files["handwritten"] = REPO / "evalsets" / "handwritten.jsonl"
    print(f"data: {len(rows)} training rows; prompt sets {', '.join(files)}", flush=True)
    return files


def run_capped(cmd: list[str], log: Path, seconds: int) -> subprocess.Popen:
    """Start ``cmd`` with its output in ``log``; ``wait_capped`` SIGTERMs it at the cap."""
    handle = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    proc.deadline = time.monotonic() + seconds  # type: ignore[attr-defined]
    proc.log = handle  # type: ignore[attr-defined]
    return proc


def wait_capped(procs: dict[str, subprocess.Popen], grace: int = 90) -> dict[str, int]:
    """Wait for every process; past its deadline send SIGTERM (saves and exports), then SIGKILL."""
    codes: dict[str, int] = {}
    termed: dict[str, float] = {}
    while len(codes) < len(procs):
        for name, proc in procs.items():
            if name in codes:
                continue
            code = proc.poll()
            if code is not None:
                codes[name] = code
                proc.log.close()  # type: ignore[attr-defined]
                continue
            now = time.monotonic()
            if name not in termed and now > proc.deadline:  # type: ignore[attr-defined]
                os.killpg(proc.pid, signal.SIGTERM)
                termed[name] = now
            elif name in termed and now > termed[name] + grace:
                os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(1)
    return codes


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "dflash_train.cli", *args]


def train_all(args: argparse.Namespace, runs: list[tuple[str, list[str]]], files: dict[str, Path]) -> dict:
    procs = {}
    for name, overrides in runs:
        cmd = cli(
            "train",
            args.recipe,
            f"target.path={args.target}",
            f"data.paths=[{files['train_rows']}]",
            f"output_dir={args.work / ('run-' + name)}",
            f"data.cache_dir={args.work / ('cache-' + name)}",
            *args.common.split(),
            *overrides,
            "--json",
        )
        print("train:", " ".join(cmd[3:]), flush=True)
        procs[name] = run_capped(cmd, args.out / f"train-{name}.log", args.train_seconds)
    start = time.monotonic()
    codes = wait_capped(procs)
    print(f"training done in {time.monotonic() - start:.0f} s: {codes}", flush=True)
    return codes


def export_dir(args: argparse.Namespace, name: str) -> Path | None:
    """The run's export, made from its newest checkpoint when the time cap stopped it first."""
    run = args.work / f"run-{name}"
    export = run / "export"
    if not (export / "config.json").exists():
        with open(args.out / f"train-{name}.log", "a") as log:
            subprocess.run(
                cli("export", str(run), str(export)), stdout=log, stderr=subprocess.STDOUT, cwd=REPO
            )
    metrics = run / "metrics.jsonl"
    if metrics.exists():
        shutil.copy(metrics, args.out / f"metrics-{name}.jsonl")
    return export if (export / "config.json").exists() else None


def eval_all(
    args: argparse.Namespace, names: list[str], files: dict[str, Path], engine: str = "auto", only=None
) -> dict[str, dict]:
    procs, exports = {}, {}
    for name in names:
        export = export_dir(args, name)
        if export is None:
            print(f"{name}: no export (training failed, see train-{name}.log)", flush=True)
            continue
        exports[name] = export
    prompt_sets = [str(files[k]) for k in ("heldout_synth", "handwritten")]
    for name, export in exports.items():
        for label, prompts, num in (
            ("heldout", prompt_sets, args.eval_prompts),
            ("train", [str(files["train_prompts"])], 0),
        ):
            if only is not None and f"{name}:{label}" not in only:
                continue
            cmd = cli(
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
                str(args.work / f"eval-{name}-{label}"),
                *args.eval_args.split(),
                *(["--device", args.device] if args.device else []),
                "--json",
            )
            procs[f"{name}:{label}"] = run_capped(
                cmd, args.out / f"eval-{name}-{label}.log", args.eval_seconds
            )
    start = time.monotonic()
    wait_capped(procs, grace=10)
    print(f"evals done in {time.monotonic() - start:.0f} s", flush=True)
    reports = {}
    for key in procs:
        log = args.out / f"eval-{key.replace(':', '-')}.log"
        try:
            reports[key] = json.loads(log.read_text().strip().splitlines()[-1])
        except (ValueError, IndexError):
            reports[key] = {"error": log.read_text()[-600:]}
    return reports


def last_train_metrics(args: argparse.Namespace, name: str) -> dict:
    path = args.work / f"run-{name}" / "metrics.jsonl"
    last: dict = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if "tau" in row:
                last = row
    return last


def print_table(args: argparse.Namespace, names: list[str], reports: dict[str, dict]) -> None:
    print(
        f"\n{'run':12} {'step':>5} {'tr_tau':>6} | {'prompts':16} {'tau':>6} {'ngram':>6} {'ratio':>5}  diagnosis"
    )
    for name in names:
        train = last_train_metrics(args, name)
        for label in ("heldout", "train"):
            report = reports.get(f"{name}:{label}", {})
            if "error" in report or not report:
                print(f"{name:12} {label}: eval failed {report.get('error', '')[-200:]!r}")
                continue
            for row in report.get("per_file") or []:
                tau, ngram = row.get("tau") or float("nan"), row.get("ngram_tau") or float("nan")
                diag = {
                    k: v for k, v in row.items() if isinstance(v, float) and k not in ("tau", "ngram_tau")
                }
                diag_text = " ".join(f"{k}={v:.3g}" for k, v in list(diag.items())[:8])
                print(
                    f"{name:12} {train.get('step', '-'):>5} {train.get('tau', float('nan')):6.2f} | "
                    f"{Path(row['file']).stem[:16]:16} {tau:6.3f} {ngram:6.3f} {tau / ngram:5.2f}  {diag_text}"
                )


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for spec in args.run or ["base|"]:
        name, _, overrides = spec.partition("|")
        runs.append((name.strip(), overrides.split()))
    files = prepare_data(args)
    codes = train_all(args, runs, files)
    names = [name for name, _ in runs]
    reports = eval_all(args, names, files)
    failed = [key for key, report in reports.items() if "error" in report]
    if failed:  # the slot engine's first GPU runs: a failure there must not cost the measurements
        print(f"evals failed: {failed}; again on the padded generation engine", flush=True)
        reports.update(eval_all(args, names, files, engine="padded", only=set(failed)))
    summary = {
        "runs": {name: " ".join(o) for name, o in runs},
        "train_exit_codes": codes,
        "train_last": {n: last_train_metrics(args, n) for n in names},
        "eval": reports,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print_table(args, names, reports)


if __name__ == "__main__":
    main()
