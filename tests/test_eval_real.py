"""Exact mode on the real pretrained chat target (Llama architecture), and on CUDA.

Run with ``DFLASH_REAL_TARGET=/work/smollm2 pytest -m real tests/test_eval_real.py``; the CUDA
test runs on any GPU machine (tiny targets, no download).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from dflash_train.eval.exact import exact_acceptance
from dflash_train.eval.generate import greedy_continuations, pad_token_for
from dflash_train.eval.runner import default_eos_ids, evaluate
from dflash_train.eval.speculative import plain_generate
from dflash_train.eval.target_session import TargetSession

REAL = os.environ.get("DFLASH_REAL_TARGET", "")
PROMPTS = [
    "Write a Python function that reverses a string.",
    "What is the capital of France?",
    "Explain recursion in one sentence.",
]


def random_drafter(model, mask_token_id, block_size=8, layer_ids=(1, 8, 15, 22)):
    from dflash_train.config import DrafterConfig
    from dflash_train.models import presets
    from dflash_train.models.drafter import DFlashDrafter

    config = presets.resolve_drafter_config(
        DrafterConfig(preset="from-target", block_size=block_size, num_hidden_layers=1),
        model.config,
        target_layer_ids=list(layer_ids),
        mask_token_id=mask_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    return DFlashDrafter(config).to(next(model.parameters()).device).eval()


@pytest.mark.real
@pytest.mark.skipif(not REAL, reason="set DFLASH_REAL_TARGET to the real target's HF directory")
def test_exact_mode_on_the_real_target_equals_decoding():
    from dflash_train.eval.prompts import encode_prompt
    from dflash_train.models.target import load_causal_lm

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, tokenizer = load_causal_lm(REAL, dtype=torch.float32, device="cpu")
    model.eval()
    prompts = [encode_prompt(tokenizer, {"prompt": p}, None) for p in PROMPTS]
    eos = default_eos_ids(model, tokenizer)
    max_new = 16
    continuations = greedy_continuations(
        model, prompts, max_new_tokens=max_new, eos_token_ids=eos,
        pad_token_id=pad_token_for(tokenizer, eos), batch_size=3,
    )  # fmt: skip
    for prompt, continuation in zip(prompts, continuations, strict=True):
        with TargetSession(model) as session:
            assert (
                plain_generate(session, prompt, max_new_tokens=max_new, eos_token_ids=eos).tokens
                == continuation
            )
    drafter = random_drafter(model, mask_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>") + 100)
    common = dict(
        max_new_tokens=max_new, eos_token_ids=eos, methods=("dflash", "ngram", "ddtree"), ddtree_budget=8
    )
    exact = exact_acceptance(model, drafter, prompts, continuations, **common)
    decoded = evaluate(model, tokenizer, drafter, prompts, **common)
    for name in common["methods"]:
        assert decoded["methods"][name]["lossless"] is True, name
        assert exact["methods"][name]["tau"] == pytest.approx(decoded["methods"][name]["tau"], abs=1e-9), name


@pytest.mark.gpu
def test_exact_mode_equals_decoding_on_cuda():
    from dflash_train.tiny import build_tiny_target, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_tiny_target("qwen3", vocab_size=len(tokenizer))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2 and "embed" not in name:
                param.mul_(6.0)
    model = copy.deepcopy(model).cuda()
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    eos = {tokenizer.eos_token_id}
    continuations = greedy_continuations(
        model, prompts, max_new_tokens=17, eos_token_ids=eos, pad_token_id=0, batch_size=2
    )
    drafter = random_drafter(model, tokenizer.mask_token_id, block_size=4, layer_ids=(0, 1))
    common = dict(
        max_new_tokens=17, eos_token_ids=eos, methods=("dflash", "ngram", "ddtree"), ddtree_budget=6
    )
    exact = exact_acceptance(model, drafter, prompts, continuations, **common)
    decoded = evaluate(model, tokenizer, drafter, prompts, **common)
    assert [g.tokens for g in decoded["generations"]["plain"]] == continuations
    for name in common["methods"]:
        assert exact["methods"][name]["tau"] == pytest.approx(decoded["methods"][name]["tau"], abs=1e-9), name
