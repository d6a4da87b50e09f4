"""target.fp8: config, refusals, which linears become FP8, the wiring into load_target, and (GPU) fidelity."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

from dflash_train.config import TargetConfig, load_config
from dflash_train.models import target as target_module
from dflash_train.models import target_fp8
from dflash_train.models.target import load_target, load_target_head
from dflash_train.models.target_fp8 import (
    SKIP_GDN_GATE,
    SKIP_ROUTER,
    SKIP_SHAPE,
    check_fp8_support,
    plan_fp8_linears,
    quantize_target_linears,
)
from dflash_train.models.target_loading import load_causal_lm


def tiny_model(preset: str = "tiny-hybrid") -> nn.Module:
    model, _ = load_causal_lm(
        f"preset:{preset}", dtype=torch.float32, device=torch.device("cpu"), trust_remote_code=False
    )
    return model


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in model.get_decoder().named_modules() if isinstance(m, nn.Linear)}


# ----------------------------------------------------------------------------- config


def test_fp8_is_off_by_default():
    assert TargetConfig(path="x").fp8 is False
    assert load_config("tiny-cpu").target.fp8 is False


def test_fp8_with_a_dtype_other_than_bfloat16_is_a_config_error():
    with pytest.raises(ValueError, match="target.dtype=bfloat16"):
        load_config("tiny-cpu", ["target.fp8=true", "target.dtype=float32"])
    cfg = load_config("tiny-cpu", ["target.fp8=true", "target.dtype=bfloat16"])
    assert cfg.target.fp8 is True


# ----------------------------------------------------------------------------- refusals


def test_load_target_refuses_fp8_on_cpu_before_loading(monkeypatch, tiny_qwen3_dir):
    def no_load(*args, **kwargs):
        raise AssertionError("the target was loaded before the refusal")

    monkeypatch.setattr(target_module, "load_causal_lm", no_load)
    cfg = TargetConfig(path=str(tiny_qwen3_dir), dtype="bfloat16", fp8=True)
    with pytest.raises(RuntimeError, match=r"needs a CUDA GPU .*8\.9.*set target\.fp8=false"):
        load_target(cfg, "cpu")


def test_a_gpu_before_sm89_is_refused(monkeypatch):
    monkeypatch.setattr(target_fp8, "cuda_capability", lambda device: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(RuntimeError, match=r"sm80; set target\.fp8=false"):
        check_fp8_support("cuda", torch.bfloat16)


def test_a_dtype_other_than_bfloat16_is_refused_at_load(monkeypatch):
    monkeypatch.setattr(target_fp8, "cuda_capability", lambda device: (9, 0))
    with pytest.raises(ValueError, match="set target.dtype=bfloat16"):
        check_fp8_support("cuda", torch.float16)


def test_missing_torchao_is_refused_with_the_install_command(monkeypatch):
    monkeypatch.setattr(target_fp8, "cuda_capability", lambda device: (9, 0))
    # A None entry in sys.modules makes `import torchao...` raise ImportError, installed or not.
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    with pytest.raises(RuntimeError, match=r"pip install torchao.*dflash-train\[fp8\]"):
        check_fp8_support("cuda", torch.bfloat16)


def test_split_placement_head_loads_with_fp8_on():
    # Drafter ranks load only the (always bf16) embedding and LM head on the CPU: fp8 must not refuse.
    head = load_target_head(TargetConfig(path="preset:tiny-qwen3", dtype="bfloat16", fp8=True), "cpu")
    assert head.lm_head.weight.dtype == torch.bfloat16
    assert len(head.decoder.layers) == 0


# ----------------------------------------------------------------------------- which linears


def test_plan_converts_every_decoder_linear_but_the_gated_delta_net_gates():
    model = tiny_model("tiny-hybrid")
    plan = plan_fp8_linears(model)
    linears = decoder_linears(model)
    assert set(plan.converted) | set(plan.skipped) == set(linears)
    assert not set(plan.converted) & set(plan.skipped)
    gates = {n for n in linears if n.endswith(("in_proj_a", "in_proj_b"))}
    assert len(gates) == 6 and plan.skipped == dict.fromkeys(gates, SKIP_GDN_GATE)
    for expected in (
        "layers.0.linear_attn.in_proj_qkv",
        "layers.3.self_attn.k_proj",
        "layers.2.mlp.down_proj",
    ):
        assert expected in plan.converted
    assert all(n.startswith("layers.") for n in plan.converted)  # never embed_tokens / lm_head
    assert plan.kernel_entries() == {
        "linear": "fp8-torchao rowwise (25 of 31 decoder linears)",
        "linear_bf16": f"{SKIP_GDN_GATE} x6",
    }


def test_plan_skips_shapes_off_the_fp8_grid_and_routers():
    model = tiny_model("tiny-qwen3")
    layer = model.get_decoder().layers[0]
    layer.mlp.up_proj = nn.Linear(64, 120, bias=False)  # 120 % 16 != 0
    layer.mlp.gate = nn.Linear(64, 32, bias=False)  # a MoE router's name
    plan = plan_fp8_linears(model)
    assert plan.skipped == {"layers.0.mlp.up_proj": SKIP_SHAPE, "layers.0.mlp.gate": SKIP_ROUTER}
    assert len(plan.converted) == 21 - 1
    assert "lm_head" not in plan.converted and not any("embed" in n for n in plan.converted)


# ----------------------------------------------------------------------------- wiring (a stand-in torchao)


class StandInFloat8(torch.Tensor):
    """Marks a weight as converted (torchao's Float8Tensor is a tensor subclass too)."""


def stand_in_torchao(monkeypatch, *, converts: bool = True) -> list:
    """Install a fake ``torchao.quantization`` whose quantize_ applies filter_fn as torchao does."""
    calls = []

    def quantize_(model, config, filter_fn):
        calls.append(config)
        for name, module in list(model.named_modules()):
            if isinstance(module, nn.Linear) and filter_fn(module, name) and converts:
                weight = torch.Tensor._make_subclass(StandInFloat8, module.weight.detach())
                module.weight = nn.Parameter(weight, requires_grad=False)

    quantization = types.SimpleNamespace(
        quantize_=quantize_,
        PerRow=lambda: "per-row",
        Float8DynamicActivationFloat8WeightConfig=lambda **kw: kw,
    )
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.quantization", quantization)
    return calls


def test_quantize_converts_exactly_the_planned_linears(monkeypatch):
    calls = stand_in_torchao(monkeypatch)
    model = tiny_model("tiny-hybrid")
    summary = quantize_target_linears(model)
    assert calls == [{"granularity": "per-row", "set_inductor_config": False}]
    converted = {n for n, m in decoder_linears(model).items() if isinstance(m.weight, StandInFloat8)}
    assert converted == set(summary.converted) and len(converted) == 25
    assert not isinstance(model.lm_head.weight, StandInFloat8)
    assert not isinstance(model.get_input_embeddings().weight, StandInFloat8)


def test_a_linear_torchao_leaves_in_bf16_is_an_error(monkeypatch):
    stand_in_torchao(monkeypatch, converts=False)
    with pytest.raises(RuntimeError, match="torchao left 25 planned linears in bf16"):
        quantize_target_linears(tiny_model("tiny-hybrid"))


def test_load_target_quantizes_and_records_it(monkeypatch, tiny_hybrid_dir):
    stand_in_torchao(monkeypatch)
    checked = []
    monkeypatch.setattr(target_module, "check_fp8_support", lambda device, dtype: checked.append(dtype))
    cfg = TargetConfig(path=str(tiny_hybrid_dir), dtype="bfloat16", fp8=True, target_layer_ids=[0, 2])
    target = load_target(cfg, "cpu")
    assert checked == [torch.bfloat16]
    assert target.kernels["linear"] == "fp8-torchao rowwise (25 of 31 decoder linears)"
    assert isinstance(target.decoder.layers[0].mlp.up_proj.weight, StandInFloat8)
    assert target.lm_head.weight.dtype == torch.bfloat16 and not isinstance(
        target.lm_head.weight, StandInFloat8
    )
    plain = load_target(
        TargetConfig(path=str(tiny_hybrid_dir), dtype="bfloat16", target_layer_ids=[0, 2]), "cpu"
    )
    assert "linear" not in plain.kernels


def test_real_torchao_converts_the_planned_linears_on_cpu(monkeypatch):
    # Pins torchao's API names and filter_fn contract where torchao is installed (not in CI): with its
    # CUDA-capability assertion stood down, torch's CPU _scaled_mm runs the same Float8Tensor path.
    pytest.importorskip("torchao")
    from torchao.quantization import quant_api

    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)
    model, tokenizer = load_causal_lm(
        "preset:tiny-qwen3", dtype=torch.bfloat16, device=torch.device("cpu"), trust_remote_code=False
    )
    ids = torch.randint(0, 320, (2, 64), generator=torch.Generator().manual_seed(0))
    expected = target_module.FrozenTarget(model, tokenizer, [0, 1]).features(ids)
    summary = quantize_target_linears(model)
    assert summary.kernel_entries() == {"linear": "fp8-torchao rowwise (21 of 21 decoder linears)"}
    assert {type(m.weight).__name__ for m in decoder_linears(model).values()} == {"Float8Tensor"}
    assert type(model.lm_head.weight) is nn.Parameter
    got = target_module.FrozenTarget(model, tokenizer, [0, 1]).features(ids)
    assert not torch.equal(got, expected) and cosine(got, expected) > 0.99


# ----------------------------------------------------------------------------- GPU fidelity


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


@pytest.mark.gpu
@pytest.mark.parametrize("fixture", ["tiny_qwen3_dir", "tiny_hybrid_dir"])
def test_fp8_features_close_to_bf16_on_gpu(request, fixture):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores (sm89+)")
    pytest.importorskip("torchao")
    path = str(request.getfixturevalue(fixture))
    kwargs = dict(path=path, dtype="bfloat16", target_layer_ids=[0, 1, 2], allow_slow_kernels=True)
    reference = load_target(TargetConfig(**kwargs), "cuda")
    fp8 = load_target(TargetConfig(**kwargs, fp8=True), "cuda")
    assert fp8.kernels["linear"].startswith("fp8-torchao rowwise")
    ids = torch.randint(0, reference.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0)).cuda()
    expected, got = reference.features(ids), fp8.features(ids)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    assert not torch.equal(got, expected)  # the FP8 path really ran
    assert cosine(got, expected) > 0.99
    assert type(fp8.decoder.layers[0].mlp.up_proj.weight).__name__ == "Float8Tensor"
    assert type(fp8.lm_head.weight) is nn.Parameter and fp8.lm_head.weight.dtype == torch.bfloat16


@pytest.mark.gpu
def test_fp8_target_compiles_whole_layers_on_gpu(tiny_qwen3_dir):
    # target.compile after quantization compiles every decoder layer's forward (compile_target_layers),
    # not the per-region MLPs of a bf16 target: each float8 linear's activation quantization then fuses
    # into the op before it. The compiled forward must trace the float8 linears whole: no graph break,
    # no frame dynamo gives up on (either would run part of every layer eagerly).
    from torch._dynamo.utils import counters

    from dflash_train.models.target_kernels import compile_report

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores (sm89+)")
    pytest.importorskip("torchao")
    cfg = TargetConfig(path=str(tiny_qwen3_dir), dtype="bfloat16", target_layer_ids=[0, 1], fp8=True)
    eager = load_target(cfg, "cuda")
    compiled = load_target(cfg, "cuda", compile_regions=True)
    layers = compiled.decoder.layers
    assert all(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in layers)
    assert all(layer.mlp._compiled_call_impl is None for layer in layers)  # no regions on top
    assert compiled.kernels["compile"] == f"whole layers ({len(layers)} of {len(layers)})"
    assert compile_report(compiled.model) == compiled.kernels["compile"]
    assert eager.kernels["compile"] == "none (target.compile off)"
    ids = torch.randint(0, eager.vocab_size, (1, 128), generator=torch.Generator().manual_seed(1)).cuda()
    torch._dynamo.reset()
    counters.clear()
    got = compiled.features(ids)
    assert counters["stats"]["unique_graphs"] >= 1  # the layers really ran compiled
    assert dict(counters["graph_break"]) == {}
    assert counters["frames"]["total"] == counters["frames"]["ok"]  # no eager fallback
    assert cosine(got, eager.features(ids)) > 0.999


# ----------------------------------------------------------------------------- bench


def test_bench_target_fp8_flag_sets_the_target_config():
    from dflash_train.bench.train_step import BenchOptions, bench_config
    from dflash_train.cli import build_parser, options_from_args

    args = build_parser().parse_args(["bench", "--preset", "qwen3.6-27b", "--target-fp8"])
    options = options_from_args(BenchOptions, args)
    assert options.target_fp8 is True
    cfg, _, _ = bench_config(options)
    assert cfg.target.fp8 is True and cfg.target.dtype == "bfloat16"
    assert bench_config(BenchOptions(preset="qwen3.6-27b"))[0].target.fp8 is False
    with pytest.raises(ValueError, match="--target-fp8 needs a bfloat16 preset"):
        BenchOptions(preset="tiny", target_fp8=True)
