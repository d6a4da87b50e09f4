"""Chat data readers: JSONL files, directories of them, and anything ``datasets.load_dataset`` reads.

Rows come in two forms, detected per row (``data.format=auto``) or forced:
- ``messages``: ``{"messages": [{"role": "user", "content": "..."}, ...]}`` with roles
  system/user/assistant/tool; an assistant message may store the ids the target generated for it
  (``token_ids``, with the ``prompt_token_ids`` it was given, in full or as what they add to the
  previous reply's, ``data.stored_prompts``; written by ``regen``);
- ShareGPT ``conversations``: ``{"conversations": [{"from": "human", "value": "..."}, ...]}`` with
  human/gpt/system (mapped to user/assistant/system).

Everything is a generator, so a JSONL file is never loaded whole, and every row carries its origin
(file and 1-based line for JSONL, 0-based row index for JSON arrays, parquet/csv/arrow files and hub
datasets) so errors can point at it. Malformed JSON, invalid UTF-8 and rows that are not chats are
reported to a ``SkipCounts`` (which raises past ``data.max_bad_rows``) instead of being dropped
silently, whatever the source; a source that cannot be read at all is a ValueError naming it.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_train.data.skips import BadRowError, SkipCounts
from dflash_train.data.stored_prompts import FROM_PREVIOUS, SHARED_PROMPT_KEYS, TAIL, check_prompt_chain

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
}
JSONL_SUFFIXES = (".jsonl", ".json")
DATASET_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json"}
DIRECTORY_SUFFIXES = (".jsonl", ".json", ".parquet")
# What regen and synth write beside an output that is not its rows: regen's failed rows (their source
# rows, with the original replies in them), synth's resume state and its held-out prompts' folder. A
# folder given as data skips them, saying so; named as a file, one is read.
FAILED_ROWS_SUFFIX = ".failed.jsonl"
STATE_SUFFIX = ".state.json"
HELDOUT_DIR_SUFFIX = ".heldout"
# Stored token ids of an assistant message (lists of ids): what the target generated and the prompt
# it was given, in full or as the tail after what it shares with the previous reply's.
TOKEN_ID_KEYS = ("token_ids", "prompt_token_ids", TAIL)
# Every stored-ids key: the id lists and the count of shared prompt ids.
STORED_ID_KEYS = (*TOKEN_ID_KEYS, FROM_PREVIOUS)


@dataclass
class ChatRow:
    """One conversation in ``messages`` form with where it came from."""

    messages: list[dict[str, Any]]
    source: str
    line: int  # 1-based line of a JSONL file, or 0-based row index of a datasets source
    extra: dict[str, Any] | None = None  # the other top-level keys of the raw row (regen keeps them)

    @property
    def where(self) -> str:
        return format_where(self.source, self.line)


def format_where(source: str, line: int) -> str:
    """``file:line`` for line-read JSONL (1-based), ``file row i`` for datasets sources (0-based)."""
    return f"{source}:{line}" if reads_by_line(source) else f"{source} row {line}"


@functools.lru_cache(maxsize=4096)
def reads_by_line(file: str) -> bool:
    return file.endswith(JSONL_SUFFIXES) and os.path.isfile(file) and not is_json_array(file)


# ----------------------------------------------------------------------------- sources


def failed_rows_path(output: str | Path) -> Path:
    """``regen.jsonl`` -> ``regen.failed.jsonl``: the rows regen could not regenerate."""
    return Path(str(output).removesuffix(".jsonl") + FAILED_ROWS_SUFFIX)


def state_path(output: str | Path) -> Path:
    """``prompts.jsonl`` -> ``prompts.jsonl.state.json``: what a synth rerun continues from."""
    return Path(str(output) + STATE_SUFFIX)


def default_heldout_dir(output: str | Path) -> Path:
    """``prompts.jsonl`` -> ``prompts.heldout/``: synth's held-out prompts by task."""
    path = Path(output)
    return path.with_name(path.name.removesuffix(".jsonl") + HELDOUT_DIR_SUFFIX)


def not_rows(file: Path, folder: Path) -> str | None:
    """Why ``file``, found under the data ``folder``, is not training rows (None when it is)."""
    if file.name.endswith(FAILED_ROWS_SUFFIX):
        return "regen's failed rows, with their original replies"
    if file.name.endswith(STATE_SUFFIX):
        return "synth's resume state"
    if any(part.endswith(HELDOUT_DIR_SUFFIX) for part in file.relative_to(folder).parent.parts):
        return "synth's held-out prompts"
    return None


def expand_paths(paths: list[str]) -> list[str]:
    """Files and directories (recursively: *.jsonl, *.json, *.parquet) to a sorted file list.

    A directory's files that regen or synth wrote beside their outputs and that are not rows
    (``not_rows``) are left out, and a file given twice is read once, each named on stderr. A path
    that does not exist is kept as is: it is taken for a hub dataset name.
    """
    if not paths:
        raise ValueError(
            "data.paths is empty: give JSONL files, directories or dataset names, e.g. data.paths=[chat.jsonl]"
        )
    files: list[str] = []
    for path in paths:
        p = Path(path)
        if p.is_dir():
            found = []
            for f in sorted(p.rglob("*"), key=str):
                if not f.is_file() or f.suffix not in DIRECTORY_SUFFIXES:
                    continue
                if reason := not_rows(f, p):
                    print(f"data: not reading {f} ({reason}); name it as a file to read it", file=sys.stderr)
                else:
                    found.append(str(f))
            if not found:
                raise ValueError(f"{path}: directory has no *.jsonl/*.json/*.parquet files of rows")
            files.extend(found)
        else:
            files.append(str(p) if p.exists() else path)
    return read_once(files)


def read_once(files: list[str]) -> list[str]:
    """``files`` with each local file once (a folder and a file in it, or one file named twice, would
    train on or regenerate its rows twice); a repeat is named on stderr."""
    again = set(repeated_paths(files))
    for i in sorted(again):
        print(f"data: {files[i]} is given twice in the data paths: its rows are read once", file=sys.stderr)
    return [f for i, f in enumerate(files) if i not in again]


def repeated_paths(paths: list[str]) -> list[int]:
    """The indices of ``paths`` that name what an earlier one names, however spelled (``a``, ``./a``,
    ``sub/../a``; a hub name stands for itself)."""
    seen: set[str] = set()
    again = []
    for i, path in enumerate(paths):
        key = os.path.realpath(path)
        if key in seen:
            again.append(i)
        seen.add(key)
    return again


def fingerprint(files: list[str]) -> list[list[Any]]:
    """(path, size, mtime_ns) per local file; hub names stand for themselves (cache keyed by name)."""
    prints: list[list[Any]] = []
    for f in files:
        if os.path.isfile(f):
            st = os.stat(f)
            prints.append([os.path.abspath(f), st.st_size, st.st_mtime_ns])
        else:
            prints.append([f, None, None])
    return prints


def iter_raw_rows(file: str, skips: SkipCounts, streaming: bool = False) -> Iterator[tuple[int, dict]]:
    """(line or row index, row dict) of one source; bad lines/rows are recorded in ``skips``."""
    if reads_by_line(file):
        yield from iter_jsonl(file, skips)
    elif os.path.isfile(file) and file.endswith(JSONL_SUFFIXES):
        yield from iter_json_array(file, skips)
    else:
        yield from iter_dataset(file, streaming)


def is_json_array(file: str) -> bool:
    with open(file, "rb") as fh:
        head = fh.read(4096).lstrip()
    return head.startswith(b"[")


def iter_jsonl(file: str, skips: SkipCounts) -> Iterator[tuple[int, dict]]:
    """Parse a JSONL file line by line in binary, so invalid UTF-8 is caught per line."""
    with open(file, "rb") as fh:
        for line_no, data in enumerate(fh, start=1):
            if not data.strip():
                continue
            where = format_where(file, line_no)
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as err:
                skips.record("invalid_utf8", where, f"invalid UTF-8 at byte {err.start}")
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as err:
                skips.record("malformed_json", where, f"malformed JSON ({err.msg} at column {err.colno})")
                continue
            if not isinstance(row, dict):
                skips.record(
                    "not_a_chat_row", where, f"a row must be a JSON object, got {type(row).__name__}"
                )
                continue
            yield line_no, row


def iter_json_array(file: str, skips: SkipCounts) -> Iterator[tuple[int, dict]]:
    """Rows of a ``.json`` file holding one JSON array, with 0-based row indices.

    Read by us rather than by ``datasets``, which fails the whole file on one row that is not an
    object (or differs in type) without saying which. An array is parsed whole (as ``datasets``
    does too): for large data prefer JSONL, which is read line by line.
    """
    try:
        with open(file, encoding="utf-8") as fh:
            rows = json.load(fh)
    except UnicodeDecodeError as err:
        raise ValueError(f"{file}: invalid UTF-8 at byte {err.start}; re-encode the file as UTF-8.") from err
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{file}:{err.lineno}: malformed JSON ({err.msg} at column {err.colno}); a JSON-array file "
            "cannot skip a broken row: fix the file, or convert it to JSONL (one row per line)."
        ) from err
    if not isinstance(rows, list):
        raise ValueError(f"{file}: a .json data file must hold one array of rows, got {type(rows).__name__}.")
    for index, row in enumerate(rows):
        if isinstance(row, dict):
            yield index, row
        else:
            skips.record(
                "not_a_chat_row",
                format_where(file, index),
                f"a row must be a JSON object, got {type(row).__name__}",
            )


def iter_dataset(name: str, streaming: bool) -> Iterator[tuple[int, dict]]:
    """Rows of a local parquet/csv/arrow file or a hub dataset (split 'train'), with 0-based indices.

    Columnar formats give every row every column, None where a row had none: those are dropped so
    that a file mixing ``messages`` and ``conversations`` rows reads row by row like JSONL. A source
    that cannot be read becomes a ValueError naming it (and the row index where reading stopped).
    """
    import datasets  # lazy: importing datasets costs about a second

    index = -1
    try:
        builder = DATASET_SUFFIXES.get(Path(name).suffix)
        if builder is not None and os.path.isfile(name):
            ds = datasets.load_dataset(builder, data_files=name, split="train", streaming=streaming)
        else:
            ds = datasets.load_dataset(name, split="train", streaming=streaming)
        for index, row in enumerate(ds):
            yield index, {k: v for k, v in row.items() if v is not None}
    except (OSError, ValueError, TypeError, datasets.exceptions.DatasetsError) as err:
        where = name if index < 0 else format_where(name, index + 1)  # the row that could not be read
        cause = err.__cause__ or err
        raise ValueError(
            f"{where}: cannot read data source ({type(cause).__name__}: {str(cause)[:300]}); check that it is "
            "a readable parquet/csv/arrow/JSON(L) file or an available hub dataset name (offline? download it first)."
        ) from err


# ----------------------------------------------------------------------------- rows


def iter_chat_rows(
    files: list[str],
    skips: SkipCounts,
    fmt: str = "auto",
    streaming: bool = False,
    require_assistant: bool = True,
) -> Iterator[ChatRow]:
    """Every usable conversation of ``files`` in order; bad rows are counted in ``skips``."""
    for file in files:
        for line, raw in iter_raw_rows(file, skips, streaming):
            try:
                messages = normalize_messages(raw, fmt)
                if require_assistant and not any(m["role"] == "assistant" for m in messages):
                    raise BadRowError("no_assistant_turn", "the conversation has no assistant turn")
            except BadRowError as err:
                skips.record(err.reason, format_where(file, line), err.detail)
                continue
            extra = {k: v for k, v in raw.items() if k not in ("messages", "conversations")}
            yield ChatRow(messages=messages, source=file, line=line, extra=extra)


def normalize_messages(raw: dict[str, Any], fmt: str = "auto") -> list[dict[str, Any]]:
    """A raw row to a list of ``{"role", "content", ...}`` dicts; raises ``BadRowError``."""
    if fmt == "auto":
        if "messages" in raw and "conversations" in raw:
            raise BadRowError("ambiguous_chat_row", "row has both a 'messages' and a 'conversations' list")
        fmt = "messages" if "messages" in raw else "sharegpt" if "conversations" in raw else ""
    key = {"messages": "messages", "sharegpt": "conversations"}.get(fmt)
    if key is None or key not in raw:
        wanted = f"'{key}' list" if key else "'messages' or 'conversations' list"
        raise BadRowError("not_a_chat_row", f"row has no {wanted} (keys: {sorted(raw)[:8]})")
    turns = raw[key]
    if not isinstance(turns, list):
        raise BadRowError("not_a_chat_row", f"'{key}' must be a list, got {type(turns).__name__}")
    if not turns:
        raise BadRowError("empty_messages", f"'{key}' is empty")
    convert = to_message if key == "messages" else from_sharegpt
    messages = [convert(turn, i) for i, turn in enumerate(turns)]
    check_prompt_chain(messages)
    return messages


def to_message(turn: Any, index: int) -> dict[str, Any]:
    if not isinstance(turn, dict):
        raise BadRowError("not_a_chat_row", f"message {index} is not an object")
    role = turn.get("role")
    if role not in ROLES:
        raise BadRowError("unknown_role", f"message {index} has role {role!r}; use one of {list(ROLES)}")
    # Arrow sources fill absent struct fields with None; drop them so templates see "undefined".
    message = {k: v for k, v in turn.items() if v is not None}
    message["content"] = content_text(turn.get("content"), index)
    check_token_id_fields(message, index)
    return message


def check_token_id_fields(message: dict[str, Any], index: int) -> None:
    """The stored-ids fields of a message (docs/data.md, "Stored token ids"); raises ``BadRowError``.

    An assistant message may carry ``token_ids`` (the ids the target generated for this reply) with
    the ids it was given: ``prompt_token_ids``, or ``prompt_token_ids_from_previous`` (a count) with
    ``prompt_token_ids_tail`` (``data.stored_prompts``, which checks them against the row); the ids and
    their prompt or neither, lists of non-negative integers. Whether they are inside the vocabulary
    is checked where the tokenizer is known (``data.stored_ids``).
    """
    present = [key for key in STORED_ID_KEYS if key in message]
    if not present:
        return
    if message["role"] != "assistant":
        raise BadRowError(
            "malformed_token_ids",
            f"message {index} ({message['role']}) has {present[0]}; only assistant messages store ids",
        )
    shared = [key for key in SHARED_PROMPT_KEYS if key in message]
    if "token_ids" not in message or (not shared and "prompt_token_ids" not in message):
        have, missing = present[0], "token_ids" if "token_ids" not in message else "prompt_token_ids"
        raise BadRowError(
            "malformed_token_ids", f"message {index} has {have} without {missing}; store both or neither"
        )
    if shared and "prompt_token_ids" in message:
        raise BadRowError(
            "malformed_token_ids",
            f"message {index} has prompt_token_ids and {shared[0]}; store the prompt one way, not both",
        )
    if len(shared) == 1:
        missing = next(key for key in SHARED_PROMPT_KEYS if key not in shared)
        raise BadRowError(
            "malformed_token_ids", f"message {index} has {shared[0]} without {missing}; store both"
        )
    count = message.get(FROM_PREVIOUS, 0)
    if type(count) is not int or count < 0:  # bool is not a count
        raise BadRowError(
            "malformed_token_ids", f"message {index} {FROM_PREVIOUS} = {count!r} is not an integer >= 0"
        )
    for key in (key for key in TOKEN_ID_KEYS if key in message):
        ids = message[key]
        if not isinstance(ids, list):
            raise BadRowError(
                "malformed_token_ids",
                f"message {index} {key} must be a list of integers, got {type(ids).__name__}",
            )
        bad = next((j for j, t in enumerate(ids) if type(t) is not int or t < 0), None)  # bool is not an id
        if bad is not None:
            raise BadRowError(
                "malformed_token_ids",
                f"message {index} {key}[{bad}] = {ids[bad]!r} is not a token id (an integer >= 0)",
            )


def reply_finished(row: ChatRow) -> list[bool] | None:
    """Per assistant message of ``row``, in order, whether its reply ended on its own: the row's
    ``regen.finished`` (False where ``regen`` cut the reply at ``--max-new-tokens``; training gives
    such a reply no end-of-turn label, ``data.tokenize``). None for rows without that record (user
    data, ``synth`` output). Raises ``BadRowError``.

    ``regen`` generates the assistant turns of a row in order and writes one flag per reply, so the
    list pairs with the assistant messages one to one. A list of another length means the row was
    edited after regen (turns added or removed) and no flag can be trusted to name its reply: the row
    is a bad row (``malformed_regen_finished``), not trained with guessed labels.
    """
    regen = (row.extra or {}).get("regen")
    if not isinstance(regen, dict) or "finished" not in regen:
        return None
    finished = regen["finished"]
    if not isinstance(finished, list) or any(type(flag) is not bool for flag in finished):
        raise BadRowError(
            "malformed_regen_finished",
            f"regen.finished must be a list of true/false, one per assistant message; got {str(finished)[:60]}",
        )
    num_replies = sum(m["role"] == "assistant" for m in row.messages)
    if len(finished) != num_replies:
        raise BadRowError(
            "malformed_regen_finished",
            f"regen.finished has {len(finished)} flags for {num_replies} assistant messages (regen writes "
            "one per reply, in order: was the row edited after regen?); fix the list or remove regen.finished",
        )
    return finished


def from_sharegpt(turn: Any, index: int) -> dict[str, Any]:
    if not isinstance(turn, dict):
        raise BadRowError("not_a_chat_row", f"turn {index} is not an object")
    speaker = turn.get("from")
    if speaker not in SHAREGPT_ROLES:
        raise BadRowError(
            "unknown_role", f"turn {index} is from {speaker!r}; use one of {sorted(SHAREGPT_ROLES)}"
        )
    return {"role": SHAREGPT_ROLES[speaker], "content": content_text(turn.get("value"), index)}


def content_text(content: Any, index: int) -> str:
    """Message content as text: a string, None (empty), or OpenAI-style text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(p.get("text") or "" for p in content)
    raise BadRowError("not_a_chat_row", f"message {index} content must be text, got {type(content).__name__}")
