"""Run accounting: a small Ray actor that stages report their per-batch counts to, and the run summary."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pyarrow as pa
import ray

from ingest.accounting import BatchCounts, batch_key, report_counts

# Prometheus names (Ray prefixes ``ray_``): one counter per summary count, tagged with the run id.
METRIC_NAMES = {
    "rows_in": "ingest_rows_in",
    "rows_out": "ingest_rows_out",
    "filtered_overlong": "ingest_rows_filtered_overlong",
    "quarantined": "ingest_rows_quarantined",
    "prompt_tokens": "ingest_prompt_tokens",
    "dropped_no_target": "ingest_rows_dropped_no_target",
}


@ray.remote(num_cpus=0)
class RunLedger:
    """Sums the counts every stage actor reports (rows in / out / filtered / quarantined, prompt tokens).

    The same increments go to ``ray.util.metrics`` counters (tag ``run``), so a Prometheus scrape of the cluster's
    metrics endpoints sees the run's progress while it runs; their final values equal the summary's.
    """

    def __init__(self, run_id: str = "default"):
        from ray.util.metrics import Counter

        self.counts = BatchCounts()
        self.records: list[dict] = []
        self.seen: set[tuple] = set()
        self.run_id = run_id
        self.metrics = {
            key: Counter(name, description=f"{key.replace('_', ' ')} (ray-ingest)", tag_keys=("run",))
            for key, name in METRIC_NAMES.items()
        }

    def add(self, counts: dict, quarantine: list | None = None, key: tuple | None = None) -> None:
        # A stage task that dies after reporting is retried by Ray and reports the same batch again: count a keyed
        # batch once (exactly-once accounting over at-least-once execution).
        if key is not None:
            if key in self.seen:
                return
            self.seen.add(key)
        self.counts.add(BatchCounts(**counts))
        self.records.extend(quarantine or [])
        for key, value in counts.items():
            if value and key in self.metrics:
                self.metrics[key].inc(value, tags={"run": self.run_id})

    def get(self) -> dict:
        return dataclasses.asdict(self.counts)

    def quarantine(self) -> list[dict]:
        return list(self.records)


def stage_unit(stage, unit: pa.Table, batch_size: int, ledger) -> Iterator[pa.Table]:
    """Run a stage over one read unit in ``batch_size`` slices, reporting each slice's counts once."""
    for start in range(0, unit.num_rows, batch_size):
        batch = unit.slice(start, batch_size)
        result = stage(batch)
        report_counts(ledger, result.counts, result.quarantine, batch_key(batch))
        yield result.table


@dataclasses.dataclass
class RunSummary:
    rows_in: int = 0
    rows_out: int = 0
    filtered_overlong: int = 0
    quarantined: int = 0
    prompt_tokens: int = 0
    dropped_no_target: int = 0  # SFT: samples with no trained token in their window (a reason of its own)
    files: int = 0
    seconds: float = 0.0
    time_to_first_batch_s: float | None = None
    rows_per_s: float = 0.0
    tokens_per_s: float = 0.0
    output_dir: str | None = None
    quarantine_file: str | None = None
    run_id: str | None = None  # tag of this run's Prometheus counters (METRIC_NAMES)

    @property
    def accounted(self) -> bool:
        return self.rows_in == self.rows_out + self.filtered_overlong + self.quarantined + self.dropped_no_target

    def finish(self, started: float) -> RunSummary:
        self.seconds = time.perf_counter() - started
        self.rows_per_s = self.rows_out / self.seconds if self.seconds else 0.0
        self.tokens_per_s = self.prompt_tokens / self.seconds if self.seconds else 0.0
        return self

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["accounted"] = self.accounted
        return out

    def format(self) -> str:
        ttfb = "n/a" if self.time_to_first_batch_s is None else f"{self.time_to_first_batch_s:.2f} s"
        lines = [
            f"rows in            {self.rows_in:>12,}  ({self.files} files)",
            f"rows out           {self.rows_out:>12,}",
            f"filtered overlong  {self.filtered_overlong:>12,}",
            f"quarantined        {self.quarantined:>12,}",
            *([f"dropped: no target {self.dropped_no_target:>12,}"] if self.dropped_no_target else []),
            f"accounted          {'yes' if self.accounted else 'NO: rows in != out + filtered + quarantined'}",
            f"time               {self.seconds:>12.2f} s",
            f"rows/s             {self.rows_per_s:>12,.0f}",
            f"prompt tokens/s    {self.tokens_per_s:>12,.0f}",
            f"time to 1st batch  {ttfb:>14}",
        ]
        if self.output_dir:
            lines.append(f"output             {self.output_dir}")
        if self.quarantine_file:
            lines.append(f"quarantine records {self.quarantine_file}")
        return "\n".join(lines)
