"""One streaming pass over the dataset: consume (and optionally write) every row, then account for all of them."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ingest.config import DataConfig
from ingest.datasets.plan import FilesArg, InputPlan, plan_input
from ingest.datasets.pools import ensure_ray
from ingest.datasets.rl import build_dataset, cluster_layout
from ingest.datasets.store import StoreTotals, store_totals
from ingest.errors import IngestError, SourceError
from ingest.media.pixels import cpu_resize
from ingest.read.files import BadFile, conflicting_column, expand_files, inspect_files, printable_path, unify_schemas
from ingest.stats import RunLedger, RunSummary
from ingest.tokenizer.offline import resolve_model_path

OUTPUT_ROWS_PER_FILE = 50_000
logger = logging.getLogger(__name__)


def _storable(table: pa.Table) -> pa.Table:
    """Parquet cannot store a struct with no fields: drop all-``{}`` kwargs columns (``VerlCollate`` restores them)."""
    keep = [i for i, f in enumerate(table.schema) if not (pa.types.is_struct(f.type) and f.type.num_fields == 0)]
    return table.select(keep) if len(keep) != table.num_columns else table


def open_inside(directory: str | os.PathLike, name: str):
    """``directory/name`` opened for writing, never outside ``directory``.

    ``name`` is chosen by this module (never derived from data or config) and must be a plain file name; a symlink
    at that place is refused rather than followed (``O_NOFOLLOW``), so a planted link cannot redirect the write.
    """
    if not name or name in (".", "..") or "/" in name or os.sep in name or (os.altsep and os.altsep in name):
        raise ValueError(f"not a plain file name: {name!r}")
    path = os.path.join(directory, name)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if os.path.islink(path):
            raise IngestError(f"refusing to write through a symlink: {path} -> {os.readlink(path)}") from None
        raise IngestError(f"cannot write {path}: {exc.strerror}") from None
    return os.fdopen(fd, "wb")


class _PartWriter:
    """Writes batches to ``out_dir/part-NNNNN.parquet`` (names chosen here, so nothing lands outside ``out_dir``)."""

    def __init__(self, out_dir: str):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.part, self.rows_in_part, self.writer, self.handle = 0, 0, None, None

    def write(self, table: pa.Table) -> None:
        table = _storable(table)
        if self.writer is None or self.rows_in_part >= OUTPUT_ROWS_PER_FILE:
            self.close()
            self.handle = open_inside(self.dir, f"part-{self.part:05d}.parquet")
            self.writer = pq.ParquetWriter(self.handle, table.schema)
            self.part, self.rows_in_part = self.part + 1, 0
        self.writer.write_table(table)
        self.rows_in_part += table.num_rows

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.handle is not None:
            self.handle.close()
            self.handle = None


def write_quarantine(records: list[dict], out_dir: str) -> str:
    """The quarantine records as ``quarantine.parquet``: file, row, column, reason, original row as JSON, and
    ``rows``, the rows a record stands for (1 for a row; a whole file's row count, null when unknown, for a file)."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "quarantine.parquet")
    schema = pa.schema(
        [
            ("file", pa.string()),
            ("row", pa.int64()),
            ("column", pa.string()),
            ("reason", pa.string()),
            ("original", pa.string()),
            ("rows", pa.int64()),
        ]
    )
    records = [{**r, "rows": r.get("rows", 1)} for r in records]
    with open_inside(out_dir, "quarantine.parquet") as f:
        pq.write_table(pa.Table.from_pylist(records, schema=schema), f)
    return path


@dataclasses.dataclass
class RunReport(RunSummary):
    """``RunSummary`` plus the whole files quarantined before the run (unreadable, or not matching the dataset).

    The rows of a quarantined file whose footer could be read are in ``rows_in`` and ``quarantined`` (and in
    ``rows_quarantined_in_files``); a file whose row count is unknown is counted only in ``files_quarantined`` and
    ``files_quarantined_rows_unknown``. ``files`` counts every input file.
    """

    files_quarantined: int = 0
    files_quarantined_rows_unknown: int = 0
    rows_quarantined_in_files: int = 0
    layout: str | None = None  # the pools' layout and why (``Layout.describe``)
    image_resize: str | None = None  # media runs: how the CPU vision actors resize images (``cpu_resize``)
    # what the cluster's object store spilled to disk and restored during the run; None when Ray did not say
    object_store: StoreTotals | None = None

    @classmethod
    def of(cls, summary: RunSummary, bad_files: list[BadFile]) -> RunReport:
        report = cls(**{f.name: getattr(summary, f.name) for f in dataclasses.fields(summary)})
        report.files_quarantined = len(bad_files)
        report.files_quarantined_rows_unknown = sum(b.num_rows is None for b in bad_files)
        report.rows_quarantined_in_files = sum(b.num_rows or 0 for b in bad_files)
        report.files += len(bad_files)
        report.rows_in += report.rows_quarantined_in_files
        return report

    def format(self) -> str:
        lines = super().format().split("\n")
        if self.files_quarantined:
            at = next(i for i, line in enumerate(lines) if line.startswith("quarantined")) + 1
            note = f"  ({self.rows_quarantined_in_files:,} rows, in the counts above"
            if self.files_quarantined_rows_unknown:
                note += f"; {self.files_quarantined_rows_unknown} files of unknown size, rows not counted"
            lines.insert(at, f"quarantined files  {self.files_quarantined:>12,}{note})")
        if self.layout:
            lines.append(f"pool layout        {self.layout}")
        if self.image_resize:
            lines.append(f"CPU image resize   {self.image_resize}")
        spill = "unknown (the raylet did not answer)" if self.object_store is None else self.object_store.describe()
        lines.append(f"object store       {spill}")
        return "\n".join(lines)


def file_record(bad: BadFile) -> dict:
    err = bad.error
    return {
        "file": err.file,
        "row": None,
        "column": err.column,
        "reason": err.reason,
        "original": None,
        "rows": bad.num_rows,
    }


def plan_run(files: FilesArg, cfg: DataConfig, *, multimodal: bool = False) -> tuple[InputPlan, list[BadFile]]:
    """``plan_input`` with the file-level bad-input policy: (plan of the usable files, quarantined files).

    Whole files that cannot be used: not Parquet / truncated / empty (footer unreadable), no prompt column, columns of
    pickled Python objects, a column type that conflicts with the files before it. ``on_bad_row="raise"``: the first
    one raises ``SourceError`` naming it; ``"quarantine"``: they are left out and returned, unless no file is usable.
    Paths that do not exist or cannot be listed always raise (a configuration error, not bad data). The checks run
    again only when the plain plan fails, so a clean dataset costs nothing extra.
    """
    try:
        plan = plan_input(files, cfg, multimodal=multimodal)
    except SourceError as exc:
        if cfg.on_bad_row == "raise" or exc.file is None:  # strict, or not about one file (e.g. duplicates)
            raise
    else:
        try:
            unify_schemas(plan.infos)  # a type conflict fails here instead of in build_dataset
            return plan, []
        except SourceError:
            if cfg.on_bad_row == "raise":
                raise
    paths = expand_files(files, cfg.storage_options)
    bad: list[BadFile] = []
    usable: list[str] = []
    schema = None
    for info in inspect_files(paths, cfg.storage_options, bad=bad):
        if cfg.prompt_key not in info.schema.names:
            reason = f"no prompt column {cfg.prompt_key!r} (columns: {', '.join(info.schema.names)})"
            error = SourceError(reason, file=printable_path(info.path), column=cfg.prompt_key)
            bad.append(BadFile(info.path, error, info.num_rows))
            continue
        try:
            merged = (
                info.schema if schema is None else pa.unify_schemas([schema, info.schema], promote_options="permissive")
            )
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            reason = f"schema conflicts with the files before it: {exc}"
            error = SourceError(reason, file=printable_path(info.path), column=conflicting_column(exc))
            bad.append(BadFile(info.path, error, info.num_rows))
            continue
        schema = merged
        usable.append(info.path)
    bad.sort(key=lambda b: paths.index(b.path))
    if not usable:
        first = bad[0].error
        reason = f"{first.reason} (no usable input file: {len(bad)} of {len(paths)} rejected)"
        raise SourceError(reason, file=first.file, column=first.column)
    for b in bad:
        logger.warning("quarantined input file %s: %s", b.error.file, b.error.reason)
    return plan_input(usable, cfg, multimodal=multimodal), bad


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
    store_before = store_totals()
    plan, bad_files = plan_run(files, cfg, multimodal=processor is not None)
    run_id = uuid.uuid4().hex[:12]  # the ``run`` tag of the exported counters
    # the ledger lives on the driver's node: the run then outlives any other node, and that node goes only with it
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    ledger = RunLedger.options(scheduling_strategy=here).remote(run_id)
    layout = cluster_layout(cfg, media=processor is not None, plan=plan)
    cfg = layout.apply(cfg)
    ds = build_dataset(plan.files, tokenizer, cfg, processor=processor, ledger=ledger, plan=plan)
    summary = RunSummary(rows_in=plan.num_rows, files=len(plan.files), output_dir=output, run_id=run_id)
    writer = _PartWriter(output) if output else None
    summary = RunReport.of(summary, bad_files)  # rows of quarantined files count as rows in and quarantined
    summary.layout = layout.describe()
    summary.image_resize = cpu_resize(resolve_model_path(processor)) if processor is not None else None
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
    summary.quarantined = counts["quarantined"] + summary.rows_quarantined_in_files
    summary.prompt_tokens = counts["prompt_tokens"]
    summary.finish(started)
    store_after = store_totals() if store_before is not None else None
    summary.object_store = store_after.since(store_before) if store_after is not None else None
    records = [file_record(b) for b in bad_files]
    records += ray.get(ledger.quarantine.remote()) if counts["quarantined"] else []
    if records and (quarantine_dir or output):
        summary.quarantine_file = write_quarantine(records, quarantine_dir or output)
    if counts["rows_in"] != plan.num_rows or counts["rows_out"] != summary.rows_out:
        raise RuntimeError(
            f"row accounting mismatch: planned {plan.num_rows} rows in, stages saw {counts['rows_in']}; "
            f"stages emitted {counts['rows_out']}, consumer received {summary.rows_out}"
        )
    if not summary.accounted:
        raise RuntimeError(f"row accounting mismatch: {json.dumps(summary.to_dict())}")
    return summary


def write_summary_json(summary: RunSummary, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(summary.to_dict(), f, indent=2)
