"""The demo's corpus: the Python standard library's own sources, present on every machine.

``stdlib_files(split)`` lists the ``*.py`` files under ``sysconfig.get_paths()["stdlib"]`` that are
ordinary library code: test suites, IDLE, turtle demos, installed packages, the generated codec
tables of ``encodings`` (machine-made mapping tables), the pydoc topic dump and the interpreter's
build-specific ``_sysconfigdata*`` are left out, as are files over ``MAX_FILE_BYTES`` or not valid
UTF-8. The order is sorted by relative path, so the selection is a pure function of the interpreter
(its contents differ slightly between Python 3.11 and 3.12, which is fine: everything built from
it is cached per Python minor version).

Held-out split: a file is ``eval`` when ``sha1(relative posix path) mod EVAL_MODULUS == 0`` (about
1 in 16 files), ``train`` otherwise. The hash of the path, not its contents, decides, so a file keeps
its split across patch releases and machines.

``continuation_prompt`` is the one user-turn wording the demo target is trained on and the demo's
chat rows use ("continue this file"); ``file_chunks`` cuts a file into line-aligned pieces.
"""

from __future__ import annotations

import functools
import hashlib
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

EVAL_MODULUS = 16
MAX_FILE_BYTES = 256_000
MIN_FILE_BYTES = 200
# Directory names skipped anywhere under the stdlib root.
EXCLUDED_DIRS = frozenset(
    {
        "test",
        "tests",
        "idlelib",
        "site-packages",
        "dist-packages",
        "lib2to3",
        "turtledemo",
        "ensurepip",
        "encodings",
        "pydoc_data",
        "__pycache__",
        "__phello__",
    }
)
# Build-specific files (their contents depend on how this interpreter was configured).
EXCLUDED_PREFIXES = ("_sysconfigdata", "__hello__")

CONTINUATION_INSTRUCTION = "Continue this Python file."

Split = Literal["train", "eval"]


def stdlib_root() -> Path:
    """The directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_eval_file(relative_path: str) -> bool:
    """Whether a file (posix path relative to the stdlib root) belongs to the held-out split."""
    digest = hashlib.sha1(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % EVAL_MODULUS == 0


def _is_included(path: Path, root: Path) -> bool:
    relative = path.relative_to(root)
    if any(part in EXCLUDED_DIRS or part.startswith("config-") for part in relative.parts[:-1]):
        return False
    if path.name.startswith(EXCLUDED_PREFIXES):
        return False
    size = path.stat().st_size
    if not MIN_FILE_BYTES <= size <= MAX_FILE_BYTES:
        return False
    try:
        path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def stdlib_files(split: Split, root: Path | None = None) -> list[Path]:
    """The ``split`` ("train" or "eval") files of the stdlib corpus, sorted by relative path."""
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}: use 'train' or 'eval'")
    root = stdlib_root() if root is None else Path(root)
    want_eval = split == "eval"
    return [p for p in _corpus_files(root) if is_eval_file(p.relative_to(root).as_posix()) == want_eval]


@functools.lru_cache(maxsize=4)
def _corpus_files(root: Path) -> tuple[Path, ...]:
    # Cached: the scan decodes every file once (~1 s), and the stdlib does not change under us.
    if not root.is_dir():
        raise ValueError(f"standard library directory {root} does not exist; is this a full Python install?")
    return tuple(
        sorted(
            (p for p in root.rglob("*.py") if p.is_file() and _is_included(p, root)),
            key=lambda p: p.relative_to(root).as_posix(),
        )
    )


def read_source(path: Path) -> str:
    """A source file's text with newlines normalised to ``\\n`` (the corpus only has UTF-8 files)."""
    return path.read_bytes().decode("utf-8").replace("\r\n", "\n")


def file_chunks(text: str, max_chars: int) -> Iterator[str]:
    """Cut ``text`` into consecutive pieces of whole lines, each at most ``max_chars`` long.

    A single line longer than ``max_chars`` is cut at ``max_chars``. Joining the pieces gives back
    ``text`` exactly.
    """
    if max_chars <= 0:
        raise ValueError(f"max_chars={max_chars}: must be positive")
    piece: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        while len(line) > max_chars:
            if piece:
                yield "".join(piece)
                piece, size = [], 0
            yield line[:max_chars]
            line = line[max_chars:]
        if size + len(line) > max_chars and piece:
            yield "".join(piece)
            piece, size = [], 0
        piece.append(line)
        size += len(line)
    if piece:
        yield "".join(piece)


def continuation_prompt(prefix: str) -> str:
    """The user turn asking to continue a file from ``prefix``; the reply is the raw continuation."""
    return f"{CONTINUATION_INSTRUCTION}\n{prefix}"
