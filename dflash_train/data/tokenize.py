"""One conversation to token ids plus a loss mask over the assistant tokens.

The text is the target tokenizer's own chat template (``apply_chat_template``), so the drafter
trains on exactly what the target sees when it serves. ``data.thinking`` becomes the template's
``enable_thinking`` switch when it is not null.

The loss mask marks assistant tokens only. Templates with ``{% generation %}`` markers get it from
transformers (``return_assistant_tokens_mask``). Others (Qwen's ChatML templates have none) get it
from prefix renderings: for assistant turn i,
- the history ``render(messages[:i])`` must be a prefix of the full rendering (else the template
  is not prefix-stable and we refuse, since the mask would be a guess);
- the response starts where ``render(messages[:i], add_generation_prompt=True)`` stops matching
  the full text (the generation prompt is prompt, not response), and no later than the turn's
  content (``content_start``: a history turn rendered without the generation prompt's think text
  may begin with the same characters, a reply starting with ``<`` after ``<think>``);
- it ends after the turn (``render(messages[:i+1])`` without trailing whitespace) when that is a
  prefix of the full text, otherwise after the template's turn-closing text (e.g. ``<|im_end|>``).
  The second case covers templates such as Qwen3's that render the *last* assistant turn
  differently from history turns (an empty ``<think></think>`` stub).
Characters map to tokens through the fast tokenizer's offsets: a token is a response token when
it starts inside a response span.

A reply that ``regen`` cut at ``--max-new-tokens`` (``finished`` False, from the row's
``regen.finished``) did not end there: the target would have continued. Its turn-closing text, which
the template writes after every assistant message, is therefore no label (the drafter must not learn
that the turn ends where the limit fell); only the reply's own content is. On either path the
response span of such a turn ends before the closing text (``label_spans``).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from dflash_train.data.skips import BadRowError

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
SENTINEL = "\u2063dflash-sentinel\u2063"


class TemplateError(ValueError):
    """The chat template cannot give a trustworthy loss mask; fatal, not a per-row skip."""


def template_kwargs(thinking: bool | None) -> dict[str, Any]:
    return {} if thinking is None else {"enable_thinking": thinking}


def has_generation_markers(tokenizer) -> bool:
    template = tokenizer.chat_template
    return isinstance(template, str) and bool(GENERATION_MARKER.search(template))


def check_tokenizer(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the target tokenizer has no chat_template; set one (tokenizer.chat_template = ...) "
            "and save it with the target, since the drafter must see the target's serving format"
        )
    if not has_generation_markers(tokenizer) and not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            "a chat template without {% generation %} markers needs a fast tokenizer (character "
            "offsets) to compute the loss mask; use the tokenizer.json of the target"
        )


def tokenize_chat(
    tokenizer,
    messages: list[dict[str, Any]],
    thinking: bool | None = None,
    finished: list[bool] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [L], loss_mask bool [L]) of one conversation; raises ``BadRowError``.

    ``finished``: one flag per assistant message, in order (``regen.finished``, checked by
    ``data.readers.reply_finished``); a message flagged False was cut at the generation limit and
    its turn-closing tokens get no label. None: every reply ended on its own."""
    kwargs = template_kwargs(thinking)
    if has_generation_markers(tokenizer):
        ids, mask = tokenize_with_markers(tokenizer, messages, kwargs, finished)
    else:
        ids, mask = tokenize_with_prefixes(tokenizer, messages, kwargs, finished)
    return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=bool)


def render(tokenizer, messages: list[dict[str, Any]], kwargs: dict, generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )
    except Exception as err:  # jinja raises many types (incl. raise_exception in templates)
        raise BadRowError("template_error", f"chat template failed: {type(err).__name__}: {err}") from err


def tokenize_with_markers(tokenizer, messages, kwargs, finished=None) -> tuple[list[int], list[int]]:
    try:
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kwargs
        )
    except Exception as err:  # same as render(): the template is user code
        raise BadRowError("template_error", f"chat template failed: {type(err).__name__}: {err}") from err
    ids, mask = out["input_ids"], out["assistant_masks"]
    if finished is None or all(finished):
        return ids, mask
    return ids, unlabel_cut_turn_ends(tokenizer, messages, kwargs, ids, mask, finished)


def unlabel_cut_turn_ends(tokenizer, messages, kwargs, ids, mask, finished: list[bool]) -> list[bool]:
    """The markers' mask with the turn-closing tokens of cut replies unlabelled. The generation
    blocks are the mask's runs of tokens (one per assistant message, in order); their characters come
    from the fast tokenizer's offsets of the same rendering (``apply_chat_template`` tokenizes it
    without added special tokens, as here)."""
    full = render(tokenizer, messages, kwargs)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    runs = mask_runs(np.asarray(mask, dtype=bool))
    if enc["input_ids"] != list(ids):
        raise TemplateError(
            "apply_chat_template tokenized the conversation otherwise than its rendered text, so the "
            "end of turn of a reply cut at the generation limit (regen.finished false) cannot be placed; "
            "remove regen.finished from the rows to train the cut replies with their end-of-turn label."
        )
    if len(runs) != len(finished):
        raise TemplateError(
            f"the chat template's {{% generation %}} blocks ({len(runs)} labelled runs of tokens) do not "
            f"match the {len(finished)} assistant messages one to one, so the end of turn of a reply cut "
            "at the generation limit (regen.finished false) cannot be found. Mark each assistant message "
            "with one generation block, or remove regen.finished from the rows (the cut replies then "
            "train with their end-of-turn label)."
        )
    offsets = enc["offset_mapping"]
    spans = [(offsets[lo][0], offsets[hi - 1][1]) for lo, hi in runs]
    starts = np.asarray([start for start, _ in offsets], dtype=np.int64)
    closing = turn_closing_text(tokenizer, kwargs)
    return spans_to_mask(starts, label_spans(full, spans, finished, closing)).tolist()


def mask_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[lo, hi) token ranges of the runs of True in ``mask``."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def tokenize_with_prefixes(tokenizer, messages, kwargs, finished=None) -> tuple[list[int], list[bool]]:
    text, spans = assistant_char_spans(tokenizer, messages, kwargs)
    if finished is not None and not all(finished):
        spans = label_spans(text, spans, finished, turn_closing_text(tokenizer, kwargs))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = np.asarray([start for start, _ in enc["offset_mapping"]], dtype=np.int64)
    return enc["input_ids"], spans_to_mask(starts, spans).tolist()


def spans_to_mask(starts: np.ndarray, spans) -> np.ndarray:
    """A token is a loss token when its first character (``starts``) is inside one of ``spans``."""
    mask = np.zeros(len(starts), dtype=bool)
    for lo, hi in spans:
        mask |= (starts >= lo) & (starts < hi)
    return mask


def label_spans(
    full: str, spans: list[tuple[int, int]], finished: list[bool] | None, closing: str
) -> list[tuple[int, int]]:
    """The response spans (one per assistant message) whose characters are labels: a span of a reply
    cut at the generation limit (``finished`` False) ends before its turn-closing text."""
    if finished is None:
        return spans
    if len(finished) != len(spans):  # data.readers.reply_finished checked the row's own list
        raise ValueError(f"finished has {len(finished)} flags for {len(spans)} assistant messages")
    return [
        (lo, hi if done else content_end(full, lo, hi, closing, turn))
        for turn, ((lo, hi), done) in enumerate(zip(spans, finished))
    ]


def content_end(full: str, lo: int, hi: int, closing: str, turn: int) -> int:
    """Where the reply's own content ends in the response span ``full[lo:hi]``: before the turn-closing
    text at its end (trailing whitespace aside); ``hi`` for a template that closes a turn with nothing."""
    if not closing:
        return hi
    text = full[lo:hi].rstrip()
    if not text.endswith(closing):
        raise TemplateError(
            f"assistant turn {turn} was cut at the generation limit (regen.finished false), but its "
            f"rendering does not end with the template's turn-closing text {closing!r} "
            f"(it ends {text[-40:]!r}), so its end-of-turn tokens cannot be told from its content. "
            "Remove regen.finished from the rows to train the cut replies with their end-of-turn label."
        )
    return lo + len(text) - len(closing)


def assistant_char_spans(tokenizer, messages, kwargs) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the [start, end) character span of every assistant response."""
    full = render(tokenizer, messages, kwargs)
    closing = turn_closing_text(tokenizer, kwargs)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            start = response_start(tokenizer, messages, i, full, kwargs)
            spans.append((start, response_end(tokenizer, messages, i, full, start, closing, kwargs)))
    return full, spans


def response_start(tokenizer, messages, i: int, full: str, kwargs) -> int:
    if i == 0:  # no generation prompt renders before it: transformers refuses an empty conversation
        return opening_reply_start(tokenizer, messages, i, full, kwargs)
    try:
        history = render(tokenizer, messages[:i], kwargs)
        prompt = render(tokenizer, messages[:i], kwargs, generation_prompt=True)
    except BadRowError:
        if refused_for_a_user_query(messages[:i]):  # Qwen3.5/3.6 refuse a system prompt alone
            return opening_reply_start(tokenizer, messages, i, full, kwargs)
        raise
    start = common_prefix_length(prompt, full)
    if start < len(history):
        raise TemplateError(
            f"the chat template is not prefix-stable: rendering messages[:{i}] is not a prefix of the "
            f"whole conversation (they differ at character {start}: {full[start : start + 40]!r}), so "
            "the loss mask cannot be derived. Use a template with {% generation %} markers."
        )
    if start < len(prompt):  # rendered otherwise than its prompt: the match may run into the reply
        content = content_start(tokenizer, messages, i, full, kwargs)
        start = start if content is None else min(start, content)
    return start


def opening_reply_start(tokenizer, messages, i: int, full: str, kwargs) -> int:
    """Where reply ``i`` starts when no user message precedes it (it opens the conversation, or
    follows a system prompt alone): at its content, the header before it being prompt."""
    start = content_start(tokenizer, messages, i, full, kwargs)
    if start is None:
        raise BadRowError(
            "template_error",
            "the conversation opens with an assistant message and the chat template does not write "
            "its content verbatim, so where its reply starts cannot be found; start the row with a "
            "user message",
        )
    return start


def refused_for_a_user_query(messages) -> bool:
    """Whether a template's refusal to render ``messages`` may be for want of a user query (Qwen3.5/3.6
    raise "No user query found in messages"), which a whole row with one would not meet."""
    return not any(m["role"] == "user" for m in messages)


def content_start(tokenizer, messages, i: int, full: str, kwargs) -> int | None:
    """Where assistant message ``i``'s content starts in ``full`` at the latest: where ``full`` parts
    from the same conversation rendered with a sentinel as that content (the header and whatever the
    template writes before the content are before it). None when the template does not write the
    sentinel (it transforms content)."""
    probe = render(
        tokenizer, [*messages[:i], {**messages[i], "content": SENTINEL}, *messages[i + 1 :]], kwargs
    )
    if SENTINEL not in probe:
        return None
    return common_prefix_length(probe.split(SENTINEL, 1)[0], full)


def response_end(tokenizer, messages, i: int, full: str, start: int, closing: str, kwargs) -> int:
    try:
        turn = render(tokenizer, messages[: i + 1], kwargs).rstrip()
    except BadRowError:
        if not refused_for_a_user_query(messages[: i + 1]):
            raise
        turn = ""  # the turn's end is found in the whole rendering, as that of a rewritten turn
    if turn and full.startswith(turn) and len(turn) > start:
        return len(turn)
    end = end_of_rewritten_turn(full, start, closing)
    if end < 0:
        raise TemplateError(
            f"cannot find the end of assistant turn {i} in the rendered conversation (turn-closing "
            f"text {closing!r}). Use a template with {{% generation %}} markers."
        )
    return end


def end_of_rewritten_turn(full: str, start: int, closing: str) -> int:
    """Where a turn ends in ``full`` when ``full`` renders it otherwise than a conversation ending
    with it (Qwen3 and Qwen3.5/3.6 drop the last assistant turn's empty think block once a user turn
    follows): just past the first turn-closing text at or after ``start``, a position inside the
    turn; -1 when there is none. Shared by the loss mask and ``synth``'s user-turn prefix."""
    end = full.find(closing, start) if closing else -1
    return end + len(closing) if end >= 0 else -1


def turn_closing_text(tokenizer, kwargs) -> str:
    """What the template writes after an assistant message's content (e.g. ``<|im_end|>``)."""
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": SENTINEL}]
    text = render(tokenizer, probe, kwargs)
    return text.split(SENTINEL, 1)[1].rstrip() if SENTINEL in text else ""


def common_prefix_length(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))  # binary search keeps the comparisons in C on long texts
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
