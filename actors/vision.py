"""Decode and vision actors for the multimodal path (the vision actor may hold a GPU)."""

from __future__ import annotations

import pyarrow as pa

from ingest.config import DataConfig, StageContext
from ingest.memory import use_arrow_memory_pool
from ingest.stages.media import Pool, media_stages


class _MediaActor:
    pool: Pool  # which media stages run here: ingest.stages.media.media_steps

    def __init__(self, config: DataConfig, context: StageContext, processor: str):
        use_arrow_memory_pool(config.arrow_memory_pool)
        self.process = media_stages(config, context, processor, self.pool)

    def __call__(self, batch: pa.Table) -> pa.Table:
        return self.process(batch)


class DecodeActor(_MediaActor):
    """The decode stage; with ``vision_pool_max_size: 0`` the vision stage after it, here."""

    pool = "decode"


class VisionActor(_MediaActor):
    """The vision stage, on the CPU or a GPU (``vision_num_gpus``)."""

    pool = "vision"
