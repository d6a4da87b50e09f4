"""Tokenize a dataset once, in parallel, into an on-disk cache that loads instantly.

Cache layout (one directory per key): ``ids.bin`` (int32, all rows concatenated), ``mask.bin``
(uint8 loss mask, same length), ``offsets.npy`` (int64 [N+1]), ``rows.npy`` (int64 [N, 2]: file
index, line), ``id_sources.npy`` (uint8 [N]: ``ID_*``, whether a row's replies are the generated
ids it stores, ``data.stored_ids``), ``cut_replies.npy`` (int32 [N]: replies cut at the generation
limit, trained without their end of turn), ``meta.json`` (files, skip counts, rows whose stored ids
fell back to their text, settings). Arrays are memory-mapped, so a dataset larger than RAM works. The
key hashes everything that changes the tokens: the tokenizer (its full serialisation), the chat
template, ``data.format``/``data.thinking``, the cache version (the row format training reads) and,
per data file, its path, size and mtime. Bucket and over-length settings are applied after loading, so changing them never
re-tokenizes. The directory is written under a temporary name and renamed when complete, so a
crash never leaves a half cache that looks valid.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import sys
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import numpy as np

from dflash_train.config import DataConfig
from dflash_train.data.readers import (
    ChatRow,
    expand_paths,
    fingerprint,
    format_where,
    iter_chat_rows,
    reply_finished,
)
from dflash_train.data.skips import BadRowError, SkipCounts
from dflash_train.data.stored_ids import FALLBACK_REASONS, tokenize_training_row
from dflash_train.data.tokenize import check_tokenizer

# 2: rows train from their stored token ids (id_sources.npy, meta "token_ids"); a cache of version 1
# tokenized such rows from their text.
# 3: a reply cut at the generation limit (regen.finished false) has no end-of-turn label
# (cut_replies.npy); a cache of version 2 labelled it.
# 4: a reply may store its prompt as what it adds to the previous reply's (data.stored_prompts); a
# cache of version 3 counted such rows as malformed_token_ids.
# 5: a reply's label starts no later than its content (data/tokenize.py ``content_start``); a cache
# of version 4 labelled the prompt of a row opening with an assistant message, and dropped the first
# label of a history reply starting with the generation prompt's first characters.
# 6: a reply with no user message before it (opening the row, or after a system prompt alone) trains
# under templates that refuse to render a conversation without a user query (Qwen3.5/3.6); a cache of
# version 5 skipped such rows as template_error.
# 7: the reply closing a row trains as its stored ids where the template renders it otherwise (Qwen's
# empty think block before a reply cut inside its reasoning); a cache of version 6 used its text.
# 8: so does the closing reply of a regen row without ids (regen --endpoint), as the prompt, its
# content's tokens and the end of turn; a cache of version 7 trained the template's rendering of it.
CACHE_VERSION = 8
# id_sources.npy codes: replies tokenized from text; from stored ids; from stored ids in a row whose
# regen.round_trip says the text would have tokenized to other ids.
ID_FROM_TEXT, ID_STORED, ID_STORED_NOT_ROUND_TRIP = 0, 1, 2
ROWS_PER_TASK = 32
# data.num_workers=0: at most this many tokenization processes (one reading thread feeds them all).
MAX_TOKENIZE_WORKERS = 16


@dataclass
class TokenizedData:
    """Every usable row of a dataset: ids and loss mask, plus where each row came from."""

    ids: np.ndarray  # int32 [T], all rows concatenated
    loss_mask: np.ndarray  # bool [T]
    offsets: np.ndarray  # int64 [N + 1]
    origins: np.ndarray  # int64 [N, 2]: index into files, line
    response_counts: np.ndarray  # int64 [N]: loss-mask tokens per row
    files: list[str]
    skips: SkipCounts
    directory: Path | None = None
    id_sources: np.ndarray | None = None  # uint8 [N]: ID_*; None: every row from its text
    # Rows that store ids but were tokenized from their text: {reason: count}, first example per reason.
    id_fallbacks: dict[str, int] = field(default_factory=dict)
    id_fallback_examples: dict[str, str] = field(default_factory=dict)
    cut_replies: np.ndarray | None = None  # int32 [N]: replies cut at the generation limit; None: none

    def __post_init__(self):
        if self.id_sources is None:
            self.id_sources = np.full(self.num_rows, ID_FROM_TEXT, dtype=np.uint8)
        if self.cut_replies is None:
            self.cut_replies = np.zeros(self.num_rows, dtype=np.int32)

    @property
    def num_rows(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def row(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.offsets[index], self.offsets[index + 1]
        return self.ids[lo:hi], self.loss_mask[lo:hi]

    def where(self, index: int) -> str:
        file_index, line = self.origins[index]
        return format_where(self.files[file_index], int(line))


# ----------------------------------------------------------------------------- keys


def default_cache_dir() -> Path:
    root = os.environ.get("DFLASH_TRAIN_CACHE") or Path.home() / ".cache" / "dflash-train"
    return Path(root) / "tokenized"


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the whole tokenizer (vocab, merges, normalizer, added tokens)."""
    if getattr(tokenizer, "is_fast", False):
        text = tokenizer.backend_tokenizer.to_str()
    else:
        text = json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()


def cache_key(cfg: DataConfig, tokenizer, files: list[str]) -> str:
    settings = {
        "version": CACHE_VERSION,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "chat_template": tokenizer.chat_template,
        "format": cfg.format,
        "thinking": cfg.thinking,
        "files": fingerprint(files),
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:24]


def cache_path(cfg: DataConfig, tokenizer, files: list[str]) -> Path:
    root = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    return root / cache_key(cfg, tokenizer, files)


# ----------------------------------------------------------------------------- load / build


def load_or_build(cfg: DataConfig, tokenizer, *, build: bool = True) -> TokenizedData | None:
    """The tokenized dataset of ``cfg``: from the cache, or built now (None if absent and not build)."""
    files = expand_paths(cfg.paths)
    directory = cache_path(cfg, tokenizer, files)
    if (directory / "meta.json").is_file():
        return load_cache(directory, cfg.max_bad_rows, files)
    if not build:
        return None
    build_cache(cfg, tokenizer, files, directory)
    return load_cache(directory, cfg.max_bad_rows, files)


def load_cache(directory: Path, max_bad_rows: int, files: list[str]) -> TokenizedData:
    """The cache in ``directory`` of the data ``files`` as named now. The key holds each file's
    absolute path, so a process that names the same files otherwise (relative to another working
    directory) loads the cache its builder wrote: the names recorded there may point elsewhere from
    here, and the fingerprints and row locations must use today's."""
    meta = json.loads((directory / "meta.json").read_text())
    assert len(files) == len(meta["files"]), (directory, files)  # the key fingerprints every file
    skips = SkipCounts(max_bad_rows=max_bad_rows, by_reason=meta["skips"], examples=meta["examples"])
    skips.check_limit()  # the cache may have been built under a higher data.max_bad_rows
    num_tokens = meta["num_tokens"]
    return TokenizedData(
        ids=memmap(directory / "ids.bin", np.int32, num_tokens),
        loss_mask=memmap(directory / "mask.bin", np.bool_, num_tokens),
        offsets=np.load(directory / "offsets.npy"),
        origins=np.load(directory / "rows.npy"),
        response_counts=np.load(directory / "response.npy"),
        files=files,
        skips=skips,
        directory=directory,
        id_sources=np.load(directory / "id_sources.npy"),
        id_fallbacks=meta["token_ids"]["fallback"],
        id_fallback_examples=meta["token_ids"]["examples"],
        cut_replies=np.load(directory / "cut_replies.npy"),
    )


def memmap(path: Path, dtype, count: int) -> np.ndarray:
    if count == 0:  # np.memmap refuses empty files
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


def build_cache(cfg: DataConfig, tokenizer, files: list[str], directory: Path) -> None:
    """Read, tokenize (``tokenize_workers(cfg)`` processes) and write; raises past ``max_bad_rows``."""
    check_tokenizer(tokenizer)
    skips = SkipCounts(max_bad_rows=cfg.max_bad_rows)
    staging = directory.with_name(f"{directory.name}.tmp-{os.getpid()}")
    staging.mkdir(parents=True, exist_ok=True)
    fallbacks = IdFallbacks()
    try:
        offsets, origins, response_counts, id_sources, cut_replies = write_rows(
            cfg, tokenizer, files, skips, fallbacks, staging
        )
        np.save(staging / "response.npy", np.asarray(response_counts, dtype=np.int64))
        np.save(staging / "id_sources.npy", np.asarray(id_sources, dtype=np.uint8))
        np.save(staging / "cut_replies.npy", np.asarray(cut_replies, dtype=np.int32))
        np.save(staging / "offsets.npy", np.asarray(offsets, dtype=np.int64))
        np.save(staging / "rows.npy", np.asarray(origins, dtype=np.int64).reshape(-1, 2))
        meta = {
            "files": files,
            "num_tokens": offsets[-1],
            "skips": skips.by_reason,
            "examples": skips.examples,
            "token_ids": {"fallback": fallbacks.by_reason, "examples": fallbacks.examples},
        }
        meta["settings"] = {"format": cfg.format, "thinking": cfg.thinking}
        (staging / "meta.json").write_text(json.dumps(meta, indent=1))
        publish(staging, directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if fallbacks.by_reason:
        print(fallbacks.warning(), file=sys.stderr)


@dataclass
class IdFallbacks:
    """Rows that store token ids but were tokenized from their text, by reason (``FALLBACK_REASONS``)."""

    by_reason: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)

    def record(self, reason: str, detail: str, *, where: str) -> None:
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1
        self.examples.setdefault(reason, f"{where}: {detail}")

    def warning(self) -> str:
        lines = [
            f"  {reason} ({n}): {FALLBACK_REASONS[reason]}; first: {self.examples[reason]}"
            for reason, n in sorted(self.by_reason.items())
        ]
        total = sum(self.by_reason.values())
        return (
            f"data: WARNING {total} rows store token ids that do not fit this tokenizer and chat "
            "template; they train from their text (as rows without ids do):\n" + "\n".join(lines)
        )


def publish(staging: Path, directory: Path) -> None:
    try:
        os.rename(staging, directory)
    except OSError:
        if not (directory / "meta.json").is_file():  # another rank finished first: keep its copy
            raise


def write_rows(
    cfg, tokenizer, files, skips: SkipCounts, fallbacks: IdFallbacks, staging: Path
) -> tuple[list, list, list, list, list]:
    """Stream tokenized rows into ids.bin/mask.bin; returns offsets, (file, line), response counts,
    id sources (``ID_*``) and cut replies per row."""
    from tqdm.auto import tqdm

    file_index = {f: i for i, f in enumerate(files)}
    rows = iter_chat_rows(files, skips, cfg.format, cfg.streaming)
    offsets, origins, response_counts, id_sources, cut_replies = [0], [], [], [], []
    with (
        open(staging / "ids.bin", "wb") as ids_out,
        open(staging / "mask.bin", "wb") as mask_out,
        tqdm(desc="tokenizing", unit=" rows", disable=None, file=sys.stderr) as bar,
    ):
        for row, (chat, bad) in tokenized_rows(rows, tokenizer, cfg):
            bar.update(1)
            error = BadRowError(*bad) if bad is not None else trainability_error(chat.loss_mask)
            if error is not None:
                skips.record(error.reason, row.where, error.detail)
                continue
            if chat.fallback is not None:
                fallbacks.record(*chat.fallback, where=row.where)
            ids_out.write(chat.ids.tobytes())
            mask_out.write(chat.loss_mask.astype(np.uint8).tobytes())
            offsets.append(offsets[-1] + len(chat.ids))
            origins.append((file_index[row.source], row.line))
            response_counts.append(int(chat.loss_mask.sum()))
            id_sources.append(id_source(chat.from_token_ids, row))
            cut_replies.append(chat.num_cut_replies)
    return offsets, origins, response_counts, id_sources, cut_replies


def id_source(from_token_ids: bool, row: ChatRow) -> int:
    """``ID_*`` of a kept row; regen's per-turn ``round_trip`` flags say whether its text would have
    tokenized to the generated ids (absent: unknown, counted as round-tripping)."""
    if not from_token_ids:
        return ID_FROM_TEXT
    regen = (row.extra or {}).get("regen")
    round_trip = regen.get("round_trip") if isinstance(regen, dict) else None
    return ID_STORED_NOT_ROUND_TRIP if isinstance(round_trip, list) and not all(round_trip) else ID_STORED


def trainability_error(mask: np.ndarray) -> BadRowError | None:
    """A row trains the drafter only if some anchor a has loss_mask[a] and loss_mask[a+1]."""
    if not mask.any():
        return BadRowError("no_response_tokens", "no assistant tokens after templating (all labels masked)")
    if not (mask[:-1] & mask[1:]).any():
        return BadRowError("no_valid_anchor", "fewer than 2 consecutive response tokens (no valid anchor)")
    return None


# ----------------------------------------------------------------------------- workers

_WORKER: dict = {}


def init_worker(tokenizer, thinking) -> None:
    _WORKER["tokenizer"], _WORKER["thinking"] = tokenizer, thinking


def tokenize_task(rows: list[ChatRow]) -> list[tuple]:
    """(``TokenizedChat``, None) or (None, (reason, detail)) per row: the bad row's reason as a tuple,
    since a ``BadRowError`` does not survive the trip back from a worker process (pickling an
    exception re-creates it from its message alone). A row's ``regen.finished`` goes with its
    messages (``data.readers.reply_finished``): a reply cut at the generation limit has no
    end-of-turn label."""
    results = []
    for row in rows:
        try:
            finished = reply_finished(row)
            chat = tokenize_training_row(_WORKER["tokenizer"], row.messages, _WORKER["thinking"], finished)
            results.append((chat, None))
        except BadRowError as err:
            results.append((None, (err.reason, err.detail)))
    return results


def tokenize_workers(cfg: DataConfig) -> int:
    """``data.num_workers``, or for 0 the CPUs this process may run on (its affinity, which a job
    scheduler sets), at most ``MAX_TOKENIZE_WORKERS``. Only one rank builds a cache, so the others'
    CPUs are free while it does: 2 workers took ~65 s for 92,597 rows of ~410 tokens."""
    if cfg.num_workers:
        return cfg.num_workers
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cpus, MAX_TOKENIZE_WORKERS))


def tokenized_rows(rows: Iterator[ChatRow], tokenizer, cfg: DataConfig) -> Iterator[tuple[ChatRow, tuple]]:
    """(row, (tokenized chat, error)) in input order, tokenized by ``tokenize_workers(cfg)`` processes."""
    chunks = iter(lambda: list(islice(rows, ROWS_PER_TASK)), [])
    workers = tokenize_workers(cfg)
    if workers <= 1:
        init_worker(tokenizer, cfg.thinking)
        for chunk in chunks:
            yield from zip(chunk, tokenize_task(chunk))
        return
    # fork: workers inherit the tokenizer without pickling and start in milliseconds; they only
    # run Python/Rust tokenization, never CUDA, so forking a CUDA-initialised parent is safe.
    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with ctx.Pool(workers, initializer=init_worker, initargs=(tokenizer, cfg.thinking)) as pool:
        # Reading stays in this thread (skips are counted in order) and only a bounded window of
        # chunks is in flight, so memory does not grow with the dataset.
        in_flight: deque = deque()
        for chunk in chunks:
            in_flight.append((chunk, pool.apply_async(tokenize_task, (chunk,))))
            if len(in_flight) >= 4 * workers:
                done, result = in_flight.popleft()
                yield from zip(done, result.get())
        while in_flight:
            done, result = in_flight.popleft()
            yield from zip(done, result.get())
