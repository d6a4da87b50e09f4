"""The frozen target: features == HF hidden states, truncation, freezing, the kernel guard, loading."""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
import warnings
import weakref

import pytest
import torch
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

from dflash_train.config import TargetConfig
from dflash_train.models import presets, target_kernels, target_loading
from dflash_train.models.builtin_targets import register_builtin_target
from dflash_train.models.drafter_config import DFlashDraftConfig
from dflash_train.models.target import (
    FrozenTarget,
    load_causal_lm,
    load_target,
    validate_target_for_drafter,
)
from dflash_train.models.target_kernels import check_fast_kernels, gated_delta_net_layers

FIXTURES = ["tiny_hybrid_dir", "tiny_qwen3_dir"]


def frozen(path, ids, dtype="float32") -> FrozenTarget:
    return load_target(TargetConfig(path=str(path), dtype=dtype, target_layer_ids=ids), "cpu")


def random_ids(target: FrozenTarget, rows: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, target.vocab_size, (rows, length), generator=generator)


@pytest.mark.parametrize(
    "fixture,ids",
    [
        ("tiny_hybrid_dir", [0, 2]),
        ("tiny_hybrid_dir", [1, 3]),
        ("tiny_qwen3_dir", [0, 1]),
        ("tiny_qwen3_dir", [2, 0]),
    ],
)
def test_features_equal_hf_hidden_states(request, fixture, ids):
    # HF's hidden_states[0] is the embedding output and hidden_states[i + 1] the raw output of layer i,
    # EXCEPT the last entry hidden_states[N], which transformers replaces by the final-normed output.
    # So a feature of the last layer N-1 is checked as norm(feature) == hidden_states[N].
    target = frozen(request.getfixturevalue(fixture), ids)
    input_ids = random_ids(target, rows=2, length=24)
    features = target.features(input_ids)
    with torch.no_grad():
        hidden_states = target.model(input_ids=input_ids, output_hidden_states=True).hidden_states
    num_layers = target.num_layers
    assert len(hidden_states) == num_layers + 1
    assert features.shape == (2, 24, len(ids) * target.hidden_size)
    assert features.dtype == torch.float32 and features.is_contiguous() and not features.requires_grad
    for k, layer_id in enumerate(ids):
        feature = features[..., k * target.hidden_size : (k + 1) * target.hidden_size]
        if layer_id < num_layers - 1:
            assert torch.equal(feature, hidden_states[layer_id + 1])
        else:
            with torch.no_grad():
                assert torch.equal(target.decoder.norm(feature), hidden_states[num_layers])


@pytest.mark.parametrize("fixture", FIXTURES)
def test_right_padded_rows_match_unpadded(request, fixture):
    target = frozen(request.getfixturevalue(fixture), [0, 1])
    lengths = [24, 17, 9]
    input_ids = random_ids(target, rows=3, length=24, seed=1)
    attention_mask = torch.arange(24)[None, :] < torch.tensor(lengths)[:, None]
    input_ids = input_ids.masked_fill(~attention_mask, 0)
    padded = target.features(input_ids, attention_mask)
    for row, length in enumerate(lengths):
        alone = target.features(input_ids[row : row + 1, :length])[0]
        torch.testing.assert_close(padded[row, :length], alone, rtol=0, atol=1e-5)


def count_calls(modules: dict[str, torch.nn.Module]) -> tuple[dict[str, int], list]:
    counts = dict.fromkeys(modules, 0)

    def counter(name):
        def hook(module, args, output):
            counts[name] += 1

        return hook

    return counts, [m.register_forward_hook(counter(n)) for n, m in modules.items()]


def test_features_run_only_needed_layers_and_leave_model_whole(tiny_hybrid_dir):
    target = frozen(tiny_hybrid_dir, [0, 2])
    assert not any(p.requires_grad for p in target.model.parameters())
    assert not target.model.training
    watched = {f"layer{i}": layer for i, layer in enumerate(target.decoder.layers)}
    watched |= {"norm": target.decoder.norm, "lm_head": target.lm_head}
    counts, handles = count_calls(watched)
    target.features(random_ids(target, 1, 8))
    assert counts == {"layer0": 1, "layer1": 1, "layer2": 1, "layer3": 0, "norm": 0, "lm_head": 0}
    # The full model is untouched: a normal forward runs every layer, the final norm and the LM head.
    with torch.no_grad():
        target.model(input_ids=random_ids(target, 1, 8))
    assert counts == {"layer0": 2, "layer1": 2, "layer2": 2, "layer3": 1, "norm": 1, "lm_head": 1}
    assert len(target.decoder.layers) == 4 and target.decoder.norm is watched["norm"]
    for handle in handles:
        handle.remove()


def test_features_leave_no_other_activations_alive(tiny_hybrid_dir):
    target = frozen(tiny_hybrid_dir, [0, 2])
    refs = []
    handle = target.decoder.layers[1].register_forward_hook(lambda m, a, out: refs.append(weakref.ref(out)))
    features = target.features(random_ids(target, 2, 16))
    handle.remove()
    assert refs and refs[0]() is None  # layer 1's output (not a feature) was freed, no gc needed
    assert features._base is None  # a fresh tensor, not a view keeping a larger buffer alive


@pytest.mark.parametrize("fixture,tied", [("tiny_qwen3_dir", True), ("tiny_hybrid_dir", False)])
def test_embedding_and_lm_head_are_the_models_own(request, fixture, tied):
    target = frozen(request.getfixturevalue(fixture), [0])
    assert target.embed_tokens is target.model.model.embed_tokens
    assert target.lm_head is target.model.lm_head
    shares = target.lm_head.weight.data_ptr() == target.embed_tokens.weight.data_ptr()
    assert shares == tied
    assert target.hidden_size == 64 and target.vocab_size == target.lm_head.weight.shape[0]


def test_features_in_bfloat16_keep_the_target_dtype(tiny_qwen3_dir):
    target = frozen(tiny_qwen3_dir, [0, 2], dtype="bfloat16")
    assert target.features(random_ids(target, 1, 8)).dtype == torch.bfloat16


# ----------------------------------------------------------------------------- kernel guard


def bind_chunk_rule(monkeypatch, model, package: str) -> None:
    """Re-wrap the GatedDeltaNet chunk kernel with transformers' own fallback decorator for ``package``."""
    modeling = sys.modules[type(gated_delta_net_layers(model)[0]).__module__]

    def torch_chunk_gated_delta_rule(query, key, value, g, beta, **kwargs):
        raise AssertionError("not called")

    wrapped = use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", package)(
        torch_chunk_gated_delta_rule
    )
    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", wrapped)


def install_fake_fla(monkeypatch) -> None:
    """A stand-in ``fla`` package exposing ops.gated_delta_rule.chunk_gated_delta_rule."""
    fla, ops, rule = (types.ModuleType(n) for n in ("fla", "fla.ops", "fla.ops.gated_delta_rule"))

    def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False):
        raise AssertionError("not called")

    chunk_gated_delta_rule.__module__ = "fla.ops.gated_delta_rule.chunk"
    rule.chunk_gated_delta_rule, ops.gated_delta_rule, fla.ops = chunk_gated_delta_rule, rule, ops
    for module in (fla, ops, rule):
        monkeypatch.setitem(sys.modules, module.__name__, module)


@pytest.fixture()
def hybrid_model(tiny_hybrid_dir):
    return load_causal_lm(str(tiny_hybrid_dir), dtype="float32", device="cpu")[0]


def test_guard_refuses_torch_fallback_on_cuda(monkeypatch, hybrid_model):
    bind_chunk_rule(monkeypatch, hybrid_model, "package_that_is_not_installed")
    with pytest.raises(RuntimeError, match="pip install fla-core.*allow_slow_kernels=true"):
        check_fast_kernels(hybrid_model, "cuda", allow_slow=False)
    with pytest.warns(RuntimeWarning, match="fla-core"):
        kernels = check_fast_kernels(hybrid_model, torch.device("cuda", 0), allow_slow=True)
    assert kernels["chunk_gated_delta_rule"] == "torch"


def test_guard_accepts_fla_and_cpu(monkeypatch, hybrid_model, tiny_qwen3_dir):
    install_fake_fla(monkeypatch)
    bind_chunk_rule(monkeypatch, hybrid_model, "fla")
    assert check_fast_kernels(hybrid_model, "cuda", allow_slow=False)["chunk_gated_delta_rule"] == "fla"
    monkeypatch.undo()
    kernels = check_fast_kernels(hybrid_model, "cpu", allow_slow=False)  # fla is absent on this machine
    assert kernels["chunk_gated_delta_rule"] == "torch" and kernels["causal_conv1d_fn"] == "torch"
    qwen3 = load_causal_lm(str(tiny_qwen3_dir), dtype="float32", device="cpu")[0]
    assert "chunk_gated_delta_rule" not in check_fast_kernels(qwen3, "cuda", allow_slow=False)


def test_torch_conv_fallback_warns_once_and_loudly_on_cuda(monkeypatch, hybrid_model):
    monkeypatch.setattr(target_kernels, "_WARNED", set())
    install_fake_fla(monkeypatch)
    bind_chunk_rule(monkeypatch, hybrid_model, "fla")  # the chunk rule is fast, the conv is not
    with pytest.warns(RuntimeWarning, match="SLOW TARGET: the GatedDeltaNet conv"):
        kernels = check_fast_kernels(hybrid_model, "cuda", allow_slow=False)
    assert kernels["causal_conv1d_fn"] == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: a second target load stays quiet
        check_fast_kernels(hybrid_model, "cuda", allow_slow=False)
    monkeypatch.setattr(target_kernels, "_WARNED", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_fast_kernels(hybrid_model, "cpu", allow_slow=False)  # CPU runs never warn


def test_kernels_report_what_is_bound_not_what_imports(monkeypatch, hybrid_model):
    # An opaque callable (no wrapper closure to inspect) bound to the conv: the reported source is
    # where that callable is defined, even when the fast package itself imports fine.
    modeling = sys.modules[type(gated_delta_net_layers(hybrid_model)[0]).__module__]
    monkeypatch.setitem(sys.modules, "causal_conv1d", types.ModuleType("causal_conv1d"))
    reference = functools.partial(modeling.causal_conv1d_fn.__wrapped__)
    monkeypatch.setattr(modeling, "causal_conv1d_fn", reference)
    assert target_kernels.bound_kernels(hybrid_model)["causal_conv1d_fn"] == "torch"

    class FastConv:
        def __call__(self, *args, **kwargs):
            raise AssertionError("not called")

    FastConv.__module__ = "causal_conv1d.cpp_functions"
    monkeypatch.setattr(modeling, "causal_conv1d_fn", FastConv())
    assert target_kernels.bound_kernels(hybrid_model)["causal_conv1d_fn"] == "causal_conv1d"
    monkeypatch.setattr(modeling, "causal_conv1d_fn", target_kernels.fla_causal_conv1d_fn)
    assert target_kernels.bound_kernels(hybrid_model)["causal_conv1d_fn"] == "fla"


def test_load_target_records_kernels(tiny_hybrid_dir):
    target = frozen(tiny_hybrid_dir, [1])
    assert target.kernels["chunk_gated_delta_rule"] in ("torch", "fla")
    assert target.kernels["attention"] == "sdpa"


# ----------------------------------------------------------------------------- errors and drafter checks


@pytest.mark.parametrize("path", ["/nonexistent/target_dir", "./missing/target", "~/no/such/model"])
def test_missing_local_path_is_a_clear_error(path):
    with pytest.raises(ValueError, match=f"{path!r} does not exist"):
        load_causal_lm(path, dtype="float32", device="cpu")


def test_bad_config_values_are_clear_errors(tiny_qwen3_dir):
    with pytest.raises(ValueError, match="preset 'nope' is unknown"):
        load_causal_lm("preset:nope", dtype="float32", device="cpu")
    with pytest.raises(ValueError, match=r"within \[0, 2\]"):
        frozen(tiny_qwen3_dir, [0, 3])
    with pytest.raises(ValueError, match="dtype 'int8'"):
        load_causal_lm("preset:tiny-qwen3", dtype="int8", device="cpu")


def drafter_for(target: FrozenTarget) -> DFlashDraftConfig:
    return DFlashDraftConfig(
        hidden_size=target.hidden_size,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=target.lm_head.weight.shape[0],
        num_target_layers=target.num_layers,
        target_layer_ids=list(target.target_layer_ids),
        mask_token_id=target.tokenizer.mask_token_id,
        block_size=4,
    )


def test_validate_target_for_drafter(tiny_hybrid_dir):
    target = frozen(tiny_hybrid_dir, [0, 2])
    draft = drafter_for(target)
    validate_target_for_drafter(target, draft)
    eos, pad = target.tokenizer.eos_token_id, target.tokenizer.pad_token_id
    cases = [
        (dict(hidden_size=32, intermediate_size=64), "hidden_size 32 != target hidden_size 64"),
        (dict(target_layer_ids=[1, 2]), "set target.target_layer_ids"),
        (dict(vocab_size=draft.vocab_size + 1), "vocab_size"),
        (dict(mask_token_id=draft.vocab_size + 5), "not a row of the target embedding"),
        (dict(mask_token_id=eos), "eos token.*drafter.mask_token_id"),
        (dict(mask_token_id=pad), "pad token"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            validate_target_for_drafter(target, dataclasses.replace(draft, **change))


# ----------------------------------------------------------------------------- other sources


TINY_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
)


@pytest.mark.parametrize("tied", [False, True])
def test_conditional_generation_checkpoint_loads_text_only(tmp_path, tied):
    text = presets.tiny_hybrid_target_config().to_dict()
    config = Qwen3_5Config(text_config=text, vision_config=TINY_VISION, tie_word_embeddings=tied)
    torch.manual_seed(0)
    full = Qwen3_5ForConditionalGeneration(config).eval()
    full.save_pretrained(tmp_path)
    model, tokenizer = load_causal_lm(str(tmp_path), dtype="float32", device="cpu")
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and tokenizer is None
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    assert not any("visual" in n for n in names)
    input_ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(input_ids=input_ids).logits, full(input_ids=input_ids).logits)
    target = FrozenTarget(model, tokenizer, [0, 2])
    assert (target.lm_head.weight.data_ptr() == target.embed_tokens.weight.data_ptr()) == tied


def test_preset_builds_random_weights(tiny_qwen3_dir):
    target = load_target(
        TargetConfig(path="preset:tiny-hybrid", dtype="float32", target_layer_ids=[0, 1]), "cpu"
    )
    assert target.tokenizer is None and target.num_layers == 4
    assert target.features(random_ids(target, 1, 8)).shape == (1, 8, 128)
    again = load_causal_lm("preset:tiny-hybrid", dtype="float32", device="cpu")[0]
    assert torch.equal(again.lm_head.weight, target.lm_head.weight)  # seeded: benchmarks are repeatable
    cfg = TargetConfig(path="preset:tiny-hybrid", dtype="float32", target_layer_ids=[0, 1])
    truncated = load_target(cfg, "cpu", truncate_unused_layers=True)
    assert truncated.num_layers == 2 and truncated.target_layer_ids == [0, 1]


def test_default_layer_ids_and_builtin(monkeypatch, tiny_qwen3_dir):
    from dflash_train.models import builtin_targets

    target = load_target(
        TargetConfig(path=str(tiny_qwen3_dir), dtype="float32"), "cpu", num_target_features=2
    )
    assert target.target_layer_ids == presets.default_target_layer_ids(3, 2)
    monkeypatch.setattr(builtin_targets, "_RESOLVERS", {})
    with pytest.raises(ValueError, match=r"'builtin:tiny' is not registered.*register\(\)"):
        load_causal_lm("builtin:tiny", dtype="float32", device="cpu")
    register_builtin_target("tiny", lambda name: tiny_qwen3_dir)
    model, tokenizer = load_causal_lm("builtin:tiny", dtype="float32", device="cpu")
    assert type(model).__name__ == "Qwen3ForCausalLM" and tokenizer is not None


def test_demo_registers_its_builtin_target_lazily(monkeypatch, tiny_qwen3_dir):
    from dflash_train.demo import builtin_targets as demo_builtins
    from dflash_train.models import builtin_targets

    monkeypatch.setattr(builtin_targets, "_RESOLVERS", {})
    monkeypatch.setattr(demo_builtins, "builtin_target_path", lambda name: tiny_qwen3_dir)
    demo_builtins.register()
    assert builtin_targets.registered_builtin_targets() == ["demo-target"]
    assert target_loading.resolve_target_path("builtin:demo-target") == str(tiny_qwen3_dir)


@pytest.mark.gpu
def test_fla_causal_conv_matches_the_torch_fallback_on_cuda():

    model = target_loading.build_preset_target("tiny-hybrid", dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, 300, (2, 128), device="cuda")
    module = sys.modules[type(target_kernels.gated_delta_net_layers(model)[0]).__module__]
    original = module.causal_conv1d_fn
    try:
        reference = FrozenTarget(model, None, [0, 2]).features(ids)
        assert target_kernels.bind_fla_causal_conv(model, "cuda")
        assert target_kernels.bound_kernels(model)["causal_conv1d_fn"] == "fla"
        fast = FrozenTarget(model, None, [0, 2]).features(ids)
    finally:
        module.causal_conv1d_fn = original
    assert ((fast.float() - reference.float()).norm() / reference.float().norm()) < 2e-2


def test_fla_causal_conv_is_not_bound_on_cpu(tiny_hybrid_dir):

    model, _ = target_loading.load_causal_lm(str(tiny_hybrid_dir), dtype="float32", device="cpu")
    assert not target_kernels.bind_fla_causal_conv(model, "cpu")
    assert target_kernels.bound_kernels(model)["causal_conv1d_fn"] == "torch"


@pytest.mark.parametrize("fixture", ["tiny_hybrid_dir", "tiny_qwen3_dir"])
def test_target_head_reads_only_embedding_and_lm_head(fixture, request):
    from dflash_train.models.target import load_target_head

    path = str(request.getfixturevalue(fixture))
    cfg = TargetConfig(path=path, dtype="float32", target_layer_ids=[0, 2])
    full = load_target(cfg, "cpu")
    head = load_target_head(cfg, "cpu")
    assert torch.equal(head.embed_tokens.weight, full.embed_tokens.weight)
    assert torch.equal(head.lm_head.weight, full.lm_head.weight)
    assert head.target_layer_ids == [0, 2] and head.num_layers == full.num_layers
    assert len(head.decoder.layers) == 0 and head.tokenizer is not None
    assert head.decoder.norm.weight.is_meta  # nothing but the two tensors was read


def test_compile_target_regions_leaves_the_fla_token_mixer_eager():

    model = target_loading.build_preset_target("tiny-hybrid", dtype=torch.float32, device="cpu")
    names = target_kernels.compile_target_regions(model)  # lazy: nothing compiles until a forward
    kinds = {name.split(".", 2)[2] for name in names}
    assert kinds == {"input_layernorm", "post_attention_layernorm", "mlp", "self_attn", "linear_attn.norm"}
    assert len(names) == 4 * len(model.get_decoder().layers)


def test_compile_report_counts_what_each_compilation_wrapped_without_compiling():
    # torch.compile wraps lazily: the report reads the wrappers, so nothing compiles on CPU here.
    model = target_loading.build_preset_target("tiny-hybrid", dtype=torch.float32, device="cpu")
    assert target_kernels.compile_report(model) == "none"
    target_kernels.compile_target_regions(model)
    assert target_kernels.compile_report(model) == (
        "regions (linear_attn.norm x3, mlp x4, input_layernorm x4, post_attention_layernorm x4, "
        "self_attn x1; in 4 of 4 layers)"
    )
    model = target_loading.build_preset_target("tiny-hybrid", dtype=torch.float32, device="cpu")
    target_kernels.compile_target_layers(model)
    assert target_kernels.compile_report(model) == "whole layers (4 of 4)"
    del model.get_decoder().layers[1].forward  # back to the class's own, uncompiled forward
    assert target_kernels.compile_report(model) == "whole layers (3 of 4)"


def test_load_target_records_what_was_compiled(tiny_qwen3_dir):
    cfg = TargetConfig(path=str(tiny_qwen3_dir), target_layer_ids=[0, 1])
    assert load_target(cfg, "cpu").kernels["compile"] == "none (target.compile off)"
    on_cpu = load_target(cfg, "cpu", compile_regions=True)
    assert on_cpu.kernels["compile"] == "none (target.compile applies on CUDA only)"
    assert target_kernels.compile_report(on_cpu.model) == "none"


@pytest.mark.gpu
def test_compiled_target_regions_give_the_same_features_on_cuda():

    model = target_loading.build_preset_target("tiny-hybrid", dtype=torch.bfloat16, device="cuda")
    target_kernels.bind_fla_causal_conv(model, "cuda")
    ids = torch.randint(0, 300, (2, 128), device="cuda")
    reference = FrozenTarget(model, None, [0, 2, 3]).features(ids)
    target_kernels.compile_target_regions(model)
    compiled = FrozenTarget(model, None, [0, 2, 3]).features(ids)
    assert ((compiled.float() - reference.float()).norm() / reference.float().norm()) < 1e-2
