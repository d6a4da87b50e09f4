"""Prompt-file rows to prompt token ids: which rows are prompts, and how their ids start."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

from dflash_train.data.tokenize import tokenize_chat
from dflash_train.eval.prompts import BadPromptRows, PromptRowError, encode_prompt, load_prompt_file
from dflash_train.eval.serve_prompts import load_serve_prompts
from dflash_train.tiny import build_tokenizer
from tests.chat_families import family_tokenizer

CHAT = [{"role": "user", "content": "def add(a, b):"}]
SHAREGPT = [{"from": "human", "value": "def add(a, b):"}]
TEXT = "def add(a, b):"


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def without_template():
    """The tiny ChatML tokenizer with no chat template (it adds no BOS: Qwen-style)."""
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    return tokenizer


def llama_base_tokenizer(*, add_eos_token: bool = False, template: bool = False) -> PreTrainedTokenizerFast:
    """The Llama-3-style tiny tokenizer as a base model ships it: it puts <|begin_of_text|> before a
    text of its own accord (``add_bos_token``), and has no chat template unless ``template``."""
    family = family_tokenizer("llama3")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=family.backend_tokenizer,
        bos_token=family.bos_token,
        eos_token=family.eos_token,
        add_bos_token=True,
        add_eos_token=add_eos_token,
    )
    tokenizer.chat_template = family.chat_template if template else None
    assert tokenizer(TEXT)["input_ids"][0] == tokenizer.bos_token_id
    return tokenizer


# ----------------------------------------------------------------------------- a prompt and a chat


@pytest.mark.parametrize("chat_key, turns", [("messages", CHAT), ("conversations", SHAREGPT)])
@pytest.mark.parametrize("has_template", [True, False])
def test_a_row_with_a_prompt_and_a_chat_is_refused_as_ambiguous(chat_key, turns, has_template):
    """Such a row was taken as its prompt, its conversation silently dropped."""
    tokenizer = build_tokenizer() if has_template else without_template()
    with pytest.raises(PromptRowError) as caught:
        encode_prompt(tokenizer, {"prompt": "something else", chat_key: turns}, None, where="p.jsonl:3")
    assert caught.value.reason == "ambiguous_prompt_row"
    assert f"both 'prompt' and '{chat_key}'" in caught.value.detail
    assert "keep one" in caught.value.detail
    assert str(caught.value).startswith("p.jsonl:3: ")


def test_ambiguous_rows_are_counted_and_named_like_other_bad_rows(tokenizer, tmp_path):
    path = write_rows(
        tmp_path / "p.jsonl",
        [
            {"prompt": TEXT},
            {"prompt": "something else", "messages": CHAT},
            {"messages": CHAT},
            {"prompt": "something else", "conversations": SHAREGPT},
        ],
    )
    with pytest.raises(ValueError, match=r"p\.jsonl:2: bad prompt row \(ambiguous_prompt_row\): .*keep one"):
        load_prompt_file(path, tokenizer)
    loaded = load_prompt_file(path, tokenizer, bad_rows=BadPromptRows(max_bad_rows=2))
    assert len(loaded.prompts) == 2 and loaded.skipped == {"ambiguous_prompt_row": 2}


def test_serve_check_refuses_an_ambiguous_row_too(tokenizer, tmp_path):
    """serve-check sends the engine the row's turns: it took the prompt there as well."""
    path = write_rows(tmp_path / "p.jsonl", [{"prompt": "something else", "messages": CHAT}])
    with pytest.raises(ValueError, match=r"p\.jsonl:1: .*both 'prompt' and 'messages'"):
        load_serve_prompts([str(path)], tokenizer, num_prompts=1)


def test_a_null_chat_beside_a_prompt_is_not_ambiguous(tokenizer):
    """Only a second prompt form is ambiguous: a row with a ``null`` messages field is a prompt row."""
    assert encode_prompt(tokenizer, {"prompt": TEXT, "messages": None}, None) == encode_prompt(
        tokenizer, {"prompt": TEXT}, None
    )


@pytest.mark.parametrize("chat_key, turns", [("messages", CHAT), ("conversations", SHAREGPT)])
def test_a_prompt_repeating_the_chats_first_request_is_a_chat_row(tokenizer, chat_key, turns):
    """ultrachat_200k's rows carry the opening request as 'prompt' beside the whole chat; training reads
    the chat, and so does the eval: refusing them would refuse the whole dataset."""
    multi = [*turns, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and more?"}]
    if chat_key == "conversations":
        multi = [*turns, {"from": "gpt", "value": "ok"}, {"from": "human", "value": "and more?"}]
    row = {"prompt": TEXT, chat_key: multi}
    assert encode_prompt(tokenizer, row, None) == encode_prompt(tokenizer, {chat_key: multi}, None)


# ----------------------------------------------------------------------------- how a prompt starts


def test_a_plain_prompt_without_template_starts_with_the_tokenizers_bos():
    """A Llama-style base tokenizer puts BOS before every text it encodes, and the target was trained
    and is served (completions) that way; the prompt was encoded without it."""
    tokenizer = llama_base_tokenizer()
    text_ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert encode_prompt(tokenizer, {"prompt": TEXT}, None) == [tokenizer.bos_token_id, *text_ids]


def test_a_plain_prompt_never_ends_with_the_eos_a_tokenizer_appends():
    tokenizer = llama_base_tokenizer(add_eos_token=True)
    assert tokenizer(TEXT)["input_ids"][-1] == tokenizer.eos_token_id
    text_ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert encode_prompt(tokenizer, {"prompt": TEXT}, None) == [tokenizer.bos_token_id, *text_ids]


def test_a_plain_prompt_without_template_or_bos_is_the_text_alone():
    tokenizer = without_template()
    assert encode_prompt(tokenizer, {"prompt": TEXT}, None) == tokenizer(TEXT)["input_ids"]


def test_a_templated_prompt_starts_as_training_rows_start_with_one_bos():
    """With a chat template the template writes the BOS (Llama 3's does); the tokenizer adding its own
    would double it. Training tokenizes the same rendering the same way, so the prompt is the start
    of the training row of the same turn."""
    tokenizer = llama_base_tokenizer(template=True)
    prompt = encode_prompt(tokenizer, {"prompt": TEXT}, None)
    assert prompt[0] == tokenizer.bos_token_id and prompt[1] != tokenizer.bos_token_id
    ids, _ = tokenize_chat(tokenizer, [*CHAT, {"role": "assistant", "content": "return a + b"}])
    assert ids[: len(prompt)].tolist() == prompt
