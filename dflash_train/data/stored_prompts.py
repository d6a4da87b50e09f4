"""The stored prompt ids of a row's replies, each written once (docs/data.md, "Stored token ids").

The prompt of reply k of a conversation is the chat template's rendering of everything before it,
so it almost always starts with the prompt of reply k-1 followed by that reply (the target's own
ids where they re-tokenize to themselves). Storing each reply's whole prompt would store a 20-turn
row about ten times over. ``regen`` therefore writes the first reply's (and any reply after one
without ids) ``prompt_token_ids`` in full, and every later reply as what it adds:

- ``prompt_token_ids_from_previous``: N, its prompt starts with the first N ids of the previous
  assistant message's prompt followed by that message's ``token_ids``;
- ``prompt_token_ids_tail``: the ids of its prompt after those N.

Files written before (every reply with its full ``prompt_token_ids``) read as they always did. With
a template that renders the history alike at every turn, a tail holds only the template text between
two replies (and re-tokenized text where it differs from the generated ids), so a row stores
O(turns x tokens) ids; with one that rewrites its history (Qwen3 drops the think blocks of earlier
replies), a tail starts where the rewrite does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dflash_train.data.skips import BadRowError

FROM_PREVIOUS = "prompt_token_ids_from_previous"
TAIL = "prompt_token_ids_tail"
# The two ways an assistant message with ``token_ids`` stores its prompt.
FULL_PROMPT_KEYS = ("prompt_token_ids",)
SHARED_PROMPT_KEYS = (FROM_PREVIOUS, TAIL)


class PromptChain:
    """Resolves the prompt ids of a row's assistant messages, visited in order; holds only the
    previous reply's prompt and ids, never every prompt of the row at once."""

    def __init__(self) -> None:
        self.previous: list[int] | None = None  # previous assistant message: prompt + token_ids

    def prompt_of(self, message: dict[str, Any]) -> list[int] | None:
        """The full prompt ids of this assistant message (None when it stores no ids); call it for
        every assistant message of the row, in order (``check_prompt_chain`` validated the row)."""
        if "token_ids" not in message:
            self.previous = None
            return None
        if FROM_PREVIOUS in message:
            assert self.previous is not None, "check_prompt_chain admits no shared prompt here"
            prompt = self.previous[: message[FROM_PREVIOUS]] + message[TAIL]
        else:
            prompt = list(message["prompt_token_ids"])
        self.previous = prompt + list(message["token_ids"])
        return prompt


def check_prompt_chain(messages: list[dict[str, Any]]) -> None:
    """Every shared prompt of the row follows an assistant message with ids and takes at most its
    prompt and ids; raises ``BadRowError`` (``malformed_token_ids``). The fields themselves were
    checked per message (``readers.check_token_id_fields``)."""
    previous: int | None = None  # length of the previous assistant message's prompt + token_ids
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if "token_ids" not in message:
            previous = None
            continue
        if FROM_PREVIOUS in message:
            shared = message[FROM_PREVIOUS]
            if previous is None:
                raise BadRowError(
                    "malformed_token_ids",
                    f"message {index} has {FROM_PREVIOUS} but the assistant message before it stores no "
                    "token ids (or there is none); store its full prompt_token_ids",
                )
            if shared > previous:
                raise BadRowError(
                    "malformed_token_ids",
                    f"message {index} {FROM_PREVIOUS} = {shared} exceeds the {previous} ids of the previous "
                    "assistant message's prompt and token_ids",
                )
            prompt = shared + len(message[TAIL])
        else:
            prompt = len(message["prompt_token_ids"])
        previous = prompt + len(message["token_ids"])


def prompt_fields(prompt_ids: Sequence[int], conversation: list[dict[str, Any]]) -> dict[str, Any]:
    """How a new reply after ``conversation`` stores ``prompt_ids``: what it adds to the previous
    assistant message's prompt and ids when that message stores ids, else in full."""
    chain = PromptChain()
    for message in conversation:
        if message["role"] == "assistant":
            chain.prompt_of(message)
    previous = chain.previous
    if previous is None:
        return {"prompt_token_ids": list(prompt_ids)}
    shared = 0
    for a, b in zip(previous, prompt_ids):
        if a != b:
            break
        shared += 1
    return {FROM_PREVIOUS: shared, TAIL: list(prompt_ids[shared:])}
