"""A packed row and the same conversations unpacked give the same DFlash loss (same anchors), block
labels stop at each conversation's end, and a packed tiny run trains end to end (hybrid target on
the per-conversation CPU reference)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import pytest
import torch

from dflash_train.config import DrafterConfig, load_config
from dflash_train.data.batching import assemble_batch, assemble_packed_batch, same_segment
from dflash_train.models import presets
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.models.target import FrozenTarget
from dflash_train.tiny import build_tiny_target
from dflash_train.train.loss import block_targets, dflash_loss
from dflash_train.train.step import prepare_micro_batch, target_features
from tests.train_helpers import logged_losses, tiny_config, train_stopped_by_sigterm

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*")
MASK_ID = 300


class Layout(NamedTuple):
    """Packed rows of conversations: each a ``prompt``-token prompt, then the response."""

    lengths: list[list[int]]  # conversation lengths per packed row
    prompt: int
    row: int
    block: int


# A block reaches B-1 tokens past its anchor (at latest a conversation's second-to-last token),
# so it reaches the next conversation's reply only when B >= prompt + 3: not here ...
LONG_PROMPTS = Layout([[9, 14, 5], [20, 7], [3, 12]], prompt=2, row=32, block=4)
# ... but here (block 16, short user turns), where only the boundary filter keeps those labels out.
SHORT_PROMPTS = Layout([[21, 9, 17, 11], [12, 30, 14]], prompt=3, row=64, block=16)
LAYOUTS = [pytest.param(LONG_PROMPTS, id="long-prompts"), pytest.param(SHORT_PROMPTS, id="short-prompts")]


def conversations(layout: Layout, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows, indices = [], []
    for r, lengths in enumerate(layout.lengths):
        row = []
        for n in lengths:
            ids = torch.randint(0, MASK_ID, (n,), generator=g).numpy()
            row.append((ids, np.arange(n) >= layout.prompt))
        rows.append(row)
        indices.append([10 * r + c for c in range(len(lengths))])
    return rows, indices


def fake_run(target, layout: Layout, device: str = "cpu"):
    cfg = load_config(
        "tiny-cpu",
        [
            f"train.num_anchors={layout.row}",
            "train.anchors_per_token=1.0",
            f"drafter.block_size={layout.block}",
            "train.seed=5",
        ],
    )
    return SimpleNamespace(
        cfg=cfg, info=SimpleNamespace(device=torch.device(device)), gamma=4.0, target=target
    )


def make_drafter(block: int) -> DFlashDrafter:
    config = presets.resolve_drafter_config(
        DrafterConfig(preset="tiny", block_size=block, sliding_window=max(8, block)),  # window >= block
        presets.tiny_qwen3_target_config(vocab_size=320),
        target_layer_ids=[0, 2],
        mask_token_id=MASK_ID,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    return DFlashDrafter(config)


def micro_loss(run, drafter, batch, backend: str, *, packed_positions: bool = True) -> torch.Tensor:
    m = prepare_micro_batch(run, batch, epoch=2)
    packed = {"position_ids": m["position_ids"]} if "position_ids" in m else {}
    features = target_features(run.target, m["input_ids"], **packed)
    hidden = drafter(
        features,
        m["input_ids"],
        m["anchors"],
        m["keep"],
        run.target.embed_tokens,
        backend=backend,
        sdpa_anchor_chunk=8,
        **(packed if packed_positions else {}),
    )
    loss, _ = dflash_loss(
        hidden,
        run.target.lm_head.weight,
        m["labels"],
        m["label_valid"],
        m["keep"],
        gamma=run.gamma,
        denom=m["weights"].sum(),
    )
    return loss, m


@pytest.mark.parametrize(
    ("backend", "device", "layout"),
    [
        ("sdpa", "cpu", LONG_PROMPTS),
        ("flex", "cpu", LONG_PROMPTS),
        ("sdpa", "cpu", SHORT_PROMPTS),  # uncompiled flex on the CPU is slow at block 16
        pytest.param("flex", "cuda", LONG_PROMPTS, marks=pytest.mark.gpu),
        pytest.param("flex", "cuda", SHORT_PROMPTS, marks=pytest.mark.gpu),
    ],
    ids=[
        "sdpa-cpu-long-prompts",
        "flex-cpu-long-prompts",
        "sdpa-cpu-short-prompts",
        "flex-cuda-long-prompts",
        "flex-cuda-short-prompts",
    ],  # fmt: skip
)
def test_packed_row_and_unpacked_conversations_give_the_same_loss(backend, device, layout):
    """On CUDA flex runs compiled, with the conversation bound inside the compiled mask_mod."""
    target = FrozenTarget(build_tiny_target("qwen3", vocab_size=320).to(device), None, [0, 2])
    run, drafter = fake_run(target, layout, device), make_drafter(layout.block).to(device)
    rows, indices = conversations(layout)
    packed = assemble_packed_batch(rows, indices, len(rows), layout.row, pad_id=0)
    flat_rows = [c for row in rows for c in row]
    flat_index = [i for row in indices for i in row]
    unpacked = assemble_batch(flat_rows, flat_index, len(flat_rows), layout.row, pad_id=0)
    with torch.no_grad():
        packed_loss, pm = micro_loss(run, drafter, packed, backend)
        unpacked_loss, um = micro_loss(run, drafter, unpacked, backend)
        crossed_loss, _ = micro_loss(run, drafter, packed, backend, packed_positions=False)
    # The same anchors (every valid position here) and the same scored labels either way.
    num_valid = sum(n - layout.prompt - 1 for row in layout.lengths for n in row)
    assert int(pm["keep"].sum()) == int(um["keep"].sum()) == num_valid
    assert float(pm["weights"].sum()) == pytest.approx(float(um["weights"].sum()), rel=1e-6)
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if device == "cpu" else {"rtol": 2e-4, "atol": 1e-4}
    torch.testing.assert_close(packed_loss, unpacked_loss, **tolerance)
    # The test can fail: a drafter that ignores the boundaries sees other conversations' context.
    assert abs(float(crossed_loss) - float(unpacked_loss)) > 1e-4


@pytest.mark.parametrize("layout", LAYOUTS)
def test_labels_never_cross_into_the_next_conversation(layout):
    target = FrozenTarget(build_tiny_target("qwen3", vocab_size=320), None, [0, 2])
    run = fake_run(target, layout)
    rows, indices = conversations(layout)
    batch = assemble_packed_batch(rows, indices, len(rows), layout.row, pad_id=0)
    m = prepare_micro_batch(run, batch, epoch=0)
    owner = batch.token_sample_index
    for r in range(batch.shape[0]):
        for slot in torch.nonzero(m["keep"][r]).flatten().tolist():
            a = int(m["anchors"][r, slot])
            for k in range(1, layout.block):
                if m["label_valid"][r, slot, k - 1]:
                    assert owner[r, a + k] == owner[r, a]
    # And some block of a conversation's last tokens has labels cut by the boundary.
    assert (~m["label_valid"] & m["keep"][..., None]).any()
    # With short prompts the loss mask alone would score the next conversation's reply: the test
    # depends on the boundary filter there.
    _, by_loss_mask = block_targets(m["input_ids"], m["loss_mask"], m["anchors"], layout.block)
    crossing = by_loss_mask & m["keep"][..., None] & ~m["label_valid"]
    assert crossing.any() == (layout is SHORT_PROMPTS)


def test_same_segment_stops_at_every_conversation_start():
    """[R, A, B-1]: a + k is in anchor a's conversation; the row end and the padding tail count as
    other segments."""
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 0, 0, 1]])  # 4, 3, 2, 1 tokens, padding
    anchors = torch.tensor([[0, 2, 3, 5, 8, 10]])
    t, f = True, False
    expected = [[t, t, t], [t, f, f], [f, f, f], [t, f, f], [f, f, f], [t, f, f]]
    assert same_segment(position_ids, anchors, block_size=4).tolist() == [expected]
    # Two rows, block 2 (one label per block): only the row's own positions decide.
    rows = torch.tensor([[0, 1, 2, 0], [0, 0, 1, 2]])
    assert same_segment(rows, torch.tensor([[1, 2], [0, 1]]), 2).tolist() == [[[t], [f]], [[f], [t]]]


def test_packed_tiny_run_trains(train_task, tmp_path):
    from dflash_train.train.trainer import train

    out = tmp_path / "packed"
    result = train(
        tiny_config(train_task, out, "data.packing=true", "train.max_steps=6", "checkpoint.every_steps=100")
    )
    losses = logged_losses(out)
    assert result["step"] == 6 and all(np.isfinite(list(losses.values())))


def test_packed_run_resumes_with_the_uninterrupted_losses(train_task, tmp_path):
    """SIGTERM inside step 4 of a packed run, resume: the same batches, anchors and losses."""
    from dflash_train.train.trainer import train

    extra = ("data.packing=true", "train.max_steps=8", "checkpoint.every_steps=100")
    train(tiny_config(train_task, tmp_path / "full", *extra))
    full = logged_losses(tmp_path / "full")

    out = tmp_path / "resumed"
    first = train_stopped_by_sigterm(tiny_config(train_task, out, *extra))
    assert first["step"] == 4
    assert train(tiny_config(train_task, out, *extra))["step"] == 8
    assert logged_losses(out) == full


def test_a_filler_step_of_a_later_epoch_leaves_the_weights_alone(train_task, tmp_path):
    """Epoch 1 of this data packs into fewer rows than epoch 0, so its last step is all filler (no
    label anywhere): that step must not move the drafter (AdamW's momentum and weight decay would)."""
    from dflash_train.train.trainer import TrainHooks, train

    snapshots = {}

    def snapshot(run):
        params = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
        snapshots[run.step] = (params, run.data.pack)

    extra = ("data.packing=true", "data.pack_window=4", "train.seed=2", "train.max_steps=0")
    extra += ("train.num_epochs=2", "checkpoint.every_steps=100", "train.weight_decay=0.1")
    cfg = tiny_config(train_task, tmp_path / "run", *extra)
    result = train(cfg, TrainHooks(after_step=snapshot))
    pack = snapshots[1][1]
    steps = pack.steps_per_epoch
    filler = [
        epoch * steps + s + 1
        for epoch in range(2)
        for s, group in enumerate(pack.groups(epoch))
        if all(len(rows) == 0 for rows in group)
    ]
    assert filler == [2 * steps] and result["step"] == 2 * steps  # the run's last step is all filler
    before, after = snapshots[filler[0] - 1][0], snapshots[filler[0]][0]
    assert all(torch.equal(before[k], after[k]) for k in before)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == filler[0] and rows[-1]["empty_steps"] == 1 and rows[-2]["empty_steps"] == 0
