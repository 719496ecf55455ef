"""Read units (``ingest/read/units.py``): planning, exact reads of split row groups, the first unit's ramp."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from ingest.blocks import FILE_COLUMN, ROW_COLUMN
from ingest.read.files import inspect_files
from ingest.read.units import plan_units, read_unit, split_first_unit


def test_units_split_a_big_row_group_exactly(tmp_path):
    table = pa.table({"prompt": [[{"role": "user", "content": str(i)}] for i in range(5000)], "i": range(5000)})
    pq.write_table(table, tmp_path / "big.parquet", row_group_size=5000)
    pq.write_table(table.slice(0, 900), tmp_path / "small.parquet", row_group_size=300)
    infos = inspect_files([str(tmp_path / "big.parquet"), str(tmp_path / "small.parquet")])
    units = plan_units(infos, rows_per_task=1000)
    assert [u.num_rows for u in units] == [1000] * 5 + [900]
    schema = infos[0].schema
    rows = [
        (t.column(FILE_COLUMN)[k].as_py(), t.column(ROW_COLUMN)[k].as_py(), t.column("i")[k].as_py())
        for u in units
        for t in [read_unit(u, infos[u.file_index].path, schema, {}, None)]
        for k in range(t.num_rows)
    ]
    assert [(f, r) for f, r, _ in rows] == [(0, r) for r in range(5000)] + [(1, r) for r in range(900)]
    assert all(r == i for _, r, i in rows)
    # two small units cut off the first in read order (the first batch waits for both), the rest read exactly once
    ramped = split_first_unit(units, 128)
    assert [u.num_rows for u in ramped] == [128, 128, 744] + [1000] * 4 + [900]
    rows = [
        t.column(ROW_COLUMN)[k].as_py()
        for u in ramped[:3]
        for t in [read_unit(u, infos[u.file_index].path, schema, {}, None)]
        for k in range(t.num_rows)
    ]
    assert rows == list(range(1000))
    assert split_first_unit(units, 0) == units and split_first_unit(units, 5000) == units
    assert [u.num_rows for u in split_first_unit(units, 600)] == [600, 400] + [1000] * 4 + [900]


def test_drawn_units_read_exactly_the_drawn_rows_in_file_order(tmp_path):
    """``max_samples``: rows drawn from all the files as one table (indices in file order) become units that read
    those rows only, in file order, with their provenance; a unit with none drawn is left out, and the first unit's
    ramp cuts the drawn rows, not the slice."""
    import numpy as np

    from ingest.read.units import drawn_units

    table = pa.table({"prompt": [[{"role": "user", "content": str(i)}] for i in range(5000)], "i": range(5000)})
    pq.write_table(table, tmp_path / "big.parquet", row_group_size=5000)
    pq.write_table(table.slice(0, 900), tmp_path / "small.parquet", row_group_size=300)
    infos = inspect_files([str(tmp_path / "big.parquet"), str(tmp_path / "small.parquet")])
    units = plan_units(infos, rows_per_task=1000)
    drawn = np.random.default_rng(3).choice(5900, size=700, replace=False)
    drawn = drawn[(drawn < 1000) | (drawn >= 2000)]  # none from the second unit
    picked = drawn_units(units, drawn, [5000, 900])
    assert len(picked) == len(units) - 1 and sum(u.num_rows for u in picked) == len(drawn)
    schema = infos[0].schema
    for ramp in (0, 40):
        read = [
            (t.column(FILE_COLUMN)[k].as_py(), t.column(ROW_COLUMN)[k].as_py(), t.column("i")[k].as_py())
            for u in split_first_unit(picked, ramp)
            for t in [read_unit(u, infos[u.file_index].path, schema, {}, None)]
            for k in range(t.num_rows)
        ]
        assert [5000 * f + r for f, r, _ in read] == sorted(drawn.tolist())
        assert all(r == i for _, r, i in read)
    assert [u.num_rows for u in split_first_unit(picked, 40)][:2] == [40, 40]
