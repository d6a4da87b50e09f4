"""Loss options (train.loss ce | kl | ce+kl, train.kl_topk, train.loss_weighting decay | dpace) against
naive full-vocabulary fp64 references written straight from their definitions (docs/training.md)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
from torch import Tensor

from dflash_train.train import loss as loss_mod
from dflash_train.train.loss import (
    LossOptions,
    denominator_weights,
    dflash_loss,
    teacher_block_hidden,
)
from dflash_train.train.loss_terms import dpace_weights

GAMMA = 7.0
OPTIONS = {
    "ce": LossOptions(),
    "kl": LossOptions(loss="kl", kl_weight=0.7),
    "kl-top5": LossOptions(loss="kl", kl_topk=5),
    "ce+kl": LossOptions(loss="ce+kl", kl_weight=0.5),
    "ce+dpace": LossOptions(weighting="dpace", dpace_alpha=0.3),
    "ce+kl-top3+dpace": LossOptions(loss="ce+kl", kl_topk=3, weighting="dpace"),
}


def make_case(seed=0, rows=2, anchors=5, block=5, hidden=12, vocab=40):
    """fp64 tensors: drafter hidden [R,A,B,H], head [V,H], labels/validity [R,A,K], keep, teacher."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, anchors, block, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * 0.5
    labels = torch.randint(0, vocab, (rows, anchors, block - 1), generator=g)
    valid = torch.rand(rows, anchors, block - 1, generator=g) > 0.2
    keep = torch.rand(rows, anchors, generator=g) > 0.3
    teacher = torch.randn(rows, anchors, block - 1, hidden, generator=g, dtype=torch.float64)
    return h.requires_grad_(True), w, labels, valid, keep, teacher


def naive_dpace(q: Tensor, valid: Tensor, alpha: float) -> Tensor:
    """D-PACE weights by explicit loops: w_k = sum_{j>=k, j scored} prod_{i<=j, i scored} s_i."""
    out = torch.zeros_like(q)
    for idx in itertools.product(*(range(n) for n in q.shape[:-1])):
        prefix, running = [], 1.0
        for k in range(q.shape[-1]):
            if valid[idx][k]:
                running *= alpha + (1 - alpha) * float(q[idx][k])
            prefix.append(running if valid[idx][k] else 0.0)
        for k in range(q.shape[-1]):
            out[idx][k] = sum(prefix[k:]) if valid[idx][k] else 0.0
    return out


def naive_loss(h, w, labels, valid, keep, teacher, options: LossOptions, denom) -> Tensor:
    """Full [R,A,K,V] logits in fp64, log-softmax, CE and KL, weights, one global denominator."""
    scored = valid & keep[..., None]
    log_p = torch.log_softmax(h[:, :, 1:] @ w.t(), dim=-1)
    ce = -log_p.gather(-1, labels[..., None]).squeeze(-1)
    if options.weighting == "dpace":
        weights = naive_dpace((-ce).exp().detach(), scored, options.dpace_alpha)
    else:
        k = torch.arange(labels.shape[-1], dtype=torch.float32)  # the decay weights are fp32 by design
        weights = scored.double() * torch.exp(-k / GAMMA).double()
    per_token = options.ce_coef * ce
    if options.uses_kl:
        t_logits = teacher @ w.t()
        if options.kl_topk:
            values, ids = t_logits.topk(options.kl_topk, dim=-1)
            p_t = torch.zeros_like(t_logits).scatter(-1, ids, torch.softmax(values, -1))
        else:
            p_t = torch.softmax(t_logits, -1)
        kl = (torch.xlogy(p_t, p_t) - p_t * log_p).sum(-1)
        per_token = per_token + options.kl_weight * kl
    return (per_token * weights)[scored].sum() / denom


def run_loss(h, w, labels, valid, keep, teacher, options, denom, chunk_tokens=1000):
    return dflash_loss(
        h, w, labels, valid, keep, gamma=GAMMA, denom=denom, chunk_tokens=chunk_tokens,
        options=options, teacher_hidden=teacher,
    )  # fmt: skip


@pytest.mark.parametrize("chunk_tokens", [4, 12, 1000])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_option_equals_the_naive_fp64_reference(name, chunk_tokens):
    options = OPTIONS[name]
    h, w, labels, valid, keep, teacher = make_case()
    denom = denominator_weights(keep, valid, GAMMA, options).sum() * 1.5  # as if other ranks added some
    loss, _ = run_loss(h, w, labels, valid, keep, teacher, options, denom, chunk_tokens)
    (grad,) = torch.autograd.grad(loss * 2.0, h)
    h2 = h.detach().clone().requires_grad_(True)
    ref = naive_loss(h2, w, labels, valid, keep, teacher, options, denom)
    (ref_grad,) = torch.autograd.grad(ref * 2.0, h2)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_kl_against_a_one_hot_teacher_equals_ce(weighting):
    h, _, labels, valid, keep, _ = make_case(hidden=40)
    w = torch.eye(40, dtype=torch.float64)  # logits = hidden: a teacher hidden of 1e3 * onehot is one-hot
    teacher = torch.nn.functional.one_hot(labels, 40).double() * 1e3
    ce_opts, kl_opts = LossOptions(weighting=weighting), LossOptions(loss="kl", weighting=weighting)
    denom = denominator_weights(keep, valid, GAMMA, ce_opts).sum()
    ce, ce_stats = run_loss(h, w, labels, valid, keep, None, ce_opts, denom, chunk_tokens=8)
    kl, kl_stats = run_loss(h, w, labels, valid, keep, teacher, kl_opts, denom, chunk_tokens=8)
    (ce_grad,) = torch.autograd.grad(ce, h)
    (kl_grad,) = torch.autograd.grad(kl, h)
    torch.testing.assert_close(kl, ce, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kl_grad, ce_grad, rtol=1e-12, atol=1e-12)
    # Top-1 KL is one-hot on the teacher's argmax: any teacher whose argmax is the label gives CE.
    soft_teacher = torch.randn(teacher.shape, dtype=torch.float64) + teacher / 1e3 * 10
    top1, _ = run_loss(
        h, w, labels, valid, keep, soft_teacher, LossOptions(loss="kl", kl_topk=1, weighting=weighting), denom
    )
    torch.testing.assert_close(top1, ce, rtol=1e-12, atol=1e-12)
    # Metrics come from the student's logits, whatever the teacher says.
    for key in ce_stats:
        if key != "weight":
            torch.testing.assert_close(kl_stats[key], ce_stats[key])


@pytest.mark.parametrize("name", ["ce", "ce+kl", "ce+dpace", "ce+kl-top3+dpace"])
def test_denominator_is_global_over_micro_batches_and_ranks(name):
    """Rows split into micro-batches (or ranks) with the step's summed denominator give the same
    total loss and the same gradients as one pass over all rows."""
    options = OPTIONS[name]
    h, w, labels, valid, keep, teacher = make_case(rows=4)
    parts = [slice(0, 1), slice(1, 4)]
    denom = sum(denominator_weights(keep[p], valid[p], GAMMA, options).sum() for p in parts)
    whole, _ = run_loss(h, w, labels, valid, keep, teacher, options, denom, chunk_tokens=8)
    (whole_grad,) = torch.autograd.grad(whole, h)
    total, grads = 0.0, []
    for p in parts:
        hp = h[p].detach().clone().requires_grad_(True)
        part, _ = run_loss(hp, w, labels[p], valid[p], keep[p], teacher[p], options, denom, chunk_tokens=8)
        grads.append(torch.autograd.grad(part, hp)[0])
        total = total + part
    torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat(grads), whole_grad, rtol=1e-12, atol=1e-12)


def test_dpace_denominator_counts_kept_blocks():
    keep = torch.tensor([[True, False, True]])
    valid = torch.ones(1, 3, 4, dtype=torch.bool)
    assert denominator_weights(keep, valid, GAMMA, LossOptions(weighting="dpace")).sum() == 2
    decay = denominator_weights(keep, valid, GAMMA, LossOptions()).sum()
    assert float(decay) == pytest.approx(2 * sum(math.exp(-k / GAMMA) for k in range(4)))


def test_dpace_weights_by_hand():
    q = torch.tensor([[1.0, 1.0, 0.0, 0.5]])
    valid = torch.tensor([[True, True, True, True]])
    # alpha 0: s = q, prefix P = [1, 1, 0, 0]; w_k = sum_{j>=k} P_j = [2, 1, 0, 0].
    assert dpace_weights(q, valid, 0.0).tolist() == [[2.0, 1.0, 0.0, 0.0]]
    # alpha 1: every s = 1, so w_k = number of scored positions from k on: a linear decay.
    assert dpace_weights(q, valid, 1.0).tolist() == [[4.0, 3.0, 2.0, 1.0]]
    # An unscored position counts as accepted and carries no weight of its own.
    gap = torch.tensor([[True, False, True, True]])
    # s = [1, (1), 0.5, 0.75], P = [1, -, 0.5, 0.375]
    assert dpace_weights(q, gap, 0.5).tolist() == [[1.0 + 0.5 + 0.375, 0.0, 0.5 + 0.375, 0.375]]
    # The weights shift toward later positions as the drafter grows confident.
    unsure = dpace_weights(torch.full((1, 4), 0.1), valid, 0.5)
    sure = dpace_weights(torch.full((1, 4), 0.9), valid, 0.5)
    assert (sure[0, 1:] / sure[0, 0] > unsure[0, 1:] / unsure[0, 0]).all()


def test_dpace_weights_carry_no_gradient():
    """The loss gradient is w * dCE with w held fixed (the weights are detached estimates)."""
    h, w, labels, valid, keep, _ = make_case()
    options = LossOptions(weighting="dpace")
    denom = torch.tensor(3.0, dtype=torch.float64)
    loss, stats = run_loss(h, w, labels, valid, keep, None, options, denom)
    (grad,) = torch.autograd.grad(loss, h)
    h2 = h.detach().clone().requires_grad_(True)
    log_p = torch.log_softmax(h2[:, :, 1:] @ w.t(), dim=-1)
    ce = -log_p.gather(-1, labels[..., None]).squeeze(-1)
    fixed = naive_dpace((-ce).exp().detach(), valid & keep[..., None], options.dpace_alpha)
    ((ce * fixed).sum() / denom).backward()
    torch.testing.assert_close(grad, h2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(stats["weight"], fixed.sum().float().to(stats["weight"].dtype))


def test_teacher_of_block_position_k_is_the_target_output_before_the_label():
    final_hidden = torch.arange(10.0)[None, :, None].expand(1, 10, 2)  # value = position
    anchors = torch.tensor([[2, 7]])
    got = teacher_block_hidden(final_hidden, anchors, block_size=4)[..., 0]
    # Block position k (label ids[a+k]) is predicted by the target at a+k-1; clamped past the row.
    assert got.tolist() == [[[2.0, 3.0, 4.0], [7.0, 8.0, 9.0]]]


def test_student_head_runs_once_per_chunk_with_a_teacher(monkeypatch):
    calls = {"student": [], "teacher": []}
    real = loss_mod.lm_head_logits
    monkeypatch.setattr(
        loss_mod, "lm_head_logits", lambda h, w: calls["student"].append(h.shape[0]) or real(h, w)
    )
    monkeypatch.setattr(
        loss_mod, "teacher_logits", lambda h, w: calls["teacher"].append(h.shape[0]) or real(h, w)
    )
    h, w, labels, valid, keep, teacher = make_case(rows=2, anchors=5, block=4)  # 30 scored tokens
    loss, _ = run_loss(
        h, w, labels, valid, keep, teacher, OPTIONS["ce+kl"], torch.tensor(10.0), chunk_tokens=9
    )
    loss.backward()
    assert calls == {"student": [9, 9, 9, 3], "teacher": [9, 9, 9, 3]}


def test_kl_needs_the_teacher_and_a_topk_within_the_vocabulary():
    h, w, labels, valid, keep, teacher = make_case()
    with pytest.raises(ValueError, match="teacher hidden states"):
        run_loss(h, w, labels, valid, keep, None, OPTIONS["kl"], torch.tensor(1.0))
    with pytest.raises(ValueError, match="kl_topk=41 exceeds the vocabulary"):
        run_loss(h, w, labels, valid, keep, teacher, LossOptions(loss="kl", kl_topk=41), torch.tensor(1.0))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["ce+kl-top3+dpace", "kl"])
def test_compiled_terms_match_eager_on_cuda(name):
    h, w, labels, valid, keep, teacher = (
        t.cuda() for t in make_case(rows=3, anchors=20, block=8, vocab=3000)
    )
    h, w, teacher = (t.float() for t in (h.detach(), w, teacher))
    h.requires_grad_(True)
    options, denom = OPTIONS[name], torch.tensor(50.0, device="cuda")
    results = []
    for fused in (False, True):
        loss, stats = dflash_loss(
            h, w, labels, valid, keep, gamma=GAMMA, denom=denom, chunk_tokens=50, fused=fused,
            options=options, teacher_hidden=teacher,
        )  # fmt: skip
        results.append((loss, torch.autograd.grad(loss, h)[0], stats["top1"], stats["weight"]))
    for eager, fused in zip(results[0], results[1], strict=True):
        torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- the teacher


@pytest.mark.parametrize("fixture", ["tiny_hybrid_dir", "tiny_qwen3_dir"])
def test_teacher_hidden_is_the_final_norm_output_that_gives_the_target_logits(request, fixture):
    from dflash_train.config import TargetConfig
    from dflash_train.models.target import load_target

    target = load_target(
        TargetConfig(path=str(request.getfixturevalue(fixture)), dtype="float32", target_layer_ids=[0, 1]),
        "cpu",
    )
    ids = torch.randint(0, target.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    truncated = target.features(ids)
    with torch.no_grad():  # a non-trivial final norm, so a pre-norm teacher cannot pass
        target.decoder.norm.weight.add_(
            torch.rand(target.hidden_size, generator=torch.Generator().manual_seed(1))
        )
        logits = target.model(input_ids=ids).logits
    features, final_hidden = target.features(ids, with_final_hidden=True)
    torch.testing.assert_close(features, truncated)  # the features do not depend on the depth run
    torch.testing.assert_close(final_hidden @ target.lm_head.weight.t(), logits, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        target.decoder.norm.weight.mul_(0.5)
    _, renormed = target.features(ids, with_final_hidden=True)
    assert not torch.allclose(renormed, final_hidden)


def test_a_target_built_only_to_its_feature_layers_refuses_to_be_a_teacher():
    from dflash_train.config import TargetConfig
    from dflash_train.models.target import load_target

    cfg = TargetConfig(path="preset:tiny-hybrid", dtype="float32", target_layer_ids=[0, 1])
    target = load_target(cfg, "cpu", truncate_unused_layers=True)
    ids = torch.zeros(1, 4, dtype=torch.long)
    assert target.features(ids).shape[0] == 1  # features still work
    with pytest.raises(ValueError, match="needs the final layers"):
        target.features(ids, with_final_hidden=True)


# ----------------------------------------------------------------------------- config and trainer


@pytest.mark.parametrize(
    "override,error,match",
    [
        ("train.loss=mse", ValueError, r"use one of \['ce', 'kl', 'ce\+kl'\]"),
        ("train.loss_weighting=focal", ValueError, r"\['decay', 'dpace'\]"),
        ("train.kl_topk=-1", ValueError, "train.kl_topk=-1"),
        ("train.dpace_alpha=1.5", ValueError, r"train.dpace_alpha=1.5: use a value in \[0, 1\]"),
    ],
)
def test_bad_loss_options_are_refused_with_a_remedy(override, error, match):
    from dflash_train.config import load_config

    with pytest.raises(error, match=match):
        load_config("tiny-cpu", ["output_dir=/tmp/x", override])


def test_kl_needs_a_positive_weight_and_colocated_placement():
    from dflash_train.config import load_config

    with pytest.raises(ValueError, match="kl_weight=0.0 with train.loss=ce\\+kl"):
        load_config("tiny-cpu", ["output_dir=/tmp/x", "train.loss=ce+kl", "train.kl_weight=0"])
    load_config("tiny-cpu", ["output_dir=/tmp/x", "train.kl_weight=0"])  # unused without KL: fine
    with pytest.raises(NotImplementedError, match="placement=colocated for a KL loss"):
        load_config(
            "tiny-cpu",
            ["output_dir=/tmp/x", "train.loss=kl", "train.placement=split", "train.target_ranks=1"],
        )


def test_training_with_kl_runs_the_target_to_full_depth_and_dpace_trains(train_task, tmp_path, monkeypatch):
    from dflash_train.models.target import FrozenTarget
    from dflash_train.train.trainer import train
    from tests.train_helpers import logged_losses, tiny_config

    calls = []
    real = FrozenTarget.features
    monkeypatch.setattr(
        FrozenTarget,
        "features",
        lambda self, *a, **kw: calls.append(kw.get("with_final_hidden")) or real(self, *a, **kw),
    )
    steps = ["train.max_steps=3", "checkpoint.every_steps=100"]
    losses = {}
    for name, extra in {
        "ce": [],
        "kl": ["train.loss=kl"],
        "ce+kl+dpace": ["train.loss=ce+kl", "train.kl_topk=8", "train.loss_weighting=dpace"],
    }.items():
        calls.clear()
        train(tiny_config(train_task, tmp_path / name, *steps, *extra))
        losses[name] = logged_losses(tmp_path / name)
        assert all(math.isfinite(v) for v in losses[name].values())
        assert calls and all(calls) == ("kl" in name) and any(calls) == ("kl" in name)
    assert losses["kl"][1] != losses["ce"][1] != losses["ce+kl+dpace"][1]


@pytest.mark.parametrize("drafter_only", [False, True])
def test_bench_measures_the_kl_teacher(drafter_only):
    """``dflash-train bench --loss kl`` builds the whole target and counts the teacher's work."""
    from dflash_train.cli import build_parser

    base = ["bench", "--preset", "tiny", "--steps", "1", "--warmup", "0", "--device", "cpu"]
    base += ["--drafter-only"] if drafter_only else []
    results = {}
    for loss in ("ce", "kl"):
        args = build_parser().parse_args([*base, "--loss", loss])
        results[loss] = args.handler(args)
    assert results["kl"]["objective"] == "kl" and math.isfinite(results["kl"]["loss"])
    assert results["kl"]["loss"] != results["ce"]["loss"]
    if not drafter_only:
        assert results["kl"]["tflop_per_step"] > results["ce"]["tflop_per_step"]


def test_a_loss_setting_the_chosen_options_ignore_warns():
    from dflash_train.config import load_config

    with pytest.warns(UserWarning, match="train.gamma set but unused"):
        load_config("tiny-cpu", ["output_dir=/tmp/x", "train.loss_weighting=dpace", "train.gamma=5"])
    with pytest.warns(UserWarning, match="train.kl_topk set but unused with train.loss=ce"):
        load_config("tiny-cpu", ["output_dir=/tmp/x", "train.kl_topk=8"])


def test_resume_refuses_a_changed_objective_unless_allowed():
    from dflash_train.config import load_config
    from dflash_train.train.resume_check import check_resume_compatible

    saved = load_config("tiny-cpu", ["output_dir=/tmp/x"]).to_dict()
    now = load_config(
        "tiny-cpu", ["output_dir=/tmp/x", "train.loss=ce+kl", "train.loss_weighting=dpace"]
    ).to_dict()
    with pytest.raises(
        ValueError, match="train.loss: checkpoint 'ce' -> now 'ce\\+kl'.*train.loss_weighting"
    ):
        check_resume_compatible(saved, now, [])
    check_resume_compatible(saved, now, ["train.loss", "train.loss_weighting"])  # e.g. KL fine-tuning


LOSS_OVERRIDES = ("train.loss=ce+kl", "train.kl_topk=8", "train.loss_weighting=dpace")


def two_rank_options_worker(rank: int, port: int, task: dict, out_dir: str, grads_path: str) -> None:
    from dflash_train.train.trainer import train
    from tests.test_loss_wiring import gradient_saver
    from tests.train_helpers import become_rank, tiny_config

    become_rank(rank, 2, port)
    cfg = tiny_config(task, out_dir, "train.max_steps=1", "train.parallel=ddp", *LOSS_OVERRIDES)
    train(cfg, gradient_saver(Path(grads_path)))


def test_kl_and_dpace_are_normalised_over_ranks_like_one_process(train_task, tmp_path, monkeypatch):
    """ce+kl with D-PACE weights: a 2-rank step and one process stepping over the same global
    batch (grad_accum=2) give the same loss and the same gradients."""
    import dflash_train.data.loader as loader
    from dflash_train.train.trainer import train
    from tests.test_loss_wiring import BothRanks, first_step_loss, free_port, gradient_saver
    from tests.train_helpers import spawn_ranks, tiny_config

    two = tmp_path / "two"
    args = (free_port(), train_task, str(two), str(tmp_path / "two.pt"))
    spawn_ranks(two_rank_options_worker, args, nprocs=2)
    build = loader.build_train_data

    def both_ranks(cfg, tokenizer, *, seed, rank=0, world_size=1, **kwargs):
        return BothRanks([build(cfg, tokenizer, seed=seed, rank=r, world_size=2, **kwargs) for r in (0, 1)])

    monkeypatch.setattr(loader, "build_train_data", both_ranks)
    one = tmp_path / "one"
    cfg = tiny_config(train_task, one, "train.max_steps=1", "train.grad_accum=2", *LOSS_OVERRIDES)
    train(cfg, gradient_saver(tmp_path / "one.pt"))
    assert first_step_loss(one) == pytest.approx(first_step_loss(two), rel=1e-6)
    grads_one, grads_two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert set(grads_one) == set(grads_two) and grads_one
    for name, grad in grads_one.items():
        torch.testing.assert_close(grads_two[name], grad, rtol=1e-5, atol=1e-8, msg=name)
