"""SFT data types: the contract's ``PlaceholderRange`` / ``RenderedTrainingSample``, per-token tags of a rendered
conversation, model-input sequences, and ``mm_token_type_ids``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

# mm_token_type_ids values (the processor's own: 0 text, 1 image, 2 video)
MODALITY_TOKEN_TYPES: dict[str, int] = {"image": 1, "video": 2}


class SFTRenderError(ValueError):
    """A conversation this renderer cannot turn into a training sample (bad row: quarantine or raise)."""


class PlaceholderRange(NamedTuple):
    """The expanded pad run of one media item in ``token_ids`` (not the vision start/end markers)."""

    offset: int
    length: int


@dataclass(frozen=True)
class ModalityData:
    """One modality's media of a sample, per item in stream order.

    ``items[k]``: the processor outputs of item k, every array with the item on axis 0 so that concatenating a
    key over items gives the processor's batch output (images: ``pixel_values`` (patches, dim) float32,
    ``image_grid_thw`` (1, 3) int64; videos: ``pixel_values_videos``, ``video_grid_thw``).
    ``hashes[k]``: sha256 hex of the item's encoded bytes (of the RGB pixels where no encoded bytes were given).
    ``placeholders[k]``: its pad run in ``token_ids``.
    """

    items: list[dict[str, np.ndarray]]
    hashes: list[str]
    placeholders: list[PlaceholderRange]


@dataclass(frozen=True)
class RenderedTrainingSample:
    """The contract's sample: ``multi_modal_data`` / ``mm_token_type_ids`` are None for text-only samples."""

    token_ids: list[int]
    loss_mask: list[bool]
    multi_modal_data: dict[str, ModalityData] | None = None
    mm_token_type_ids: list[int] | None = None


@dataclass(frozen=True)
class MediaItem:
    """One media item as rendered: where its pad run is, its grid, hash, and (when processed) processor outputs.

    ``data`` holds the encoded bytes when the value had them (what a later decode stage needs); ``outputs`` is None
    when the renderer was asked not to process pixels (images only; videos are always processed: their grid
    comes from the video processor).
    """

    modality: str
    placeholder: PlaceholderRange
    grid: tuple[int, int, int]
    hash: str
    outputs: dict[str, np.ndarray] | None = None
    data: bytes | None = None


@dataclass(frozen=True)
class RenderedConversation:
    """Per-token tags of one rendered conversation (media already expanded).

    ``message_indices[t]``: index of the message token t came from, -1 for scaffolding the template added on its
    own (a default system prompt, text outside any message). ``sampled[t]``: the model would emit it (None: the
    renderer cannot tell). ``content[t]``: message body rather than scaffolding (None: cannot tell).
    """

    token_ids: list[int]
    message_indices: list[int]
    sampled: list[bool] | None
    content: list[bool] | None
    media: list[MediaItem] = field(default_factory=list)
    text: str = ""  # the rendered template text (pads unexpanded)


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


def mm_token_type_ids(length: int, ranges_by_modality: Mapping[str, Iterable[Sequence[int]]]) -> list[int]:
    """0 text, 1 image, 2 video over each placeholder range, ranges clipped to ``length``; unknown modalities 0."""
    out = [0] * max(int(length), 0)
    for modality, ranges in ranges_by_modality.items():
        value = MODALITY_TOKEN_TYPES.get(modality)
        if value is None:
            continue
        for offset, span in ranges:
            start, end = max(int(offset), 0), min(int(offset) + int(span), len(out))
            if end > start:
                out[start:end] = [value] * (end - start)
    return out
