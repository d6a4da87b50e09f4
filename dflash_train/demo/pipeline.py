"""``dflash-train demo``: a real DFlash drafter trained and evaluated on CPU in minutes.

Six stages, each through the code path a user would run on a real model:

1. target: the embedded hybrid target (``builtin:demo-target``, built on first use and cached);
   ``--quick`` builds a much smaller one under its own cache name instead.
2. rows: "continue this file" chat prompts (``corpus.continuation_prompt``, the wording the target
   was trained on) cut from the held-in stdlib files, at most ``prompt_tokens`` tokens each.
3. regen: the target's greedy replies (``data.regen.run_regen``, i.e. ``dflash-train regen``).
4. train: the drafter, with the real trainer and the ``tiny-cpu`` recipe.
5. export: the serving layout the trainer wrote to ``run/export`` (checked here, and reloaded).
6. eval: exact greedy tau (``eval.exact``) on prompts from the HELD-OUT files, DFlash next to the
   n-gram prompt-lookup baseline, and real speculative decoding of the first few prompts for the
   lossless check (``eval.runner.evaluate``).

Everything lands in ``workdir``: ``data/`` (prompts, regenerated rows, token cache), ``run/``
(config, metrics.jsonl, curves.png, checkpoints, ``export/``), ``acceptance.png`` and
``demo_result.json``.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_train.demo import corpus

# Marks a directory the demo created, so a rerun may clear its own stage outputs (and nothing else).
WORKDIR_MARKER = ".dflash-demo"
RECIPE = "tiny-cpu"


@dataclass(frozen=True, kw_only=True)
class DemoSettings:
    """Sizes of one demo run: ``FULL`` is ``dflash-train demo``, ``QUICK`` is ``--quick``."""

    # Regenerated training rows (the regen stage's cost grows linearly with it).
    num_train_rows: int
    # Held-out prompts for the speculative-decoding eval.
    num_eval_prompts: int
    # Longest prompt, chat header included; with ``reply_tokens`` it stays within the target's
    # 256-token training rows.
    prompt_tokens: int = 128
    # max_new_tokens of regen and eval: 1 + 15 blocks of 8, so eval rounds are whole blocks.
    reply_tokens: int = 121
    # Rows per batched ``generate`` call of the regen stage.
    regen_batch_size: int = 32
    # Extra dotted overrides of the tiny-cpu recipe (e.g. fewer steps for --quick).
    train_overrides: tuple[str, ...] = ()
    # Train a small stand-in target for this many steps (128-token rows) instead of using the shipped
    # builtin (``--quick``); counted in steps, not seconds, so a busy machine builds the same model.
    quick_target_steps: int = 0


FULL = DemoSettings(num_train_rows=2048, num_eval_prompts=21)
QUICK = DemoSettings(
    num_train_rows=64,
    num_eval_prompts=4,
    reply_tokens=57,
    train_overrides=("train.max_steps=40", "checkpoint.every_steps=40", "logging.every_steps=10"),
    quick_target_steps=100,
)
# Wall-clock backstop of the quick target build (about 2 minutes on 2 idle cores). A cap that bites
# leaves a target too undertrained to reply (its first token is <|im_end|>), so it is generous.
QUICK_TARGET_MAX_SECONDS = 900.0


def run_demo(quick: bool = False, workdir: str | Path = "runs/demo") -> dict[str, Any]:
    """Build the target, regenerate rows, train, export and evaluate; return the headline numbers.

    The result holds ``tau`` / ``ngram_tau`` (tokens per target forward of DFlash and of the n-gram
    baseline on held-out files), ``lossless``, ``train_steps``, ``export`` and the stage timings.
    """
    settings = QUICK if quick else FULL
    root = prepare_workdir(Path(workdir))
    timings: dict[str, float] = {}
    started = time.perf_counter()
    say(f"dflash-train demo{' --quick' if quick else ''}: working in {root}")
    with stage("1/6 target", timings):
        target_dir = build_target(settings)
    with stage("2/6 rows", timings):
        rows_path, eval_path = write_prompts(root / "data", target_dir, settings)
    with stage("3/6 regen", timings):
        regen = regenerate(target_dir, rows_path, root / "data" / "regen.jsonl", settings)
    with stage("4/6 train", timings):
        trained = train_drafter(target_dir, Path(regen["output"]), root, settings)
    with stage("5/6 export", timings):
        export_dir = check_export(trained)
    with stage("6/6 eval", timings):
        report = evaluate_drafter(target_dir, export_dir, eval_path, settings)
    timings["total"] = time.perf_counter() - started
    result = summarize(report, trained, regen, timings, root, target_dir, export_dir, quick)
    result["acceptance_png"] = plot_demo_acceptance(report, eval_path, root)
    (root / "demo_result.json").write_text(json.dumps(result, indent=2) + "\n")
    print_summary(result, report)
    return result


# ----------------------------------------------------------------------------- progress


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


@contextlib.contextmanager
def stage(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Print a start and a done line for a stage and record its wall time under its bare name."""
    say(f"{name} ...")
    start = time.perf_counter()
    yield
    seconds = time.perf_counter() - start
    timings[name.split(" ", 1)[1]] = seconds
    say(f"{name} done in {seconds:.1f}s")


def prepare_workdir(root: Path) -> Path:
    """Create ``root`` (or clear the stage outputs of an earlier demo there) and mark it as the demo's.

    The trainer resumes from checkpoints in its output dir and regen skips rows already written, so a
    rerun must start from empty stage directories to measure a whole run.
    """
    root = root.resolve()
    if root.exists() and any(root.iterdir()) and not (root / WORKDIR_MARKER).exists():
        raise ValueError(
            f"--workdir {root} exists and was not made by the demo: pass an empty or new directory"
        )
    for name in ("data", "run", "demo_result.json", "acceptance.png"):
        path = root / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    root.mkdir(parents=True, exist_ok=True)
    (root / WORKDIR_MARKER).write_text(
        "created by `dflash-train demo`; its data/ and run/ are cleared on rerun\n"
    )
    return root


# ----------------------------------------------------------------------------- 1. target


def build_target(settings: DemoSettings) -> Path:
    """The shipped builtin target, or (``--quick``) a small stand-in trained for a few steps."""
    from dflash_train.demo import target_build
    from dflash_train.demo.builtin_targets import builtin_target_path

    if not settings.quick_target_steps:
        path = builtin_target_path("demo-target")
        say(f"target: builtin demo-target at {path}")
        return path
    python = f"py{sys.version_info.major}.{sys.version_info.minor}"
    path = target_build.default_cache_dir() / f"demo-target-quick-{target_build.CACHE_VERSION}-{python}"
    if not (path / "build_info.json").exists():
        say(
            f"target: --quick trains a SMALL stand-in target for {settings.quick_target_steps} steps "
            "(not the shipped demo-target: its greedy output is one repeated line, so the numbers are a "
            "smoke test only)"
        )
        quick = target_build.DemoTargetSettings(
            max_steps=settings.quick_target_steps, seq_len=128, warmup_steps=10
        )
        with contextlib.suppress(FileExistsError):  # another process built it meanwhile
            target_build.build_demo_target(
                path, seconds_budget=QUICK_TARGET_MAX_SECONDS, settings=quick, progress=False
            )
    steps = json.loads((path / "build_info.json").read_text())["steps"]
    if steps < settings.quick_target_steps:
        say(
            f"WARNING: the quick stand-in target trained only {steps} of {settings.quick_target_steps} steps "
            f"(the {QUICK_TARGET_MAX_SECONDS:.0f} s cap of a busy machine): its replies may be empty; "
            f"delete {path} to rebuild it"
        )
    say(f"target: quick stand-in at {path}")
    return path


# ----------------------------------------------------------------------------- 2. rows


def write_prompts(data_dir: Path, target_dir: Path, settings: DemoSettings) -> tuple[Path, Path]:
    """Prompt-only chat rows from the held-in files (to regenerate) and from the held-out files (to
    evaluate), as JSONL ``{"messages": [user turn]}`` that ``regen`` and ``eval`` both read."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    train_rows = continuation_rows(
        corpus.stdlib_files("train"), settings.num_train_rows, tokenizer, settings.prompt_tokens, seed=0
    )
    eval_rows = continuation_rows(
        corpus.stdlib_files("eval"), settings.num_eval_prompts, tokenizer, settings.prompt_tokens, seed=1
    )
    # Similar lengths in one regen batch waste less left padding.
    train_rows.sort(key=lambda row: row[0])
    rows_path, eval_path = data_dir / "prompts.jsonl", data_dir / "eval_prompts.jsonl"
    write_jsonl(rows_path, [messages for _, messages in train_rows])
    write_jsonl(eval_path, [messages for _, messages in eval_rows])
    num_tokens = sum(length for length, _ in train_rows)
    say(
        f"rows: {len(train_rows)} prompts from held-in files ({num_tokens / len(train_rows):.0f} tokens on "
        f"average), {len(eval_rows)} from held-out files"
    )
    return rows_path, eval_path


def continuation_rows(
    files: list[Path], num_rows: int, tokenizer, max_tokens: int, seed: int
) -> list[tuple[int, dict]]:
    """``(prompt tokens, row)`` pairs: a line-aligned prefix of a file as a "continue this file" turn.

    Files are visited round-robin in a seeded order, so even a few rows cover many files; the
    prefix starts at the top of the file a third of the time (as in the target's training rows),
    else at a random line, and takes as many whole lines as fit in ``max_tokens`` prompt tokens.
    """
    rng = random.Random(seed)
    order = list(files)
    rng.shuffle(order)
    texts = {path: corpus.read_source(path).splitlines(keepends=True) for path in order}
    rows = []
    for i in range(num_rows):
        lines = texts[order[i % len(order)]]
        start = 0 if rng.random() < 1 / 3 else rng.randrange(max(1, len(lines) - 8))
        window = lines[start : start + max_tokens]  # a line is at least one token
        count = longest_fitting_prefix(window, tokenizer, max_tokens)
        if count == 0:
            continue  # a single over-long line: skip rather than cut mid-line
        row = {"messages": [{"role": "user", "content": corpus.continuation_prompt("".join(window[:count]))}]}
        rows.append((prompt_length(tokenizer, row), row))
    return rows


def longest_fitting_prefix(lines: list[str], tokenizer, max_tokens: int) -> int:
    """The largest n with the chat prompt of ``lines[:n]`` at most ``max_tokens`` tokens (binary search)."""
    low, high = 0, len(lines)
    while low < high:
        mid = (low + high + 1) // 2
        row = {"messages": [{"role": "user", "content": corpus.continuation_prompt("".join(lines[:mid]))}]}
        if prompt_length(tokenizer, row) <= max_tokens:
            low = mid
        else:
            high = mid - 1
    return low


def prompt_length(tokenizer, row: dict) -> int:
    from dflash_train.eval.prompts import encode_prompt

    return len(encode_prompt(tokenizer, row, thinking=None))


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


# ----------------------------------------------------------------------------- 3. regen


def regenerate(target_dir: Path, rows_path: Path, output: Path, settings: DemoSettings) -> dict[str, Any]:
    """Greedy target replies through ``dflash-train regen``'s own entry point."""
    from dflash_train.data.regen import RegenOptions, run_regen

    # Every option the demo does not set keeps the same default as the CLI (RegenOptions').
    opts = RegenOptions(
        target=str(target_dir),
        data=[str(rows_path)],
        output=str(output),
        max_new_tokens=settings.reply_tokens,
        batch_size=settings.regen_batch_size,
        engine="transformers",
        device="cpu",
    )
    result = run_regen(opts)
    say(
        f"regen: {result['rows_done']} replies of up to {settings.reply_tokens} tokens "
        f"({result['rows_hit_max_new_tokens']} hit the limit) -> {output}"
    )
    return result


# ----------------------------------------------------------------------------- 4. train, 5. export


def train_drafter(target_dir: Path, data_path: Path, root: Path, settings: DemoSettings) -> dict[str, Any]:
    """The real trainer on the ``tiny-cpu`` recipe, pointed at the built target and regenerated rows."""
    from dflash_train.config import load_config
    from dflash_train.train.trainer import train

    overrides = [
        # JSON strings are YAML strings: safe for any path.
        f"target.path={json.dumps(str(target_dir))}",
        f"data.paths=[{json.dumps(str(data_path))}]",
        f"data.cache_dir={json.dumps(str(root / 'data' / 'token-cache'))}",
        f"output_dir={json.dumps(str(root / 'run'))}",
        *settings.train_overrides,
    ]
    cfg = load_config(RECIPE, overrides)
    say(
        f"train: recipe {RECIPE}, block {cfg.drafter.block_size}, feature layers "
        f"{cfg.target.target_layer_ids}, {cfg.train.num_anchors} anchors/row, lr {cfg.train.lr}, "
        f"{cfg.train.max_steps} steps -> {cfg.output_dir}"
    )
    return train(cfg)


def check_export(trained: dict[str, Any]) -> Path:
    """The trainer's serving-layout export; reloaded once to prove it is complete."""
    from dflash_train.models.export import CONFIG_NAME, WEIGHTS_NAME, load_drafter

    if not trained.get("export"):
        raise RuntimeError(f"training stopped at step {trained['step']} before the end: no export written")
    export_dir = Path(trained["export"])
    _, config = load_drafter(export_dir)
    size = (export_dir / WEIGHTS_NAME).stat().st_size
    say(
        f"export: {export_dir} ({CONFIG_NAME} + {WEIGHTS_NAME}, {size / 1e6:.1f} MB, "
        f"{config.num_hidden_layers} layers, block {config.block_size})"
    )
    return export_dir


# ----------------------------------------------------------------------------- 6. eval


# Held-out prompts the eval stage also decodes for real (lossless check); tau comes from exact mode.
DEMO_DECODE_PROMPTS = 3


def evaluate_drafter(target_dir: Path, export_dir: Path, eval_path: Path, settings: DemoSettings) -> dict:
    """Exact greedy tau of the DFlash chain and n-gram lookup on every held-out prompt
    (``eval.exact``), and real speculative decoding of the first few for the lossless check."""
    import torch

    from dflash_train.eval.exact import exact_acceptance
    from dflash_train.eval.generate import greedy_continuations, pad_token_for
    from dflash_train.eval.prompts import load_prompts
    from dflash_train.eval.runner import default_eos_ids, evaluate
    from dflash_train.models.export import load_drafter
    from dflash_train.models.target import load_causal_lm

    target, tokenizer = load_causal_lm(str(target_dir), dtype=torch.float32, device="cpu")
    target, drafter = target.eval(), load_drafter(export_dir, device="cpu", dtype=torch.float32)[0].eval()
    prompts = load_prompts(eval_path, tokenizer)
    eos, methods = default_eos_ids(target, tokenizer), ("dflash", "ngram")
    common = {"max_new_tokens": settings.reply_tokens, "eos_token_ids": eos}
    continuations = greedy_continuations(
        target, prompts, pad_token_id=pad_token_for(tokenizer, eos), batch_size=8, **common
    )
    exact = exact_acceptance(target, drafter, prompts, continuations, methods=methods, **common)
    decoded = evaluate(target, tokenizer, drafter, prompts[:DEMO_DECODE_PROMPTS], methods=methods, **common)
    report = {"methods": {}, "num_prompts": len(prompts), "num_decoded": len(prompts[:DEMO_DECODE_PROMPTS])}
    for name in methods:
        real, simulated = decoded["methods"][name], exact["methods"][name]
        report["methods"][name] = {
            **simulated,
            "lossless": real["lossless"],
            # fp32 on CPU: the decoded prompts' tau must be exactly the simulated one.
            "exact_matches_decode": real["per_request_tau"]
            == simulated["per_request_tau"][: report["num_decoded"]],
        }
    return report


def plot_demo_acceptance(report: dict, eval_path: Path, root: Path) -> str:
    """``root/acceptance.png``: acceptance by block position of DFlash and n-gram (eval/plots.py)."""
    from dflash_train.eval.plots import ACCEPTANCE_PNG, plot_acceptance

    per_file = [{"file": str(eval_path), "methods": report["methods"]}]
    return plot_acceptance(per_file, root / ACCEPTANCE_PNG, title="demo: acceptance by block position")


# ----------------------------------------------------------------------------- summary


def summarize(
    report: dict,
    trained: dict[str, Any],
    regen: dict[str, Any],
    timings: dict[str, float],
    root: Path,
    target_dir: Path,
    export_dir: Path,
    quick: bool,
) -> dict[str, Any]:
    dflash, ngram = report["methods"]["dflash"], report["methods"]["ngram"]
    return {
        "tau": dflash["tau"],
        "ngram_tau": ngram["tau"],
        "lossless": bool(dflash["lossless"] and ngram["lossless"]),
        "exact_matches_decode": bool(dflash["exact_matches_decode"] and ngram["exact_matches_decode"]),
        "num_decoded_prompts": report["num_decoded"],
        "train_steps": trained["step"],
        "export": str(export_dir),
        "train_loss": trained["loss"],
        "train_tau": trained["tau"],
        "per_position_acceptance": [round(x, 3) for x in dflash["per_position_acceptance"]],
        "num_train_rows": regen["rows_done"],
        "num_eval_prompts": report["num_prompts"],
        "eval_tokens": dflash["tokens"],
        "seconds": {name: round(seconds, 1) for name, seconds in timings.items()},
        "quick": quick,
        "target": str(target_dir),
        "run_dir": str(root / "run"),
        "metrics": str(root / "run" / "metrics.jsonl"),
        "curves_png": str(root / "run" / "curves.png"),
        "workdir": str(root),
    }


def print_summary(result: dict[str, Any], report: dict) -> None:
    seconds = result["seconds"]
    stages = ", ".join(f"{name} {value:.0f}s" for name, value in seconds.items() if name != "total")
    lines = [
        "",
        f"DFlash demo{' (--quick smoke run: small stand-in target)' if result['quick'] else ''} "
        f"on {result['num_eval_prompts']} held-out stdlib prompts",
        f"  tau (tokens per target forward, block {len(result['per_position_acceptance']) + 1}): DFlash {result['tau']:.2f}  vs  n-gram {result['ngram_tau']:.2f}",
        f"  lossless (identical to plain greedy decoding, {result['num_decoded_prompts']} prompts decoded): "
        f"{result['lossless']}; exact-mode tau == decoded tau there: {result['exact_matches_decode']}",
        f"  trained {result['train_steps']} steps on {result['num_train_rows']} regenerated rows "
        f"(final loss {result['train_loss']:.3f}, training tau {result['train_tau']:.2f})",
        f"  time: {seconds['total']:.0f}s total ({stages})",
        f"  exported drafter: {result['export']}",
        f"  run logs: {result['metrics']} (config.yaml and checkpoints beside it)",
        f"  plots: {result['curves_png']} (training curves), {result['acceptance_png']} (acceptance by "
        f"block position); `dflash-train plot {result['run_dir']}` redraws the curves",
        "",
    ]
    print("\n".join(lines), flush=True)
