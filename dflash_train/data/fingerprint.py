"""What the data files of a run were: a fingerprint per file, saved in every checkpoint.

A resume replays the epoch plan from the saved (epoch, position); the plan is a function of the
rows, so a file edited, reordered or grown between two processes of a run would make the same
position pick other rows (some seen twice, some never), silently when the epoch keeps its number of
steps. The fingerprint is what a resume compares (``train/resume_check.py``):

- ``size`` in bytes and ``rows``, the rows of the file kept by tokenization (from the token cache,
  no extra read);
- ``sha256`` of the whole file up to ``SMALL_FILE_BYTES``, else of its first and last
  ``EDGE_BYTES`` and its size (``hashed`` says which): two small reads whatever the file's size, so a
  100K-row file costs milliseconds, and an edit of the first or last rows, an append or a truncation
  is caught. An edit in the middle of a large file that keeps its size and its kept row count is not.
- ``lengths``, a hash of the file's row lengths in tokens, in order: the epoch plan groups rows by
  length, so the same rows tokenized otherwise (the target's tokenizer or chat template, or
  ``data.format`` / ``data.thinking``, changed under the same paths) would also move the position.
- A dataset that is not a local file (a hub name) is fingerprinted by its rows and lengths only.

Files are compared in order, not by path: the same contents under another path (data moved) match.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np

# Files up to this size are hashed whole; larger ones by their first and last EDGE_BYTES.
SMALL_FILE_BYTES = 8 << 20
EDGE_BYTES = 1 << 20


def file_fingerprint(path: str, rows: int) -> dict[str, Any]:
    """The fingerprint of one data file (or dataset name) whose tokenization kept ``rows`` rows."""
    if not os.path.isfile(path):
        return {"path": path, "size": None, "rows": rows, "sha256": None, "hashed": "not a local file"}
    size = os.path.getsize(path)
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        if size <= SMALL_FILE_BYTES:
            digest.update(fh.read())
            hashed = "whole file"
        else:
            digest.update(fh.read(EDGE_BYTES))
            fh.seek(size - EDGE_BYTES)
            digest.update(fh.read(EDGE_BYTES))
            digest.update(str(size).encode())
            hashed = f"first and last {EDGE_BYTES >> 20} MiB"
    return {"path": path, "size": size, "rows": rows, "sha256": digest.hexdigest(), "hashed": hashed}


def data_fingerprint(tokenized) -> list[dict[str, Any]]:
    """The fingerprint of every file of a ``TokenizedData``, in its file order."""
    file_of_row = np.asarray(tokenized.origins)[:, 0]
    rows = np.bincount(file_of_row, minlength=len(tokenized.files))
    # each file's row lengths in row order (rows are stored file by file, but sort to be sure)
    by_file = np.split(
        np.asarray(tokenized.lengths)[np.argsort(file_of_row, kind="stable")], np.cumsum(rows)[:-1]
    )
    return [
        {**file_fingerprint(path, int(n)), "lengths": lengths_digest(lengths)}
        for path, n, lengths in zip(tokenized.files, rows, by_file, strict=True)
    ]


def lengths_digest(lengths: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(lengths, dtype=np.int64).tobytes()).hexdigest()[:16]


def fingerprint_changes(
    reference: list[dict[str, Any]],
    now: list[dict[str, Any]],
    *,
    changed: str = "changed since the checkpoint",
    reference_name: str = "then",
    current_name: str = "now",
) -> list[str]:
    """What differs between the fingerprints ``reference`` (a checkpoint's, rank 0's) and ``now``, one
    phrase per differing file (``data file PATH <changed>: ...``); [] when nothing does."""
    if len(reference) != len(now):
        listed = [", ".join(f["path"] for f in prints) for prints in (reference, now)]
        return [
            f"the data files {changed}: {len(reference)} {reference_name} ({listed[0]}), "
            f"{len(now)} {current_name} ({listed[1]})"
        ]
    differences = []
    for old, new in zip(reference, now, strict=True):
        what = []
        if old["size"] != new["size"]:
            what.append(f"size {old['size']} -> {new['size']} bytes")
        if old["rows"] != new["rows"]:
            what.append(f"rows {old['rows']} -> {new['rows']}")
        if old["hashed"] != new["hashed"]:
            what.append(f"hashed as {old['hashed']!r} {reference_name}, {new['hashed']!r} {current_name}")
        elif old["sha256"] != new["sha256"]:
            what.append(f"contents (sha256 of the {new['hashed']}) differ")
        lengths = old.get("lengths"), new.get("lengths")  # None: a checkpoint from before lengths
        if not what and None not in lengths and lengths[0] != lengths[1]:
            what.append(
                "the same rows tokenized to other lengths (the target's tokenizer or chat template, "
                "data.format or data.thinking changed)"
            )
        if what:
            moved = f" ({reference_name}: {old['path']})" if old["path"] != new["path"] else ""
            differences.append(f"data file {new['path']}{moved} {changed}: {', '.join(what)}")
    return differences


def check_every_rank_reads_the_same_data(
    local: list[dict[str, Any]] | None, source: list[dict[str, Any]], failure: BaseException | None = None
) -> None:
    """Every rank of the job (a collective): refuse to train when this rank's data files are not rank
    0's (``source``). Each rank loads its own token cache from the files it sees, so a node with
    another copy of a file (node-local data, an old sync) would train on other rows, or on another
    number of steps per epoch and leave its peers waiting in a collective. ``local``: this rank's
    fingerprints, None on a rank that reads no data (split placement's drafter ranks). Every rank
    raises the same ``ValueError``, naming the ranks and files.

    ``failure``: this rank's error loading its copy of the data (``local`` is then ignored). It is
    gathered too, so every rank raises it (a ``ValueError`` for bad data or a missing file, a
    ``RuntimeError`` otherwise, as ``data.loader.tokenize_and_broadcast``) instead of the others
    waiting here for a rank that left."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if failure is not None:
            raise failure
        return
    if failure is not None:  # a dict among the lists of differences
        mine: Any = {
            "error": f"{type(failure).__name__}: {failure}",
            "user": isinstance(failure, ValueError | OSError),
        }
    else:
        mine = [] if local is None else fingerprint_changes(
            source, local, changed="differs from rank 0's", reference_name="rank 0", current_name="here"
        )  # fmt: skip
    gathered: list[Any] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine)
    failed = [(rank, found) for rank, found in enumerate(gathered) if isinstance(found, dict)]
    if failed:
        kind = ValueError if all(found["user"] for _, found in failed) else RuntimeError
        errors = "; ".join(f"rank {rank} could not read the data: {found['error']}" for rank, found in failed)
        raise kind(
            f"{errors}. Every rank loads data.paths itself: make the files readable on every node, or put "
            "them on a shared file system."
        ) from failure
    problems = [f"rank {rank}: {difference}" for rank, found in enumerate(gathered) for difference in found]
    if problems:
        raise ValueError(
            f"the ranks read different data: {'; '.join(problems)}. Every rank must see the same contents "
            "of data.paths: copy the same files to every node, or put them on a shared file system."
        )
