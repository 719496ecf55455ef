"""Decode and vision actors for the multimodal path (the vision actor may hold a GPU)."""

from __future__ import annotations

import pyarrow as pa

from ingest.offline import resolve_model_path
from ingest.stages.vision import DecodeStage, VisionStage


class DecodeActor:
    def __init__(self):
        self.stage = DecodeStage()

    def __call__(self, batch: pa.Table) -> pa.Table:
        return self.stage(batch)


class VisionActor:
    def __init__(self, processor: str, device: str = "cpu", return_multi_modal_inputs: bool = True):
        self.stage = VisionStage(resolve_model_path(processor), device, return_multi_modal_inputs)

    def __call__(self, batch: pa.Table) -> pa.Table:
        return self.stage(batch)
