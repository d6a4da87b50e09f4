"""``acceptance.png``: acceptance by block position, every method (DFlash, n-gram, DDTree, ...) in
one panel per prompt file.

Drawn by ``dflash-train eval --output-dir`` beside ``eval.json``, by the demo, and again by
``dflash-train plot DIR`` from ``DIR/eval.json``. Figures are rendered with matplotlib's Agg canvas
directly (no pyplot): no display, no global backend switch in the caller's process.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ACCEPTANCE_PNG = "acceptance.png"
EVAL_JSON = "eval.json"
METHOD_LABELS = {
    "dflash": "DFlash",
    "ngram": "n-gram",
    "ngram-overlap": "n-gram-overlap",
    "ngram+dflash": "n-gram+DFlash",
    "ddtree": "DDTree",
    "ngram-simple": "ngram-simple",
}
METHOD_STYLES = {
    "dflash": "-",
    "ngram": ":",
    "ngram-overlap": ":",
    "ngram+dflash": "-.",
    "ddtree": "--",
    "ngram-simple": ":",
}
# One color per method in every panel (matplotlib's first cycle colors).
METHOD_COLORS = {
    "dflash": "C0",
    "ngram": "C1",
    "ddtree": "C2",
    "ngram+dflash": "C3",
    "ngram-simple": "C4",
    "ngram-overlap": "C5",
}
PANEL_COLUMNS = 3


def method_label(method: str) -> str:
    """A method's printed name: ``METHOD_LABELS``', with the key-size sweep's ``@K`` kept
    (``ngram+dflash@6`` -> ``n-gram+DFlash@6``)."""
    base, at, key_size = method.partition("@")
    return METHOD_LABELS.get(base, base) + at + key_size


def method_styles(methods: Sequence[str]) -> dict[str, dict[str, str]]:
    """Line style and color of each method: a sweep's ``ngram+dflash@K`` draws in ``ngram+dflash``'s
    line style, each in a color of its own after the fixed ones (C5, C6, ...), so that a panel tells
    the key sizes apart."""
    styles, num_extra = {}, 0
    for method in methods:
        color = METHOD_COLORS.get(method)
        if color is None:
            color, num_extra = f"C{len(METHOD_COLORS) + num_extra}", num_extra + 1
        styles[method] = {"linestyle": METHOD_STYLES.get(method.partition("@")[0], "-"), "color": color}
    return styles


def plot_acceptance(per_file: Sequence[dict[str, Any]], path: str | Path, *, title: str) -> str:
    """Write ``acceptance_figure(per_file)`` to ``path``; returns the path."""
    acceptance_figure(per_file, title=title).savefig(path, dpi=110)
    return str(path)


def acceptance_figure(per_file: Sequence[dict[str, Any]], *, title: str):
    """One panel per entry of ``per_file``, one line per method.

    Each entry is ``{"file": name, "methods": {method: {"per_position_acceptance": [...], "tau": x}}}``
    (``eval.json``'s ``per_file``).
    """
    from matplotlib.figure import Figure

    if not per_file:
        raise ValueError("plot_acceptance: no prompt file to draw")
    columns = min(PANEL_COLUMNS, len(per_file))
    rows = math.ceil(len(per_file) / columns)
    fig = Figure(figsize=(4.8 * columns, 3.6 * rows + 0.6))
    axes = fig.subplots(rows, columns, squeeze=False).flatten()
    for ax, entry in zip(axes, per_file, strict=False):
        draw_file_panel(ax, entry)
    for ax in axes[len(per_file) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def draw_file_panel(ax, entry: dict[str, Any]) -> None:
    """One prompt file: acceptance of draft k by block position, per method, tau in the legend."""
    styles = method_styles(list(entry["methods"]))
    for method, numbers in entry["methods"].items():
        accept = numbers.get("per_position_acceptance") or []
        tau = numbers.get("tau")
        label = f"{method_label(method)} (tau {'-' if tau is None else f'{tau:.2f}'})"
        ax.plot(range(1, len(accept) + 1), accept, marker="o", label=label, **styles[method])
    ax.set_title(Path(str(entry["file"])).name, fontsize=10)
    ax.set_xlabel("block position k")
    ax.set_ylabel("acceptance of draft k")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def redraw_acceptance(directory: str | Path) -> str | None:
    """``directory/acceptance.png`` from ``directory/eval.json``; None when there is no eval.json."""
    source = Path(directory) / EVAL_JSON
    if not source.is_file():
        return None
    result = json.loads(source.read_text())
    return plot_acceptance(
        result["per_file"], Path(directory) / ACCEPTANCE_PNG, title=acceptance_title(result)
    )


def acceptance_title(result: dict[str, Any]) -> str:
    return f"acceptance by block position ({result.get('tau_mode', 'exact')} mode)"
