"""Serving layout: export -> load -> same outputs, exact tensor names and config keys, the
qwen3.6-27b preset's config as SGLang/vLLM read it, and checkpoint resolution for ``dflash-train export``.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_train.cli import main as cli_main
from dflash_train.config import DrafterConfig
from dflash_train.models import presets
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.models.export import export_checkpoint, load_drafter, save_drafter

LAYER_TENSORS = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]

SERVING_KEYS = {
    "architectures",
    "model_type",
    "block_size",
    "dflash_config",
    "num_target_layers",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "attention_bias",
    "attention_dropout",
    "layer_types",
    "use_sliding_window",
    "sliding_window",
    "tie_word_embeddings",
    "vocab_size",
    "torch_dtype",
    "dtype",
}


def tiny_config():
    return presets.resolve_drafter_config(
        DrafterConfig(preset="tiny", block_size=4),
        presets.tiny_hybrid_target_config(),
        target_layer_ids=[0, 2],
        mask_token_id=300,
        torch_dtype="float32",
    )


def tiny_inputs():
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(1, 24, 128, generator=gen)
    ids = torch.randint(0, 300, (1, 24), generator=gen)
    anchors = torch.tensor([[1, 7, 15, 22]])
    embed = torch.nn.Embedding(320, 64)
    return features, ids, anchors, torch.ones_like(anchors, dtype=torch.bool), embed


def expected_names(num_layers: int) -> set[str]:
    layers = {f"layers.{i}.{name}" for i in range(num_layers) for name in LAYER_TENSORS}
    return layers | {"fc.weight", "hidden_norm.weight", "norm.weight"}


def saved_tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def test_float32_export_roundtrip_gives_identical_outputs(tmp_path):
    config = tiny_config()
    torch.manual_seed(0)
    drafter = DFlashDrafter(config)
    save_drafter(drafter, config, tmp_path, dtype="float32")
    loaded, loaded_config = load_drafter(tmp_path)
    assert loaded_config == config
    inputs = tiny_inputs()
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.forward_train(*inputs), drafter.forward_train(*inputs), atol=0, rtol=0
        )
    assert all(p.requires_grad for p in loaded.parameters())  # loadable as a training init


def test_bf16_export_has_exact_names_and_keys_and_loads_in_bf16(tmp_path):
    config = tiny_config()
    save_drafter(DFlashDrafter(config), config, tmp_path)  # default dtype bfloat16
    tensors = saved_tensors(tmp_path)
    assert set(tensors) == expected_names(2)
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors.values())
    assert tensors["fc.weight"].shape == (64, 2 * 64)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert set(raw) == SERVING_KEYS  # no is_causal key at the default
    assert raw["torch_dtype"] == raw["dtype"] == "bfloat16"
    assert raw["dflash_config"] == {"mask_token_id": 300, "target_layer_ids": [0, 2], "block_size": 4}
    assert raw["layer_types"] == ["sliding_attention", "full_attention"]
    loaded, _ = load_drafter(tmp_path)
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    with torch.no_grad():
        assert torch.isfinite(loaded.forward_train(*tiny_inputs())).all()
    upcast, _ = load_drafter(tmp_path, dtype="float32")
    assert upcast.fc.weight.dtype == torch.float32


def test_non_default_causality_is_written(tmp_path):
    config = tiny_config()
    config.is_causal = False
    save_drafter(DFlashDrafter(config), config, tmp_path, dtype="float32")
    assert json.loads((tmp_path / "config.json").read_text())["is_causal"] is False
    assert load_drafter(tmp_path)[1].is_causal is False


def test_qwen36_27b_preset_serving_layout():
    config = presets.resolve_drafter_config(
        DrafterConfig(preset="qwen3.6-27b"), presets.qwen36_27b_target_config()
    )
    raw = config.to_serving_dict()
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["dflash_config"] == {
        "mask_token_id": 248070,
        "target_layer_ids": [1, 16, 31, 46, 61],
        "block_size": 16,
    }
    assert raw["block_size"] == 16 and raw["num_target_layers"] == 64
    assert raw["layer_types"] == ["sliding_attention"] * 4 + ["full_attention"]
    assert raw["sliding_window"] == 2048 and raw["use_sliding_window"] is True
    assert "is_causal" not in raw
    assert (raw["hidden_size"], raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]) == (
        5120,
        32,
        8,
        128,
    )
    with torch.device("meta"):  # 1.7B parameters: shapes only, instantly
        drafter = DFlashDrafter(config)
    shapes = {name: tuple(t.shape) for name, t in drafter.state_dict().items()}
    assert set(shapes) == expected_names(5)
    assert not any("embed" in name or "lm_head" in name for name in shapes)
    assert shapes["fc.weight"] == (5120, 5 * 5120)
    assert shapes["layers.0.self_attn.q_proj.weight"] == (32 * 128, 5120)
    assert shapes["layers.4.self_attn.k_proj.weight"] == (8 * 128, 5120)
    assert shapes["layers.0.self_attn.q_norm.weight"] == (128,)


def test_load_reports_missing_and_unexpected_tensors(tmp_path):
    config = tiny_config()
    save_drafter(DFlashDrafter(config), config, tmp_path, dtype="float32")
    tensors = saved_tensors(tmp_path)
    tensors.pop("norm.weight")
    tensors["lm_head.weight"] = torch.zeros(320, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"missing tensors \['norm.weight'\].*unexpected tensors \['lm_head.weight'\]"
    ):
        load_drafter(tmp_path)
    with pytest.raises(ValueError, match="no config.json"):
        load_drafter(tmp_path / "nowhere")


def write_checkpoint(path, config, seed: int, committed: bool = True) -> DFlashDrafter:
    """A training checkpoint as the trainer writes it: drafter_config.json + fp32 drafter.safetensors."""
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config)
    path.mkdir(parents=True)
    (path / "drafter_config.json").write_text(json.dumps(config.to_serving_dict()))
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, str(path / "drafter.safetensors"))
    if committed:
        (path / "COMMITTED").write_text("")
    return drafter


def test_export_checkpoint_picks_newest_committed_step(tmp_path):
    config = tiny_config()
    run = tmp_path / "run"
    write_checkpoint(run / "checkpoints" / "step-9", config, seed=1)
    newest = write_checkpoint(run / "checkpoints" / "step-10", config, seed=2)
    write_checkpoint(run / "checkpoints" / "step-11", config, seed=3, committed=False)  # torn save
    result = export_checkpoint(run, tmp_path / "out", dtype="float32")
    assert (
        result["export"] == str(tmp_path / "out") and result["tensors"] == 25 and result["dtype"] == "float32"
    )
    assert result["checkpoint"].endswith("step-10")
    loaded, _ = load_drafter(tmp_path / "out")
    torch.testing.assert_close(loaded.fc.weight, newest.fc.weight, atol=0, rtol=0)


def test_export_checkpoint_dir_and_cli(tmp_path, capsys):
    config = tiny_config()
    step = tmp_path / "step-5"
    drafter = write_checkpoint(step, config, seed=4)
    assert cli_main(["export", str(step), str(tmp_path / "out"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["dtype"] == "bfloat16" and result["tensors"] == 25
    loaded, _ = load_drafter(tmp_path / "out")
    torch.testing.assert_close(loaded.norm.weight, drafter.norm.weight.to(torch.bfloat16))


def test_export_from_another_folder_names_the_target_the_run_was_launched_with(tmp_path, monkeypatch):
    """A recipe's relative ``target.path`` means the folder the run was launched from (run_info.json's
    ``launch_dir``), not the one ``dflash-train export`` runs in."""
    (tmp_path / "project" / "models" / "smol").mkdir(parents=True)
    run = tmp_path / "project" / "runs" / "r"
    step = run / "checkpoints" / "step-5"
    write_checkpoint(step, tiny_config(), seed=4)
    (step / "config.yaml").write_text("target:\n  path: models/smol\n")
    (run / "run_info.json").write_text(json.dumps({"launch_dir": str(tmp_path / "project")}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    export_checkpoint(run, tmp_path / "out", dtype="float32")
    notes = (tmp_path / "out" / "SERVING.md").read_text()
    assert (
        f"--model-path {tmp_path / 'project' / 'models' / 'smol'} " in notes and " models/smol" not in notes
    )


def test_export_refuses_uncommitted_checkpoint(tmp_path):
    write_checkpoint(tmp_path / "step-3", tiny_config(), seed=0, committed=False)
    with pytest.raises(ValueError, match="COMMITTED"):
        export_checkpoint(tmp_path / "step-3", tmp_path / "out")
    with pytest.raises(ValueError, match="neither a committed checkpoint"):
        export_checkpoint(tmp_path, tmp_path / "out")


def randomized(drafter: DFlashDrafter, seed: int = 0) -> DFlashDrafter:
    """Every parameter random, norms included: all-ones norms would hide two norm tensors swapped."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in drafter.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5 + 1.0)
    return drafter


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_roundtrip_with_random_norms_keeps_every_tensor(tmp_path, dtype):
    config = tiny_config()
    drafter = randomized(DFlashDrafter(config))
    save_drafter(drafter, config, tmp_path, dtype=dtype)
    loaded, _ = load_drafter(tmp_path, dtype="float32")
    original = {k: v.to(getattr(torch, dtype)).float() for k, v in drafter.state_dict().items()}
    reloaded = loaded.state_dict()
    assert set(reloaded) == set(original) == expected_names(2)
    for name, tensor in original.items():
        torch.testing.assert_close(reloaded[name], tensor, atol=0, rtol=0, msg=name)
    assert not torch.equal(
        original["layers.0.input_layernorm.weight"], original["layers.0.post_attention_layernorm.weight"]
    )
    if dtype == "float32":
        inputs = tiny_inputs()
        with torch.no_grad():
            torch.testing.assert_close(
                loaded.forward_train(*inputs), drafter.forward_train(*inputs), atol=0, rtol=0
            )


def test_a_failed_export_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    """Re-exporting into an export directory (``dflash-train export RUN DIR`` as a run goes on) on a disk
    that fills up while writing config.json: the previous export stays whole (its config next to its
    weights and its SERVING.md), and no temporary file is left behind."""
    import pathlib

    old_config = tiny_config()
    old = randomized(DFlashDrafter(old_config), seed=1)
    save_drafter(old, old_config, tmp_path, dtype="float32")
    before = {
        name: (tmp_path / name).read_bytes() for name in ("config.json", "model.safetensors", "SERVING.md")
    }
    new_config = tiny_config()
    new_config.block_size = 8
    write_text = pathlib.Path.write_text

    def disk_full_on_config(path, *args, **kwargs):
        if "config.json" in path.name:
            raise OSError(28, "No space left on device")
        return write_text(path, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", disk_full_on_config)
    with pytest.raises(OSError, match="No space left"):
        save_drafter(randomized(DFlashDrafter(new_config), seed=2), new_config, tmp_path, dtype="float32")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before)
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    loaded, loaded_config = load_drafter(tmp_path)
    assert loaded_config.block_size == 4
    torch.testing.assert_close(loaded.fc.weight, old.fc.weight, atol=0, rtol=0)


def test_a_broken_config_is_refused_naming_its_file(tmp_path):
    """A config.json cut short or missing a key (hand-edited, another tool's) is a ValueError naming
    the file and what is wrong, not a JSON or TypeError traceback without the file."""
    config = tiny_config()
    save_drafter(DFlashDrafter(config), config, tmp_path / "out", dtype="float32")
    path = tmp_path / "out" / "config.json"
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in raw.items() if k != "num_target_layers"}))
    with pytest.raises(ValueError, match=rf"{path}.*num_target_layers"):
        load_drafter(tmp_path / "out")
    path.write_text(json.dumps(raw)[:40])
    with pytest.raises(ValueError, match=rf"{path}.*not valid JSON"):
        load_drafter(tmp_path / "out")
    step = tmp_path / "step-3"
    write_checkpoint(step, config, seed=0)
    (step / "drafter_config.json").write_text("")
    with pytest.raises(ValueError, match=rf"{step / 'drafter_config.json'}.*not valid JSON"):
        export_checkpoint(step, tmp_path / "exported")
