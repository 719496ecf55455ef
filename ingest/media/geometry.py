"""The Qwen2-VL image processor's geometry: ``VisionSpec`` read from a processor directory, ``smart_resize`` and the
image / video grids that decide how many pad tokens each medium expands to.

Nothing here imports transformers: the tokenize stage needs only the processor's numbers (patch / merge size, pixel
budget), so it reads them from the saved JSON.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"


def image_processor_config(path: str | Path) -> dict:
    """The saved image processor config of a model directory (``preprocessor_config.json``, else the
    ``image_processor`` section of ``processor_config.json``; ``{}`` when neither is there)."""
    path = Path(path)
    if (path / "preprocessor_config.json").is_file():
        return json.loads((path / "preprocessor_config.json").read_text())
    if (path / "processor_config.json").is_file():
        return json.loads((path / "processor_config.json").read_text()).get("image_processor", {})
    return {}


def processor_class(path: str | Path) -> str | None:
    """The processor class a saved processor directory names (``Qwen2VLProcessor``, ``Qwen2_5_VLProcessor``, ...)."""
    path = Path(path)
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        if (path / name).is_file():
            found = json.loads((path / name).read_text()).get("processor_class")
            if found:
                return str(found)
    return None


@dataclass(frozen=True)
class VisionSpec:
    """The image processor's geometry (Qwen2-VL family), read from a processor directory."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    processor_class: str = "Qwen2VLImageProcessor"
    video_min_pixels: int = 128 * 28 * 28  # the video processor's own pixel budget per frame
    video_max_pixels: int = 768 * 28 * 28
    video_processor_class: str = "Qwen2VLVideoProcessor"

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dir(cls, path: str | Path) -> VisionSpec:
        """The geometry a processor directory's saved JSON gives; a number it leaves out keeps Qwen2-VL's default."""
        path = Path(path)
        config = image_processor_config(path)
        size = config.get("size") or {}
        video: dict = {}
        if (path / "video_preprocessor_config.json").is_file():
            video = json.loads((path / "video_preprocessor_config.json").read_text())
        video_size = video.get("size") or {}
        default = cls()
        video_min = video.get("min_pixels") or video_size.get("shortest_edge") or default.video_min_pixels
        video_max = video.get("max_pixels") or video_size.get("longest_edge") or default.video_max_pixels
        return cls(
            patch_size=int(config.get("patch_size", default.patch_size)),
            merge_size=int(config.get("merge_size", default.merge_size)),
            temporal_patch_size=int(config.get("temporal_patch_size", default.temporal_patch_size)),
            min_pixels=int(config.get("min_pixels") or size.get("shortest_edge") or default.min_pixels),
            max_pixels=int(config.get("max_pixels") or size.get("longest_edge") or default.max_pixels),
            processor_class=str(config.get("image_processor_type", default.processor_class)),
            video_min_pixels=int(video_min),
            video_max_pixels=int(video_max),
            video_processor_class=str(video.get("video_processor_type", default.video_processor_class)),
        )

    @property
    def timestamps_videos(self) -> bool:
        """Qwen3-VL: its video budget spans all frames, and its processor writes a timestamp before every frame."""
        return "Qwen3VL" in self.video_processor_class

    @property
    def is_qwen2_vl(self) -> bool:
        # verl 0.5.0 switches to 3-row rope positions when the processor class name contains this
        return "Qwen2VLImageProcessor" in self.processor_class


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize target (transformers ``smart_resize``): multiples of ``factor`` within the pixel budget."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_grid(width: int, height: int, spec: VisionSpec) -> tuple[int, int, int]:
    """``image_grid_thw`` of one image: (1, H / patch, W / patch) after ``smart_resize``."""
    h, w = smart_resize(height, width, spec.factor, spec.min_pixels, spec.max_pixels)
    return 1, h // spec.patch_size, w // spec.patch_size


def video_grid(nframes: int, height: int, width: int, spec: VisionSpec) -> tuple[int, int, int]:
    """``video_grid_thw`` of ``nframes`` frames of ``height`` x ``width`` after the video processor's resize."""
    if spec.timestamps_videos:
        h, w = frames_smart_resize(nframes, height, width, spec)
    else:
        h, w = smart_resize(height, width, spec.factor, spec.video_min_pixels, spec.video_max_pixels)
    return -(-nframes // spec.temporal_patch_size), h // spec.patch_size, w // spec.patch_size


def frames_smart_resize(nframes: int, height: int, width: int, spec: VisionSpec) -> tuple[int, int]:
    """Qwen3-VL's video resize (transformers ``video_processing_qwen3_vl.smart_resize``): the pixel budget counts
    every frame (the frame count rounded up to the temporal patch)."""
    factor = spec.factor
    if height < factor or width < factor:
        raise ValueError(f"height:{height} or width:{width} must be larger than factor:{factor}")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = math.ceil(nframes / spec.temporal_patch_size) * spec.temporal_patch_size
    if t_bar * h_bar * w_bar > spec.video_max_pixels:
        beta = math.sqrt((nframes * height * width) / spec.video_max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < spec.video_min_pixels:
        beta = math.sqrt(spec.video_min_pixels / (nframes * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def timestamped_video_text(text: str, grids: list[tuple[int, int, int]], metadata: list[dict], spec: VisionSpec) -> str:
    """``text`` with each video's ``<|vision_start|><|video_pad|><|vision_end|>`` (in order; its grid and its
    fetch_video ``metadata``: ``frames_indices``, ``fps``) written out as the Qwen3-VL processor writes it: per
    temporal patch ``<t seconds>``, then that patch's pads between vision start and end. Each patch keeps one pad token
    here (the caller adds the rest: special tokens split the text, so the count is exact)."""
    placeholder = "<|ingest_video_patch|>"
    for (patches, _, _), video in zip(grids, metadata, strict=True):
        times = frame_timestamps(video["frames_indices"], video["fps"], spec.temporal_patch_size)
        expanded = "".join(f"<{times[t]:.1f} seconds>{VISION_START}{placeholder}{VISION_END}" for t in range(patches))
        text = text.replace(f"{VISION_START}{VIDEO_PAD}{VISION_END}", expanded, 1)
    return text.replace(placeholder, VIDEO_PAD)


def frame_timestamps(frames_indices: list[int], fps: float, temporal_patch_size: int) -> list[float]:
    """Qwen3-VL's per-temporal-patch timestamps (seconds; its processor's ``_calculate_timestamps``): the last index
    repeated to a whole patch, each patch the mean of its first and last frame's time."""
    indices = list(frames_indices)
    if len(indices) % temporal_patch_size:
        indices += [indices[-1]] * (temporal_patch_size - len(indices) % temporal_patch_size)
    times = [i / fps for i in indices]
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


def grid_tokens(grid: tuple[int, int, int], spec: VisionSpec) -> int:
    """How many pad tokens one image or video expands to in ``input_ids``."""
    return int(np.prod(grid)) // (spec.merge_size**2)


# qwen-vl-utils' image budget in merged tokens (IMAGE_MIN_TOKEN_NUM / IMAGE_MAX_TOKEN_NUM)
FETCH_MIN_TOKENS, FETCH_MAX_TOKENS = 4, 16384


def fetch_image_size(width: int, height: int, image_patch_size: int) -> tuple[int, int]:
    """(width, height) of an image after qwen-vl-utils' ``fetch_image`` (what verl 0.9 hands the processor): its own
    ``smart_resize`` (multiples of ``2 * image_patch_size``, at least one factor per side; no floor in the shrink)."""
    factor = 2 * image_patch_size
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > FETCH_MAX_TOKENS * factor**2:
        beta = math.sqrt((height * width) / (FETCH_MAX_TOKENS * factor**2))
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < FETCH_MIN_TOKENS * factor**2:
        beta = math.sqrt(FETCH_MIN_TOKENS * factor**2 / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return w_bar, h_bar
