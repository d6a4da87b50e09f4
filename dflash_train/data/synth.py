"""``dflash-train synth``: user prompts sampled from the target itself (Magpie), steered to tasks.

An aligned chat model given its chat template rendered up to the start of a user turn (system
prompt if the template adds one, then the user header, nothing else) writes a plausible user
request: the Magpie method (Xu et al., 2024, "Magpie: Alignment Data Synthesis from Scratch by
Prompting Aligned LLMs with Nothing"). The pre-query prefix is found generically: render the
template with a sentinel user message and cut at the sentinel. Generation of the user turn stops at
the token the template writes after a user message (``<|im_end|>``, ``<|eot_id|>``) or an EOS id.

Tasks (``--task-file``, ``data.synth_tasks``): a system prompt before the user turn and optional
openings of it steer what the target asks for (code, math, explanation, writing, multi-turn chat),
each task with its share of the rows; every row records its task. ``--heldout-per-task N`` writes
each task's first N kept prompts to its own file, and no training row repeats any of them.

``turns`` > 1 alternates: prompt, the target's greedy reply (``--max-reply-tokens``), the next
prompt sampled after that reply, ... and the row ends with a user turn, so ``regen`` writes (and
rewrites) every reply. Every prompt passes the filters of ``data.prompt_filters``; the first user
turn must not duplicate an earlier row of its task (exactly or nearly: min-hashed 5-gram sets).

Output rows: ``{"messages": [...], "synth": {"seed", "index", "target", "turns", "task"}}``. Each
sample's randomness is keyed by its task and index, so each task's rows are a function of the seed
and settings, whatever the batch size. Resume: ``data.synth_state``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from dflash_train.data.prompt_filters import REASONS, PromptFilter
from dflash_train.data.readers import default_heldout_dir, state_path
from dflash_train.data.special_tokens import (
    SENTINEL,
    end_of_turn_id,
    pad_id,
    render,
    resolve_eos_ids,
    special_token_ids,
    template_token_ids,
)
from dflash_train.data.synth_state import append_rows, load_state, read_rows, save_state
from dflash_train.data.synth_tasks import (
    TASK_KEY_SHIFT,
    SynthTask,
    apportion,
    heldout_path,
    resolve_tasks,
    sample_budgets,
    schedule,
)
from dflash_train.data.tokenize import (
    common_prefix_length,
    end_of_rewritten_turn,
    template_kwargs,
    turn_closing_text,
)
from dflash_train.generate.compiled_step import compile_decode_choice
from dflash_train.generate.decode_attention import decode_attention_choice
from dflash_train.generate.engine import QUEUE_ROWS_PER_SLOT, build_generator, decode_step_report
from dflash_train.generate.loops import LoopStop
from dflash_train.generate.sampling import Sampling, load_generator, resolve_device

THINKING = {"on": True, "off": False, "default": None}
# Settings that change which rows are produced; a resumed run must use the same ones.
STATE_KEYS = (
    "target",
    "temperature",
    "top_p",
    "max_prompt_tokens",
    "turns",
    "system",
    "seed",
    "thinking",
    "max_reply_tokens",
    "min_prompt_chars",
    "near_dup_threshold",
)


@dataclass(kw_only=True)
class SynthOptions:
    """Options of ``dflash-train synth`` (the CLI builds this from its arguments)."""

    target: str
    output: str
    num_rows: int
    temperature: float = 1.0
    top_p: float = 0.99
    max_prompt_tokens: int = 256
    turns: int = 1
    system: str = ""
    seed: int = 0
    batch_size: int = 64
    device: str = "auto"
    compile_decode: str = "auto"  # the slot engine's torch.compile of its decode step (auto, on, off)
    decode_attention: str = "auto"  # its decode attention (auto: flex on CUDA for attention-only targets)
    thinking: str = "default"
    # Greedy replies between the turns of a multi-turn row.
    max_reply_tokens: int = 512
    # End a generated turn (user prompt or reply) once it repeats itself (generate/loops.py) and drop
    # its sample, instead of generating it to its token limit and dropping it then.
    stop_loops: bool = False
    min_prompt_chars: int = 10
    near_dup_threshold: float = 0.8
    # Stop after drawing this many samples even if fewer rows were kept (0 = 20 per requested row).
    max_samples: int = 0
    # Tasks to steer to (data.synth_tasks; "" = one task with --system), and per task the first N
    # kept prompts written to HELDOUT_DIR/<task>.jsonl instead (default: OUTPUT minus .jsonl + .heldout/).
    task_file: str = ""
    heldout_per_task: int = 0
    heldout_dir: str = ""

    def __post_init__(self):
        if self.num_rows < 1 or self.turns < 1 or self.batch_size < 1 or self.max_prompt_tokens < 1:
            raise ValueError("--num-rows, --turns, --batch-size and --max-prompt-tokens must be >= 1")
        if self.heldout_per_task < 0:
            raise ValueError(
                f"--heldout-per-task {self.heldout_per_task}: give 0 (none) or a count of prompts"
            )
        if self.thinking not in THINKING:
            raise ValueError(f"--thinking {self.thinking!r}: use one of {list(THINKING)}")
        Sampling(temperature=self.temperature, top_p=self.top_p)  # validates both
        compile_decode_choice(self.compile_decode)
        decode_attention_choice(self.decode_attention)


def magpie_prefix(tokenizer, history: list[dict], kwargs: dict) -> str:
    """The template's text up to where the content of the next user message would start."""
    text = render(tokenizer, [*history, {"role": "user", "content": SENTINEL}], **kwargs)
    if text.count(SENTINEL) != 1:
        raise ValueError(
            "the chat template does not write a user message's content verbatim exactly once, so the text "
            "before a user turn cannot be found; synth needs a template that renders the content as given"
        )
    prefix = text.split(SENTINEL, 1)[0]
    if not prefix[history_end(tokenizer, history, prefix, kwargs) :].strip():
        raise ValueError(
            "the chat template writes no user header before a user message's content (text before it: "
            f"{prefix[-60:]!r}), so the target cannot tell that it should write a user turn"
        )
    return prefix


def history_end(tokenizer, history: list[dict], prefix: str, kwargs: dict) -> int:
    """Where ``history`` ends in ``prefix`` (its rendering followed by a user turn's header).

    The history rendered alone is a prefix of it for most templates. Templates that rewrite the last
    assistant turn once a user turn follows (Qwen3 and Qwen3.5/3.6 drop its empty think block) make
    it end after the turn-closing text that follows the point where the two renderings part, as the
    loss mask finds such a turn (``data.tokenize``). Templates that refuse a conversation without a
    user query (Qwen3.5/3.6, for the system prompt alone) are searched from the start in the same way.
    """
    if not history:
        return 0
    try:
        before = render(tokenizer, history, **kwargs)
    except ValueError:
        if any(m["role"] == "user" for m in history):
            raise  # a refusal of anything else is the template's error, not a missing user query
        start = 0
    else:
        if prefix.startswith(before):
            return len(before)
        start = common_prefix_length(before, prefix)
    closing = turn_closing_text(tokenizer, kwargs)
    end = end_of_rewritten_turn(prefix, start, closing)
    if end < 0:
        raise ValueError(
            f"the chat template renders the conversation before a user turn otherwise than alone and writes "
            f"no turn-closing text ({closing!r}) after character {start} ({prefix[start : start + 40]!r}), so "
            "the user turn's start cannot be found"
        )
    return end


class Synthesizer:
    """The loaded target and everything needed to turn (task, sample index) pairs into kept rows."""

    def __init__(self, opts: SynthOptions, tasks: list[SynthTask] | None = None):
        tasks = tasks or resolve_tasks(opts.task_file, opts.system, opts.turns)
        self.opts, self.tasks = opts, tasks
        self.model, self.tokenizer = load_generator(opts.target, resolve_device(opts.device))
        self.kwargs = template_kwargs(THINKING[opts.thinking])
        eos = resolve_eos_ids(self.tokenizer, getattr(self.model, "generation_config", None))
        self.user_stops = {end_of_turn_id(self.tokenizer, "user", self.kwargs), *eos}
        multi_turn = any(t.turns > 1 for t in tasks)
        self.reply_stops = (
            {end_of_turn_id(self.tokenizer, "assistant", self.kwargs), *eos} if multi_turn else set()
        )
        self.pad_id = pad_id(self.tokenizer, eos)
        self.special = set(special_token_ids(self.tokenizer))
        texts = [self.tokenizer.convert_ids_to_tokens(i) for i in template_token_ids(self.tokenizer)]
        # One duplicate index per task (so each task's rows depend on its own samples only), and one
        # of every task's held-out prompts, which no training row may repeat.
        self.filters = [PromptFilter(texts, opts.min_prompt_chars, opts.near_dup_threshold) for _ in tasks]
        self.heldout_index = PromptFilter([], opts.min_prompt_chars, opts.near_dup_threshold)
        self.training_index: PromptFilter | None = None  # see index_training_rows
        self.systems = [[{"role": "system", "content": t.system}] if t.system else [] for t in tasks]
        self.first_prefixes = [magpie_prefix(self.tokenizer, system, self.kwargs) for system in self.systems]
        self.sampling = Sampling(temperature=opts.temperature, top_p=opts.top_p, seed=opts.seed)
        self.generator = build_generator(
            self.model, num_slots=opts.batch_size, compile_decode=compile_decode_choice(opts.compile_decode),
            decode_attention=decode_attention_choice(opts.decode_attention),
        )  # fmt: skip
        self.loop_stop = LoopStop() if opts.stop_loops else None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def draw(self, samples: list[tuple[int, int]]) -> list[tuple[int, int, list[dict], str | None]]:
        """(task, index, messages, rejection reason or None) for each (task, sample index)."""
        conversations = {s: list(self.systems[s[0]]) for s in samples}
        problems: dict[tuple[int, int], str] = {}
        for turn in range(max(self.tasks[t].turns for t, _ in samples)):
            live = [s for s in samples if s not in problems and self.tasks[s[0]].turns > turn]
            if turn > 0 and live:
                self.add_replies(live, conversations, problems, turn)
                live = [s for s in live if s not in problems]
            if live:
                self.add_prompts(live, conversations, problems, turn)
        return [(t, i, conversations[(t, i)], problems.get((t, i))) for t, i in samples]

    def add_prompts(self, live: list, conversations: dict, problems: dict, turn: int) -> None:
        # A seed opens the first user turn only; the target continues it.
        openings = [self.tasks[t].seed_for(i) if turn == 0 else "" for t, i in live]
        prefixes = [
            self.first_prefixes[s[0]]
            if turn == 0
            else magpie_prefix(self.tokenizer, conversations[s], self.kwargs)
            for s in live
        ]
        generations = self.generator.generate(
            [self.encode(prefix + opening) for prefix, opening in zip(prefixes, openings)],
            [sample_key(s, 2 * turn) for s in live],
            max_new_tokens=self.opts.max_prompt_tokens,
            stop_ids=self.user_stops,
            pad_id=self.pad_id,
            sampling=self.sampling,
            loop_stop=self.loop_stop,
        )
        for s, opening, gen in zip(live, openings, generations):
            text = opening + self.tokenizer.decode(gen.token_ids, skip_special_tokens=False)
            seen = any(t in self.special for t in gen.token_ids)
            problem = "looped" if gen.looped else self.filters[s[0]].text_problem(text, gen.finished, seen)
            if problem:
                problems[s] = problem
            else:
                conversations[s].append({"role": "user", "content": text.strip()})

    def add_replies(self, live: list, conversations: dict, problems: dict, turn: int) -> None:
        prompts = [self.encode(render(self.tokenizer, conversations[s], True, **self.kwargs)) for s in live]
        generations = self.generator.generate(
            prompts,
            [sample_key(s, 2 * turn - 1) for s in live],
            max_new_tokens=self.opts.max_reply_tokens,
            stop_ids=self.reply_stops,
            pad_id=self.pad_id,
            sampling=Sampling(seed=self.opts.seed),  # greedy: what regen at temperature 0 writes
            loop_stop=self.loop_stop,
        )
        for s, gen in zip(live, generations):
            if not gen.finished:
                problems[s] = "reply_looped" if gen.looped else "reply_hit_token_limit"
            else:
                text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=False)
                conversations[s].append({"role": "assistant", "content": text})

    def remember(self, rows: list[tuple[str, str]], heldout: bool) -> None:
        """Index rows already written (a resumed run) under their tasks' duplicate indexes."""
        index = {t.name: i for i, t in enumerate(self.tasks)}
        for task, text in rows:
            if task not in index:
                raise ValueError(f"{self.opts.output}: a row of task {task!r}, which the task file lacks")
            self.filters[index[task]].remember(text)
            if heldout:
                self.heldout_index.remember(text)

    def index_training_rows(self, rows: list[tuple[str, str]]) -> None:
        """Every task's training rows written before a held-out phase that a budget cut short (a
        rerun completes it): no new held-out prompt may repeat them. Dropped after that phase."""
        self.training_index = PromptFilter([], self.opts.min_prompt_chars, self.opts.near_dup_threshold)
        for _, text in rows:
            self.training_index.remember(text)


def sample_key(sample: tuple[int, int], turn_code: int) -> int:
    """The generator key of a sample's turn: the default task (index 0) keeps synth's old keys."""
    task, index = sample
    return (((task << TASK_KEY_SHIFT) | index) << 8) | turn_code


def run_synth(opts: SynthOptions) -> dict[str, Any]:
    """Synthesize ``opts.num_rows`` prompt rows (and the held-out ones) into ``opts.output``."""
    tasks = resolve_tasks(opts.task_file, opts.system, opts.turns)
    names = [t.name for t in tasks]
    output, state_file = Path(opts.output), state_path(opts.output)
    heldout = heldout_files(opts, names)
    state = load_state(output, heldout, state_file, settings(opts, tasks), names)
    progress = [state["tasks"][name] for name in names]
    synth = Synthesizer(opts, tasks)
    training = read_rows(output)
    synth.remember(training, heldout=False)
    for path in heldout.values():
        synth.remember(read_rows(path), heldout=True)
    if training and any(p["heldout_rows"] < opts.heldout_per_task for p in progress):
        synth.index_training_rows(training)
    for f, p in zip(synth.filters, progress):
        f.counts.update(p["filtered"])
    quotas = apportion([t.share for t in tasks], opts.num_rows)
    start, t0 = [dict(p) for p in progress], time.perf_counter()
    output.parent.mkdir(parents=True, exist_ok=True)
    # Counted before any row is written: a kill between a batch's rows and its state then leaves
    # rows that the rerun cuts and redraws, never rows without a state file.
    save_state(state_file, state)
    files = {None: output} | heldout  # each file is created by its first row
    bar = ProgressBar(opts.num_rows, progress, synth.generator)
    # Every task's held-out rows first: each training row is then checked against all of them.
    synth_phase(synth, opts, state, files, bar, "heldout", [opts.heldout_per_task] * len(tasks), quotas)
    synth.training_index = None
    synth_phase(synth, opts, state, files, bar, "train", quotas, quotas)
    bar.close()
    result = summary(opts, tasks, progress, quotas, start, heldout, time.perf_counter() - t0)
    return result | decode_step_report(synth.generator)


def synth_phase(synth, opts, state, files, bar, phase: str, targets: list[int], quotas: list[int]) -> None:
    """Batches until every task has ``targets`` rows of this phase (or its sample budget is spent);
    after each, the rows are made durable, then the state that counts them."""
    progress = [state["tasks"][t.name] for t in synth.tasks]
    key = "heldout_rows" if phase == "heldout" else "rows"
    budgets = sample_budgets([q + opts.heldout_per_task for q in quotas], opts.max_samples)
    size = QUEUE_ROWS_PER_SLOT * opts.batch_size  # several samples per slot: freed slots refill at once
    while batch := schedule(
        synth.tasks, progress, [n - p[key] for n, p in zip(targets, progress)], budgets, size
    ):
        lines = write_batch(synth, opts, batch, progress, targets, phase)
        for name, path in files.items():
            append_rows(path, lines.get(name, []))
        for f, p in zip(synth.filters, progress):
            p["filtered"] = f.summary()
        save_state(state_path(opts.output), state)
        bar.show()


class ProgressBar:
    """Kept training rows of all tasks, with the filter counts, samples drawn and tokens/s."""

    def __init__(self, total: int, progress: list[dict], generator):
        from tqdm import tqdm

        self.total, self.progress, self.generator, self.t0 = total, progress, generator, time.perf_counter()
        self.shown = min(state_rows(progress), total)
        self.bar = tqdm(total=total, initial=self.shown, unit="row", desc="synth", disable=None)

    def show(self) -> None:
        rows = min(state_rows(self.progress), self.total)
        self.bar.update(rows - self.shown)
        self.shown = rows
        speed = {"tok_s": round(self.generator.generated_tokens / (time.perf_counter() - self.t0))}
        drawn = {"drawn": sum(p["next_index"] for p in self.progress)}
        self.bar.set_postfix(sum_counts(self.progress) | drawn | speed, refresh=False)

    def close(self) -> None:
        self.bar.close()


def write_batch(synth, opts, batch, progress, targets, phase) -> dict[str | None, list[str]]:
    """Draw and filter one batch; advances ``progress``; returns the lines per file (None: the
    training output, else the held-out file of that task)."""
    lines: dict[str | None, list[str]] = {}
    key = "heldout_rows" if phase == "heldout" else "rows"
    for t, index, messages, problem in synth.draw(batch):
        task, state = synth.tasks[t], progress[t]
        if state[key] >= targets[t]:
            continue  # this task is done; its later samples stay undrawn, so a longer rerun continues here
        state["next_index"] = index + 1
        first = next(m["content"] for m in messages if m["role"] == "user") if not problem else ""
        problem = problem or synth.filters[t].duplicate_problem(first)
        if not problem and phase == "train" and synth.heldout_index.duplicate_problem(first):
            problem = "heldout_overlap"
        if not problem and phase == "heldout" and synth.training_index is not None:
            if synth.training_index.duplicate_problem(first):
                problem = "training_overlap"
        if problem:
            synth.filters[t].reject(problem)
            continue
        synth.filters[t].remember(first)
        if phase == "heldout":
            synth.heldout_index.remember(first)
        kept = messages if task.keep_system else [m for m in messages if m["role"] != "system"]
        meta = {
            "seed": opts.seed,
            "index": index,
            "target": opts.target,
            "turns": task.turns,
            "task": task.name,
        }
        lines.setdefault(task.name if phase == "heldout" else None, []).append(
            json.dumps({"messages": kept, "synth": meta}) + "\n"
        )
        state[key] += 1
    return lines


def state_rows(progress: list[dict]) -> int:
    return sum(p["rows"] for p in progress)


def sum_counts(progress: list[dict]) -> dict[str, int]:
    total: dict[str, int] = {}
    for p in progress:
        for reason, count in p["filtered"].items():
            total[reason] = total.get(reason, 0) + count
    return total


def summary(opts, tasks, progress, quotas, start: list[dict], heldout, elapsed) -> dict[str, Any]:
    """The result: totals (as before tasks existed) and per task rows, samples and filter counts."""
    per_task = {}
    for task, p, quota in zip(tasks, progress, quotas):
        per_task[task.name] = {
            "rows": p["rows"],
            "quota": quota,
            "heldout_rows": p["heldout_rows"],
            "samples_drawn": p["next_index"],
            "filtered": dict(p["filtered"]),
            "complete": p["rows"] >= quota and p["heldout_rows"] >= opts.heldout_per_task,
        }
    rows, drawn = state_rows(progress), sum(p["next_index"] for p in progress)
    rows_new = rows - sum(s["rows"] for s in start)
    drawn_new = drawn - sum(s["next_index"] for s in start)
    complete = all(t["complete"] for t in per_task.values())
    if not complete:
        short = {
            n: f"{t['rows']}/{t['quota']} rows, {t['heldout_rows']} held out"
            for n, t in per_task.items()
            if not t["complete"]
        }
        print(
            f"synth: stopped after {drawn} samples with tasks short of their rows ({short}; filters: "
            f"{sum_counts(progress)}); raise --max-samples or loosen the filters",
            file=sys.stderr,
        )
    return {
        "rows": rows,
        "rows_new": rows_new,
        "heldout_rows": sum(p["heldout_rows"] for p in progress),
        "samples_drawn": drawn,
        "filtered": {reason: sum_counts(progress).get(reason, 0) for reason in REASONS},
        "complete": complete,
        "tasks": per_task,
        # the files with rows (a task whose samples all failed the filters has none)
        "heldout_files": {name: str(path) for name, path in heldout.items() if path.is_file()},
        "rows_per_s": round(rows_new / elapsed, 2) if elapsed > 0 else 0.0,
        "samples_per_s": round(drawn_new / elapsed, 2) if elapsed > 0 else 0.0,
        "elapsed_s": round(elapsed, 2),
        "output": opts.output,
    }


# ----------------------------------------------------------------------------- settings


def heldout_files(opts: SynthOptions, names: list[str]) -> dict[str, Path]:
    """The held-out file of every task ({} without ``--heldout-per-task``), created by its first row."""
    if not opts.heldout_per_task:
        return {}
    directory = Path(opts.heldout_dir) if opts.heldout_dir else default_heldout_dir(opts.output)
    files = {name: heldout_path(directory, name) for name in names}
    for name, path in files.items():
        if path.resolve() == Path(opts.output).resolve():  # held-out rows would be training rows
            raise ValueError(
                f"--heldout-dir {directory}: task {name!r}'s held-out file is the --output file {opts.output}; "
                f"give another --heldout-dir (the default is {default_heldout_dir(opts.output)}) or another --output"
            )
    return files


def settings(opts: SynthOptions, tasks: list[SynthTask]) -> dict[str, Any]:
    """What decides the rows (a resume must use the same). Task and held-out keys appear only when
    used, so state files from before they existed still resume."""
    values = asdict(opts)
    current = {k: values[k] for k in STATE_KEYS}
    if opts.stop_loops:  # a turn that would have left its loop is dropped: other rows
        current["stop_loops"] = True
    if opts.task_file:
        current["tasks"] = [t.to_dict() for t in tasks]
    if opts.heldout_per_task:
        current["heldout_per_task"] = opts.heldout_per_task
        current["heldout_dir"] = opts.heldout_dir  # as given: "" (beside the output) moves with it
    return current


def options_from_args(args) -> SynthOptions:
    """``SynthOptions`` from parsed CLI arguments (fields of the same names)."""
    return SynthOptions(**{f.name: getattr(args, f.name) for f in fields(SynthOptions)})
