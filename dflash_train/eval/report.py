"""What ``dflash-train eval`` shows: progress bars, a table per prompt file and overall, the
lossless verdict, ``eval.json`` and ``acceptance.png``.

The flat result keeps the keys of earlier versions at top level for the overall numbers (``tau``,
``ngram_tau``, ``ddtree_tau``, ``lossless``, ``per_position_acceptance``, ``tokens_per_s``,
``speedup``, ...) and adds ``per_file`` (the same numbers per prompt file), ``divergences``,
``lossless_up_to_ties``, ``timings``, ``tau_mode`` and, in exact mode, ``diagnosis``
(``eval/diagnosis.py``: random-anchor tau, tau inside / outside repetition loops, accuracy after a
rejected round) with ``random_anchor_tau``, ``ngram_overlap_tau`` (``ngram-overlap``: the n-gram
lookup copied on past the text's end) and ``ngram_dflash_tau`` at top level. A key-size sweep
(``--ngram-min-match 3,4,6``) adds its methods ``ngram+dflash@K`` to ``methods`` (overall and per
file), to the tables and to the figure, like every other method.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dflash_train.eval.diagnosis import summarize_diagnosis
from dflash_train.eval.plots import (
    ACCEPTANCE_PNG,
    EVAL_JSON,
    acceptance_title,
    method_label,
    plot_acceptance,
)
from dflash_train.eval.runner import summarize, summarize_plain
from dflash_train.eval.summary import ratio, summarize_rounds
from dflash_train.eval.verdict import divergence_line, verdict_line

# Rows of the printed per-position accuracy of the diagnosis: (group, label).
DIAGNOSIS_ROWS = (
    ("anchors", "every anchor"),
    ("rounds", "every round"),
    ("after_rejection", "after a rejected round"),
    ("other_rounds", "other rounds"),
)


class ProgressBars:
    """tqdm bars on stderr, one per phase or method: prompts done, running tau, ETA."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.bars: dict[str, Any] = {}

    def _bar(self, name: str, total: int):
        if name not in self.bars:
            from tqdm import tqdm

            self.bars[name] = tqdm(
                total=total, desc=f"eval {name}", unit="prompt", file=sys.stderr, disable=not self.enabled
            )
        return self.bars[name]

    def _advance(self, bar, n: int, tau: float | None = None) -> None:
        if tau is not None:
            bar.set_postfix(tau=f"{tau:.3f}", refresh=False)
        bar.update(n)
        # A finished bar is closed at once, so the next phase's bar takes its line instead of nesting.
        if bar.n >= bar.total:
            bar.close()

    def counter(self, name: str, total: int) -> Callable[[int], None]:
        """A callback advancing bar ``name`` by n prompts."""
        return lambda n: self._advance(self._bar(name, total), n)

    def generation_counter(self, name: str, total: int) -> Callable[[int, int], None]:
        """``on_rows(num_prompts, num_tokens)`` for the generation engine: prompts done, rows/s and
        generated tokens/s."""
        started = time.perf_counter()
        generated = 0

        def update(num_rows: int, num_tokens: int) -> None:
            nonlocal generated
            generated += num_tokens
            bar = self._bar(name, total)
            bar.set_postfix(tok_s=round(generated / max(time.perf_counter() - started, 1e-9)), refresh=False)
            self._advance(bar, num_rows)

        return update

    def exact_callback(self, total: int, methods: Sequence[str]) -> Callable[[str, int, float | None], None]:
        """``on_progress(phase, n, tau)`` for ``exact.exact_generations``."""

        def update(phase: str, n: int, tau: float | None) -> None:
            self._advance(self._bar(phase, total), n, tau)

        return update

    def decode_callback(self, total: int, methods: Sequence[str]) -> Callable:
        """``on_prompt(name, generation)`` for ``runner.evaluate``: running tau per method."""
        taus: dict[str, list[float]] = {}

        def update(name: str, generation) -> None:
            tau = None
            if name != "plain" and generation.num_rounds:
                taus.setdefault(name, []).append(generation.tau)
                tau = sum(taus[name]) / len(taus[name])
            self._advance(self._bar(f"decode {name}", total), 1, tau)

        return update

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()


# ----------------------------------------------------------------------------- numbers


def group_numbers(
    indices: Sequence[int], measured: dict, temperature: float, block_size: int
) -> dict[str, Any]:
    """Every method's numbers over the prompts ``indices`` (of the concatenated prompt list)."""
    members = set(indices)
    decoded = [j for j, i in enumerate(measured["decoded"]) if i in members]
    report = measured["decode_report"]
    methods = {}
    baseline_tps = None
    if decoded:
        references = [report["generations"]["plain"][j] for j in decoded]
        baseline_tps = summarize_plain(references)["tokens_per_s"]
    for name, generations in measured["generations"].items():
        numbers = summarize_rounds([generations[i] for i in indices], block_size)
        numbers.pop("per_request_tau")
        numbers.update({"lossless": None, "tokens_per_s": None, "speedup": None})
        if decoded and name in report["generations"]:
            decoded_gens = [report["generations"][name][j] for j in decoded]
            decode = summarize(decoded_gens, references, temperature, block_size)
            numbers.update(
                lossless=decode["lossless"],
                tokens_per_s=decode["tokens_per_s"],
                speedup=ratio(decode["tokens_per_s"], baseline_tps),
            )
        methods[name] = numbers
    diagnoses = measured.get("diagnoses") or []
    return {
        "num_prompts": len(indices),
        "num_decoded": len(decoded),
        "baseline_tokens_per_s": baseline_tps,
        "methods": methods,
        "diagnosis": summarize_diagnosis([diagnoses[i] for i in indices], block_size) if diagnoses else None,
    }


def flat_numbers(group: dict[str, Any]) -> dict[str, Any]:
    """The DFlash chain's numbers at top level, other methods prefixed (the keys of earlier versions)."""
    methods = group["methods"]
    main = methods.get("dflash", {})
    flat = {
        "tau": main.get("tau"),
        "tokens_per_s": main.get("tokens_per_s"),
        "baseline_tokens_per_s": group["baseline_tokens_per_s"],
        "speedup": main.get("speedup"),
        "ngram_tau": methods.get("ngram", {}).get("tau"),
        "ngram_overlap_tau": methods.get("ngram-overlap", {}).get("tau"),
        "ddtree_tau": methods.get("ddtree", {}).get("tau"),
        "ngram_dflash_tau": methods.get("ngram+dflash", {}).get("tau"),
        "random_anchor_tau": (group["diagnosis"] or {}).get("random_anchor_tau"),
        "per_position_acceptance": main.get("per_position_acceptance"),
        "rounds": main.get("rounds"),
        "tokens": main.get("tokens"),
    }
    for name in ("ngram", "ddtree"):
        if name in methods:
            for key in ("lossless", "tokens_per_s", "speedup"):
                flat[f"{name}_{key}"] = methods[name][key]
    return flat


def finish_report(measured: dict, files, options, block_size: int, extra: dict[str, Any]) -> dict[str, Any]:
    """Build the flat result, print tables / divergences / verdict, write the output directory."""
    per_file, start = [], 0
    for f in files:
        group = group_numbers(range(start, start + len(f.prompts)), measured, options.temperature, block_size)
        per_file.append({"file": f.path, "skipped": f.skipped, **group, **flat_numbers(group)})
        start += len(f.prompts)
    overall = group_numbers(range(start), measured, options.temperature, block_size)
    result = {
        **flat_numbers(overall),
        **measured["verdict"],
        "num_prompts": overall["num_prompts"],
        "num_decoded_prompts": overall["num_decoded"],
        **extra,
        "methods": overall["methods"],
        "diagnosis": overall["diagnosis"],
        "divergences": measured["divergences"],
        "timings": {k: round(v, 3) for k, v in measured["timings"].items()},
        "per_file": per_file,
    }
    print_tables(result)
    if options.output_dir:
        result["output_files"] = write_outputs(result, Path(options.output_dir))
    return result


# ----------------------------------------------------------------------------- printing


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_tables(result: dict[str, Any]) -> None:
    """One row per prompt file plus ``overall``: tau per method, tokens, speedup; then the
    per-position acceptance of each method, the divergences and the verdict."""
    methods = list(result["methods"])
    rows = [(f["file"], f) for f in result["per_file"]] + [("overall", result)]
    width = max(len(name) for name, _ in rows)
    columns = [max(10, len(method_label(m)) + 4) for m in methods]
    header = f"{'prompts file':<{width}}  {'prompts':>7}  {'tokens':>8}  " + "  ".join(
        f"{method_label(m) + ' tau':>{c}}" for m, c in zip(methods, columns, strict=True)
    )
    lines = ["", f"eval ({result['tau_mode']} mode, {result['dtype']} on {result['device']})", header]
    for name, row in rows:
        taus = "  ".join(
            f"{_fmt(row['methods'][m]['tau'], 3):>{c}}" for m, c in zip(methods, columns, strict=True)
        )
        speed = f"  speedup {_fmt(row['speedup'])}x" if row.get("speedup") else ""
        lines.append(f"{name:<{width}}  {row['num_prompts']:>7}  {row['tokens'] or 0:>8}  {taus}{speed}")
    if result.get("ngram_dflash_key_sizes"):
        lines.append(key_size_line(result["ngram_dflash_key_sizes"], result["ngram_max_draft"]))
    lines.append("per-position acceptance (block positions 1..B-1):")
    label_width = max(len(method_label(m)) for m in methods)
    for name, row in rows:
        for m in methods:
            accept = " ".join(f"{a:.2f}" for a in row["methods"][m]["per_position_acceptance"])
            lines.append(f"  {name:<{width}}  {method_label(m):<{label_width}} {accept}")
    if result.get("diagnosis"):
        lines += diagnosis_lines(rows, width)
    lines += [divergence_line(d) for d in result["divergences"]]
    lines.append(verdict_line(result))
    timings = ", ".join(f"{k} {v:.1f}s" for k, v in result["timings"].items())
    lines += [f"time: {timings}", ""]
    print("\n".join(lines), flush=True)


def key_size_line(key_sizes: dict[str, int], max_draft: int) -> str:
    """Which ngram-simple key size each lookup-first column of a key-size sweep ran with."""
    columns = ", ".join(f"{method_label(m)} {k}" for m, k in key_sizes.items())
    return f"ngram-simple key size (--spec-ngram-simple-size-n): {columns}; at most {max_draft} tokens per lookup round"


def diagnosis_lines(rows, width: int) -> list[str]:
    """The diagnosis table (pooled over blocks, like the training tau) and the overall teacher-forced
    accuracy by block position of each group."""
    names = ("random-anchor tau", "pooled round tau", "loop rounds", "tau in loops", "tau outside loops")
    lines = [
        "diagnosis of the DFlash drafts (docs/evaluation.md, 'Diagnosis'):",
        f"{'prompts file':<{width}}  " + "  ".join(names),
    ]
    for name, row in rows:
        d = row["diagnosis"]
        fraction = d["loop_round_fraction"]
        values = (
            _fmt(d["random_anchor_tau"], 3),
            _fmt(d["pooled_round_tau"], 3),
            "-" if fraction is None else f"{100 * fraction:.1f}%",
            _fmt(d["tau_in_loops"], 3),
            _fmt(d["tau_outside_loops"], 3),
        )
        lines.append(
            f"{name:<{width}}  " + "  ".join(f"{v:>{len(n)}}" for v, n in zip(values, names, strict=True))
        )
    groups = rows[-1][1]["diagnosis"]["groups"]
    lines.append("teacher-forced accuracy by block position (overall):")
    for group, label in DIAGNOSIS_ROWS:
        accuracy = " ".join(_fmt(a) for a in groups[group]["accuracy_by_pos"])
        lines.append(f"  {label:<22} {accuracy}  ({groups[group]['blocks']} blocks)")
    return lines


def write_outputs(result: dict[str, Any], directory: Path) -> dict[str, str]:
    """``eval.json`` (the full result) and ``acceptance.png`` (eval/plots.py) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    json_path = directory / EVAL_JSON
    json_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    png = plot_acceptance(result["per_file"], directory / ACCEPTANCE_PNG, title=acceptance_title(result))
    return {"eval_json": str(json_path), "acceptance_png": png}
