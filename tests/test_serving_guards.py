"""Guards that keep a trained drafter servable as it was trained: feature layer ids, the last
layer, in-block causality, the serving flags written next to an export, and ``drafter.init_from``."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_train.cli import main as cli_main
from dflash_train.config import DrafterConfig, load_config
from dflash_train.models import presets
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.models.drafter_config import DFlashDraftConfig
from dflash_train.models.export import save_drafter
from dflash_train.models.serving import serving_notes
from dflash_train.train.trainer import TrainHooks, train
from tests.train_helpers import tiny_config

# ----------------------------------------------------------------------------- feature layer ids


def test_documented_defaults_stay():
    assert presets.default_target_layer_ids(64) == [1, 16, 31, 46, 61]
    assert presets.default_target_layer_ids(36) == [1, 9, 17, 25, 33]


@pytest.mark.parametrize("num_layers", range(2, 13))
@pytest.mark.parametrize("num_features", [1, 2, 3, 5])
def test_defaults_are_distinct_ascending_and_avoid_the_last_layer(num_layers, num_features):
    ids = presets.default_target_layer_ids(num_layers, num_features)
    assert ids == sorted(set(ids)) and len(ids) == min(num_features, num_layers - 1)
    presets.check_serving_layer_ids(ids, num_layers)  # the default always passes the guard


def test_tiny_targets_no_longer_repeat_a_layer():
    assert presets.default_target_layer_ids(4) == [0, 1, 2]  # was [1, 1, 1, 1, 1]
    assert presets.default_target_layer_ids(3, 2) == [0, 1]  # was [1, 0]


@pytest.mark.parametrize(
    "ids,message",
    [
        ([1, 1, 2], "strictly increasing and distinct.*repeated id crashes"),
        ([2, 1], "strictly increasing.*silently permutes.*use \\[1, 2\\]"),
        ([0, 4], "within \\[0, 3\\]"),
        ([], "within"),
        ([1, 3], "last layer 3.*before or after the final norm.*target.allow_last_layer=true"),
    ],
)
def test_serving_layer_id_guard(ids, message):
    with pytest.raises(ValueError, match=message):
        presets.check_serving_layer_ids(ids, 4)


def test_last_layer_is_allowed_when_asked():
    assert presets.check_serving_layer_ids([1, 3], 4, allow_last_layer=True) == [1, 3]


def base(*overrides):
    return load_config(None, ["output_dir=x", "target.path=preset:qwen3.6-27b", *overrides])


def test_config_checks_ids_where_the_depth_is_known():
    with pytest.raises(ValueError, match="strictly increasing"):
        load_config(None, ["output_dir=x", "target.path=/some/checkpoint", "target.target_layer_ids=[3,3]"])
    with pytest.raises(ValueError, match="last layer 63"):
        base("target.target_layer_ids=[1,16,31,46,63]")
    with pytest.raises(ValueError, match="within \\[0, 63\\]"):
        base("target.target_layer_ids=[1,64]")
    assert base("target.target_layer_ids=[1,63]", "target.allow_last_layer=true").target.allow_last_layer


def test_drafter_config_refuses_unsorted_ids():
    with pytest.raises(ValueError, match="strictly increasing"):
        DFlashDraftConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=320,
            num_target_layers=4,
            target_layer_ids=[2, 0],
            mask_token_id=3,
        )


@pytest.fixture
def task(train_task):
    return train_task


def test_training_refuses_the_last_layer_at_target_load(task, tmp_path):
    cfg = tiny_config(
        task, tmp_path / "run", "target.target_layer_ids=[0,3]", "target.allow_last_layer=false"
    )
    with pytest.raises(ValueError, match="last layer 3"):
        train(cfg)


def test_is_causal_false_with_sliding_layers_warns_about_sglang():
    with pytest.warns(UserWarning, match="SGLang ignores is_causal"):
        presets.resolve_drafter_config(
            DrafterConfig(preset="tiny", is_causal=False),
            presets.tiny_hybrid_target_config(),
            mask_token_id=3,
        )


# ----------------------------------------------------------------------------- SERVING.md


def tiny_drafter_config(variant: str = "dflash", **changes) -> DFlashDraftConfig:
    """The tiny drafter of these tests (block 4, sliding + full layers, fp32), with ``changes`` set."""
    config = presets.resolve_drafter_config(
        DrafterConfig(preset="tiny", block_size=4, variant=variant),
        presets.tiny_hybrid_target_config(),
        target_layer_ids=[0, 2],
        mask_token_id=300,
        torch_dtype="float32",
    )
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def test_export_writes_the_exact_serving_flags(tmp_path):
    config = tiny_drafter_config()  # block 4, sliding + full layers
    out = save_drafter(DFlashDrafter(config), config, tmp_path / "export", target="org/target")
    notes = (out / "SERVING.md").read_text()
    assert "--speculative-algorithm DFLASH" in notes and "--speculative-num-draft-tokens 4" in notes
    assert f"--speculative-draft-model-path {out.resolve()}" in notes
    assert '"method": "dflash"' in notes and '"num_speculative_tokens": 3' in notes
    assert "VLLM_USE_V2_MODEL_RUNNER=1 vllm serve org/target" in notes  # mixed layer types
    # llama.cpp: the full block (p-min 0), alone and after its ngram-simple lookup, whose defaults
    # are the eval's (key 3, at most 48 tokens, llama.cpp's limit); without the eval's numbers, how to get them.
    assert "--spec-type draft-dflash --spec-draft-n-max 3 --spec-draft-p-min 0 --jinja" in notes
    combined = (
        "--spec-type ngram-simple,draft-dflash --spec-draft-n-max 3 --spec-draft-p-min 0 "
        "--spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 48 --jinja"
    )
    assert combined in notes and "Measure it on yours" in notes and "--baseline ngram" in notes


@pytest.mark.parametrize(
    ("combined_tau", "pick"), [(3.1, "Serve the combination: 1.24x"), (2.4, "drafter alone")]
)
def test_serving_md_states_the_evals_numbers_and_picks(tmp_path, combined_tau, pick):
    """``eval.json`` of ``dflash-train eval --baseline ngram`` in the export: SERVING.md serves the
    lookup the eval simulated and recommends the combination only where it raised tau."""
    config = tiny_drafter_config()
    out = tmp_path / "export"
    out.mkdir()
    record = {"tau": 2.5, "ngram_tau": 2.0, "ngram_dflash_tau": combined_tau, "num_prompts": 300}
    (out / "eval.json").write_text(json.dumps({**record, "ngram_min_match": 4, "ngram_max_draft": 7}))
    notes = (save_drafter(DFlashDrafter(config), config, out) / "SERVING.md").read_text()
    assert "--spec-ngram-simple-size-n 4 --spec-ngram-simple-size-m 7" in notes
    assert f"tau 2.500 with the drafter alone, {combined_tau:.3f} with ngram-simple first" in notes
    assert "2.000 with the eval's n-gram lookup alone" in notes and "300 prompts" in notes
    assert pick in notes and "Measure it on yours" not in notes
    (out / "eval.json").write_text(json.dumps({**record, "ngram_dflash_tau": None}))  # no --baseline ngram
    notes = (save_drafter(DFlashDrafter(config), config, out) / "SERVING.md").read_text()
    assert "Measure it on yours" in notes and "--spec-ngram-simple-size-n 3" in notes


def test_serving_md_does_not_state_numbers_measured_with_blocks_cut_short(tmp_path):
    """An eval with ``--draft-p-min P > 0`` (DSpark's confidence stop) measured blocks cut short; the
    flags SERVING.md writes draft full blocks (``--spec-draft-p-min 0``), so its numbers and its pick
    are not of those flags: SERVING.md says how to measure instead."""
    config = tiny_drafter_config("dspark")
    out = tmp_path / "export"
    out.mkdir()
    record = {"tau": 2.5, "ngram_tau": 2.0, "ngram_dflash_tau": 3.1, "num_prompts": 300, "draft_p_min": 0.4}
    (out / "eval.json").write_text(json.dumps({**record, "ngram_min_match": 4, "ngram_max_draft": 7}))
    notes = (save_drafter(DFlashDrafter(config), config, out) / "SERVING.md").read_text()
    assert "--spec-type draft-dspark --spec-draft-n-max 4 --spec-draft-p-min 0 " in notes
    assert "tau 2.500" not in notes and "Measure it on yours" in notes


@pytest.mark.parametrize(
    ("swept_taus", "served", "pick"),
    [((2.6, 3.0, 2.9), 6, "Serve the combination: 1.20x"), ((2.4, 2.4, 2.3), 3, "drafter alone")],
)
def test_serving_md_serves_the_best_key_size_of_a_sweep(tmp_path, swept_taus, served, pick):
    """An eval that swept the key size (``--ngram-min-match 3,6,8``): SERVING.md serves the key size
    with the highest tau (the first on a tie), states that tau and lists every key size's; a sweep
    it cannot read leaves the advice to measure."""
    config = tiny_drafter_config()
    out = tmp_path / "export"
    out.mkdir()
    names = {"ngram+dflash": 3, "ngram+dflash@6": 6, "ngram+dflash@8": 8}
    record = {
        "tau": 2.5, "ngram_tau": 2.0, "ngram_dflash_tau": swept_taus[0], "num_prompts": 300,
        "ngram_min_match": 3, "ngram_max_draft": 7, "ngram_dflash_key_sizes": names,
        "methods": {name: {"tau": tau} for name, tau in zip(names, swept_taus, strict=True)},
    }  # fmt: skip
    (out / "eval.json").write_text(json.dumps(record))
    notes = (save_drafter(DFlashDrafter(config), config, out) / "SERVING.md").read_text()
    assert f"--spec-ngram-simple-size-n {served} --spec-ngram-simple-size-m 7" in notes
    best = max(swept_taus)
    assert f"{best:.3f} with ngram-simple first (key size {served}, the flags above" in notes
    listed = ", ".join(f"{k}: {t:.3f}" for k, t in zip((3, 6, 8), swept_taus, strict=True))
    assert listed in notes and pick in notes
    del record["methods"]["ngram+dflash@8"]
    (out / "eval.json").write_text(json.dumps(record))
    notes = (save_drafter(DFlashDrafter(config), config, out) / "SERVING.md").read_text()
    assert "Measure it on yours" in notes and "--spec-ngram-simple-size-n 3" in notes


def test_all_full_layers_need_no_v2_runner_and_warnings_are_written(tmp_path):
    full = tiny_drafter_config(layer_types=["full_attention"] * 2)
    notes = (save_drafter(DFlashDrafter(full), full, tmp_path / "a") / "SERVING.md").read_text()
    assert "VLLM_USE_V2_MODEL_RUNNER" not in notes and "Notes:" not in notes
    odd = tiny_drafter_config(is_causal=False, target_layer_ids=[0, 3])
    notes = (save_drafter(DFlashDrafter(odd), odd, tmp_path / "b") / "SERVING.md").read_text()
    assert "SGLang ignores it" in notes and "last layer 3" in notes


@pytest.mark.parametrize(
    ("variant", "layers"), [("dflash", "sliding_attention"), ("dflash2", "full_attention")]
)
def test_a_drafter_llama_cpp_cannot_run_as_trained_is_named_in_serving_md(tmp_path, variant, layers):
    """llama.cpp has one in-block causality for every layer (from ``is_causal``): a drafter mixing
    sliding (causal) and full (bidirectional) layers cannot serve there as trained."""
    config = tiny_drafter_config(variant)
    notes = serving_notes(config, tmp_path)
    assert f"its {layers} layers would not run as trained" in notes
    # The tiny DFlash2 drafter (hidden 64) is too narrow for llama.cpp's selector lattice at top-k 16.
    assert ("selector lattice needs hidden_size >= selector_top_k x (selector_top_k + 1) = 272" in notes) == (
        variant == "dflash2"
    )
    assert "llama.cpp runs every layer" not in serving_notes(tiny_drafter_config(is_causal=False), tmp_path)


def test_export_command_prints_the_flags(tmp_path, capsys):
    config = tiny_drafter_config()
    step = tmp_path / "step-5"
    step.mkdir()
    (step / "drafter_config.json").write_text(json.dumps(config.to_serving_dict()))
    torch.manual_seed(0)
    save_file(
        {k: v.contiguous() for k, v in DFlashDrafter(config).state_dict().items()},
        str(step / "drafter.safetensors"),
    )
    (step / "config.yaml").write_text("target:\n  path: org/my-target\n")
    (step / "COMMITTED").write_text("")
    assert cli_main(["export", str(step), str(tmp_path / "out"), "--json"]) == 0
    printed = capsys.readouterr().out
    assert "--speculative-num-draft-tokens 4" in printed and "--model-path org/my-target" in printed
    result = json.loads(printed.strip().splitlines()[-1])
    assert result["serving"] == str(tmp_path / "out" / "SERVING.md")


def test_training_writes_serving_md_next_to_its_export(task, tmp_path):
    result = train(tiny_config(task, tmp_path / "run", "train.max_steps=1"))
    notes = (tmp_path / "run" / "export" / "SERVING.md").read_text()
    assert result["export"] and f"--model-path {task['target']}" in notes
    assert "--speculative-num-draft-tokens 8" in notes  # the tiny-cpu recipe's block size


def write_recipe_checkpoint(step, config, target: str) -> None:
    """A committed training checkpoint whose saved recipe names ``target`` as ``target.path``."""
    step.mkdir(parents=True)
    (step / "drafter_config.json").write_text(json.dumps(config.to_serving_dict()))
    torch.manual_seed(0)
    save_file(
        {k: v.contiguous() for k, v in DFlashDrafter(config).state_dict().items()},
        str(step / "drafter.safetensors"),
    )
    (step / "config.yaml").write_text(f"target:\n  path: {target}\n")
    (step / "COMMITTED").write_text("")


@pytest.mark.parametrize("writer", ["export", "save_drafter", "eval"])
@pytest.mark.parametrize("local", [True, False])
def test_serving_md_names_a_local_target_by_its_absolute_path(tmp_path, monkeypatch, writer, local):
    """``target.path=../models/smol`` (relative to where training ran) was copied into SERVING.md,
    which is read from elsewhere, often on another machine: an existing local directory is named by
    its absolute path, by every writer of SERVING.md (``dflash-train export`` from the checkpoint's
    recipe, the end of training, ``eval --output-dir EXPORT``). A hub id stays as written."""
    from dflash_train.models.export import export_checkpoint
    from dflash_train.models.serving import write_serving_notes

    (tmp_path / "models" / "smol").mkdir(parents=True)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    target = "../models/smol" if local else "Qwen/Qwen3-8B"
    expected = str((tmp_path / "models" / "smol").resolve()) if local else target
    config, out = tiny_drafter_config(), tmp_path / "export"
    if writer == "export":
        write_recipe_checkpoint(tmp_path / "step-5", config, target)
        export_checkpoint(tmp_path / "step-5", out, dtype="float32")
    elif writer == "save_drafter":
        save_drafter(DFlashDrafter(config), config, out, target=target)
    else:
        save_drafter(DFlashDrafter(config), config, out)
        write_serving_notes(config, out, target)
    notes = (out / "SERVING.md").read_text()
    for flag in ("--model-path", "vllm serve", "--target-model-dir", "dflash-train eval --target"):
        assert f"{flag} {expected} " in notes, flag
    if local:
        assert "../models/smol" not in notes


# ----------------------------------------------------------------------------- drafter.init_from


@pytest.fixture(scope="module")
def exported(train_task, tmp_path_factory):
    out = tmp_path_factory.mktemp("init") / "run"
    train(tiny_config(train_task, out, "train.max_steps=1"))
    return out / "export"


@pytest.mark.parametrize(
    "change,key",
    [
        ("drafter.block_size=4", "block_size"),
        ("drafter.mask_token_id=5", "dflash_config.mask_token_id"),
        ("target.target_layer_ids=[1,2]", "dflash_config.target_layer_ids"),
        ("drafter.layer_types=[full_attention,full_attention]", "layer_types"),
    ],
)
def test_init_from_refuses_an_export_of_another_drafter(task, tmp_path, exported, change, key):
    cfg = tiny_config(task, tmp_path / "run", "train.max_steps=1", f"drafter.init_from={exported}", change)
    with pytest.raises(ValueError, match=rf"drafter.init_from=.*differs.*{key}: export"):
        train(cfg)


def test_init_from_a_matching_export_starts_from_its_weights(task, tmp_path, exported):
    seen = {}

    def before_the_first_update(run):
        seen.update({n: p.detach().clone() for n, p in run.model.named_parameters()})

    cfg = tiny_config(task, tmp_path / "run", "train.max_steps=1", f"drafter.init_from={exported}")
    train(cfg, TrainHooks(after_backward=before_the_first_update))
    weights = load_file(str(exported / "model.safetensors"))
    assert set(seen) == set(weights)
    assert all(torch.equal(seen[name], weights[name].float()) for name in weights)


def test_an_eval_record_of_other_weights_is_set_aside_when_an_export_replaces_them(tmp_path, capsys):
    """``eval --output-dir EXPORT`` measured the weights there; exporting other weights into the same
    folder (a newer checkpoint) kept that eval.json, and SERVING.md stated its numbers for the new
    drafter. The same weights again keep it; other weights set it aside as eval.json.old."""
    config = tiny_drafter_config()
    torch.manual_seed(0)
    drafter, out = DFlashDrafter(config), tmp_path / "export"
    save_drafter(drafter, config, out)
    record = {"tau": 2.5, "ngram_tau": 2.0, "ngram_dflash_tau": 3.1, "num_prompts": 300}
    (out / "eval.json").write_text(json.dumps({**record, "ngram_min_match": 3, "ngram_max_draft": 3}))
    assert "tau 2.500" in (save_drafter(drafter, config, out) / "SERVING.md").read_text()  # the same weights
    with torch.no_grad():
        next(drafter.parameters()).add_(1.0)
    notes = (save_drafter(drafter, config, out) / "SERVING.md").read_text()
    assert "tau 2.500" not in notes and "Measure it on yours" in notes
    assert not (out / "eval.json").exists() and json.loads((out / "eval.json.old").read_text())["tau"] == 2.5
    assert "eval.json.old" in capsys.readouterr().err


def test_serving_commands_quote_paths_a_shell_would_split(tmp_path):
    """An export folder with a space (and a target path with a quote) was pasted into SERVING.md's
    commands unquoted: each command split the path into several arguments."""
    import shlex

    from dflash_train.models.serving import serving_flags

    config = tiny_drafter_config()
    export, target = tmp_path / "my export", "/models/Bob's target"
    flags = serving_flags(config, export, target)
    resolved = str(export.resolve())
    sglang = shlex.split(flags["sglang"])
    assert sglang[sglang.index("--model-path") + 1] == target
    assert sglang[sglang.index("--speculative-draft-model-path") + 1] == resolved
    vllm = shlex.split(flags["vllm"])
    assert vllm[vllm.index("serve") + 1] == target
    assert json.loads(vllm[vllm.index("--speculative-config") + 1])["model"] == resolved
    convert = shlex.split(flags["llama_cpp"].split(" && ")[0])
    assert convert[2] == resolved and convert[convert.index("--target-model-dir") + 1] == target
    assert "'<target>'" not in serving_flags(config, export)["vllm"]  # the placeholder stays as it reads
