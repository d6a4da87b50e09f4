"""Chat template tokenization, the assistant loss mask and the tokenized-data cache."""

import json

import numpy as np
import pytest

from dflash_train.config import DataConfig
from dflash_train.data.cache import load_or_build
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
