"""The bad-input matrix (docs/bad-input.md): every case on real local Ray, in quarantine mode (the default: record the
row or file and go on, counts add up) and in strict mode (``on_bad_row: raise``: one error naming file, row, reason).

Cases already covered elsewhere are listed in docs/bad-input.md and not repeated here: bad images / ``<image>`` count
(tests/test_parity_multimodal.py), bad videos (tests/test_parity_video.py), a missing prompt column, a string prompt
and a message without a role in strict mode, a tokenizer directory that does not exist (tests/test_errors.py).
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from ingest import BadRowError, ModelLoadError, SourceError, build_dataset
from ingest.errors import find_ingest_error
from ingest.run import run_pipeline, write_summary_json
from ingest.stats import RunLedger
from tests.support.batches import collect
from tests.support.tiers import slow

QUARANTINE = {"shuffle": False}
STRICT = {"shuffle": False, "on_bad_row": "raise"}


def _good(i, **extra):
    return {
        "prompt": [{"role": "user", "content": f"question {i}"}],
        "data_source": "x",
        "extra_info": {"index": i},
        **extra,
    }


def _write(path, rows, **kwargs):
    pq.write_table(pa.Table.from_pylist(rows) if isinstance(rows, list) else rows, path, **kwargs)
    return str(path)


def _quarantine(summary) -> list[dict]:
    return pq.read_table(summary.quarantine_file).to_pylist() if summary.quarantine_file else []


def _accounted(summary) -> None:
    assert summary.accounted
    assert summary.rows_in == summary.rows_out + summary.filtered_overlong + summary.quarantined


def _indices(batches) -> list[int]:
    return [int(i) for b in batches for i in b["index"]]


def _invalid_utf8_strings(values: list[bytes]) -> pa.Array:
    """A Parquet-writable string array holding arbitrary bytes (pyarrow does not check UTF-8 on this path)."""
    data = b"".join(values)
    offsets = [0]
    for v in values:
        offsets.append(offsets[-1] + len(v))
    return pa.StringArray.from_buffers(len(values), pa.array(offsets, pa.int32()).buffers()[1], pa.py_buffer(data))


# --- prompts ---------------------------------------------------------------------------------------------------------


def test_bad_prompts_land_in_quarantine_parquet_with_their_rows(ray_session, model_dir, tmp_path):
    rows = [_good(i) for i in range(7)]
    rows[1]["prompt"] = []  # empty message list
    rows[2]["prompt"] = [{"content": "no role key"}]  # role missing (null in the Arrow struct)
    rows[3]["prompt"] = [{"role": "user", "content": None}]
    rows[5]["prompt"] = None  # not a list at all
    path = _write(tmp_path / "prompts.parquet", rows)
    out = tmp_path / "out"
    summary = run_pipeline([path], model_dir, QUARANTINE, output=str(out))
    _accounted(summary)
    assert (summary.rows_in, summary.rows_out, summary.quarantined) == (7, 3, 4)
    records = _quarantine(summary)
    assert summary.quarantine_file == str(out / "quarantine.parquet")
    assert [(r["file"], r["row"], r["column"], r["rows"]) for r in records] == [
        (path, i, "prompt", 1) for i in (1, 2, 3, 5)
    ]
    assert [r["reason"] for r in records] == [
        "prompt is an empty message list",
        "message 0 has no 'role' string",
        "message 0 (user) has content NoneType, expected a string",
        "prompt must be a list of chat messages, got NoneType",
    ]
    original = json.loads(records[1]["original"])
    assert original["prompt"] == [{"role": None, "content": "no role key"}] and original["extra_info"] == {"index": 2}
    out_rows = pq.read_table(out / "part-00000.parquet").column("extra_info").to_pylist()
    assert [r["index"] for r in out_rows] == [0, 4, 6]

    with pytest.raises(BadRowError) as info:
        run_pipeline([path], model_dir, STRICT)
    err = find_ingest_error(info.value)
    assert (err.file, err.row, err.column, err.reason) == (path, 1, "prompt", "prompt is an empty message list")


def test_string_and_binary_prompt_columns_are_bad_rows(ray_session, model_dir, tmp_path):
    strings = _write(tmp_path / "strings.parquet", [{"prompt": "just text", "data_source": "x"}] * 2)
    binary = _write(tmp_path / "binary.parquet", pa.table({"prompt": pa.array([b"\xff\x00", b"[]"], pa.binary())}))
    summary = run_pipeline([strings], model_dir, QUARANTINE, output=str(tmp_path / "s"))
    _accounted(summary)
    assert summary.rows_out == 0 and summary.quarantined == 2
    assert {r["reason"] for r in _quarantine(summary)} == {"prompt must be a list of chat messages, got str"}
    summary = run_pipeline([binary], model_dir, QUARANTINE, output=str(tmp_path / "b"))
    _accounted(summary)
    records = _quarantine(summary)
    assert [r["reason"] for r in records] == ["prompt must be a list of chat messages, got bytes"] * 2
    assert json.loads(records[0]["original"]) == {"prompt": "<bytes>"}


# --- empty and unreadable input ---------------------------------------------------------------------------------------


def test_empty_dataset_is_an_empty_accounted_run(ray_session, model_dir, tmp_path):
    path = _write(tmp_path / "empty.parquet", pa.Table.from_pylist([_good(0)]).slice(0, 0))
    for config in (QUARANTINE, STRICT):
        summary = run_pipeline([path], model_dir, config, output=str(tmp_path / "out"))
        _accounted(summary)
        assert (summary.rows_in, summary.rows_out, summary.quarantined, summary.files) == (0, 0, 0, 1)
        assert summary.quarantine_file is None and summary.files_quarantined == 0
    assert collect(build_dataset(path, model_dir, QUARANTINE)) == []


@pytest.fixture
def unreadable_files(tmp_path):
    """good (5 rows), a 0-byte file, a truncated file (footer gone), a text file, no prompt column, good (3 rows)."""
    first = _write(tmp_path / "a-good.parquet", [_good(i) for i in range(5)])
    (tmp_path / "b-empty.parquet").write_bytes(b"")
    whole = (tmp_path / "a-good.parquet").read_bytes()
    (tmp_path / "c-truncated.parquet").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "d-text.parquet").write_text("id,prompt\n1,hello\n")
    _write(tmp_path / "e-noprompt.parquet", [{"question": "q", "data_source": "x"}] * 4)
    _write(tmp_path / "f-good.parquet", [_good(i) for i in range(10, 13)])
    return first, sorted(str(p) for p in tmp_path.glob("*.parquet"))


def test_unreadable_files_are_quarantined_whole_and_the_run_goes_on(ray_session, model_dir, tmp_path, unreadable_files):
    _, files = unreadable_files
    out = tmp_path / "out"
    summary = run_pipeline(str(tmp_path), model_dir, QUARANTINE, output=str(out))  # the directory: sorted files
    _accounted(summary)
    assert summary.rows_out == 8 and summary.files == 6
    assert (summary.files_quarantined, summary.files_quarantined_rows_unknown) == (4, 2)
    # known sizes (0-byte file: 0 rows, no prompt column: 4 rows) are in rows in and quarantined; unknown ones are not
    assert (summary.rows_quarantined_in_files, summary.quarantined, summary.rows_in) == (4, 4, 12)
    records = _quarantine(summary)
    assert [(r["file"], r["row"], r["rows"]) for r in records] == [
        (files[1], None, 0),
        (files[2], None, None),
        (files[3], None, None),
        (files[4], None, 4),
    ]
    assert records[0]["reason"] == "cannot read as Parquet: ArrowInvalid: Parquet file size is 0 bytes"
    assert "magic bytes not found in footer" in records[1]["reason"]
    assert records[3]["reason"] == "no prompt column 'prompt' (columns: question, data_source)"
    assert records[3]["column"] == "prompt"
    text = summary.format()
    assert (
        "quarantined files             4  (4 rows, in the counts above; 2 files of unknown size, rows not counted)"
        in text
    )
    write_summary_json(summary, str(tmp_path / "summary.json"))
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["files_quarantined"] == 4 and saved["files_quarantined_rows_unknown"] == 2 and saved["accounted"]
    indices = pq.read_table(out / "part-00000.parquet").column("extra_info").to_pylist()
    assert [r["index"] for r in indices] == [0, 1, 2, 3, 4, 10, 11, 12]


def test_unreadable_file_strict_is_one_error_naming_it(ray_session, model_dir, tmp_path, unreadable_files):
    _, files = unreadable_files
    with pytest.raises(SourceError) as info:
        run_pipeline(files, model_dir, STRICT)
    assert str(info.value) == f"file {files[1]}: cannot read as Parquet: ArrowInvalid: Parquet file size is 0 bytes"


def test_no_usable_file_is_an_error_in_both_modes(ray_session, model_dir, tmp_path):
    (tmp_path / "empty.parquet").write_bytes(b"")
    (tmp_path / "text.parquet").write_text("not parquet")
    for config in (QUARANTINE, STRICT):
        with pytest.raises(SourceError) as info:
            run_pipeline(str(tmp_path), model_dir, config)
        assert info.value.file == str(tmp_path / "empty.parquet") and "0 bytes" in info.value.reason
        if config is QUARANTINE:
            assert info.value.reason.endswith("(no usable input file: 2 of 2 rejected)")


@slow
def test_corrupt_row_group_behind_a_readable_footer_follows_the_policy(ray_session, model_dir, tmp_path):
    """Footer fine, a data page broken: found only when that read unit is read, inside an actor. Quarantine mode:
    the unit's rows are quarantined (one record: file, first row, reason, rows) and the run goes on; strict mode:
    the run stops with the file, the unit's first row and the reason."""
    path = _write(tmp_path / "rg.parquet", [_good(i) for i in range(20)], row_group_size=10)
    meta = pq.ParquetFile(path).metadata.row_group(1).column(0)
    offset = meta.dictionary_page_offset or meta.data_page_offset
    data = bytearray((tmp_path / "rg.parquet").read_bytes())
    data[offset : offset + 16] = b"\xff" * 16  # the page header of row group 1's first column chunk
    (tmp_path / "rg.parquet").write_bytes(bytes(data))
    with pytest.raises(SourceError) as info:
        run_pipeline([path], model_dir, {**STRICT, "read_rows_per_task": 10})
    err = find_ingest_error(info.value)
    assert (err.file, err.row) == (path, 10) and err.reason.startswith("cannot read row groups [1]: OSError")
    summary = run_pipeline([path], model_dir, {**QUARANTINE, "read_rows_per_task": 10}, output=str(tmp_path / "out"))
    _accounted(summary)
    assert (summary.rows_in, summary.rows_out, summary.quarantined) == (20, 10, 10)
    (record,) = _quarantine(summary)
    assert (record["file"], record["row"], record["rows"]) == (path, 10, 10)
    assert record["reason"].startswith("cannot read row groups [1]: OSError")


# --- schemas ----------------------------------------------------------------------------------------------------------


@slow
def test_files_with_extra_or_missing_columns_union_with_nulls(ray_session, model_dir, tmp_path):
    """As verl's HF ``concatenate_datasets``: the union of the columns, null where a file lacks one (struct fields
    too), in first-seen order."""
    a = _write(tmp_path / "a.parquet", [{**_good(0), "difficulty": 3, "extra_info": {"index": 0, "split": "train"}}])
    b = _write(tmp_path / "b.parquet", [_good(1)])  # no difficulty column, extra_info without split
    batch = collect(build_dataset([a, b], model_dir, {**QUARANTINE, "return_raw_chat": True}))[0]
    assert list(batch["difficulty"]) == [3, None]
    assert _indices([batch]) == [0, 1]
    summary = run_pipeline([b, a], model_dir, STRICT, output=str(tmp_path / "out"))
    _accounted(summary)
    table = pq.read_table(tmp_path / "out" / "part-00000.parquet")
    assert table.column("difficulty").to_pylist() == [None, 3]
    assert table.column("extra_info").to_pylist() == [{"index": 1, "split": None}, {"index": 0, "split": "train"}]


@slow
def test_conflicting_column_types_quarantine_the_later_file(ray_session, model_dir, tmp_path):
    a = _write(tmp_path / "a.parquet", [_good(i) for i in range(3)])
    b = _write(tmp_path / "b.parquet", [{**_good(i), "data_source": i} for i in range(3, 5)])  # int, not string
    c = _write(tmp_path / "c.parquet", [_good(5)])
    summary = run_pipeline([a, b, c], model_dir, QUARANTINE, output=str(tmp_path / "out"))
    _accounted(summary)
    assert (summary.rows_out, summary.quarantined, summary.files_quarantined) == (4, 2, 1)
    (record,) = _quarantine(summary)
    assert (record["file"], record["row"], record["column"], record["rows"]) == (b, None, "data_source", 2)
    assert "schema conflicts with the files before it" in record["reason"] and "data_source" in record["reason"]
    with pytest.raises(SourceError) as info:
        run_pipeline([a, b, c], model_dir, STRICT)
    assert (info.value.file, info.value.column) == (b, "data_source") and "incompatible types" in info.value.reason
    # a conflict between two later files (the first has no such column): the later of the two is quarantined
    d = _write(tmp_path / "d.parquet", [{**_good(6), "level": 1}])
    e = _write(tmp_path / "e.parquet", [{**_good(7), "level": "hard"}])
    summary = run_pipeline([a, d, e], model_dir, QUARANTINE, output=str(tmp_path / "out2"))
    _accounted(summary)
    assert [(r["file"], r["column"]) for r in _quarantine(summary)] == [(e, "level")] and summary.rows_out == 4


# --- text that is not UTF-8 -------------------------------------------------------------------------------------------


def test_invalid_utf8_rows_are_quarantined_with_a_readable_original(ray_session, model_dir, tmp_path):
    rows = [_good(i) for i in range(5)]
    table = pa.Table.from_pylist(rows)
    sources = _invalid_utf8_strings([b"x", b"bad \xff\xfe source", b"x", b"x", b"x"])
    table = table.set_column(table.schema.get_field_index("data_source"), "data_source", sources)
    contents = _invalid_utf8_strings([b"question 0", b"question 1", b"question 2", b"caf\xe9 latin-1", b"question 4"])
    prompts = pa.ListArray.from_arrays(
        pa.array(range(6), pa.int32()),
        pa.StructArray.from_arrays([pa.array(["user"] * 5), contents], names=["role", "content"]),
    )
    table = table.set_column(table.schema.get_field_index("prompt"), "prompt", prompts)
    path = _write(tmp_path / "latin1.parquet", table)
    summary = run_pipeline([path], model_dir, QUARANTINE, output=str(tmp_path / "out"))
    _accounted(summary)
    assert (summary.rows_out, summary.quarantined) == (3, 2)
    records = _quarantine(summary)
    assert [(r["row"], r["column"]) for r in records] == [(1, "data_source"), (3, "prompt")]
    assert all(r["reason"].startswith("text that is not valid UTF-8") for r in records)
    assert json.loads(records[0]["original"])["data_source"] == "bad \\xff\\xfe source"
    assert json.loads(records[1]["original"])["prompt"] == [{"role": "user", "content": "caf\\xe9 latin-1"}]
    kept = pq.read_table(tmp_path / "out" / "part-00000.parquet").column("extra_info").to_pylist()
    assert [r["index"] for r in kept] == [0, 2, 4]
    with pytest.raises(BadRowError) as info:
        run_pipeline([path], model_dir, STRICT)
    err = find_ingest_error(info.value)
    assert (err.file, err.row, err.column) == (path, 1, "data_source") and "UTF-8" in err.reason


# --- tokenizer and overlong prompts -----------------------------------------------------------------------------------


def test_tokenizer_that_cannot_load_names_it(ray_session, model_dir, tmp_path):
    """A directory that passes the driver's check but does not load: the actor's ModelLoadError reaches the caller."""
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer"}))
    (broken / "tokenizer.json").write_text("{not json")
    path = _write(tmp_path / "ok.parquet", [_good(0)])
    with pytest.raises(Exception) as info:
        run_pipeline([path], str(broken), QUARANTINE)
    err = find_ingest_error(info.value)
    assert isinstance(err, ModelLoadError) and f"cannot load tokenizer {str(broken)!r}" in str(err)


def test_overlong_with_truncation_error(ray_session, model_dir, tmp_path):
    rows = [_good(i) for i in range(4)]
    rows[2]["prompt"] = [{"role": "user", "content": "many words " * 300}]
    path = _write(tmp_path / "long.parquet", rows)
    config = {"truncation": "error", "max_prompt_length": 64}
    summary = run_pipeline([path], model_dir, {**QUARANTINE, **config})  # the filter (default on) drops it
    _accounted(summary)
    assert (summary.rows_out, summary.filtered_overlong, summary.quarantined) == (3, 1, 0)
    for policy in (QUARANTINE, STRICT):  # filter off: the config asks for an error, as verl raises; both policies
        with pytest.raises(BadRowError) as info:
            run_pipeline([path], model_dir, {**policy, **config, "filter_overlong_prompts": False})
        err = find_ingest_error(info.value)
        assert (err.file, err.row) == (path, 2) and "longer than max_prompt_length=64 with truncation='error'" in str(
            err
        )


# --- accounting -------------------------------------------------------------------------------------------------------


class _MiscountingLedger:
    """Stands in for ``RunLedger`` in run.py: a real ledger that starts with phantom counts."""

    def __init__(self, phantom: dict):
        self.phantom = phantom

    def options(self, **options):
        return self

    def remote(self, *args, **kwargs):
        ledger = RunLedger.remote(*args, **kwargs)
        ray.get(ledger.add.remote(self.phantom, []))
        return ledger


@pytest.mark.parametrize(
    "phantom, message",
    [
        ({"rows_in": 1, "quarantined": 1}, "planned 3 rows in, stages saw 4"),  # a stage saw a row nobody planned
        ({"rows_out": 1}, "stages emitted 4, consumer received 3"),  # a row emitted but never delivered
        ({"quarantined": 1}, '"rows_in": 3, "rows_out": 3, "filtered_overlong": 0, "quarantined": 1'),  # in != sum
    ],
)
def test_accounting_mismatch_is_an_error(ray_session, model_dir, tmp_path, monkeypatch, phantom, message):
    path = _write(tmp_path / "ok.parquet", [_good(i) for i in range(3)])
    assert run_pipeline([path], model_dir, QUARANTINE).accounted
    monkeypatch.setattr("ingest.run.RunLedger", _MiscountingLedger(phantom))
    with pytest.raises(RuntimeError, match="row accounting mismatch") as info:
        run_pipeline([path], model_dir, QUARANTINE)
    assert message in str(info.value)
