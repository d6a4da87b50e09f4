"""Target regeneration end to end on a tiny saved target, resume, and data-stats."""

import dataclasses
import json

import pytest
import yaml

from dflash_train.cli import build_parser, main
from dflash_train.data.regen import options_from_args, run_regen
from dflash_train.data.stats import run_data_stats

ROWS = [
    {
        "id": "a",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "old reply one"},
            {"role": "user", "content": "more"},
            {"role": "assistant", "content": "old reply two"},
        ],
    },
    {"conversations": [{"from": "human", "value": "add"}, {"from": "gpt", "value": "old"}]},
    {"messages": [{"role": "user", "content": "prompt only"}]},
    {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "old"}]},
]


def regen_args(target, data, output, **overrides):
    """The CLI's ``regen`` options (its defaults), small and CPU-only, plus ``overrides``."""
    argv = ["regen", "--target", str(target), "--data", str(data), "--output", str(output)]
    argv += ["--max-new-tokens", "4", "--batch-size", "2", "--engine", "transformers", "--device", "cpu"]
    return dataclasses.replace(options_from_args(build_parser().parse_args(argv)), **overrides)


@pytest.fixture
def chat_file(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_regen_replaces_assistant_turns_and_resumes(tiny_hybrid_dir, chat_file, tmp_path):
    output = tmp_path / "out" / "regen.jsonl"
    first = run_regen(regen_args(tiny_hybrid_dir, chat_file, output, max_rows=3))
    assert first["engine"] == "transformers" and first["rows_done"] == 3 and first["rows_skipped"] == 0
    rows = read_jsonl(output)
    assert [r["regen"]["line"] for r in rows] == [1, 2, 3]
    roles = [[m["role"] for m in r["messages"]] for r in rows]
    assert roles == [
        ["system", "user", "assistant", "user", "assistant"],
        ["user", "assistant"],
        ["user", "assistant"],  # a prompt-only row gets one reply
    ]
    assert rows[0]["id"] == "a" and rows[0]["messages"][3] == ROWS[0]["messages"][3]
    assert all(m["content"] != "old reply one" for m in rows[0]["messages"])
    assert len(rows[0]["regen"]["finished"]) == 2

    # A crash left a torn line; the rerun cuts it, skips the 3 done rows and adds only row 4.
    with open(output, "a") as fh:
        fh.write('{"messages": [')
    second = run_regen(regen_args(tiny_hybrid_dir, chat_file, output))
    assert second["rows_done"] == 1 and second["rows_skipped"] == 3
    rows_after = read_jsonl(output)
    assert rows_after[:3] == rows and [r["regen"]["line"] for r in rows_after] == [1, 2, 3, 4]
    third = run_regen(regen_args(tiny_hybrid_dir, chat_file, output))
    assert third["rows_done"] == 0 and third["rows_skipped"] == 4 and third["engine"] == "none"


def test_regen_is_deterministic_and_matches_batch_size_one(tiny_hybrid_dir, chat_file, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    run_regen(regen_args(tiny_hybrid_dir, chat_file, a, batch_size=4))
    run_regen(regen_args(tiny_hybrid_dir, chat_file, b, batch_size=1))  # left padding is neutral
    assert [r["messages"] for r in read_jsonl(a)] == [r["messages"] for r in read_jsonl(b)]


def test_regen_output_trains(tiny_hybrid_dir, chat_file, tmp_path):
    output = tmp_path / "regen.jsonl"
    run_regen(regen_args(tiny_hybrid_dir, chat_file, output, batch_size=4))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump({"output_dir": str(tmp_path / "run"), "target": {"path": str(tiny_hybrid_dir)}})
    )
    overrides = [
        f"data.paths=[{output}]",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.seq_buckets=[64,128]",
        "data.token_budget=256",
        "data.max_bad_rows=4",
    ]
    result = run_data_stats(str(recipe), overrides)
    assert result["rows"] + sum(result["skips"].values()) == 4
    assert result["rows"] >= 1 and 0 <= result["padding_waste"] < 1


def test_data_stats_cli_json(tiny_hybrid_dir, chat_file, tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump({"output_dir": str(tmp_path / "run"), "target": {"path": str(tiny_hybrid_dir)}})
    )
    overrides = [f"data.paths=[{chat_file}]", f"data.cache_dir={tmp_path / 'cache'}", "data.max_bad_rows=1"]
    assert main(["data-stats", str(recipe), *overrides, "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["rows"] == 3 and result["skips"] == {"no_assistant_turn": 1}
    assert result["rows_per_bucket"] == {"1024": 3, "2048": 0, "4096": 0}
    assert set(result) >= {"tokens", "response_tokens", "padding_waste", "steps_per_epoch"}


@pytest.mark.parametrize("command", ["regen", "synth"])
def test_cli_defaults_are_the_option_defaults(command):
    """The demo and scripts build the options directly: they must get what the CLI gives."""
    from dflash_train.data import synth

    required = {"regen": ["--target", "t", "--data", "d", "--output", "o"], "synth": ["--target", "t", "--output", "o", "--num-rows", "3"]}[command]  # fmt: skip
    module = {"regen": __import__("dflash_train.data.regen", fromlist=["x"]), "synth": synth}[command]
    from_cli = module.options_from_args(build_parser().parse_args([command, *required]))
    cls = type(from_cli)
    direct = cls(
        **{
            f.name: getattr(from_cli, f.name)
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING
        }
    )
    assert from_cli == direct


def test_regen_pads_with_eos_when_the_tokenizer_has_no_pad_token(tmp_path, chat_file):
    from tests.chat_families import save_family_target

    target = save_family_target(tmp_path / "llama3", "llama3", eos_ids=None)
    output = tmp_path / "out.jsonl"
    result = run_regen(regen_args(target, chat_file, output, batch_size=4, temperature=0.8, top_p=0.9))
    assert result["rows_done"] == 4 and result["rows_failed"] == 0
    single = tmp_path / "single.jsonl"
    run_regen(regen_args(target, chat_file, single, batch_size=1, temperature=0.8, top_p=0.9))
    assert [r["messages"] for r in read_jsonl(output)] == [r["messages"] for r in read_jsonl(single)]


def test_regen_refuses_a_checkpoint_with_missing_weights(tiny_qwen3_dir, chat_file, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_qwen3_dir, broken)
    weights = load_file(broken / "model.safetensors")
    save_file(
        {k: v for k, v in weights.items() if "layers.1.mlp" not in k},
        broken / "model.safetensors",
        metadata={"format": "pt"},
    )
    with pytest.raises(ValueError, match="lacks .* weights"):
        run_regen(regen_args(broken, chat_file, tmp_path / "o.jsonl"))


def split_merged_token(tokenizer):
    """(text, its canonical ids, a split of them into single characters the tokenizer never produces)."""
    for token_id in sorted(tokenizer.get_vocab().values()):
        text = tokenizer.decode([token_id])
        if (
            len(text) < 2
            or not text.isalpha()
            or tokenizer(text, add_special_tokens=False)["input_ids"] != [token_id]
        ):
            continue
        chars = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in text]
        if all(len(c) == 1 for c in chars):
            return text, [token_id], [c[0] for c in chars]
    raise AssertionError("the tiny tokenizer has no merged alphabetic token")


def test_round_trip_error_finds_a_split_the_tokenizer_never_produces(tiny_hybrid_dir):
    from transformers import AutoTokenizer

    from dflash_train.data.regen_turns import round_trip_error

    tokenizer = AutoTokenizer.from_pretrained(tiny_hybrid_dir)
    text, canonical, split = split_merged_token(tokenizer)
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": text}]
    assert round_trip_error(tokenizer, conversation, canonical, {}) is None
    error = round_trip_error(tokenizer, conversation, split, {})
    assert error is not None and f"generated {split}" in error and f"tokenizes to [{canonical[0]}," in error


def test_regen_counts_rows_whose_text_does_not_round_trip(
    tiny_hybrid_dir, chat_file, tmp_path, monkeypatch, capsys
):
    from transformers import AutoTokenizer

    from dflash_train.data import regen
    from dflash_train.generate.sampling import Generation

    _, _, split = split_merged_token(AutoTokenizer.from_pretrained(tiny_hybrid_dir))
    # The target "emits" a non-canonical split: its text cannot carry those ids.
    from types import SimpleNamespace

    fake = SimpleNamespace(
        generated_tokens=0, generate=lambda prompts, keys, **_: [Generation(split, True)] * len(prompts)
    )
    monkeypatch.setattr(regen, "build_generator", lambda model, num_slots, **_: fake)
    output = tmp_path / "regen.jsonl"
    result = run_regen(regen_args(tiny_hybrid_dir, chat_file, output, max_rows=2))
    assert result["rows_done"] == 2 and result["rows_not_round_trip"] == 2
    rows = read_jsonl(output)
    assert [r["regen"]["round_trip"] for r in rows] == [[False, False], [False]]  # per assistant turn
    assert "2 of 2 rows store a reply whose text re-tokenizes" in capsys.readouterr().err


def test_regen_reports_rows_that_round_trip(tiny_hybrid_dir, chat_file, tmp_path):
    output = tmp_path / "regen.jsonl"
    result = run_regen(regen_args(tiny_hybrid_dir, chat_file, output))
    rows = read_jsonl(output)
    assert all(len(r["regen"]["round_trip"]) == len(r["regen"]["finished"]) for r in rows)
    assert result["rows_not_round_trip"] == sum(not all(r["regen"]["round_trip"]) for r in rows)


def test_regen_answers_the_last_user_turn_of_a_multi_turn_row(tiny_hybrid_dir, tmp_path):
    """A ``synth --turns 2`` row (system, user, assistant, user) gets both replies, in every engine."""
    from dflash_train.data.readers import ChatRow
    from dflash_train.data.regen_turns import Reply, regenerate_row

    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "old"},
        {"role": "user", "content": "and then?"},
    ]
    data = tmp_path / "turns.jsonl"
    data.write_text(json.dumps({"messages": messages}) + "\n")
    output = tmp_path / "regen.jsonl"
    assert run_regen(regen_args(tiny_hybrid_dir, data, output))["rows_done"] == 1
    (row,) = read_jsonl(output)
    assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert row["messages"][3] == messages[3] and len(row["regen"]["finished"]) == 2

    # The endpoint's per-row path: the same turns, each reply seeing the regenerated history.
    seen = []

    def complete(conversation, key):
        seen.append([m["role"] for m in conversation])
        return Reply(f"reply {len(seen)}", True)

    _, conversation, finished, error = regenerate_row(complete, ChatRow(messages, str(data), 1))
    assert error is None and finished == [True, True]
    assert seen == [["system", "user"], ["system", "user", "assistant", "user"]]
    assert [m["content"] for m in conversation[2::2]] == ["reply 1", "reply 2"]


class FakeVllm:
    """A stand-in for the ``vllm`` module: the "model" always writes ``hello``, the template's
    end-of-turn token, then more text; it stops like vLLM, at the tokenizer's EOS or a
    ``stop_token_ids`` entry (kept as the last output id) or after ``max_tokens``."""

    def __init__(self):
        self.params = []
        fake = self

        class LLM:
            def __init__(self, model, seed):
                from transformers import AutoTokenizer

                self.tokenizer = AutoTokenizer.from_pretrained(model)

            def get_tokenizer(self):
                return self.tokenizer

            def generate(self, prompts, params, use_tqdm):
                from types import SimpleNamespace

                tok = self.tokenizer
                stream = tok("hello<|im_end|> and then some", add_special_tokens=False)["input_ids"]
                outputs = []
                for prompt, p in zip(prompts, params):
                    fake.params.append(p)
                    stops = {tok.eos_token_id, *(p.kwargs.get("stop_token_ids") or [])}
                    end = next((k + 1 for k, t in enumerate(stream) if t in stops), None)
                    ids, reason = (
                        (stream[:end], "stop") if end else (stream[: p.kwargs["max_tokens"]], "length")
                    )
                    completion = SimpleNamespace(token_ids=ids, finish_reason=reason)
                    outputs.append(
                        SimpleNamespace(outputs=[completion], prompt_token_ids=prompt["prompt_token_ids"])
                    )
                return outputs

        class SamplingParams:
            def __init__(self, **kwargs):
                self.kwargs = kwargs

        self.LLM, self.SamplingParams = LLM, SamplingParams


def test_vllm_engine_stops_at_the_templates_end_of_turn(tmp_path, monkeypatch):
    """A target whose EOS is not the template's end-of-turn token (a base-model tokenizer, a
    generation config naming only <|endoftext|>): vLLM must be told to stop at <|im_end|> too, as the
    transformers engine does, or the reply runs past its turn and still counts as finished."""
    import sys

    from tests.chat_families import family_tokenizer, save_family_target

    tokenizer = family_tokenizer("qwen35")
    tokenizer.eos_token = "<|endoftext|>"
    eos, end_of_turn = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    target = save_family_target(tmp_path / "t", "qwen35", tokenizer=tokenizer, eos_ids=[eos])
    fake = FakeVllm()
    monkeypatch.setitem(sys.modules, "vllm", fake)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    output = tmp_path / "o.jsonl"
    result = run_regen(regen_args(target, data, output, engine="vllm", max_new_tokens=16))
    assert result["engine"] == "vllm" and result["rows_done"] == 1
    assert set(fake.params[0].kwargs["stop_token_ids"]) == {eos, end_of_turn}
    (row,) = read_jsonl(output)
    assert row["messages"][-1]["content"] == "hello" and row["regen"]["finished"] == [True]


def stored_ids_count(message: dict) -> int:
    """Token ids an assistant message stores (generated and prompt, in whichever form)."""
    keys = ("token_ids", "prompt_token_ids", "prompt_token_ids_tail")
    return sum(len(message.get(key, [])) for key in keys)


def test_a_20_turn_regenerated_row_stores_each_prompt_once_and_trains_as_full_prompts(
    tiny_hybrid_dir, tmp_path
):
    """Each reply of a long conversation stores only what its prompt adds to the previous reply's
    prompt and ids: O(turns x tokens), not the whole prefix per reply. It trains exactly as the same
    row with every reply's full prompt_token_ids (the files regen wrote before) does."""
    from transformers import AutoTokenizer

    from dflash_train.config import DataConfig
    from dflash_train.data.cache import load_or_build

    turns = 20
    messages = []
    for t in range(turns):
        messages += [{"role": "user", "content": f"question {t}"}, {"role": "assistant", "content": "old"}]
    data = tmp_path / "turns.jsonl"
    data.write_text(json.dumps({"messages": messages}) + "\n")
    output = tmp_path / "regen.jsonl"
    assert run_regen(regen_args(tiny_hybrid_dir, data, output))["rows_done"] == 1
    (row,) = read_jsonl(output)
    replies = [m for m in row["messages"] if m["role"] == "assistant"]
    assert len(replies) == turns and all("token_ids" in m for m in replies)
    tokenizer = AutoTokenizer.from_pretrained(tiny_hybrid_dir)
    full_prompts = []
    for i, message in enumerate(row["messages"]):
        if message["role"] == "assistant":
            history = [{"role": m["role"], "content": m["content"]} for m in row["messages"][:i]]
            prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
            full_prompts.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    whole = len(full_prompts[-1]) + len(replies[-1]["token_ids"])
    assert sum(map(stored_ids_count, replies)) <= 2 * whole  # a whole prefix per reply: about turns / 2 x
    # The files regen wrote before: every reply with its whole prompt.
    old = json.loads(json.dumps(row))
    old_replies = [m for m in old["messages"] if m["role"] == "assistant"]
    for message, prompt in zip(old_replies, full_prompts):
        message.pop("prompt_token_ids_from_previous", None)
        message.pop("prompt_token_ids_tail", None)
        message["prompt_token_ids"] = prompt
    old_file = tmp_path / "old.jsonl"
    old_file.write_text(json.dumps(old) + "\n")
    built = [
        load_or_build(
            DataConfig(paths=[str(path)], cache_dir=str(tmp_path / "cache"), num_workers=1), tokenizer
        )
        for path in (output, old_file)
    ]
    for tokenized in built:  # trained from the stored ids, every reply of them
        assert tokenized.num_rows == 1 and tokenized.id_sources[0] > 0 and tokenized.id_fallbacks == {}
    assert [a.tolist() for a in built[0].row(0)] == [a.tolist() for a in built[1].row(0)]


@pytest.mark.parametrize("choice, compiled", [("on", True), ("off", False), ("auto", False)])
def test_compile_decode_reaches_the_slot_engine(
    tiny_qwen3_dir, chat_file, tmp_path, monkeypatch, choice, compiled
):
    """``--compile-decode`` picks the slot engine's compiled step (auto: off on a CPU); the report says
    which ran and what its compilations cost (dynamo's eager backend here: tracing and guards, no
    code generation)."""
    import torch

    from dflash_train.data.regen import TransformersEngine
    from dflash_train.generate import compiled_step

    monkeypatch.setattr(compiled_step, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()  # no compiled entry of an earlier test serves this run
    opts = regen_args(tiny_qwen3_dir, chat_file, tmp_path / "out.jsonl", compile_decode=choice)
    assert TransformersEngine(opts, "cpu").generator.compile_decode is compiled
    result = run_regen(opts)
    assert result["compile_decode"] is compiled and result["rows_done"] == 4
    if compiled:
        # one sampling setting: one compilation serves every turn's call, whatever its prompt lengths
        assert result["decode_compiles"] == 1 and 0 < result["decode_compile_s"] <= result["elapsed_s"]
    else:
        assert result["decode_compiles"] == 0 and result["decode_compile_s"] == 0.0


def test_compile_decode_refuses_an_unknown_choice(tmp_path):
    with pytest.raises(ValueError, match="--compile-decode 'yes'"):
        regen_args("t", tmp_path / "d", tmp_path / "o", compile_decode="yes")
    with pytest.raises(SystemExit):
        build_parser().parse_args(
            ["regen", "--target", "t", "--data", "d", "--output", "o", "--compile-decode", "yes"]
        )


@pytest.mark.parametrize("choice, attention", [("auto", "grouped"), ("flex", "flex"), ("grouped", "grouped")])
def test_decode_attention_reaches_the_slot_engine(tiny_qwen3_dir, chat_file, tmp_path, choice, attention):
    """``--decode-attention`` picks the slot engine's decode attention (auto: grouped on a CPU) and the
    report says which ran; an unknown one is refused by name."""
    opts = regen_args(tiny_qwen3_dir, chat_file, tmp_path / "out.jsonl", decode_attention=choice)
    result = run_regen(opts)
    assert result["decode_attention"] == attention and result["rows_done"] == 4
    with pytest.raises(ValueError, match="--decode-attention 'sdpa': use auto, flex or grouped"):
        regen_args("t", tmp_path / "d", tmp_path / "o", decode_attention="sdpa")


@pytest.mark.parametrize(
    "changed", [{"temperature": 0.7}, {"max_new_tokens": 8}, {"seed": 1}, {"thinking": "off"}]
)
def test_a_rerun_with_other_settings_is_refused_not_mixed_into_the_output(
    tiny_hybrid_dir, chat_file, tmp_path, changed
):
    """The rerun only skipped the keys already written: another sampling, length or seed appended its
    rows to the first run's, and training read labels of two settings as one."""
    output = tmp_path / "regen.jsonl"
    run_regen(regen_args(tiny_hybrid_dir, chat_file, output, max_rows=2))
    before = output.read_text()
    ((key, value),) = changed.items()
    with pytest.raises(ValueError, match=rf"regen.jsonl:1 was regenerated with other settings .*'{key}'"):
        run_regen(regen_args(tiny_hybrid_dir, chat_file, output, **changed))
    assert output.read_text() == before


def test_a_rerun_over_a_folder_that_holds_the_output_does_not_read_it_back(tiny_hybrid_dir, tmp_path):
    """``--data data/ --output data/regen.jsonl``: the first run listed the folder before its output
    existed; every rerun read the output (and the failed-rows file) as input and regenerated it again."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:3]))
    output = data / "regen.jsonl"
    assert run_regen(regen_args(tiny_hybrid_dir, data, output))["rows_done"] == 3
    again = run_regen(regen_args(tiny_hybrid_dir, data, output))
    assert again["rows_done"] == 0 and again["rows_skipped"] == 3
    assert len(read_jsonl(output)) == 3


def test_a_row_the_chat_template_refuses_fails_alone_into_the_failed_rows(tmp_path):
    """Qwen3.5's template raises on a system message after the first turn: the in-process engines
    ended the whole run there (and every rerun at the same row), where the endpoint fails that row."""
    from dflash_train.tiny import build_tiny_target
    from tests.chat_families import qwen_tokenizer, save_with

    tok = qwen_tokenizer("qwen3.5")
    save_with(tmp_path / "t", build_tiny_target("qwen3", vocab_size=len(tok), seed=0), tok)
    refused = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "old"},
            {"role": "system", "content": "late system turn"},
            {"role": "user", "content": "more"},
            {"role": "assistant", "content": "old"},
        ]
    }
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [ROWS[3], refused, ROWS[2]]))
    output = tmp_path / "regen.jsonl"
    result = run_regen(regen_args(tmp_path / "t", data, output))
    assert result["rows_done"] == 2 and result["rows_failed"] == 1
    assert [r["regen"]["line"] for r in read_jsonl(output)] == [1, 3]
    (failed,) = read_jsonl(tmp_path / "regen.failed.jsonl")
    assert failed["line"] == 2 and failed["messages"] == refused["messages"]
    assert failed["reason"].startswith("assistant turn 1: the chat template fails")
    assert "System message must be at the beginning" in failed["reason"]
