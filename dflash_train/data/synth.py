"""``dflash-train synth``: user prompts sampled from the target itself (Magpie).

An aligned chat model given its chat template rendered up to the start of a user turn (system
prompt if the template adds one, then the user header, nothing else) writes a plausible user
request: the Magpie method (Xu et al., 2024, "Magpie: Alignment Data Synthesis from Scratch by
Prompting Aligned LLMs with Nothing"). The pre-query prefix is found generically: render the
template with a sentinel user message and cut at the sentinel. Generation of the user turn stops at
the token the template writes after a user message (``<|im_end|>``, ``<|eot_id|>``) or an EOS id.

``--turns N`` alternates: prompt, the target's greedy reply (``--max-reply-tokens``), the next
prompt sampled after that reply, ... and the row ends with a user turn, so ``regen`` writes (and
rewrites) every reply. Every prompt passes the filters of ``data.prompt_filters``; the first user
turn must not duplicate an earlier row.

Output rows: ``{"messages": [...], "synth": {"seed", "index", "target", "turns"}}`` (a ``system``
message first when ``--system`` is given). Each sample's randomness is keyed by its global index,
so the rows are a function of the seed and settings, whatever the batch size. Resume: the output is
appended to and fsynced per batch, then ``OUTPUT.state.json`` records the next sample index, the
kept-row count and the filter counts; a rerun with the same settings continues exactly where the
state says (rows written after the last state update are cut and redrawn identically).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from dflash_train.data.prompt_filters import PromptFilter
from dflash_train.data.special_tokens import (
    SENTINEL,
    end_of_turn_id,
    pad_id,
    render,
    resolve_eos_ids,
    special_token_ids,
    template_token_ids,
)
from dflash_train.data.tokenize import (
    common_prefix_length,
    end_of_rewritten_turn,
    template_kwargs,
    turn_closing_text,
)
from dflash_train.generate.engine import QUEUE_ROWS_PER_SLOT, build_generator
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
    thinking: str = "default"
    # Greedy replies between the turns of a multi-turn row.
    max_reply_tokens: int = 512
    min_prompt_chars: int = 10
    near_dup_threshold: float = 0.8
    # Stop after drawing this many samples even if fewer rows were kept (0 = 20 per requested row).
    max_samples: int = 0

    def __post_init__(self):
        if self.num_rows < 1 or self.turns < 1 or self.batch_size < 1 or self.max_prompt_tokens < 1:
            raise ValueError("--num-rows, --turns, --batch-size and --max-prompt-tokens must be >= 1")
        if self.thinking not in THINKING:
            raise ValueError(f"--thinking {self.thinking!r}: use one of {list(THINKING)}")
        Sampling(temperature=self.temperature, top_p=self.top_p)  # validates both


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
    """The loaded target and everything needed to turn sample indices into kept rows."""

    def __init__(self, opts: SynthOptions):
        self.opts = opts
        self.model, self.tokenizer = load_generator(opts.target, resolve_device(opts.device))
        self.kwargs = template_kwargs(THINKING[opts.thinking])
        eos = resolve_eos_ids(self.tokenizer, getattr(self.model, "generation_config", None))
        self.user_stops = {end_of_turn_id(self.tokenizer, "user", self.kwargs), *eos}
        self.reply_stops = (
            {end_of_turn_id(self.tokenizer, "assistant", self.kwargs), *eos} if opts.turns > 1 else set()
        )
        self.pad_id = pad_id(self.tokenizer, eos)
        self.special = set(special_token_ids(self.tokenizer))
        texts = [self.tokenizer.convert_ids_to_tokens(i) for i in template_token_ids(self.tokenizer)]
        self.filter = PromptFilter(texts, opts.min_prompt_chars, opts.near_dup_threshold)
        self.system = [{"role": "system", "content": opts.system}] if opts.system else []
        self.first_prefix = magpie_prefix(self.tokenizer, self.system, self.kwargs)
        self.sampling = Sampling(temperature=opts.temperature, top_p=opts.top_p, seed=opts.seed)
        self.generator = build_generator(self.model, num_slots=opts.batch_size)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def draw(self, indices: list[int]) -> list[tuple[int, list[dict] | None, str | None]]:
        """(index, messages or None, rejection reason or None) for each sample index."""
        conversations = {i: list(self.system) for i in indices}
        problems: dict[int, str] = {}
        for turn in range(self.opts.turns):
            live = [i for i in indices if i not in problems]
            if turn > 0 and live:
                self.add_replies(live, conversations, problems, turn)
                live = [i for i in live if i not in problems]
            if live:
                self.add_prompts(live, conversations, problems, turn)
        return [(i, conversations[i], problems.get(i)) for i in indices]

    def add_prompts(self, live: list[int], conversations: dict, problems: dict, turn: int) -> None:
        if turn == 0:
            prompts = [self.encode(self.first_prefix)] * len(live)
        else:
            prompts = [
                self.encode(magpie_prefix(self.tokenizer, conversations[i], self.kwargs)) for i in live
            ]
        keys = [(i << 8) | (2 * turn) for i in live]
        generations = self.generator.generate(
            prompts,
            keys,
            max_new_tokens=self.opts.max_prompt_tokens,
            stop_ids=self.user_stops,
            pad_id=self.pad_id,
            sampling=self.sampling,
        )
        for i, gen in zip(live, generations):
            text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=False)
            seen = any(t in self.special for t in gen.token_ids)
            problem = self.filter.text_problem(text, gen.finished, seen)
            if problem:
                problems[i] = problem
            else:
                conversations[i].append({"role": "user", "content": text.strip()})

    def add_replies(self, live: list[int], conversations: dict, problems: dict, turn: int) -> None:
        prompts = [self.encode(render(self.tokenizer, conversations[i], True, **self.kwargs)) for i in live]
        generations = self.generator.generate(
            prompts,
            [(i << 8) | (2 * turn - 1) for i in live],
            max_new_tokens=self.opts.max_reply_tokens,
            stop_ids=self.reply_stops,
            pad_id=self.pad_id,
            sampling=Sampling(seed=self.opts.seed),  # greedy: what regen at temperature 0 writes
        )
        for i, gen in zip(live, generations):
            if not gen.finished:
                problems[i] = "reply_hit_token_limit"
            else:
                text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=False)
                conversations[i].append({"role": "assistant", "content": text})


def run_synth(opts: SynthOptions) -> dict[str, Any]:
    """Synthesize ``opts.num_rows`` prompt rows into ``opts.output``; returns the summary."""
    from tqdm import tqdm

    output, state_path = Path(opts.output), Path(str(opts.output) + ".state.json")
    state = load_state(output, state_path, settings(opts))
    synth = Synthesizer(opts)
    for text in read_first_prompts(output):
        synth.filter.remember(text)
    synth.filter.counts.update(state["filtered"])
    budget = opts.max_samples or 20 * opts.num_rows
    start, kept0, t0 = state["next_index"], state["rows"], time.perf_counter()
    bar = tqdm(total=opts.num_rows, initial=min(kept0, opts.num_rows), unit="row", desc="synth", disable=None)
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "a", encoding="utf-8") as out:
        while state["rows"] < opts.num_rows and state["next_index"] < budget:
            # Several samples per slot in one call: slots freed by short prompts are refilled at once.
            end = min(state["next_index"] + QUEUE_ROWS_PER_SLOT * opts.batch_size, budget)
            indices = list(range(state["next_index"], end))
            written = write_batch(synth, opts, indices, out, state)
            save_state(state_path, state, synth.filter.summary())
            bar.update(written)
            speed = {"tok_s": round(synth.generator.generated_tokens / (time.perf_counter() - t0))}
            bar.set_postfix(synth.filter.summary() | {"drawn": state["next_index"]} | speed, refresh=False)
    bar.close()
    return summary(opts, state, synth.filter.summary(), kept0, start, time.perf_counter() - t0)


def write_batch(synth: Synthesizer, opts: SynthOptions, indices: list[int], out, state: dict) -> int:
    """Draw, filter and append one batch; advances ``state``; returns the rows written."""
    written = 0
    for index, messages, problem in synth.draw(indices):
        state["next_index"] = index + 1
        first = next(m["content"] for m in messages if m["role"] == "user") if not problem else ""
        problem = problem or synth.filter.duplicate_problem(first)
        if problem:
            synth.filter.reject(problem)
            continue
        synth.filter.remember(first)
        meta = {"seed": opts.seed, "index": index, "target": opts.target, "turns": opts.turns}
        out.write(json.dumps({"messages": messages, "synth": meta}) + "\n")
        state["rows"], written = state["rows"] + 1, written + 1
        if state["rows"] >= opts.num_rows:
            break  # later samples of this batch stay undrawn, so a longer rerun continues here
    out.flush()
    os.fsync(out.fileno())  # the rows are durable before the state that counts them
    return written


def summary(opts, state, filtered, kept0, start, elapsed) -> dict[str, Any]:
    rows_new, drawn = state["rows"] - kept0, state["next_index"] - start
    complete = state["rows"] >= opts.num_rows
    if not complete:
        print(
            f"synth: stopped after {state['next_index']} samples with {state['rows']} of {opts.num_rows} rows "
            f"kept (filters: {filtered}); raise --max-samples or loosen the filters",
            file=sys.stderr,
        )
    return {
        "rows": state["rows"],
        "rows_new": rows_new,
        "samples_drawn": state["next_index"],
        "filtered": filtered,
        "complete": complete,
        "rows_per_s": round(rows_new / elapsed, 2) if elapsed > 0 else 0.0,
        "samples_per_s": round(drawn / elapsed, 2) if elapsed > 0 else 0.0,
        "elapsed_s": round(elapsed, 2),
        "output": opts.output,
    }


# ----------------------------------------------------------------------------- resume


def settings(opts: SynthOptions) -> dict[str, Any]:
    values = asdict(opts)
    return {k: values[k] for k in STATE_KEYS}


def load_state(output: Path, state_path: Path, current: dict) -> dict[str, Any]:
    """The resume state, after making the output agree with it (see the module docstring)."""
    fresh = {"settings": current, "next_index": 0, "rows": 0, "filtered": {}}
    if not state_path.is_file():
        if output.is_file() and output.stat().st_size > 0:
            raise ValueError(
                f"{output} exists but has no {state_path.name}: use a new --output (or remove it)"
            )
        return fresh
    state = json.loads(state_path.read_text())
    changed = {k: (state["settings"].get(k), v) for k, v in current.items() if state["settings"].get(k) != v}
    if changed:
        raise ValueError(
            f"{output} was written with other settings ({changed}, as (then, now)); rerun with the same "
            "settings to continue it, or use a new --output"
        )
    keep_rows(output, state["rows"])
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


def read_first_prompts(output: Path) -> list[str]:
    """The first user turn of every row already written (to rebuild the duplicate index)."""
    if not output.is_file():
        return []
    rows = [json.loads(line) for line in output.read_text(encoding="utf-8").splitlines()]
    return [next(m["content"] for m in r["messages"] if m["role"] == "user") for r in rows]


def save_state(path: Path, state: dict, filtered: dict[str, int]) -> None:
    state["filtered"] = filtered
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)  # atomic: a crash leaves the old or the new state, never half of one


def options_from_args(args) -> SynthOptions:
    """``SynthOptions`` from parsed CLI arguments (fields of the same names)."""
    return SynthOptions(**{f.name: getattr(args, f.name) for f in fields(SynthOptions)})
