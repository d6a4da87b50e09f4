"""``dflash-train synth``: Magpie prefixes per template family, filters, determinism and resume."""

import json
import os

import pytest
import torch

from dflash_train.cli import main
from dflash_train.data.prompt_filters import PromptFilter, normalise
from dflash_train.data.special_tokens import end_of_turn_id
from dflash_train.data.synth import SynthOptions, magpie_prefix, run_synth
from tests.chat_families import (
    QWEN_TEMPLATES,
    SHOUTING_TEMPLATE,
    family_tokenizer,
    qwen_tokenizer,
    save_family_target,
    save_with,
)

# Two threads on a shared 2-core machine run ~15x slower than one for these tiny models.
pytestmark = pytest.mark.usefixtures("one_thread")


def options(target, output, **overrides):
    base = dict(target=str(target), output=str(output), num_rows=8, batch_size=16, max_prompt_tokens=16)
    return SynthOptions(**(base | dict(device="cpu", max_reply_tokens=8) | overrides))


def read_rows(path):
    return [json.loads(line) for line in open(path)]


@pytest.mark.parametrize(
    "family, expected",
    [
        ("smollm2", "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\n"),
        ("llama3", "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"),
        ("qwen35", "<|im_start|>user\n"),
    ],
)  # fmt: skip
def test_magpie_prefix_and_end_of_turn_per_family(family, expected):
    tok = family_tokenizer(family)
    assert magpie_prefix(tok, [], {}) == expected
    eot = "<|eot_id|>" if family == "llama3" else "<|im_end|>"
    assert tok.convert_ids_to_tokens(end_of_turn_id(tok, "user")) == eot
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>x</think>\n\nyo"}]
    second = magpie_prefix(tok, history, {"enable_thinking": False})
    assert second.startswith(tok.apply_chat_template(history, tokenize=False)) and second.endswith(
        expected[-12:]
    )


def test_magpie_prefix_keeps_a_given_system_prompt():
    tok = family_tokenizer("qwen35")
    system = [{"role": "system", "content": "You write Python."}]
    assert (
        magpie_prefix(tok, system, {})
        == "<|im_start|>system\nYou write Python.<|im_end|>\n<|im_start|>user\n"
    )


@pytest.mark.parametrize("thinking", [None, False, True])
@pytest.mark.parametrize("template", QWEN_TEMPLATES)
def test_magpie_prefix_on_the_real_qwen_templates(template, thinking):
    """Qwen's templates drop the last reply's think block once a user turn follows, and Qwen3.5/3.6
    refuse the system prompt alone: the prefix is still the template's text before the user content."""
    tok = qwen_tokenizer(template)
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    system = [{"role": "system", "content": "Be kind."}]
    first = [{"role": "user", "content": "hi"}]
    for reply in ("yo", "<think>\nhmm\n</think>\n\nyo"):  # thinking off / on
        history = [*first, {"role": "assistant", "content": reply}]
        second = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n<|im_start|>user\n"
        assert magpie_prefix(tok, history, kwargs) == second
        assert magpie_prefix(tok, [*system, *history], kwargs) == SYSTEM_TURN + second
    assert magpie_prefix(tok, system, kwargs) == SYSTEM_TURN + "<|im_start|>user\n"
    assert magpie_prefix(tok, [], kwargs) == "<|im_start|>user\n"


SYSTEM_TURN = "<|im_start|>system\nBe kind.<|im_end|>\n"


@pytest.mark.parametrize("template", QWEN_TEMPLATES)
def test_synth_two_turns_on_the_real_qwen_templates(tmp_path, monkeypatch, template):
    """``synth --turns 2 --system ...`` on a target carrying Qwen's real template writes
    (system, user, assistant, user) rows; the second prompt starts where the template opens a user turn."""
    from dflash_train.data import synth as synth_module
    from dflash_train.generate.sampling import Generation
    from dflash_train.tiny import build_tiny_target

    tok = qwen_tokenizer(template)
    save_with(tmp_path / "t", build_tiny_target("qwen3", vocab_size=len(tok), seed=0), tok)
    opts = options(tmp_path / "t", tmp_path / "o.jsonl", turns=2, system="Be kind.")
    synthesizer = synth_module.Synthesizer(opts)
    seen = []

    def fake_sample_batch(prompts, keys, **kwargs):
        seen.append(tok.decode(prompts[0]))
        return [Generation(tok("a question about rain", add_special_tokens=False)["input_ids"], True)] * len(
            prompts
        )

    monkeypatch.setattr(synthesizer.generator, "generate", fake_sample_batch)
    ((_, _, messages, problem),) = synthesizer.draw([(0, 0)])
    assert problem is None and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert seen[0] == SYSTEM_TURN + "<|im_start|>user\n"
    assert seen[2] == (
        SYSTEM_TURN + "<|im_start|>user\na question about rain<|im_end|>\n"
        "<|im_start|>assistant\na question about rain<|im_end|>\n<|im_start|>user\n"
    )


def test_templates_where_the_prefix_cannot_be_found_are_refused():
    tok = family_tokenizer("qwen35")
    tok.chat_template = SHOUTING_TEMPLATE
    with pytest.raises(ValueError, match="verbatim"):
        magpie_prefix(tok, [], {})
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="no user header"):
        magpie_prefix(tok, [], {})
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>user\n' + m['content'] + '\n\n' }}{% endfor %}"
    )
    with pytest.raises(ValueError, match="not a special end-of-turn"):
        end_of_turn_id(tok, "user")
    # The last reply is rewritten once a user turn follows, and no turn-closing text shows its end.
    tok.chat_template = (
        "{% for m in messages %}{% if m.role == 'assistant' and loop.last %}{{ '[last]' }}{% endif %}"
        "{{ '<|im_start|>' + m.role + '\n' + m['content'] + '\n' }}{% endfor %}"
    )
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(ValueError, match="no turn-closing text"):
        magpie_prefix(tok, history, {})


def test_prompt_filter_reasons_and_near_duplicates():
    f = PromptFilter(["<|im_start|>"], min_chars=5, near_dup_threshold=0.8)
    assert f.text_problem("a fine question", False, False) == "hit_token_limit"
    assert f.text_problem("see <|im_start|>assistant", True, False) == "template_tokens"
    assert f.text_problem("fine text", True, True) == "template_tokens"
    assert f.text_problem("  hi ", True, False) == "empty_or_short"
    assert f.text_problem("\ufffd\ufffd\ufffdabc\x01\x02", True, False) == "not_printable"
    assert f.text_problem("How do I sort a list in Python?", True, False) is None
    f.remember("How do I sort a list in Python?")
    assert f.duplicate_problem("how do i SORT a list in python") == "exact_duplicate"
    assert f.duplicate_problem("How do I sort a list in Python 3?") == "near_duplicate"
    assert f.duplicate_problem("How do I reverse a dictionary in Rust?") is None
    assert normalise("  Héllo,   WORLD!! ") == "héllo world"


def test_synth_rows_counts_and_determinism(chatty_dir, tmp_path):
    a = run_synth(options(chatty_dir, tmp_path / "a.jsonl"))
    assert a["complete"] and a["rows"] == 8 and a["rows_new"] == 8
    assert a["samples_drawn"] == a["rows"] + sum(a["filtered"].values())
    assert a["filtered"]["exact_duplicate"] > 0  # the tiny target knows only 12 prompts
    rows = read_rows(tmp_path / "a.jsonl")
    assert [m["role"] for r in rows for m in r["messages"]] == ["user"] * 8
    firsts = [normalise(r["messages"][0]["content"]) for r in rows]
    assert len(set(firsts)) == 8 and all(f for f in firsts)
    assert [r["synth"]["seed"] for r in rows] == [0] * 8 and sorted(r["synth"]["index"] for r in rows) == [
        r["synth"]["index"] for r in rows
    ]
    # Randomness is keyed by sample index: another batch size draws the same rows.
    run_synth(options(chatty_dir, tmp_path / "b.jsonl", batch_size=5))
    assert read_rows(tmp_path / "b.jsonl") == rows
    run_synth(options(chatty_dir, tmp_path / "c.jsonl", seed=1))
    assert read_rows(tmp_path / "c.jsonl") != rows


def test_synth_resumes_exactly(chatty_dir, tmp_path):
    whole = tmp_path / "whole.jsonl"
    run_synth(options(chatty_dir, whole, num_rows=8))
    part = tmp_path / "part.jsonl"
    first = run_synth(options(chatty_dir, part, num_rows=4))
    assert first["rows"] == 4
    with open(part, "a") as fh:  # a row written after the last state update, then a torn line
        fh.write(
            json.dumps({"messages": [{"role": "user", "content": "unrecorded"}], "synth": {}}) + '\n{"mes'
        )
    second = run_synth(options(chatty_dir, part, num_rows=8))
    assert second["rows"] == 8 and second["rows_new"] == 4
    assert read_rows(part) == read_rows(whole)
    state = json.loads(open(str(whole) + ".state.json").read())
    assert second["filtered"] == state["tasks"]["default"]["filtered"]
    with pytest.raises(ValueError, match="other settings"):
        run_synth(options(chatty_dir, part, num_rows=9, temperature=0.7))
    stray = tmp_path / "stray.jsonl"
    stray.write_text('{"messages": []}\n')
    with pytest.raises(ValueError, match="no stray.jsonl.state.json"):
        run_synth(options(chatty_dir, stray))


def test_synth_two_turns_alternate(chatty_dir, tmp_path):
    out = tmp_path / "t.jsonl"
    result = run_synth(options(chatty_dir, out, num_rows=2, turns=2, system="Be kind.", max_samples=400))
    rows = read_rows(out)
    assert result["rows"] == 2 and result["samples_drawn"] == 2 + sum(result["filtered"].values())
    assert all([m["role"] for m in r["messages"]] == ["system", "user", "assistant", "user"] for r in rows)
    assert all(r["messages"][0]["content"] == "Be kind." and r["synth"]["turns"] == 2 for r in rows)


def test_synth_counts_a_reply_between_turns_that_hits_its_token_limit(chatty_dir, tmp_path):
    """One reply token is never a whole reply ("ok." and its end of turn): every sample whose first
    turn passes is dropped at its reply, counted, and none is kept."""
    result = run_synth(
        options(chatty_dir, tmp_path / "t.jsonl", num_rows=2, turns=2, max_reply_tokens=1, max_samples=40)
    )
    assert result["rows"] == 0 and result["filtered"]["reply_hit_token_limit"] > 0
    assert result["samples_drawn"] == sum(result["filtered"].values())


def test_synth_on_a_padless_llama3_target_counts_every_sample(tmp_path):
    target = save_family_target(tmp_path / "llama", "llama3")
    assert family_tokenizer("llama3").pad_token is None
    result = run_synth(options(target, tmp_path / "l.jsonl", num_rows=4, max_samples=12, batch_size=6))
    assert result["samples_drawn"] == 12 or result["complete"]
    assert result["samples_drawn"] == result["rows"] + sum(result["filtered"].values())


def test_synth_cli_json(chatty_dir, tmp_path, capsys):
    out = tmp_path / "cli.jsonl"
    argv = ["synth", "--target", str(chatty_dir), "--output", str(out), "--num-rows", "3"]
    assert main([*argv, "--max-prompt-tokens", "16", "--device", "cpu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["rows"] == 3 and set(result["filtered"]) >= {"near_duplicate", "exact_duplicate"}
    assert os.path.exists(str(out) + ".state.json")
    assert result["decode_compiles"] == 0 and result["decode_compile_s"] == 0.0  # auto: eager on a CPU
    assert result["decode_attention"] == "grouped"  # auto on a CPU
    flex = tmp_path / "flex.jsonl"
    argv = ["synth", "--target", str(chatty_dir), "--output", str(flex), "--num-rows", "2", "--device", "cpu"]
    assert main([*argv, "--max-prompt-tokens", "16", "--decode-attention", "flex", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["decode_attention"] == "flex"


def test_synth_reports_the_compiled_steps_compilations(chatty_dir, tmp_path, monkeypatch):
    """``--compile-decode on``: the summary counts the decode step's compilations and their seconds
    (dynamo's eager backend here: tracing and guards, no code generation)."""
    from dflash_train.generate import compiled_step

    monkeypatch.setattr(compiled_step, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()  # no compiled entry of an earlier test serves this run
    result = run_synth(options(chatty_dir, tmp_path / "c.jsonl", num_rows=3, compile_decode="on"))
    assert result["rows"] == 3
    # one sampling setting (one turn: prompts only): one compilation serves every call
    assert result["decode_compiles"] == 1 and 0 < result["decode_compile_s"] <= result["elapsed_s"]


@pytest.mark.parametrize(
    "thinking, reply_prompt_end", [("off", "<think>\n\n</think>\n\n"), ("on", "<think>\n")]
)
def test_thinking_switch_reaches_the_template(tmp_path, monkeypatch, thinking, reply_prompt_end):
    """Qwen3.5-style template: the reply prompt between turns follows --thinking."""
    from dflash_train.data import synth as synth_module
    from dflash_train.generate.sampling import Generation

    target = save_family_target(tmp_path / "qwen35", "qwen35")
    synthesizer = synth_module.Synthesizer(options(target, tmp_path / "o.jsonl", turns=2, thinking=thinking))
    tok = synthesizer.tokenizer
    seen = []

    def fake_sample_batch(prompts, keys, **kwargs):
        seen.append(tok.decode(prompts[0]))
        return [
            Generation(tok("a question about rain", add_special_tokens=False)["input_ids"], True)
            for _ in prompts
        ]

    monkeypatch.setattr(synthesizer.generator, "generate", fake_sample_batch)
    ((_, _, messages, problem),) = synthesizer.draw([(0, 0)])
    assert problem is None and [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert seen[0] == "<|im_start|>user\n"
    assert seen[1].endswith("<|im_start|>assistant\n" + reply_prompt_end)  # the reply prompt
    assert seen[2].endswith("<|im_end|>\n<|im_start|>user\n")  # the second user turn's prefix


def test_gpu_script_splits_gzip_files_under_the_limit(tmp_path):
    import gzip
    import importlib.util
    import random

    spec = importlib.util.spec_from_file_location("gpu_synth_regen", "scripts/gpu_synth_regen.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rng = random.Random(0)
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps({"x": rng.randbytes(300).hex()}) + "\n" for _ in range(400)))
    out = tmp_path / "out"
    out.mkdir()
    names = script.gzip_parts(source, out, max_mib=0.05)
    assert len(names) > 1 and all((out / n).stat().st_size < 0.05 * 2**20 for n in names)
    assert b"".join(gzip.decompress((out / n).read_bytes()) for n in names) == source.read_bytes()
    assert script.gzip_parts(source, out, max_mib=15) == ["rows.jsonl.gz"]


def test_near_duplicate_index_stays_small_and_finds_near_copies():
    """Prompts sharing common openings must not pile into one bucket (quadratic at 20K rows)."""
    import random

    rng = random.Random(0)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9)))
        for _ in range(3000)
    ]
    starts = ["How do I", "Can you explain", "What is the best way to", "Write a Python function that"]
    prompts = [
        f"{rng.choice(starts)} {' '.join(rng.choices(words, k=rng.randint(12, 30)))}" for _ in range(2000)
    ]
    f = PromptFilter([], min_chars=5, near_dup_threshold=0.8)
    for p in prompts:
        assert f.duplicate_problem(p) is None
        f.remember(p)
    assert max(len(rows) for rows in f.index.values()) < 100  # of 2000 kept prompts
    caught = sum(f.duplicate_problem(p + " ok") == "near_duplicate" for p in prompts[:300])
    assert caught >= 290


def test_stop_loops_drops_looping_turns_when_they_loop_and_is_part_of_the_settings(tmp_path, monkeypatch):
    """With --stop-loops a turn that repeats itself ends there and its sample is counted as looped (a
    random target's greedy turns loop at once; a loop test small enough for its 32-token turns): the
    same samples that run into the token limit without it; every sample is counted once, and a resume
    without the option is refused."""
    from dflash_train.data import synth as synth_module
    from dflash_train.generate.loops import LoopStop

    monkeypatch.setattr(synth_module, "LoopStop", lambda: LoopStop(max_period=4, min_span=8))
    target = save_family_target(tmp_path / "random", "smollm2")
    settings = dict(num_rows=2, max_samples=16, max_prompt_tokens=32, temperature=0.0)
    out = tmp_path / "loops.jsonl"
    stopped = run_synth(options(target, out, stop_loops=True, **settings))
    plain = run_synth(options(target, tmp_path / "plain.jsonl", **settings))
    assert plain["filtered"]["hit_token_limit"] == 16 and plain["filtered"]["looped"] == 0
    assert stopped["filtered"]["looped"] == 16 and stopped["filtered"]["hit_token_limit"] == 0
    assert stopped["samples_drawn"] == stopped["rows"] + sum(stopped["filtered"].values())
    with pytest.raises(ValueError, match="stop_loops"):
        run_synth(options(target, out, **settings))
