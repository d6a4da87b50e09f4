"""What ``gpu_data_scale.py`` brings back from a job and carries to the next: the synth bundle
(prompts, held-out files, synth state) and the regenerated rows, in parts that one device call
returns (at most ``PART_BYTES`` each), and the synth bundle unpacked again on a fresh machine."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import tarfile

PART_BYTES = 15 * 2**20


def bundle_synth(args) -> None:
    """The prompts, held-out files and synth state as ``synth.tar.gz`` (parts past 15 MiB) under --out."""
    files = [args.work / "prompts.jsonl", args.work / "prompts.jsonl.state.json"]
    files += sorted((args.work / "prompts.heldout").glob("*.jsonl"))
    if not files[0].exists():
        return
    whole = args.work / "synth.tar.gz"
    with tarfile.open(whole, "w:gz") as tar:
        for path in files:
            if path.exists():
                tar.add(path, arcname=str(path.relative_to(args.work)))
    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("synth*.tar.gz"):
        old.unlink()
    data = whole.read_bytes()
    if len(data) <= PART_BYTES:
        (args.out / "synth.tar.gz").write_bytes(data)
        return
    for i in range(0, len(data), PART_BYTES):
        (args.out / f"synth.part{i // PART_BYTES:02d}.tar.gz").write_bytes(data[i : i + PART_BYTES])


def bundle_rows(args, status: dict, part_bytes: int = PART_BYTES) -> subprocess.Popen | None:
    """Once regen has every row: ``regen-rows.partNN.jsonl.xz`` under --out (xz in parts of at most
    ``part_bytes``, so a call brings them back and a later lease carries them as ``--regen-rows``),
    then ``regen-rows.complete``. It runs beside training (``xz -T0``); the caller need not wait."""
    record, regen = status.get("regen", {}), args.work / "regen.jsonl"
    finished = record.get("done", 0) >= record.get("total", 1) or record.get("exhausted")
    if not finished or not regen.exists() or (args.out / "regen-rows.complete").exists():
        return None
    if shutil.which("xz") is None or shutil.which("split") is None:
        raise SystemExit("bundling the regenerated rows needs the xz and split commands")
    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("regen-rows.part*"):
        old.unlink()
    pipeline = (
        f"xz -T0 -6 -c {shlex.quote(str(regen))} | split -b {part_bytes} -d -a 2 --additional-suffix=.jsonl.xz"
        f" - {shlex.quote(str(args.out / 'regen-rows.part'))} && touch {shlex.quote(str(args.out / 'regen-rows.complete'))}"
    )
    return subprocess.Popen(["bash", "-c", f"set -o pipefail; {pipeline}"], start_new_session=True)


def bundle_partial_rows(args, status: dict, part_bytes: int = PART_BYTES) -> None:
    """A job whose budget ran out inside regen still brings its rows back: the complete lines of
    ``regen.jsonl`` (regen appends per batch; a line cut by the kill is left out) as
    ``regen-partial-N.partNN.jsonl.xz`` under --out. A later lease gives them as ``--regen-rows`` with
    the same ``--prompts``, and regen continues with the prompts they do not answer."""
    record, regen = status.get("regen", {}), args.work / "regen.jsonl"
    if record.get("done", 0) >= record.get("total", 1) or record.get("exhausted") or not regen.exists():
        return
    with open(regen, "rb") as f:
        rows = sum(1 for line in f if line.endswith(b"\n"))
    if rows == 0:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("regen-partial-*"):
        old.unlink()
    prefix = args.out / f"regen-partial-{rows}.part"
    pipeline = (
        f"head -n {rows} {shlex.quote(str(regen))} | xz -T0 -6 -c | split -b {part_bytes} -d -a 2"
        f" --additional-suffix=.jsonl.xz - {shlex.quote(str(prefix))}"
    )
    subprocess.run(["bash", "-c", f"set -o pipefail; {pipeline}"], check=True)
    status["regen_partial_rows"] = rows
    print(f"regen: {rows} rows so far bundled as {prefix.name}NN.jsonl.xz", flush=True)


def restore_synth(args) -> None:
    """A synth bundle from an earlier call, unpacked into an empty work folder (a fresh machine)."""
    if args.synth_from is None or (args.work / "prompts.jsonl").exists():
        return
    parts = sorted(args.synth_from.glob("synth.part*.tar.gz")) or [args.synth_from / "synth.tar.gz"]
    whole = args.work / "synth-restored.tar.gz"
    whole.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(whole) as tar:
        tar.extractall(args.work, filter="data")
    print(f"synth: continued from {', '.join(p.name for p in parts)}", flush=True)
