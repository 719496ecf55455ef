"""The bad rows of one batch, the one way every stage keeps them: each a ``BadRowError`` naming file, row and
column, then either the first one raised (``on_bad_row="raise"``) or all of them as quarantine records.

A stage counts ``len(bad)`` as quarantined and passes on ``bad.kept()`` (or drops the rows ``bad.good()`` marks
False), so that its rows in = out + filtered + quarantined.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa

from ingest.accounting import input_row, quarantine_record, row_error
from ingest.errors import BadRowError


class BadRows:
    """The bad rows of ``table`` (by position), each with its ``BadRowError``, located through the table's provenance
    columns and ``files``. ``column``: the column an error names where ``add`` is given none."""

    __slots__ = ("_errors", "column", "files", "table")

    def __init__(self, files: Sequence[str], table: pa.Table, column: str | None = None):
        self.files, self.table, self.column = files, table, column
        self._errors: dict[int, BadRowError] = {}

    def add(self, i: int, reason: str, column: str | None = None) -> None:
        """Row ``i`` is bad for ``reason``; a later reason for the same row replaces the earlier one."""
        self._errors[i] = row_error(self.files, self.table, i, reason, column or self.column)

    def __contains__(self, i: int) -> bool:
        return i in self._errors

    def __len__(self) -> int:
        return len(self._errors)

    def raise_first(self, on_bad_row: str) -> None:
        """With ``on_bad_row="raise"``, raise the error of the first bad row (the lowest position), whichever check
        found it first."""
        if self._errors and on_bad_row == "raise":
            raise self._errors[min(self._errors)]

    def good(self) -> np.ndarray:
        """A boolean mask over the table's rows: True where a row is not bad."""
        mask = np.ones(self.table.num_rows, dtype=bool)
        mask[list(self._errors)] = False
        return mask

    def kept(self) -> list[int]:
        """The positions of the rows that are not bad, in order."""
        return [i for i in range(self.table.num_rows) if i not in self._errors]

    def quarantine(self, shown: Callable[[pa.Table, int], dict | None] = input_row) -> list[dict]:
        """The quarantine records, in row order; ``shown`` gives what a record holds of row ``i`` (``input_row``: the
        row as read; ``processed_row``: as a later stage has it)."""
        return [quarantine_record(err, shown(self.table, i)) for i, err in sorted(self._errors.items())]
