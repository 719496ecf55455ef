"""Decode and vision actors for the multimodal path (the vision actor may hold a GPU)."""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from ingest.memory import DEFAULT_ARROW_MEMORY_POOL, use_arrow_memory_pool
from ingest.stages.vision import media_stages


class DecodeActor:
    """The decode stage; with ``vision_stage`` (``vision_pool_max_size: 0``) the vision stage after it, here."""

    def __init__(
        self,
        config: dict,
        files: Sequence[str],
        ledger=None,
        keep_provenance: bool = False,
        vision_stage: dict | None = None,
    ):
        use_arrow_memory_pool(config.get("arrow_memory_pool", DEFAULT_ARROW_MEMORY_POOL))
        self.process = media_stages(config, files, keep_provenance, ledger, decode=True, vision=vision_stage)

    def __call__(self, batch: pa.Table) -> pa.Table:
        return self.process(batch)


class VisionActor:
    def __init__(
        self,
        processor: str,
        device: str = "cpu",
        return_multi_modal_inputs: bool = True,
        config: dict | None = None,
        files: Sequence[str] = (),
        ledger=None,
        keep_provenance: bool = False,
    ):
        config = config or {}
        use_arrow_memory_pool(config.get("arrow_memory_pool", DEFAULT_ARROW_MEMORY_POOL))
        vision = {"processor": processor, "device": device, "return_multi_modal_inputs": return_multi_modal_inputs}
        self.process = media_stages(config, files, keep_provenance, ledger, vision=vision)

    def __call__(self, batch: pa.Table) -> pa.Table:
        return self.process(batch)
