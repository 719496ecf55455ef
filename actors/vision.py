"""Decode and vision actors for the multimodal path (the vision actor may hold a GPU)."""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from ingest.offline import resolve_model_path
from ingest.stages.vision import DecodeStage, VisionStage, decode_block


class DecodeActor:
    def __init__(self, config: dict, files: Sequence[str], ledger=None, keep_provenance: bool = False):
        self.stage = DecodeStage.from_config(config, files, keep_provenance)
        self.ledger = ledger

    def __call__(self, batch: pa.Table) -> pa.Table:
        return decode_block(self.stage, batch, self.ledger)


class VisionActor:
    def __init__(self, processor: str, device: str = "cpu", return_multi_modal_inputs: bool = True):
        self.stage = VisionStage(resolve_model_path(processor), device, return_multi_modal_inputs)

    def __call__(self, batch: pa.Table) -> pa.Table:
        return self.stage(batch)
