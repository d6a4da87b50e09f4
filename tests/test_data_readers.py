"""Readers (JSONL, directories, datasets files; messages and ShareGPT) and every bad-input path."""

import json

import pytest

from dflash_train.config import DataConfig
from dflash_train.data import build_train_data
from dflash_train.data.readers import expand_paths, iter_chat_rows
from dflash_train.data.skips import SkipCounts
from dflash_train.tiny import CHAT_TEMPLATE, build_tokenizer

GOOD = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
    ]
}
SHAREGPT = {
    "conversations": [
        {"from": "system", "value": "be brief"},
        {"from": "human", "value": "hi"},
        {"from": "gpt", "value": "def add(a, b):\n    return a + b"},
    ]
}


def write_lines(path, lines):
    """Write raw lines (dicts become JSON, bytes are written as they are)."""
    with open(path, "wb") as fh:
        for line in lines:
            data = line if isinstance(line, bytes) else json.dumps(line).encode()
            fh.write(data + b"\n")
    return path


def read(paths, fmt="auto", max_bad_rows=0):
    skips = SkipCounts(max_bad_rows=max_bad_rows)
    rows = list(iter_chat_rows(expand_paths([str(p) for p in paths]), skips, fmt))
    return rows, skips


def build(tokenizer, path, tmp_path, max_bad_rows=0, **overrides):
    settings = dict(seq_buckets=[64, 128], token_budget=256, cache_dir=str(tmp_path / "cache"), num_workers=1)
    cfg = DataConfig(paths=[str(path)], max_bad_rows=max_bad_rows, **(settings | overrides))
    return build_train_data(cfg, tokenizer, seed=0, rank=0, world_size=1)


# ----------------------------------------------------------------------------- formats


def test_messages_and_sharegpt_rows_read_the_same(tmp_path):
    path = write_lines(tmp_path / "mixed.jsonl", [GOOD, SHAREGPT])
    rows, skips = read([path])
    assert [r.messages for r in rows] == [GOOD["messages"], GOOD["messages"]]
    assert [r.where for r in rows] == [f"{path}:1", f"{path}:2"]
    assert skips.to_dict() == {}


def test_forced_format_rejects_the_other_form(tmp_path):
    path = write_lines(tmp_path / "mixed.jsonl", [GOOD, SHAREGPT])
    with pytest.raises(ValueError, match=r"mixed.jsonl:2: bad row \(not_a_chat_row\)"):
        read([path], fmt="messages")


def test_directory_and_parquet_sources(tmp_path):
    import datasets

    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)
    write_lines(folder / "a.jsonl", [GOOD])
    write_lines(folder / "sub" / "b.jsonl", [SHAREGPT, GOOD])
    datasets.Dataset.from_list([GOOD, GOOD]).to_parquet(str(folder / "c.parquet"))
    rows, _ = read([folder])
    assert len(rows) == 5 and all(r.messages == GOOD["messages"] for r in rows)
    assert [r.where for r in rows][1:3] == [f"{folder / 'c.parquet'} row 0", f"{folder / 'c.parquet'} row 1"]


def test_a_folder_leaves_out_what_regen_and_synth_write_beside_their_rows(tmp_path, capsys):
    """regen's failed rows hold the original replies, synth's held-out prompts must never be trained
    on or regenerated for training, and synth's state is not rows: a folder given as data skips them
    and says so; named as a file, one is read."""
    folder = tmp_path / "data"
    (folder / "prompts.heldout").mkdir(parents=True)
    write_lines(folder / "regen.jsonl", [GOOD])
    write_lines(folder / "regen.failed.jsonl", [GOOD])
    write_lines(folder / "prompts.jsonl", [GOOD])
    (folder / "prompts.jsonl.state.json").write_text("{}")
    write_lines(folder / "prompts.heldout" / "code.jsonl", [GOOD])
    assert expand_paths([str(folder)]) == [str(folder / "prompts.jsonl"), str(folder / "regen.jsonl")]
    told = capsys.readouterr().err
    for name, why in [
        ("regen.failed.jsonl", "failed rows"),
        ("prompts.jsonl.state.json", "resume state"),
        ("code.jsonl", "held-out prompts"),
    ]:
        assert name in told and why in told
    assert expand_paths([str(folder / "regen.failed.jsonl")]) == [str(folder / "regen.failed.jsonl")]
    assert expand_paths([str(folder / "prompts.heldout")]) == [str(folder / "prompts.heldout" / "code.jsonl")]


def test_a_file_given_twice_is_read_once(tmp_path, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    write_lines(folder / "a.jsonl", [GOOD])
    write_lines(folder / "b.jsonl", [GOOD])
    files = expand_paths([str(folder), str(folder / "a.jsonl"), f"{folder}/../data/b.jsonl"])
    assert files == [str(folder / "a.jsonl"), str(folder / "b.jsonl")]
    told = capsys.readouterr().err
    assert told.count("given twice") == 2 and "read once" in told


def test_json_array_file_is_read_lazily(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([GOOD, GOOD, GOOD]))
    skips = SkipCounts()
    rows = iter_chat_rows([str(path)], skips, streaming=True)
    first = next(rows)  # a generator: nothing is loaded before the first row is asked for
    assert first.messages == GOOD["messages"] and first.where == f"{path} row 0"
    assert len(list(rows)) == 2


def test_content_parts_and_null_content_become_text(tmp_path):
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": None, "tool_calls": None},
            {"role": "assistant", "content": "ok"},
        ]
    }
    rows, _ = read([write_lines(tmp_path / "parts.jsonl", [row])])
    assert rows[0].messages == [
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": ""},
        {"role": "assistant", "content": "ok"},
    ]


# ----------------------------------------------------------------------------- bad input

BAD_LINES = [
    (b'{"messages": [', "malformed_json"),
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "invalid_utf8"),
    ({"messages": []}, "empty_messages"),
    (
        {"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]},
        "unknown_role",
    ),
    ({"messages": [{"content": "no role"}, {"role": "assistant", "content": "x"}]}, "unknown_role"),
    ({"conversations": [{"from": "bot", "value": "x"}]}, "unknown_role"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no_assistant_turn"),
    ({"text": "plain text"}, "not_a_chat_row"),
    ([1, 2, 3], "not_a_chat_row"),
    (  # which of the two is the conversation? (data.format=messages or sharegpt says)
        {
            "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
            "conversations": [{"from": "human", "value": "c"}, {"from": "gpt", "value": "d"}],
        },
        "ambiguous_chat_row",
    ),
]


@pytest.mark.parametrize("line,reason", BAD_LINES, ids=[r for _, r in BAD_LINES])
def test_bad_line_raises_naming_file_and_line(tmp_path, line, reason):
    path = write_lines(tmp_path / "bad.jsonl", [GOOD, line, GOOD])
    with pytest.raises(ValueError, match=rf"bad\.jsonl:2: bad row \({reason}\).*max_bad_rows"):
        read([path])


@pytest.mark.parametrize("line,reason", BAD_LINES, ids=[r for _, r in BAD_LINES])
def test_bad_line_is_a_counted_skip_within_the_limit(tmp_path, line, reason):
    path = write_lines(tmp_path / "bad.jsonl", [GOOD, line, GOOD])
    rows, skips = read([path], max_bad_rows=1)
    assert [r.line for r in rows] == [1, 3]
    assert skips.to_dict() == {reason: 1}


@pytest.mark.parametrize("fmt,first", [("messages", "a"), ("sharegpt", "c")])
def test_a_format_reads_its_key_of_a_row_that_has_both(tmp_path, fmt, first):
    path = write_lines(tmp_path / "both.jsonl", [BAD_LINES[-1][0]])
    rows, _ = read([path], fmt=fmt)
    assert rows[0].messages[0]["content"] == first


def test_exceeding_the_limit_raises_with_counts(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", [GOOD, b"{", {"messages": []}, b"nope", GOOD])
    with pytest.raises(ValueError, match=r"bad\.jsonl:4.*3 > data.max_bad_rows=2.*'malformed_json': 2"):
        read([path], max_bad_rows=2)


def test_response_too_short_and_all_masked(tmp_path, tokenizer):
    # Generation markers around the content only, so an empty reply has no response tokens at all.
    content_only = CHAT_TEMPLATE.replace(
        "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}",
        "{% generation %}{{ message['content'] }}{% endgeneration %}{{ '<|im_end|>' }}",
    )
    tok = build_tokenizer()
    tok.chat_template = content_only
    rows = [
        GOOD,
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}]},
    ]
    path = write_lines(tmp_path / "short.jsonl", rows)
    with pytest.raises(ValueError, match=r"short\.jsonl:2: bad row \(no_response_tokens\)"):
        build(tok, path, tmp_path)
    data = build(tok, path, tmp_path, max_bad_rows=2)
    assert data.stats.skips == {"no_response_tokens": 1, "no_valid_anchor": 1}
    assert data.stats.num_rows == 1 and data.stats.num_skipped == 2


def test_template_error_is_a_bad_row(tmp_path):
    tok = build_tokenizer()
    tok.chat_template = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}" + CHAT_TEMPLATE
    )
    path = write_lines(tmp_path / "t.jsonl", [GOOD, {"messages": GOOD["messages"][1:]}])
    with pytest.raises(ValueError, match=r"t\.jsonl:1: bad row \(template_error\).*user first"):
        build(tok, path, tmp_path)
    assert build(tok, path, tmp_path, max_bad_rows=1).stats.skips == {"template_error": 1}


def test_skip_counts_reach_the_stats_and_the_cache_enforces_a_lower_limit(tmp_path, tokenizer):
    path = write_lines(tmp_path / "bad.jsonl", [GOOD, b"{", b"\xff\xfe", GOOD])
    data = build(tokenizer, path, tmp_path, max_bad_rows=5, num_workers=2)
    assert data.stats.skips == {"malformed_json": 1, "invalid_utf8": 1}
    assert data.stats.num_rows == 2
    with pytest.raises(ValueError, match=r"bad\.jsonl:2 \(first malformed_json row\)"):
        build(tokenizer, path, tmp_path, max_bad_rows=1)  # same cache, stricter limit


def test_all_rows_bad_raises(tmp_path, tokenizer):
    path = write_lines(tmp_path / "bad.jsonl", [{"messages": []}])
    with pytest.raises(ValueError, match="no usable rows"):
        build(tokenizer, path, tmp_path, max_bad_rows=5)


def test_empty_paths_raise_with_a_remedy():
    with pytest.raises(ValueError, match="data.paths is empty"):
        expand_paths([])


# ----------------------------------------------------------------------------- bad input, other sources


def test_json_array_bad_rows_are_counted_skips_with_their_index(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([GOOD, 5, {"messages": []}, SHAREGPT, {"text": "x"}]))
    rows, skips = read([path], max_bad_rows=3)
    assert [r.where for r in rows] == [f"{path} row 0", f"{path} row 3"]  # mixed formats read per row
    assert skips.to_dict() == {"not_a_chat_row": 2, "empty_messages": 1}
    assert skips.examples["not_a_chat_row"] == f"{path} row 1: a row must be a JSON object, got int"
    with pytest.raises(ValueError, match=r"rows\.json row 1: bad row \(not_a_chat_row\).*max_bad_rows"):
        read([path])


def test_malformed_json_array_names_file_and_line(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text('[\n{"messages": []},\n{"messages": [}\n]')
    with pytest.raises(ValueError, match=r"rows\.json:3: malformed JSON.*convert it to JSONL"):
        read([path])


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = sorted({key for row in rows for key in row})  # every row gets every column, None if absent
    pq.write_table(pa.Table.from_pylist([{k: row.get(k) for k in columns} for row in rows]), str(path))
    return path


def test_parquet_bad_rows_are_counted_skips_with_their_index(tmp_path):
    path = write_parquet(tmp_path / "c.parquet", [GOOD, {"messages": []}, SHAREGPT, {"text": "x"}])
    rows, skips = read([path], max_bad_rows=2)
    assert [r.where for r in rows] == [f"{path} row 0", f"{path} row 2"]
    assert rows[1].messages == GOOD["messages"]  # a None 'messages' column does not hide 'conversations'
    assert skips.to_dict() == {"empty_messages": 1, "not_a_chat_row": 1}
    assert skips.examples["not_a_chat_row"].startswith(
        f"{path} row 3: row has no 'messages' or 'conversations'"
    )
    with pytest.raises(ValueError, match=r"c\.parquet row 1: bad row \(empty_messages\)"):
        read([path])


def test_unreadable_sources_name_the_source(tmp_path, monkeypatch):
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=r"broken\.parquet: cannot read data source.*ArrowInvalid"):
        read([broken])
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'org/chats' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(
        ValueError, match=r"org/chats: cannot read data source \(ConnectionError.*hub dataset"
    ):
        read(["org/chats"])
