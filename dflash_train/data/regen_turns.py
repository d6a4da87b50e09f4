"""One chat row's turns during regeneration: which turn needs a reply next, the reply, its seed key.

Shared by every regeneration engine (``data.regen``'s in-process engines, ``data.endpoint``), so an
engine module never needs ``data.regen`` itself (which chooses among the engines).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from dflash_train.data.readers import ChatRow
from dflash_train.data.stored_prompts import prompt_fields

# --thinking values -> the chat template's enable_thinking (None: the template's default).
THINKING = {"on": True, "off": False, "default": None}


class Reply(NamedTuple):
    """One generated turn: its text, whether it ended on a stop token, an error (endpoint only), and
    the generated token ids (stop token excluded) with the prompt ids the engine fed. Engines that
    know both (the in-process ones) set both: the output row stores them for training
    (docs/data.md, "Stored token ids") and the round-trip check uses them. The endpoint returns text."""

    text: str
    finished: bool
    error: str | None = None
    reasoning: str | None = None
    token_ids: tuple[int, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None


def row_key(row: ChatRow) -> str:
    digest = hashlib.sha1(json.dumps(row.messages, sort_keys=True).encode()).hexdigest()[:12]
    return f"{Path(row.source).name}:{row.line}:{digest}"


def regenerate_row(complete, row: ChatRow) -> tuple[ChatRow, list[dict], list[bool], str | None]:
    """One row's turns in sequence through ``complete(conversation, key) -> Reply``; stops at an error."""
    conversation: list[dict] = []
    cursors, finished = [0], []
    while advance_to_reply(row, conversation, cursors, 0):
        reply = complete(conversation, turn_key(row, len(finished)))
        if reply.error:
            return row, conversation, finished, f"assistant turn {len(finished)}: {reply.error}"
        conversation.append(assistant_message(reply, conversation))
        finished.append(reply.finished)
        cursors[0] += 1
    return row, conversation, finished, None


def assistant_message(reply: Reply, conversation: list[dict]) -> dict:
    """The message of ``reply`` to the turns of ``conversation``: its text and, where the engine
    knows them, its ids and its prompt's (what it adds to the previous reply's, ``data.stored_prompts``)."""
    message = {"role": "assistant", "content": reply.text}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning  # a server's reasoning parser split it off
    if reply.token_ids is not None and reply.prompt_token_ids is not None:  # what training reads
        message["token_ids"] = list(reply.token_ids)
        message.update(prompt_fields(reply.prompt_token_ids, conversation))
    return message


def turn_key(row: ChatRow, turn: int) -> int:
    """A stable 62-bit integer per (row, assistant turn) that seeds that reply's sampling."""
    digest = hashlib.sha1(f"{row_key(row)}#{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def advance_to_reply(row: ChatRow, conversation: list[dict], cursors: list[int], i: int) -> bool:
    """Copy non-assistant turns; True when the row needs a generated reply next: at each assistant
    turn, and once more at the end of a row whose last turn is not an assistant's (a prompt-only row,
    a ``synth --turns N`` row ending with a user turn), whose reply ``regen`` writes too."""
    messages = row.messages
    while cursors[i] < len(messages) and messages[cursors[i]]["role"] != "assistant":
        conversation.append(messages[cursors[i]])
        cursors[i] += 1
    if cursors[i] < len(messages):
        return True
    ends_unanswered = bool(messages) and messages[-1]["role"] != "assistant"
    return ends_unanswered and cursors[i] == len(messages)  # one past the end once its reply exists


def round_trip_error(
    tokenizer, conversation: list[dict], reply_ids: Sequence[int], kwargs: dict
) -> str | None:
    """None when the last (assistant) turn of ``conversation`` tokenizes as training reads it
    (the whole chat template rendering) to the prompt's ids followed by exactly ``reply_ids``; else
    where it differs.

    Text cannot always carry token ids: a BPE target may emit a split that its tokenizer never
    produces (two ``\\n`` tokens where the text re-encodes to one ``\\n\\n``), or a reply's first
    characters may merge with the template text before them. The drafter then trains on tokens the
    target does not emit.
    """
    prompt = tokenizer.apply_chat_template(
        conversation[:-1], tokenize=False, add_generation_prompt=True, **kwargs
    )
    try:
        full = tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
    except Exception as err:  # jinja raises many types; training would skip this row too
        return f"the chat template fails on the reply: {type(err).__name__}: {err}"
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    expected = [*prompt_ids, *reply_ids]
    got = tokenizer(full, add_special_tokens=False)["input_ids"][: len(expected)]
    if got == expected:
        return None
    k = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    if k >= len(prompt_ids):
        where = f"reply token {k - len(prompt_ids)}"
    else:  # the reply's first characters merged with the template text before it
        where = f"prompt token {k} (merged with the reply's start)"
    return f"at {where}: generated {expected[k : k + 4]}, the stored text tokenizes to {got[k : k + 4]}"
