"""scripts/gpu_detached.sh: a job that outlives one device call, and calls whose output is piped."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_detached.sh"


def call(args: str, state: Path, out: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "DETACHED_DIR": str(state), "OUT": str(out)}
    return subprocess.run(
        f"{SCRIPT} {args}", shell=True, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_a_piped_call_returns_while_its_job_runs_and_a_later_call_reports_the_end(tmp_path):
    """The job once held the call's stdout, so `gpu_detached.sh ... | tail` waited for the whole job
    (a device call ran into its limit for nothing)."""
    state, out = tmp_path / "state", tmp_path / "out"
    out.mkdir()
    started = call(
        "job 0 bash -c 'echo working; sleep 20; echo finished' | tail -n 3", state, out, timeout=10
    )
    try:
        assert "job: started" in started.stdout and "still running" in started.stdout
        assert call("job 0", state, out, timeout=10).returncode == 3  # still running: exit 3
    finally:
        os.killpg(int((state / "job.pid").read_text()), signal.SIGTERM)
    # Killed before it could write its exit code: said so, not "still running" (nor "not started")
    # for ever.
    ended = call("job 30", state, out, timeout=40)
    assert ended.returncode == 4 and "job: ended without an exit code" in ended.stdout
    assert (out / "job.log").read_text().startswith("working")


def test_the_job_s_exit_code_is_the_call_s_once_it_ends(tmp_path):
    state, out = tmp_path / "state", tmp_path / "out"
    out.mkdir()
    assert call("quick 0", state, out, timeout=10).returncode == 2  # never started, no command
    first = call("quick 30 bash -c 'echo hello; exit 7'", state, out, timeout=40)
    assert first.returncode == 7 and "quick: finished, exit 7" in first.stdout
    assert call("quick 0", state, out, timeout=10).returncode == 7  # a later call: the same outcome
    assert (out / "quick.log").read_text() == "hello\n"
