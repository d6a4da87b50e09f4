"""scripts/gpu_checks.sh, the GPU procedure: its steps are `dflash-train bench` commands and the GPU
test suite, and every bench command parses into its mode's options (checked here on CPU, with a
stand-in ``python3`` that records what it is asked to run)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from dflash_train.cli import build_parser, options_from_args

REPO = Path(__file__).resolve().parents[1]
SEPARATOR = "\x1f"


def recorded_commands(tmp_path: Path, *groups: str, seconds: float = 0, **env_vars: str) -> list[list[str]]:
    """The argument lists of every ``python3`` call the script makes for ``groups`` (each bench call
    taking ``seconds``, the rest none)."""
    log, shim = tmp_path / "calls.txt", tmp_path / "bin" / "python3"
    shim.parent.mkdir()
    shim.write_text(
        f"#!/bin/sh\nprintf '%s{SEPARATOR}' \"$@\" >> {log}\necho >> {log}\ncase \"$*\" in *' bench '*) sleep {seconds};; esac\n"
    )
    shim.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{shim.parent}:{os.environ['PATH']}",
        "OUT": str(tmp_path / "logs"),
        "CKPT_DIR": str(tmp_path / "ckpt"),
        "SMOLLM2": "/models/smollm2",
        **env_vars,
    }
    subprocess.run(
        ["bash", "scripts/gpu_checks.sh", *groups], cwd=REPO, env=env, check=True, capture_output=True
    )
    return [line.split(SEPARATOR)[:-1] for line in log.read_text().splitlines()]


def test_every_gpu_step_is_a_bench_command_or_the_gpu_suite(tmp_path):
    from dflash_train.bench.modes import MODES

    calls = [c for c in recorded_commands(tmp_path) if c[:3] != ["-m", "pip", "install"] and c[0] != "-c"]
    digest = ["scripts/gpu_figures.py", "--print-source-digest"]  # the summary names the code by content
    assert calls.count(digest) == 1
    calls.remove(digest)
    benches = [c[3:] for c in calls if c[:3] == ["-m", "dflash_train.cli", "bench"]]
    others = [c for c in calls if c[:3] != ["-m", "dflash_train.cli", "bench"]]
    assert others == [["-m", "pytest", "-q", "-m", "gpu", "tests"]]
    modes = {args[0] for args in benches}
    assert modes == {"train", "lengths", "checkpoint", "eval", "decode", "generation"}
    for args in benches:
        parsed = build_parser().parse_args(["bench", *args])
        assert parsed.json is True and parsed.progress is False
        options_from_args(MODES[parsed.bench_mode].Options, parsed)  # every value is valid for its mode
    summary = (tmp_path / "logs" / "summary.txt").read_text()
    assert "train_27b_4k_fp8" in summary and "lengths_mixed_chat" in summary and "checkpoint_27b" in summary


def test_a_gpu_group_runs_alone_and_an_unknown_one_is_refused(tmp_path):
    calls = recorded_commands(tmp_path, "lengths")
    benches = [c for c in calls if c[:3] == ["-m", "dflash_train.cli", "bench"]]
    assert [c[3:5] for c in benches] == [["lengths", "short-chat"], ["lengths", "mixed-chat"]]
    refused = subprocess.run(
        ["bash", "scripts/gpu_checks.sh", "round2"], cwd=REPO, capture_output=True, text=True,
        env={**os.environ, "OUT": str(tmp_path / "other"), "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"},
    )  # fmt: skip
    assert refused.returncode == 2 and "unknown group round2" in refused.stderr


def test_no_file_name_in_the_repository_contains_round():
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    tracked = listed.stdout
    assert [path for path in tracked.splitlines() if "round" in Path(path).name.lower()] == []


def test_every_step_fits_one_device_call_and_the_budget_stops_the_rest(tmp_path):
    # One device call runs at most 600 s: no step may be given more than 570, and the steps of a group
    # together stop at BUDGET_S, the rest listed as not run.
    script = (REPO / "scripts" / "gpu_checks.sh").read_text()
    limits = [int(n) for n in re.findall(r"^\s*(?:bench_)?step \S+ (\d+) ", script, flags=re.MULTILINE)]
    assert len(limits) >= 15 and max(limits) <= 570
    # The first bench starts with ~40 s left whatever this machine's load; after its 15 s, under 30 s.
    calls = recorded_commands(tmp_path, "lengths", seconds=15, BUDGET_S="40")
    benches = [c[3:5] for c in calls if c[:3] == ["-m", "dflash_train.cli", "bench"]]
    assert benches == [["lengths", "short-chat"]]
    summary = (tmp_path / "logs" / "summary.txt").read_text()
    assert "lengths_mixed_chat       not run: under 30 s of BUDGET_S=40 left" in summary
