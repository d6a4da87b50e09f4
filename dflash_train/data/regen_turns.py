"""One chat row's turns during regeneration: which turn needs a reply next, the reply, its seed key.

Shared by every regeneration engine (``data.regen``'s in-process engines, ``data.endpoint``), so an
engine module never needs ``data.regen`` itself (which chooses among the engines).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import NamedTuple

from dflash_train.data.readers import ChatRow

# --thinking values -> the chat template's enable_thinking (None: the template's default).
THINKING = {"on": True, "off": False, "default": None}


class Reply(NamedTuple):
    """One generated turn: its text, whether it ended on a stop token, and an error (endpoint only)."""

    text: str
    finished: bool
    error: str | None = None
    reasoning: str | None = None


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
        conversation.append(assistant_message(reply))
        finished.append(reply.finished)
        cursors[0] += 1
    return row, conversation, finished, None


def assistant_message(reply: Reply) -> dict:
    message = {"role": "assistant", "content": reply.text}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning  # a server's reasoning parser split it off
    return message


def turn_key(row: ChatRow, turn: int) -> int:
    """A stable 62-bit integer per (row, assistant turn) that seeds that reply's sampling."""
    digest = hashlib.sha1(f"{row_key(row)}#{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def advance_to_reply(row: ChatRow, conversation: list[dict], cursors: list[int], i: int) -> bool:
    """Copy non-assistant turns; True when the row needs a generated reply next."""
    messages = row.messages
    while cursors[i] < len(messages) and messages[cursors[i]]["role"] != "assistant":
        conversation.append(messages[cursors[i]])
        cursors[i] += 1
    if cursors[i] < len(messages):
        return True
    prompt_only = not any(m["role"] == "assistant" for m in messages)
    return prompt_only and cursors[i] == len(messages)  # one past the end once its reply exists
