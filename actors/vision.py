"""Decode and vision actors for the multimodal path (the vision actor may hold a GPU)."""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from ingest.memory import DEFAULT_ARROW_MEMORY_POOL, use_arrow_memory_pool
from ingest.offline import resolve_model_path
from ingest.stages.vision import DecodeStage, VisionStage, counted_block, decode_block


class DecodeActor:
    def __init__(self, config: dict, files: Sequence[str], ledger=None, keep_provenance: bool = False):
        use_arrow_memory_pool(config.get("arrow_memory_pool", DEFAULT_ARROW_MEMORY_POOL))
        self.stage = DecodeStage.from_config(config, files, keep_provenance)
        self.ledger = ledger

    def __call__(self, batch: pa.Table) -> pa.Table:
        return decode_block(self.stage, batch, self.ledger)


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
        path, config = resolve_model_path(processor), config or {}
        use_arrow_memory_pool(config.get("arrow_memory_pool", DEFAULT_ARROW_MEMORY_POOL))
        self.stage = VisionStage.from_config(path, device, return_multi_modal_inputs, config, files, keep_provenance)
        self.ledger = ledger

    def __call__(self, batch: pa.Table) -> pa.Table:
        # counts only for rows whose media this stage decoded (vision_decode_*_on_device); none otherwise
        return counted_block(self.stage.process, batch, self.ledger, "vision", skip_empty=True)
