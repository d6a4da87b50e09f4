"""Tiny models and a tiny tokenizer built in code, for tests and the embedded default.

Nothing here downloads anything: the tokenizer is a byte-level BPE trained with ``tokenizers`` on
whatever text it is given, with ChatML special tokens, a dedicated mask token and a chat template
that marks assistant turns with ``{% generation %}`` (so transformers can return the assistant
mask) and honours ``enable_thinking``. The targets are the tiny presets of ``models.presets``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from dflash_train.models.presets import tiny_hybrid_target_config, tiny_qwen3_target_config

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>", "<think>", "</think>"]

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{ '<think>\n\n</think>\n\n' }}{%- endif -%}"
    "{%- endif -%}"
)

DEFAULT_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "user: what is two plus two? assistant: two plus two is four.\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
]


def build_tokenizer(corpus: Iterable[str] = DEFAULT_CORPUS, vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``corpus`` and wrap it with ChatML specials and the chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        mask_token="<|mask|>",
        additional_special_tokens=["<|im_start|>", "<think>", "</think>"],
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_tiny_target(kind: str = "hybrid", vocab_size: int = 320, seed: int = 0, **shape) -> torch.nn.Module:
    """A randomly initialised tiny target: ``hybrid`` (Qwen3.5 GatedDeltaNet + attention) or ``qwen3``."""
    if kind not in ("hybrid", "qwen3"):
        raise ValueError(f"tiny target kind {kind!r}: use 'hybrid' or 'qwen3'")
    config = (tiny_hybrid_target_config if kind == "hybrid" else tiny_qwen3_target_config)(
        vocab_size=vocab_size, **shape
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def sharpen(model: torch.nn.Module) -> torch.nn.Module:
    """Scale a tiny random target's weight matrices x6 (embeddings aside) and its final norm x4, in
    place: at the default init its greedy continuations repeat one token; sharpened they vary, so
    drafts get accepted and rejected mid-block."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2 and "embed" not in name:
                param.mul_(6.0)
        model.model.norm.weight.mul_(4.0)
    return model


def save_tiny_target(
    directory: str | Path, kind: str = "hybrid", seed: int = 0, corpus: Iterable[str] = DEFAULT_CORPUS
) -> Path:
    """Write a tiny target checkpoint (model + tokenizer) that ``load_target`` can read."""
    directory = Path(directory)
    tokenizer = build_tokenizer(corpus)
    model = build_tiny_target(kind, vocab_size=len(tokenizer), seed=seed)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def fit_drafter_on_continuations(
    drafter,
    target,
    prompts,
    continuations,
    *,
    max_new_tokens: int,
    steps: int,
    lr: float = 1e-2,
):
    """A few Adam steps of ``drafter`` on every anchor of the target's continuations of ``prompts``:
    a partially right drafter for evaluation tests and CPU eval benchmarks. ``target`` is a
    FrozenTarget (``eval.exact.as_frozen_target(model, layer_ids)``). Returns it in eval mode."""
    import torch.nn.functional as F

    block_size = drafter.config.block_size
    sequences = [p + c for p, c in zip(prompts, continuations, strict=True)]
    lengths = torch.tensor([len(s) for s in sequences])
    ids = torch.zeros(len(sequences), int(lengths.max()), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq)
    features = target.features(ids)
    anchors = torch.tensor([len(p) for p in prompts])[:, None] + torch.arange(max_new_tokens)
    keep = anchors + 1 < lengths[:, None]
    positions = anchors[..., None] + torch.arange(1, block_size)
    labels = ids.gather(1, positions.clamp(max=ids.shape[1] - 1).flatten(1)).view_as(positions)
    valid = keep[..., None] & (positions < lengths[:, None, None])
    optimizer = torch.optim.Adam(drafter.parameters(), lr=lr)
    for _ in range(steps):
        hidden = drafter(features, ids, anchors, keep, target.embed_tokens)
        loss = F.cross_entropy(target.lm_head(hidden[:, :, 1:])[valid], labels[valid])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval()
