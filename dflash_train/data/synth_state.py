"""Resume of ``dflash-train synth``: the state file and the output files made to agree with it.

The state file is written before the first row (counting none). Rows are appended to the output
(and the held-out files, each created by its first row) and fsynced per batch, then
``OUTPUT.state.json`` records, per task, the next sample index, the training and held-out rows kept
and the filter counts. A rerun with the same settings continues exactly where the state says: rows
written after the last state update are cut (and redrawn identically), as is a torn last line.
State files written before tasks existed (one implicit task) are read as the ``default`` task's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from dflash_train.data.synth_tasks import DEFAULT_TASK


def fresh_progress() -> dict[str, Any]:
    return {"next_index": 0, "rows": 0, "heldout_rows": 0, "filtered": {}}


def load_state(
    output: Path, heldout: dict[str, Path], state_path: Path, current: dict, tasks: list[str]
) -> dict[str, Any]:
    """The resume state, after making the output and held-out files agree with it."""
    fresh = {"settings": current, "tasks": {name: fresh_progress() for name in tasks}}
    if not state_path.is_file():
        stray = [p for p in [output, *heldout.values()] if p.is_file() and p.stat().st_size > 0]
        if stray:
            raise ValueError(
                f"{stray[0]} exists but has no {state_path.name}: use a new --output (or remove it)"
            )
        return fresh
    state = json.loads(state_path.read_text())
    if "tasks" not in state:  # written before tasks existed: one task
        state["tasks"] = {
            DEFAULT_TASK: {**fresh_progress(), **{k: state.pop(k) for k in list(state) if k != "settings"}}
        }
    changed = {k: (state["settings"].get(k), v) for k, v in current.items() if state["settings"].get(k) != v}
    changed |= {k: (v, None) for k, v in state["settings"].items() if k not in current}
    if changed:
        raise ValueError(
            f"{output} was written with other settings ({changed}, as (then, now)); rerun with the same "
            "settings to continue it, or use a new --output"
        )
    progress = state["tasks"]
    keep_rows(output, sum(p["rows"] for p in progress.values()))
    for name, path in heldout.items():
        keep_rows(path, progress[name]["heldout_rows"])
    return state


def keep_rows(output: Path, num_rows: int) -> None:
    """Cut ``output`` after its first ``num_rows`` complete lines (a torn line or unrecorded rows)."""
    data = output.read_bytes() if output.is_file() else b""
    keep = 0
    for row in range(num_rows):
        end = data.find(b"\n", keep)
        if end < 0:
            raise ValueError(
                f"{output} has {row} complete rows but its state file counts {num_rows}: it was modified; "
                "use a new --output"
            )
        keep = end + 1
    if keep < len(data):
        print(
            f"synth: {output}: cutting {len(data) - keep} bytes written after the last recorded batch",
            file=sys.stderr,
        )
        with open(output, "r+b") as fh:
            fh.truncate(keep)


def read_rows(path: Path) -> list[tuple[str, str]]:
    """(task, first user turn) of every row already written (to rebuild the duplicate indexes)."""
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return [
        (
            r.get("synth", {}).get("task", DEFAULT_TASK),
            next(m["content"] for m in r["messages"] if m["role"] == "user"),
        )
        for r in rows
    ]


def save_state(path: Path, state: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)  # atomic: a crash leaves the old or the new state, never half of one


def append_rows(path: Path, lines: list[str]) -> None:
    """Append rows to ``path`` (created, with its folder, by its first rows) and make them durable
    before the state that counts them is written."""
    if not lines:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("".join(lines))
        handle.flush()
        os.fsync(handle.fileno())
