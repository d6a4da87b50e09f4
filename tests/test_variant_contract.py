"""The contract every registered drafter variant meets (docs/CONTRACTS.md "Drafter variants"), run on
each name ``variant_names()`` lists, so a new variant is checked the moment it is registered: it trains
a few steps on CPU through the real trainer, exports in its own layout and loads back unchanged, drafts
in the exact eval with its own procedure (tau and drafts equal to real decoding, lossless), and states
its serving flags and FLOPs; its settings and fields are refused on every other variant."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dflash_train.config import DrafterConfig
from dflash_train.models.drafter_config import DFlashDraftConfig
from dflash_train.models.export import load_drafter
from dflash_train.models.serving import serving_flags
from dflash_train.models.variant import get_variant, registered_variants, variant_names
from dflash_train.train.loss_options import LossOptions
from dflash_train.train.trainer import train
from tests.train_helpers import logged_losses, tiny_config
from tests.variant_helpers import fit_variant_drafter

TEXTS = ["repeat: def add", "repeat: the quick fox", "repeat: class Point print"]
MAX_NEW = 16


@pytest.fixture(scope="module")
def target(train_task):
    """The training task's tiny hybrid target in fp32, its tokenizer, prompts and greedy continuations."""
    from dflash_train.eval.generate import greedy_continuations
    from dflash_train.eval.prompts import encode_prompt
    from dflash_train.models.target_loading import load_causal_lm

    model, tokenizer = load_causal_lm(train_task["target"], dtype=torch.float32, device="cpu")
    prompts = [encode_prompt(tokenizer, {"prompt": t}, None) for t in TEXTS]
    eos = {tokenizer.eos_token_id}
    continuations = greedy_continuations(
        model, prompts, max_new_tokens=MAX_NEW, eos_token_ids=eos, pad_token_id=0, batch_size=4
    )
    return model, tokenizer, prompts, continuations


@pytest.mark.parametrize("name", variant_names())
def test_the_variant_trains_exports_loads_back_and_drafts_in_the_exact_eval(
    name, task, target, tmp_path, one_thread
):
    from dflash_train.eval.exact import as_frozen_target, draft_all, exact_acceptance
    from dflash_train.eval.runner import evaluate

    variant = get_variant(name)
    out = tmp_path / "run"
    result = train(
        tiny_config(task, out, f"drafter.variant={name}", "train.max_steps=4", "checkpoint.every_steps=100")
    )
    assert result["step"] == 4 and all(math.isfinite(v) for v in logged_losses(out).values())

    raw = json.loads((out / "export" / "config.json").read_text())
    assert raw["architectures"] == [variant.architecture]
    drafter, config = load_drafter(out / "export", dtype=torch.float32)
    assert config.variant == name and DFlashDraftConfig.from_serving_dict(raw) == config
    assert config.num_draft_tokens == config.block_size - variant.first_scored_slot

    # A few more steps on the target's own continuations (the toy task's labels are not the target's
    # replies), so the drafter's acceptance is partial and the comparison below has rounds to compare.
    model, tokenizer, prompts, continuations = target
    frozen = as_frozen_target(model, config.target_layer_ids)
    fit_variant_drafter(
        drafter,
        frozen,
        prompts,
        continuations,
        max_new_tokens=MAX_NEW,
        steps=30,
        lr=2e-2,
        options=LossOptions(),
    )
    common = dict(max_new_tokens=MAX_NEW, eos_token_ids={tokenizer.eos_token_id}, methods=("dflash",))
    exact = exact_acceptance(model, drafter, prompts, continuations, **common)["methods"]["dflash"]
    decoded = evaluate(model, tokenizer, drafter, prompts, decode_engine="dynamic", **common)
    real = decoded["methods"]["dflash"]
    assert real["lossless"] is True
    assert exact["tau"] == pytest.approx(real["tau"], abs=1e-9) and exact["tau"] > 1.3
    assert exact["per_request_tau"] == pytest.approx(real["per_request_tau"], abs=1e-9)
    assert len(exact["per_position_acceptance"]) == config.num_draft_tokens

    # The eval's drafts are the variant's procedure (``draft_tokens``) at every anchor.
    tables = draft_all(
        frozen, drafter, prompts, continuations, max_new_tokens=MAX_NEW, eos_token_ids={tokenizer.eos_token_id},
        topk=0, budget=65536, pad_token_id=0, timings={},
    )  # fmt: skip
    for prompt, continuation, table in zip(prompts, continuations, tables, strict=True):
        ids = torch.tensor([[*prompt, *continuation]])
        anchors = len(prompt) + torch.arange(table.tokens.shape[0])[None]
        with torch.no_grad():
            hidden = drafter(
                frozen.features(ids),
                ids,
                anchors,
                torch.ones_like(anchors, dtype=torch.bool),
                frozen.embed_tokens,
            )
        assert torch.equal(table.tokens, drafter.draft_tokens(hidden[0], ids[0, anchors[0]], frozen.lm_head))


@pytest.mark.parametrize("name", variant_names())
def test_the_variant_states_its_serving_flags_and_flops(name, tmp_path):
    from dflash_train.models import presets
    from dflash_train.train.flops import train_step_flops

    variant = get_variant(name)
    target_config = presets.qwen36_27b_target_config()
    config = presets.resolve_drafter_config(DrafterConfig(preset="qwen3.6-27b", variant=name), target_config)
    backbone = presets.resolve_drafter_config(DrafterConfig(preset="qwen3.6-27b"), target_config)
    flags = serving_flags(config, tmp_path)
    assert f"--speculative-algorithm {variant.sglang_algorithm} " in flags["sglang"]
    assert f"--speculative-num-draft-tokens {config.num_verify_tokens}" in flags["sglang"]
    assert f'"method": "{variant.vllm_method}"' in flags["vllm"]
    assert f'"num_speculative_tokens": {config.num_draft_tokens}' in flags["vllm"]
    assert (
        f"--spec-type {variant.llama_cpp_spec_type} --spec-draft-n-max {config.num_draft_tokens}"
        in flags["llama_cpp"]
    )
    cost = train_step_flops(target_config, config, seq_len=4096, num_anchors=512, rows=1)["total"]
    assert (
        math.isfinite(cost)
        and cost >= train_step_flops(target_config, backbone, seq_len=4096, num_anchors=512, rows=1)["total"]
    )


@pytest.mark.parametrize("name", variant_names())
def test_the_variants_settings_and_fields_are_refused_on_every_other_variant(name):
    variant = get_variant(name)
    others = [v.name for v in registered_variants() if v is not variant]
    for other in others:
        for key in variant.recipe_sizes:
            with pytest.raises(ValueError, match=f"drafter.{key}"):
                DrafterConfig(variant=other, **{key: 8})
    config = DFlashDraftConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=320, num_target_layers=4, target_layer_ids=[0, 2], mask_token_id=300,
    )  # fmt: skip
    for key, unused in variant.config_fields.items():
        used = not unused if isinstance(unused, bool) else ("other" if isinstance(unused, str) else 8)
        for other in others:
            if key not in get_variant(other).config_fields:
                with pytest.raises(ValueError, match="belong to another drafter variant"):
                    DFlashDraftConfig(**{**config.__dict__, "variant": other, key: used})


@pytest.mark.parametrize("name", variant_names())
def test_llama_cpp_runs_an_all_full_attention_export_bidirectional_in_block_as_trained(name):
    """llama.cpp turns a top-level ``is_causal: true`` into causal block attention in every layer
    (``dflash.attention.causal``); full-attention layers are trained bidirectional in-block, so an
    export of such a drafter must not carry it, whatever the variant."""
    from dflash_train.models.serving import serving_warnings

    variant = get_variant(name)
    config = DFlashDraftConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=320, num_target_layers=4, target_layer_ids=[0, 2], mask_token_id=300,
        variant=name, **variant.resolved_fields(DrafterConfig(variant=name)),
    )  # fmt: skip
    assert config.to_serving_dict().get("is_causal", False) is False
    assert not [note for note in serving_warnings(config) if "llama.cpp runs every layer" in note]
    mixed = DFlashDraftConfig(
        **{**config.__dict__, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}
    )
    assert DFlashDraftConfig.from_serving_dict(mixed.to_serving_dict()) == mixed
