"""The static-cache decode engine gives exactly the dynamic TargetSession path's tokens and
acceptance (fp32, CPU, no CUDA graphs) on tiny Qwen3 and Llama targets with a partly fitted
drafter: plain decoding and DFlash, drafts rejected mid-block, EOS stops, one session and one
static drafter reused across requests (so rollback and slot reuse are exercised)."""

from __future__ import annotations

import pytest
import torch

from dflash_train.eval.exact import as_frozen_target
from dflash_train.eval.generate import greedy_continuations
from dflash_train.eval.proposers import DFlashProposer
from dflash_train.eval.runner import evaluate
from dflash_train.eval.speculative import plain_generate, speculative_generate
from dflash_train.eval.static_drafter import StaticDFlashProposer
from dflash_train.eval.static_session import StaticTargetSession
from dflash_train.eval.target_session import TargetSession

BLOCK = 4
LAYER_IDS = [0, 2]  # includes the last layer: its feature is the pre-norm layer output, as in training
MAX_NEW = 25
TEXTS = ["def add(a, b): the quick brown fox", "for i in range(10):", "class Point:", "hi", "print(i * i)"]


pytestmark = pytest.mark.usefixtures("one_thread_module")


def tiny_llama(vocab_size: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def sharp_target(kind: str, vocab_size: int):
    """A tiny random target whose greedy continuations vary (``tiny.sharpen``)."""
    from dflash_train.tiny import build_tiny_target, sharpen

    return sharpen(
        tiny_llama(vocab_size) if kind == "llama" else build_tiny_target(kind, vocab_size=vocab_size)
    )


def fitted_drafter(model, tokenizer, prompts, continuations):
    from dflash_train.config import DrafterConfig
    from dflash_train.models import presets
    from dflash_train.models.drafter import DFlashDrafter
    from dflash_train.tiny import fit_drafter_on_continuations

    config = presets.resolve_drafter_config(
        DrafterConfig(preset="tiny", block_size=BLOCK),
        model.config,
        target_layer_ids=LAYER_IDS,
        mask_token_id=tokenizer.mask_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    frozen = as_frozen_target(model, LAYER_IDS)
    return fit_drafter_on_continuations(
        DFlashDrafter(config), frozen, prompts, continuations, max_new_tokens=MAX_NEW, steps=10
    )


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def setup(request, tokenizer):
    from dflash_train.eval.prompts import encode_prompt

    model = sharp_target(request.param, len(tokenizer))
    prompts = [encode_prompt(tokenizer, {"prompt": t}, None) for t in TEXTS]
    continuations = greedy_continuations(
        model, prompts, max_new_tokens=MAX_NEW, eos_token_ids=set(), pad_token_id=0, batch_size=4
    )
    return model, prompts, continuations, fitted_drafter(model, tokenizer, prompts, continuations)


def dflash(drafter, model):
    config = drafter.config
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    return DFlashProposer(drafter, embed, head, config.block_size, config.mask_token_id)


def max_length(prompts):
    return max(len(p) for p in prompts) + MAX_NEW + BLOCK


def test_static_plain_decoding_equals_dynamic(setup):
    model, prompts, continuations, _ = setup
    static = StaticTargetSession(model, max_length=max_length(prompts), graph_sizes=(1, BLOCK))
    for prompt, continuation in zip(prompts, continuations, strict=True):
        with TargetSession(model) as session:
            dynamic = plain_generate(session, prompt, max_new_tokens=MAX_NEW)
        assert plain_generate(static, prompt, max_new_tokens=MAX_NEW).tokens == dynamic.tokens == continuation


def test_static_features_and_logits_match_the_hooks(setup):
    """Prefill, a padded verify (2 tokens in the 4-token step), a rollback and a 1-token step: the
    same logits and feature-layer outputs as TargetSession's hooks (layer 2 is the last layer: its
    pre-norm output, not HF's post-norm last hidden state)."""
    model, prompts, continuations, _ = setup
    prompt, tokens = torch.tensor(prompts[0]), continuations[0]
    static = StaticTargetSession(model, LAYER_IDS, max_length=max_length(prompts), graph_sizes=(1, BLOCK))
    with TargetSession(model, LAYER_IDS) as dynamic:
        steps = [
            (lambda s: s.prefill(prompt), None),
            (lambda s: s.verify(torch.tensor(tokens[:2])), 1),  # keep 1 of 2: roll back one slot
            (lambda s: s.verify(torch.tensor(tokens[1:2])), 1),
            (lambda s: s.verify(torch.tensor(tokens[2:6])), 4),
        ]
        for run, keep in steps:
            want, got = run(dynamic), run(static)
            torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got.features, want.features, rtol=1e-5, atol=1e-5)
            if keep is not None:
                dynamic.commit(keep)
                static.commit(keep)
        assert static.length == dynamic.length == len(prompts[0]) + 6


@pytest.mark.parametrize("stop_early", [False, True], ids=["max_new_tokens", "eos"])
def test_static_dflash_equals_dynamic(setup, stop_early):
    model, prompts, continuations, drafter = setup
    # EOS: a token of every continuation's middle, so requests stop early (and mid-block).
    eos = {c[MAX_NEW // 2] for c in continuations} if stop_early else set()
    static = StaticTargetSession(model, LAYER_IDS, max_length=max_length(prompts), graph_sizes=(1, BLOCK))
    static_proposer = StaticDFlashProposer(dflash(drafter, model), max_length=max_length(prompts))
    accepted = []
    for prompt in prompts:
        kwargs = dict(block_size=BLOCK, max_new_tokens=MAX_NEW, eos_token_ids=eos)
        with TargetSession(model, LAYER_IDS) as session:
            dynamic = speculative_generate(session, dflash(drafter, model), prompt, **kwargs)
        fast = speculative_generate(static, static_proposer, prompt, **kwargs)
        assert fast.tokens == dynamic.tokens
        assert fast.num_accepted == dynamic.num_accepted and fast.num_drafted == dynamic.num_drafted
        accepted += dynamic.num_accepted
    assert any(0 < a < BLOCK - 1 for a in accepted), accepted  # rejections mid-block happened
    assert any(a == BLOCK - 1 for a in accepted), accepted  # and full blocks
    if stop_early:
        plain = [plain_generate(static, p, max_new_tokens=MAX_NEW, eos_token_ids=eos).tokens for p in prompts]
        assert all(len(t) < MAX_NEW for t in plain)


def test_evaluate_static_equals_dynamic_and_reports_engine(setup, tokenizer):
    model, prompts, _, drafter = setup
    kwargs = dict(max_new_tokens=MAX_NEW, methods=("dflash", "ngram"), eos_token_ids=set())
    dynamic = evaluate(model, tokenizer, drafter, prompts, decode_engine="dynamic", **kwargs)
    static = evaluate(model, tokenizer, drafter, prompts, decode_engine="static", **kwargs)
    assert dynamic["decode_engine"] == "eager-dynamic" and static["decode_engine"] == "static-eager"
    assert static["baseline"]["decode_engine"] == "static-eager"
    for name in ("plain", "dflash", "ngram"):
        assert [g.tokens for g in static["generations"][name]] == [
            g.tokens for g in dynamic["generations"][name]
        ]
        assert [g.tau for g in static["generations"][name]] == [g.tau for g in dynamic["generations"][name]]
    assert static["methods"]["dflash"]["decode_engine"] == "static-eager"
    assert static["methods"]["dflash"]["lossless"] is True


def test_ddtree_keeps_the_dynamic_engine_and_says_so(setup, tokenizer):
    model, prompts, _, drafter = setup
    report = evaluate(
        model, tokenizer, drafter, prompts[:2], max_new_tokens=9, methods=("dflash", "ddtree"),
        ddtree_budget=6, eos_token_ids=set(), decode_engine="auto",
    )  # fmt: skip
    assert report["methods"]["dflash"]["decode_engine"] == "static-eager"
    assert report["methods"]["ddtree"]["decode_engine"] == "eager-dynamic"
    assert report["methods"]["ddtree"]["lossless"] is True


def test_static_cache_overflow_is_a_clear_error(setup):
    model, prompts, _, _ = setup
    static = StaticTargetSession(model, max_length=len(prompts[0]) + 3)
    with pytest.raises(ValueError, match="static KV cache of"):
        plain_generate(static, prompts[0], max_new_tokens=MAX_NEW)


def test_hybrid_target_refuses_static_and_auto_reports_dynamic(tokenizer, capsys):
    model = sharp_target("hybrid", len(tokenizer))
    prompt = [[5, 6, 7, 8]]
    with pytest.raises(ValueError, match="GatedDeltaNet"):
        evaluate(model, tokenizer, None, prompt, max_new_tokens=4, methods=(), decode_engine="static")
    report = evaluate(model, tokenizer, None, prompt, max_new_tokens=4, methods=(), decode_engine="auto")
    assert report["decode_engine"] == "eager-dynamic"
    assert "decode engine eager-dynamic" in capsys.readouterr().err


def test_unknown_decode_engine_is_rejected(tokenizer):
    from dflash_train.eval.options import EvalOptions

    with pytest.raises(ValueError, match="decode_engine"):
        EvalOptions(target="t", drafter="d", prompts=["p.jsonl"], decode_engine="fast")


def test_eval_command_reports_the_decode_engine(tiny_qwen3_dir, tiny_hybrid_dir, tmp_path, capsys):
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_train.cli import main
    from dflash_train.config import DrafterConfig
    from dflash_train.models import presets
    from dflash_train.models.drafter import DFlashDrafter
    from dflash_train.models.export import save_drafter

    for directory, name in ((tiny_qwen3_dir, "qwen3"), (tiny_hybrid_dir, "hybrid")):
        model = AutoModelForCausalLM.from_pretrained(directory)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        config = presets.resolve_drafter_config(
            DrafterConfig(preset="tiny", block_size=BLOCK), model.config, target_layer_ids=LAYER_IDS,
            mask_token_id=tokenizer.mask_token_id, torch_dtype="float32",
        )  # fmt: skip
        save_drafter(DFlashDrafter(config), config, tmp_path / name, dtype="float32")
    (tmp_path / "p.jsonl").write_text('{"prompt": "def add(a, b):"}\n{"prompt": "class Point:"}\n')
    base = ["eval", "--prompts", str(tmp_path / "p.jsonl"),
            "--max-new-tokens", "9", "--device", "cpu", "--no-progress", "--json", "--tau-mode", "decode"]  # fmt: skip
    for engine, name in (("static", "static-eager"), ("dynamic", "eager-dynamic")):
        qwen3 = ["--target", str(tiny_qwen3_dir), "--drafter", str(tmp_path / "qwen3")]
        assert main([*base, *qwen3, "--decode-engine", engine]) == 0
        captured = capsys.readouterr()
        result = json.loads(captured.out.strip().splitlines()[-1])
        assert result["decode_engine"] == name and result["decode_engines"] == {"plain": name, "dflash": name}
        assert result["lossless"] is True
        assert f"eval: real decoding on plain: {name}, dflash: {name}" in captured.err
    # A hybrid target: static is a clear error, auto says it runs the dynamic engine.
    hybrid = ["--target", str(tiny_hybrid_dir), "--drafter", str(tmp_path / "hybrid")]
    assert main([*base, *hybrid, "--decode-engine", "static", "--tau-mode", "exact"]) == 1
    assert "--decode-engine static cannot run this target: GatedDeltaNet" in capsys.readouterr().err
    assert main([*base, *hybrid, "--decode-engine", "auto"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1])["decode_engine"] == "eager-dynamic"
    assert "eval: decode engine eager-dynamic (the static engine cannot run this target" in captured.err


@pytest.mark.gpu
def test_cuda_graph_engine_equals_dynamic_in_fp32(setup, tokenizer):
    """On a GPU the graphed steps (captured in evaluate's warm-up) give the dynamic engine's tokens."""
    import copy

    model, prompts, _, drafter = setup
    model, drafter = copy.deepcopy(model).cuda(), copy.deepcopy(drafter).cuda()
    kwargs = dict(max_new_tokens=MAX_NEW, methods=("dflash",), eos_token_ids=set())
    dynamic = evaluate(model, tokenizer, drafter, prompts, decode_engine="dynamic", **kwargs)
    static = evaluate(model, tokenizer, drafter, prompts, decode_engine="static", **kwargs)
    assert static["decode_engine"] == "static-cudagraph"
    for name in ("plain", "dflash"):
        assert [g.tokens for g in static["generations"][name]] == [
            g.tokens for g in dynamic["generations"][name]
        ]
        assert [g.tau for g in static["generations"][name]] == [g.tau for g in dynamic["generations"][name]]
