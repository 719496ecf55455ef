"""Streaming Parquet read: one Ray read task per *read unit* (a run of rows inside one file), not per file.

Ray merges what one read task yields into blocks of up to ``target_max_block_size`` (128 MiB), so a 20,000-row file read
by one task reaches the tokenizer as one block and nothing leaves before all of it is tokenized. Small units make the
first batch independent of file size, spread work over every core, and give resume a granularity finer than a file.

Units follow row groups: consecutive row groups are grouped while they fit in ``rows_per_task``; a row group much
larger than that is split into at most ``MAX_SLICES_PER_ROW_GROUP`` row slices (each slice re-decodes the row group
prefix, so the split is capped).

Every row carries its provenance: ``_ingest_file`` (index into the file list) and ``_ingest_row`` (row in the file).
"""

from __future__ import annotations

import bisect
import dataclasses
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from ingest.accounting import BatchCounts, report_counts
from ingest.blocks import FILE_COLUMN, ROW_COLUMN
from ingest.errors import SourceError, StoreError
from ingest.read.files import (
    FileInfo,
    check_no_pickles,
    conform,
    open_parquet,
    printable_path,
    redacted_failure,
    store_failed,
)

MAX_SLICES_PER_ROW_GROUP = 16


@dataclass(frozen=True)
class ReadUnit:
    file_index: int
    row_groups: tuple[int, ...]
    first_row: int  # row index in the file of the first row of row_groups[0]
    slice_start: int  # rows to skip / keep inside the concatenated row groups
    slice_stop: int
    # the slice's rows to read (offsets from slice_start, ascending); None: all of them (rows drawn: max_samples)
    rows: tuple[int, ...] | None = None

    @property
    def num_rows(self) -> int:
        return self.slice_stop - self.slice_start if self.rows is None else len(self.rows)


class UnitIndex:
    """(file index, row in file) -> position of the row's read unit in the epoch's unit order."""

    def __init__(self, units: list[ReadUnit]):
        by_file: dict[int, list[tuple[int, int]]] = {}
        for order, unit in enumerate(units):
            by_file.setdefault(unit.file_index, []).append((unit.first_row + unit.slice_start, order))
        self._starts = {f: [s for s, _ in sorted(v)] for f, v in by_file.items()}
        self._orders = {f: [o for _, o in sorted(v)] for f, v in by_file.items()}

    def __call__(self, file_index: int, row: int) -> int:
        k = bisect.bisect_right(self._starts[file_index], row) - 1
        return self._orders[file_index][k]

    def of_block(self, table: pa.Table) -> np.ndarray:
        """The unit position of every row of a block that carries the provenance columns."""
        files, rows = table.column(FILE_COLUMN).to_numpy(), table.column(ROW_COLUMN).to_numpy()
        return np.fromiter((self(int(f), int(r)) for f, r in zip(files, rows, strict=True)), np.int64, len(rows))


def plan_units(infos: Sequence[FileInfo], rows_per_task: int) -> list[ReadUnit]:
    units: list[ReadUnit] = []
    for file_index, info in enumerate(infos):
        group: list[int] = []
        group_rows = 0
        group_first = 0
        row = 0
        for rg, rg_rows in enumerate(info.row_group_rows):
            if rg_rows > 2 * rows_per_task:
                if group:
                    units.append(ReadUnit(file_index, tuple(group), group_first, 0, group_rows))
                    group, group_rows = [], 0
                slices = min(MAX_SLICES_PER_ROW_GROUP, -(-rg_rows // rows_per_task))
                bounds = np.linspace(0, rg_rows, slices + 1).astype(int)
                units.extend(
                    ReadUnit(file_index, (rg,), row, int(a), int(b)) for a, b in zip(bounds, bounds[1:], strict=False)
                )
            else:
                if group and group_rows + rg_rows > rows_per_task:  # close the unit before it outgrows the target
                    units.append(ReadUnit(file_index, tuple(group), group_first, 0, group_rows))
                    group, group_rows = [], 0
                if not group:
                    group_first = row
                group.append(rg)
                group_rows += rg_rows
            row += rg_rows
        if group:
            units.append(ReadUnit(file_index, tuple(group), group_first, 0, group_rows))
    return [u for u in units if u.num_rows > 0]


def split_first_unit(units: list[ReadUnit], rows: int) -> list[ReadUnit]:
    """Cut ``rows`` rows off the first unit twice: two small units, then the rest (all read the same row groups,
    sliced). Two, because Ray Data's iterator (``prefetch_batches`` >= 1) takes in the second block before it hands
    on the first, so the first batch waits for both."""
    if not units or rows <= 0:
        return units
    first, heads = units[0], []
    while len(heads) < 2 and first.num_rows > rows:
        if first.rows is None:
            heads.append(dataclasses.replace(first, slice_stop=first.slice_start + rows))
            first = dataclasses.replace(first, slice_start=heads[-1].slice_stop)
        else:
            heads.append(dataclasses.replace(first, rows=first.rows[:rows]))
            first = dataclasses.replace(first, rows=first.rows[rows:])
    return [*heads, first, *units[1:]]


def drawn_units(units: list[ReadUnit], drawn: np.ndarray, file_rows: Sequence[int]) -> list[ReadUnit]:
    """``units`` (``plan_units``' order) reading only the rows ``drawn`` (indices into the files' rows taken in file
    order, as one table of them all): each unit its drawn rows, a unit with none left out."""
    starts = np.concatenate([[0], np.cumsum(file_rows)[:-1]]).astype(np.int64)
    drawn = np.sort(np.asarray(drawn, dtype=np.int64))
    out = []
    for unit in units:
        first = starts[unit.file_index] + unit.first_row + unit.slice_start
        lo, hi = np.searchsorted(drawn, [first, first + unit.num_rows])
        if hi > lo:
            out.append(dataclasses.replace(unit, rows=tuple(int(i) for i in drawn[lo:hi] - first)))
    return out


def shuffle_units(units: list[ReadUnit], seed: int, epoch: int = 0) -> list[ReadUnit]:
    order = list(units)
    random.Random(f"units:{seed}:{epoch}").shuffle(order)
    return order


def _row_permutation(unit: ReadUnit, seed: int, epoch: int) -> np.ndarray:
    rng = np.random.default_rng([seed, epoch, unit.file_index, unit.first_row + unit.slice_start])
    return rng.permutation(unit.num_rows)


def read_unit(
    unit: ReadUnit, path: str, schema: pa.Schema, storage_options: dict, shuffle_seed: int | None, epoch: int = 0
) -> pa.Table:
    """Read one unit as a table with ``schema`` plus the provenance columns."""
    pf = open_parquet(path, storage_options)
    try:
        if unit.slice_start == 0 and unit.slice_stop == sum(pf.metadata.row_group(g).num_rows for g in unit.row_groups):
            # one thread: a read runs inside a fractional-CPU actor (parallelism comes from the actors), and Arrow's
            # thread pool there costs more CPU than it saves (a third of the read's CPU on geo3k's image column)
            table = pf.read_row_groups(list(unit.row_groups), use_threads=False)
        else:  # a slice of one big row group: decode only up to the slice end
            batches, seen = [], 0
            for batch in pf.iter_batches(batch_size=4096, row_groups=list(unit.row_groups), use_threads=False):
                batches.append(batch)
                seen += batch.num_rows
                if seen >= unit.slice_stop:
                    break
            stop = unit.slice_stop - unit.slice_start
            table = pa.Table.from_batches(batches, schema=batches[0].schema).slice(unit.slice_start, stop)
    except SourceError:
        raise
    except Exception as exc:
        error = StoreError if store_failed(pf) else SourceError  # the store failing vs a corrupt data page
        raise error(
            redacted_failure(f"cannot read row groups {list(unit.row_groups)}", exc, path, storage_options),
            file=printable_path(path),
            row=unit.first_row + unit.slice_start,
        ) from None
    check_no_pickles(table.schema, path)  # the footer was checked when planning; the file may have changed since
    table = conform(table, schema)
    rows = np.arange(unit.num_rows, dtype=np.int64) if unit.rows is None else np.asarray(unit.rows, dtype=np.int64)
    if unit.rows is not None:
        table = table.take(rows)
    rows += unit.first_row + unit.slice_start
    if shuffle_seed is not None:
        perm = _row_permutation(unit, shuffle_seed, epoch)
        table, rows = table.take(perm), rows[perm]
    table = table.append_column(FILE_COLUMN, pa.array(np.full(unit.num_rows, unit.file_index, dtype=np.int32)))
    return table.append_column(ROW_COLUMN, pa.array(rows))


class ParquetUnitsDatasource(Datasource):
    """A Ray ``Datasource`` with one read task per ``ReadUnit`` (in the given order)."""

    def __init__(
        self,
        paths: Sequence[str],
        units: Sequence[ReadUnit],
        schema: pa.Schema,
        storage_options: dict | None = None,
        shuffle_seed: int | None = None,
        epoch: int = 0,
        on_bad_row: str = "raise",
        ledger=None,
    ):
        super().__init__()
        self._on_bad_row = on_bad_row
        self._ledger = ledger
        self._paths = list(paths)
        self._units = list(units)
        self._schema = schema
        self._storage_options = dict(storage_options or {})
        self._shuffle_seed = shuffle_seed
        self._epoch = epoch

    def get_name(self) -> str:
        return "ReadParquetUnits"

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None, data_context=None) -> list:
        out_schema = self._schema.append(pa.field(FILE_COLUMN, pa.int32())).append(pa.field(ROW_COLUMN, pa.int64()))
        tasks = []
        for unit in self._units:
            path = self._paths[unit.file_index]
            meta = BlockMetadata(num_rows=unit.num_rows, size_bytes=None, input_files=[path], exec_stats=None)
            tasks.append(
                ReadTask(
                    _UnitReader(
                        (unit, path, self._schema, self._storage_options, self._shuffle_seed, self._epoch),
                        out_schema,
                        self._on_bad_row,
                        self._ledger,
                    ),
                    meta,
                    schema=out_schema,
                    # Ray 2.48 has no per-task row limit (and never asks for one)
                    **({} if per_task_row_limit is None else {"per_task_row_limit": per_task_row_limit}),
                )
            )
        return tasks


class _UnitReader:
    """The read function of one task (a class, so it pickles without closures over the datasource).

    A unit whose row groups cannot be decoded (a corrupt data page behind a readable footer) raises with
    ``on_bad_row="raise"``; with ``"quarantine"`` its rows are reported to the ledger as quarantined (one record for
    the unit: file, first row, reason, ``rows``) and the read yields no rows, so the run goes on.
    """

    def __init__(self, args: tuple, out_schema: pa.Schema, on_bad_row: str = "raise", ledger=None):
        self.args, self.out_schema, self.on_bad_row, self.ledger = args, out_schema, on_bad_row, ledger

    def __call__(self) -> Iterator[pa.Table]:
        try:
            yield read_unit(*self.args)
        except SourceError as err:
            if self.on_bad_row != "quarantine" or isinstance(err, StoreError):  # a store outage is not bad data
                raise

            unit = self.args[0]
            record = {"file": err.file, "row": err.row, "column": None, "reason": err.reason, "original": None}
            counts = BatchCounts(rows_in=unit.num_rows, quarantined=unit.num_rows)
            key = ("unit", unit.file_index, unit.first_row + unit.slice_start)
            report_counts(self.ledger, counts, [{**record, "rows": unit.num_rows}], key)
            yield self.out_schema.empty_table()
