"""DFlash2: the grouped dynamic causal convolution, the candidate selector and its loss, each pinned
against a slow reference written here; the training forward equals the inference block; the export
round-trips in the layout vLLM / llama.cpp read."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_train.config import DrafterConfig
from dflash_train.models import presets
from dflash_train.models.dflash2 import dflash2_layer_step, grouped_causal_conv
from dflash_train.models.drafter import DFlashDrafter, DraftOutput
from dflash_train.models.export import load_drafter, save_drafter
from dflash_train.train.loss import LossOptions, block_targets, denominator_weights, draft_loss, loss_weights
from dflash_train.train.variant_terms import selector_term
from tests.variant_helpers import golden_block_batch

VOCAB, MASK_ID, BLOCK = 320, 300, 4
R, L = 2, 40

pytestmark = pytest.mark.usefixtures("one_thread_module")


def make_drafter(seed: int = 0, variant: str = "dflash2", **overrides) -> DFlashDrafter:
    """Tiny [sliding, full] drafter of block 4 over 2 features; conv and selector non-trivial."""
    config = presets.resolve_drafter_config(
        DrafterConfig(preset="tiny", block_size=BLOCK, variant=variant, **overrides),
        presets.tiny_hybrid_target_config(vocab_size=VOCAB),
        target_layer_ids=[0, 2],
        mask_token_id=MASK_ID,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config)
    with torch.no_grad():  # away from the identity / zero init, so a misplaced term shows
        for name, param in drafter.named_parameters():
            if "conv" in name or "successor" in name or name.endswith("norm.weight"):
                param.add_(0.3 * torch.randn_like(param))
    return drafter


@pytest.fixture(scope="module")
def batch():
    anchors = [[1, 5, 6, 13, 22, 30, 37, 39], [0, 2, 9, 17, 18, 26, 33, 38]]
    features, ids, anchors, embed, lm_head, _ = golden_block_batch(anchors, R, L, VOCAB, MASK_ID)
    return features, ids, anchors, embed, lm_head


# ----------------------------------------------------------------------------- the convolution


def reference_conv(x, dynamic, base, block_size, group_size):
    """y[k] = sum_t (base[t] + dynamic[k, t, group]) * x[k - t], token by token, inside each block."""
    rows, tokens, hidden = x.shape
    out = torch.zeros_like(x)
    for r in range(rows):
        for i in range(tokens):
            k = i % block_size
            for t in range(base.shape[0]):
                if k - t < 0:
                    continue
                for ch in range(hidden):
                    coefficient = base[t, ch] + dynamic[r, i, t, ch // group_size]
                    out[r, i, ch] += coefficient * x[r, i - t, ch]
    return out


@pytest.mark.parametrize("taps", [2, 3])
def test_grouped_conv_equals_the_token_by_token_reference(taps):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 12, 8, generator=gen, dtype=torch.float64)
    dynamic = torch.randn(2, 12, taps, 2, generator=gen, dtype=torch.float64)
    base = torch.randn(taps, 8, generator=gen, dtype=torch.float64)
    got = grouped_causal_conv(x, dynamic, base, block_size=4, group_size=4)
    torch.testing.assert_close(got, reference_conv(x, dynamic, base, 4, 4))


def test_an_untrained_dflash2_drafter_is_its_dflash_backbone(batch):
    """Identity convolutions and zero successors: same hidden states and drafts as a DFlash drafter
    with the same backbone weights."""
    features, ids, anchors, embed, lm_head = batch
    plain = make_drafter(variant="dflash")
    torch.manual_seed(0)
    fresh = DFlashDrafter(make_drafter().config)  # identity init, no perturbation
    fresh.load_state_dict(plain.state_dict(), strict=False)
    keep = torch.ones_like(anchors, dtype=torch.bool)
    with torch.no_grad():
        want = plain(features, ids, anchors, keep, embed)
        got = fresh(features, ids, anchors, keep, embed)
        torch.testing.assert_close(got, want)
        first = ids.gather(1, anchors).flatten()
        drafts = fresh.draft_tokens(got.flatten(0, 1), first, lm_head)
        assert torch.equal(drafts, plain.draft_tokens(want.flatten(0, 1), first, lm_head))


def test_each_sublayer_sits_between_its_two_convolutions():
    """The layer step against a hand-written reference with a stand-in attention (q passed through)."""
    drafter = make_drafter()
    layer, config = drafter.layers[1], drafter.config
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, 2 * BLOCK, 64, generator=gen)
    rope = drafter.rope(torch.arange(2 * BLOCK)[None])

    def attend(q, k_ctx, v_ctx, k_blk, v_blk):  # queries through: the reference needs no softmax
        return q

    def conv(module, side, x, dyn):
        return reference_conv(x, dyn, module.base_kernel[side].detach(), BLOCK, config.conv_group_size)

    def dynamic(module, x):
        return module.kernel_projection(x).unflatten(-1, (2, config.conv_kernel_size, -1))

    with torch.no_grad():
        got = dflash2_layer_step(layer, hidden, None, None, rope, attend)
        x = layer.input_layernorm(hidden)
        dyn = dynamic(layer.attention_conv, x)
        q = layer.self_attn.project_q(conv(layer.attention_conv, 0, x, dyn[:, :, 0]), rope)
        out = layer.self_attn.o_proj(q.transpose(1, 2).flatten(2))
        h = hidden + conv(layer.attention_conv, 1, out, dyn[:, :, 1])
        x = layer.post_attention_layernorm(h)
        dyn = dynamic(layer.mlp_conv, x)
        m = layer.mlp(conv(layer.mlp_conv, 0, x, dyn[:, :, 0]))
        want = h + conv(layer.mlp_conv, 1, m, dyn[:, :, 1])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_training_block_equals_inference_block(batch):
    features, ids, anchors, embed, _ = batch
    drafter = make_drafter()
    keep = torch.ones_like(anchors, dtype=torch.bool)
    with torch.no_grad():
        train = drafter.forward_train(features, ids, anchors, keep, embed, "sdpa", 3)
        for r in range(R):
            for j, anchor in enumerate(anchors[r].tolist()):
                cache = drafter.extend_context(drafter.new_context_cache(1), features[r : r + 1, :anchor])
                block = torch.full((1, BLOCK), MASK_ID)
                block[0, 0] = ids[r, anchor]
                infer = drafter.forward_block(block, anchor, cache, embed)
                torch.testing.assert_close(infer[0], train[r, j], atol=2e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- the selector


def reference_walk(selector, logits, hidden, anchors, top_k):
    """Per block, left to right: score every top-K candidate against the previous pick."""
    pred, succ = selector.predecessor_codebook.double(), selector.successor_codebook.double()
    projected = selector.hidden_projection(hidden).double()
    drafts = []
    for m in range(logits.shape[0]):
        previous, row = int(anchors[m]), []
        for k in range(logits.shape[1]):
            order = sorted(range(logits.shape[2]), key=lambda v: -float(logits[m, k, v]))[:top_k]
            scores = [
                float(logits[m, k, c]) + float((pred[previous] * projected[m, k]) @ succ[c]) for c in order
            ]
            previous = order[max(range(top_k), key=lambda i: (scores[i], -i))]
            row.append(previous)
        drafts.append(row)
    return torch.tensor(drafts)


def test_selector_walk_equals_the_reference(batch):
    drafter = make_drafter()
    with torch.no_grad():  # pairwise scores on the scale of the logits: the selector then decides
        drafter.candidate_selector.predecessor_codebook.mul_(200.0)
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(6, BLOCK, 64, generator=gen)
    anchors = torch.randint(0, VOCAB, (6,), generator=gen)
    lm_head = batch[4]
    with torch.no_grad():
        drafts = drafter.draft_tokens(hidden, anchors, lm_head)
        logits = lm_head(hidden[:, 1:]).double()
        want = reference_walk(
            drafter.candidate_selector, logits, hidden[:, 1:], anchors, drafter.config.selector_top_k
        )
    assert torch.equal(drafts, want)
    # The selector decides: here its picks differ from the parallel head's argmax somewhere.
    assert not torch.equal(drafts, logits.argmax(-1))


def reference_selector_loss(logits, labels, gate, table, top_k, weights):
    """K-way cross-entropy over the top-K (the gold token in the K-th slot when missing), one token at a time."""
    total = logits.new_zeros(())
    for i in range(logits.shape[0]):
        order = sorted(range(logits.shape[1]), key=lambda v: -float(logits[i, v].detach()))[:top_k]
        label = int(labels[i])
        if label not in order:
            order[-1] = label
        scores = logits[i, order] + table[order] @ gate[i]
        total = total + weights[i] * (torch.logsumexp(scores, 0) - scores[order.index(label)])
    return total


def test_selector_term_and_its_gradients_equal_autograd_on_the_reference():
    gen = torch.Generator().manual_seed(5)
    c, vocab, rank, top_k = 7, 40, 6, 5
    logits = torch.randn(c, vocab, generator=gen, dtype=torch.float64, requires_grad=True)
    gate = torch.randn(c, rank, generator=gen, dtype=torch.float64, requires_grad=True)
    table = torch.randn(vocab, rank, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = (
        logits.detach().argsort(-1, descending=True)[:, [0, 3, 12, 39, 2, 4, 30]].diagonal()
    )  # some miss the top 5
    weights = torch.tensor([1.0, 0.5, 0.25, 2.0, 0.0, 1.0, 0.7], dtype=torch.float64)
    want = reference_selector_loss(logits, labels, gate, table, top_k, weights)
    want.backward()
    term = selector_term(
        logits.detach(), labels, gate.detach(), table.detach(), top_k, weights, torch.tensor(1.0)
    )
    torch.testing.assert_close(term.loss_sum, want.detach())
    grad_logits = torch.zeros(c, vocab, dtype=torch.float64).scatter_add_(1, term.candidates, term.grad_unary)
    torch.testing.assert_close(grad_logits, logits.grad)
    torch.testing.assert_close(term.grad_gate, gate.grad)
    torch.testing.assert_close(term.grad_table, table.grad)
    # A weight-0 token with non-finite logits changes nothing.
    poisoned = logits.detach().clone()
    poisoned[4] = float("nan")
    again = selector_term(poisoned, labels, gate.detach(), table.detach(), top_k, weights, torch.tensor(1.0))
    torch.testing.assert_close(again.loss_sum, term.loss_sum)
    assert torch.isfinite(again.grad_table).all() and torch.isfinite(again.grad_gate).all()


def reference_loss(drafter, out, lm_weight, labels, valid, keep, gamma, denom, selector_weight):
    """The DFlash2 objective with whole [N, V] logits and plain autograd."""
    hidden = out.hidden.reshape(-1, out.hidden.shape[-1])
    logits = hidden @ lm_weight.t()
    flat_labels, flat_valid = labels.reshape(-1), (valid & keep[..., None]).reshape(-1)
    w = loss_weights(keep, valid, gamma).to(logits.dtype).reshape(-1)  # the decay, in its fp32 definition
    ce = torch.nn.functional.cross_entropy(logits, flat_labels, reduction="none")
    gate = out.selector_gate.reshape(-1, out.selector_gate.shape[-1])
    live = flat_valid.nonzero()[:, 0]
    selector = reference_selector_loss(
        logits[live],
        flat_labels[live],
        gate[live],
        out.selector_table,
        drafter.config.selector_top_k,
        w[live],
    )
    return ((w * ce).sum() + selector_weight * selector) / denom


@pytest.mark.parametrize("chunk_tokens", [3, 2048])
def test_chunked_dflash2_loss_gradients_equal_the_reference(batch, chunk_tokens):
    """Every parameter's gradient of the one-pass chunked loss (parallel CE + selector) equals plain
    autograd over whole logits, in float64."""
    features, ids, anchors, embed, lm_head = batch
    drafter = make_drafter(selector_top_k=6).double()
    keep = torch.ones_like(anchors, dtype=torch.bool)
    keep[1, -1] = False
    mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)) > 0.2
    labels, valid = block_targets(ids, mask, anchors, BLOCK)
    options = LossOptions(selector_weight=0.5)
    denom = denominator_weights(keep, valid, 3.0, options).sum().double()
    embed64, weight = torch.nn.Embedding.from_pretrained(embed.weight.double()), lm_head.weight.double()

    def grads(loss_fn):
        drafter.zero_grad()
        out = drafter(features.double(), ids, anchors, keep, embed64, "sdpa", 3, heads=True)
        loss_fn(out).backward()
        return {n: p.grad.clone() for n, p in drafter.named_parameters()}

    got = grads(lambda out: draft_loss(out, weight, labels, valid, keep, gamma=3.0, denom=denom,
                                       chunk_tokens=chunk_tokens, options=options)[0])  # fmt: skip
    want = grads(lambda out: reference_loss(drafter, out, weight, labels, valid, keep, 3.0, denom, 0.5))
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)
    assert want["candidate_selector.successor_codebook"].abs().sum() > 0


def test_training_tau_counts_the_selectors_pick(batch):
    """With the selector's pick as the served draft, training tau uses it; the head's own top-1 is
    reported apart (``head_top1``)."""
    features, ids, anchors, embed, lm_head = batch
    drafter = make_drafter()
    keep = torch.ones_like(anchors, dtype=torch.bool)
    labels, valid = block_targets(ids, torch.ones_like(ids, dtype=torch.bool), anchors, BLOCK)
    with torch.no_grad():
        hidden = drafter(features, ids, anchors, keep, embed)
        drafts = drafter.draft_tokens(hidden.flatten(0, 1), ids.gather(1, anchors).flatten(), lm_head)
        out = drafter(features, ids, anchors, keep, embed, heads=True)
        # Teacher forcing: make every label the drafted token, so the selector is right everywhere
        # it picked the label given the gold predecessor (here: the first position of each block).
        labels[..., 0] = drafts.view(R, -1, BLOCK - 1)[..., 0]
        _, stats = draft_loss(out, lm_head.weight, labels, valid, keep, gamma=3.0, denom=torch.tensor(1.0),
                              options=LossOptions(selector_weight=1.0))  # fmt: skip
    assert stats["top1"][0] == valid[..., 0].sum()
    assert "head_top1" in stats


# ----------------------------------------------------------------------------- export


def test_export_roundtrip_keeps_drafts_and_writes_the_dflash2_layout(batch, tmp_path):
    features, ids, anchors, embed, lm_head = batch
    drafter = make_drafter()
    out = save_drafter(drafter, drafter.config, tmp_path / "export", dtype="float32")
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"]
    assert {k: raw["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")} == {
        "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16,
    }  # fmt: skip
    assert raw["is_causal"] is True
    notes = (out / "SERVING.md").read_text()
    assert (
        f"--spec-type draft-dflash --spec-draft-n-max {BLOCK - 1}" in notes and '"method": "dflash"' in notes
    )
    loaded, config = load_drafter(out)
    assert config == drafter.config
    names = set(loaded.state_dict())
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.1.attention_conv.base_kernel",
            "layers.1.attention_conv.kernel_projection.weight", "layers.0.mlp_conv.base_kernel",
            "layers.0.mlp_conv.kernel_projection.weight"} <= names  # fmt: skip
    keep = torch.ones_like(anchors, dtype=torch.bool)
    with torch.no_grad():
        a, b = drafter(features, ids, anchors, keep, embed), loaded(features, ids, anchors, keep, embed)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        first = ids.gather(1, anchors).flatten()
        assert torch.equal(
            drafter.draft_tokens(a.flatten(0, 1), first, lm_head),
            loaded.draft_tokens(b.flatten(0, 1), first, lm_head),
        )


# ----------------------------------------------------------------------------- config


def test_settings_of_another_variant_are_refused():
    with pytest.raises(ValueError, match="drafter.selector_rank"):
        DrafterConfig(variant="dflash", selector_rank=64)
    # A loss weight of another variant (its default is not 0) was ignored without a word.
    with pytest.raises(ValueError, match="drafter.dspark_tv_weight set with drafter.variant=dflash"):
        DrafterConfig(variant="dflash", dspark_tv_weight=0.5)
    with pytest.raises(ValueError, match="drafter.selector_loss_weight set with drafter.variant=dspark"):
        DrafterConfig(variant="dspark", selector_loss_weight=2.0)
    with pytest.raises(ValueError, match="conv_group_size=24 must divide hidden_size=64"):
        make_drafter(conv_group_size=24)


def test_ddtree_is_refused_for_dflash2(batch):
    from dflash_train.eval.ddtree import check_tree_variant

    with pytest.raises(NotImplementedError, match="selector"):
        check_tree_variant(True, make_drafter().config)


def test_draft_output_is_a_pytree():
    """DDP and FSDP2 find the forward's tensors through pytree (their gradient and unshard hooks)."""
    import torch.utils._pytree as pytree

    leaves, _ = pytree.tree_flatten(DraftOutput(hidden=torch.ones(1), selector_gate=torch.zeros(2)))
    assert sum(torch.is_tensor(x) for x in leaves) == 2


def test_qwen36_27b_dflash2_serving_layout():
    """The 27B preset's DFlash2 tensors, in the shapes of the released checkpoints' layout
    (``attention_conv.base_kernel`` [2, 2, 5120], ``kernel_projection`` [2 * 2 * 320, 5120],
    codebooks [V, 256])."""
    config = presets.resolve_drafter_config(
        DrafterConfig(preset="qwen3.6-27b", variant="dflash2"), presets.qwen36_27b_target_config()
    )
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in DFlashDrafter(config).state_dict().items()}
    assert shapes["layers.4.attention_conv.base_kernel"] == (2, 2, 5120)
    assert shapes["layers.0.mlp_conv.kernel_projection.weight"] == (1280, 5120)
    assert shapes["candidate_selector.predecessor_codebook"] == (248320, 256)
    assert shapes["candidate_selector.successor_codebook"] == (248320, 256)
    assert shapes["candidate_selector.hidden_projection.weight"] == (256, 5120)


def test_the_lm_head_runs_once_per_chunk_with_the_selector(batch, monkeypatch):
    """The selector's candidates and unary scores come from the chunk's one LM-head pass."""
    import dflash_train.train.loss as loss_mod

    features, ids, anchors, embed, lm_head = batch
    drafter = make_drafter()
    keep = torch.ones_like(anchors, dtype=torch.bool)
    labels, valid = block_targets(ids, torch.ones_like(ids, dtype=torch.bool), anchors, BLOCK)
    calls = []
    real = loss_mod.lm_head_logits
    monkeypatch.setattr(loss_mod, "lm_head_logits", lambda h, w: calls.append(h.shape[0]) or real(h, w))
    out = drafter(features, ids, anchors, keep, embed, heads=True)
    loss, _ = draft_loss(out, lm_head.weight, labels, valid, keep, gamma=3.0, denom=torch.tensor(10.0),
                         chunk_tokens=9, options=LossOptions(selector_weight=1.0))  # fmt: skip
    loss.backward()
    assert calls == [9] * 5 + [3]  # 48 scored tokens in chunks of 3 blocks; none again in backward
