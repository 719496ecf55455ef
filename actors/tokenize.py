"""The tokenization actor: loads the tokenizer once, then runs ``PromptTokenizeStage`` (``RawPromptStage`` for verl
0.9 rows) per batch (and, on small
layouts, the media stages after it: ``media_steps``)."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa

from ingest.config import DataConfig, StageContext
from ingest.memory import use_arrow_memory_pool
from ingest.stages.prompt import prompt_stage
from ingest.stats import stage_unit


class TokenizeActor:
    def __init__(self, config: DataConfig, context: StageContext, tokenizer: str | None, processor: str | None = None):
        use_arrow_memory_pool(config.arrow_memory_pool)
        self.stage = prompt_stage(config, context, tokenizer, processor)
        self.ledger = context.ledger
        self.batch_size = config.tokenizer_batch_size
        self.media = None
        if processor is not None:
            from ingest.stages.media import media_stages  # the text path never imports the media stages

            self.media = media_stages(config, context, processor, "tokenizer")

    def __call__(self, unit: pa.Table) -> Iterator[pa.Table]:
        tables = stage_unit(self.stage, unit, self.batch_size, self.ledger)
        # a generator, not a map object: Ray Data takes generators (and tables) as a UDF's output
        return tables if self.media is None else (self.media(table) for table in tables)
