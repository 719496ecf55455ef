"""Rows holding values Arrow's full validation rejects: in practice bytes that are not valid UTF-8 in a string column
(Parquet does not check them). Python cannot read such a row (verl's HF dataset raises ``UnicodeDecodeError``), so it
is a bad row; its quarantine record shows the invalid bytes as ``\\xNN`` escapes.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from ingest.accounting import input_row
from ingest.blocks import PROVENANCE_COLUMNS
from ingest.stages.bad_rows import BadRows


def invalid_value_rows(files: Sequence[str], table: pa.Table) -> BadRows:
    """The rows of ``table`` with a value that does not validate, each naming the first such column."""
    bad = BadRows(files, table)
    try:
        table.validate(full=True)  # cheap next to tokenizing the batch
        return bad
    except pa.ArrowInvalid:
        pass
    columns = [(name, table.column(name)) for name in table.column_names if not _validates(table.column(name))]
    for i in range(table.num_rows):
        for name, column in columns:
            try:
                column.take([i]).validate(full=True)  # take, not slice: a sliced list keeps all its children
            except pa.ArrowInvalid as exc:
                what = "text that is not valid UTF-8" if "UTF8" in str(exc) else "an invalid value"
                bad.add(i, f"{what} ({exc})", name)
                break
    return bad


def readable_row(table: pa.Table, i: int) -> dict:
    """What a quarantine record shows of a row that may hold invalid UTF-8: the row as read, or where it does not
    read, every column that reads cleanly as it is and the others with their invalid bytes as ``\\xNN`` escapes."""
    return input_row(table, i) or _lossy_row_dict(table, i)


def _validates(column: pa.ChunkedArray) -> bool:
    try:
        column.validate(full=True)
        return True
    except pa.ArrowInvalid:
        return False


def _text_as_binary(dtype: pa.DataType) -> pa.DataType:
    """``dtype`` with every string type replaced by the binary type of the same layout (a cast that never fails)."""
    if pa.types.is_string(dtype):
        return pa.binary()
    if pa.types.is_large_string(dtype):
        return pa.large_binary()
    if pa.types.is_list(dtype):
        return pa.list_(dtype.value_field.with_type(_text_as_binary(dtype.value_type)))
    if pa.types.is_large_list(dtype):
        return pa.large_list(dtype.value_field.with_type(_text_as_binary(dtype.value_type)))
    if pa.types.is_struct(dtype):
        return pa.struct([f.with_type(_text_as_binary(f.type)) for f in dtype])
    return dtype


def _decode_lossy(value):
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if isinstance(value, list):
        return [_decode_lossy(v) for v in value]
    if isinstance(value, dict):
        return {k: _decode_lossy(v) for k, v in value.items()}
    return value


def _lossy_row_dict(table: pa.Table, i: int) -> dict:
    """The row with invalid UTF-8 bytes shown as ``\\xNN`` escapes (columns that read cleanly are as they are)."""
    row = {}
    for name in table.column_names:
        if name in PROVENANCE_COLUMNS:
            continue
        value = table.column(name).slice(i, 1)
        try:
            row[name] = value.to_pylist()[0]
        except Exception:
            try:
                row[name] = _decode_lossy(value.cast(_text_as_binary(value.type)).to_pylist()[0])
            except Exception:
                row[name] = None
    return row
