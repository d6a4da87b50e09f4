"""The lossless verdict (identical / up to ties / bug), prompt files, and the eval command's
per-file report, output directory and pad-less tokenizers."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_train.eval.prompts import BadPromptRows, load_prompt_file
from dflash_train.eval.verdict import TIE_ULPS, tie_threshold, verdict, verdict_line

BLOCK = 4


pytestmark = pytest.mark.usefixtures("one_thread_module")


def make_drafter(model, tokenizer, seed=0):
    from dflash_train.config import DrafterConfig
    from dflash_train.models import presets
    from dflash_train.models.drafter import DFlashDrafter

    config = presets.resolve_drafter_config(
        DrafterConfig(preset="tiny", block_size=BLOCK),
        model.config,
        target_layer_ids=[0, 2],
        mask_token_id=tokenizer.mask_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return DFlashDrafter(config).eval(), config


def test_tie_threshold_scales_with_dtype_and_logit_scale():
    assert tie_threshold(20.0, torch.bfloat16) == pytest.approx(TIE_ULPS * 2**-7 * 20)
    assert tie_threshold(20.0, torch.float32) == pytest.approx(TIE_ULPS * 2**-23 * 20)
    assert tie_threshold(0.01, torch.bfloat16) == tie_threshold(1.0, torch.bfloat16)  # floor at scale 1


def test_verdict_separates_ties_from_bugs():
    tie = {"is_tie": True}
    clear = {"is_tie": False}
    assert verdict([], 3, 0.0) == {"lossless": True, "lossless_up_to_ties": True, "num_clear_divergences": 0}
    assert verdict([tie], 3, 0.0)["lossless"] is False
    assert verdict([tie], 3, 0.0)["lossless_up_to_ties"] is True
    result = verdict([tie, clear], 3, 0.0)
    assert result["lossless_up_to_ties"] is False and result["num_clear_divergences"] == 1
    assert "clear margin: bug" in verdict_line(result)
    assert verdict([], 0, 0.0)["lossless"] is None and verdict([], 3, 0.5)["lossless"] is None


def test_a_broken_verifier_is_reported_as_a_clear_margin_bug(tiny_qwen3_dir, monkeypatch):
    """Plant a bug (accept every draft of a drafter with shuffled fc): the divergences are not ties."""
    from dflash_train.eval import speculative
    from dflash_train.eval.prompts import encode_prompt
    from dflash_train.eval.runner import evaluate

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(20.0)  # a trained model's logit scale: clear top-2 gaps
    drafter, _ = make_drafter(model, tokenizer)
    with torch.no_grad():
        drafter.fc.weight.copy_(drafter.fc.weight[:, torch.randperm(drafter.fc.weight.shape[1])])
    monkeypatch.setattr(
        speculative, "accept_greedy", lambda draft, logits: (len(draft), int(logits[len(draft)].argmax()))
    )
    prompts = [encode_prompt(tokenizer, {"prompt": "def add(a, b):"}, None)]
    report = evaluate(model, tokenizer, drafter, prompts, max_new_tokens=13, methods=("dflash",))
    divergences = report["methods"]["dflash"]["divergences"]
    assert report["methods"]["dflash"]["lossless"] is False and len(divergences) == 1
    assert divergences[0]["is_tie"] is False
    assert divergences[0]["reference_top2_gap"] > 100 * divergences[0]["tie_threshold"]
    assert "bug" in verdict_line(verdict(divergences, 1, 0.0))


def test_prompt_files_report_invalid_utf8_and_count_skips(tiny_qwen3_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    path = tmp_path / "p.jsonl"
    path.write_bytes(
        b'{"prompt": "hello"}\n'
        b'{"prompt": "caf\xe9"}\n'  # latin-1, not UTF-8
        b"not json\n"
        b'{"messages": [{"role": "assistant", "content": "x"}]}\n'
        b'{"conversations": [{"from": "human", "value": "second"}]}\n'
    )
    with pytest.raises(ValueError, match=r"p\.jsonl:2: bad prompt row \(invalid_utf8\)"):
        load_prompt_file(path, tokenizer)
    loaded = load_prompt_file(path, tokenizer, bad_rows=BadPromptRows(max_bad_rows=3))
    assert len(loaded.prompts) == 2
    assert loaded.skipped == {"invalid_utf8": 1, "malformed_json": 1, "no_user_turn": 1}
    with pytest.raises(ValueError, match=r"p\.jsonl:4: .*no_user_turn.*--max-bad-rows"):
        load_prompt_file(path, tokenizer, bad_rows=BadPromptRows(max_bad_rows=2))


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def save_padless_target(tiny_qwen3_dir, directory):
    """The tiny Qwen3 target with a tokenizer that has no pad token (Llama-3 style)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    tokenizer.pad_token = None
    model.config.pad_token_id = None
    model.generation_config.pad_token_id = None
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    assert AutoTokenizer.from_pretrained(directory).pad_token_id is None
    return model, tokenizer


def test_eval_command_reports_per_file_and_writes_the_output_dir(tiny_qwen3_dir, tmp_path, capsys):
    from dflash_train.cli import main
    from dflash_train.models.export import save_drafter

    model, tokenizer = save_padless_target(tiny_qwen3_dir, tmp_path / "target")
    drafter, config = make_drafter(model, tokenizer)
    save_drafter(drafter, config, tmp_path / "drafter", dtype="float32")
    code_file = write_rows(
        tmp_path / "code.jsonl", [{"prompt": "def add(a, b):"}, {"prompt": "class Point:"}]
    )
    chat = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "answer"},
        {"role": "user", "content": "what is two plus two?"},
    ]
    chat_file = write_rows(tmp_path / "chat.jsonl", [{"messages": chat}, {"prompt": "the quick fox"}] * 2)
    args = [
        "eval", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
        "--prompts", code_file, chat_file, "--max-new-tokens", "9", "--baseline", "ngram",
        "--ddtree-budget", "6", "--decode-prompts", "1", "--batch-size", "3", "--device", "cpu",
        "--output-dir", str(tmp_path / "out"), "--no-progress", "--json",
    ]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert [f["file"] for f in result["per_file"]] == [code_file, chat_file]
    assert [f["num_prompts"] for f in result["per_file"]] == [2, 4]
    assert [f["num_decoded"] for f in result["per_file"]] == [1, 1]
    assert result["num_prompts"] == 6 and result["num_decoded_prompts"] == 2
    assert result["lossless"] is True and result["lossless_up_to_ties"] is True
    for key in ("tau", "ngram_tau", "ddtree_tau", "per_position_acceptance", "speedup", "timings"):
        assert result[key] is not None, key
    tokens = sum(f["tokens"] for f in result["per_file"])
    assert result["tokens"] == tokens
    assert set(result["timings"]) >= {"generate", "features", "drafter", "simulation", "decode"}
    assert "overall" in out and code_file in out
    saved = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert saved["tau"] == result["tau"] and saved["per_file"][1]["file"] == chat_file
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert result["output_files"]["acceptance_png"] is None
    else:
        assert (tmp_path / "out" / "acceptance.png").stat().st_size > 0


def test_eval_command_decode_mode_and_sampling(tiny_qwen3_dir, tmp_path, capsys):
    from dflash_train.cli import main
    from dflash_train.models.export import save_drafter

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    drafter, config = make_drafter(model, tokenizer)
    save_drafter(drafter, config, tmp_path / "drafter", dtype="float32")
    prompts = write_rows(tmp_path / "p.jsonl", [{"prompt": "def add(a, b):"}, {"prompt": "class Point:"}])
    base = ["eval", "--target", str(tiny_qwen3_dir), "--drafter", str(tmp_path / "drafter"), "--prompts", prompts,
            "--max-new-tokens", "9", "--device", "cpu", "--no-progress", "--json"]  # fmt: skip
    assert main([*base, "--tau-mode", "decode"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (
        result["tau_mode"] == "decode" and result["lossless"] is True and result["num_decoded_prompts"] == 2
    )
    assert main([*base, "--temperature", "0.8"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["tau_mode"] == "decode" and result["lossless"] is None
    assert main([*base, "--temperature", "0.8", "--tau-mode", "exact"]) == 1
    assert "--tau-mode exact needs --temperature 0" in capsys.readouterr().err


def test_eval_refuses_a_drafter_for_another_target(tiny_qwen3_dir, tiny_hybrid_dir, tmp_path, capsys):
    from dflash_train.cli import main
    from dflash_train.models.export import save_drafter

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    drafter, config = make_drafter(model, tokenizer)
    config.mask_token_id = tokenizer.eos_token_id  # MASK must never be pad/eos
    save_drafter(drafter, config, tmp_path / "drafter", dtype="float32")
    prompts = write_rows(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    args = ["eval", "--target", str(tiny_qwen3_dir), "--drafter", str(tmp_path / "drafter"), "--prompts", prompts,
            "--device", "cpu", "--no-progress"]  # fmt: skip
    assert main(args) == 1
    assert "mask_token_id" in capsys.readouterr().err


def test_eval_options_refuse_bad_values_with_a_remedy():
    from dflash_train.eval.options import EvalOptions

    base = {"target": "t", "drafter": "d", "prompts": ["p.jsonl"]}
    assert EvalOptions(**base).resolved_tau_mode == "exact"
    assert EvalOptions(**base, temperature=0.5).resolved_tau_mode == "decode"
    assert EvalOptions(**base, baseline="ngram", ddtree_budget=4).methods == ["dflash", "ngram", "ddtree"]
    with pytest.raises(ValueError, match="--prompts"):
        EvalOptions(target="t", drafter="d")
    with pytest.raises(ValueError, match="tau_mode"):
        EvalOptions(**base, tau_mode="fast")
    with pytest.raises(ValueError, match="max_new_tokens=0: use >= 1"):
        EvalOptions(**base, max_new_tokens=0)
    with pytest.raises(ValueError, match="DDTree is greedy only"):
        EvalOptions(**base, ddtree_budget=4, temperature=0.7, tau_mode="decode")


def test_exact_mode_reports_hybrid_ddtree_and_skips_only_its_real_decoding(tiny_hybrid_dir, tmp_path, capsys):
    from dflash_train.cli import main
    from dflash_train.models.export import save_drafter

    model = AutoModelForCausalLM.from_pretrained(tiny_hybrid_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_hybrid_dir)
    drafter, config = make_drafter(model, tokenizer)
    save_drafter(drafter, config, tmp_path / "drafter", dtype="float32")
    prompts = write_rows(tmp_path / "p.jsonl", [{"prompt": "def add(a, b):"}, {"prompt": "class Point:"}])
    args = ["eval", "--target", str(tiny_hybrid_dir), "--drafter", str(tmp_path / "drafter"), "--prompts", prompts,
            "--max-new-tokens", "9", "--ddtree-budget", "6", "--decode-prompts", "1", "--device", "cpu",
            "--no-progress", "--json"]  # fmt: skip
    assert main(args) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert 1.0 <= result["ddtree_tau"] <= BLOCK
    assert result["methods"]["ddtree"]["lossless"] is None and result["methods"]["dflash"]["lossless"] is True
    assert "DDTree is not decoded for real on GatedDeltaNet targets" in captured.err
    assert main([*args, "--tau-mode", "decode"]) == 1  # real tree decoding still refuses hybrids, clearly
    assert "not supported for GatedDeltaNet targets" in capsys.readouterr().err
