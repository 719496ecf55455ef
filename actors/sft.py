"""SFT actors: the render actor (renderer loaded once; reads are fused into it) and the SFT vision actor."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pyarrow as pa

from ingest.config import DataConfig
from ingest.memory import use_arrow_memory_pool
from ingest.models import ChatTokenizer
from ingest.offline import resolve_model_path
from ingest.sft.render import create_renderer
from ingest.stages.sft import SFTRenderStage, SFTVisionStage
from ingest.stats import stage_unit


class SFTRenderActor:
    def __init__(
        self,
        tokenizer: str | None,
        config: dict,
        files: Sequence[str],
        processor: str | None = None,
        ledger=None,
        role_to_mask: Callable | None = None,
    ):
        cfg = DataConfig(**config)
        use_arrow_memory_pool(cfg.arrow_memory_pool)
        chat = ChatTokenizer(tokenizer, trust_remote_code=cfg.trust_remote_code)
        renderer = create_renderer(chat, processor)  # the processor path: geometry from its JSON, no transformers
        self.stage = SFTRenderStage(renderer, cfg, files, media=processor is not None, role_to_mask=role_to_mask)
        self.ledger = ledger
        self.batch_size = cfg.tokenizer_batch_size

    def __call__(self, unit: pa.Table) -> Iterator[pa.Table]:
        return stage_unit(self.stage, unit, self.batch_size, self.ledger)


class SFTVisionActor:
    def __init__(self, processor: str, device: str = "cpu", image_key: str = "images"):
        self.stage = SFTVisionStage(resolve_model_path(processor), device, image_key)

    def __call__(self, batch: pa.Table) -> pa.Table:
        return self.stage(batch)
