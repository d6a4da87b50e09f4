"""Every drafter variant through the whole pipeline on CPU: it trains (one process and two ranks),
and its exact-mode tau equals real decoding with its own drafting procedure (fp32, dynamic and
static engines), so the eval's tau is the tau an engine that runs the procedure serves."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from dflash_train.eval.exact import as_frozen_target, draft_all, exact_acceptance
from dflash_train.eval.generate import greedy_continuations
from dflash_train.eval.runner import evaluate
from dflash_train.models.export import load_drafter
from dflash_train.train.trainer import train
from tests.train_helpers import logged_losses, tiny_config
from tests.variant_helpers import fit_variant_drafter, variant_drafter

VARIANTS = ["dflash2", "dspark"]
ARCHITECTURE = {"dflash2": "DFlash2DraftModel", "dspark": "Qwen3DSparkModel"}
BLOCK, MAX_NEW = 4, 25
GOLDEN = Path(__file__).parent / "golden"
TEXTS = ["def add(a, b): the quick brown fox", "for i in range(10):", "class Point:", "hi", "print(i * i)"]


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_trains_exports_and_reloads(task, tmp_path, variant, one_thread):
    out = tmp_path / "run"
    train(
        tiny_config(
            task, out, f"drafter.variant={variant}", "train.max_steps=30", "checkpoint.every_steps=100"
        )
    )
    losses = logged_losses(out)
    assert sum(losses[s] for s in range(26, 31)) < sum(losses[s] for s in range(1, 6)) - 1.0, losses
    exported = json.loads((out / "export" / "config.json").read_text())
    assert exported["architectures"] == [ARCHITECTURE[variant]]
    drafter, config = load_drafter(out / "export")
    assert config.variant == variant
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["tau"] > 1.0 and len(rows[-1]["acc_by_pos"]) == config.num_draft_tokens
    if variant == "dflash2":
        assert "head_acc_by_pos" in rows[-1]
        assert drafter.candidate_selector.successor_codebook.abs().sum() > 0  # the selector learned
    if variant == "dspark":
        assert 0 <= rows[-1]["confidence_abs_error"] <= 1


@pytest.mark.parametrize("variant", VARIANTS)
def test_golden_losses_of_a_fixed_seed_variant_run(task, tmp_path, variant, one_thread):
    """Per-step losses of a 30-step run of each variant (``test_train``'s golden run with the variant
    on top: its heads, drafting slots and loss terms); a numerics change updates the file on purpose."""
    golden_file = GOLDEN / f"tiny_train_losses_{variant}.json"
    out = tmp_path / "run"
    train(
        tiny_config(
            task, out, f"drafter.variant={variant}", "train.max_steps=30", "checkpoint.every_steps=100"
        )
    )
    losses = [logged_losses(out)[s] for s in range(1, 31)]
    if os.environ.get("DFLASH_UPDATE_GOLDEN"):
        golden_file.write_text(json.dumps({"losses": losses}, indent=1) + "\n")
    golden = json.loads(golden_file.read_text())["losses"]
    # Tight, not bit-exact: CPU kernels differ slightly between instruction sets (AVX2 vs AVX-512).
    assert losses == pytest.approx(golden, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_fsdp_ranks_train_every_variant_head(task, tmp_path, variant):
    """Sharded (FSDP2, gloo) training reaches the heads' weights the loss reads from the forward."""
    from tests.test_train_distributed import run_two_ranks

    extra = [
        f"drafter.variant={variant}",
        "train.parallel=fsdp",
        "train.max_steps=6",
        "checkpoint.every_steps=100",
    ]
    outcomes = run_two_ranks(task, tmp_path / "run", extra, "train", tmp_path)
    assert [o["result"]["step"] for o in outcomes] == [6, 6]
    drafter, _ = load_drafter(tmp_path / "run" / "export")
    torch.manual_seed(0)  # train.seed: the drafter's initial weights
    initial = type(drafter)(drafter.config).state_dict()
    heads = ("candidate_selector", "markov_head", "confidence_head")
    for name, tensor in drafter.state_dict().items():
        if name.startswith(heads):
            assert (tensor.float() - initial[name]).abs().max() > 1e-3, (
                name
            )  # trained, beyond export rounding


# ----------------------------------------------------------------------------- exact eval == decoding


@pytest.fixture(scope="module", params=VARIANTS)
def fitted(request, tokenizer, one_thread_module):
    """(variant, target, prompts, continuations, drafter fitted until its acceptance is partial)."""
    from dflash_train.eval.prompts import encode_prompt
    from dflash_train.tiny import build_tiny_target, sharpen

    model = sharpen(build_tiny_target("qwen3", vocab_size=len(tokenizer)))
    prompts = [encode_prompt(tokenizer, {"prompt": t}, None) for t in TEXTS]
    eos = {tokenizer.eos_token_id}
    continuations = greedy_continuations(
        model, prompts, max_new_tokens=MAX_NEW, eos_token_ids=eos, pad_token_id=0, batch_size=4
    )
    drafter = variant_drafter(model.config, tokenizer.mask_token_id, request.param, BLOCK)
    target = as_frozen_target(model, [0, 2])
    fit_variant_drafter(drafter, target, prompts, continuations, max_new_tokens=MAX_NEW, steps=12, lr=2e-2)
    return request.param, model, prompts, continuations, drafter


@pytest.mark.parametrize("engine", ["dynamic", "static"])
def test_exact_tau_equals_real_decoding_with_the_variants_procedure(fitted, tokenizer, engine):
    variant, model, prompts, continuations, drafter = fitted
    eos = {tokenizer.eos_token_id}
    common = dict(max_new_tokens=MAX_NEW, eos_token_ids=eos, methods=("dflash", "ngram"))
    exact = exact_acceptance(model, drafter, prompts, continuations, **common)
    decoded = evaluate(model, tokenizer, drafter, prompts, decode_engine=engine, **common)
    assert decoded["methods"]["dflash"]["decode_engine"].startswith(
        engine.replace("dynamic", "eager-dynamic")
    )
    for name in ("dflash", "ngram"):
        got, want = exact["methods"][name], decoded["methods"][name]
        assert want["lossless"] is True, name
        assert got["tau"] == pytest.approx(want["tau"], abs=1e-9), name
        assert got["per_request_tau"] == pytest.approx(want["per_request_tau"], abs=1e-9), name
        assert got["per_position_acceptance"] == pytest.approx(want["per_position_acceptance"], abs=1e-9)
        assert got["accept_length_histogram"] == want["accept_length_histogram"], name
    drafts = drafter.config.num_draft_tokens
    assert len(exact["methods"]["dflash"]["per_position_acceptance"]) == drafts
    assert 1.2 < exact["methods"]["dflash"]["tau"] < drafts + 0.5


def test_the_exact_eval_drafts_with_the_variants_procedure(fitted, tokenizer):
    """The eval's drafts are the procedure's (the selector's walk / the Markov chain), which differ
    from the parallel head's argmax at some anchor of the fitted drafter."""
    variant, model, prompts, continuations, drafter = fitted
    target = as_frozen_target(model, [0, 2])
    timings: dict[str, float] = {}
    tables = draft_all(
        target, drafter, prompts, continuations, max_new_tokens=MAX_NEW, eos_token_ids={tokenizer.eos_token_id},
        topk=0, budget=65536, pad_token_id=0, timings=timings,
    )  # fmt: skip
    differ = 0
    for prompt, continuation, table in zip(prompts, continuations, tables, strict=True):
        ids = torch.tensor([[*prompt, *continuation]])
        anchors = len(prompt) + torch.arange(table.tokens.shape[0])[None]
        keep = torch.ones_like(anchors, dtype=torch.bool)
        with torch.no_grad():
            hidden = drafter(target.features(ids), ids, anchors, keep, target.embed_tokens)
            head = target.lm_head(hidden[0, :, drafter.config.first_scored_slot :]).argmax(-1)
        assert torch.equal(table.tokens, drafter.draft_tokens(hidden[0], ids[0, anchors[0]], target.lm_head))
        differ += int((head != table.tokens).any())
    assert differ > 0


# ----------------------------------------------------------------------------- recipes and bench


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_variant_recipe_is_smollm2_with_the_variant_and_trains(tmp_path, variant, one_thread):
    """``smollm2-135m-<variant>``: the smollm2-135m recipe's data, rows, steps and backbone, the
    variant on top; it trains and exports on a tiny stand-in target (small buckets: seconds)."""
    from dflash_train.config import load_config
    from dflash_train.tiny import save_tiny_target
    from tests.train_helpers import write_repeat_task

    cfg, base = (
        load_config(f"smollm2-135m-{variant}", ["target.path=x"]),
        load_config("smollm2-135m", ["target.path=x"]),
    )
    assert (cfg.data, cfg.train, cfg.target) == (base.data, base.train, base.target)
    backbone = ("preset", "num_hidden_layers", "block_size", "mask_token_id", "layer_types", "is_causal")
    assert [getattr(cfg.drafter, k) for k in backbone] == [getattr(base.drafter, k) for k in backbone]
    assert cfg.drafter.variant == variant
    target = save_tiny_target(tmp_path / "target", kind="qwen3")
    data = write_repeat_task(tmp_path / "rows.jsonl", rows=24)
    overrides = [
        f"target.path={target}", f"data.paths=[{data}]", f"data.cache_dir={tmp_path / 'cache'}",
        f"output_dir={tmp_path / 'run'}", "target.dtype=float32", "train.dtype=float32", "train.compile=false",
        "train.attention_backend=sdpa", "train.device=cpu", "train.max_steps=2", "logging.progress_bar=off",
        "data.seq_buckets=[128]", "data.token_budget=256", "train.num_anchors=8",
    ]  # fmt: skip
    assert train(load_config(f"smollm2-135m-{variant}", overrides))["step"] == 2
    exported = json.loads((tmp_path / "run" / "export" / "config.json").read_text())
    assert (
        exported["architectures"] == [ARCHITECTURE[variant]]
        and exported["dflash_config"]["mask_token_id"] == 16
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_bench_times_the_variant(variant, one_thread):
    from dflash_train.bench.train_step import BenchOptions, bench_config, run_bench

    result = run_bench(BenchOptions(preset="tiny", variant=variant, steps=1, warmup=0, progress=False))
    assert result["variant"] == variant and result["step_s"] > 0
    cfg, _, _ = bench_config(BenchOptions(preset="qwen3.6-27b", variant=variant))
    assert cfg.drafter.variant == variant and cfg.drafter.preset == "qwen3.6-27b"


def test_a_block_stops_early_as_llama_cpp_stops_it_or_the_stop_is_refused(fitted, tokenizer):
    """``draft_p_min`` (llama.cpp's --spec-draft-p-min): a DSpark block ends at the first slot whose
    confidence ``sigmoid(proj . [h_k; markov_w1[prev_k]] + b)`` is below it (prev_k the chain's previous
    pick), in the exact eval and in real decoding alike; a variant whose stop is not reproduced refuses it."""
    variant, model, prompts, continuations, drafter = fitted
    if not drafter.config.enable_confidence_head:
        with pytest.raises(NotImplementedError, match="llama.cpp cuts its blocks"):
            drafter.set_draft_p_min(0.5)
        assert drafter.draft_p_min == 0.0
        return
    target = as_frozen_target(model, [0, 2])
    eos = {tokenizer.eos_token_id}
    anchors_of = []
    for prompt, continuation in zip(prompts, continuations, strict=True):
        ids = torch.tensor([[*prompt, *continuation]])
        anchors = len(prompt) + torch.arange(len(continuation) - 1)[None]
        with torch.no_grad():
            hidden = drafter(
                target.features(ids),
                ids,
                anchors,
                torch.ones_like(anchors, dtype=torch.bool),
                target.embed_tokens,
            )[0]
            chain = drafter.draft_tokens(hidden, ids[0, anchors[0]], target.lm_head)  # full blocks
            previous = torch.cat([ids[0, anchors[0]][:, None], chain[:, :-1]], dim=1)
            head = drafter.confidence_head.proj
            features = torch.cat([hidden, drafter.markov_head.markov_w1.weight[previous]], dim=-1)
            confidence = torch.sigmoid(features @ head.weight[0] + head.bias[0])
        anchors_of.append((chain, confidence))
    # A threshold midway between the two middle confidences: at one of them (the median) a value
    # equal to the threshold was cut or kept by the draft's own rounding, not by the rule.
    ordered = torch.cat([c.flatten() for _, c in anchors_of]).sort().values
    middle = ordered.numel() // 2
    assert ordered[middle] - ordered[middle - 1] > 1e-5  # clear of either path's rounding
    p_min = ((ordered[middle - 1] + ordered[middle]) / 2).item()
    try:
        drafter.set_draft_p_min(p_min)
        tables = draft_all(
            target, drafter, prompts, continuations, max_new_tokens=MAX_NEW, eos_token_ids=eos,
            topk=0, budget=65536, pad_token_id=0, timings={},
        )  # fmt: skip
        cut_somewhere = kept_somewhere = False
        for table, (chain, confidence) in zip(tables, anchors_of, strict=True):
            stop = [
                int((row < p_min).nonzero()[0]) if (row < p_min).any() else row.numel() for row in confidence
            ]
            expected = torch.stack(
                [torch.cat([c[:s], c.new_full((c.numel() - s,), -1)]) for c, s in zip(chain, stop)]
            )
            assert torch.equal(table.tokens, expected[: table.tokens.shape[0]])
            cut_somewhere |= min(stop) < chain.shape[1]
            kept_somewhere |= max(stop) > 0
        assert cut_somewhere and kept_somewhere
        common = dict(max_new_tokens=MAX_NEW, eos_token_ids=eos, methods=("dflash",))
        exact = exact_acceptance(model, drafter, prompts, continuations, **common)["methods"]["dflash"]
        for engine in ("dynamic", "static"):
            real = evaluate(model, tokenizer, drafter, prompts, decode_engine=engine, **common)["methods"][
                "dflash"
            ]
            assert real["lossless"] is True
            assert exact["per_request_tau"] == pytest.approx(real["per_request_tau"], abs=1e-9), engine
            # the slots after a cut are not drafted, in the exact eval's counts as in decoding's
            assert exact["per_position_acceptance"] == pytest.approx(real["per_position_acceptance"]), engine
    finally:
        drafter.draft_p_min = 0.0
    full = exact_acceptance(model, drafter, prompts, continuations, **common)["methods"]["dflash"]
    assert exact["tau"] <= full["tau"]


def test_the_diagnosis_scores_no_slot_a_stopped_block_left_undrafted():
    """Blocks stopped after two of three slots (``NO_DRAFT`` in the third): the third position is
    scored by no block, over every anchor as over the rounds; the teacher-forced tau is unchanged."""
    from dflash_train.eval.diagnosis import diagnose_request, summarize_diagnosis
    from dflash_train.eval.simulate import simulate_chain
    from dflash_train.models.variant import NO_DRAFT

    continuation = list(range(10, 18))  # anchors j = 0..6, both drafts right inside the continuation
    padded = [*continuation, 1_000_000, 1_000_000]
    drafts = [[padded[j + 1], padded[j + 2], NO_DRAFT] for j in range(len(continuation) - 1)]
    common = dict(block_size=BLOCK, max_new_tokens=len(continuation), eos_token_ids=set())
    generation = simulate_chain(continuation, lambda out: drafts[out - 1], **common)
    stats = diagnose_request([100], continuation, drafts, generation, ngram_n=3, **common)
    groups = summarize_diagnosis([stats], BLOCK)["groups"]
    assert groups["rounds"]["accuracy_by_pos"] == [1.0, 1.0, None]
    assert groups["anchors"]["accuracy_by_pos"] == [1.0, 1.0, None]
    assert groups["anchors"]["tau"] == pytest.approx((6 * 3 + 2) / 7)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_checkpoint_of_the_older_serving_layout_resumes(task, tmp_path, variant, one_thread):
    """Checkpoints written before an all-full-attention DFlash2 / DSpark export left out ``is_causal``
    hold ``"is_causal": true``: the resume compares the drafters they describe, not the layouts."""
    out = tmp_path / "run"
    common = ("drafter.layer_types=[full_attention,full_attention]", "checkpoint.every_steps=2")
    train(tiny_config(task, out, f"drafter.variant={variant}", "train.max_steps=2", *common))
    saved = out / "checkpoints" / "step-00000002" / "drafter_config.json"
    old_layout = {**json.loads(saved.read_text()), "is_causal": True}
    saved.write_text(json.dumps(old_layout))
    longer = ("train.max_steps=4", "checkpoint.allow_changed=[train.max_steps]")
    assert train(tiny_config(task, out, f"drafter.variant={variant}", *longer, *common))["step"] == 4
