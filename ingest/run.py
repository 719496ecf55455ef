"""One streaming pass over the dataset: consume (and optionally write) every row, then account for all of them."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import ray

from ingest.config import DataConfig
from ingest.pipeline import build_dataset, plan_input
from ingest.stats import RunLedger, RunSummary

OUTPUT_ROWS_PER_FILE = 50_000


def ensure_ray() -> None:
    """Join the cluster this process runs in (a Ray job sets RAY_ADDRESS), else start a local one."""
    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=True)


def _storable(table: pa.Table) -> pa.Table:
    """Parquet cannot store a struct with no fields: drop all-``{}`` kwargs columns (``VerlCollate`` restores them)."""
    keep = [i for i, f in enumerate(table.schema) if not (pa.types.is_struct(f.type) and f.type.num_fields == 0)]
    return table.select(keep) if len(keep) != table.num_columns else table


class _PartWriter:
    """Writes batches to ``out_dir/part-NNNNN.parquet`` (names chosen here, so nothing lands outside ``out_dir``)."""

    def __init__(self, out_dir: str):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.part, self.rows_in_part, self.writer = 0, 0, None

    def write(self, table: pa.Table) -> None:
        table = _storable(table)
        if self.writer is None or self.rows_in_part >= OUTPUT_ROWS_PER_FILE:
            self.close()
            self.writer = pq.ParquetWriter(self.dir / f"part-{self.part:05d}.parquet", table.schema)
            self.part, self.rows_in_part = self.part + 1, 0
        self.writer.write_table(table)
        self.rows_in_part += table.num_rows

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def write_quarantine(records: list[dict], out_dir: str) -> str:
    """The quarantine records (file, row, column, reason, original row as JSON) as ``quarantine.parquet``."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "quarantine.parquet")
    schema = pa.schema(
        [
            ("file", pa.string()),
            ("row", pa.int64()),
            ("column", pa.string()),
            ("reason", pa.string()),
            ("original", pa.string()),
        ]
    )
    pq.write_table(pa.Table.from_pylist(records, schema=schema), path)
    return path


def run_pipeline(
    files,
    tokenizer,
    config: DataConfig | dict | None = None,
    *,
    processor=None,
    output: str | None = None,
    quarantine_dir: str | None = None,
    batch_size: int = 256,
) -> RunSummary:
    ensure_ray()
    cfg = DataConfig.from_any(config)
    started = time.perf_counter()
    plan = plan_input(files, cfg, multimodal=processor is not None)
    ledger = RunLedger.remote()
    ds = build_dataset(plan.files, tokenizer, cfg, processor=processor, ledger=ledger, plan=plan)
    summary = RunSummary(rows_in=plan.num_rows, files=len(plan.files), output_dir=output)
    writer = _PartWriter(output) if output else None
    try:
        for batch in ds.iter_batches(batch_size=batch_size, batch_format="pyarrow"):
            if summary.time_to_first_batch_s is None:
                summary.time_to_first_batch_s = time.perf_counter() - started
            summary.rows_out += batch.num_rows
            if writer is not None:
                writer.write(batch)
    finally:
        if writer is not None:
            writer.close()
    counts = ray.get(ledger.get.remote())
    summary.filtered_overlong = counts["filtered_overlong"]
    summary.quarantined = counts["quarantined"]
    summary.prompt_tokens = counts["prompt_tokens"]
    summary.finish(started)
    records = ray.get(ledger.quarantine.remote()) if summary.quarantined else []
    if records and (quarantine_dir or output):
        summary.quarantine_file = write_quarantine(records, quarantine_dir or output)
    if counts["rows_in"] != summary.rows_in or counts["rows_out"] != summary.rows_out:
        raise RuntimeError(
            f"row accounting mismatch: planned {summary.rows_in} rows in, stages saw {counts['rows_in']}; "
            f"stages emitted {counts['rows_out']}, consumer received {summary.rows_out}"
        )
    if not summary.accounted:
        raise RuntimeError(f"row accounting mismatch: {json.dumps(summary.to_dict())}")
    return summary


def write_summary_json(summary: RunSummary, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(summary.to_dict(), f, indent=2)
