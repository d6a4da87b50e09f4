"""The slot engine (continuous batching, preallocated cache) emits exactly what the padded engine does.

fp32 on CPU: for every row, the same tokens, stop flag and stop id as the padded-batch loop (the
engine synth and regen used before, ``generate.sampling.sample_batch``), greedy and sampled, on an
attention target, a GatedDeltaNet hybrid and the demo target's shape, with mixed prompt lengths,
rows that stop at once, rows that hit the limit, and fewer slots than rows (so slots are refilled
and hold a longer row's stale entries). A planted off-by-one in positions, cache indices or the
mask must break the comparison.
"""

from __future__ import annotations

import sys

import pytest
import torch

from dflash_train.generate import engine as generation
from dflash_train.generate.engine import SlotEngine, build_generator, slot_engine_problem
from dflash_train.generate.sampling import PaddedEngine, Sampling
from dflash_train.generate.slot_cache import SlotAttentionLayer
from dflash_train.tiny import build_tiny_target, sharpen

pytestmark = pytest.mark.usefixtures("one_thread_module")

GREEDY, SAMPLED = Sampling(), Sampling(temperature=0.7, top_p=0.9, seed=3)


class ShapeOnly:
    """What ``demo_target_config`` reads from a tokenizer."""

    def __init__(self, size: int):
        self.size, self.eos_token_id, self.pad_token_id = size, 2, 0

    def __len__(self) -> int:
        return self.size


def demo_shaped_target() -> torch.nn.Module:
    """The builtin demo target's architecture (Qwen3.5 hybrid, 3 GatedDeltaNet + 1 attention layer,
    vocab 2048) with sharpened random weights: the demo target itself takes minutes to build."""
    from transformers import AutoModelForCausalLM

    from dflash_train.demo.target_build import DemoTargetSettings, demo_target_config

    torch.manual_seed(0)
    config = demo_target_config(DemoTargetSettings(), ShapeOnly(2048))
    return sharpen(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())


@pytest.fixture(scope="module", params=["qwen3", "hybrid", "demo-shape"])
def target(request):
    if request.param == "demo-shape":
        return demo_shaped_target()
    return sharpen(build_tiny_target(request.param, vocab_size=64, seed=1))


def mixed_prompts(vocab_size: int, num_rows: int = 9, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 20, (num_rows,), generator=gen).tolist()
    return [torch.randint(1, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def stop_ids_for(model, prompts, sampling: Sampling = GREEDY) -> set[int]:
    """Stop ids that end some rows at once and others later: the first token of row 0 and the fifth
    of row 1 as ``run`` draws them (the other rows keep going until they meet one, or the limit)."""
    first = run(PaddedEngine(model, num_slots=len(prompts)), prompts, set(), sampling, max_new_tokens=5)
    return {first[0].token_ids[0], first[1].token_ids[4]}


def run(engine, prompts, stops, sampling, max_new_tokens=24):
    keys = [100 + i for i in range(len(prompts))]
    return engine.generate(
        prompts, keys, max_new_tokens=max_new_tokens, stop_ids=stops, pad_id=0, sampling=sampling
    )


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("check_every", [1, 4])
def test_slots_equal_the_padded_engine_row_for_row(monkeypatch, target, sampling, check_every):
    prompts = mixed_prompts(target.config.vocab_size)
    stops = stop_ids_for(target, prompts, sampling)
    want = run(PaddedEngine(target, num_slots=len(prompts)), prompts, stops, sampling)
    running_at_admission = []
    real_prefill = generation.Run.prefill

    def recording_prefill(self, rows, slots):
        running_at_admission.append(len(self.occupant))
        return real_prefill(self, rows, slots)

    monkeypatch.setattr(generation.Run, "prefill", recording_prefill)
    engine = SlotEngine(target, num_slots=3, check_every=check_every)
    got = run(engine, prompts, stops, sampling)
    assert got == want
    assert [g.stop_id is not None for g in got] == [g.finished for g in got]
    lengths = [len(g.token_ids) for g in got]
    assert any(g.finished and n < 3 for g, n in zip(got, lengths))  # stopped early
    assert any(not g.finished for g in got) and max(lengths) == 24  # hit the limit
    assert max(running_at_admission) > 0  # a freed slot was refilled while other rows kept decoding


def test_one_engine_serves_calls_with_other_settings(target):
    # Prompts seed 2: with seed 1, one demo-shape row's sampled draw at step 8 lies within fp32
    # rounding of a CDF boundary (the padded engine itself draws either token, by batch size).
    prompts = mixed_prompts(target.config.vocab_size, num_rows=6, seed=2)
    stops = stop_ids_for(target, prompts)
    engine = SlotEngine(target, num_slots=4)
    for sampling, max_new_tokens in [(SAMPLED, 10), (GREEDY, 30), (SAMPLED, 1)]:
        fresh = PaddedEngine(target, num_slots=2)
        want = run(fresh, prompts, stops, sampling, max_new_tokens)
        assert run(engine, prompts, stops, sampling, max_new_tokens) == want


def test_a_row_is_the_same_alone_or_in_any_slot():
    model = sharpen(build_tiny_target("hybrid", vocab_size=64, seed=2))
    prompts = mixed_prompts(64, num_rows=5, seed=2)
    engine = SlotEngine(model, num_slots=2)
    together = run(engine, prompts, {63}, SAMPLED)
    alone = [
        engine.generate([p], [100 + i], max_new_tokens=24, stop_ids={63}, pad_id=0, sampling=SAMPLED)[0]
        for i, p in enumerate(prompts)
    ]
    assert together == alone
    other_key = engine.generate(
        prompts[:1], [7], max_new_tokens=24, stop_ids={63}, pad_id=0, sampling=SAMPLED
    )
    assert other_key[0] != alone[0]


class Planted(torch.nn.Module):
    """A target whose decode steps get a planted off-by-one (``where``): the comparison must see it."""

    def __init__(self, model: torch.nn.Module, where: str):
        super().__init__()
        self.inner, self.where, self.config = model, where, model.config

    def forward(self, input_ids, position_ids=None, attention_mask=None, **kwargs):
        # The engine's decode step: one token, a 4D mask (or one per layer type); a prefill's is 2D.
        decoding = input_ids.shape[1] == 1 and (isinstance(attention_mask, dict) or attention_mask.ndim == 4)
        if decoding and self.where == "positions":
            position_ids = position_ids + 1
        if decoding and self.where == "mask":  # one more (stale) cache index visible
            per_type = (
                attention_mask if isinstance(attention_mask, dict) else {"full_attention": attention_mask}
            )
            bias = per_type["full_attention"]
            visible = bias == 0
            visible[..., 1:] |= visible[..., :-1].clone()
            per_type["full_attention"] = torch.where(visible, 0.0, torch.finfo(bias.dtype).min)
            attention_mask = per_type if isinstance(attention_mask, dict) else per_type["full_attention"]
        return self.inner(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, **kwargs
        )


@pytest.mark.parametrize("where", ["positions", "cache-index", "mask"])
def test_a_planted_off_by_one_breaks_the_comparison(monkeypatch, target, where):
    prompts = mixed_prompts(target.config.vocab_size)
    stops = stop_ids_for(target, prompts)
    want = run(PaddedEngine(target, num_slots=len(prompts)), prompts, stops, GREEDY)
    if where == "cache-index":
        real_update = SlotAttentionLayer.update

        def shifted(self, key_states, value_states, *args, **kwargs):
            self.write_positions += 1
            try:
                return real_update(self, key_states, value_states, *args, **kwargs)
            finally:
                self.write_positions -= 1

        monkeypatch.setattr(SlotAttentionLayer, "update", shifted)
        model = target
    else:
        model = Planted(target, where)
    got = run(SlotEngine(model, num_slots=3), prompts, stops, GREEDY)
    assert got != want


def test_progress_counts_rows_and_tokens():
    model = sharpen(build_tiny_target("qwen3", vocab_size=64, seed=1))
    prompts = mixed_prompts(64)
    calls = []
    got = SlotEngine(model, num_slots=4).generate(
        prompts, list(range(9)), max_new_tokens=12, stop_ids={5, 7}, pad_id=0, sampling=GREEDY,
        on_rows=lambda rows, tokens: calls.append((rows, tokens)),
    )  # fmt: skip
    assert sum(r for r, _ in calls) == 9 and len(calls) > 1
    assert sum(t for _, t in calls) == sum(len(g.token_ids) + g.finished for g in got)


def test_models_the_slot_engine_cannot_run_fall_back_to_the_padded_engine():
    model = build_tiny_target("qwen3", vocab_size=64, seed=1)
    assert slot_engine_problem(model) is None
    model.config.layer_types = ["sliding_attention"] * model.config.num_hidden_layers
    assert "sliding_attention" in slot_engine_problem(model)
    with pytest.warns(UserWarning, match="padded-batch engine"):
        assert isinstance(build_generator(model, num_slots=2), PaddedEngine)
    with pytest.raises(ValueError, match="cannot run this model"):
        build_generator(model, num_slots=2, engine="slots")
    with pytest.raises(ValueError, match="use auto, slots or padded"):
        build_generator(model, num_slots=2, engine="vllm")


def test_bad_requests_are_refused():
    model = build_tiny_target("qwen3", vocab_size=64, seed=1)
    engine = SlotEngine(model, num_slots=2)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        engine.generate([[1]], [0], max_new_tokens=0, stop_ids=set(), pad_id=0, sampling=GREEDY)
    with pytest.raises(ValueError, match="non-empty prompts"):
        engine.generate([[1], []], [0, 1], max_new_tokens=2, stop_ids=set(), pad_id=0, sampling=GREEDY)
    with pytest.raises(ValueError, match="num_slots=0"):
        SlotEngine(model, num_slots=0)


def test_prefill_groups_respect_the_token_budget():
    assert generation.prefill_groups([10, 8, 8, 3], 19) == [[0], [1, 2], [3]]
    assert generation.prefill_groups([50], 20) == [[0]]  # a long prompt still gets a group


@pytest.mark.gpu
@pytest.mark.parametrize("decode_attention", ["flex", "grouped"])
@pytest.mark.parametrize("kind", ["qwen3", "hybrid"])
def test_cuda_graphs_replay_exactly_what_eager_steps_compute(kind, decode_attention):
    """fp32 on CUDA: the graphed decode step (refills, several calls and settings; grouped: several kv
    buckets) gives the eager step's and the padded engine's tokens, with either decode attention."""
    model = sharpen(build_tiny_target(kind, vocab_size=64, seed=1)).cuda()
    prompts = mixed_prompts(64, num_rows=24, seed=3)
    stops = stop_ids_for(model, prompts)
    options = {"num_slots": 5, "kv_bucket": 16, "decode_attention": decode_attention, "compile_decode": False}
    # the eager step's graphs: the compiled step's are tests/test_compiled_step.py's
    graphed = SlotEngine(model, use_cuda_graphs=True, **options)
    eager = SlotEngine(model, use_cuda_graphs=False, **options)
    for sampling in (GREEDY, SAMPLED, GREEDY, SAMPLED):
        want = run(PaddedEngine(model, num_slots=24), prompts, stops, sampling, 40)
        assert run(graphed, prompts, stops, sampling, 40) == run(eager, prompts, stops, sampling, 40) == want
    # flex attends the whole capacity (live blocks only): one graph per setting; grouped, one per bucket
    assert len(graphed.graphs) >= (2 if decode_attention == "flex" else 3)


@pytest.mark.slow
def test_the_builtin_demo_target_when_it_is_built():
    from transformers import AutoModelForCausalLM

    from dflash_train.demo import target_build

    python = f"py{sys.version_info.major}.{sys.version_info.minor}"
    path = target_build.default_cache_dir() / f"demo-target-{target_build.CACHE_VERSION}-{python}"
    if not (path / "build_info.json").exists():
        pytest.skip(f"the demo target is not built at {path} (dflash-train demo builds it)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = mixed_prompts(model.config.vocab_size, num_rows=12)
    stops = {model.config.eos_token_id}
    want = run(PaddedEngine(model, num_slots=12), prompts, stops, GREEDY, 48)
    assert run(SlotEngine(model, num_slots=5), prompts, stops, GREEDY, 48) == want


@pytest.mark.parametrize("kind, sampling", [("qwen3", GREEDY), ("hybrid", SAMPLED)], ids=["qwen3", "hybrid"])
def test_the_compiled_step_gives_the_padded_engines_tokens(kind, sampling):
    """``compile_decode``: the forward and draw under torch.compile (fp32, CPU inductor) over several kv
    buckets (one dynamic compilation serves them all: tests/test_compiled_step.py), token for token
    against the padded engine."""
    torch._dynamo.reset()
    model = sharpen(build_tiny_target(kind, vocab_size=64, seed=1))
    prompts = mixed_prompts(64, num_rows=9, seed=2)
    stops = stop_ids_for(model, prompts)
    engine = SlotEngine(model, num_slots=3, kv_bucket=8, compile_decode=True)
    buckets, decode = set(), engine.decode
    engine.decode = lambda spec: (buckets.add(spec.kv_length), decode(spec))
    want = run(PaddedEngine(model, num_slots=9), prompts, stops, sampling, 30)
    assert run(engine, prompts, stops, sampling, 30) == want
    assert engine.step_body.num_compiles == 1 and len(buckets) >= 3


def test_a_grown_cache_counts_the_allocators_unused_blocks_as_free(monkeypatch):
    """Growing the slot cache drops the old one first; its blocks stay reserved by PyTorch's allocator
    (which hands them back before failing), so the fit check must count them: on an H200, regen's
    cache of 2,048 slots grown from 1,536 to 1,792 tokens was refused with 68.9 GiB "free" while the
    old cache's ~70 GiB sat unused in the allocator."""
    from types import SimpleNamespace

    from dflash_train.generate import slot_cache

    layer = SimpleNamespace(keys=torch.zeros(1, 2, 8, 4))  # 2 heads x 4 dims, float32: 64 bytes per token
    prefill = SimpleNamespace(layers=[layer])
    need = 16 * 1024 * 64  # 16 slots x 1,024 tokens: 1 MiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (need // 2, 4 * need))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: need // 4)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: need // 4 + need)
    slot_cache.check_free_memory(prefill, 16, 1024, torch.device("cuda"))  # 1.5 MiB usable: fits
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: need // 4)
    with pytest.raises(ValueError, match=r"16 slots x 1024 tokens"):
        slot_cache.check_free_memory(prefill, 16, 1024, torch.device("cuda"))
