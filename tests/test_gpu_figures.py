"""scripts/gpu_figures.py, the owed GPU figures: the dry run end to end on CPU (every step's bench
command at the tiny presets), step selection, and steps that run past their limit or the budget."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "scripts" / "gpu_figures.py"


@pytest.fixture(scope="module")
def figures():
    spec = importlib.util.spec_from_file_location("gpu_figures", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_figures"] = module  # dataclasses resolve the module's annotations through it
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("gpu_figures")


def stub(figures, code: str, timeout_s: float = 60):
    """A step whose command is ``python -c code``; its figures are its JSON result."""
    return figures.Step(
        command=lambda options, limit_s: [sys.executable, "-c", code],
        timeout_s=timeout_s,
        figures=lambda result, log: result or {},
        line=lambda values: f"value {values['value']}",
    )


def read_results(out: Path) -> dict:
    return json.loads((out / "gpu_figures.json").read_text())


def test_the_dry_run_runs_every_step_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--work", str(tmp_path / "work")],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    results = read_results(out)
    steps = results["steps"]
    assert results["dry_run"] is True and list(steps) == [
        "train-bf16", "train-fp8", "checkpoint", "lengths-short", "lengths-mixed", "generation", "gpu-tests",
    ]  # fmt: skip
    assert all(record["status"] == "ok" and record["rc"] == 0 for record in steps.values())
    for name in ("train-bf16", "train-fp8"):
        train = steps[name]["figures"]
        assert train["tokens_per_s"] > 0 and train["compile"] == "none (target.compile off)"
        assert train["compiled_graphs_timed"] == 0 and train["eager_fallbacks"] == 0
    assert "--target-fp8" not in steps["train-fp8"]["command"] and steps["train-fp8"]["dry_run_note"]
    checkpoint = steps["checkpoint"]["figures"]
    assert set(checkpoint) == {"gather", "dcp-sync", "dcp-async", "dcp-async-pinned"}
    assert checkpoint.pop("dcp-async-pinned") == {"error": "not run: needs CUDA (pinned host memory)"}
    assert all(mode["checkpoint_bytes"] > 0 for mode in checkpoint.values())
    for name, distribution in (("lengths-short", "short-chat"), ("lengths-mixed", "mixed-chat")):
        assert distribution in steps[name]["command"]
        lengths = steps[name]["figures"]
        assert lengths["packing"]["real_tokens_per_s"] > 0 and lengths["packing_speedup"] > 0
        assert lengths["packing"]["padding_waste_epoch"] < lengths["buckets"]["padding_waste_epoch"]
    generation = steps["generation"]["figures"]
    assert set(generation["runs"]) == {"slots-uncompiled", "slots-flex"}
    assert all(run["rows_per_s"] > 0 for run in generation["runs"].values())
    assert generation["attention"][0]["grouped_ms"] > 0 and generation["attention"][0]["flex_ms"] > 0
    assert generation["sampler"][0]["exact_ms"] > 0
    assert (out / "generation_bench.json").exists() and not (
        SCRIPT.parents[1] / "generation_bench.json"
    ).exists()
    tests = steps["gpu-tests"]["figures"]
    assert tests["counts"]["skipped"] >= 1 and "failed" not in tests["counts"]  # GPU tests skip on CPU
    assert not (tmp_path / "work" / "checkpoint").exists()  # scratch removed
    # The table is printed last, one line per step, and kept in table.txt.
    table = (out / "table.txt").read_text().splitlines()
    assert done.stdout.strip().splitlines()[-8:] == table
    assert table[1].startswith("train-bf16") and "tok/s" in table[1] and "compile: none" in table[1]
    assert all((out / f"{name}.log").exists() for name in steps)


def test_steps_run_in_the_order_given_and_unknown_names_are_refused(figures, tmp_path, monkeypatch, capsys):
    assert figures.parse_args(["--steps", "lengths-mixed,train-bf16"]).steps == [
        "lengths-mixed",
        "train-bf16",
    ]
    for steps, message in (("train-bf16,train", "--steps train"), ("gpu-tests,gpu-tests", "named twice")):
        with pytest.raises(SystemExit):
            figures.parse_args(["--steps", steps])
        assert message in capsys.readouterr().err
    monkeypatch.setitem(figures.STEPS, "checkpoint", stub(figures, "print('{\"value\": 1}')"))
    monkeypatch.setitem(figures.STEPS, "gpu-tests", stub(figures, "print('{\"value\": 2}')"))
    out = tmp_path / "out"
    assert figures.main(["--steps", "gpu-tests,checkpoint", "--out", str(out), "--work", str(tmp_path)]) == 0
    assert list(read_results(out)["steps"]) == ["gpu-tests", "checkpoint"]
    assert sorted(p.name for p in out.glob("*.log")) == ["checkpoint.log", "gpu-tests.log"]
    last = capsys.readouterr().out.strip().splitlines()[-2:]  # the table, printed last
    assert [line.split()[:2] + line.split()[-2:] for line in last] == [
        ["gpu-tests", "ok", "value", "2"],
        ["checkpoint", "ok", "value", "1"],
    ]


def test_a_step_past_its_limit_is_killed_with_its_children_and_the_next_step_runs(
    figures, tmp_path, monkeypatch, capsys
):
    pid_file = tmp_path / "grandchild.pid"
    slow = (
        "import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        f"open({str(pid_file)!r}, 'w').write(str(child.pid)); print('started', flush=True); time.sleep(120)"
    )
    monkeypatch.setitem(figures.STEPS, "train-bf16", stub(figures, slow, timeout_s=2))
    monkeypatch.setitem(figures.STEPS, "train-fp8", stub(figures, "print('{\"value\": 7}')"))
    out = tmp_path / "out"
    started = time.monotonic()
    rc = figures.main(["--steps", "train-bf16,train-fp8", "--out", str(out), "--work", str(tmp_path)])
    assert rc == 1 and time.monotonic() - started < 60
    steps = read_results(out)["steps"]
    assert steps["train-bf16"]["status"] == "timeout" and steps["train-bf16"]["limit_s"] == 2
    assert "[killed at its 2 s limit]" in (out / "train-bf16.log").read_text()
    assert "started" in steps["train-bf16"]["log_tail"]
    time.sleep(0.5)
    assert not Path(f"/proc/{pid_file.read_text()}").exists() or "Z" in zombie_state(pid_file.read_text())
    assert steps["train-fp8"]["status"] == "ok" and steps["train-fp8"]["figures"] == {"value": 7}
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith("train-bf16     timeout") and lines[-1].endswith("value 7")


def zombie_state(pid: str) -> str:
    """The state letter of a process (Z: ended, not yet reaped by its parent)."""
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]


def test_a_step_that_no_longer_fits_the_budget_is_recorded_as_not_run(figures, tmp_path, monkeypatch):
    monkeypatch.setitem(figures.STEPS, "lengths-short", stub(figures, "import time; time.sleep(1.5)"))
    monkeypatch.setitem(figures.STEPS, "lengths-mixed", stub(figures, "print('{\"value\": 3}')"))
    out = tmp_path / "out"
    args = [
        "--steps",
        "lengths-short,lengths-mixed",
        "--budget-s",
        "31",
        "--out",
        str(out),
        "--work",
        str(tmp_path),
    ]
    assert figures.main(args) == 1
    steps = read_results(out)["steps"]
    assert steps["lengths-short"]["status"] == "ok" and steps["lengths-short"]["limit_s"] <= 31
    assert steps["lengths-mixed"] == {"status": "not run", "reason": "under 30 s of --budget-s 31 left"}
    assert "lengths-mixed  not run        -  under 30 s" in (out / "table.txt").read_text()


def test_a_stopped_script_ends_the_running_step_and_still_writes_the_table(figures, tmp_path, monkeypatch):
    # The step sends this process the SIGTERM a caller's limit would.
    code = "import os, signal, time; os.kill(os.getppid(), signal.SIGTERM); time.sleep(60)"
    monkeypatch.setitem(figures.STEPS, "gpu-tests", stub(figures, code))
    out = tmp_path / "out"
    started = time.monotonic()
    with pytest.raises(SystemExit) as stopped:
        figures.main(["--steps", "gpu-tests,checkpoint", "--out", str(out), "--work", str(tmp_path)])
    assert stopped.value.code == 143 and time.monotonic() - started < 30
    steps = read_results(out)["steps"]
    assert steps == {
        "gpu-tests": {
            "status": "stopped", "limit_s": 60, "reason": "this script was stopped during the step",
        },
    }  # fmt: skip
    assert "gpu-tests      stopped" in (out / "table.txt").read_text()


def test_pytest_figures_read_the_summary_line_and_the_failed_tests(figures):
    log = "\n".join(
        [
            "....F..",
            "FAILED tests/test_target_fp8.py::test_fp8_target_compiles_regionally_on_gpu - AssertionError: x",
            "1 failed, 27 passed, 412 deselected in 407.12s (0:06:47)",
        ]
    )
    got = figures.pytest_figures(None, log)
    assert got["counts"] == {"failed": 1, "passed": 27, "deselected": 412} and got["pytest_s"] == 407.12
    assert got["failed"] == ["FAILED tests/test_target_fp8.py::test_fp8_target_compiles_regionally_on_gpu"]
    assert figures.pytest_figures(None, "no tests ran in 0.01s") == {}


def test_the_gpu_tests_run_the_files_given_and_name_each_test_as_it_finishes(figures):
    """--tests lets the suite span device calls; -v names every finished test in a log cut at the limit."""
    options = figures.parse_args(["--steps", "gpu-tests", "--tests", "tests/test_a.py", "tests/test_b.py"])
    command = figures.gpu_tests(options, 100.0)
    assert command[-2:] == ["tests/test_a.py", "tests/test_b.py"] and "-v" in command and "-q" not in command
    assert figures.gpu_tests(figures.parse_args(["--steps", "gpu-tests"]), 100.0)[-1] == "tests"


def test_the_source_digest_names_the_code_by_content_not_by_commit(figures, tmp_path):
    """The device's git history can lag the tree it was sent: the header's ``source`` changes with
    any source file's content or name, ignores bytecode, and the CLI prints the same digest."""
    for folder in figures.SOURCE_FOLDERS:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "a.py").write_text("x = 1\n")
    first = figures.source_digest(tmp_path)
    (tmp_path / "dflash_train" / "__pycache__").mkdir()
    (tmp_path / "dflash_train" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    assert figures.source_digest(tmp_path) == first
    (tmp_path / "scripts" / "a.py").write_text("x = 2\n")
    changed = figures.source_digest(tmp_path)
    (tmp_path / "scripts" / "a.py").rename(tmp_path / "scripts" / "b.py")
    renamed = figures.source_digest(tmp_path)
    assert len({first, changed, renamed}) == 3 and len(first) == 12
    printed = subprocess.run(
        [sys.executable, str(SCRIPT), "--print-source-digest"], capture_output=True, text=True, check=True
    )
    assert printed.stdout.strip() == figures.source_digest()


def test_a_step_whose_bench_recorded_errors_is_partial_and_its_line_shows_them(
    figures, tmp_path, monkeypatch
):
    """A bench that exits 0 with failed engines, kernels or save modes in its JSON is not ``ok``."""
    import dataclasses

    generation = {
        "device": "NVIDIA H100",
        "runs": [
            {"engine": "slots-grouped-compiled", "batch_size": 1024, "status": "ok", "rows_per_s": 12.5,
             "generated_tokens_per_s": 3200.0, "warmup_decode_compile_s": 1.0},
            {"engine": "slots-flex-compiled", "batch_size": 1024, "status": "error: RuntimeError: capture failed"},
        ],
        "attention": [
            {"slots": 1024, "kv": 256, "status": "ok", "grouped_compiled_ms": 0.05, "flex_error": "RuntimeError: no triton"},
            {"slots": 256, "kv": 2048, "status": "error: OutOfMemoryError: CUDA out of memory"},
        ],
        "sampler": [{"rows": 64, "vocab": 248320, "status": "ok", "sort_ms": 0.3, "exact_compiled_error": "boom"}],
        "agreement": [
            {"batch_size": 1024, "reference": "slots-grouped-compiled", "engine": "slots-x", "status": "error: ValueError: v"}
        ],
    }  # fmt: skip
    save = {"stall_s": 1.0, "wall_s": 2.0, "peak_rss_gib": 3.0, "checkpoint_bytes": 2**30}
    checkpoint = {
        "modes": {
            "gather": {"saves": [save]},
            "dcp-sync": {"error": "exit code 0 but no JSON result on stdout (last line: ''): quiet"},
            "dcp-async-pinned": {"not_run": "needs CUDA (pinned host memory)"},
        }
    }
    for name, result in (("generation", generation), ("checkpoint", checkpoint)):
        code = f"import json; print(json.dumps({result!r}))"
        step = dataclasses.replace(
            figures.STEPS[name], command=lambda options, limit_s, code=code: [sys.executable, "-c", code]
        )
        monkeypatch.setitem(figures.STEPS, name, step)
    out = tmp_path / "out"
    assert figures.main(["--steps", "generation,checkpoint", "--out", str(out), "--work", str(tmp_path)]) == 1
    steps = read_results(out)["steps"]
    assert steps["generation"]["rc"] == 0 and steps["generation"]["status"] == "partial"
    assert steps["generation"]["errors"] == [
        "sampler 64x248320 exact_compiled: boom",
        "attention 1024x256 flex: RuntimeError: no triton",
        "attention 256x2048: error: OutOfMemoryError: CUDA out of memory",
        "slots-flex-compiled x1024: error: RuntimeError: capture failed",
        "agreement slots-x vs slots-grouped-compiled x1024: error: ValueError: v",
    ]
    assert steps["checkpoint"]["status"] == "partial"  # a mode not run (no CUDA) is recorded, not an error
    assert steps["checkpoint"]["errors"] == [
        "dcp-sync: exit code 0 but no JSON result on stdout (last line: ''): quiet"
    ]
    table = (out / "table.txt").read_text()
    generation_line = next(line for line in table.splitlines() if line.startswith("generation"))
    assert "None" not in generation_line and generation_line.split()[1] == "partial"
    assert "slots-grouped-compiled 12.5 rows/s" in generation_line
    assert "slots-flex-compiled error: RuntimeError: capture failed" in generation_line
    assert "flex failed (RuntimeError: no triton)" in generation_line
    assert "256x2048 error: OutOfMemoryError" in generation_line
    assert "checkpoint     partial" in table and "dcp-sync exit code 0 but no JSON" in table
