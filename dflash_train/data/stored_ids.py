"""Training rows from the token ids the target generated, where the data stores them.

Text cannot carry every id sequence: a target may emit a split its tokenizer never produces (two
``\\n`` tokens where the text re-encodes to one ``\\n\\n``), or a reply's first characters may merge
with the template text before them. Re-tokenizing such a reply teaches the drafter tokens the target
never emitted. ``regen`` therefore stores, per assistant message, the generated ``token_ids`` and the
``prompt_token_ids`` the target was given (docs/data.md, "Stored token ids"; a later reply stores only
what its prompt adds to the previous reply's, ``data.stored_prompts``), and training uses them:

- the conversation is rendered with the chat template as on the text path (``data.tokenize``);
- for every assistant message with ids, the rendering before its reply must be exactly its
  generation prompt (``render(messages[:i], add_generation_prompt=True)``), which must tokenize to the
  stored ``prompt_token_ids``, and the reply must be written verbatim (the ids decode to ``content``)
  unless it closes the row (``reply_end``: its rendering is then replaced by its ids);
- the row is then the template text between replies, tokenized piece by piece, with each reply's
  text replaced by its stored ids. The first piece is the first reply's prompt, so the row starts with
  exactly the ids the target saw, followed by exactly the ids it generated. The loss mask covers the
  generated ids and the template's end-of-turn text after them, as on the text path; for a reply cut
  at the generation limit (``regen.finished`` False) the generated ids only (``data.tokenize``).

A reply whose stored ids do not fit the current tokenizer and template (another ``data.thinking``
than regen's ``--thinking``, another template, an edited reply) is tokenized from its text and the row
is counted by reason (``FALLBACK_REASONS``); a row none of whose replies fits takes the text path
exactly. Ids outside the vocabulary are a bad row (``malformed_token_ids``). Rows without ids take
the text path, except the closing reply of a row written by ``regen --endpoint`` (text only) that the
template renders otherwise: its content is what the target generated, so it is placed as stored ids
would be (``closing_reply_as_generated``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from dflash_train.data.readers import STORED_ID_KEYS, TOKEN_ID_KEYS
from dflash_train.data.skips import BadRowError
from dflash_train.data.stored_prompts import PromptChain
from dflash_train.data.tokenize import (
    TemplateError,
    assistant_char_spans,
    label_spans,
    render,
    template_kwargs,
    tokenize_chat,
    turn_closing_text,
)

# Why a row with stored ids was tokenized from its text instead (counted, never a skip).
FALLBACK_REASONS = {
    "prompt_mismatch": "the stored prompt_token_ids differ from the chat template's rendering now "
    "(rows regenerated with another tokenizer, template or --thinking than data.thinking)",
    "content_mismatch": "the stored token_ids do not decode to the message content (edited after regen)",
    "template_mismatch": "the chat template renders the reply or its context otherwise than the "
    "generation prompt it was generated from",
}


class StoredIdsMismatch(Exception):
    """Stored ids that cannot be placed in this rendering; the row falls back to its text."""

    def __init__(self, reason: str, detail: str):
        assert reason in FALLBACK_REASONS, reason
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class TokenizedChat(NamedTuple):
    """One training row: ids int32 [L], loss mask bool [L], and where the reply ids came from."""

    ids: np.ndarray
    loss_mask: np.ndarray
    from_token_ids: bool  # at least one reply is its stored generated ids
    # (reason, detail) of the first reply whose stored ids could not be used (tokenized from its
    # text); a tuple, not the exception, so that it pickles from a tokenizer worker process.
    fallback: tuple[str, str] | None = None
    num_cut_replies: int = 0  # replies cut at the generation limit, trained without their end of turn


def has_token_ids(messages: list[dict[str, Any]]) -> bool:
    return any("token_ids" in m for m in messages)


def without_token_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the chat template sees them (the id lists are not for the template)."""
    return [{k: v for k, v in m.items() if k not in STORED_ID_KEYS} for m in messages]


def tokenize_training_row(
    tokenizer,
    messages: list[dict[str, Any]],
    thinking: bool | None = None,
    finished: list[bool] | None = None,
) -> TokenizedChat:
    """The training ids and loss mask of one row: from its stored ids where it has usable ones, else
    from its text (``data.tokenize.tokenize_chat``). ``finished``: one flag per assistant message
    (``regen.finished``; False: cut at the generation limit, no end-of-turn label), None when all
    ended on their own. Raises ``BadRowError``."""
    num_cut = 0 if finished is None else finished.count(False)
    if not has_token_ids(messages):
        rebuilt = closing_reply_as_generated(tokenizer, messages, template_kwargs(thinking), finished)
        ids, mask = rebuilt or tokenize_chat(tokenizer, messages, thinking, finished)
        ids, mask = np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=bool)
        return TokenizedChat(ids, mask, from_token_ids=False, num_cut_replies=num_cut)
    check_vocabulary(tokenizer, messages)
    clean = without_token_ids(messages)
    try:
        if not getattr(tokenizer, "is_fast", False):
            raise StoredIdsMismatch(
                "template_mismatch", "placing stored ids needs a fast tokenizer (offsets)"
            )
        kwargs = template_kwargs(thinking)
        ids, mask, mismatch = tokenize_with_stored_ids(tokenizer, messages, clean, kwargs, finished)
    except StoredIdsMismatch as err:
        ids, mismatch = None, err
    fallback = (mismatch.reason, mismatch.detail) if mismatch is not None else None
    if ids is None:  # no reply could use its ids: exactly the text path
        ids, mask = tokenize_chat(tokenizer, clean, thinking, finished)
        return TokenizedChat(ids, mask, from_token_ids=False, fallback=fallback, num_cut_replies=num_cut)
    ids, mask = np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=bool)
    return TokenizedChat(ids, mask, from_token_ids=True, fallback=fallback, num_cut_replies=num_cut)


def closing_reply_as_generated(
    tokenizer, messages, kwargs, finished: list[bool] | None
) -> tuple[list[int], list[bool]] | None:
    """(ids, mask) of a row written by regen without stored ids (``regen --endpoint``) whose closing
    reply the template does not render as its generation prompt followed by its content: that reply
    trains as ``reply_end`` places stored ids, its prompt, ``tokenizer(content)`` and the turn-closing
    text (a label only where ``finished`` says it ended on its own). None: the text path.

    A regen reply's content is exactly what the target generated after the generation prompt, so
    the empty think block Qwen's templates put before a reply cut inside its reasoning, or a trimmed
    trailing newline, would train as the target's. Rows not written by regen (``finished`` None) hold
    answers for the template to format, and a reply whose reasoning a server's reasoning parser split
    into ``reasoning_content`` cannot be rebuilt from its content: both keep the text path."""
    i, last = len(messages) - 1, messages[-1]
    if finished is None or i == 0 or last["role"] != "assistant" or "reasoning_content" in last:
        return None
    if not getattr(tokenizer, "is_fast", False):
        return None
    try:
        prompt = render(tokenizer, messages[:i], kwargs, generation_prompt=True)
    except BadRowError:  # Qwen3.5/3.6 refuse a prompt without a user query; the text path handles it
        return None
    if render(tokenizer, messages, kwargs).startswith(prompt + last["content"]):
        return None  # rendered as generated: the text path is already the row the target wrote
    generated = {
        **last,
        "token_ids": tokenizer(last["content"], add_special_tokens=False)["input_ids"],
        "prompt_token_ids": tokenizer(prompt, add_special_tokens=False)["input_ids"],
    }
    try:
        ids, mask, mismatch = tokenize_with_stored_ids(
            tokenizer, [*messages[:i], generated], messages, kwargs, finished
        )
    except StoredIdsMismatch:
        return None
    return None if ids is None or mismatch is not None else (ids, mask)


def check_vocabulary(tokenizer, messages: list[dict[str, Any]]) -> None:
    """Every stored id is a token of ``tokenizer`` (readers checked that they are integers >= 0)."""
    vocab_size = len(tokenizer)
    for index, message in enumerate(messages):
        for key in TOKEN_ID_KEYS:
            ids = message.get(key) or []
            if ids and max(ids) >= vocab_size:
                bad = next(j for j, t in enumerate(ids) if t >= vocab_size)
                raise BadRowError(
                    "malformed_token_ids",
                    f"message {index} {key}[{bad}] = {ids[bad]} is outside the tokenizer's {vocab_size} "
                    "tokens (were the rows generated by another target?)",
                )


def tokenize_with_stored_ids(
    tokenizer, messages, clean, kwargs, finished: list[bool] | None = None
) -> tuple[list[int] | None, list[bool] | None, StoredIdsMismatch | None]:
    """Template text piece by piece with each stored reply that fits spliced in, and the first reply
    that does not (it stays text, like a reply without ids); (None, None, mismatch) when none fits.

    Per reply, not per row: a Qwen3-style template rewrites history turns (drops their think block),
    so in a multi-turn row an earlier reply may not fit where the last one does. The text after a
    reply is labelled where it lies in its response span; the span of a reply cut at the generation
    limit (``finished`` False) ends with its content, so its end of turn is no label."""
    try:
        full, spans = assistant_char_spans(tokenizer, clean, kwargs)
        closing = turn_closing_text(tokenizer, kwargs)
        labels = spans
        if finished is not None and not all(finished):
            labels = label_spans(full, spans, finished, closing)
    except TemplateError as err:  # the text path (generation markers) may still give a mask
        raise StoredIdsMismatch("template_mismatch", str(err)) from err
    turns = [i for i, m in enumerate(clean) if m["role"] == "assistant"]
    ids: list[int] = []
    mask: list[bool] = []
    cursor, num_spliced, first_mismatch = 0, 0, None
    chain = PromptChain()  # every assistant turn in order: a prompt may continue the previous one
    for i, span in zip(turns, spans):
        stored_prompt = chain.prompt_of(messages[i])
        if stored_prompt is None:
            continue  # an assistant turn without ids stays text, masked by its span below
        start = span[0]
        try:
            end = reply_end(tokenizer, messages[i], stored_prompt, clean, i, full, span, closing, kwargs)
        except StoredIdsMismatch as mismatch:
            first_mismatch = first_mismatch or mismatch
            continue
        append_text(tokenizer, full, cursor, start, labels, ids, mask)
        ids += messages[i]["token_ids"]
        mask += [True] * len(messages[i]["token_ids"])
        cursor, num_spliced = end, num_spliced + 1
    if not num_spliced:
        return None, None, first_mismatch
    append_text(tokenizer, full, cursor, len(full), labels, ids, mask)
    return ids, mask, first_mismatch


def reply_end(
    tokenizer, message, stored: list[int], clean, i: int, full: str, span, closing: str, kwargs
) -> int:
    """Where reply ``i``'s text ends in ``full`` (``span``: its response span there), after checking
    that its stored ids (``stored``: its prompt's, resolved by ``PromptChain``) fit there.

    The reply that closes the row may be rendered otherwise than generated: Qwen's templates put a
    reply without ``</think>`` (cut at the limit inside its reasoning) after an empty think block the
    target never wrote, and trim its trailing whitespace. Nothing after it was rendered from it, so
    its rendering is replaced whole: the row is its prompt, its ids, then the turn-closing text."""
    start, span_end = span
    prompt = render(tokenizer, clean[:i], kwargs, generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if prompt_ids != stored:
        k = next(
            (j for j, (a, b) in enumerate(zip(stored, prompt_ids)) if a != b),
            min(len(stored), len(prompt_ids)),
        )
        raise StoredIdsMismatch(
            "prompt_mismatch",
            f"assistant message {i}: stored prompt_token_ids ({len(stored)}) differ from the chat template's "
            f"rendering ({len(prompt_ids)}) at token {k}: stored {stored[k : k + 4]}, now {prompt_ids[k : k + 4]}",
        )
    text = tokenizer.decode(
        message["token_ids"], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    if text != message["content"]:
        raise StoredIdsMismatch(
            "content_mismatch",
            f"assistant message {i}: token_ids decode to {text[:40]!r}, the content is {message['content'][:40]!r}",
        )
    verbatim = full[start : start + len(text)] == text
    closes_row = i == len(clean) - 1 and full[:span_end].endswith(closing)
    if start == len(prompt) and full.startswith(prompt) and not verbatim and closes_row:
        return span_end - len(closing)
    if start != len(prompt) or not full.startswith(prompt) or not verbatim:
        raise StoredIdsMismatch(
            "template_mismatch",
            f"assistant message {i}: the chat template does not render its generation prompt followed by "
            f"the reply verbatim (rendered from character {start}: {full[start : start + 40]!r})",
        )
    return start + len(text)


def append_text(tokenizer, full: str, lo: int, hi: int, spans, ids: list[int], mask: list[bool]) -> None:
    """Tokenize ``full[lo:hi]`` alone; a token is a loss token when it starts inside a response span
    (the end-of-turn text after a stored reply, or an assistant turn without stored ids)."""
    if hi <= lo:
        return
    enc = tokenizer(full[lo:hi], add_special_tokens=False, return_offsets_mapping=True)
    starts = lo + np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
    in_span = np.zeros(len(starts), dtype=bool)
    for span_lo, span_hi in spans:
        in_span |= (starts >= span_lo) & (starts < span_hi)
    ids += enc["input_ids"]
    mask += in_span.tolist()
