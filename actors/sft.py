"""SFT actors: the render actor (renderer loaded once; reads are fused into it) and the SFT vision actor."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pyarrow as pa

from ingest.config import DataConfig, StageContext
from ingest.memory import use_arrow_memory_pool
from ingest.sft.render import create_renderer
from ingest.stages.sft import SFTRenderStage, SFTVisionStage
from ingest.stats import stage_unit
from ingest.tokenizer.chat import ChatTokenizer
from ingest.tokenizer.offline import resolve_model_path


class SFTRenderActor:
    def __init__(
        self,
        config: DataConfig,
        context: StageContext,
        tokenizer: str | None,
        processor: str | None = None,
        role_to_mask: Callable | None = None,
    ):
        use_arrow_memory_pool(config.arrow_memory_pool)
        chat = ChatTokenizer(tokenizer, trust_remote_code=config.trust_remote_code)
        renderer = create_renderer(chat, processor)  # the processor path: geometry from its JSON, no transformers
        self.stage = SFTRenderStage(renderer, config, context, media=processor is not None, role_to_mask=role_to_mask)
        self.ledger = context.ledger
        self.batch_size = config.tokenizer_batch_size

    def __call__(self, unit: pa.Table) -> Iterator[pa.Table]:
        return stage_unit(self.stage, unit, self.batch_size, self.ledger)


class SFTVisionActor:
    def __init__(self, config: DataConfig, context: StageContext, processor: str):
        use_arrow_memory_pool(config.arrow_memory_pool)
        self.stage = SFTVisionStage(resolve_model_path(processor), config)

    def __call__(self, batch: pa.Table) -> pa.Table:
        return self.stage(batch)
