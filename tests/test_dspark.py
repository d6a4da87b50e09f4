"""DSpark: the Markov head's semi-autoregressive drafting and the DSpark objective (CE + TV +
confidence BCE) pinned against slow references written here; every block slot is scored against
the token after it; the export is the layout DeepSpec writes and SGLang / vLLM / llama.cpp read."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_train.config import DrafterConfig, load_config
from dflash_train.models import presets
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.models.drafter_config import DFlashDraftConfig
from dflash_train.models.export import load_drafter, save_drafter
from dflash_train.models.serving import serving_flags
from dflash_train.train.loss import (
    block_targets,
    denominator_weights,
    draft_loss,
    loss_weights,
    teacher_block_hidden,
)
from dflash_train.train.loss_options import LossOptions
from tests.variant_helpers import golden_block_batch

VOCAB, MASK_ID, BLOCK = 320, 300, 4
R, L = 2, 40

pytestmark = pytest.mark.usefixtures("one_thread_module")


def make_drafter(seed: int = 0, **overrides) -> DFlashDrafter:
    config = presets.resolve_drafter_config(
        DrafterConfig(preset="tiny", block_size=BLOCK, variant="dspark", **overrides),
        presets.tiny_hybrid_target_config(vocab_size=VOCAB),
        target_layer_ids=[0, 2],
        mask_token_id=MASK_ID,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config)
    with torch.no_grad():  # a Markov bias on the scale of the logits, so it decides drafts
        drafter.markov_head.markov_w1.weight.mul_(60.0)
        drafter.markov_head.markov_w2.weight.mul_(10.0)
    return drafter


@pytest.fixture(scope="module")
def batch():
    anchors = [[1, 5, 6, 13, 22, 30, 35, 36], [0, 2, 9, 17, 18, 26, 33, 38]]
    features, ids, anchors, embed, lm_head, gen = golden_block_batch(anchors, R, L, VOCAB, MASK_ID)
    final_hidden = torch.randn(R, L, 64, generator=gen)
    return features, ids, anchors, embed, lm_head, final_hidden


# ----------------------------------------------------------------------------- drafting


def reference_chain(markov, logits, anchors):
    """Slot by slot: the argmax over the vocabulary of logits + w2 @ w1[previous draft]."""
    w1, w2 = markov.markov_w1.weight.double(), markov.markov_w2.weight.double()
    drafts = []
    for m in range(logits.shape[0]):
        previous, row = int(anchors[m]), []
        for k in range(logits.shape[1]):
            scores = [float(logits[m, k, v]) + float(w2[v] @ w1[previous]) for v in range(logits.shape[2])]
            previous = max(range(len(scores)), key=lambda v: (scores[v], -v))
            row.append(previous)
        drafts.append(row)
    return torch.tensor(drafts)


def test_markov_chain_drafts_every_slot_and_equals_the_reference(batch):
    lm_head = batch[4]
    drafter = make_drafter()
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(6, BLOCK, 64, generator=gen)
    anchors = torch.randint(0, VOCAB, (6,), generator=gen)
    with torch.no_grad():
        drafts = drafter.draft_tokens(hidden, anchors, lm_head)
        logits = lm_head(hidden).double()  # every slot, the anchor's included
        want = reference_chain(drafter.markov_head, logits, anchors)
    assert drafts.shape == (6, BLOCK) and torch.equal(drafts, want)
    assert not torch.equal(drafts, logits.argmax(-1))  # the Markov head decides somewhere


def test_every_slot_is_scored_against_the_token_after_it(batch):
    """DeepSpec's convention: slot k of the block at anchor a predicts ids[a+k+1], so the labels are
    ``block_targets`` over B + 1 positions and the Markov head's previous token is ids[a+k]."""
    features, ids, anchors, embed, *_ = batch
    drafter = make_drafter()
    keep = torch.ones_like(anchors, dtype=torch.bool)
    with torch.no_grad():
        hidden = drafter(features, ids, anchors, keep, embed)
        out = drafter(features, ids, anchors, keep, embed, heads=True)
    assert drafter.config.num_draft_tokens == BLOCK and drafter.config.num_verify_tokens == BLOCK + 1
    torch.testing.assert_close(out.hidden, hidden)  # slot 0 (the anchor) included
    labels, _ = block_targets(ids, torch.ones_like(ids, dtype=torch.bool), anchors, BLOCK + 1)
    assert torch.equal(labels[0, 0], ids[0, 2:6])  # anchor 1: ids[2..5]
    previous = ids.gather(1, (anchors[..., None] + torch.arange(BLOCK)).clamp(max=L - 1).flatten(1))
    torch.testing.assert_close(out.markov_latent, drafter.markov_head.markov_w1(previous.view(R, -1, BLOCK)))


# ----------------------------------------------------------------------------- the objective


def reference_dspark_loss(drafter, out, weight, labels, valid, keep, teacher, gamma, denom, options):
    """DeepSpec's objective with whole [N, V] logits and plain autograd."""
    hidden = out.hidden.reshape(-1, out.hidden.shape[-1])
    logits = hidden @ weight.t() + out.markov_latent.reshape(hidden.shape[0], -1) @ out.markov_table.t()
    w = loss_weights(keep, valid, gamma).to(logits.dtype).reshape(-1)
    live = (valid & keep[..., None]).reshape(-1)
    ce = torch.nn.functional.cross_entropy(logits, labels.reshape(-1), reduction="none")
    probs, target = logits.softmax(-1), (teacher.reshape(hidden.shape[0], -1) @ weight.t()).softmax(-1)
    tv = (probs - target).abs().sum(-1)
    accept = (1 - 0.5 * tv).clamp(0, 1).detach()
    bce = torch.nn.functional.binary_cross_entropy_with_logits(
        out.confidence.reshape(-1), accept, reduction="none"
    )
    per_token = options.ce_weight * ce + options.tv_weight * tv + options.confidence_weight * bce
    return (w * per_token)[live].sum() / denom


@pytest.mark.parametrize("chunk_tokens", [3, 2048])
def test_chunked_dspark_loss_gradients_equal_the_reference(batch, chunk_tokens):
    """Every parameter's gradient of the one-pass chunked loss (Markov-biased CE and TV to the target,
    the confidence BCE) equals plain autograd over whole logits, in float64."""
    features, ids, anchors, embed, lm_head, final_hidden = batch
    drafter = make_drafter().double()
    keep = torch.ones_like(anchors, dtype=torch.bool)
    keep[1, -1] = False
    mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)) > 0.2
    labels, valid = block_targets(ids, mask, anchors, BLOCK + 1)
    teacher = teacher_block_hidden(final_hidden.double(), anchors, BLOCK + 1)
    options = LossOptions(ce_weight=0.1, tv_weight=0.9, confidence_weight=1.0)
    denom = denominator_weights(keep, valid, 3.0, options).sum().double()
    embed64, weight = torch.nn.Embedding.from_pretrained(embed.weight.double()), lm_head.weight.double()

    def grads(loss_fn):
        drafter.zero_grad()
        out = drafter(features.double(), ids, anchors, keep, embed64, "sdpa", 3, heads=True)
        loss_fn(out).backward()
        return {n: p.grad.clone() for n, p in drafter.named_parameters()}

    got = grads(lambda out: draft_loss(out, weight, labels, valid, keep, gamma=3.0, denom=denom,
                                       chunk_tokens=chunk_tokens, options=options, teacher_hidden=teacher)[0])  # fmt: skip
    want = grads(
        lambda out: reference_dspark_loss(
            drafter, out, weight, labels, valid, keep, teacher, 3.0, denom, options
        )
    )
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)
    for name in (
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "confidence_head.proj.weight",
    ):
        assert want[name].abs().sum() > 0, name


def test_a_weight_zero_slot_with_non_finite_logits_changes_nothing(batch):
    from dflash_train.train.variant_terms import total_variation_term

    gen = torch.Generator().manual_seed(6)
    logits, teacher = torch.randn(4, 30, generator=gen), torch.randn(4, 30, generator=gen)
    weights = torch.tensor([1.0, 0.0, 0.5, 2.0])
    clean = torch.zeros(4, 30)
    loss, accept = total_variation_term(
        logits, logits.logsumexp(-1), teacher, weights, torch.tensor(1.0), clean
    )
    logits[1] = float("nan")
    dirty = torch.zeros(4, 30)
    again, _ = total_variation_term(logits, logits.logsumexp(-1), teacher, weights, torch.tensor(1.0), dirty)
    torch.testing.assert_close(again, loss)
    assert torch.equal(dirty, clean) and ((accept >= 0) & (accept <= 1)).all()


def test_training_scores_only_a_blocks_contiguous_valid_prefix(batch):
    """As DeepSpec: a slot after an unscored one (a prompt token inside the block) is not scored,
    even where its own label is a response token."""
    from types import SimpleNamespace

    from dflash_train.train.parallel import DistInfo
    from dflash_train.train.step import prepare_micro_batch

    ids = batch[1][:1]
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    loss_mask[0, 12] = False  # a user turn of one token in the middle of the row
    rows = SimpleNamespace(input_ids=ids, loss_mask=loss_mask, attention_mask=torch.ones_like(loss_mask),
                           sample_index=torch.tensor([0]))  # fmt: skip
    cfg = load_config("tiny-cpu", ["target.path=x", "drafter.variant=dspark", "train.num_anchors=40"])
    run = SimpleNamespace(cfg=cfg, info=DistInfo(0, 1, 0, torch.device("cpu")), draft_config=make_drafter().config,
                          gamma=cfg.loss_gamma)  # fmt: skip
    m = prepare_micro_batch(run, rows, 0)
    valid, anchors = m["label_valid"][0], m["anchors"][0]
    assert torch.equal(valid, valid.long().cumprod(-1).bool())
    before_gap = (
        (anchors < 11) & (anchors + BLOCK > 12) & m["keep"][0]
    )  # blocks whose labels cross position 12
    assert before_gap.any() and not valid[before_gap, -1].any()


# ----------------------------------------------------------------------------- export and serving


def test_export_roundtrip_writes_the_dspark_layout(batch, tmp_path):
    features, ids, anchors, embed, lm_head, _ = batch
    drafter = make_drafter()
    out = save_drafter(drafter, drafter.config, tmp_path / "export", dtype="float32")
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3DSparkModel"] and raw["sample_from_anchor"] is True
    expected = {"markov_rank": 256, "markov_head_type": "vanilla", "enable_confidence_head": True,
                "confidence_head_with_markov": True}  # fmt: skip
    assert {k: raw[k] for k in expected} == expected  # DeepSpec's top-level fields
    assert {k: raw["dflash_config"][k] for k in expected} == expected and raw["dflash_config"][
        "projector_type"
    ] == "dspark"
    assert (
        raw["target_layer_ids"] == [0, 2] and raw["mask_token_id"] == MASK_ID and raw["block_size"] == BLOCK
    )
    loaded, config = load_drafter(out)
    assert config == drafter.config
    names = set(loaded.state_dict())
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias"} <= names  # fmt: skip
    assert not any("embed" in n or "lm_head" in n for n in names)
    keep = torch.ones_like(anchors, dtype=torch.bool)
    with torch.no_grad():
        a, b = drafter(features, ids, anchors, keep, embed), loaded(features, ids, anchors, keep, embed)
        first = ids.gather(1, anchors).flatten()
        assert torch.equal(
            drafter.draft_tokens(a.flatten(0, 1), first, lm_head),
            loaded.draft_tokens(b.flatten(0, 1), first, lm_head),
        )


def test_a_deepspec_config_reads_and_other_conventions_are_refused():
    """DeepSpec writes the DSpark fields at the top level (no dflash_config); the speculators
    convention (sample_from_anchor false) and the gated / rnn Markov heads are refused."""
    raw = make_drafter().config.to_serving_dict()
    deepspec = {k: v for k, v in raw.items() if k not in ("dflash_config", "sample_from_anchor")}
    deepspec["architectures"] = ["DSparkDraftModel"]
    assert DFlashDraftConfig.from_serving_dict(deepspec) == make_drafter().config
    with pytest.raises(NotImplementedError, match="sample_from_anchor=false"):
        DFlashDraftConfig.from_serving_dict({**deepspec, "sample_from_anchor": False})
    with pytest.raises(NotImplementedError, match="'gated'"):
        DFlashDraftConfig.from_serving_dict({**deepspec, "markov_head_type": "gated"})
    with pytest.raises(ValueError, match="not a drafter this project loads"):
        DFlashDraftConfig.from_serving_dict({**deepspec, "architectures": ["LlamaForCausalLM"]})


def test_serving_flags_draft_every_slot(tmp_path):
    flags = serving_flags(make_drafter().config, tmp_path, "TARGET")
    assert "--speculative-algorithm DSPARK" in flags["sglang"]
    assert f"--speculative-num-draft-tokens {BLOCK + 1}" in flags["sglang"]
    assert '"method": "dspark"' in flags["vllm"] and f'"num_speculative_tokens": {BLOCK}' in flags["vllm"]
    assert flags["vllm"].startswith("VLLM_USE_V2_MODEL_RUNNER=1 ")
    assert f"--spec-type draft-dspark --spec-draft-n-max {BLOCK}" in flags["llama_cpp"]


def test_qwen36_27b_dspark_serving_layout():
    config = presets.resolve_drafter_config(
        DrafterConfig(preset="qwen3.6-27b", variant="dspark"), presets.qwen36_27b_target_config()
    )
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in DFlashDrafter(config).state_dict().items()}
    assert shapes["markov_head.markov_w1.weight"] == (248320, 256)
    assert shapes["markov_head.markov_w2.weight"] == (248320, 256)
    assert shapes["confidence_head.proj.weight"] == (1, 5120 + 256) and shapes[
        "confidence_head.proj.bias"
    ] == (1,)


# ----------------------------------------------------------------------------- config


def test_dspark_settings_are_checked():
    with pytest.raises(ValueError, match="drafter.markov_rank"):
        DrafterConfig(variant="dflash2", markov_rank=64)
    with pytest.raises(ValueError, match="dspark_ce_weight"):
        DrafterConfig(variant="dspark", dspark_ce_weight=0.0, dspark_tv_weight=0.0)
    with pytest.raises(NotImplementedError, match="train.placement=colocated"):
        load_config("tiny-cpu", ["drafter.variant=dspark", "train.placement=split", "train.target_ranks=1"])
    # Without the teacher terms split placement is allowed (features only).
    load_config("tiny-cpu", ["drafter.variant=dspark", "drafter.dspark_tv_weight=0", "drafter.confidence_head=false",
                             "train.placement=split", "train.target_ranks=1"])  # fmt: skip
    options = LossOptions.from_train_config(load_config("tiny-cpu", ["drafter.variant=dspark"]).train,
                                            DrafterConfig(variant="dspark"))  # fmt: skip
    assert (options.ce_weight, options.tv_weight, options.confidence_weight, options.needs_teacher) == (
        0.1,
        0.9,
        1.0,
        True,
    )
