"""``dflash-train data-stats`` resolves and checks the target exactly as ``train`` does."""

import json
from types import SimpleNamespace

import pytest

from dflash_train.cli import main
from dflash_train.data.stats import run_data_stats
from dflash_train.models.builtin_targets import register_builtin_target
from tests.test_data_readers import GOOD, write_lines


@pytest.fixture
def chats(tmp_path):
    return write_lines(tmp_path / "chats.jsonl", [GOOD, GOOD])


def overrides(tmp_path, chats, target):
    return [f"target.path={target}", f"data.paths=[{chats}]", f"data.cache_dir={tmp_path / 'cache'}"]


def test_builtin_target_of_the_tiny_recipe_resolves_like_train(tmp_path, chats, tiny_hybrid_dir):
    # The tiny recipe's builtin:demo-target goes through the same registry; a test target stands in
    # for the demo's, which takes minutes to build.
    register_builtin_target("stats-test-target", lambda name: tiny_hybrid_dir)
    result = run_data_stats("tiny-cpu", overrides(tmp_path, chats, "builtin:stats-test-target"))
    assert result["rows"] == 2 and result["skips"] == {}


def test_unregistered_builtin_and_missing_path_are_refused(tmp_path, chats):
    with pytest.raises(ValueError, match="'builtin:nowhere' is not registered"):
        run_data_stats("tiny-cpu", overrides(tmp_path, chats, "builtin:nowhere"))
    with pytest.raises(ValueError, match="does not exist"):
        run_data_stats("tiny-cpu", overrides(tmp_path, chats, str(tmp_path / "no-such-target")))


def test_a_target_without_tokenizer_gets_trains_error(tmp_path, chats):
    with pytest.raises(ValueError, match="has no tokenizer; training needs one"):
        run_data_stats("tiny-cpu", overrides(tmp_path, chats, "preset:tiny-hybrid"))


def test_cli_data_stats_on_the_tiny_recipe(tmp_path, chats, tiny_hybrid_dir, capsys):
    register_builtin_target("stats-test-target", lambda name: tiny_hybrid_dir)
    args = ["data-stats", "tiny-cpu", *overrides(tmp_path, chats, "builtin:stats-test-target"), "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"] == 2


def test_regen_rows_train_from_the_ids_the_target_generated(tmp_path, tiny_hybrid_dir, monkeypatch, capsys):
    """A reply whose text does not re-tokenize to its ids: regen stores the ids, data-stats and the
    training rows use them."""
    from transformers import AutoTokenizer

    from dflash_train.config import load_config
    from dflash_train.data import regen
    from dflash_train.data.cache import load_or_build
    from dflash_train.data.regen import run_regen
    from dflash_train.generate.sampling import Generation
    from tests.test_data_regen import ROWS, regen_args, split_merged_token

    tokenizer = AutoTokenizer.from_pretrained(tiny_hybrid_dir)
    _, _, split = split_merged_token(tokenizer)
    # The target "emits" a split its tokenizer never produces.
    fake = SimpleNamespace(
        generated_tokens=0, generate=lambda prompts, keys, **_: [Generation(split, True)] * len(prompts)
    )
    monkeypatch.setattr(regen, "build_generator", lambda model, num_slots, **_: fake)
    chats = write_lines(tmp_path / "chats.jsonl", ROWS[:2])
    output = tmp_path / "regen.jsonl"
    result = run_regen(regen_args(tiny_hybrid_dir, chats, output))
    assert (
        result["rows_done"] == 2 and result["rows_with_token_ids"] == 2 and result["rows_not_round_trip"] == 2
    )
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    first = rows[1]["messages"]  # one user turn, one reply
    prompt = tokenizer.apply_chat_template(first[:1], tokenize=False, add_generation_prompt=True)
    assert first[1]["token_ids"] == split
    assert first[1]["prompt_token_ids"] == tokenizer(prompt, add_special_tokens=False)["input_ids"]

    register_builtin_target("stats-test-target", lambda name: tiny_hybrid_dir)
    args = overrides(tmp_path, output, "builtin:stats-test-target")
    capsys.readouterr()
    stats = run_data_stats("tiny-cpu", args)
    assert stats["rows"] == 2 and stats["rows_from_token_ids"] == 2 and stats["rows_not_round_trip"] == 2
    assert stats["token_ids_fallback"] == {}
    assert "rows from stored token ids: 2 of 2 (2 of them would re-tokenize" in capsys.readouterr().out
    data = load_or_build(load_config("tiny-cpu", args).data, tokenizer, build=False)
    ids, mask = (a.tolist() for a in data.row(1))
    start = len(first[1]["prompt_token_ids"])
    assert ids[:start] == first[1]["prompt_token_ids"] and ids[start : start + len(split)] == split
    assert not any(mask[:start]) and all(mask[start : start + len(split) + 1])  # + the end of turn


def test_replies_regen_cut_at_the_limit_train_without_their_end_of_turn(
    tmp_path, tiny_hybrid_dir, monkeypatch, capsys
):
    """regen writes finished false for a reply cut at --max-new-tokens; training labels its tokens but
    not the end of turn the template closes it with, and data-stats counts the cut replies."""
    from transformers import AutoTokenizer

    from dflash_train.config import load_config
    from dflash_train.data import regen
    from dflash_train.data.cache import load_or_build
    from dflash_train.data.regen import run_regen
    from dflash_train.generate.sampling import Generation
    from tests.test_data_regen import ROWS, regen_args
    from tests.test_data_tokenize import labelled_end_of_turn

    tokenizer = AutoTokenizer.from_pretrained(tiny_hybrid_dir)
    reply = tokenizer("two plus two", add_special_tokens=False)["input_ids"]

    def generate(prompts, keys, **_):  # the row with a system prompt runs into the limit, every turn
        return [Generation(reply, "be brief" not in tokenizer.decode(p)) for p in prompts]

    monkeypatch.setattr(
        regen,
        "build_generator",
        lambda model, num_slots, **_: SimpleNamespace(generated_tokens=0, generate=generate),
    )
    output = tmp_path / "regen.jsonl"
    result = run_regen(regen_args(tiny_hybrid_dir, write_lines(tmp_path / "chats.jsonl", ROWS[:2]), output))
    assert result["rows_done"] == 2 and result["rows_hit_max_new_tokens"] == 1
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["regen"]["finished"] for r in rows] == [[False, False], [True]]

    register_builtin_target("stats-test-target", lambda name: tiny_hybrid_dir)
    args = overrides(tmp_path, output, "builtin:stats-test-target")
    capsys.readouterr()
    stats = run_data_stats("tiny-cpu", args)
    data = load_or_build(load_config("tiny-cpu", args).data, tokenizer, build=False)
    assert [labelled_end_of_turn(tokenizer, *data.row(i)) for i in range(2)] == [[False, False], [True]]
    ids, mask = (a.tolist() for a in data.row(1))  # the finished reply: its ids, then its end of turn
    start = len(rows[1]["messages"][1]["prompt_token_ids"])
    assert ids[start : start + len(reply)] == reply and all(mask[start : start + len(reply) + 1])
    assert (stats["replies_cut"], stats["rows_with_cut_reply"], stats["rows_from_token_ids"]) == (2, 1, 2)
    assert (
        "replies cut at regen's --max-new-tokens (trained without their end-of-turn label): 2, in 1 of 2"
        in (capsys.readouterr().out)
    )
