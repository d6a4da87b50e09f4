"""Every packaged recipe loads, and the real-target recipe trains end to end on a tiny stand-in."""

import json

import pytest

from dflash_train.config import PACKAGED_RECIPES, load_config
from dflash_train.tiny import save_tiny_target
from dflash_train.train.trainer import train
from tests.train_helpers import write_repeat_task

RECIPES = sorted(p.stem for p in PACKAGED_RECIPES.glob("*.yaml"))


@pytest.mark.parametrize("name", RECIPES)
def test_packaged_recipe_loads(name):
    cfg = load_config(name, ["target.path=/models/some-target"])
    assert cfg.drafter.block_size >= 2


def test_smollm2_recipe_trains_and_exports_on_a_tiny_target(tmp_path):
    """The recipe of docs/quality.md with only the target, data and CPU settings replaced: its
    drafter shape comes from the target, its mask token 16 is a real embedding row, and the run
    reaches an export with the block size and mask token of the recipe."""
    target = save_tiny_target(tmp_path / "target", kind="qwen3")
    data = write_repeat_task(tmp_path / "rows.jsonl", rows=24)
    cfg = load_config(
        "smollm2-135m",
        [
            f"target.path={target}",
            f"data.paths=[{data}]",
            f"data.cache_dir={tmp_path / 'cache'}",
            f"output_dir={tmp_path / 'run'}",
            "target.dtype=float32",
            "train.dtype=float32",
            "train.compile=false",
            "train.attention_backend=sdpa",
            "train.device=cpu",
            "train.max_steps=2",
            "logging.progress_bar=off",
        ],
    )
    result = train(cfg)
    exported = json.loads((tmp_path / "run" / "export" / "config.json").read_text())
    assert result["step"] == 2
    assert exported["block_size"] == 16
    assert exported["dflash_config"]["mask_token_id"] == 16
    assert exported["num_hidden_layers"] == 5
