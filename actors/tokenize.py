"""The tokenization actor: loads the tokenizer once, then runs ``PromptTokenizeStage`` (``RawPromptStage`` for verl
0.9 rows) per batch (and, on small
layouts, the media stages after it: ``media_steps``)."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa

from ingest.config import DataConfig, StageContext
from ingest.media.geometry import VisionSpec
from ingest.memory import use_arrow_memory_pool
from ingest.stages.raw_prompt import RawPromptStage
from ingest.stages.tokenize import PromptTokenizeStage
from ingest.stats import stage_unit
from ingest.tokenizer.chat import ChatTokenizer
from ingest.tokenizer.offline import resolve_model_path


class TokenizeActor:
    def __init__(self, config: DataConfig, context: StageContext, tokenizer: str | None, processor: str | None = None):
        use_arrow_memory_pool(config.arrow_memory_pool)
        vision = VisionSpec.from_dir(resolve_model_path(processor)) if processor else None
        chat = ChatTokenizer(tokenizer, trust_remote_code=config.trust_remote_code)
        stage = RawPromptStage if config.row_format == "verl-0.9" else PromptTokenizeStage
        self.stage = stage(chat, config, context, vision)
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
