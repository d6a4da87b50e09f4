"""Evaluation prompts from JSONL: chat rows (``messages`` / ShareGPT ``conversations``) or ``{"prompt": ...}``.

A chat row is cut after its last user turn (the assistant replies that followed are what the target
should now generate; earlier turns stay as the context of a multi-turn row) and rendered with the target's chat template plus the generation prompt, with
thinking on/off/default as asked. A ``{"prompt": text}`` row becomes one user turn when the
tokenizer has a chat template. The rendering is tokenized without added special tokens, as training
tokenizes its rows (``data.tokenize``): the template writes the BOS where the target has one. Without
a chat template the text is encoded as the tokenizer encodes a text of its own accord, so a Llama-style
tokenizer's BOS leads it (a trailing EOS that some tokenizers append is left off).

Bad rows (invalid UTF-8, malformed JSON, no user turn, a ``prompt`` beside a chat, ...) raise a
``ValueError`` naming ``file:line``, or are skipped and counted per file while their total stays
within ``max_bad_rows``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# A prompt row's forms: one user turn, or a chat cut after its last user turn. A 'prompt' beside a chat
# is ambiguous; 'messages' beside 'conversations' reads 'messages', as the training data readers do.
PROMPT_FORMS = (("prompt", str), ("messages", list), ("conversations", list))


@dataclass
class PromptFile:
    """The encoded prompts of one file and the rows skipped in it, by reason."""

    path: str
    prompts: list[list[int]]
    skipped: dict[str, int] = field(default_factory=dict)


class BadPromptRows:
    """Counts bad rows over all prompt files; the first one past ``max_bad_rows`` raises."""

    def __init__(self, max_bad_rows: int = 0):
        self.max_bad_rows = max_bad_rows
        self.num_bad = 0

    def record(self, skipped: dict[str, int], reason: str, where: str, detail: str) -> None:
        self.num_bad += 1
        skipped[reason] = skipped.get(reason, 0) + 1
        if self.num_bad > self.max_bad_rows:
            allowance = (
                "or skip bad rows with --max-bad-rows N"
                if self.max_bad_rows == 0
                else f"or raise --max-bad-rows (now {self.max_bad_rows})"
            )
            raise ValueError(
                f"{where}: bad prompt row ({reason}): {detail}. Fix or remove the row, {allowance}."
            )
        print(f"eval: skipping {where} ({reason}: {detail})", file=sys.stderr)


def read_jsonl_rows(path: str | Path):
    """``(line_number, row, error)`` per non-blank line; error = (reason, detail) for a bad line."""
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield (
                    line_number,
                    None,
                    ("invalid_utf8", f"invalid UTF-8 at byte {err.start}; re-encode the file as UTF-8"),
                )
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                yield line_number, None, ("malformed_json", f"not valid JSON ({err.msg})")
                continue
            if not isinstance(row, dict):
                yield line_number, None, ("not_a_prompt_row", f"a JSON {type(row).__name__}, not an object")
                continue
            yield line_number, row, None


def load_prompt_file(
    path: str | Path,
    tokenizer,
    *,
    thinking: bool | None = None,
    num_prompts: int = 0,
    bad_rows: BadPromptRows | None = None,
    context: tuple[int, int] | None = None,
) -> PromptFile:
    """Token ids of the first ``num_prompts`` (0 = all) usable prompts of a JSONL file. ``context``:
    (the target's positions, the new tokens each prompt decodes); a prompt that does not fit them
    with its new tokens is a bad row (``too_long``): past its context a target's tau is not the one served."""
    bad_rows = bad_rows or BadPromptRows(0)
    if not Path(path).is_file():
        raise ValueError(f"prompts file {path} does not exist: give JSONL files to --prompts")
    result = PromptFile(path=str(path), prompts=[])
    for line_number, row, error in read_jsonl_rows(path):
        where = f"{path}:{line_number}"
        if error is None:
            try:
                ids = encode_prompt(tokenizer, row, thinking, where=where)
                check_fits(ids, context, where)
                result.prompts.append(ids)
            except PromptRowError as err:
                error = (err.reason, err.detail)
        if error is not None:
            bad_rows.record(result.skipped, error[0], where, error[1])
        if num_prompts and len(result.prompts) >= num_prompts:
            break
    if not result.prompts:
        raise ValueError(f"{path} has no usable prompts")
    return result


def check_fits(ids: list[int], context: tuple[int, int] | None, where: str) -> None:
    """``ids`` and ``new_tokens`` within the target's ``positions`` (``context``), else ``too_long``."""
    if context is None:
        return
    positions, new_tokens = context
    if len(ids) + new_tokens > positions:
        raise PromptRowError(
            "too_long",
            f"{len(ids)} prompt tokens + {new_tokens} new tokens exceed the target's {positions} positions "
            "(max_position_embeddings); shorten the prompt or decode fewer new tokens",
            where,
        )


def target_context(model, new_tokens: int) -> tuple[int, int] | None:
    """(the target's ``max_position_embeddings``, ``new_tokens``) for ``load_prompt_file``; None when
    the config names no limit."""
    from dflash_train.models.presets import text_config

    positions = getattr(text_config(model.config), "max_position_embeddings", None)
    return (int(positions), new_tokens) if positions else None


def load_prompts(
    path: str | Path, tokenizer, *, thinking: bool | None = None, num_prompts: int = 0
) -> list[list[int]]:
    """Token ids of the first ``num_prompts`` (0 = all) prompts of a JSONL file (bad rows raise)."""
    return load_prompt_file(path, tokenizer, thinking=thinking, num_prompts=num_prompts).prompts


class PromptRowError(ValueError):
    """A row that cannot become a prompt: ``reason`` (a short key) and ``detail`` (what is wrong)."""

    def __init__(self, reason: str, detail: str, where: str):
        super().__init__(f"{where}: {detail}")
        self.reason, self.detail = reason, detail


def encode_prompt(tokenizer, row: dict[str, Any], thinking: bool | None, where: str = "row") -> list[int]:
    """One row -> prompt token ids ending with the assistant generation prompt."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    text = plain_prompt(row, where)
    if text is not None:
        if not has_template:
            return encode_text(tokenizer, text, where)
        messages = [{"role": "user", "content": text}]
    else:
        if not isinstance(row.get("messages"), list) and not isinstance(row.get("conversations"), list):
            raise PromptRowError(
                "not_a_prompt_row",
                f"give a 'prompt' string, a 'messages' list or a ShareGPT 'conversations' list (keys: {sorted(row)[:8]})",
                where,
            )
        messages = prompt_messages(row, where)
        if not has_template:
            raise PromptRowError("no_chat_template", "chat rows need a tokenizer with a chat template", where)
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    try:
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
    except Exception as err:  # the template is user code: its raise_exception() or any jinja/type error
        raise PromptRowError(
            "template_error", f"the chat template refused the row: {type(err).__name__}: {err}", where
        ) from None
    # As training tokenizes its rows (data.tokenize): the template writes the BOS where there is one.
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    if not ids:
        raise PromptRowError("empty_prompt", "the prompt renders to no tokens", where)
    return ids


def plain_prompt(row: dict[str, Any], where: str) -> str | None:
    """The text of a ``{"prompt": text}`` row; None for a chat row. A row holding a ``prompt`` string
    and a ``messages`` or ``conversations`` list is a chat row when the prompt repeats the chat's first
    user turn (as the training data readers read it), and is refused otherwise
    (``ambiguous_prompt_row``): one user turn or the chat up to its last user turn, either could be the
    request meant."""
    forms = [key for key, kind in PROMPT_FORMS if isinstance(row.get(key), kind)]
    if "prompt" not in forms:
        return None
    if len(forms) == 1:
        return row["prompt"]
    if row["prompt"] == first_user_turn(row):
        return None  # the chat's opening request repeated beside it (ultrachat_200k's rows): a chat row
    quoted = [f"'{key}'" for key in forms]
    found = ("both " if len(forms) == 2 else "") + ", ".join(quoted[:-1]) + f" and {quoted[-1]}"
    raise PromptRowError(
        "ambiguous_prompt_row",
        f"the row has {found}; keep one of them (a 'prompt' string is one user turn, a chat "
        "list is the conversation up to its last user turn)",
        where,
    )


def first_user_turn(row: dict[str, Any]) -> str | None:
    """The content of a chat row's first user turn; None where the chat is malformed or has none."""
    from dflash_train.data.readers import normalize_messages

    try:
        messages = normalize_messages(row)
    except ValueError:
        return None
    return next((m["content"] for m in messages if m["role"] == "user"), None)


def encode_text(tokenizer, text: str, where: str) -> list[int]:
    """``text`` as the tokenizer encodes a text of its own accord (what the target was pretrained on
    and a completions server feeds it): led by the special ids it adds (a Llama-style BOS), without
    any it appends after the text (an EOS: a prompt to continue does not end the sequence)."""
    bare = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not bare:
        raise PromptRowError("empty_prompt", "the prompt encodes to no tokens", where)
    full = tokenizer(text)["input_ids"]
    start = next((i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare), None)
    return full if start is None else full[: start + len(bare)]


def prompt_messages(row: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The turns of a chat row up to and including its last user turn."""
    from dflash_train.data.readers import normalize_messages

    try:
        messages = normalize_messages(row)
    except ValueError as err:
        raise PromptRowError(getattr(err, "reason", "not_a_chat_row"), str(err), where) from None
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    if last_user < 0:
        raise PromptRowError("no_user_turn", "the row has no user turn to answer", where)
    return messages[: last_user + 1]


# Built-in chat requests for the benchmarks (scripts/gpu_*_bench.py) when no prompt file is given.
BENCHMARK_TOPICS = [
    "Write a Python function that merges two sorted lists.",
    "Explain how a hash map handles collisions.",
    "What is the difference between a process and a thread?",
    "Write a haiku about autumn rain.",
    "Summarise the causes of the French Revolution in five sentences.",
    "How do I read a CSV file with the csv module and sum one column?",
    "Give three tips for writing clear commit messages.",
    "Solve 3x + 7 = 22 step by step.",
    "Write a short story opening set on a night train.",
    "Explain recursion to a ten-year-old.",
    "Write a SQL query that returns the top five customers by revenue.",
    "What does the Python GIL do?",
]


def benchmark_prompts(tokenizer, num_prompts: int) -> list[list[int]]:
    """``num_prompts`` distinct chat requests (the topics above, numbered), rendered as prompts."""
    rows = [
        {"prompt": f"{BENCHMARK_TOPICS[i % len(BENCHMARK_TOPICS)]} (variant {i})"} for i in range(num_prompts)
    ]
    return [encode_prompt(tokenizer, row, None) for row in rows]
