"""Synthesize prompts with a real target, regenerate them, report rows/s, bring the rows back gzipped.

    python3 scripts/gpu_synth_regen.py --target /path/to/smollm2 --out-dir "$OUT" \
        --num-rows 20000 --synth-batch-size 512 --regen-rows 12000 --regen-batch-size 512 --max-new-tokens 512

Each stage runs as resumed calls of --step-rows rows; no call starts that would end after --budget-s
(so one device command of at most 10 minutes always writes its outputs; run it again to continue).
Working files (plain JSONL, resumable: rerunning with the same --work-dir continues both stages) go
to --work-dir (git-ignored ``runs/``, kept on a warm device machine between commands); --out-dir receives ``prompts.jsonl.gz`` / ``regen.jsonl.gz`` (split into
``.partNN.jsonl.gz`` files when one would pass --max-part-mib), ``regen.failed.jsonl`` when rows
failed, and ``summary.json`` with both stages' results (rows/s, filter counts, elapsed seconds).
Needs torch and transformers only (no ``datasets``, no network).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_train.data.regen import RegenOptions, run_regen  # noqa: E402
from dflash_train.data.synth import SynthOptions, run_synth  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="HF directory of the real target")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--work-dir", default="runs/synth-regen", help="git-ignored, so it survives between runs")
    p.add_argument("--stages", default="synth,regen", help="synth, regen or both (each resumes its output)")
    p.add_argument("--num-rows", type=int, default=20000, help="prompts kept after the filters")
    p.add_argument("--synth-batch-size", type=int, default=512)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.99)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--regen-rows", type=int, default=0, help="prompts to regenerate (0 = all)")
    p.add_argument("--regen-batch-size", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--max-part-mib", type=float, default=15.0, help="largest gzip file brought back")
    p.add_argument(
        "--step-rows", type=int, default=4096, help="rows per resumed call (budget checks between)"
    )
    p.add_argument("--budget-s", type=float, default=480.0, help="start no call that would end after this")
    return p.parse_args()


def gzip_parts(source: Path, out_dir: Path, max_mib: float) -> list[str]:
    """``source`` gzipped into ``out_dir``; rolled over into numbered parts before ``max_mib``."""
    limit, names, part, out, raw = int(max_mib * 2**20 * 0.9), [], 0, None, None
    with open(source, "rb") as lines:
        for line in lines:
            if out is None:
                names.append(f"{source.stem}.part{part:02d}.jsonl.gz")
                raw = open(out_dir / names[-1], "wb")
                out = gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9)
            out.write(line)
            if raw.tell() >= limit:  # compressed bytes flushed so far; the margin covers the rest
                out.close(), raw.close()
                out, part = None, part + 1
    if out is not None:
        out.close(), raw.close()
    if len(names) == 1:  # one file: the plain name
        (out_dir / names[0]).rename(out_dir / f"{source.name}.gz")
        names = [f"{source.name}.gz"]
    return names


def in_steps(run_once, total: int, step: int, budget_end: float, done_key: str) -> dict:
    """Call ``run_once(limit)`` for limit = step, 2*step, ... up to ``total`` while the time budget
    allows another call as long as the last one (each call resumes the previous; equal results)."""
    calls, limit = [], 0
    while True:
        limit = min(total, max(limit, calls[-1][done_key] if calls else 0) + step)
        start = time.perf_counter()
        calls.append(run_once(limit))
        last_s = time.perf_counter() - start
        print(json.dumps(calls[-1]), flush=True)
        if limit >= total or calls[-1].get("complete") is False or time.perf_counter() + last_s > budget_end:
            break
    merged = dict(calls[-1])
    new_key = "rows_new" if "rows_new" in merged else "rows_done"
    for key in (new_key, "rows_hit_max_new_tokens"):  # per-call counts; the rest is cumulative
        if key in merged:
            merged[key] = sum(c[key] for c in calls)
    merged["elapsed_s"] = round(sum(c["elapsed_s"] for c in calls), 2)
    merged["rows_per_s"] = round(merged[new_key] / merged["elapsed_s"], 2) if merged["elapsed_s"] else 0.0
    merged["calls"] = len(calls)
    return merged


def main() -> int:
    args = parse_args()
    import torch
    import transformers

    work, out_dir = Path(args.work_dir), Path(args.out_dir)
    work.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts, regen = work / "prompts.jsonl", work / "regen.jsonl"
    t0, stages = time.perf_counter(), args.stages.split(",")
    budget_end = t0 + args.budget_s
    synth = regenerated = None
    if "synth" in stages:

        def synth_once(limit: int) -> dict:
            opts = SynthOptions(
                target=args.target,
                output=str(prompts),
                num_rows=limit,
                temperature=args.temperature,
                top_p=args.top_p,
                max_prompt_tokens=args.max_prompt_tokens,
                seed=args.seed,
                batch_size=args.synth_batch_size,
            )
            return run_synth(opts)

        synth = in_steps(synth_once, args.num_rows, args.step_rows, budget_end, "rows")
        print("synth:", json.dumps(synth), flush=True)
    if "regen" in stages and prompts.is_file():
        available = sum(1 for _ in open(prompts, "rb"))
        total = min(args.regen_rows or available, available)

        def regen_once(limit: int) -> dict:
            opts = RegenOptions(
                target=args.target,
                data=[str(prompts)],
                output=str(regen),
                max_new_tokens=args.max_new_tokens,
                batch_size=args.regen_batch_size,
                max_rows=limit,
                engine="transformers",
            )
            result = run_regen(opts)
            return result | {"rows": result["rows_done"] + result["rows_skipped"]}

        regenerated = in_steps(regen_once, total, args.step_rows, budget_end, "rows")
        print("regen:", json.dumps(regenerated), flush=True)
        failed = Path(regenerated["failed_output"])
        if failed.is_file() and failed.stat().st_size:
            shutil.copy(failed, out_dir / failed.name)
    files = {p.name: gzip_parts(p, out_dir, args.max_part_mib) for p in (prompts, regen) if p.is_file()}
    summary = {
        "synth": synth,
        "regen": regenerated,
        "files": files,
        "total_s": round(time.perf_counter() - t0, 1),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "args": vars(args),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
