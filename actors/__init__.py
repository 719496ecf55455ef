"""Ray actor classes used by ``map_batches``. Each hosts a stage from ``ingest.stages``; no pipeline logic here.

The classes are imported on first use: an actor process unpickling ``actors.vision.DecodeActor`` then imports the
decode stage's modules only, not every other actor's (the tokenizer's jinja2, the SFT renderers).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "DecodeActor": "actors.vision",
    "SFTRenderActor": "actors.sft",
    "SFTVisionActor": "actors.sft",
    "TokenizeActor": "actors.tokenize",
    "VisionActor": "actors.vision",
}

__all__ = [
    "DecodeActor",
    "SFTRenderActor",
    "SFTVisionActor",
    "TokenizeActor",
    "VisionActor",
]

if TYPE_CHECKING:
    from actors.sft import SFTRenderActor, SFTVisionActor
    from actors.tokenize import TokenizeActor
    from actors.vision import DecodeActor, VisionActor


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'actors' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
