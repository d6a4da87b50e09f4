"""The device side of a lease: scripts/gpu_lease_setup.sh (the target and files sent in calls of their
own) and scripts/gpu_detached.sh (a job that outlives one device call)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
SCRIPT = SCRIPTS / "gpu_detached.sh"


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
    again = call("quick 0 bash -c 'echo hello; exit 7'", state, out, timeout=10)  # the same call again
    assert again.returncode == 7 and "started" not in again.stdout
    # Another command under a finished job's name once printed the old job's log and "finished, exit
    # 0" as if it had run; it is refused, and the old job's outcome stays.
    other = call("quick 30 bash -c 'echo new; exit 0'", state, out, timeout=10)
    assert other.returncode == 2 and "already started with another command" in other.stdout
    assert call("quick 0", state, out, timeout=10).returncode == 7


FAKE_CONVERTER = """import pathlib, sys
src, name, out = sys.argv[1:4]
pathlib.Path(out).mkdir(parents=True)
pathlib.Path(out, "config.json").write_bytes(pathlib.Path(src, name).read_bytes())
with open(pathlib.Path(src, "conversions"), "a") as fh:
    fh.write("1")
"""


def setup(args: str, repo: Path, tmp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "LEASE_TMP": str(tmp)}
    return subprocess.run(
        f"{SCRIPTS / 'gpu_lease_setup.sh'} {args}",
        shell=True,
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
    )


def test_the_target_is_assembled_from_calls_of_their_own_and_the_tree_copied_without_dev(tmp_path):
    repo, tmp = tmp_path / "repo", tmp_path / "tmp"
    (repo / ".dev" / "gguf-a").mkdir(parents=True)
    (repo / ".dev" / "gguf-b").mkdir()
    (repo / ".dev" / "rows").mkdir()
    (repo / ".dev" / "gguf-a" / "part").write_bytes(b"first half|")
    (repo / ".dev" / "gguf-b" / "part").write_bytes(b"second half")
    (repo / ".dev" / "gguf-b" / "real-target-convert.py").write_text(FAKE_CONVERTER)
    (repo / ".dev" / "rows" / "regen-rows.part00.jsonl.xz").write_bytes(b"rows")
    (repo / "scripts").mkdir()
    (repo / "scripts" / "job.py").write_text("print('job')\n")
    refused = setup("target", repo, tmp)  # part a never came (or the machine was not kept warm)
    assert refused.returncode == 1 and "run 'part-a'" in refused.stdout
    assert setup("part-a", repo, tmp).returncode == 0
    assert setup("files .dev/rows", repo, tmp).returncode == 0
    assert (tmp / "rows" / "regen-rows.part00.jsonl.xz").read_bytes() == b"rows"
    for _ in range(2):  # the second call (a fresh tree, say) converts nothing again
        done = setup("target", repo, tmp)
        assert done.returncode == 0, done.stderr
    assert (tmp / "smol" / "config.json").read_bytes() == b"first half|second half"
    assert (tmp / "smol-src" / "conversions").read_text() == "1"
    assert (tmp / "job" / "scripts" / "job.py").is_file() and not (tmp / "job" / ".dev").exists()


def test_a_failed_conversion_says_what_the_converter_needs_and_leaves_no_half_target(tmp_path):
    """The converter imports gguf, which the GPU machine lacks unless its wheel is carried: a lease's
    third call once failed with only the converter's traceback."""
    repo, tmp = tmp_path / "repo", tmp_path / "tmp"
    (repo / ".dev" / "gguf-a").mkdir(parents=True)
    (repo / ".dev" / "gguf-b").mkdir()
    (repo / ".dev" / "gguf-a" / "part").write_bytes(b"a")
    (repo / ".dev" / "gguf-b" / "part").write_bytes(b"b")
    failing = "import pathlib, sys\npathlib.Path(sys.argv[3]).mkdir(parents=True)\nsys.exit(1)\n"
    (repo / ".dev" / "gguf-b" / "real-target-convert.py").write_text(failing)
    assert setup("part-a", repo, tmp).returncode == 0
    failed = setup("target", repo, tmp)
    assert failed.returncode == 1 and "gpu-wheels.sh gguf" in failed.stdout
    assert not (tmp / "smol").exists()  # the next call converts again instead of using a half target


def test_prepare_restores_the_rows_and_splits_the_export_that_the_device_joins_byte_for_byte(tmp_path):
    """The rows and the trained export live in the history, not the tree; a fresh checkout (whose
    git-ignored .dev/ is empty) restores them and splits the export's weights into halves that fit a
    call each, and the device joins the halves back."""
    repo, tmp, shared = tmp_path / "repo", tmp_path / "tmp", tmp_path / "shared"
    (shared / "data" / "smollm2-135m").mkdir(parents=True)
    (shared / "data" / "smollm2-135m" / "heldout_synth.jsonl.gz").write_bytes(b"held out")
    rows = repo / "datasets" / "smollm2-135m-tasks"
    rows.mkdir(parents=True)
    for i in range(4):
        (rows / f"regen-rows.part0{i}.jsonl.xz").write_bytes(f"rows {i}".encode())
    export = tmp_path / "export-rows-92597-d2"
    export.mkdir()
    weights = os.urandom(46_000_000 + 1234)
    (export / "model.safetensors").write_bytes(weights)
    (export / "config.json").write_text("{}")
    (export / "SERVING.md").write_text("serve")
    parts = repo / "exports" / "smollm2-135m-dflash2-10k"
    parts.mkdir(parents=True)
    tar = subprocess.run(
        ["tar", "-cf", "-", "-C", str(tmp_path), export.name], capture_output=True, check=True
    )
    step = len(tar.stdout) // 6 + 1
    for i in range(6):
        (parts / f"export-rows-92597-d2.part0{i}.tar").write_bytes(tar.stdout[i * step : (i + 1) * step])

    def git(*args):
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "rows and export")
    commit = git("rev-parse", "HEAD").strip()
    for i in range(3):  # the first three parts of the rows and the export leave the tree
        (rows / f"regen-rows.part0{i}.jsonl.xz").unlink()
    for part in parts.iterdir():
        part.unlink()
    (parts / "README.md").write_text(  # what an export's README says once its parts left the tree
        f"mkdir -p .dev && for i in 00 01 02 03 04 05; do git show {commit[:7]}:exports/smollm2-135m-dflash2-10k/"
        "export-rows-92597-d2.part$i.tar; done | tar x -C .dev\n"
    )
    for half in "ab":  # the target's parts and the wheel are there
        (repo / ".dev" / f"gguf-{half}").mkdir(parents=True)
        (repo / ".dev" / f"gguf-{half}" / "part").write_bytes(half.encode())
    (repo / ".whl").mkdir()
    (repo / ".whl" / "gguf-0.19.0-py3-none-any.whl").write_bytes(b"w")
    env = {"ROWS_COMMIT": commit, "EXPORT": "exports/smollm2-135m-dflash2-10k", "SHARED": str(shared)}
    done = subprocess.run(
        f"{SCRIPTS / 'gpu_lease_setup.sh'} prepare",
        shell=True,
        cwd=repo,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    dev = repo / ".dev"
    assert [p.read_bytes() for p in sorted((dev / "rows").iterdir())] == [
        f"rows {i}".encode() for i in range(4)
    ]
    assert (dev / "heldout_synth.jsonl.gz").read_bytes() == b"held out"
    assert (dev / "exp1" / "st.00").stat().st_size == 46_000_000  # each half fits a call beside the tree
    assert setup("files .dev/exp1", repo, tmp).returncode == 0
    assert setup("files .dev/exp2", repo, tmp).returncode == 0
    joined = setup(f"export {tmp / 'export'}", repo, tmp)
    assert joined.returncode == 0, joined.stderr
    assert (tmp / "export" / "model.safetensors").read_bytes() == weights
    assert (tmp / "export" / "config.json").read_text() == "{}"
    # an export whose README has no restore command is named, not guessed at
    (repo / "exports" / "other").mkdir()
    (repo / "exports" / "other" / "README.md").write_text("trained elsewhere\n")
    other = subprocess.run(
        f"{SCRIPTS / 'gpu_lease_setup.sh'} prepare",
        shell=True,
        cwd=repo,
        env={**os.environ, **env, "EXPORT": "exports/other"},
        capture_output=True,
        text=True,
    )
    assert other.returncode == 1 and "exports/other/README.md has no restore command" in other.stdout
