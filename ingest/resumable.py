"""``ResumableBatches``: what ``PromptStream`` and ``PromptShard`` share: their arguments, the read of a set of
read units through ``build_dataset`` (rows keep their provenance, so each batch's units are known), and the collate
of a batch without those columns. Each subclass keeps its own position and state format."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa

from ingest.blocks import FILE_COLUMN, ROW_COLUMN
from ingest.config import DataConfig
from ingest.datasets.plan import FilesArg, InputPlan
from ingest.datasets.rl import build_dataset
from ingest.read.units import ReadUnit
from ingest.rowformat.collate import VerlCollate


class ResumableBatches:
    """Collated batches of ``batch_size`` rows over ``files`` (``build_dataset``'s ``tokenizer``, ``config``,
    ``processor``); ``collate_fn`` defaults to ``VerlCollate`` of the config's row format; ``drop_last`` drops a final
    short batch; ``ledger``: a ``RunLedger`` actor that receives the counts."""

    def __init__(
        self,
        files: FilesArg,
        tokenizer: str | os.PathLike | None,
        config: DataConfig | Mapping[str, Any] | None,
        batch_size: int,
        processor: str | os.PathLike | None = None,
        *,
        collate_fn=None,
        drop_last: bool = False,
        ledger=None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.files = files
        self.tokenizer = tokenizer
        self.processor = processor
        self.config = DataConfig.from_any(config)
        self.batch_size = batch_size
        self.collate_fn = collate_fn or VerlCollate(row_format=self.config.row_format)
        self.drop_last = drop_last
        self.ledger = ledger
        self.epoch = 0

    def _read(self, plan: InputPlan, units: Sequence[ReadUnit]) -> Iterator[pa.Table]:
        """The blocks of ``units`` (in their order) made by the actors, with their provenance columns."""
        ds = build_dataset(
            plan.files,
            self.tokenizer,
            self.config,
            self.processor,
            epoch=self.epoch,
            plan=InputPlan(plan.files, plan.infos, list(units)),
            ledger=self.ledger,
            keep_provenance=True,
        )
        yield from ds.iter_batches(batch_size=None, batch_format="pyarrow")

    def _collate(self, table: pa.Table) -> dict:
        return self.collate_fn(table.drop_columns([FILE_COLUMN, ROW_COLUMN]))
