import pytest
import torch

from dflash_train.models.export import read_dcp_model_state
from dflash_train.train import checkpoint as ckpt
from dflash_train.train import resume_check


def linear_state(value: float):
    """A tiny model and optimizer after one AdamW step, with every weight ``value`` before it."""
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.constant_(model.weight, value)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    return model, optimizer


def write(out, step, writer=None, keep_last=2, value=0.0):
    """One checkpoint of a one-process run, through the trainer's path: shards, then the commit."""
    writer = writer or ckpt.CheckpointWriter(asynchronous=False)
    model, optimizer = linear_state(value)
    staging = ckpt.clear_staging(out, step)
    state = ckpt.snapshot(ckpt.sharded_state(model, optimizer))
    staged = ckpt.stage_shards(state, staging, writer)
    shards = ckpt.write_shards(staged, group=None)
    commit = dict(drafter_config={"block_size": 4}, train_state={"step": step}, config_yaml="output_dir: x\n")
    return writer.submit(out, step, shards=shards, keep_last=keep_last, **commit), model


def test_only_committed_folders_count_and_old_ones_are_pruned(tmp_path):
    for step in (1, 2, 3):
        write(tmp_path, step)
    assert [p.name for p in ckpt.committed_checkpoints(tmp_path)] == ["step-00000002", "step-00000003"]
    partial = ckpt.checkpoints_root(tmp_path) / "step-00000009"
    partial.mkdir()  # a crash before the commit marker
    assert ckpt.latest_checkpoint(tmp_path).name == "step-00000003"
    with pytest.raises(ValueError, match="not a committed checkpoint"):
        ckpt.load_checkpoint(partial)


def test_resuming_from_a_path_that_is_no_checkpoint_says_what_to_give(tmp_path):
    """checkpoint.resume=<a typo> or =<the run's output_dir> was reported as a checkpoint "interrupted
    while saving", to be replaced by an older one."""
    write(tmp_path, 1)
    with pytest.raises(ValueError, match=r"checkpoint.resume=.*no-such: no such directory; give auto, never"):
        ckpt.load_checkpoint(tmp_path / "no-such")
    with pytest.raises(
        ValueError, match=r"is a run's output_dir, not one of its checkpoints: give .*step-00000001"
    ):
        ckpt.load_checkpoint(tmp_path)


def test_sharded_checkpoint_holds_the_model_and_the_optimizer(tmp_path):
    path, model = write(tmp_path, 1, value=2.0)
    loaded = ckpt.load_checkpoint(path)
    assert loaded["sharded"] and loaded["drafter_state"] is None and loaded["train_state"] == {"step": 1}
    assert torch.equal(read_dcp_model_state(path / "model_optim")["weight"], model.weight.detach())
    fresh, optimizer = torch.nn.Linear(2, 1, bias=False), None
    optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    ckpt.load_sharded_state(fresh, optimizer, path)
    saved_model, saved_optimizer = linear_state(2.0)
    assert torch.equal(fresh.weight, saved_model.weight)
    mine, theirs = optimizer.state_dict()["state"][0], saved_optimizer.state_dict()["state"][0]
    assert all(torch.equal(mine[k], theirs[k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def test_sharded_load_of_another_shape_is_a_clear_error(tmp_path):
    path, _ = write(tmp_path, 1)
    other = torch.nn.Linear(3, 1, bias=False)
    with pytest.raises(
        ValueError, match=r"another architecture.*weight: checkpoint \[1, 2\] vs now \[1, 3\]"
    ):
        ckpt.load_sharded_state(other, torch.optim.AdamW(other.parameters()), path)


def test_async_writer_commits_and_surfaces_errors(tmp_path, monkeypatch):
    writer = ckpt.CheckpointWriter(asynchronous=True)
    path, model = write(tmp_path, 5, writer, value=3.0)
    writer.wait()
    assert torch.equal(read_dcp_model_state(path / "model_optim")["weight"], model.weight.detach())

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(ckpt, "save_checkpoint", disk_full)
    write(tmp_path, 6, writer)
    with pytest.raises(OSError, match="No space left"):
        writer.close()
    assert ckpt.latest_checkpoint(tmp_path).name == "step-00000005"


def test_a_pinned_staging_buffer_is_made_once_and_each_save_writes_its_own_step(tmp_path, monkeypatch):
    """checkpoint.pinned_staging: one staged copy, made at the first save and refilled by each later
    one; every checkpoint holds its own step's weights, not what the buffer held later. On a CPU the
    pinning is stood in for (it needs CUDA)."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *args, **kwargs: self)
    writer = ckpt.CheckpointWriter(asynchronous=True, pinned_staging=True)
    saved, buffers = {}, []
    for step, value in ((1, 2.0), (2, 5.0)):
        path, model = write(tmp_path, step, writer=writer, value=value)
        writer.wait()
        saved[path] = model.weight.detach().clone()
        buffers.append(writer.stager.state_dict_cache)
    writer.close()
    assert buffers[0] is not None and buffers[0] is buffers[1]
    for path, weight in saved.items():
        assert torch.equal(read_dcp_model_state(path / "model_optim")["weight"], weight)


@pytest.mark.gpu
def test_pinned_staging_of_a_cuda_state_writes_each_saves_values():
    """The real path: a CUDA model's state staged into the pinned buffer by two saves, with the
    weights changed on the GPU between them (the buffer is refilled, never stale or mixed)."""
    import tempfile

    model = torch.nn.Linear(64, 32, bias=False).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 64, device="cuda")).sum().backward()
    optimizer.step()
    writer = ckpt.CheckpointWriter(asynchronous=True, pinned_staging=True)
    with tempfile.TemporaryDirectory() as out:
        saved = {}
        for step in (1, 2):
            with torch.no_grad():
                model.weight.fill_(float(step))
            staging = ckpt.clear_staging(out, step)
            state = ckpt.sharded_state(model, optimizer)
            staged = ckpt.stage_shards(state, staging, writer)
            with torch.no_grad():
                model.weight.fill_(-1.0)  # after staging: must not reach the checkpoint
            shards = ckpt.write_shards(staged, group=None)
            path = writer.submit(out, step, shards=shards, drafter_config={}, train_state={"step": step},
                                 config_yaml="", keep_last=2)  # fmt: skip
            writer.wait()
            saved[step] = read_dcp_model_state(path / "model_optim")["weight"]
        writer.close()
        assert all(torch.all(saved[step] == float(step)) for step in (1, 2))
        assert writer.stager.state_dict_cache["model"]["weight"].is_pinned()


def test_pinned_staging_is_refused_where_it_cannot_run():
    from dflash_train.config import CheckpointConfig

    with pytest.raises(ValueError, match="pinned_staging=true needs CUDA.*pinned_staging=false"):
        ckpt.CheckpointWriter.for_run(CheckpointConfig(pinned_staging=True), torch.device("cpu"))


def test_snapshot_does_not_alias_live_tensors():
    live = {"w": torch.zeros(3), "nested": {"m": torch.ones(2)}}
    copy = ckpt.snapshot(live)
    live["w"].add_(1)
    live["nested"]["m"].mul_(5)
    assert copy["w"].tolist() == [0.0, 0.0, 0.0] and copy["nested"]["m"].tolist() == [1.0, 1.0]


def test_resume_compatibility_names_the_key_and_the_fix():
    saved = {"drafter": {"block_size": 16}, "train": {"num_anchors": 512}}
    now = {"drafter": {"block_size": 8}, "train": {"num_anchors": 512}}
    with pytest.raises(
        ValueError, match=r"drafter.block_size: checkpoint 16 -> now 8.*allow_changed=\[drafter.block_size\]"
    ):
        resume_check.check_resume_compatible(saved, now, [])
    resume_check.check_resume_compatible(saved, now, ["drafter.block_size"])


def test_resume_compares_the_resolved_drafter_config():
    recipe = {"drafter": {"block_size": 16}}
    saved = {"block_size": 16, "dflash_config": {"mask_token_id": 7}, "dtype": "bfloat16"}
    now = {"block_size": 16, "dflash_config": {"mask_token_id": 9}, "dtype": "float32"}  # dtype: not checked
    with pytest.raises(
        ValueError, match=r"drafter_config.dflash_config.mask_token_id: checkpoint 7 -> now 9"
    ):
        resume_check.check_resume_compatible(recipe, recipe, [], saved_drafter=saved, current_drafter=now)
    allowed = ["drafter_config.dflash_config.mask_token_id"]
    resume_check.check_resume_compatible(recipe, recipe, allowed, saved_drafter=saved, current_drafter=now)


def test_every_drafter_key_but_init_from_is_checked():
    saved = {"drafter": {"head_dim": 128, "init_from": "a"}}
    with pytest.raises(ValueError, match=r"drafter.head_dim: checkpoint 128 -> now 64"):
        resume_check.check_resume_compatible(saved, {"drafter": {"head_dim": 64, "init_from": "a"}}, [])
    resume_check.check_resume_compatible(saved, {"drafter": {"head_dim": 128, "init_from": "b"}}, [])


@pytest.mark.parametrize(
    "key,saved_value,new_value",
    [
        ("train.anchors_per_token", 0.0, 0.5),
        ("train.dtype", "float32", "bfloat16"),
        ("target.dtype", "float32", "bfloat16"),
        ("target.fp8", False, True),
        ("data.thinking", None, False),
        ("data.overlong", "truncate", "drop"),
        ("data.packing", False, True),
        ("data.pack_window", 4096, 64),
    ],
)
def test_resume_refuses_what_changes_the_features_tokens_rows_or_numerics(key, saved_value, new_value):
    section, name = key.split(".")
    saved, now = {section: {name: saved_value}}, {section: {name: new_value}}
    with pytest.raises(ValueError, match=rf"{key}: checkpoint {saved_value!r} -> now {new_value!r}"):
        resume_check.check_resume_compatible(saved, now, [])
    resume_check.check_resume_compatible(saved, now, [key])


def test_a_key_the_checkpoint_predates_counts_as_its_default():
    """A recipe written before data.packing existed was trained without packing."""
    resume_check.check_resume_compatible({"data": {}}, {"data": {"packing": False}}, [])
    with pytest.raises(ValueError, match=r"data.packing: checkpoint False -> now True"):
        resume_check.check_resume_compatible({"data": {}}, {"data": {"packing": True}}, [])


def test_state_shape_mismatch_becomes_a_value_error(tmp_path):
    model = torch.nn.Linear(4, 3, bias=False)
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(
        ValueError, match=r"another architecture.*weight: checkpoint \[2, 4\] vs now \[3, 4\]"
    ):
        ckpt.load_model_state(model, {"weight": torch.zeros(2, 4)}, optimizer, {}, tmp_path)
    with pytest.raises(ValueError, match=r"not in the model: \['extra'\]"):
        state = {"weight": torch.zeros(3, 4), "extra": torch.zeros(1)}
        ckpt.load_model_state(model, state, optimizer, {}, tmp_path)


def test_export_reads_a_sharded_checkpoint_on_one_process(tmp_path):
    """``dflash-train export`` of a DCP checkpoint: the serving tensors equal the trained drafter's."""
    from dflash_train.config import DrafterConfig
    from dflash_train.models import presets
    from dflash_train.models.drafter import DFlashDrafter
    from dflash_train.models.export import export_checkpoint, load_drafter

    config = presets.resolve_drafter_config(
        DrafterConfig(preset="tiny", block_size=4),
        presets.tiny_hybrid_target_config(),
        target_layer_ids=[0, 2],
        mask_token_id=300,
        torch_dtype="float32",
    )
    torch.manual_seed(3)
    drafter = DFlashDrafter(config)
    optimizer = torch.optim.AdamW(drafter.parameters())
    staging = ckpt.clear_staging(tmp_path, 7)
    state = ckpt.sharded_state(drafter, optimizer)
    ckpt.write_shards(
        ckpt.stage_shards(state, staging, ckpt.CheckpointWriter(asynchronous=False)), group=None
    )
    ckpt.save_checkpoint(
        tmp_path,
        7,
        shards=None,
        drafter_config=config.to_serving_dict(),
        train_state={"step": 7},
        config_yaml="target:\n  path: org/target\n",
        keep_last=2,
    )
    result = export_checkpoint(tmp_path, tmp_path / "export", dtype="float32")
    assert result["checkpoint"] == str(ckpt.step_folder(tmp_path, 7))
    exported, _ = load_drafter(tmp_path / "export")
    theirs = exported.state_dict()
    assert all(torch.equal(theirs[k], v) for k, v in drafter.state_dict().items())
