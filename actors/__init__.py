"""Ray actor classes used by ``map_batches``. Each hosts a stage from ``ingest.stages``; no pipeline logic here.

The classes are imported on first use: an actor process unpickling ``actors.vision.DecodeActor`` then imports the
decode stage's modules only, not every other actor's (the tokenizer's jinja2, the SFT renderers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ingest.lazy import lazy_exports

_EXPORTS = {
    "DecodeActor": "actors.vision",
    "SFTRenderActor": "actors.sft",
    "TokenizeActor": "actors.tokenize",
    "VisionActor": "actors.vision",
}

__all__ = [
    "DecodeActor",
    "SFTRenderActor",
    "TokenizeActor",
    "VisionActor",
]

if TYPE_CHECKING:
    from actors.sft import SFTRenderActor
    from actors.tokenize import TokenizeActor
    from actors.vision import DecodeActor, VisionActor


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
