"""The GPU figures still owed (docs/performance.md, "Owed GPU figures"), each a ``dflash-train bench``
command or the GPU test suite, run one after another under its own time limit:

    python3 scripts/gpu_figures.py --steps train-bf16,train-fp8       # one device call per group

Steps (``--steps``, in the order given; default all):
  train-bf16     ``bench train --preset qwen3.6-27b``: the 4K step of the 62-layer target (bench
                 builds the target up to its last feature layer) with its compile report
                 (``target_kernels.compile``, graphs compiled in the timed steps, eager fallbacks)
  train-fp8      the same with ``--target-fp8`` (torchao must be importable)
  checkpoint     ``bench checkpoint --preset qwen3.6-27b --saves 2``: stall, wall time, host RSS and
                 bytes per save of gather, dcp-sync and dcp-async, on ``--work``'s disk
  lengths-short  ``bench lengths short-chat --preset qwen3.6-27b``: buckets against packing, real
  lengths-mixed  tokens/s and padding waste (mixed-chat for the second)
  generation     ``bench generation --preset smollm2-135m`` at 1,024 slots: the compiled step with the
                 grouped attention against flex over live blocks (rows/s), one layer's decode
                 attention alone per kernel (``--attention-shapes``) and the top-p draw alone
                 (``--sampler-shapes``), the generation issue's open figures
  gpu-tests      ``python3 -m pytest -v -rfE -m gpu TESTS``: pass/fail counts and wall time; ``--tests``
                 (default ``tests``) picks files, so the suite can span calls (on an H100 its first 22
                 tests took the whole 540 s): ``--tests tests/test_[a-m]*.py``, then ``[n-z]``.
                 Verbose, so a log cut at the limit still names every test that finished

Each step runs in its own process group, killed at its limit: its ``--timeout-s`` (default: the
step's own, ``STEPS``), cut to what is left of ``--budget-s`` (a device call's 10 minutes, less a
margin); a step that no longer fits is recorded as not run. Under ``--out`` (default ``$OUT`` or
./gpu-logs): ``gpu_figures.json`` (each step's command, status, exit code, wall time, the bench's
JSON and its figures), rewritten before and after every step so a call cut short still returns the
finished steps (and ``running`` for the cut one), ``STEP.log`` per step, and ``table.txt``, the
table printed last. A step whose bench exited 0 but recorded errors in its JSON (an engine, a kernel,
a save mode) is ``partial``, its errors listed under ``errors``. Exit code 0 when every step ran and
passed, else 1. The header names the commit and the source digest (``source_digest``;
``--print-source-digest`` prints a local tree's).

Dry run on a CPU (the wiring end to end in about a minute, numbers meaningless): ``--dry-run`` runs
every step at the tiny presets on the CPU (``train-fp8`` without ``--target-fp8``: FP8 needs CUDA
sm89+), and ``gpu-tests`` on one test file, whose GPU tests skip.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_figure_readers import (  # noqa: E402
    checkpoint_errors,
    checkpoint_figures,
    checkpoint_line,
    generation_errors,
    generation_figures,
    generation_line,
    lengths_figures,
    lengths_line,
    pytest_figures,
    pytest_line,
    train_figures,
    train_line,
)

REPO = Path(__file__).resolve().parents[1]
RESULTS = "gpu_figures.json"
# A step starts only with at least this many seconds of the budget left.
MIN_STEP_S = 30.0
# After SIGTERM to a step's process group, seconds before SIGKILL.
KILL_GRACE_S = 10.0
# What the figures were measured with: these folders' files, named by their content.
SOURCE_FOLDERS = ("dflash_train", "scripts")


@dataclass(frozen=True)
class Step:
    """One figure: its command (real or dry run, given the step's limit), its default limit, how its
    figures are read (from the bench's JSON result, or the log) and written as one table line, and
    the errors its bench recorded inside its JSON result (failed engines, kernels, save modes)."""

    command: Callable[[argparse.Namespace, float], list[str]]
    timeout_s: float
    figures: Callable[[dict | None, str], dict]
    line: Callable[[dict], str]
    note_dry_run: str = ""
    errors: Callable[[dict | None], list[str]] = lambda result: []


def bench(mode: str, *args: str) -> Callable[[argparse.Namespace, float], list[str]]:
    """A ``dflash-train bench MODE`` command with ``--json``, no bar and the step's limit per bench step."""

    def command(options: argparse.Namespace, limit_s: float) -> list[str]:
        shape = DRY_RUN_SHAPES[mode] if options.dry_run else REAL_SHAPES[mode]
        extra = [a for a in args if not (options.dry_run and a == "--target-fp8")]
        scratch = ["--dir", str(options.work / "checkpoint")] if mode == "checkpoint" else []
        if mode == "generation":  # its JSON beside the step's log, not in the working directory
            scratch = ["--out", str(options.out / "generation_bench.json")]
        return [
            sys.executable, "-m", "dflash_train.cli", "bench", mode, *extra, *shape, *scratch,
            "--json", "--no-progress", "--step-timeout-s", f"{limit_s:.0f}",
        ]  # fmt: skip

    return command


# Per mode: the shape of the owed figure, and the tiny CPU shape of the dry run.
REAL_SHAPES = {
    "train": ["--preset", "qwen3.6-27b"],
    "checkpoint": ["--preset", "qwen3.6-27b", "--saves", "2"],
    "lengths": ["--preset", "qwen3.6-27b", "--steps", "30", "--warmup", "2"],
    "generation": [
        "--preset", "smollm2-135m", "--num-prompts", "1024", "--batch-sizes", "1024", "--max-new-tokens", "256",
        "--engines", "slots-grouped-compiled,slots-flex-compiled", "--sampler-shapes", "1024x49152,64x248320",
        "--attention-shapes", "1024x256,1024x512,1024x1024,256x2048",
    ],
}  # fmt: skip
DRY_RUN_SHAPES = {
    "train": ["--preset", "tiny", "--steps", "1", "--warmup", "1", "--device", "cpu"],
    "checkpoint": ["--preset", "tiny", "--saves", "1", "--device", "cpu"],
    "lengths": ["--preset", "tiny", "--steps", "2", "--warmup", "0", "--device", "cpu"],
    "generation": [
        "--preset", "tiny-qwen3", "--device", "cpu", "--num-prompts", "3", "--batch-sizes", "2",
        "--max-new-tokens", "8", "--engines", "slots-uncompiled,slots-flex", "--sampler-shapes", "3x256",
        "--attention-shapes", "3x256",
    ],
}  # fmt: skip


def gpu_tests(options: argparse.Namespace, limit_s: float) -> list[str]:
    where = ["tests/test_target_fp8.py"] if options.dry_run else options.tests
    return [sys.executable, "-m", "pytest", "-v", "-rfE", "-m", "gpu", *where]


# ----------------------------------------------------------------------------- figures per step


STEPS: dict[str, Step] = {
    "train-bf16": Step(bench("train"), 270, train_figures, train_line),
    "train-fp8": Step(
        bench("train", "--target-fp8"), 270, train_figures, train_line,
        note_dry_run="--target-fp8 dropped (FP8 needs CUDA sm89+)",
    ),
    "checkpoint": Step(
        bench("checkpoint"), 540, checkpoint_figures, checkpoint_line, errors=checkpoint_errors
    ),
    "lengths-short": Step(bench("lengths", "short-chat"), 540, lengths_figures, lengths_line),
    "lengths-mixed": Step(bench("lengths", "mixed-chat"), 540, lengths_figures, lengths_line),
    "generation": Step(
        bench("generation"), 540, generation_figures, generation_line, errors=generation_errors
    ),
    "gpu-tests": Step(gpu_tests, 540, pytest_figures, pytest_line),
}  # fmt: skip


# ----------------------------------------------------------------------------- running the steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of: {', '.join(STEPS)}")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-logs"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu-figures"), help="checkpoint scratch")
    parser.add_argument("--timeout-s", type=float, default=0, help="each step's limit (0 = the step's own)")
    parser.add_argument(
        "--budget-s", type=float, default=570, help="all steps together (a device call: 600 s); 0 = none"
    )
    parser.add_argument("--dry-run", action="store_true", help="tiny presets on the CPU (see the header)")
    parser.add_argument("--tests", nargs="+", default=["tests"], help="gpu-tests: test files or folders")
    parser.add_argument(
        "--print-source-digest", action="store_true", help="print the header's 'source' and exit"
    )
    args = parser.parse_args(argv)
    args.steps = [name.strip() for name in args.steps.split(",") if name.strip()]
    unknown = [name for name in args.steps if name not in STEPS]
    if unknown or not args.steps:
        parser.error(f"--steps {','.join(unknown) or '(none)'}: use names from {', '.join(STEPS)}")
    if len(set(args.steps)) != len(args.steps):
        parser.error(f"--steps {','.join(args.steps)}: a step is named twice")
    if args.timeout_s < 0 or args.budget_s < 0:
        parser.error("--timeout-s and --budget-s must be >= 0 (0: the step's own limit / no budget)")
    return args


def run_step(name: str, args: argparse.Namespace, limit_s: float) -> dict:
    """Run one step in its own process group, its output in ``STEP.log``; killed at ``limit_s`` (or
    when this script is stopped)."""
    step = STEPS[name]
    command = step.command(args, limit_s)
    log_path = args.out / f"{name}.log"
    started = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
        )
        try:
            timed_out = wait_or_kill(proc, limit_s)
        finally:  # a SIGTERM to this script must not leave the step's processes running
            if proc.poll() is None:
                end_group(proc)
        if timed_out:
            log.write(f"\n[killed at its {limit_s:.0f} s limit]\n")
    text = log_path.read_text(errors="replace")
    result = last_json_object(text)
    record = {
        "command": command,
        "status": "timeout" if timed_out else ("ok" if proc.returncode == 0 else "failed"),
        "rc": proc.returncode,
        "wall_s": round(time.monotonic() - started, 1),
        "log": log_path.name,
        "result": result,
    }
    try:  # a result without a key the table reads is recorded, not a reason to stop the other steps
        record["figures"] = step.figures(result, text)
    except (KeyError, TypeError, ValueError) as err:
        record["figures"], record["figures_error"] = {}, f"{type(err).__name__}: {err}"
    errors = step.errors(result)
    if errors:  # figures the bench did not measure: an exit code of 0 does not make the step ok
        record["errors"] = errors
        record["status"] = "partial" if record["status"] == "ok" else record["status"]
    if args.dry_run and step.note_dry_run:
        record["dry_run_note"] = step.note_dry_run
    if record["status"] != "ok":
        record["log_tail"] = text.splitlines()[-15:]
    return record


def wait_or_kill(proc: subprocess.Popen, limit_s: float) -> bool:
    """Wait for ``proc``; past ``limit_s`` end its whole process group. Returns whether it was killed."""
    try:
        proc.wait(timeout=limit_s)
        return False
    except subprocess.TimeoutExpired:
        end_group(proc)
        return True


def end_group(proc: subprocess.Popen) -> None:
    """SIGTERM to ``proc``'s process group (the bench's own children too), SIGKILL after a grace."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the group is already gone
            break
        try:
            proc.wait(timeout=KILL_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def last_json_object(text: str) -> dict | None:
    """The last line of ``text`` that is a JSON object (a bench's ``--json`` result), or None."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return None


def source_digest(root: Path = REPO) -> str:
    """The first 12 hex digits of a SHA-256 over the relative paths and contents of every file under
    ``SOURCE_FOLDERS`` (bytecode caches left out): the code a figure was measured with, named by its
    content. The device machine's copy of the git history can lag the tree it was sent (its HEAD
    named an older commit), so the commit alone does not say; ``--print-source-digest`` prints the
    same digest for a local tree to compare."""
    digest = hashlib.sha256()
    for folder in SOURCE_FOLDERS:
        for path in sorted((root / folder).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts or path.suffix == ".pyc":
                continue
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def header(args: argparse.Namespace) -> dict:
    """Where and with what the figures were measured."""
    commit = subprocess.run(
        ["git", "log", "-1", "--format=%h %cs"], cwd=REPO, capture_output=True, text=True, check=False
    )
    versions = {}
    for package in ("torch", "transformers", "fla-core", "torchao"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "commit": commit.stdout.strip() or "unknown (no git checkout here)",
        "source": source_digest(),
        "dry_run": args.dry_run,
        "versions": versions,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def write_results(args: argparse.Namespace, results: dict) -> None:
    """``gpu_figures.json`` under --out, replaced whole (never half-written)."""
    path = args.out / RESULTS
    path.with_suffix(".tmp").write_text(json.dumps(results, indent=1))
    os.replace(path.with_suffix(".tmp"), path)


def step_limit(args: argparse.Namespace, name: str, started: float) -> float | None:
    """This step's limit: its own (or --timeout-s) cut to the budget left; None when it does not fit."""
    limit = args.timeout_s or STEPS[name].timeout_s
    if not args.budget_s:
        return limit
    left = args.budget_s - (time.monotonic() - started)
    return None if left < MIN_STEP_S else min(limit, left)


def run_steps(args: argparse.Namespace, results: dict) -> None:
    """Every step of ``args.steps`` in order, recorded in ``results``; the results file is rewritten
    before and after each."""
    started = time.monotonic()
    for name in args.steps:
        limit = step_limit(args, name, started)
        if limit is None:
            reason = f"under {MIN_STEP_S:.0f} s of --budget-s {args.budget_s:.0f} left"
            results["steps"][name] = {"status": "not run", "reason": reason}
            continue
        results["steps"][name] = {"status": "running", "limit_s": limit}
        if name == "checkpoint":
            results["steps"][name]["disk_free_gib"] = round(shutil.disk_usage(args.work).free / 2**30, 1)
        write_results(args, results)
        results["steps"][name] |= run_step(name, args, limit)
        write_results(args, results)


# ----------------------------------------------------------------------------- the table


def step_line(name: str, record: dict) -> str:
    """One table line: the step, its status and wall time, and its figures in short."""
    if record.get("figures"):
        text = STEPS[name].line(record["figures"])
    elif "reason" in record:
        text = record["reason"]
    else:
        text = (record.get("log_tail") or ["no output"])[-1][:120]
    wall = f"{record['wall_s']:.0f} s" if "wall_s" in record else "-"
    return f"{name:14} {record['status']:8} {wall:>7}  {text}"


def table(results: dict) -> str:
    dry_run = " (dry run: tiny presets on the CPU, numbers meaningless)" if results["dry_run"] else ""
    names = f"commit {results['commit']}, source {results['source']}"
    lines = [f"gpu figures, {names}, started {results['started']}{dry_run}"]
    lines += [step_line(name, record) for name, record in results["steps"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.print_source_digest:
        print(source_digest())
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    results = {**header(args), "steps": {}}
    # A SIGTERM to this script (a caller's limit) ends the step running and still writes the table.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        run_steps(args, results)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for record in results["steps"].values():
            if record["status"] == "running":
                record |= {"status": "stopped", "reason": "this script was stopped during the step"}
        write_results(args, results)
        # The bench deletes its checkpoints itself; a killed one may not have.
        shutil.rmtree(args.work / "checkpoint", ignore_errors=True)
        text = table(results)
        (args.out / "table.txt").write_text(text + "\n")
        print(text, flush=True)
    return 0 if all(r["status"] == "ok" for r in results["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
