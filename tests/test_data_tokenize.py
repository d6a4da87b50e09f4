"""Chat template tokenization, the assistant loss mask and the tokenized-data cache."""

import json
import os

import numpy as np
import pytest

from dflash_train.config import DataConfig, load_config
from dflash_train.data.cache import MAX_TOKENIZE_WORKERS, load_or_build, tokenize_workers
from dflash_train.data.tokenize import TemplateError, has_generation_markers, tokenize_chat
from dflash_train.tiny import CHAT_TEMPLATE, build_tokenizer

# Modelled on Qwen3's ChatML template: no {% generation %} markers, reasoning split out of the
# content, history turns rendered without <think>, the last turn with an (empty) think block, and
# enable_thinking=false adding an empty think block to the generation prompt.
QWEN_STYLE_TEMPLATE = (
    "{%- set ns = namespace(last_query_index=-1) -%}"
    "{%- for message in messages -%}{%- if message.role == 'user' -%}"
    "{%- set ns.last_query_index = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- set content = message.content -%}"
    "{%- if message.role == 'assistant' -%}"
    "{%- set reasoning = '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}"
)

CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what is two plus two?"},
    {"role": "assistant", "content": "two plus two is four."},
    {"role": "user", "content": "and in python?"},
    {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
]


def with_template(tokenizer, template):
    copy = build_tokenizer()
    copy.chat_template = template
    return copy


def masked_spans(tokenizer, ids, mask) -> list[str]:
    """Decoded text of each contiguous run of loss-mask tokens."""
    spans, current = [], []
    for token, on in zip(ids.tolist(), mask.tolist()):
        if on:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    return [tokenizer.decode(s) for s in spans]


def test_generation_markers_mask_only_assistant_turns(tokenizer):
    assert has_generation_markers(tokenizer)
    ids, mask = tokenize_chat(tokenizer, CONVERSATION)
    assert ids.dtype == np.int32 and mask.dtype == bool and len(ids) == len(mask)
    assert masked_spans(tokenizer, ids, mask) == [
        "two plus two is four.<|im_end|>",
        "def add(a, b):\n    return a + b<|im_end|>",
    ]


def test_prefix_rendering_matches_generation_markers(tokenizer):
    """The same template without markers takes the prefix path and must give the same mask."""
    plain = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    unmarked = with_template(tokenizer, plain)
    assert not has_generation_markers(unmarked)
    ids_a, mask_a = tokenize_chat(tokenizer, CONVERSATION)
    ids_b, mask_b = tokenize_chat(unmarked, CONVERSATION)
    assert ids_a.tolist() == ids_b.tolist()
    assert mask_a.tolist() == mask_b.tolist()


OPENS_WITH_ASSISTANT = [
    {"role": "assistant", "content": "hello, how can I help?"},
    {"role": "user", "content": "what is two plus two?"},
    {"role": "assistant", "content": "four."},
]


@pytest.mark.parametrize(
    "family", ["markers", "no markers", "smollm2", "llama3", "qwen3", "qwen3.5", "qwen3.6"]
)
def test_a_conversation_opening_with_an_assistant_message_labels_its_reply_only(tokenizer, family):
    """No generation prompt can be rendered before an opening assistant message (transformers refuses
    an empty conversation); what the template writes before its content (the assistant header, a
    default system prompt) is prompt, as before every other reply."""
    from tests.chat_families import QWEN_TEMPLATES, family_tokenizer, qwen_tokenizer

    if family in ("markers", "no markers"):
        tok = tokenizer_for(tokenizer, family)
    else:
        tok = qwen_tokenizer(family) if family in QWEN_TEMPLATES else family_tokenizer(family)
    end_of_turn = {"llama3": "<|eot_id|>"}.get(family, "<|im_end|>")
    ids, mask = tokenize_chat(tok, OPENS_WITH_ASSISTANT)
    answered = masked_spans(tok, *tokenize_chat(tok, OPENS_WITH_ASSISTANT[1:]))  # the reply to the user
    assert masked_spans(tok, ids, mask) == [OPENS_WITH_ASSISTANT[0]["content"] + end_of_turn, *answered]


@pytest.mark.parametrize("family", ["smollm2", "llama3", "qwen3", "qwen3.5", "qwen3.6"])
def test_a_reply_after_only_a_system_prompt_labels_its_reply_only(family):
    """Qwen3.5/3.6 refuse to render a conversation without a user query (the system prompt alone, or
    it and the opening reply), though they render the whole row: the row still trains, its opening
    reply labelled from its content as a reply opening the conversation is."""
    from tests.chat_families import QWEN_TEMPLATES, family_tokenizer, qwen_tokenizer

    tok = qwen_tokenizer(family) if family in QWEN_TEMPLATES else family_tokenizer(family)
    end_of_turn = {"llama3": "<|eot_id|>"}.get(family, "<|im_end|>")
    system = {"role": "system", "content": "be brief"}
    ids, mask = tokenize_chat(tok, [system, *OPENS_WITH_ASSISTANT])
    answered = masked_spans(tok, *tokenize_chat(tok, [system, *OPENS_WITH_ASSISTANT[1:]]))
    assert masked_spans(tok, ids, mask) == [OPENS_WITH_ASSISTANT[0]["content"] + end_of_turn, *answered]


@pytest.mark.parametrize(
    ("family", "thinking"), [("qwen", False), ("qwen3", False), ("qwen3.5", None), ("qwen3.6", None)]
)
def test_a_history_reply_starting_like_the_generation_prompt_keeps_its_first_label(
    tokenizer, family, thinking
):
    """Qwen's generation prompt ends with think text ("<think>\\n") that a history reply's rendering
    lacks: a reply starting with "<" (HTML, XML, JSX) still starts at its own first character."""
    from tests.chat_families import qwen_tokenizer

    tok = tokenizer_for(tokenizer, family) if family == "qwen" else qwen_tokenizer(family)
    messages = [
        {"role": "user", "content": "write html"},
        {"role": "assistant", "content": "<div>hi</div>"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "<p>ok</p>"},
    ]
    ids, mask = tokenize_chat(tok, messages, thinking=thinking)
    assert masked_spans(tok, ids, mask)[0] == "<div>hi</div><|im_end|>"


def test_qwen_style_template_multi_turn(tokenizer):
    qwen = with_template(tokenizer, QWEN_STYLE_TEMPLATE)
    ids, mask = tokenize_chat(qwen, CONVERSATION)
    text = qwen.decode(ids.tolist())
    assert "<|im_start|>assistant\ntwo plus two" in text  # history turn: no think block
    assert masked_spans(qwen, ids, mask) == [
        "two plus two is four.<|im_end|>",
        "<think>\n\n</think>\n\ndef add(a, b):\n    return a + b<|im_end|>",  # the target emits it
    ]


def test_qwen_style_thinking_off_puts_think_stub_in_the_prompt(tokenizer):
    qwen = with_template(tokenizer, QWEN_STYLE_TEMPLATE)
    ids, mask = tokenize_chat(qwen, CONVERSATION, thinking=False)
    spans = masked_spans(qwen, ids, mask)
    assert spans[-1] == "def add(a, b):\n    return a + b<|im_end|>"
    assert "<think>" in qwen.decode(ids.tolist())


def test_qwen_style_keeps_reasoning_of_last_turn(tokenizer):
    qwen = with_template(tokenizer, QWEN_STYLE_TEMPLATE)
    messages = CONVERSATION[:2] + [{"role": "assistant", "content": "<think>\nadd them\n</think>\n\nfour"}]
    ids, mask = tokenize_chat(qwen, messages)
    assert masked_spans(qwen, ids, mask) == ["<think>\nadd them\n</think>\n\nfour<|im_end|>"]


def test_template_that_is_not_prefix_stable_raises(tokenizer):
    unstable = with_template(tokenizer, "{{ messages|length }}" + QWEN_STYLE_TEMPLATE)
    with pytest.raises(TemplateError, match="not prefix-stable"):
        tokenize_chat(unstable, CONVERSATION)


# ----------------------------------------------------------------------------- cache


def write_rows(path, num_rows):
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": "x" * (i + 3)},
            ]
        }
        for i in range(num_rows)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_cache_is_reused_and_invalidated_by_file_changes(tmp_path, tokenizer):
    data = tmp_path / "chat.jsonl"
    write_rows(data, 5)
    cfg = DataConfig(paths=[str(data)], cache_dir=str(tmp_path / "cache"), num_workers=1)
    first = load_or_build(cfg, tokenizer)
    assert first.num_rows == 5
    again = load_or_build(cfg, tokenizer, build=False)  # no rebuild needed
    assert again is not None and again.directory == first.directory
    assert np.array_equal(np.asarray(again.ids), np.asarray(first.ids))
    write_rows(data, 7)
    assert load_or_build(cfg, tokenizer, build=False) is None  # size/mtime changed: new key
    assert load_or_build(cfg, tokenizer).num_rows == 7
    thinking = DataConfig(paths=[str(data)], cache_dir=str(tmp_path / "cache"), thinking=False)
    assert load_or_build(thinking, tokenizer, build=False) is None  # settings are part of the key


def test_num_workers_0_tokenizes_on_the_cpus_this_process_may_use(monkeypatch):
    """The default: one rank builds the cache, so it may use every CPU it is given (capped)."""
    assert DataConfig().num_workers == 0
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(128)), raising=False)
    assert tokenize_workers(DataConfig()) == MAX_TOKENIZE_WORKERS
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6}, raising=False)
    assert tokenize_workers(DataConfig()) == 3
    assert tokenize_workers(DataConfig(num_workers=5)) == 5  # given: as given
    with pytest.raises(ValueError, match="data.num_workers=-1"):
        load_config("tiny-cpu", ["output_dir=/tmp/x", "data.num_workers=-1"])


def test_parallel_workers_match_single_process(tmp_path, tokenizer):
    data = tmp_path / "chat.jsonl"
    write_rows(data, 100)
    single = DataConfig(paths=[str(data)], cache_dir=str(tmp_path / "a"), num_workers=1)
    parallel = DataConfig(paths=[str(data)], cache_dir=str(tmp_path / "b"), num_workers=2)
    a, b = load_or_build(single, tokenizer), load_or_build(parallel, tokenizer)
    assert np.array_equal(np.asarray(a.ids), np.asarray(b.ids))
    assert np.array_equal(np.asarray(a.loss_mask), np.asarray(b.loss_mask))
    assert np.array_equal(a.origins, b.origins)
    assert a.where(3) == f"{data}:4"


# ----------------------------------------------------------------------------- stored token ids


def split_of_a_merged_token(tokenizer) -> tuple[str, list[int]]:
    """(text, ids that decode to it but are not its tokenization): what an undertrained target emits."""
    from tests.test_data_regen import split_merged_token

    text, _, split = split_merged_token(tokenizer)
    return text, split


def prompt_ids(tokenizer, messages, **kwargs) -> list[int]:
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def generated_reply(tokenizer, history, token_ids, **kwargs) -> dict:
    """The assistant message regen writes for ``token_ids`` generated after ``history``."""
    return {
        "role": "assistant",
        "content": tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False),
        "token_ids": list(token_ids),
        "prompt_token_ids": prompt_ids(tokenizer, history, **kwargs),
    }


def build_rows(tmp_path, tokenizer, rows, name="chat.jsonl", **overrides):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = dict(cache_dir=str(tmp_path / "cache"), num_workers=1)
    return path, load_or_build(DataConfig(paths=[str(path)], **(settings | overrides)), tokenizer)


def ids_of(text_or_token, tokenizer) -> list[int]:
    return tokenizer(text_or_token, add_special_tokens=False)["input_ids"]


def test_stored_ids_train_as_the_prompt_then_the_generated_ids(tmp_path, tokenizer):
    text, split = split_of_a_merged_token(tokenizer)
    history = [{"role": "user", "content": "what is two plus two?"}]
    reply = generated_reply(tokenizer, history, split)
    old = {"messages": [*history, {"role": "assistant", "content": text}]}
    _, data = build_rows(tmp_path, tokenizer, [old, {"messages": [*history, reply]}])
    # With ids: the prompt the target saw, the ids it generated, then the template's end of turn.
    ids, mask = (a.tolist() for a in data.row(1))
    prompt, end_of_turn = reply["prompt_token_ids"], ids_of("<|im_end|>", tokenizer)
    assert ids == prompt + split + end_of_turn + ids_of("\n", tokenizer)
    assert mask == [False] * len(prompt) + [True] * (len(split) + len(end_of_turn)) + [False]
    # A row without ids is tokenized from its text exactly as before (to other ids than generated).
    text_ids, text_mask = tokenize_chat(tokenizer, old["messages"])
    assert data.row(0)[0].tolist() == text_ids.tolist() and data.row(0)[1].tolist() == text_mask.tolist()
    assert ids != text_ids.tolist()
    assert data.id_sources.tolist() == [0, 1]


def two_generated_turns(tokenizer):
    """(system, user, reply with a non-round-tripping split, user, reply): the messages, the first
    reply's split and the second reply's ids."""
    text, split = split_of_a_merged_token(tokenizer)
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    reply_one = generated_reply(tokenizer, first, split)
    second = [*first, {"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
    second_ids = ids_of("two plus two is four.", tokenizer)
    reply_two = generated_reply(tokenizer, second, second_ids)
    return [*first, reply_one, *second[3:], reply_two], split, second_ids


def test_stored_ids_of_every_turn_of_a_multi_turn_row(tmp_path, tokenizer):
    messages, split, second_ids = two_generated_turns(tokenizer)
    _, data = build_rows(tmp_path, tokenizer, [{"messages": messages}])
    ids, mask = (a.tolist() for a in data.row(0))
    end = ids_of("<|im_end|>", tokenizer)
    # The second prompt continues after the first reply's end of turn (the template text in between).
    glue = ids_of("\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n", tokenizer)
    expected = (
        messages[2]["prompt_token_ids"] + split + end + glue + second_ids + end + ids_of("\n", tokenizer)
    )
    assert ids == expected
    assert masked_spans(tokenizer, np.asarray(ids), np.asarray(mask)) == [
        tokenizer.decode(split + end),
        "two plus two is four.<|im_end|>",
    ]
    assert data.id_sources.tolist() == [1]


@pytest.mark.parametrize(
    ("family", "reply", "finished"),
    [
        ("qwen3.5", "I should greet them", False),  # cut inside the think block its prompt opened
        ("qwen3", "<think>\nI should greet them", False),  # cut inside the think block it opened
        ("qwen3.5", "greet them\n</think>\n\nhello\n", True),  # the template trims its last newline
    ],
)
def test_the_last_reply_trains_as_generated_where_the_template_renders_it_otherwise(
    tmp_path, family, reply, finished
):
    """Qwen's templates render a reply without ``</think>`` (cut at the limit inside its reasoning)
    after an empty think block the target never wrote, and trim a reply's trailing whitespace. The
    reply closing the row needs no rendering of its own to be followed by later turns: it trains as
    the prompt the target was given and the ids it generated, then the end of turn (a label only
    for a reply that ended on its own)."""
    from tests.chat_families import qwen_tokenizer

    tok = qwen_tokenizer(family)
    history = [{"role": "user", "content": "hi"}]
    generated = ids_of(reply, tok)
    message = generated_reply(tok, history, generated)
    _, data = build_rows(tmp_path, tok, [regen_row([*history, message], [finished])])
    ids, mask = (a.tolist() for a in data.row(0))
    prompt, end, newline = message["prompt_token_ids"], ids_of("<|im_end|>", tok), ids_of("\n", tok)
    assert ids == prompt + generated + end + newline
    assert mask == [False] * len(prompt) + [True] * len(generated) + [finished] * len(end) + [False]
    assert data.id_sources.tolist() == [1] and data.id_fallbacks == {}


@pytest.mark.parametrize(
    ("family", "reply", "finished"),
    [
        ("qwen3.5", "I should greet them", False),  # cut inside the think block its prompt opened
        ("qwen3", "<think>\nI should greet them", False),  # cut inside the think block it opened
        ("qwen3.5", "greet them\n</think>\n\nhello\n", True),  # the template trims its last newline
    ],
)
def test_the_last_reply_of_a_regen_row_without_ids_trains_as_generated(tmp_path, family, reply, finished):
    """``regen --endpoint`` stores text only, and a regen reply's content is what the target generated
    after the generation prompt: where the template renders it otherwise, the closing reply trains as
    the prompt, the content's tokens and the end of turn, not after an empty think block the target
    never wrote. A row not written by regen (no ``regen.finished``) is a chat answer for the template
    to format and keeps its rendering."""
    from tests.chat_families import qwen_tokenizer

    tok = qwen_tokenizer(family)
    history = [{"role": "user", "content": "hi"}]
    messages = [*history, {"role": "assistant", "content": reply}]
    _, data = build_rows(tmp_path, tok, [regen_row(messages, [finished]), {"messages": messages}])
    ids, mask = (a.tolist() for a in data.row(0))
    prompt, generated = prompt_ids(tok, history), ids_of(reply, tok)
    end, newline = ids_of("<|im_end|>", tok), ids_of("\n", tok)
    assert ids == prompt + generated + end + newline
    assert mask == [False] * len(prompt) + [True] * len(generated) + [finished] * len(end) + [False]
    text_ids, text_mask = tokenize_chat(tok, messages)
    assert data.row(1)[0].tolist() == text_ids.tolist() != ids
    assert data.row(1)[1].tolist() == text_mask.tolist()
    assert data.id_sources.tolist() == [0, 0] and data.id_fallbacks == {}


def test_a_regen_reply_split_by_a_reasoning_parser_keeps_its_rendering(tmp_path):
    """Its content lacks the reasoning in ``reasoning_content``: the reply as generated cannot be rebuilt."""
    from tests.chat_families import qwen_tokenizer

    tok = qwen_tokenizer("qwen3.5")
    reply = {"role": "assistant", "content": "hello", "reasoning_content": "I should greet them"}
    messages = [{"role": "user", "content": "hi"}, reply]
    _, data = build_rows(tmp_path, tok, [regen_row(messages, [True])])
    text_ids, text_mask = tokenize_chat(tok, messages)
    assert data.row(0)[0].tolist() == text_ids.tolist()
    assert data.row(0)[1].tolist() == text_mask.tolist()


def test_the_last_reply_of_a_multi_turn_regen_row_without_ids_trains_as_generated(tmp_path):
    """The history replies keep their text and labels; the closing one is the content's tokens after
    its generation prompt."""
    from tests.chat_families import qwen_tokenizer

    tok = qwen_tokenizer("qwen3.5")
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "and then?"},
    ]
    reply = "I should answer"
    messages = [*history, {"role": "assistant", "content": reply}]
    _, data = build_rows(tmp_path, tok, [regen_row(messages, [True, False])])
    ids, mask = data.row(0)
    prompt, generated = prompt_ids(tok, history), ids_of(reply, tok)
    assert ids.tolist() == prompt + generated + ids_of("<|im_end|>\n", tok)
    assert masked_spans(tok, ids, mask) == ["hello<|im_end|>", reply]


def test_a_stored_prompt_unlike_the_rendering_is_counted_and_trains_from_text(tmp_path, tokenizer, capsys):
    _, split = split_of_a_merged_token(tokenizer)
    history = [{"role": "user", "content": "hi"}]
    thinking_off = generated_reply(tokenizer, history, split, enable_thinking=False)  # regen --thinking off
    edited = generated_reply(tokenizer, history, split) | {"content": "an edited reply"}
    good = generated_reply(tokenizer, history, split)
    rows = [{"messages": [*history, m]} for m in (thinking_off, edited, good)]
    _, data = build_rows(tmp_path, tokenizer, rows)  # data.thinking: null, the template's default
    assert data.id_fallbacks == {"prompt_mismatch": 1, "content_mismatch": 1}
    assert data.id_sources.tolist() == [0, 0, 1]
    clean = [{"role": m["role"], "content": m["content"]} for m in rows[1]["messages"]]
    assert data.row(1)[0].tolist() == tokenize_chat(tokenizer, clean)[0].tolist()
    assert (
        "chat.jsonl:1: assistant message 1: stored prompt_token_ids"
        in data.id_fallback_examples["prompt_mismatch"]
    )
    assert "2 rows store token ids that do not fit" in capsys.readouterr().err
    # A template that renders the reply's context otherwise than its generation prompt (a Qwen3-style
    # history turn without the think stub that enable_thinking=false put into the prompt) is counted too.
    qwen = with_template(tokenizer, QWEN_STYLE_TEMPLATE)
    first = generated_reply(qwen, history, split, enable_thinking=False)
    row = [*history, first, {"role": "user", "content": "more"}, {"role": "assistant", "content": "four"}]
    _, data = build_rows(tmp_path, qwen, [{"messages": row}], name="qwen.jsonl", thinking=False)
    assert data.id_fallbacks == {"template_mismatch": 1} and data.id_sources.tolist() == [0]
    _, data = build_rows(tmp_path, qwen, [{"messages": [*history, first]}], name="last.jsonl", thinking=False)
    assert data.id_fallbacks == {} and data.id_sources.tolist() == [1]  # the last turn keeps its stub
    # Per reply: the history reply is text, the last reply after it is its stored ids.
    second = [*row[:3]]
    last = generated_reply(qwen, second, split, enable_thinking=False)
    _, data = build_rows(tmp_path, qwen, [{"messages": [*second, last]}], name="both.jsonl", thinking=False)
    assert data.id_fallbacks == {"template_mismatch": 1} and data.id_sources.tolist() == [1]
    ids = data.row(0)[0].tolist()
    prompt = last["prompt_token_ids"]
    assert ids[: len(prompt)] == prompt and ids[len(prompt) : len(prompt) + len(split)] == split


@pytest.mark.parametrize("template", ["markers", "no markers", "qwen"])
@pytest.mark.parametrize("thinking", [None, False])
def test_replies_that_round_trip_train_exactly_as_their_text(tokenizer, template, thinking):
    """Stored ids equal to the text's own tokenization give the text path's ids and mask, bit for
    bit, whichever replies the template lets them replace."""
    from dflash_train.data.stored_ids import tokenize_training_row

    plain = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    chosen = {"markers": tokenizer, "no markers": with_template(tokenizer, plain)}
    tok = chosen.get(template) or with_template(tokenizer, QWEN_STYLE_TEMPLATE)
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    messages = []
    for m in CONVERSATION:
        canonical = ids_of(m["content"], tok)
        messages.append(
            generated_reply(tok, messages, canonical, **kwargs) if m["role"] == "assistant" else m
        )
    row = tokenize_training_row(tok, messages, thinking)
    ids, mask = (a.tolist() for a in tokenize_chat(tok, CONVERSATION, thinking))
    if template == "qwen" and thinking is None:
        # The text path renders the last reply after an empty think block that its ids, generated
        # right after the prompt, lack: the row holds the reply as generated, without the block.
        prompt, stub = len(messages[-1]["prompt_token_ids"]), ids_of("<think>\n\n</think>\n\n", tok)
        assert ids[prompt : prompt + len(stub)] == stub
        ids, mask = (x[:prompt] + x[prompt + len(stub) :] for x in (ids, mask))
    assert row.ids.tolist() == ids and row.loss_mask.tolist() == mask
    # Which replies could take their ids: all with the plain templates and default thinking; with
    # thinking off the history reply was generated after a think stub its rendering lacks.
    assert row.from_token_ids == (template == "qwen" or thinking is None)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"token_ids": ["7"]}, r"message 1 token_ids\[0\] = '7' is not a token id"),
        ({"token_ids": [7, 1.0]}, r"message 1 token_ids\[1\] = 1.0 is not a token id"),
        ({"token_ids": [True]}, r"message 1 token_ids\[0\] = True is not a token id"),
        ({"prompt_token_ids": [-1]}, r"message 1 prompt_token_ids\[0\] = -1 is not a token id"),
        ({"token_ids": 7}, "message 1 token_ids must be a list of integers, got int"),
        (
            {"token_ids": [7, 100000]},
            r"message 1 token_ids\[1\] = 100000 is outside the tokenizer's 320 tokens",
        ),
    ],
)
@pytest.mark.parametrize("num_workers", [1, 2])
def test_malformed_token_ids_name_the_file_and_line(tmp_path, tokenizer, change, message, num_workers):
    history = [{"role": "user", "content": "hi"}]
    good = {"messages": [*history, generated_reply(tokenizer, history, [7, 8])]}
    bad = {"messages": [*history, generated_reply(tokenizer, history, [7, 8]) | change]}
    with pytest.raises(ValueError, match=rf"chat.jsonl:2: bad row \(malformed_token_ids\): {message}"):
        build_rows(tmp_path, tokenizer, [good, bad], num_workers=num_workers)


def test_token_ids_must_come_in_pairs_and_only_on_assistant_messages(tmp_path, tokenizer):
    history = [{"role": "user", "content": "hi"}]
    reply = generated_reply(tokenizer, history, [7, 8])
    alone = {k: v for k, v in reply.items() if k != "prompt_token_ids"}
    with pytest.raises(ValueError, match="message 1 has token_ids without prompt_token_ids; store both"):
        build_rows(tmp_path, tokenizer, [{"messages": [*history, alone]}])
    user = history[0] | {"token_ids": [7], "prompt_token_ids": [1]}
    with pytest.raises(ValueError, match=r"message 0 \(user\) has token_ids; only assistant messages"):
        build_rows(tmp_path, tokenizer, [{"messages": [user, reply]}], name="user.jsonl")
    _, data = build_rows(
        tmp_path, tokenizer, [{"messages": [*history, alone]}], name="b.jsonl", max_bad_rows=1
    )
    assert data.skips.to_dict() == {"malformed_token_ids": 1}


# ----------------------------------------------------------------------------- prompts stored once


def with_shared_prompts(messages):
    """The row as regen writes it now: every reply after one with ids stores what its prompt adds."""
    from dflash_train.data.stored_prompts import prompt_fields

    out = []
    for m in messages:
        if "prompt_token_ids" in m and any(p["role"] == "assistant" for p in out):
            m = {k: v for k, v in m.items() if k != "prompt_token_ids"} | prompt_fields(
                m["prompt_token_ids"], out
            )
        out.append(m)
    return out


def test_a_prompt_stored_as_what_it_adds_to_the_previous_reply_trains_as_the_full_prompt(tmp_path, tokenizer):
    messages, split, _ = two_generated_turns(tokenizer)
    shared = with_shared_prompts(messages)
    second = shared[-1]
    assert "prompt_token_ids" not in second and second["prompt_token_ids_from_previous"] > 0
    # It shares the first reply's whole prompt; its tail starts where the first reply's re-tokenized
    # text leaves the split the target generated.
    full_second, first_prompt = messages[-1]["prompt_token_ids"], messages[2]["prompt_token_ids"]
    shared_ids = second["prompt_token_ids_from_previous"]
    assert len(first_prompt) <= shared_ids < len(first_prompt) + len(split)
    assert second["prompt_token_ids_tail"] == full_second[shared_ids:]
    _, data = build_rows(tmp_path, tokenizer, [{"messages": messages}, {"messages": shared}])
    assert data.row(0)[0].tolist() == data.row(1)[0].tolist()
    assert data.row(0)[1].tolist() == data.row(1)[1].tolist()
    assert data.id_sources.tolist() == [1, 1] and data.id_fallbacks == {}


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda m: (
                m[:2] + [m[2] | {"prompt_token_ids_from_previous": 0, "prompt_token_ids_tail": [1]}] + m[3:]
            ),
            "message 2 has prompt_token_ids and prompt_token_ids_from_previous; store the prompt one way",
        ),
        (
            lambda m: m[:-1] + [{k: v for k, v in m[-1].items() if k != "prompt_token_ids_tail"}],
            "message 4 has prompt_token_ids_from_previous without prompt_token_ids_tail; store both",
        ),
        (
            lambda m: m[:-1] + [m[-1] | {"prompt_token_ids_from_previous": True}],
            "message 4 prompt_token_ids_from_previous = True is not an integer >= 0",
        ),
        (
            lambda m: m[:-1] + [m[-1] | {"prompt_token_ids_from_previous": 10**6}],
            "message 4 prompt_token_ids_from_previous = 1000000 exceeds the",
        ),
        (
            lambda m: m[:2] + [{"role": "assistant", "content": m[2]["content"]}] + m[3:],
            "message 4 has prompt_token_ids_from_previous but the assistant message before it stores no",
        ),
        (
            lambda m: m[:-1] + [m[-1] | {"prompt_token_ids_tail": [1, "x"]}],
            r"message 4 prompt_token_ids_tail\[1\] = 'x' is not a token id",
        ),
    ],
)
def test_malformed_shared_prompts_are_bad_rows(tmp_path, tokenizer, change, message):
    messages, _, _ = two_generated_turns(tokenizer)
    bad = change(with_shared_prompts(messages))
    with pytest.raises(ValueError, match=rf"chat.jsonl:1: bad row \(malformed_token_ids\): {message}"):
        build_rows(tmp_path, tokenizer, [{"messages": bad}])


# ----------------------------------------------------------------------------- replies cut at the limit


def tokenizer_for(tokenizer, template: str):
    """The tiny tokenizer with its marker template, the same without markers, or the Qwen-style one."""
    plain = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    if template == "markers":
        return tokenizer
    return with_template(tokenizer, plain if template == "no markers" else QWEN_STYLE_TEMPLATE)


def labelled_end_of_turn(tokenizer, ids, mask) -> list[bool]:
    """Per ``<|im_end|>`` closing an assistant turn (in order), whether it is a loss token."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    header = ids_of("<|im_start|>assistant\n", tokenizer)
    ids, flags, in_reply = ids.tolist(), [], False
    for k, token in enumerate(ids):
        if ids[k : k + len(header)] == header:
            in_reply = True
        elif token == end and in_reply:
            flags.append(bool(mask[k]))
            in_reply = False
    return flags


@pytest.mark.parametrize("template", ["markers", "no markers", "qwen"])
def test_a_reply_cut_at_the_limit_has_no_end_of_turn_label(tokenizer, template):
    """regen.finished false: the target would have gone on, so its turn end is no label; the reply's
    own tokens keep theirs, and a finished reply (or a row without the flags) keeps its end of turn."""
    tok = tokenizer_for(tokenizer, template)
    messages = CONVERSATION[:3]
    ids, mask = tokenize_chat(tok, messages)
    assert labelled_end_of_turn(tok, ids, mask) == [True]
    for finished in ([True], None):
        same = tokenize_chat(tok, messages, finished=finished)
        assert same[0].tolist() == ids.tolist() and same[1].tolist() == mask.tolist()
    cut_ids, cut_mask = tokenize_chat(tok, messages, finished=[False])
    assert cut_ids.tolist() == ids.tolist()  # the tokens stay; only their labels change
    assert labelled_end_of_turn(tok, cut_ids, cut_mask) == [False]
    assert masked_spans(tok, cut_ids, cut_mask) == [
        masked_spans(tok, ids, mask)[0].removesuffix("<|im_end|>")
    ]
    assert int(mask.sum()) - int(cut_mask.sum()) == 1


@pytest.mark.parametrize("template", ["markers", "no markers", "qwen"])
@pytest.mark.parametrize("finished", [[False, True], [True, False], [False, False]])
def test_each_cut_reply_of_a_multi_turn_row_loses_its_own_end_of_turn(tokenizer, template, finished):
    tok = tokenizer_for(tokenizer, template)
    ids, mask = tokenize_chat(tok, CONVERSATION, finished=finished)
    assert labelled_end_of_turn(tok, ids, mask) == finished
    full_ids, full_mask = tokenize_chat(tok, CONVERSATION)
    assert ids.tolist() == full_ids.tolist()
    assert int(full_mask.sum()) - int(mask.sum()) == finished.count(False)
    replies = masked_spans(tok, full_ids, full_mask)  # what each reply labels when it ended on its own
    assert masked_spans(tok, ids, mask) == [
        text if done else text.removesuffix("<|im_end|>") for text, done in zip(replies, finished)
    ]


def regen_row(messages, finished) -> dict:
    return {"messages": messages, "regen": {"key": "k", "finished": finished}}


def test_regen_finished_reaches_the_cache_and_the_data_stats(tmp_path, tokenizer):
    """From the row's regen record to the training mask, on the text and the stored-ids path."""
    from dflash_train.data.loader import TrainData

    text, split = split_of_a_merged_token(tokenizer)
    history = [{"role": "user", "content": "what is two plus two?"}]
    reply = generated_reply(tokenizer, history, split)
    text_row = [*history, {"role": "assistant", "content": "two plus two is four."}]
    rows = [
        regen_row(text_row, [True]),
        regen_row(text_row, [False]),
        {"messages": text_row},
        regen_row([*history, reply], [True]),
        regen_row([*history, reply], [False]),
    ]
    _, data = build_rows(tmp_path, tokenizer, rows)
    flags = [labelled_end_of_turn(tokenizer, *data.row(i))[0] for i in range(data.num_rows)]
    assert flags == [True, False, True, True, False]
    assert data.id_sources.tolist() == [0, 0, 0, 1, 1]
    # Stored ids, cut: the prompt, the generated ids labelled, then the end of turn unlabelled.
    ids, mask = (a.tolist() for a in data.row(4))
    prompt, end_of_turn = reply["prompt_token_ids"], ids_of("<|im_end|>\n", tokenizer)
    assert ids == prompt + split + end_of_turn
    assert mask == [False] * len(prompt) + [True] * len(split) + [False] * len(end_of_turn)
    assert data.cut_replies.tolist() == [0, 1, 0, 0, 1]
    stats = TrainData(data, DataConfig(paths=["x"]), seed=0, rank=0, world_size=1, pad_id=0).stats
    assert (stats.replies_cut, stats.rows_with_cut_reply) == (2, 2)


def test_stored_ids_of_a_multi_turn_row_with_a_cut_history_reply(tmp_path, tokenizer):
    messages, split, second_ids = two_generated_turns(tokenizer)
    _, data = build_rows(tmp_path, tokenizer, [regen_row(messages, [False, True])])
    ids, mask = data.row(0)
    assert labelled_end_of_turn(tokenizer, ids, mask) == [False, True]
    assert data.id_sources.tolist() == [1] and data.cut_replies.tolist() == [1]
    assert masked_spans(tokenizer, ids, mask) == [tokenizer.decode(split), "two plus two is four.<|im_end|>"]
    # The same ids as the uncut row: only the first reply's end-of-turn label is gone.
    _, whole = build_rows(tmp_path, tokenizer, [regen_row(messages, [True, True])], name="whole.jsonl")
    assert whole.row(0)[0].tolist() == ids.tolist()
    assert (np.asarray(whole.row(0)[1]) != np.asarray(mask)).sum() == 1


@pytest.mark.parametrize(
    "finished, message",
    [
        ([False], r"regen.finished has 1 flags for 2 assistant messages"),
        ([True, False, True], r"regen.finished has 3 flags for 2 assistant messages"),
        ([1, 0], r"regen.finished must be a list of true/false, one per assistant message; got \[1, 0\]"),
        ("no", "regen.finished must be a list of true/false"),
    ],
)
@pytest.mark.parametrize("num_workers", [1, 2])
def test_regen_finished_that_does_not_pair_with_the_replies_is_a_bad_row(
    tmp_path, tokenizer, finished, message, num_workers
):
    """One flag per assistant message, in regen's order; another count means the row was edited
    after regen and no flag can be trusted to name its reply."""
    good = regen_row(CONVERSATION, [True, False])
    bad = regen_row(CONVERSATION, finished)
    with pytest.raises(ValueError, match=rf"chat.jsonl:2: bad row \(malformed_regen_finished\): {message}"):
        build_rows(tmp_path, tokenizer, [good, bad], num_workers=num_workers)
    _, data = build_rows(tmp_path, tokenizer, [good, bad], name="b.jsonl", max_bad_rows=1)
    assert data.num_rows == 1 and data.skips.to_dict() == {"malformed_regen_finished": 1}


def test_a_template_whose_cut_turn_does_not_end_with_its_closing_text_is_refused(tokenizer):
    """The end-of-turn tokens must be told from the content, never guessed."""
    plain = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    # Closes each assistant turn with its position, so the probe's closing text is not this turn's.
    numbered = plain.replace("'<|im_end|>' }}", "'<|im_end|>' + loop.index|string }}", 1)
    assert numbered != plain
    odd = with_template(tokenizer, numbered)
    assert tokenize_chat(odd, CONVERSATION[:3])[1].any()  # finished rows are unaffected
    with pytest.raises(TemplateError, match="assistant turn 0 was cut at the generation limit"):
        tokenize_chat(odd, CONVERSATION[:3], finished=[False])


def test_generation_blocks_that_do_not_pair_with_the_replies_are_refused_for_a_cut_row(tokenizer):
    last_only = CHAT_TEMPLATE.replace("{% generation %}", "{% if loop.last %}{% generation %}").replace(
        "{% endgeneration %}",
        "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}",
    )
    marked = with_template(tokenizer, last_only)
    assert has_generation_markers(marked) and tokenize_chat(marked, CONVERSATION)[1].any()
    with pytest.raises(
        TemplateError, match=r"generation %\} blocks \(1 labelled runs of tokens\) do not match"
    ):
        tokenize_chat(marked, CONVERSATION, finished=[False, True])


@pytest.mark.parametrize("family", ["smollm2", "llama3", "qwen35", "qwen3", "qwen3.5", "qwen3.6"])
def test_cut_replies_lose_exactly_their_end_of_turn_token_on_real_family_templates(family):
    from tests.chat_families import QWEN_TEMPLATES, family_tokenizer, qwen_tokenizer

    tok = qwen_tokenizer(family) if family in QWEN_TEMPLATES else family_tokenizer(family)
    end_of_turn = {"llama3": "<|eot_id|>"}.get(family, "<|im_end|>")
    ids, mask = tokenize_chat(tok, CONVERSATION)
    cut_ids, cut_mask = tokenize_chat(tok, CONVERSATION, finished=[False, True])
    assert cut_ids.tolist() == ids.tolist()
    unlabelled = np.flatnonzero(mask != cut_mask)
    assert [tok.decode([int(ids[k])]) for k in unlabelled] == [end_of_turn] and not cut_mask[unlabelled].any()
    # It is the first reply's: the last labelled token of the first run of labels.
    first_run_end = int(np.flatnonzero(np.diff(mask.astype(np.int8)) == -1)[0])
    assert unlabelled.tolist() == [first_run_end]
