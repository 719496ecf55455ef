"""The first rows of an epoch, made in the driver: the same read and stages as the tokenizer (and decode) actors, run
in this process, so the first batch needs no Ray cluster, worker process or actor to start.

On a new cluster those cost seconds (Ray's start, Ray Data's cluster actors, a worker importing the stages and
loading the tokenizer) before the first unit is even read; a driver that already imported the stages makes one batch
in a fraction of that. ``PromptStream`` takes the first batch from here and the rest from ``build_dataset`` over the
units after these. Only where the stages are light: text rows, and verl 0.9 rows (their images are decoded, never
processed); rows with a vision stage come from the actors.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pyarrow as pa

from ingest.config import DataConfig, StageContext
from ingest.datasets.plan import InputPlan, units_source
from ingest.read.units import ReadUnit


def driver_can_start(config: DataConfig, processor: str | os.PathLike | None) -> bool:
    """Whether the driver makes the first batch: text rows, or verl 0.9 rows (no vision stage)."""
    return processor is None or config.row_format == "verl-0.9"


class DriverUnits:
    """Reads and runs single read units in this process, blocks exactly as the tokenizer (+ decode) actors give
    them; counts and quarantine go to ``context.ledger`` as from the actors."""

    def __init__(
        self,
        plan: InputPlan,
        config: DataConfig,
        context: StageContext,
        tokenizer: str | os.PathLike | None,
        processor: str | os.PathLike | None = None,
        *,
        epoch: int = 0,
    ):
        from ingest.stages.media import media_stages
        from ingest.stages.prompt import prompt_stage

        if not driver_can_start(config, processor):
            raise ValueError("the driver makes text and verl 0.9 rows only (other media rows need the vision stage)")
        self.plan, self.config, self.context, self.epoch = plan, config, context, epoch
        self.stage = prompt_stage(config, context, tokenizer, processor)
        # verl 0.9 rows: the decode pool's stage (their images decoded, counted as there); none for text rows
        self.media = media_stages(config, context, processor, "decode")

    def __call__(self, unit: ReadUnit) -> Iterator[pa.Table]:
        from ingest.stats import stage_unit

        # a unit that cannot be read is quarantined (or raises) as in the actors
        one = InputPlan(self.plan.files, self.plan.infos, [unit])
        source = units_source(one, self.config, self.epoch, self.context.ledger)
        for read in source.get_read_tasks(1):
            for table in read():
                for block in stage_unit(self.stage, table, self.config.tokenizer_batch_size, self.context.ledger):
                    yield self.media(block) if self.media is not None else block
