import pytest

from dflash_train.config import PACKAGED_RECIPES, RunConfig, load_config
from dflash_train.models.presets import qwen36_27b_target_config, resolve_drafter_config


@pytest.mark.parametrize("name", ["qwen3.6-27b", "qwen3-8b", "tiny-cpu"])
def test_every_packaged_recipe_loads(name):
    cfg = load_config(name)
    assert isinstance(cfg, RunConfig)
    assert (PACKAGED_RECIPES / f"{name}.yaml").is_file()


def test_qwen36_recipe_is_the_paper_recipe():
    cfg = load_config("qwen3.6-27b")
    assert cfg.train.num_anchors == 512 and cfg.train.gamma == 7.0 and cfg.train.lr == 6e-4
    assert (
        cfg.train.lr_schedule == "cosine"
        and cfg.train.warmup_ratio == 0.04
        and cfg.train.clip_grad_norm == 1.0
    )
    assert cfg.target.target_layer_ids == [1, 16, 31, 46, 61]


def test_overrides_apply_with_yaml_types():
    cfg = load_config(
        "tiny-cpu", ["train.lr=3e-4", "data.paths=[a.jsonl,b.jsonl]", "train.compile=true", "train.gamma=5"]
    )
    assert cfg.train.lr == 3e-4
    assert cfg.data.paths == ["a.jsonl", "b.jsonl"]
    assert cfg.train.compile is True
    assert cfg.train.gamma == 5.0 and isinstance(cfg.train.gamma, float)


def test_unknown_key_names_key_and_suggests_fix():
    with pytest.raises(ValueError, match=r"unknown key 'train.num_anchor'.*did you mean 'train.num_anchors'"):
        load_config("tiny-cpu", ["train.num_anchor=8"])
    with pytest.raises(ValueError, match=r"unknown key 'trainer'"):
        load_config("tiny-cpu", ["trainer.lr=1e-3"])


def test_wrong_type_names_key():
    with pytest.raises(ValueError, match=r"'train.num_anchors' must be int, got str"):
        load_config("tiny-cpu", ["train.num_anchors=many"])
    with pytest.raises(ValueError, match=r"'data.seq_buckets' must be a list"):
        load_config("tiny-cpu", ["data.seq_buckets=128"])
    with pytest.raises(ValueError, match=r"'train.attention_backend' = 'fast' is not allowed"):
        load_config("tiny-cpu", ["train.attention_backend=fast"])
    with pytest.raises(ValueError, match=r"'train.compile' must be bool"):
        load_config("tiny-cpu", ["train.compile=1"])


def test_cross_field_errors_say_how_to_fix():
    with pytest.raises(ValueError, match="keep at least 2"):
        load_config("tiny-cpu", ["checkpoint.keep_last=1"])
    with pytest.raises(
        ValueError, match="pinned_staging=true stages the asynchronous write.*async_write=true"
    ):
        load_config("tiny-cpu", ["checkpoint.pinned_staging=true", "checkpoint.async_write=false"])
    # Once accepted by analogy with eval.every_steps=0: every step's `step % every_steps` then divided
    # by zero, so no checkpoint was ever written.
    for key in ("checkpoint", "logging"):
        with pytest.raises(ValueError, match=rf"{key}.every_steps=0: use a step count >= 1"):
            load_config("tiny-cpu", [f"{key}.every_steps=0"])
    with pytest.raises(ValueError, match="ascending"):
        load_config("tiny-cpu", ["data.seq_buckets=[256,128]"])
    with pytest.raises(ValueError, match="not implemented.*train.placement=split"):
        load_config("tiny-cpu", ["target.fsdp_shard=true"])
    with pytest.raises(ValueError, match="required key 'output_dir'"):
        load_config(base={"target": {"path": "x"}})


def test_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = load_config("qwen3.6-27b", ["train.lr=1e-4", "data.paths=[x.jsonl]"])
    path = tmp_path / "resolved.yaml"
    cfg.to_yaml(path)
    again = load_config(path)
    assert again == cfg


def test_bad_override_syntax():
    with pytest.raises(ValueError, match="key.sub=value"):
        load_config("tiny-cpu", ["train.lr"])


def test_unknown_recipe_lists_packaged_ones():
    with pytest.raises(ValueError, match="packaged recipes"):
        load_config("no-such-recipe")


def test_qwen36_drafter_preset_resolves_to_design_shape():
    cfg = load_config("qwen3.6-27b")
    d = resolve_drafter_config(
        cfg.drafter, qwen36_27b_target_config(), target_layer_ids=cfg.target.target_layer_ids
    )
    assert (d.num_hidden_layers, d.hidden_size, d.intermediate_size) == (5, 5120, 17408)
    assert (d.num_attention_heads, d.num_key_value_heads, d.head_dim) == (32, 8, 128)
    assert d.layer_types == ["sliding_attention"] * 4 + ["full_attention"] and d.sliding_window == 2048
    assert d.mask_token_id == 248070 and d.block_size == 16 and d.rope_theta == 1e7
    assert d.target_layer_ids == [1, 16, 31, 46, 61] and d.vocab_size == 248320 and d.num_target_layers == 64


def test_a_run_by_epochs_trains_every_micro_batch_but_the_last_remainder():
    """The loader's stream crosses epochs, so 3 epochs of 5 micro-batches at 2 a step are 7 steps
    (14 of the 15 trained), not 3 x (5 // 2) = 6 with one micro-batch of every epoch left out."""
    from dflash_train.train.run import total_steps

    cfg = load_config("tiny-cpu", ["train.max_steps=0", "train.num_epochs=3", "train.grad_accum=2"])
    assert total_steps(cfg, 5) == 7
    cfg = load_config("tiny-cpu", ["train.max_steps=0", "train.num_epochs=1", "train.grad_accum=2"])
    with pytest.raises(ValueError, match="fewer than train.grad_accum=2"):
        total_steps(cfg, 1)


@pytest.mark.parametrize("value", ["0", "-1.0"])
def test_clip_grad_norm_must_be_positive(value):
    """clip_grad_norm_ scales every gradient by max_norm / norm: 0 (often "no clipping" elsewhere) zeroed
    them, so the drafter never moved, and a negative value reversed them; both were accepted."""
    with pytest.raises(ValueError, match=rf"train.clip_grad_norm={float(value)}: .*> 0.*\.inf"):
        load_config("tiny-cpu", [f"train.clip_grad_norm={value}"])
    assert load_config("tiny-cpu", ["train.clip_grad_norm=.inf"]).train.clip_grad_norm == float("inf")


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("train.betas=[0.9,1.5]", r"train.betas=\[0.9, 1.5\]: .*\[0, 1\)"),
        ("train.betas=[-0.1,0.95]", r"train.betas=\[-0.1, 0.95\]: .*\[0, 1\)"),
        ("train.weight_decay=-0.1", r"train.weight_decay=-0.1: .*>= 0"),
        ("train.lr=nan", r"train.lr=nan: .*finite"),
        ("train.lr=inf", r"train.lr=inf: .*finite"),
        ("drafter.preset=tiyn", r"drafter.preset='tiyn' is unknown; use one of"),
    ],
)
def test_optimizer_settings_and_the_drafter_preset_are_checked_at_load(override, match):
    """Each was accepted at load and failed only after the target was built (AdamW's own message,
    naming no key; the preset's lookup), or, for a non-finite lr, trained on NaN weights."""
    with pytest.raises(ValueError, match=match):
        load_config("tiny-cpu", [override])


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("data.max_bad_rows=-1", r"data.max_bad_rows=-1: .*>= 0"),
        ("train.target_ranks=2", r"train.target_ranks=2 .*train.placement=colocated"),
        (
            "checkpoint.resume=/no/such/checkpoint",
            r"checkpoint.resume=/no/such/checkpoint: no such directory",
        ),
    ],
)
def test_settings_found_wrong_only_later_are_refused_at_load(override, match):
    """A negative bad-row allowance ("unlimited") failed at the first bad row; target ranks beside
    colocated placement were silently unused; a resume path that does not exist was found only after
    the target was built and the data tokenized."""
    with pytest.raises(ValueError, match=match):
        load_config("tiny-cpu", [override])


@pytest.mark.parametrize(
    "key", ["num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "head_dim"]
)
def test_negative_drafter_sizes_are_refused(key):
    """0 means the preset's / the target's size; a negative one (-1 read as "auto") was accepted and
    failed at the drafter's build with a torch traceback ("negative dimension")."""
    with pytest.raises(ValueError, match=rf"drafter.{key}=-1: .*0 for the preset's"):
        load_config("tiny-cpu", [f"drafter.{key}=-1"])


def test_num_target_features_that_the_layer_ids_overrule_is_refused():
    """target.num_target_features only counts the default layers: beside a recipe's target_layer_ids
    (tiny-cpu has 4) a different count was silently ignored, and 0 or less gave one feature."""
    with pytest.raises(
        ValueError, match=r"target.num_target_features=3 but target.target_layer_ids=\[0, 1, 2, 3\]"
    ):
        load_config("tiny-cpu", ["target.num_target_features=3"])
    for value in ("0", "-2"):
        with pytest.raises(ValueError, match=rf"target.num_target_features={value}: .*>= 1"):
            load_config("tiny-cpu", ["target.target_layer_ids=[]", f"target.num_target_features={value}"])
    assert load_config("tiny-cpu", ["target.num_target_features=4"]).target.num_target_features == 4
    cfg = load_config("tiny-cpu", ["target.target_layer_ids=[]", "target.num_target_features=3"])
    assert cfg.target.num_target_features == 3


def test_negative_seed_is_refused():
    """seed=-1 ("random", as in llama.cpp) was accepted, and the run failed after building the target
    and the drafter with "expected non-negative integer", naming no key."""
    with pytest.raises(ValueError, match=r"train.seed=-1: .*>= 0"):
        load_config("tiny-cpu", ["train.seed=-1"])


@pytest.mark.parametrize("value", ["0", "-5"])
def test_dist_timeout_must_be_positive(value):
    """0 (read as "no timeout", as watchdog_s=0 is "off") was accepted; under torchrun every rank then
    failed at once joining the group ("client socket has timed out after 0ms")."""
    with pytest.raises(ValueError, match=rf"train.dist_timeout_s={float(value)}: .*> 0"):
        load_config("tiny-cpu", [f"train.dist_timeout_s={value}"])
