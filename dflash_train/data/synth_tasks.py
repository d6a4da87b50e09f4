"""The tasks ``dflash-train synth`` steers the target to (``--task-file``), and how the rows are shared.

Magpie steers what an aligned model writes as a user turn with the text before it: a system prompt
describing the assistant's job ("an AI assistant that helps with programming; the user asks ...")
makes the model write requests of that kind (Xu et al. 2024 do this per task for code, math,
reasoning, ...). A task file lists the tasks users will serve, each with its share of the rows:

```yaml
tasks:
  - name: code                # file-name safe: [A-Za-z0-9_-]; recorded in every row as synth.task
    share: 0.3                # relative share of the rows (normalised over the tasks)
    system: "You are ..."     # rendered as the system turn before the user turn ("" = none)
    seeds: ["", "Write a"]    # optional openings of the user turn, continued by the target;
                              # sample i of the task takes seeds[i % len(seeds)] ("" = no opening)
    turns: 1                  # user turns per row (0 or absent = --turns)
    keep_system: false        # keep the steering system prompt in the row (default: dropped, so
                              # regen answers the request as a user without it would be answered)
```

JSON (a list or ``{"tasks": [...]}``) and JSONL (one task per line) files hold the same objects.
``--task-file NAME`` without a path separator also finds a packaged file
(``dflash_train/recipes/synth/NAME.yaml``, e.g. ``chat-tasks``). Without a task file synth has one
task, ``default``, with ``--system`` (kept in the rows, as before tasks existed).

Rows per task: Sainte-Lague apportionment of ``--num-rows`` by share, which is house-monotone (a
larger ``--num-rows`` on resume never takes a row from a task). Sampling interleaves the tasks by
share (sample j of a task comes at (j + 0.5) / share), so every prefix of the output holds the mix.
"""

from __future__ import annotations

import heapq
import json
import math
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

PACKAGED_TASKS = Path(__file__).resolve().parents[1] / "recipes" / "synth"
TASK_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
DEFAULT_TASK = "default"
# A task's sample j seeds the generator with ((task index << TASK_KEY_SHIFT) | j): the default task
# (index 0) keeps the keys synth used before tasks existed.
TASK_KEY_SHIFT = 40


@dataclass(frozen=True, kw_only=True)
class SynthTask:
    """One kind of request to synthesize (see the module docstring for each field)."""

    name: str
    share: float = 1.0
    system: str = ""
    seeds: tuple[str, ...] = ()
    turns: int = 0
    keep_system: bool = False

    def seed_for(self, index: int) -> str:
        """The opening of sample ``index``'s first user turn ("" = none)."""
        return self.seeds[index % len(self.seeds)] if self.seeds else ""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "seeds": list(self.seeds)}


def resolve_tasks(task_file: str, system: str, turns: int) -> list[SynthTask]:
    """The tasks of ``task_file`` (turns 0 -> ``turns``), or the one default task with ``system``."""
    if not task_file:
        return [SynthTask(name=DEFAULT_TASK, system=system, turns=turns, keep_system=True)]
    if system:
        raise ValueError(
            "--system with --task-file: give each task's system prompt in the task file (its 'system' key)"
        )
    path = task_file_path(task_file)
    tasks = [parse_task(entry, f"{path} task {i + 1}") for i, entry in enumerate(read_entries(path))]
    if not tasks:
        raise ValueError(f"{path}: no tasks; list them under 'tasks:' (docs/data.md, 'Steering synth')")
    names = [t.name for t in tasks]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"{path}: task names {repeated} appear more than once; give every task its own name")
    return [t if t.turns else replace(t, turns=turns) for t in tasks]


def task_file_path(task_file: str) -> Path:
    """A task file path, or the name of a packaged one."""
    path = Path(task_file)
    if path.is_file():
        return path
    packaged = PACKAGED_TASKS / f"{task_file}.yaml"
    if "/" not in task_file and packaged.is_file():
        return packaged
    names = sorted(p.stem for p in PACKAGED_TASKS.glob("*.yaml"))
    raise ValueError(f"--task-file {task_file!r}: no such file, nor a packaged task file (packaged: {names})")


def read_entries(path: Path) -> list[Any]:
    """The task objects of a YAML, JSON or JSONL file."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        try:
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        except ValueError as err:
            raise ValueError(f"{path}: not JSONL ({err}); write one task object per line") from None
    loaded = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if isinstance(loaded, dict) and set(loaded) == {"tasks"}:
        loaded = loaded["tasks"]
    if not isinstance(loaded, list):
        raise ValueError(f"{path}: expected a list of tasks, or a mapping with the one key 'tasks'")
    return loaded


def parse_task(entry: Any, where: str) -> SynthTask:
    """One task object, checked key by key; each error names the task and says what to write."""
    known = {f.name for f in fields(SynthTask)}
    if not isinstance(entry, dict) or "name" not in entry:
        raise ValueError(
            f"{where}: a task is a mapping with at least a 'name' (and share, system, seeds, turns)"
        )
    unknown = sorted(set(entry) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; a task has {sorted(known)}")
    name, seeds = entry["name"], entry.get("seeds") or []
    if not isinstance(name, str) or not TASK_NAME.match(name):
        raise ValueError(
            f"{where}: name {name!r}: use letters, digits, '-' and '_' (it names the held-out file)"
        )
    share, turns = entry.get("share", 1.0), entry.get("turns", 0)
    if isinstance(share, bool) or not isinstance(share, int | float) or not share > 0:
        raise ValueError(
            f"{where} ({name}): share {share!r}: give a number > 0 (relative to the other tasks)"
        )
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 0:
        raise ValueError(f"{where} ({name}): turns {turns!r}: give an integer >= 1 (0 = --turns)")
    if not isinstance(seeds, list) or not all(isinstance(s, str) for s in seeds):
        raise ValueError(f'{where} ({name}): seeds must be a list of strings ("" = no opening)')
    system, keep = entry.get("system", ""), entry.get("keep_system", False)
    if not isinstance(system, str) or not isinstance(keep, bool):
        raise ValueError(f"{where} ({name}): system must be a string and keep_system true or false")
    return SynthTask(
        name=name, share=float(share), system=system, seeds=tuple(seeds), turns=turns, keep_system=keep
    )


def apportion(shares: list[float], total: int) -> list[int]:
    """``total`` rows over tasks by ``shares``: Sainte-Lague (the next row goes to the task with the
    largest share / (2 * rows + 1), ties to the earlier task), house-monotone in ``total``."""
    rows = [0] * len(shares)
    heap = [(-share, i) for i, share in enumerate(shares)]
    heapq.heapify(heap)
    for _ in range(total):
        _, i = heapq.heappop(heap)
        rows[i] += 1
        heapq.heappush(heap, (-shares[i] / (2 * rows[i] + 1), i))
    return rows


def sample_budgets(targets: list[int], max_samples: int) -> list[int]:
    """Samples each task may draw: ``max_samples`` shared by target rows (0 = 20 per target row)."""
    total = sum(targets)
    if not max_samples:
        return [20 * t for t in targets]
    return [math.ceil(max_samples * t / total) if total else 0 for t in targets]


def schedule(tasks: list[SynthTask], progress: list[dict], needs: list[int], budgets: list[int], size: int):
    """The next batch: up to ``size`` (task index, sample index) pairs, tasks interleaved by share.

    A task draws from its ``next_index`` while it needs rows (``needs``) and has budget, at most about
    the samples its keep rate so far says it needs (so its last batch is not mostly thrown away).
    """
    caps, heap = [], []
    for t, task in enumerate(tasks):
        state = progress[t]
        kept = state["rows"] + state["heldout_rows"]
        rate = max(kept / state["next_index"], 0.02) if state["next_index"] else 1.0
        caps.append(math.ceil(1.1 * needs[t] / rate) + 8 if needs[t] > 0 else 0)
        if caps[t] and state["next_index"] < budgets[t]:
            heap.append(((state["next_index"] + 0.5) / task.share, t, state["next_index"]))
    heapq.heapify(heap)
    batch, taken = [], [0] * len(tasks)
    while heap and len(batch) < size:
        _, t, index = heapq.heappop(heap)
        batch.append((t, index))
        taken[t] += 1
        if taken[t] < caps[t] and index + 1 < budgets[t]:
            heapq.heappush(heap, ((index + 1.5) / tasks[t].share, t, index + 1))
    return batch


def heldout_path(heldout_dir: Path, task: str) -> Path:
    """Where a task's held-out prompts go: ``HELDOUT_DIR/<task>.jsonl``."""
    return heldout_dir / f"{task}.jsonl"
