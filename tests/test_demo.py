"""`dflash-train demo --quick` end to end: target, rows, regen, train, export, speculative eval."""

from __future__ import annotations

import json

import pytest

from dflash_train.demo.pipeline import run_demo


def test_quick_demo_trains_a_lossless_drafter_that_gets_accepted(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))
    result = run_demo(quick=True, workdir=tmp_path / "demo")

    assert result["lossless"] is True
    assert result["tau"] > 1.0  # some drafted tokens were accepted by the target
    assert result["ngram_tau"] >= 1.0
    assert result["train_steps"] == 40
    export = tmp_path / "demo" / "run" / "export"
    assert result["export"] == str(export)
    assert (export / "config.json").is_file() and (export / "model.safetensors").is_file()
    assert json.loads((export / "config.json").read_text())["block_size"] == 8
    # Built under the test's own cache, as the small stand-in (never the shipped target's name).
    assert list((tmp_path / "cache").glob("demo-target-quick-*/build_info.json"))
    assert not list((tmp_path / "cache").glob("demo-target-v*"))
    assert json.loads((tmp_path / "demo" / "demo_result.json").read_text())["tau"] == result["tau"]
    out = capsys.readouterr().out
    for stage in ("1/6 target", "2/6 rows", "3/6 regen", "4/6 train", "5/6 export", "6/6 eval"):
        assert f"[demo] {stage} done in" in out
    assert "n-gram" in out and "lossless" in out
    # the plots, drawn by default, and where they are
    curves, acceptance = tmp_path / "demo" / "run" / "curves.png", tmp_path / "demo" / "acceptance.png"
    assert curves.read_bytes()[:4] == acceptance.read_bytes()[:4] == b"\x89PNG"
    assert result["curves_png"] == str(curves) and result["acceptance_png"] == str(acceptance)
    assert f"plots: {curves} (training curves), {acceptance}" in out


def test_demo_refuses_a_workdir_it_did_not_create(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not made by the demo"):
        run_demo(quick=True, workdir=tmp_path)
