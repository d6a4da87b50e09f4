"""serve-check's prompts: each row as the engine gets it (chat messages over the OpenAI chat API)
and as the exact eval does (token ids of the same rendered chat), so both decode the same prompts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_train.eval.prompts import (
    PromptRowError,
    encode_prompt,
    plain_prompt,
    prompt_messages,
    read_jsonl_rows,
)


@dataclass
class ServePrompt:
    """One prompt as the engine gets it (chat messages) and as the eval does (token ids)."""

    where: str
    messages: list[dict[str, str]]
    ids: list[int]


def load_serve_prompts(paths: Sequence[str], tokenizer, num_prompts: int) -> list[list[ServePrompt]]:
    """The first ``num_prompts`` rows of each file, as chat messages and as the eval's token ids.

    A bad row raises with ``file:line`` (no skipping: the two sides must see the same prompts).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("serve-check sends chat messages: the target's tokenizer needs a chat template")
    files = []
    for path in paths:
        if not Path(path).is_file():
            raise ValueError(f"prompts file {path} does not exist: give JSONL files to --prompts")
        prompts = []
        for line_number, row, error in read_jsonl_rows(path):
            where = f"{path}:{line_number}"
            if error is not None:
                raise ValueError(f"{where}: bad prompt row ({error[0]}): {error[1]}")
            try:
                messages = row_messages(row, where)
                ids = encode_prompt(tokenizer, row, None, where=where)
            except PromptRowError as err:
                raise ValueError(f"{err}. Fix or remove the row.") from None
            prompts.append(ServePrompt(where, messages, ids))
            if len(prompts) >= num_prompts:
                break
        if not prompts:
            raise ValueError(f"{path} has no prompts")
        files.append(prompts)
    return files


def row_messages(row: dict[str, Any], where: str) -> list[dict[str, str]]:
    """The turns the engine gets: a ``prompt`` string as one user turn, else the chat up to its last
    user turn (what ``encode_prompt`` renders)."""
    text = plain_prompt(row, where)
    if text is not None:
        return [{"role": "user", "content": text}]
    return [{"role": m["role"], "content": m["content"]} for m in prompt_messages(row, where)]
