"""Dropping the pipeline into verl's trainer: ``VerlDataLoader`` (what verl's trainers iterate, count, save and
restore), ``IngestDataset`` (what verl's ``data.custom_cls`` builds instead of its ``RLHFDataset``) and
``ingest_trainer`` (a verl trainer class of any release whose dataloaders are ours)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ingest.lazy import lazy_exports

_EXPORTS = {
    "IngestDataset": "ingest.verl.dataset",
    "VerlDataLoader": "ingest.verl.loader",
    "count_rows": "ingest.verl.length",
    "ingest_trainer": "ingest.verl.trainer",
}

__all__ = ["IngestDataset", "VerlDataLoader", "count_rows", "ingest_trainer"]

if TYPE_CHECKING:
    from ingest.verl.dataset import IngestDataset
    from ingest.verl.length import count_rows
    from ingest.verl.loader import VerlDataLoader
    from ingest.verl.trainer import ingest_trainer


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
