"""What each step of scripts/gpu_figures.py reads from its bench JSON or log (``*_figures``) and the
one line the table prints for it (``*_line``)."""

from __future__ import annotations

import re


def train_figures(result: dict | None, log: str) -> dict:
    """The train step's figures, its compile report included."""
    if result is None:
        return {}
    kernels = result.get("target_kernels", {})
    keys = ("tokens_per_s", "step_s", "target_s", "drafter_s", "optimizer_s", "mfu", "peak_mem_gb")
    compiles = ("warmup_s", "compiled_graphs_warmup", "compiled_graphs_timed", "eager_fallbacks")
    return {
        **{key: result[key] for key in keys + compiles},
        "target_fp8": result["target_fp8"],
        "compile": kernels.get("compile", "not reported"),
        "linear": kernels.get("linear", "bf16"),
        "device": result["device"],
    }


def checkpoint_figures(result: dict | None, log: str) -> dict:
    """Per save mode: each save's stall and wall time, the peak host RSS, the bytes on disk (or the error)."""
    if result is None:
        return {}
    figures = {}
    for mode, outcome in result["modes"].items():
        if "error" in outcome or "not_run" in outcome:
            figures[mode] = {"error": outcome.get("error") or f"not run: {outcome['not_run']}"}
            continue
        saves = outcome["saves"]
        figures[mode] = {
            "stall_s": [save["stall_s"] for save in saves],
            "wall_s": [save["wall_s"] for save in saves],
            "peak_rss_gib": max(save["peak_rss_gib"] for save in saves),
            "checkpoint_bytes": saves[-1]["checkpoint_bytes"],
        }
    return figures


def lengths_figures(result: dict | None, log: str) -> dict:
    """Per mode (buckets, packing): real and batch tokens/s, padding waste, and the compile counts."""
    if result is None:
        return {}
    keys = (
        "real_tokens_per_s", "batch_tokens_per_s", "padding_waste_timed", "padding_waste_epoch",
        "conversations_per_row", "step_s", "warmup_s", "compiled_graphs_timed", "eager_fallbacks",
    )  # fmt: skip
    modes = {mode: {k: values[k] for k in keys} for mode, values in result["modes"].items()}
    compile_report = result.get("target_kernels", {}).get("compile", "not reported")
    return {**modes, "packing_speedup": result["packing_speedup"], "compile": compile_report}


def generation_figures(result: dict | None, log: str) -> dict:
    """Rows/s of each engine, each decode-attention kernel's time per shape, each top-p draw's time."""
    if result is None:
        return {}
    run_keys = ("status", "rows_per_s", "generated_tokens_per_s", "warmup_decode_compile_s")
    return {
        "runs": {r["engine"]: {k: r.get(k) for k in run_keys} for r in result["runs"]},
        "attention": [
            {
                k: v
                for k, v in a.items()
                if k.endswith(("_ms", "_error")) or k in ("slots", "kv", "bucket_mb", "live_mb", "status")
            }
            for a in result["attention"]
        ],
        "sampler": [
            {
                k: v
                for k, v in a.items()
                if k.endswith(("_ms", "_error")) or k in ("rows", "vocab", "speedup", "status")
            }
            for a in result["sampler"]
        ],
        "device": result["device"],
    }


def checkpoint_errors(result: dict | None) -> list[str]:
    """Each save mode whose child recorded an error (a mode not run, the pinned one without CUDA, is
    recorded in the figures as not run, not counted here)."""
    if result is None:
        return []
    return [
        f"{mode}: {outcome['error']}"
        for mode, outcome in result.get("modes", {}).items()
        if "error" in outcome
    ]


def generation_errors(result: dict | None) -> list[str]:
    """Each top-p shape, attention shape, engine run, agreement or profile whose record holds an
    error (a status other than ``ok``), and each draw or kernel that failed inside an ``ok`` shape."""
    if result is None:
        return []
    labels = {
        "sampler": lambda r: f"sampler {r.get('rows')}x{r.get('vocab')}",
        "attention": lambda r: f"attention {r.get('slots')}x{r.get('kv')}",
        "runs": lambda r: f"{r.get('engine')} x{r.get('batch_size')}",
        "agreement": lambda r: f"agreement {r.get('engine')} vs {r.get('reference')} x{r.get('batch_size')}",
        "profiles": lambda r: f"profile x{r.get('batch_size')}",
    }
    errors = []
    for part, label in labels.items():
        for record in result.get(part, []):
            if record.get("status", "ok") != "ok":
                errors.append(f"{label(record)}: {record['status']}")
            failed = [key for key in record if key.endswith("_error")]
            errors += [f"{label(record)} {key.removesuffix('_error')}: {record[key]}" for key in failed]
    return errors


def pytest_figures(result: dict | None, log: str) -> dict:
    """Counts of pytest's last summary line (``27 passed, 1 failed in 407.12s``) and the failed tests."""
    summaries = [line for line in log.splitlines() if re.search(r"\b\d+ \w+.* in [\d.]+s\b", line)]
    if not summaries:
        return {}
    counts = {word: int(n) for n, word in re.findall(r"(\d+) ([a-z]+)", summaries[-1].split(" in ")[0])}
    duration = re.search(r" in ([\d.]+)s", summaries[-1])
    failed = [line.split(" - ")[0] for line in log.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    return {
        "counts": counts,
        "pytest_s": float(duration.group(1)),
        "failed": failed[:20],
        "summary": summaries[-1].strip("= "),
    }


def train_line(figures: dict) -> str:
    return (
        f"{figures['tokens_per_s']:,.0f} tok/s, step {figures['step_s'] * 1e3:,.0f} ms "
        f"(target {figures['target_s'] * 1e3:,.0f}), MFU {figures['mfu']:.1%}, {figures['peak_mem_gb']:.1f} GB; "
        f"compile: {figures['compile']}; timed compiles {figures['compiled_graphs_timed']}, "
        f"eager fallbacks {figures['eager_fallbacks']}"
    )


def checkpoint_line(figures: dict) -> str:
    parts = []
    for mode, values in figures.items():
        if "error" in values:
            parts.append(f"{mode} {values['error'][:60]}")
        else:
            stalls = "/".join(f"{s:.1f}" for s in values["stall_s"])
            walls = "/".join(f"{s:.1f}" for s in values["wall_s"])
            parts.append(
                f"{mode} stall {stalls} s, wall {walls} s, {values['checkpoint_bytes'] / 2**30:.1f} GiB, "
                f"RSS {values['peak_rss_gib']:.1f} GiB"
            )
    return "; ".join(parts)


def lengths_line(figures: dict) -> str:
    modes = [
        f"{mode} {figures[mode]['real_tokens_per_s']:,.0f} real tok/s (waste {figures[mode]['padding_waste_timed']:.1%})"
        for mode in ("buckets", "packing")
    ]
    return "; ".join(modes) + f"; packing x{figures['packing_speedup']:.2f}"


def generation_line(figures: dict) -> str:
    runs = [
        f"{engine} {values['rows_per_s']} rows/s"
        if values["status"] == "ok"
        else f"{engine} {values['status'][:80]}"
        for engine, values in figures["runs"].items()
    ]
    attention = [
        f"{a['slots']}x{a['kv']} grouped {kernel_time(a, 'grouped_compiled')} / flex {kernel_time(a, 'flex')}"
        if a.get("status") == "ok"
        else f"{a['slots']}x{a['kv']} {str(a.get('status'))[:80]}"
        for a in figures["attention"]
    ]
    return "; ".join(runs + attention)


def kernel_time(record: dict, kernel: str) -> str:
    """One kernel's time in an attention record, or its error."""
    if f"{kernel}_ms" in record:
        return f"{record[f'{kernel}_ms']} ms"
    if f"{kernel}_error" in record:
        return f"failed ({record[f'{kernel}_error'][:60]})"
    return "-"


def pytest_line(figures: dict) -> str:
    return figures["summary"]
