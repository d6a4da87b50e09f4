"""``dflash-train data-stats`` resolves and checks the target exactly as ``train`` does."""

import json

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
