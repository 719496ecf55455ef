"""Ray actor classes used by ``map_batches``. Each hosts a stage from ``ingest.stages``; no pipeline logic here."""

from actors.sft import SFTRenderActor, SFTVisionActor
from actors.tokenize import TokenizeActor
from actors.vision import DecodeActor, VisionActor

__all__ = ["DecodeActor", "SFTRenderActor", "SFTVisionActor", "TokenizeActor", "VisionActor"]
