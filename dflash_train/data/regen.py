"""``dflash-train regen``: replace a dataset's assistant turns with the target's own generations.

Why: the drafter learns to predict the target. Trained on human- or other-model-written replies it
learns a different distribution, and its acceptance at serving time is lower than its training
accuracy suggests. Regenerated, the training labels are what the target actually says, so
teacher-forced accuracy approximates real acceptance (and equals it for greedy decoding).

Each assistant turn is regenerated given the preceding, already regenerated turns (user, system
and tool turns are kept). A row that ends without a reply (a prompt-only row, a ``synth --turns N``
row ending with a user turn) gets one to its last turn.
Output is JSONL in ``messages`` form; each row carries ``regen.key`` (source file name, line and a
hash of the source messages), and each generated assistant message the ``token_ids`` the target
generated with the ``prompt_token_ids`` it was given (a later reply: what its prompt adds to the
previous reply's, ``data.stored_prompts``), which training reads instead of re-tokenizing the text
(``data.stored_ids``; the endpoint engine returns text only, so its rows store none). The
output is appended to and flushed per batch, so an interrupted run resumes: rows whose key is already
in the output are skipped, and a partially written last line is cut off first; a rerun with other
settings than the output's rows record (``SETTINGS``) is refused, and the output and its failed-rows
file are never read back as input.

Engines: ``transformers`` (in process, what ``--engine auto`` runs: ``generate.engine``'s continuous
batching over ``--batch-size`` slots, CUDA graphs on GPU), ``vllm`` (offline, with ``--engine vllm``) and ``endpoint`` (any OpenAI-compatible server, ``data.endpoint``;
rows that keep failing go to ``OUTPUT.failed.jsonl`` with their reason, rewritten by every run).
In every engine, a row whose conversation the chat template refuses fails alone into that file.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import fields
from itertools import islice
from pathlib import Path
from typing import Any

from dflash_train.data.readers import ChatRow, expand_paths, failed_rows_path, iter_chat_rows
from dflash_train.data.regen_options import RegenOptions
from dflash_train.data.regen_turns import (
    THINKING,
    Reply,
    advance_to_reply,
    assistant_message,
    round_trip_error,
    row_key,
    turn_key,
)
from dflash_train.data.skips import SkipCounts
from dflash_train.data.special_tokens import end_of_turn_id, pad_id, resolve_eos_ids
from dflash_train.data.tokenize import template_kwargs
from dflash_train.generate.compiled_step import compile_decode_choice
from dflash_train.generate.decode_attention import decode_attention_choice
from dflash_train.generate.engine import QUEUE_ROWS_PER_SLOT, build_generator, decode_step_report
from dflash_train.generate.sampling import Sampling, load_generator, resolve_device


def run_regen(opts: RegenOptions) -> dict[str, Any]:
    """Regenerate ``opts.data`` into ``opts.output``; see the ``regen`` CLI options."""
    import time

    from tqdm import tqdm

    output = Path(opts.output)
    done = read_done_keys(output, regen_settings(opts))
    failed_path = failed_rows_path(output)
    skips = SkipCounts(max_bad_rows=opts.max_bad_rows)
    rows = iter_chat_rows(input_files(opts, output, failed_path), skips, require_assistant=False)
    if opts.max_rows:
        rows = islice(rows, opts.max_rows)
    todo, num_skipped = [], 0
    for row in rows:
        if row_key(row) in done:
            num_skipped += 1
        else:
            todo.append(row)
    engine = build_engine(opts) if todo else None
    # rows_not_round_trip: rows whose stored text re-tokenizes to other ids than generated (below);
    # rows_with_token_ids: rows whose every reply stores its generated ids (training reads those).
    counts = {"rows_done": 0, "rows_hit_max_new_tokens": 0, "rows_failed": 0, "rows_not_round_trip": 0}
    counts["rows_with_token_ids"] = 0
    mismatches: list[str] = []
    output.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(output, "a", encoding="utf-8") as out, open(failed_path, "w", encoding="utf-8") as failed:
        # In process, a call holds several rows per slot so that finished rows' slots get refilled.
        chunk = (
            max(opts.batch_size, 8 * opts.concurrency)
            if opts.endpoint
            else QUEUE_ROWS_PER_SLOT * opts.batch_size
        )
        bar = tqdm(total=len(todo), unit="row", desc="regen", disable=None)  # rows/s on a terminal
        for batch in chunked(todo, chunk):
            write_results(engine.regenerate(batch), opts, engine.name, out, failed, counts, mismatches)
            bar.update(len(batch))
            tokens = getattr(getattr(engine, "generator", None), "generated_tokens", None)
            speed = {} if tokens is None else {"tok_s": round(tokens / (time.perf_counter() - t0))}
            bar.set_postfix(
                failed=counts["rows_failed"],
                hit_limit=counts["rows_hit_max_new_tokens"],
                **speed,
                refresh=False,
            )
        bar.close()
    elapsed = time.perf_counter() - t0
    if counts["rows_failed"]:
        print(f"regen: {counts['rows_failed']} rows failed, see {failed_path}", file=sys.stderr)
    if counts["rows_not_round_trip"]:
        print(round_trip_warning(counts, mismatches), file=sys.stderr)
    if counts["rows_done"] > counts["rows_with_token_ids"]:
        print(
            f"regen: {counts['rows_done'] - counts['rows_with_token_ids']} of {counts['rows_done']} rows store "
            f"no generated token ids (engine {engine.name}: text only), so training re-tokenizes their text",
            file=sys.stderr,
        )
    return {
        **counts,
        "rows_skipped": num_skipped,
        "bad_rows": skips.to_dict(),
        "engine": engine.name if engine else "none",
        # The slot engine's compiled decode step (None: another engine, or nothing to do).
        "compile_decode": getattr(getattr(engine, "generator", None), "compile_decode", None),
        # Its attention and compilations (inside elapsed_s: rows_per_s pays for them; a new process
        # pays again).
        **decode_step_report(getattr(engine, "generator", None)),
        "rows_per_s": round(counts["rows_done"] / elapsed, 2) if todo and elapsed > 0 else 0.0,
        "elapsed_s": round(elapsed, 2),
        "output": str(output),
        "failed_output": str(failed_path),
    }


def write_results(
    results, opts: RegenOptions, engine_name: str, out, failed, counts: dict, mismatches: list[str]
) -> None:
    """Append one batch's rows (or their failures) and make them durable.

    A result is ``(row, messages, finished, error)``; the in-process engines add a fifth item, one
    round-trip error (or None) per assistant turn (the endpoint returns text only: unchecked).
    """
    for row, messages, finished, error, *checked in results:
        round_trip = checked[0] if checked else None
        if error:
            record = {"key": row_key(row), "source": row.source, "line": row.line, "reason": error}
            failed.write(json.dumps(record | {"messages": row.messages}) + "\n")
            counts["rows_failed"] += 1
            continue
        out.write(json.dumps(output_row(row, messages, finished, opts, engine_name, round_trip)) + "\n")
        counts["rows_done"] += 1
        counts["rows_with_token_ids"] += all("token_ids" in m for m in messages if m["role"] == "assistant")
        bad = [f"turn {t} {e}" for t, e in enumerate(round_trip or []) if e]
        if bad:
            counts["rows_not_round_trip"] += 1
            if len(mismatches) < 3:
                mismatches.append(f"{row_key(row)} {bad[0]}")
        counts["rows_hit_max_new_tokens"] += not all(finished)
    for handle in (out, failed):
        handle.flush()
        os.fsync(handle.fileno())  # a crash after this point never loses the batch


# ----------------------------------------------------------------------------- resume

# What a row's replies depend on besides its prompt, recorded in every row's ``regen`` meta: a rerun
# that continues an output must use the same (rows written before max_new_tokens and seed were
# recorded are checked on the rest).
SETTINGS = ("target", "temperature", "top_p", "thinking", "max_new_tokens", "seed")


def regen_settings(opts: RegenOptions) -> dict[str, Any]:
    return {key: getattr(opts, key) for key in SETTINGS}


def input_files(opts: RegenOptions, output: Path, failed_path: Path) -> list[str]:
    """``--data`` expanded, less this run's own output and failed-rows file: a folder or glob that
    holds them (``--data data/ --output data/regen.jsonl``) would read every rerun's output back as
    input and regenerate it again."""
    own = {output.resolve(), failed_path.resolve()}
    files = []
    for path in expand_paths(list(opts.data)):
        if Path(path).resolve() in own:
            print(f"regen: not reading {path} as input: it is this run's output", file=sys.stderr)
        else:
            files.append(path)
    return files


def read_done_keys(output: Path, settings: dict[str, Any]) -> set[str]:
    """Keys of rows already in ``output``, each made with ``settings`` (else a ``ValueError``: the
    output would mix replies of two targets or samplings); a torn last line (crash mid-write) is cut
    off."""
    if not output.is_file():
        return set()
    data = output.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        print(f"regen: {output}: dropping a partially written last line", file=sys.stderr)
        with open(output, "r+b") as fh:
            fh.truncate(keep)
        data = data[:keep]
    keys = set()
    for line_no, line in enumerate(data.decode("utf-8").splitlines(), start=1):
        try:
            meta = json.loads(line)["regen"]
            keys.add(meta["key"])
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(
                f"{output}:{line_no}: not a regen output row ({type(err).__name__}); "
                "use a new --output file or remove the line"
            ) from err
        changed = {k: (meta[k], v) for k, v in settings.items() if k in meta and meta[k] != v}
        if changed:
            raise ValueError(
                f"{output}:{line_no} was regenerated with other settings ({changed}, as (then, now)): "
                "rerun with the same settings to continue it, or use a new --output"
            )
    return keys


def round_trip_warning(counts: dict, examples: list[str]) -> str:
    return (
        f"regen: {counts['rows_not_round_trip']} of {counts['rows_done']} rows store a reply whose "
        "text re-tokenizes (under the chat template) to other tokens than the target generated "
        "(regen.round_trip is false in those rows); training reads the generated token_ids stored "
        "with each reply, but anything that re-tokenizes the text would learn tokens the target does "
        "not emit. Typical causes: a target emitting a split its tokenizer never produces (an "
        "undertrained model), or a reply merging with the template text before it. "
        f"First: {'; '.join(examples)}"
    )


def output_row(
    row: ChatRow,
    messages: list[dict],
    finished: list[bool],
    opts: RegenOptions,
    engine: str,
    round_trip: list[str | None] | None = None,
) -> dict:
    meta = {
        "key": row_key(row),
        "source": row.source,
        "line": row.line,
        **regen_settings(opts),  # what a rerun that continues the output must match
        "engine": engine,
        "finished": finished,  # False where the reply hit --max-new-tokens
    }
    if round_trip is not None:  # per turn: the stored text re-tokenizes to the generated ids
        meta["round_trip"] = [error is None for error in round_trip]
    extra = {k: v for k, v in (row.extra or {}).items() if k != "regen"}
    return {**extra, "messages": messages, "regen": meta}


def chunked(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), max(size, 1)):
        yield items[i : i + size]


# ----------------------------------------------------------------------------- generation


def regenerate(engine, rows: list[ChatRow]) -> list[tuple]:
    """Regenerate a batch turn by turn: turn t of every row is generated in one engine call.

    Each result is ``(row, messages, finished, error, round_trip)``; ``error`` is None, or why the
    row failed (a conversation the chat template refuses: ``render_prompts``); ``round_trip`` holds
    per turn None where the stored text re-tokenizes to the generated ids, else where it does not.
    """
    conversations: list[list[dict]] = [[] for _ in rows]
    cursors = [0] * len(rows)
    finished: list[list[bool]] = [[] for _ in rows]
    round_trip: list[list[str | None]] = [[] for _ in rows]
    errors: list[str | None] = [None] * len(rows)  # a failed row takes no further turns
    while True:
        waiting = [
            i
            for i, row in enumerate(rows)
            if errors[i] is None and advance_to_reply(row, conversations[i], cursors, i)
        ]
        if not waiting:
            break
        keys = [turn_key(rows[i], len(finished[i])) for i in waiting]
        replies = engine.generate([conversations[i] for i in waiting], keys)
        for i, reply in zip(waiting, replies):
            if reply.error:
                errors[i] = f"assistant turn {len(finished[i])}: {reply.error}"
                continue
            conversations[i].append(assistant_message(reply, conversations[i]))
            finished[i].append(reply.finished)
            if reply.token_ids is not None:
                round_trip[i].append(
                    round_trip_error(
                        engine.tokenizer, conversations[i], reply.token_ids, engine.template_kwargs
                    )
                )
            cursors[i] += 1  # past the original assistant turn (or the end of a row ending unanswered)
    return list(zip(rows, conversations, finished, errors, round_trip))


def build_engine(opts: RegenOptions):
    """The endpoint client with ``--endpoint``, vLLM with ``--engine vllm``, else in process
    (``generate.engine``: continuous batching on a preallocated cache, CUDA graphs on GPU)."""
    if opts.endpoint:
        from dflash_train.data.endpoint import EndpointEngine

        return EndpointEngine(opts)
    device = resolve_device(opts.device)
    if opts.engine == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as err:
            raise ValueError(
                "--engine vllm needs vLLM: pip install vllm (or use --engine transformers)"
            ) from err
        return VllmEngine(opts)
    return TransformersEngine(opts, device)


class LocalEngine:
    """What the in-process engines share: rows regenerated turn by turn (``regenerate``), each turn's
    prompts rendered with the target's chat template (``tokenizer``, ``template_kwargs``) and handed
    to the engine's own ``generate_ids``."""

    tokenizer: Any
    template_kwargs: dict

    def regenerate(self, rows: list[ChatRow]):
        return regenerate(self, rows)

    def generate(self, conversations: list[list[dict]], keys: list[int]) -> list[Reply]:
        prompts = render_prompts(self.tokenizer, conversations, self.template_kwargs)
        return generate_rendered(self.generate_ids, prompts, keys)

    def generate_ids(self, ids: list[list[int]], keys: list[int]) -> list[Reply]:
        raise NotImplementedError


class TransformersEngine(LocalEngine):
    """In-process generation on ``generate.engine``'s engine (``--batch-size`` slots), greedy at temperature 0."""

    name = "transformers"

    def __init__(self, opts: RegenOptions, device: str):
        self.model, self.tokenizer = load_generator(opts.target, device)
        self.opts = opts
        self.template_kwargs = template_kwargs(THINKING[opts.thinking])
        eos = resolve_eos_ids(self.tokenizer, getattr(self.model, "generation_config", None))
        self.stop_ids = reply_stop_ids(self.tokenizer, eos, self.template_kwargs)
        self.pad_id = pad_id(self.tokenizer, eos)  # no pad token (Llama-3): EOS under the mask
        self.sampling = Sampling(temperature=opts.temperature, top_p=opts.top_p, seed=opts.seed)
        self.generator = build_generator(
            self.model, num_slots=opts.batch_size, compile_decode=compile_decode_choice(opts.compile_decode),
            decode_attention=decode_attention_choice(opts.decode_attention),
        )  # fmt: skip

    def generate_ids(self, ids: list[list[int]], keys: list[int]) -> list[Reply]:
        generations = self.generator.generate(
            ids,
            keys,
            max_new_tokens=self.opts.max_new_tokens,
            stop_ids=self.stop_ids,
            pad_id=self.pad_id,
            sampling=self.sampling,
        )
        return [reply_from_ids(self.tokenizer, g.token_ids, g.finished, p) for g, p in zip(generations, ids)]


def render_prompts(tokenizer, conversations: list[list[dict]], kwargs: dict) -> list[list[int] | str]:
    """Each conversation's generation prompt ids, or (a str) why the chat template refuses it (Qwen3.5
    raises on a system message after the first turn, Mistral's on roles that do not alternate): that
    row fails alone, into the failed-rows file, as a server's refusal fails it at an endpoint."""
    prompts: list[list[int] | str] = []
    for conversation in conversations:
        try:
            text = tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=True, **kwargs
            )
        except Exception as err:  # jinja raises many types, incl. raise_exception() in templates
            prompts.append(f"the chat template fails on the conversation: {type(err).__name__}: {err}")
        else:
            prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def generate_rendered(generate_ids, prompts: list[list[int] | str], keys: list[int]) -> list[Reply]:
    """``generate_ids(ids, keys) -> replies`` over the prompts that rendered; the others' replies
    carry their template error."""
    replies = [Reply("", False, error=p) if isinstance(p, str) else None for p in prompts]
    rendered = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    if rendered:
        generated = generate_ids([prompts[i] for i in rendered], [keys[i] for i in rendered])
        for i, reply in zip(rendered, generated, strict=True):
            replies[i] = reply
    return replies


def reply_from_ids(tokenizer, token_ids: list[int], finished: bool, prompt_ids: list[int]) -> Reply:
    """The stored reply of generated ids (stop token excluded) after the prompt ids the engine fed.
    Special tokens stay in the text and nothing is cleaned up or stripped, so the text re-encodes to
    these ids wherever the tokenizer can (``round_trip_error`` counts the rest); training reads the
    ids themselves (``data.stored_ids``)."""
    text = tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return Reply(text, finished, token_ids=tuple(token_ids), prompt_token_ids=tuple(prompt_ids))


def reply_stop_ids(tokenizer, eos: list[int], kwargs: dict) -> set[int]:
    """EOS ids plus the template's end-of-assistant-turn token (a warning when it has none)."""
    try:
        return {*eos, end_of_turn_id(tokenizer, "assistant", kwargs)}
    except ValueError as err:
        warnings.warn(f"regen stops at the EOS ids {eos} only: {err}", stacklevel=2)
        return set(eos)


class VllmEngine(LocalEngine):
    """vLLM offline generation; prompts are rendered with the target's own chat template."""

    name = "vllm"

    def __init__(self, opts: RegenOptions):
        from vllm import LLM

        self.llm = LLM(model=opts.target, seed=opts.seed)
        self.tokenizer = self.llm.get_tokenizer()
        self.opts = opts
        self.template_kwargs = template_kwargs(THINKING[opts.thinking])
        # vLLM stops at the tokenizer's EOS on its own; the generation config's EOS ids and the
        # template's end of turn must be named, the stops of the transformers engine.
        eos = resolve_eos_ids(self.tokenizer, target_generation_config(opts.target))
        self.stop_ids = reply_stop_ids(self.tokenizer, eos, self.template_kwargs)

    def generate_ids(self, ids: list[list[int]], keys: list[int]) -> list[Reply]:
        from vllm import SamplingParams

        params = [
            SamplingParams(
                temperature=self.opts.temperature,
                top_p=self.opts.top_p,
                max_tokens=self.opts.max_new_tokens,
                seed=key % 2**31,
                stop_token_ids=sorted(self.stop_ids),
            )
            for key in keys
        ]
        # Token ids, not text: vLLM would add a second BOS to a template that already writes one.
        prompts = [{"prompt_token_ids": p} for p in ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [self.reply(o.outputs[0], o.prompt_token_ids) for o in outputs]

    def reply(self, completion, prompt_ids: list[int]) -> Reply:
        """Decoded here like the transformers engine (vLLM's own text drops special tokens)."""
        ids, finished = list(completion.token_ids), completion.finish_reason == "stop"
        if finished and ids and ids[-1] in self.stop_ids | set(self.tokenizer.all_special_ids):
            ids = ids[:-1]  # the stop token (or the tokenizer's EOS) it stopped at
        return reply_from_ids(self.tokenizer, ids, finished, prompt_ids)


def target_generation_config(target: str):
    """The target's ``generation_config.json`` as transformers reads it; None when it has none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(target)
    except OSError:
        return None


def options_from_args(args) -> RegenOptions:
    """``RegenOptions`` from parsed CLI arguments (fields of the same names)."""
    return RegenOptions(**{f.name: getattr(args, f.name) for f in fields(RegenOptions)})
