"""Tiny tokenizers carrying chat templates modelled on real families: SmolLM2 (ChatML with a default
system prompt), Llama-3 (headers, <|eot_id|>, no pad token, reserved specials) and Qwen3.5/3.6
(ChatML with a thinking switch), plus Qwen's own published Qwen3 and Qwen3.5/3.6 templates
(``qwen_tokenizer``). Built in code with ``tokenizers``; nothing is downloaded."""

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast

from dflash_train.tiny import DEFAULT_CORPUS, build_tiny_target

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)
QWEN35_TEMPLATE = (
    "{%- for message in messages %}{%- if message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- if '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}"
    "{%- else %}{{- '<think>\n' }}{%- endif %}{%- endif %}"
)
# Qwen's published chat templates, kept verbatim as data (see tests/fixtures/chat_templates/README.md).
TEMPLATE_DIR = Path(__file__).parent / "fixtures" / "chat_templates"
QWEN_TEMPLATES = ("qwen3", "qwen3.5", "qwen3.6")
# A template whose user content is not written verbatim (synth must refuse it with a reason).
SHOUTING_TEMPLATE = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] | upper + '<|im_end|>\n' }}{% endfor %}"

FAMILIES = {
    "smollm2": dict(
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<file_sep>", "<empty_output>"],
        template=SMOLLM2_TEMPLATE,
        tokens=dict(bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>", unk_token="<|endoftext|>"),
    ),
    "llama3": dict(
        specials=["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|reserved_special_token_1|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        template=LLAMA3_TEMPLATE,
        tokens=dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
    ),
    "qwen35": dict(
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|vision_pad|>"],
        template=QWEN35_TEMPLATE,
        tokens=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
    ),
}  # fmt: skip


def family_tokenizer(family: str, corpus=DEFAULT_CORPUS, vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE with ``family``'s special tokens, pad/eos/bos choices and chat template."""
    spec = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=spec["specials"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    named = set(spec["tokens"].values())
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        additional_special_tokens=[s for s in spec["specials"] if s not in named],
        **spec["tokens"],
    )
    wrapped.chat_template = spec["template"]
    return wrapped


def qwen_tokenizer(template: str) -> PreTrainedTokenizerFast:
    """The Qwen3.5/3.6-style tiny tokenizer carrying Qwen's real chat template ``template``."""
    tokenizer = family_tokenizer("qwen35")
    tokenizer.chat_template = (TEMPLATE_DIR / f"{template}.jinja").read_text()
    return tokenizer


def save_family_target(directory: Path, family: str, tokenizer=None, eos_ids=None, seed: int = 0) -> Path:
    """A tiny random Qwen3 target saved with ``family``'s tokenizer and a generation config."""
    tokenizer = tokenizer or family_tokenizer(family)
    model = build_tiny_target("qwen3", vocab_size=len(tokenizer), seed=seed)
    save_with(directory, model, tokenizer, eos_ids)
    return directory


def save_with(directory: Path, model, tokenizer, eos_ids=None) -> None:
    eos = eos_ids if eos_ids is not None else tokenizer.eos_token_id
    model.config.eos_token_id = eos
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


# The requests the synth tests' chatty target (``chatty_dir`` in conftest.py) is trained to answer.
CHATTY_PROMPTS = [
    f"please {v} the {n}"
    for v in ("explain", "describe", "write about")
    for n in ("sea", "moon", "rain", "python")
]


def train_chatty_target(directory: Path, prompts: list[str], replies: list[str], steps: int = 150) -> Path:
    """A tiny ChatML (SmolLM2-style) target trained to write ``prompts`` as user turns and stop."""
    tokenizer = family_tokenizer("smollm2", corpus=[*DEFAULT_CORPUS, *prompts, *replies])
    model = build_tiny_target("qwen3", vocab_size=len(tokenizer), seed=0).train()
    rows = [
        tokenizer(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}, {"role": "assistant", "content": r}], tokenize=False
            ),
            add_special_tokens=False,
        )["input_ids"]
        for p, r in zip(prompts, replies)
    ]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    save_with(directory, model.eval(), tokenizer)
    return directory
