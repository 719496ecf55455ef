"""What stages report about rows: per-batch counts, quarantine records, and where a row came from (the provenance
columns of ``ingest.blocks``).

Light on imports (pyarrow, Ray, ``ingest.errors``): the decode actor reports bad media through it without importing
the tokenizer's modules.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow as pa

from ingest.blocks import (
    FILE_COLUMN,
    MULTI_MODAL_DATA,
    MULTI_MODAL_INPUTS,
    PROVENANCE_COLUMNS,
    ROW_COLUMN,
    TOKEN_COLUMNS,
)
from ingest.errors import BadRowError, IngestError


@dataclass
class BatchCounts:
    rows_in: int = 0
    rows_out: int = 0
    filtered_overlong: int = 0
    quarantined: int = 0
    prompt_tokens: int = 0  # tokens of the kept prompts (expanded), before truncation
    dropped_no_target: int = 0  # SFT samples whose window holds no trained token (no_target="drop")

    def add(self, other: BatchCounts) -> None:
        for key, value in vars(other).items():
            setattr(self, key, getattr(self, key) + value)


@dataclass
class StageResult:
    table: pa.Table
    counts: BatchCounts
    quarantine: list[dict] = field(default_factory=list)


def row_location(files: Sequence[str], table: pa.Table, i: int) -> tuple[str | None, int | None]:
    """(file, row) of row ``i`` of ``table`` from its provenance columns and ``files`` (None where a table has no
    provenance or a stage was built without the file list, as when called on its own)."""
    names = table.column_names
    file = table.column(FILE_COLUMN)[i].as_py() if FILE_COLUMN in names else None
    row = table.column(ROW_COLUMN)[i].as_py() if ROW_COLUMN in names else None
    return (files[file] if file is not None and file < len(files) else None), row


def row_error(files: Sequence[str], table: pa.Table, i: int, reason: str, column: str | None) -> BadRowError:
    """A ``BadRowError`` for row ``i`` of ``table``, located by ``row_location``."""
    file, row = row_location(files, table, i)
    return BadRowError(reason, file=file, row=row, column=column)


def quarantine_record(error, row: dict | None) -> dict:
    """A quarantine record of a ``BadRowError``: where, why, and the original row as JSON where it serialises."""
    try:
        original = json.dumps(row, ensure_ascii=False, default=lambda v: f"<{type(v).__name__}>")[:65536]
    except Exception:
        original = None
    return {"file": error.file, "row": error.row, "column": error.column, "reason": error.reason, "original": original}


class LedgerLostError(IngestError):
    """The run's ledger actor is gone (its node or process died): the counts it held are lost with it, so the run
    stops here rather than report totals that miss rows."""


# How long a ledger that does not answer may stay unreachable before the run gives up on it. Ray reports an actor on
# a lost node as unavailable until the GCS declares it dead; the ledger is never restarted, so it ends dead.
LEDGER_UNAVAILABLE_S = 30.0


def report_counts(ledger, counts: BatchCounts, quarantine: list | None = None, key: tuple | None = None) -> None:
    # Synchronous (one small round trip per batch) so the totals are complete when the dataset is exhausted.
    if ledger is None:
        return
    import ray
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    deadline = time.monotonic() + LEDGER_UNAVAILABLE_S
    while True:
        try:
            ray.get(ledger.add.remote(dataclasses.asdict(counts), quarantine or [], key))
            return
        except ActorUnavailableError as exc:
            # the call may or may not have landed; sending it again is safe for a keyed batch (the ledger counts a
            # key once), and an unkeyed one counted twice fails the run's final rows-in/out check, never silently
            if time.monotonic() > deadline:
                raise _lost(exc) from None
            time.sleep(1.0)
        except ActorDiedError as exc:
            raise _lost(exc) from None


def _lost(exc: Exception) -> LedgerLostError:
    return LedgerLostError(
        "the run's ledger (the RunLedger actor that counts rows) is lost, and the counts it held with it; "
        f"rerun (its node or process died: {str(exc).splitlines()[0][:300]})"
    )


def batch_key(table: pa.Table) -> tuple | None:
    """(file index, row) of a batch's first row: the same on every retry of the batch, unique within a run."""
    if not table.num_rows or ROW_COLUMN not in table.column_names:
        return None
    return table.column(FILE_COLUMN)[0].as_py(), table.column(ROW_COLUMN)[0].as_py()


def input_row(table: pa.Table, i: int) -> dict | None:
    """What a quarantine record shows of a row as read: every column but the provenance ones (None where the row
    does not convert to Python)."""
    try:
        return {k: v for k, v in table.slice(i, 1).to_pylist()[0].items() if k not in PROVENANCE_COLUMNS}
    except Exception:
        return None


def processed_row(table: pa.Table, i: int) -> dict | None:
    """What a quarantine record shows of a row after the tokenize stage: its plain columns (no internal columns, ids
    or media payloads)."""
    names = [n for n in table.column_names if not n.startswith("_") and n not in TOKEN_COLUMNS]
    names = [n for n in names if n not in (MULTI_MODAL_DATA, MULTI_MODAL_INPUTS)]
    try:
        return table.select(names).slice(i, 1).to_pylist()[0]
    except Exception:
        return None
