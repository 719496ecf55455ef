"""What the pipeline makes of renderers' samples: model-input sequences (after the causal shift, possibly packed)
with their media per modality."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np


class PlaceholderRange(NamedTuple):
    """The expanded pad run of one media item in a sequence's ``inputs`` (not the vision start/end markers)."""

    offset: int
    length: int


@dataclass(frozen=True)
class ModalityData:
    """One modality's media of a sequence, per item in stream order.

    ``items[k]``: the processor outputs of item k as renderers holds them (images: ``pixel_values`` (patches, dim),
    ``image_grid_thw`` (1, 3)); ``hashes[k]``: renderers' content hash; ``placeholders[k]``: its pad run.
    """

    items: list[dict[str, np.ndarray]]
    hashes: list[str]
    placeholders: list[PlaceholderRange]


@dataclass(frozen=True)
class TrainingSequence:
    """Model inputs after the causal shift: ``targets[t]`` is the token after ``inputs[t]``.

    ``loss_mask`` is aligned with ``targets``, ``mm_token_type_ids`` with ``inputs``; placeholder offsets in
    ``multi_modal_data`` index ``inputs``. ``seq_lens``: the lengths of the samples packed into this sequence
    (one entry for an unpacked sample); they sum to ``len(inputs)``.
    """

    inputs: list[int]
    targets: list[int]
    loss_mask: list[bool]
    mm_token_type_ids: list[int] | None = None
    multi_modal_data: dict[str, ModalityData] | None = None
    seq_lens: list[int] = field(default_factory=list)
    dropped_media: int = 0  # media items cut off by truncation
