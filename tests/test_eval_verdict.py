"""The lossless verdict (identical / up to ties / bug), prompt files, and the eval command's
per-file report, output directory and pad-less tokenizers."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_train.eval.prompts import BadPromptRows, load_prompt_file
from dflash_train.eval.verdict import (
    TIE_ULPS,
    describe_divergence,
    divergence_line,
    tie_threshold,
    verdict,
    verdict_line,
)

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
    assert divergences[0]["logit_margin"] > 100 * divergences[0]["tie_threshold"]
    assert "bug" in verdict_line(verdict(divergences, 1, 0.0))


def plant_near_tie(model, context):
    """Make the target's next token after ``context`` an exact two-way tie: the embedding row (the
    LM head is tied) of the best-ranked token outside ``context`` becomes a copy of the top
    token's. Returns (top, partner, the token the target ranks last)."""
    with torch.no_grad():
        logits = model(torch.tensor([context])).logits[0, -1].float()
        order = logits.argsort(descending=True).tolist()
        top = order[0]
        partner = next(t for t in order[1:] if t not in context)
        embedding = model.get_input_embeddings().weight
        embedding[partner] = embedding[top]
    assert model.get_output_embeddings().weight.data_ptr() == embedding.data_ptr()  # tied head
    return top, partner, order[-1]


@pytest.fixture
def bf16_near_tie(tiny_qwen3_dir):
    """The tiny Qwen3 target in bf16 with a prompt whose next token is a planted near-tie."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.bfloat16).eval()
    prompt = AutoTokenizer.from_pretrained(tiny_qwen3_dir)("def add(a, b):")["input_ids"]
    top, partner, last = plant_near_tie(model, prompt)
    return model, prompt, top, partner, last


def test_a_last_ranked_token_at_a_near_tie_is_a_clear_divergence(bf16_near_tie):
    """The target's top-2 gap being small says nothing about the emitted token: a token the target
    ranks last, emitted where its top two are tied, is a bug, not a tie."""
    model, prompt, top, _, last = bf16_near_tie
    d = describe_divergence(model, prompt, [top, 5], [last, 5], 0)
    assert d["reference_top2_gap"] <= d["tie_threshold"]  # the planted near-tie
    assert d["speculative_rank"] == model.config.vocab_size - 1
    assert d["logit_margin"] > 10 * d["tie_threshold"]
    assert d["is_tie"] is False
    assert "rank 319" in divergence_line(d) and "CLEAR MARGIN (bug)" in divergence_line(d)
    assert "bug" in verdict_line(verdict([d], 1, 0.0))


def test_the_tied_partner_is_a_tie_both_ways_and_a_wide_margin_is_not(bf16_near_tie):
    model, prompt, top, partner, last = bf16_near_tie
    for reference, emitted in ((top, partner), (partner, top)):
        d = describe_divergence(model, prompt, [reference], [emitted], 0)
        assert abs(d["logit_margin"]) <= d["tie_threshold"] and d["is_tie"] is True
        assert d["speculative_rank"] <= 1 and divergence_line(d).endswith(": tie")
    assert verdict_line(verdict([d], 1, 0.0)).startswith("lossless up to ties")
    # The emitted token far ABOVE the reference's: the plain reference picked a clearly worse
    # token, which is no tie either.
    d = describe_divergence(model, prompt, [last], [top], 0)
    assert d["logit_margin"] < -10 * d["tie_threshold"] and d["is_tie"] is False


def test_a_length_only_difference_is_never_a_tie(bf16_near_tie):
    """An output cut short (or running on) at a near-tie is a clear divergence."""
    model, prompt, top, _, _ = bf16_near_tie
    for reference, output, ended in (([top, 5], [], "speculative"), ([], [top], "target")):
        d = describe_divergence(model, prompt, reference, output, 0)
        assert d["position"] == 0 and d["reference_top2_gap"] <= d["tie_threshold"]
        assert d["logit_margin"] is None and d["speculative_rank"] is None
        assert d["is_tie"] is False
        assert f"the {ended} output ends here" in divergence_line(d)
        assert verdict([d], 1, 0.0)["num_clear_divergences"] == 1


def test_a_verifier_that_picks_the_last_token_at_near_ties_is_a_clear_margin_bug(tiny_qwen3_dir, monkeypatch):
    """Plant a bug that strikes only at near-ties (there the verifier takes the target's last-ranked
    token instead of its argmax) and plant a near-tie in the greedy continuation: the divergence is
    reported where the target's top-2 gap is within the threshold, and still as a bug."""
    from dflash_train.eval import speculative
    from dflash_train.eval.prompts import encode_prompt
    from dflash_train.eval.runner import evaluate
    from dflash_train.tiny import sharpen

    model = sharpen(AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir).eval())  # a varied continuation
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    prompt = encode_prompt(tokenizer, {"prompt": "def add(a, b):"}, None)
    reference = []
    with torch.no_grad():
        for _ in range(4):
            reference.append(int(model(torch.tensor([[*prompt, *reference]])).logits[0, -1].argmax()))
    plant_near_tie(model, [*prompt, *reference[:3]])  # at position 3 of the greedy continuation

    def last_ranked_at_near_ties(draft, logits):
        logits = logits.float()
        top2 = logits.topk(2, dim=-1).values
        near = [
            float(gap) <= tie_threshold(float(scale), torch.float32)
            for gap, scale in zip(top2[:, 0] - top2[:, 1], logits.abs().amax(-1))
        ]
        choices = torch.where(torch.tensor(near), logits.argmin(-1), logits.argmax(-1)).tolist()
        num_accepted = 0
        while num_accepted < len(draft) and draft[num_accepted] == choices[num_accepted]:
            num_accepted += 1
        return num_accepted, choices[num_accepted]

    monkeypatch.setattr(speculative, "accept_greedy", last_ranked_at_near_ties)
    drafter, _ = make_drafter(model, tokenizer)
    report = evaluate(
        model, tokenizer, drafter, [prompt], max_new_tokens=9, methods=("dflash",), eos_token_ids=()
    )
    (d,) = report["methods"]["dflash"]["divergences"]
    assert d["position"] == 3 and d["reference_top2_gap"] <= d["tie_threshold"]
    assert d["speculative_rank"] == model.config.vocab_size - 1 and d["is_tie"] is False
    assert "bug" in verdict_line(verdict([d], 1, 0.0))


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
    png = tmp_path / "out" / "acceptance.png"
    assert result["output_files"]["acceptance_png"] == str(png)
    assert png.read_bytes()[:4] == b"\x89PNG"  # drawn by default: one panel per prompt file


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


def test_eval_generation_engine_choice_gives_the_same_exact_tau(tiny_qwen3_dir, tmp_path, capsys):
    """--generation-engine picks how the greedy continuations are made, never what they are."""
    from dflash_train.cli import main
    from dflash_train.models.export import save_drafter

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    drafter, config = make_drafter(model, tokenizer)
    save_drafter(drafter, config, tmp_path / "drafter", dtype="float32")
    rows = [{"prompt": "def add(a, b):"}, {"prompt": "class Point:"}, {"prompt": "x"}]
    prompts = write_rows(tmp_path / "p.jsonl", rows)
    base = ["eval", "--target", str(tiny_qwen3_dir), "--drafter", str(tmp_path / "drafter"), "--prompts", prompts,
            "--max-new-tokens", "11", "--batch-size", "2", "--device", "cpu", "--no-progress", "--json"]  # fmt: skip
    results = {}
    for engine in ("slots", "padded"):
        assert main([*base, "--generation-engine", engine]) == 0
        results[engine] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert results["slots"]["tau"] == results["padded"]["tau"]
    assert results["slots"]["per_file"] == results["padded"]["per_file"]
    with pytest.raises(SystemExit):  # argparse refuses an unknown engine
        main([*base, "--generation-engine", "fast"])
    assert "invalid choice: 'fast'" in capsys.readouterr().err


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
    from dflash_train.cli import build_parser
    from dflash_train.eval.options import EvalOptions

    base = {"target": "t", "drafter": "d", "prompts": ["p.jsonl"]}
    assert EvalOptions(**base).resolved_tau_mode == "exact"
    assert EvalOptions(**base, temperature=0.5).resolved_tau_mode == "decode"
    assert EvalOptions(**base, baseline="ngram", ddtree_budget=4).methods == ["dflash", "ngram", "ddtree"]
    with pytest.raises(ValueError, match="--prompts"):
        EvalOptions(target="t", drafter="d")
    with pytest.raises(ValueError, match="tau_mode"):
        EvalOptions(**base, tau_mode="fast")
    with pytest.raises(ValueError, match="generation_engine='fast': use auto, slots or padded"):
        EvalOptions(**base, generation_engine="fast")
    with pytest.raises(ValueError, match="max_new_tokens=0: use >= 1"):
        EvalOptions(**base, max_new_tokens=0)
    with pytest.raises(ValueError, match="DDTree is greedy only"):
        EvalOptions(**base, ddtree_budget=4, temperature=0.7, tau_mode="decode")
    with pytest.raises(ValueError, match=r"draft_p_min=1.5: use a probability in \[0, 1\]"):
        EvalOptions(**base, draft_p_min=1.5)
    args = ["eval", "--target", "t", "--drafter", "d", "--prompts", "p.jsonl", "--draft-p-min", "0.3"]
    assert build_parser().parse_args(args).draft_p_min == 0.3


def test_a_prompt_file_given_twice_is_refused(tmp_path):
    """One file twice in --prompts (however spelled) would count its prompts twice overall."""
    from dflash_train.eval.options import EvalOptions

    (tmp_path / "sub").mkdir()
    first, second = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    for again in (first, str(tmp_path / "sub" / ".." / "a.jsonl")):
        with pytest.raises(ValueError, match=r"--prompts names .*a\.jsonl twice: list each file once"):
            EvalOptions(target="t", drafter="d", prompts=[first, second, again])
    assert EvalOptions(target="t", drafter="d", prompts=[first, second]).prompts == [first, second]


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


def test_a_row_the_chat_template_cannot_render_is_a_counted_skip_with_its_line(tiny_qwen3_dir, tmp_path):
    """Jinja raises more than TemplateError: a template concatenating a field of another type (here a
    tool call's name given as a number) raised a bare TypeError, with no file or line and no skip."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.tool_calls %}{{ '<tool>' + m.tool_calls[0].function.name }}"
        "{% endif %}{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    tool_call = {"type": "function", "function": {"name": 5, "arguments": "{}"}}
    path = tmp_path / "p.jsonl"
    write_rows(
        path,
        [
            {"prompt": "hello"},
            {
                "messages": [
                    {"role": "user", "content": "call it"},
                    {"role": "assistant", "content": "", "tool_calls": [tool_call]},
                    {"role": "user", "content": "and now?"},
                ]
            },
        ],
    )
    with pytest.raises(ValueError, match=r"p\.jsonl:2: bad prompt row \(template_error\).*TypeError"):
        load_prompt_file(path, tokenizer)
    loaded = load_prompt_file(path, tokenizer, bad_rows=BadPromptRows(max_bad_rows=1))
    assert len(loaded.prompts) == 1 and loaded.skipped == {"template_error": 1}


def test_a_prompt_that_does_not_fit_the_targets_context_is_a_bad_row(tiny_qwen3_dir, tmp_path, capsys):
    """Prompt plus new tokens past the target's max_position_embeddings: tau would be measured where the
    target was never trained (RoPE extrapolating) and was, silently; now it is a bad row named by its
    line (the eval's default refuses it, --max-bad-rows counts it)."""
    from dflash_train.cli import main
    from dflash_train.eval.prompts import target_context
    from dflash_train.models.export import save_drafter

    model, tokenizer = save_padless_target(tiny_qwen3_dir, tmp_path / "target")
    model.config.max_position_embeddings = 48
    model.save_pretrained(tmp_path / "target")
    drafter, config = make_drafter(model, tokenizer)
    save_drafter(drafter, config, tmp_path / "drafter", dtype="float32")
    path = write_rows(
        tmp_path / "p.jsonl", [{"prompt": "def add(a, b):"}, {"prompt": " ".join(["the fox"] * 30)}]
    )
    loaded = load_prompt_file(
        path, tokenizer, bad_rows=BadPromptRows(max_bad_rows=1), context=target_context(model, 9)
    )
    assert len(loaded.prompts) == 1 and loaded.skipped == {"too_long": 1}
    args = [
        "eval", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
        "--prompts", path, "--max-new-tokens", "9", "--device", "cpu", "--no-progress",
    ]  # fmt: skip
    assert main(args) == 1
    assert re.search(
        r"p\.jsonl:2: bad prompt row \(too_long\): \d+ prompt tokens \+ 9 new", capsys.readouterr().err
    )
