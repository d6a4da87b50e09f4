"""Our exports as SGLang and vLLM load them: each engine's weight-name and config rules applied to the
exported tensors, for the tiny preset (a real export on disk) and the qwen3.6-27b preset (built on the
meta device). Every engine parameter must get all of its shards and no exported tensor may be left over.

The rules, as read in the engines' DFlash loaders (SGLang ``python/sglang/srt/models/dflash.py``,
``DFlashDraftModel.load_weights``; vLLM ``vllm/model_executor/models/qwen3_dflash.py``,
``DFlashQwen3ForCausalLM.load_weights`` and ``DFlashQwen3Model.hf_to_vllm_mapper``):
- both fuse ``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj`` (shards q, k, v) and
  ``gate_proj``/``up_proj`` into ``gate_up_proj`` (shards 0, 1); the other tensors load by name;
- SGLang matches ``.{q,k,v,gate,up}_proj.`` inside the name, resolves a name with or without a
  ``model.`` prefix, and silently ignores a tensor that matches no parameter (so a misnamed tensor
  leaves a parameter at its initial value);
- vLLM prefixes every tensor name (but ``lm_head``) with ``model.`` and refuses names that match no
  parameter, so an export that already carries ``model.`` does not load; a shipped ``embed_tokens``
  or ``lm_head`` would replace the target's;
- ``fc`` takes ``len(dflash_config.target_layer_ids)`` features of ``hidden_size``.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dflash_train.config import DrafterConfig
from dflash_train.models import presets
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.models.export import save_drafter, serving_state

STACKED = [  # (engine parameter, exported name part, shard)
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
]


def check_engine_config(raw: dict) -> None:
    """The config.json fields both engines read, with the values they accept."""
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["hidden_act"] == "silu"
    assert raw["attention_bias"] is False  # else both expect bias shards we do not write
    dflash = raw["dflash_config"]
    assert {"mask_token_id", "target_layer_ids", "block_size"} <= set(dflash)
    ids = dflash["target_layer_ids"]
    assert ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] < raw["num_target_layers"]
    assert len(raw["layer_types"]) == raw["num_hidden_layers"]
    assert set(raw["layer_types"]) <= {"full_attention", "sliding_attention"}
    if "sliding_attention" in raw["layer_types"]:
        assert raw["sliding_window"] and raw["use_sliding_window"] is True


def engine_parameters(raw: dict) -> dict[str, dict]:
    """Engine parameter name (SGLang spelling) -> {shard: shape} that must be filled, from config.json."""
    hidden, inter, dim = raw["hidden_size"], raw["intermediate_size"], raw["head_dim"]
    q_rows, kv_rows = raw["num_attention_heads"] * dim, raw["num_key_value_heads"] * dim
    params = {
        "fc.weight": {None: (hidden, len(raw["dflash_config"]["target_layer_ids"]) * hidden)},
        "hidden_norm.weight": {None: (hidden,)},
        "norm.weight": {None: (hidden,)},
    }
    for i in range(raw["num_hidden_layers"]):
        p = f"layers.{i}."
        params |= {
            p + "self_attn.qkv_proj.weight": {
                "q": (q_rows, hidden),
                "k": (kv_rows, hidden),
                "v": (kv_rows, hidden),
            },
            p + "self_attn.o_proj.weight": {None: (hidden, q_rows)},
            p + "self_attn.q_norm.weight": {None: (dim,)},
            p + "self_attn.k_norm.weight": {None: (dim,)},
            p + "input_layernorm.weight": {None: (hidden,)},
            p + "post_attention_layernorm.weight": {None: (hidden,)},
            p + "mlp.gate_up_proj.weight": {0: (inter, hidden), 1: (inter, hidden)},
            p + "mlp.down_proj.weight": {None: (hidden, inter)},
        }
    return params


def load_like_sglang(raw: dict, shapes: dict[str, tuple]) -> tuple[dict, list[str]]:
    """(filled {param: {shard: shape}}, tensors SGLang ignores) under SGLang's rules."""
    params = engine_parameters(raw)

    def resolve(name):
        if name in params:
            return name
        other = name.removeprefix("model.") if name.startswith("model.") else f"model.{name}"
        return other if other in params else None

    filled, ignored = {}, []
    for name, shape in shapes.items():
        for param, part, shard in STACKED:
            if f".{part}." in name and (target := resolve(name.replace(part, param))) is not None:
                filled.setdefault(target, {})[shard] = shape
                break
        else:
            target = resolve(name)
            if target is None:
                ignored.append(name)  # SGLang skips it without a word
            else:
                filled.setdefault(target, {})[None] = shape
    return filled, ignored


def load_like_vllm(raw: dict, shapes: dict[str, tuple]) -> tuple[dict, list[str]]:
    """(filled {param: {shard: shape}}, tensors vLLM refuses or takes as its own embedding/head)."""
    params = {f"model.{name}": shards for name, shards in engine_parameters(raw).items()}
    filled, refused = {}, []
    for name, shape in shapes.items():
        if "embed_tokens" in name or "lm_head" in name:
            refused.append(name)  # would replace the target's embedding / LM head
            continue
        name = "model." + name
        shard = None
        for param, part, stacked_shard in STACKED:
            if f".{part}" in name:
                name, shard = name.replace(f".{part}", f".{param}"), stacked_shard
                break
        if name not in params:
            refused.append(name)  # AutoWeightsLoader: no parameter of that name
        else:
            filled.setdefault(name, {})[shard] = shape
    return filled, refused


def assert_loads_completely(loader, raw: dict, shapes: dict[str, tuple]) -> None:
    filled, left_over = loader(raw, shapes)
    expected = engine_parameters(raw)
    if loader is load_like_vllm:
        expected = {f"model.{name}": shards for name, shards in expected.items()}
    assert left_over == [], f"{loader.__name__}: tensors not loaded: {left_over[:6]}"
    assert set(filled) == set(expected), sorted(set(expected) ^ set(filled))[:6]
    for param, shards in expected.items():
        assert filled[param] == shards, (param, filled[param], shards)


def tiny_export(tmp_path) -> tuple[dict, dict[str, tuple]]:
    config = presets.resolve_drafter_config(
        DrafterConfig(preset="tiny", block_size=4),
        presets.tiny_hybrid_target_config(),
        target_layer_ids=[0, 2],
        mask_token_id=300,
    )
    save_drafter(DFlashDrafter(config), config, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    return json.loads((tmp_path / "config.json").read_text()), shapes


def qwen36_27b_export() -> tuple[dict, dict[str, tuple]]:
    config = presets.resolve_drafter_config(
        DrafterConfig(preset="qwen3.6-27b"), presets.qwen36_27b_target_config()
    )
    with torch.device("meta"):  # 1.7B parameters: names and shapes only
        drafter = DFlashDrafter(config)
    tensors = serving_state(drafter, torch.bfloat16)
    return config.to_serving_dict(), {name: tuple(t.shape) for name, t in tensors.items()}


@pytest.mark.parametrize("loader", [load_like_sglang, load_like_vllm])
def test_tiny_export_loads_completely(tmp_path, loader):
    raw, shapes = tiny_export(tmp_path)
    check_engine_config(raw)
    assert_loads_completely(loader, raw, shapes)


@pytest.mark.parametrize("loader", [load_like_sglang, load_like_vllm])
def test_qwen36_27b_export_loads_completely(loader):
    raw, shapes = qwen36_27b_export()
    check_engine_config(raw)
    assert raw["dflash_config"]["target_layer_ids"] == [1, 16, 31, 46, 61]
    assert_loads_completely(loader, raw, shapes)


def test_the_rules_catch_a_model_prefix_a_misnamed_tensor_and_a_shipped_embedding(tmp_path):
    raw, shapes = tiny_export(tmp_path)
    prefixed = {f"model.{name}": shape for name, shape in shapes.items()}
    with pytest.raises(AssertionError, match="load_like_vllm: tensors not loaded"):
        assert_loads_completely(load_like_vllm, raw, prefixed)
    misnamed = dict(shapes)
    misnamed["layers.0.mlp.up.weight"] = misnamed.pop("layers.0.mlp.up_proj.weight")
    with pytest.raises(AssertionError, match="load_like_sglang: tensors not loaded"):
        assert_loads_completely(load_like_sglang, raw, misnamed)
    with pytest.raises(AssertionError, match="tensors not loaded.*embed_tokens"):
        assert_loads_completely(load_like_vllm, raw, shapes | {"embed_tokens.weight": (320, 64)})
    wrong_features = json.loads(json.dumps(raw))
    wrong_features["dflash_config"]["target_layer_ids"] = [0, 1, 2]  # fc expects 3 features now
    with pytest.raises(AssertionError, match="fc.weight"):
        assert_loads_completely(load_like_sglang, wrong_features, shapes)
