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
- A dataset that is not a local file (a hub name) is fingerprinted by its rows only.

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
    rows = np.bincount(np.asarray(tokenized.origins)[:, 0], minlength=len(tokenized.files))
    return [file_fingerprint(path, int(n)) for path, n in zip(tokenized.files, rows, strict=True)]


def fingerprint_changes(saved: list[dict[str, Any]], now: list[dict[str, Any]]) -> list[str]:
    """What changed between the fingerprints of a checkpoint and those of the data now, one phrase
    per changed file (``data file PATH changed since the checkpoint: ...``); [] when nothing did."""
    if len(saved) != len(now):
        return [
            f"data files changed since the checkpoint: {len(saved)} then "
            f"({', '.join(f['path'] for f in saved)}), {len(now)} now ({', '.join(f['path'] for f in now)})"
        ]
    changes = []
    for old, new in zip(saved, now, strict=True):
        what = []
        if old["size"] != new["size"]:
            what.append(f"size {old['size']} -> {new['size']} bytes")
        if old["rows"] != new["rows"]:
            what.append(f"rows {old['rows']} -> {new['rows']}")
        if old["sha256"] != new["sha256"] and old["hashed"] == new["hashed"]:
            what.append(f"contents (sha256 of the {new['hashed']}) differ")
        elif old["hashed"] != new["hashed"]:
            what.append(f"hashed as {old['hashed']!r} then, {new['hashed']!r} now")
        if what:
            moved = f" (then {old['path']})" if old["path"] != new["path"] else ""
            changes.append(f"data file {new['path']}{moved} changed since the checkpoint: {', '.join(what)}")
    return changes
