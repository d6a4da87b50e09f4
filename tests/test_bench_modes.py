"""``dflash-train bench eval | checkpoint | decode`` on CPU with tiny presets: each mode's --json."""

from __future__ import annotations

import json

import pytest

from dflash_train.cli import main

TINY_WORKLOAD = ["--preset", "tiny-qwen3", "--block-size", "4", "--prompt-len", "12", "--device", "cpu"]


def run_json(args: list[str], capsys) -> dict:
    assert main([*args, "--no-progress", "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eval_mode_times_each_phase_and_decode_mode_agrees_on_tau(capsys):
    args = ["bench", "eval", *TINY_WORKLOAD, "--num-prompts", "3", "--max-new-tokens", "9"]
    result = run_json([*args, "--batch-size", "2", "--decode"], capsys)
    assert set(result["timings"]) == {"generate", "features", "drafter", "simulation", "total"}
    assert result["timings"]["total"] == pytest.approx(
        sum(v for k, v in result["timings"].items() if k != "total")
    )
    assert result["num_prompts"] == 3 and result["tokens"] == 3 * 9  # random weights never stop
    assert result["prompts_per_min"] > 0 and result["random_drafter"] is True
    assert set(result["tau"]) == {"dflash", "ngram"}
    # fp32: the exact simulation and real decoding of the same prompts give the same tau
    assert result["decode"]["tau"] == pytest.approx(result["tau"])
    assert result["decode"]["seconds"] >= result["decode"]["plain_reference_s"] > 0
    assert result["decode_vs_exact"] == pytest.approx(
        result["decode"]["seconds"] / result["timings"]["total"]
    )


def test_eval_mode_reports_each_modes_own_peak_memory(monkeypatch):
    """The exact phases' peak and decode mode's peak are each measured from a reset of their own:
    decode mode's allocations are not charged to ``peak_gib``, nor the warm-up's to either."""
    from types import SimpleNamespace

    import torch

    import dflash_train.bench.eval_speed as eval_speed
    import dflash_train.models.target_kernels as target_kernels

    peak = {"bytes": 0}  # a fake CUDA allocator's high-water mark
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: peak.update(bytes=0))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak["bytes"])

    def allocate(gib: int) -> None:
        peak["bytes"] = max(peak["bytes"], gib * 2**30)

    def exact_phases(options, work, prompts, progress):
        allocate(5 if progress is None else 2)  # the warm-up peaks highest
        return {"timings": {"total": 1.0}, "tau": {}, "tokens": 10}

    def decode_mode(options, work):
        allocate(3)
        return {"seconds": 4.0}

    work = SimpleNamespace(device=torch.device("cuda"), prompts=[[1, 2]], model=None, header=lambda o: {})
    monkeypatch.setattr(eval_speed, "load_workload", lambda options: work)
    monkeypatch.setattr(eval_speed, "exact_phases", exact_phases)
    monkeypatch.setattr(eval_speed, "decode_mode", decode_mode)
    monkeypatch.setattr(target_kernels, "bound_kernels", lambda model: {})
    options = eval_speed.EvalBenchOptions(preset="tiny-qwen3", decode=True, progress=False)
    result = eval_speed.run_eval_bench(options)
    assert result["peak_gib"] == 2 and result["decode"]["peak_gib"] == 3
    assert result["decode_vs_exact"] == 4.0


def test_eval_mode_refuses_a_tree_without_a_budget():
    from dflash_train.bench.eval_speed import EvalBenchOptions

    with pytest.raises(ValueError, match="ddtree needs --ddtree-budget"):
        EvalBenchOptions(preset="tiny-qwen3", methods="dflash,ddtree")
    with pytest.raises(ValueError, match="exactly one of --target DIR and --preset NAME"):
        EvalBenchOptions()


def test_decode_mode_compares_engines_prompt_by_prompt(capsys):
    args = ["bench", "decode", *TINY_WORKLOAD, "--num-prompts", "2", "--max-new-tokens", "8"]
    result = run_json(args, capsys)
    engines = result["engines"]
    assert set(engines) == {"dynamic", "static"}
    for row in engines.values():
        assert row["plain_tokens_per_s"] > 0 and row["dflash_tokens_per_s"] > 0
        assert row["lossless"] is True and row["clear_divergences"] == 0 and "_outputs" not in row
    # fp32 on CPU: both engines emit the same tokens for every prompt
    assert result["identical_outputs"] == {"dynamic_vs_static": {"plain": 2, "dflash": 2}}


def test_decode_mode_records_a_failing_engine_and_runs_the_others(capsys, monkeypatch):
    import dflash_train.bench.decode as decode

    real = decode.run_engine

    def static_breaks(options, work, engine):
        if engine == "static":
            raise RuntimeError("capture failed")
        return real(options, work, engine)

    monkeypatch.setattr(decode, "run_engine", static_breaks)
    args = ["bench", "decode", *TINY_WORKLOAD, "--num-prompts", "1", "--max-new-tokens", "4"]
    result = run_json(args, capsys)
    assert result["engines"]["static"] == {"error": "RuntimeError: capture failed"}
    assert result["engines"]["dynamic"]["lossless"] is True and result["identical_outputs"] == {}


@pytest.mark.parametrize("save_mode", ["gather", "dcp-sync", "dcp-async"])
def test_checkpoint_mode_measures_each_save(save_mode, tmp_path, capsys):
    args = ["bench", "checkpoint", "--dir", str(tmp_path / "scratch"), "--device", "cpu"]
    result = run_json([*args, "--saves", "2", "--save-mode", save_mode], capsys)
    assert result["save_mode"] == save_mode and result["preset"] == "tiny" and result["drafter_params"] > 0
    assert len(result["saves"]) == 2
    for save in result["saves"]:
        assert 0 < save["stall_s"] <= save["wall_s"] and save["peak_rss_gib"] > 0
        assert save["checkpoint_bytes"] > 4 * result["drafter_params"]  # fp32 weights at least
    if save_mode == "dcp-sync":  # the whole save is the stall
        assert all(save["wall_s"] - save["stall_s"] < 0.05 for save in result["saves"])
    assert not (tmp_path / "scratch" / save_mode).exists()  # deleted when done


def test_the_pinned_checkpoint_mode_needs_cuda(tmp_path, capsys, monkeypatch):
    import dflash_train.bench.checkpoint as checkpoint

    args = ["bench", "checkpoint", "--dir", str(tmp_path), "--saves", "1", "--device", "cpu"]
    assert main([*args, "--save-mode", "dcp-async-pinned", "--no-progress", "--json"]) == 1
    assert "--save-mode dcp-async-pinned needs CUDA (pinned host memory)" in capsys.readouterr().err
    monkeypatch.setattr(checkpoint, "SAVE_MODES", ("dcp-async-pinned",))  # all: recorded as not run
    assert run_json(args, capsys)["modes"] == {
        "dcp-async-pinned": {"not_run": "needs CUDA (pinned host memory)"}
    }


def test_checkpoint_mode_all_runs_each_save_mode_in_its_own_process(tmp_path, capsys, monkeypatch):
    import dflash_train.bench.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "SAVE_MODES", ("dcp-async",))  # one child process, not three
    args = ["bench", "checkpoint", "--dir", str(tmp_path), "--saves", "1", "--device", "cpu"]
    result = run_json(args, capsys)
    assert list(result["modes"]) == ["dcp-async"]
    child = result["modes"]["dcp-async"]
    assert child["save_mode"] == "dcp-async" and len(child["saves"]) == 1 and "torch" not in child
    assert result["device"] == "cpu" and result["torch"]


def test_checkpoint_mode_all_records_a_child_that_printed_no_result_and_keeps_the_others(
    tmp_path, capsys, monkeypatch
):
    import subprocess

    import dflash_train.bench.checkpoint as checkpoint

    def child(command, **kwargs):
        mode = command[command.index("--save-mode") + 1]
        if mode == "dcp-sync":  # exits 0 but prints nothing on stdout
            return subprocess.CompletedProcess(command, 0, stdout="", stderr="warning\nchild went quiet")
        result = {"save_mode": mode, "drafter_params": 1, "saves": []}
        return subprocess.CompletedProcess(command, 0, stdout=f"noise\n{json.dumps(result)}\n", stderr="")

    monkeypatch.setattr(checkpoint, "SAVE_MODES", ("gather", "dcp-sync", "dcp-async"))
    monkeypatch.setattr(checkpoint.subprocess, "run", child)
    args = ["bench", "checkpoint", "--dir", str(tmp_path), "--saves", "1", "--device", "cpu"]
    modes = run_json(args, capsys)["modes"]
    assert modes["gather"]["save_mode"] == "gather" and modes["dcp-async"]["save_mode"] == "dcp-async"
    assert modes["dcp-sync"] == {
        "error": "exit code 0 but no JSON result on stdout (last line: ''): warning\nchild went quiet"
    }
