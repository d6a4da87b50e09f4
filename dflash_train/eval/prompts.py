"""Evaluation prompts from JSONL: chat rows (``messages`` / ShareGPT ``conversations``) or ``{"prompt": ...}``.

A chat row is cut after its last user turn (the assistant replies that followed are what the target
should now generate) and rendered with the target's chat template plus the generation prompt, with
thinking on/off/default as asked. A ``{"prompt": text}`` row becomes one user turn when the
tokenizer has a chat template, and is encoded raw otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_prompts(
    path: str | Path, tokenizer, *, thinking: bool | None = None, num_prompts: int = 0
) -> list[list[int]]:
    """Token ids of the first ``num_prompts`` (0 = all) prompts of a JSONL file."""
    prompts: list[list[int]] = []
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_number}: not valid JSON ({err.msg})") from None
            prompts.append(encode_prompt(tokenizer, row, thinking, where=f"{path}:{line_number}"))
            if num_prompts and len(prompts) >= num_prompts:
                break
    if not prompts:
        raise ValueError(f"{path} has no prompts")
    return prompts


def encode_prompt(tokenizer, row: dict[str, Any], thinking: bool | None, where: str = "row") -> list[int]:
    """One row -> prompt token ids ending with the assistant generation prompt."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if isinstance(row.get("prompt"), str):
        if not has_template:
            return tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        messages = [{"role": "user", "content": row["prompt"]}]
    else:
        messages = prompt_messages(row, where)
        if not has_template:
            raise ValueError(f"{where}: chat rows need a tokenizer with a chat template")
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_messages(row: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The turns of a chat row up to and including its last user turn."""
    from dflash_train.data.readers import normalize_messages

    try:
        messages = normalize_messages(row)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    if last_user < 0:
        raise ValueError(f"{where}: the row has no user turn to answer")
    return messages[: last_user + 1]
