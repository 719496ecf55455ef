"""The tokenization actor: loads the tokenizer once, then runs ``PromptTokenizeStage`` per batch."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pyarrow as pa

from ingest.config import DataConfig
from ingest.memory import use_arrow_memory_pool
from ingest.models import ChatTokenizer
from ingest.offline import resolve_model_path
from ingest.stages.tokenize import PromptTokenizeStage
from ingest.stats import stage_unit
from ingest.vision import VisionSpec


class TokenizeActor:
    def __init__(
        self,
        tokenizer: str | None,
        config: dict,
        files: Sequence[str],
        processor: str | None = None,
        ledger=None,
        keep_provenance: bool = False,
        decode: bool = False,
        vision_stage: dict | None = None,
    ):
        cfg = DataConfig(**config)
        use_arrow_memory_pool(cfg.arrow_memory_pool)
        vision = VisionSpec.from_dir(resolve_model_path(processor)) if processor else None
        chat = ChatTokenizer(tokenizer, trust_remote_code=cfg.trust_remote_code)
        self.stage = PromptTokenizeStage(chat, cfg, files, vision, keep_provenance)
        self.ledger = ledger
        self.batch_size = cfg.tokenizer_batch_size
        self.media = None
        if decode or vision_stage is not None:  # media stages without a pool of their own run here
            from ingest.stages.vision import media_stages

            self.media = media_stages(config, files, keep_provenance, ledger, decode=decode, vision=vision_stage)

    def __call__(self, unit: pa.Table) -> Iterator[pa.Table]:
        tables = stage_unit(self.stage, unit, self.batch_size, self.ledger)
        # a generator, not a map object: Ray Data takes generators (and tables) as a UDF's output
        return tables if self.media is None else (self.media(table) for table in tables)
