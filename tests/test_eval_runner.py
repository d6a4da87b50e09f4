"""The DFlash proposer against the drafter contract, ``evaluate`` with a real (random) drafter, the
``dflash-train eval`` command end to end, and prompt loading."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_train.eval.prompts import encode_prompt, load_prompts
from dflash_train.eval.proposers import DFlashProposer
from dflash_train.eval.runner import evaluate
from dflash_train.eval.speculative import plain_generate, speculative_generate
from dflash_train.eval.target_session import TargetSession

BLOCK = 4
LAYER_IDS = [0, 2]


pytestmark = pytest.mark.usefixtures("one_thread_module")


def load(directory):
    return AutoModelForCausalLM.from_pretrained(directory).eval(), AutoTokenizer.from_pretrained(directory)


def chat_prompt(tokenizer, text="def add(a, b): the quick brown fox"):
    return encode_prompt(tokenizer, {"prompt": text}, thinking=None)


def make_drafter(target_model, tokenizer, seed=0):
    """A randomly initialised tiny DFlash drafter for this target: lossless must hold regardless."""
    from dflash_train.config import DrafterConfig
    from dflash_train.models import presets
    from dflash_train.models.drafter import DFlashDrafter

    config = presets.resolve_drafter_config(
        DrafterConfig(preset="tiny", block_size=BLOCK),
        target_model.config,
        target_layer_ids=LAYER_IDS,
        mask_token_id=tokenizer.mask_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return DFlashDrafter(config).eval(), config


class FakeDrafter:
    """Implements the drafter inference contract and records how it is called."""

    def __init__(self, hidden_size):
        self.hidden_size = hidden_size
        self.calls = []

    def new_context_cache(self):
        return {"features": []}

    def extend_context(self, cache, features):
        assert features.ndim == 3 and features.shape[0] == 1
        cache["features"].append(features[0])
        return cache

    def forward_block(self, block_ids, start, cache, embed_tokens):
        context = sum(f.shape[0] for f in cache["features"])
        self.calls.append((block_ids.clone(), start, context))
        # Deterministic "predictions" that depend on the context size, so drafts vary per round.
        return embed_tokens(block_ids) + 0.01 * context


def test_dflash_proposer_follows_the_drafter_contract(tiny_hybrid_dir):
    model, tokenizer = load(tiny_hybrid_dir)
    prompt = chat_prompt(tokenizer)
    fake = FakeDrafter(model.config.hidden_size)
    proposer = DFlashProposer(
        fake, model.get_input_embeddings(), model.get_output_embeddings(), BLOCK, tokenizer.mask_token_id
    )
    with TargetSession(model, LAYER_IDS) as session:
        gen = speculative_generate(session, proposer, prompt, block_size=BLOCK, max_new_tokens=13)
    with TargetSession(model) as session:
        assert gen.tokens == plain_generate(session, prompt, max_new_tokens=13).tokens
    output = prompt + gen.tokens
    for block_ids, start, context in fake.calls:
        # block = [last accepted token, MASK * (B-1)] at its own position; context = every position before it
        assert context == start
        assert block_ids[0, 0].item() == output[start]
        assert block_ids[0, 1:].tolist() == [tokenizer.mask_token_id] * (BLOCK - 1)
    assert fake.calls[0][1] == len(prompt)


def test_evaluate_with_a_random_drafter_is_lossless(tiny_qwen3_dir):
    model, tokenizer = load(tiny_qwen3_dir)
    drafter, config = make_drafter(model, tokenizer)
    prompts = [chat_prompt(tokenizer), chat_prompt(tokenizer, "for i in range(10):")]
    report = evaluate(
        model,
        tokenizer,
        drafter,
        prompts,
        max_new_tokens=13,
        methods=("dflash", "ngram", "ddtree"),
        ddtree_budget=6,
    )
    for name, summary in report["methods"].items():
        assert summary["lossless"] is True, name
        assert 1.0 <= summary["tau"] <= BLOCK
        assert len(summary["per_position_acceptance"]) == BLOCK - 1
        assert sum(summary["accept_length_histogram"]) == summary["rounds"]
    assert report["baseline"]["tokens"] == report["methods"]["dflash"]["tokens"]


def test_evaluate_hybrid_chain_is_lossless_and_tree_is_refused(tiny_hybrid_dir):
    model, tokenizer = load(tiny_hybrid_dir)
    drafter, _ = make_drafter(model, tokenizer)
    prompts = [chat_prompt(tokenizer)]
    report = evaluate(model, tokenizer, drafter, prompts, max_new_tokens=13, methods=("dflash", "ngram"))
    assert all(s["lossless"] for s in report["methods"].values())
    with pytest.raises(NotImplementedError, match="not supported for GatedDeltaNet targets"):
        evaluate(model, tokenizer, drafter, prompts, max_new_tokens=5, methods=("ddtree",), ddtree_budget=4)


def test_eval_command_end_to_end(tiny_qwen3_dir, tmp_path, capsys):
    from dflash_train.cli import main
    from dflash_train.models.export import save_drafter

    model, tokenizer = load(tiny_qwen3_dir)
    drafter, config = make_drafter(model, tokenizer)
    save_drafter(drafter, config, tmp_path / "drafter", dtype="float32")
    rows = [
        {
            "messages": [
                {"role": "user", "content": "what is two plus two?"},
                {"role": "assistant", "content": "four"},
            ]
        },
        {"conversations": [{"from": "human", "value": "class Point:"}]},
        {"prompt": "The quick brown fox"},
    ]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(
        [
            "eval",
            "--target", str(tiny_qwen3_dir),
            "--drafter", str(tmp_path / "drafter"),
            "--prompts", str(tmp_path / "prompts.jsonl"),
            "--max-new-tokens", "9",
            "--baseline", "ngram",
            "--ddtree-budget", "6",
            "--decode-prompts", "3",
            "--device", "cpu",
            "--json",
        ]
    )  # fmt: skip
    assert code == 0
    captured = capsys.readouterr()
    out = captured.out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["lossless"] is True and result["num_prompts"] == 3 and result["tau_mode"] == "exact"
    # Progress bars go to stderr, one per phase and method, never into the JSON line.
    for bar in ("eval generate", "eval drafter", "eval dflash", "eval decode plain", "eval decode ddtree"):
        assert bar in captured.err, bar
    assert "lossless: yes" in out and "overall" in out
    for key in ("tau", "ngram_tau", "ddtree_tau"):
        assert 1.0 <= result[key] <= BLOCK
    assert len(result["per_position_acceptance"]) == BLOCK - 1
    assert result["speedup"] > 0 and result["baseline_tokens_per_s"] > 0


def test_prompts_stop_at_the_last_user_turn(tiny_qwen3_dir, tmp_path):
    _, tokenizer = load(tiny_qwen3_dir)
    row = {
        "messages": [
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "first answer"},
            {"role": "user", "content": "second question"},
            {"role": "assistant", "content": "second answer"},
        ]
    }
    (tmp_path / "p.jsonl").write_text(json.dumps(row) + "\n" + json.dumps({"prompt": "hi"}) + "\n")
    first, second = load_prompts(tmp_path / "p.jsonl", tokenizer, thinking=False)
    text = tokenizer.decode(first)
    assert "second question" in text and "second answer" not in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tokenizer.decode(second).startswith("<|im_start|>user\nhi")
    assert len(load_prompts(tmp_path / "p.jsonl", tokenizer, num_prompts=1)) == 1
    (tmp_path / "bad.jsonl").write_text(
        json.dumps({"messages": [{"role": "assistant", "content": "x"}]}) + "\n"
    )
    with pytest.raises(ValueError, match="no user turn"):
        load_prompts(tmp_path / "bad.jsonl", tokenizer)


def test_evaluate_accepts_custom_methods_and_reports_exact_acceptance(tiny_hybrid_dir):
    from dflash_train.eval.proposers import OracleProposer
    from dflash_train.eval.runner import Method

    model, tokenizer = load(tiny_hybrid_dir)
    vocab = model.config.vocab_size
    oracle = Method("oracle", lambda prompt, ref: OracleProposer(ref, vocab), block_size=BLOCK)
    report = evaluate(
        model,
        tokenizer,
        None,
        [chat_prompt(tokenizer)],
        max_new_tokens=1 + 3 * BLOCK,
        methods=[oracle],
        eos_token_ids=(),
    )
    summary = report["methods"]["oracle"]
    assert summary["lossless"] is True and summary["tau"] == BLOCK
    assert summary["per_position_acceptance"] == [1.0] * (BLOCK - 1)
    assert summary["accept_length_histogram"] == [0, 0, 0, 3]


def test_lossless_check_catches_a_different_output(tiny_qwen3_dir):
    """The check itself can fail: a wrong token is reported with where it happened."""
    from dflash_train.eval.runner import describe_divergence, summarize
    from dflash_train.eval.speculative import Generation

    model, tokenizer = load(tiny_qwen3_dir)
    prompt = chat_prompt(tokenizer)
    with TargetSession(model) as session:
        reference = plain_generate(session, prompt, max_new_tokens=8)
    corrupted = list(reference.tokens)
    corrupted[5] = (corrupted[5] + 1) % model.config.vocab_size
    bad = Generation(tokens=corrupted, num_drafted=[3, 3], num_accepted=[3, 2])
    summary = summarize([bad], [reference], temperature=0.0, block_size=BLOCK)
    assert summary["lossless"] is False and summary["mismatched_prompts"] == [0]
    divergence = describe_divergence(model, prompt, reference.tokens, corrupted, 0)
    assert divergence["position"] == 5 and divergence["reference_top2_gap"] >= 0
    assert summarize([bad], [reference], temperature=0.7, block_size=BLOCK)["lossless"] is None


def test_a_request_without_rounds_does_not_pull_tau_below_one():
    from dflash_train.eval.runner import summarize
    from dflash_train.eval.speculative import Generation

    ended_at_prefill = Generation(tokens=[7])  # immediate eos: no speculative round ran
    drafted = Generation(tokens=[1, 2, 3, 4], num_drafted=[3], num_accepted=[2])
    report = summarize(
        [ended_at_prefill, drafted], [ended_at_prefill, drafted], temperature=0.0, block_size=4
    )
    assert report["tau"] == 3.0 and report["lossless"] is True
    assert summarize([ended_at_prefill], [ended_at_prefill], 0.0, 4)["tau"] is None
