"""Special tokens as real tokenizers have them: stop ids, padding, end of turn, a safe mask token.

- Stop ids: the generation config's ``eos_token_id`` (an int or a list: Llama-3 lists several),
  else the tokenizer's eos; a tokenizer eos missing from the generation config's list gets a
  warning naming both (generation follows the generation config, as ``generate`` does).
- Padding: tokenizers without a pad token (Llama-3, many base models) pad with an EOS id. Padded
  positions are hidden by the attention mask, so their id never matters.
- End of turn: the first token the chat template writes after a message's content
  (``<|im_end|>``, ``<|eot_id|>``); generation of a user or assistant turn stops there.
- Mask token: DFlash needs a real embedding row that never occurs in data. Chosen
  deterministically, the first safe id of: the tokenizer's own mask token; special tokens named
  reserved/unused/mask, lowest id first (Llama-3's ``<|reserved_special_token_0|>``); the first
  embedding row past the tokenizer's last token (the published Qwen3 drafters use 151669 that
  way); any other special token, highest id first (vocabularies append their rarely used extras
  last). Pad, eos, bos, unk and every token the chat template emits are refused.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

SENTINEL = "\u2063dflash-sentinel\u2063"
RESERVED_NAME = re.compile(r"reserved|unused|mask", re.IGNORECASE)


def as_id_list(value: Any) -> list[int]:
    """An id, a list of ids or None as a list of ints."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def resolve_eos_ids(tokenizer, generation_config=None) -> list[int]:
    """EOS ids for generation: the generation config's, else the tokenizer's; raises if none."""
    configured = as_id_list(getattr(generation_config, "eos_token_id", None))
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    if configured and tokenizer_eos is not None and tokenizer_eos not in configured:
        warnings.warn(
            f"the tokenizer's eos {tokenizer.eos_token!r} (id {tokenizer_eos}) is not in the generation "
            f"config's eos_token_id {configured}; generation stops at the generation config's ids "
            "(fix generation_config.json or the tokenizer if that is wrong)",
            stacklevel=2,
        )
    ids = configured or as_id_list(tokenizer_eos)
    if not ids:
        raise ValueError(
            "the target has no eos token: set eos_token_id in its generation_config.json (or the tokenizer's eos_token)"
        )
    return ids


def pad_id(tokenizer, eos_ids: list[int]) -> int:
    """The tokenizer's pad id, else the first EOS id (always under a zero attention mask)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad) if pad is not None else int(eos_ids[0])


def render(tokenizer, messages: list[dict], generation_prompt: bool = False, **kwargs) -> str:
    """The chat template's text; a template error names the template as the cause."""
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )
    except Exception as err:  # jinja raises many types, incl. raise_exception() in templates
        raise ValueError(
            f"the target's chat template failed on {messages!r}: {type(err).__name__}: {err}"
        ) from err


def end_of_turn_id(tokenizer, role: str, template_kwargs: dict | None = None) -> int:
    """The token the template writes right after a ``role`` message's content.

    Raises a ValueError naming what the template writes instead when that is not a special token
    (generation would have nothing to stop at).
    """
    probe = [{"role": "user", "content": "hi"}] if role == "assistant" else []
    text = render(tokenizer, [*probe, {"role": role, "content": SENTINEL}], **(template_kwargs or {}))
    if text.count(SENTINEL) != 1:
        raise ValueError(f"the chat template does not write a {role} message's content verbatim exactly once")
    closing = text.split(SENTINEL, 1)[1]
    ids = tokenizer(closing, add_special_tokens=False)["input_ids"] if closing else []
    special = set(special_token_ids(tokenizer))
    if not ids or ids[0] not in special:
        raise ValueError(
            f"the chat template writes {closing[:40]!r} after a {role} message, not a special end-of-turn "
            "token, so generation of that turn cannot stop; use a template whose turns end with a special "
            "token (e.g. <|im_end|>, <|eot_id|>)"
        )
    return int(ids[0])


def special_token_ids(tokenizer) -> dict[int, str]:
    """Every special token of the tokenizer (named specials and special added tokens): id -> text."""
    found: dict[int, str] = {}
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            found[int(token_id)] = str(added.content)
    for text, token_id in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids):
        if token_id is not None:
            found.setdefault(int(token_id), text)
    return found


def template_token_ids(tokenizer) -> set[int]:
    """Special ids the chat template emits in system/user/assistant turns, thinking on and off."""
    conversation = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "v"},
    ]
    special = special_token_ids(tokenizer)
    emitted: set[int] = set()
    for kwargs in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
        for messages in (conversation, conversation[1:]):
            try:
                text = tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True, **kwargs
                )
            except Exception:  # a template refusing a probe (e.g. a system turn) emits nothing here
                continue
            emitted.update(i for i in tokenizer(text, add_special_tokens=False)["input_ids"] if i in special)
    return emitted


def choose_mask_token(tokenizer, num_embeddings: int, extra_refused: dict[int, str] | None = None) -> int:
    """A mask token id that is safe for ``tokenizer`` (see the module docstring for the order).

    ``num_embeddings`` is the target's embedding rows; ``extra_refused`` adds ids to refuse (e.g.
    the generation config's eos/pad ids) with the reason shown in the error.
    """
    refused = dict(extra_refused or {})
    for name in ("pad", "eos", "bos", "unk"):
        token_id = getattr(tokenizer, f"{name}_token_id", None)
        if token_id is not None:
            refused.setdefault(int(token_id), name)
    for token_id in template_token_ids(tokenizer):
        refused.setdefault(token_id, "emitted by the chat template")
    special = special_token_ids(tokenizer)
    mask = getattr(tokenizer, "mask_token_id", None)
    tiers = [
        [mask] if mask is not None else [],
        sorted(i for i, text in special.items() if RESERVED_NAME.search(text)),
        [len(tokenizer)] if len(tokenizer) < num_embeddings else [],
        sorted(special, reverse=True),  # the last-added extras (SmolLM2: 16 <empty_output>)
    ]
    for tier in tiers:
        safe = [i for i in tier if i not in refused and 0 <= i < num_embeddings]
        if safe:
            return safe[0]
    listed = ", ".join(f"{i} {special.get(i, '?')!r} ({why})" for i, why in sorted(refused.items())[:20])
    raise ValueError(
        "no safe mask token: the tokenizer has no mask token, no reserved/unused special token, no embedding "
        f"row past its {len(tokenizer)} tokens, and every special token is refused: {listed}. Set "
        "drafter.mask_token_id to an embedding row (0.."
        f"{num_embeddings - 1}) that never occurs in your data."
    )


def describe_token(tokenizer, token_id: int) -> str:
    """``id 'text'`` for logs (an embedding row past the tokenizer shows as such)."""
    if token_id >= len(tokenizer):
        return f"{token_id} (an embedding row past the tokenizer's {len(tokenizer)} tokens)"
    return f"{token_id} {tokenizer.convert_ids_to_tokens(token_id)!r}"


def auto_mask_token_id(target) -> tuple[int, str]:
    """(id, description) of the mask token chosen for a loaded ``FrozenTarget`` without one set.

    Refuses, besides the tokenizer's own pad/eos/bos/unk and template tokens, every pad/eos id of
    the target's configs and generation config.
    """
    from dflash_train.models.target import special_token_ids as config_special_ids

    if target.tokenizer is None:
        raise ValueError(
            "the target has no tokenizer to choose a mask token from: set drafter.mask_token_id to an "
            "embedding row that never occurs in the data (not pad/eos)"
        )
    num_embeddings = target.embed_tokens.weight.shape[0]
    chosen = choose_mask_token(target.tokenizer, num_embeddings, config_special_ids(target))
    return chosen, describe_token(target.tokenizer, chosen)
