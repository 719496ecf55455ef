"""The stages' one bad-row helper (``ingest/stages/bad_rows.py``): errors naming file, row and column, the first bad
row raised, or quarantine records in row order; what it keeps and what it counts add up to the batch."""

from __future__ import annotations

import pyarrow as pa
import pytest

from ingest.accounting import processed_row
from ingest.blocks import FILE_COLUMN, ROW_COLUMN
from ingest.errors import BadRowError
from ingest.stages.bad_rows import BadRows


def _batch() -> pa.Table:
    return pa.table(
        {
            "prompt": ["a", "b", "c", "d", "e"],
            "_internal": [0] * 5,
            FILE_COLUMN: pa.array([0, 0, 1, 1, 1], pa.int32()),
            ROW_COLUMN: pa.array([7, 8, 0, 1, 2], pa.int64()),
        }
    )


def test_errors_name_file_row_and_column():
    bad = BadRows(["first.parquet", "second.parquet"], _batch(), "prompt")
    bad.add(3, "no good")
    bad.add(1, "bad image", "images")
    with pytest.raises(BadRowError) as info:
        bad.raise_first("raise")
    assert str(info.value) == "file first.parquet, row 8, column 'images': bad image"
    bad.raise_first("quarantine")  # the other policy raises nothing


def test_quarantine_records_in_row_order_and_counts_add_up():
    table = _batch()
    bad = BadRows(["first.parquet", "second.parquet"], table, "prompt")
    bad.add(4, "later")
    bad.add(2, "earlier")
    bad.add(4, "replaced")  # a later reason for a row replaces the earlier one
    assert 2 in bad and 0 not in bad
    assert bad.kept() == [0, 1, 3]
    assert bad.good().tolist() == [True, True, False, True, False]
    assert len(bad) + len(bad.kept()) == table.num_rows
    records = bad.quarantine()
    assert [(r["file"], r["row"], r["column"], r["reason"]) for r in records] == [
        ("second.parquet", 0, "prompt", "earlier"),
        ("second.parquet", 2, "prompt", "replaced"),
    ]
    assert records[0]["original"] == '{"prompt": "c", "_internal": 0}'  # the row as read, without provenance
    assert bad.quarantine(processed_row)[0]["original"] == '{"prompt": "c"}'  # as a later stage has it


def test_no_bad_rows():
    bad = BadRows([], _batch())
    assert not bad and bad.kept() == [0, 1, 2, 3, 4] and bad.quarantine() == []
    bad.raise_first("raise")
