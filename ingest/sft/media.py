"""Media of a conversation: values from content parts, geometry (grids from image headers, as the RL path's tokenize
stage), pixels through the RL path's ``VisionStage`` (images) and the processor's video processor (videos)."""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ingest.media.geometry import IMAGE_PAD, VIDEO_PAD, VisionSpec, grid_tokens, image_grid
from ingest.media.image import check_complete, decode_rgb, image_size, read_image_bytes
from ingest.media.pixels import ProcessorPixels
from ingest.sft.data import SFTRenderError
from ingest.tokenizer.offline import resolve_model_path

PAD_TOKENS = {"image": IMAGE_PAD, "video": VIDEO_PAD}


def part_modality(part: Mapping) -> str | None:
    """The Qwen2-VL template's test for a content part (image before video, like the template)."""
    kind = part.get("type")
    if kind == "image" or "image" in part or "image_url" in part:
        return "image"
    if kind == "video" or "video" in part:
        return "video"
    return None


def _part_value(part: Mapping, modality: str):
    if modality == "image":
        for key in ("image", "image_url", "path", "url"):
            if part.get(key) is not None:
                value = part[key]
                return value["url"] if isinstance(value, Mapping) and "url" in value else value
        return None
    for key in ("video", "path", "url"):
        if part.get(key) is not None:
            return part[key]
    return None


def media_values(messages, images, videos) -> dict[str, list]:
    """Media values in template order per modality; parts without a value take the next of images / videos."""
    supplied = {"image": list(images or []), "video": list(videos or [])}
    used = {"image": 0, "video": 0}
    values: dict[str, list] = {"image": [], "video": []}
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            modality = part_modality(part) if isinstance(part, Mapping) else None
            if modality is None:
                continue
            value = _part_value(part, modality)
            if value is None:
                if used[modality] >= len(supplied[modality]):
                    raise SFTRenderError(f"message {i} has more {modality} parts than {modality}s were given")
                value = supplied[modality][used[modality]]
                used[modality] += 1
            values[modality].append(value)
    for modality, given in supplied.items():
        if used[modality] != len(given):
            raise SFTRenderError(f"{len(given)} {modality}s given but only {used[modality]} {modality} parts need one")
    return values


@dataclass
class _Loaded:
    grid: tuple[int, int, int]
    tokens: int
    hash: str
    data: bytes | None = None
    rgb: np.ndarray | None = None
    outputs: dict[str, np.ndarray] | None = None


def _encoded_bytes(value) -> bytes | None:
    """Encoded image bytes of a value (HF ``Image()`` struct, bytes, path, data URL); None for decoded images."""
    if isinstance(value, str) and value.startswith("data:"):
        return base64.b64decode(value.split(",", 1)[1])
    if isinstance(value, str) and value.startswith(("http://", "https://")):
        raise SFTRenderError("images by http(s) URL are not fetched; pass bytes, a path or an HF Image() struct")
    if isinstance(value, Mapping | bytes | bytearray | memoryview | str):
        return read_image_bytes(value)
    return None


def _rgb_of(value) -> np.ndarray:
    if isinstance(value, np.ndarray):
        if value.ndim != 3 or value.shape[2] != 3 or value.dtype != np.uint8:
            raise SFTRenderError(f"image arrays must be (H, W, 3) uint8, got {value.shape} {value.dtype}")
        return value
    if hasattr(value, "convert"):  # PIL image
        return np.asarray(value.convert("RGB"))
    raise SFTRenderError(f"unsupported image value of type {type(value).__name__}")


class MediaProcessor:
    """The processor side: geometry (``VisionSpec``), image pixels via the RL path's ``ProcessorPixels``, videos via the
    processor's video processor. Transformers is loaded on first use."""

    def __init__(self, processor):
        if isinstance(processor, str | os.PathLike):
            self.path: str | None = resolve_model_path(processor)
            self._image_processor = None
            self._video_processor = None
            if os.path.isdir(self.path):
                self.spec = VisionSpec.from_dir(self.path)  # the numbers the RL tokenize stage reads
            else:  # a hub name: the geometry from the loaded image processor
                from transformers import AutoImageProcessor

                self._image_processor = AutoImageProcessor.from_pretrained(self.path)
                self.spec = _spec_of(self._image_processor)
        else:
            self.path = None
            image_processor = getattr(processor, "image_processor", processor)
            self._image_processor = image_processor
            self._video_processor = getattr(processor, "video_processor", None)
            self.spec = _spec_of(image_processor)
        self._processor_pixels = None

    def load(self, values: dict[str, list], process: bool) -> dict[str, list[_Loaded]]:
        out: dict[str, list[_Loaded]] = {}
        if values["image"]:
            out["image"] = [self._load_image(v, deferred=not process) for v in values["image"]]
            if process:
                self._image_outputs(out["image"])
        if values["video"]:
            out["video"] = self._videos(values["video"])
        return out

    def _load_image(self, value, deferred: bool = False) -> _Loaded:
        """``deferred``: the pixels are decoded later, in the SFT vision actor, which has no per-row quarantine; a
        file cut short is a bad image here already (``check_complete``: no pixel decode)."""
        try:
            data = _encoded_bytes(value)
            if data is not None:
                width, height = image_size(data)
                if deferred:
                    check_complete(data)
                rgb = None
                digest = hashlib.sha256(data).hexdigest()
            else:
                rgb = _rgb_of(value)
                height, width = rgb.shape[:2]
                digest = _pixel_hash(rgb)
            grid = image_grid(width, height, self.spec)
        except SFTRenderError:
            raise
        except Exception as exc:
            raise SFTRenderError(f"bad image: {type(exc).__name__}: {exc}") from exc
        return _Loaded(grid, grid_tokens(grid, self.spec), digest, data, rgb)

    def _image_outputs(self, items: list[_Loaded]) -> None:
        rgbs = []
        for item in items:
            if item.rgb is None:
                try:
                    item.rgb = decode_rgb(item.data)[0]
                except Exception as exc:
                    raise SFTRenderError(f"bad image: {type(exc).__name__}: {exc}") from exc
            rgbs.append(item.rgb)
        pixel_values, grids = self.processor_pixels()(rgbs)
        expected = [list(item.grid) for item in items]
        if grids.tolist() != expected:
            raise RuntimeError(f"image processor grids {grids.tolist()} differ from the geometry's {expected}")
        bounds = np.cumsum([0] + [int(np.prod(g)) for g in expected])
        for k, item in enumerate(items):
            item.outputs = {
                "pixel_values": pixel_values[bounds[k] : bounds[k + 1]],
                "image_grid_thw": grids[k : k + 1],
            }
            item.rgb = None  # the pixels live on in pixel_values

    def processor_pixels(self) -> ProcessorPixels:
        """The RL vision stage's pixel path (``ProcessorPixels``) on the CPU: our kernels for a processor directory
        they serve, else the processor object as it is."""
        if self._processor_pixels is None:
            if self._image_processor is None:
                self._processor_pixels = ProcessorPixels(self.path)
            else:  # a processor object (or one loaded from the hub): use it as it is
                self._processor_pixels = ProcessorPixels(image_processor=self._image_processor)
        return self._processor_pixels

    def video_processor(self):
        if self._video_processor is None:
            if self.path is None:
                raise SFTRenderError("the processor has no video processor")
            from transformers import AutoVideoProcessor

            self._video_processor = AutoVideoProcessor.from_pretrained(self.path)
        return self._video_processor

    def _videos(self, values: list) -> list[_Loaded]:
        """Videos as frame sequences ((T, H, W, 3) uint8 arrays or lists of image values), processed in one call:
        the grid (and so the pad count) comes from the video processor."""
        stacks, digests = [], []
        for value in values:
            try:
                if isinstance(value, np.ndarray):
                    frames = _rgb_frames(value)
                    digest = _pixel_hash(frames)
                elif isinstance(value, list | tuple) and value:
                    hasher = hashlib.sha256()
                    arrays = []
                    for frame in value:
                        data = _encoded_bytes(frame)
                        rgb = decode_rgb(data)[0] if data is not None else _rgb_of(frame)
                        frame_digest = (
                            hashlib.sha256(data).digest() if data is not None else bytes.fromhex(_pixel_hash(rgb))
                        )
                        hasher.update(frame_digest)
                        arrays.append(rgb)
                    frames = np.stack(arrays)
                    digest = hasher.hexdigest()
                else:
                    raise SFTRenderError(
                        f"videos must be frame sequences (a (T, H, W, 3) array or a list of images), got "
                        f"{type(value).__name__}"
                    )
            except SFTRenderError:
                raise
            except Exception as exc:
                raise SFTRenderError(f"bad video: {type(exc).__name__}: {exc}") from exc
            stacks.append(frames)
            digests.append(digest)
        out = self.video_processor()(videos=stacks, return_tensors="np")
        pixel_values = np.asarray(out["pixel_values_videos"], dtype=np.float32)
        grids = np.asarray(out["video_grid_thw"], dtype=np.int64)
        bounds = np.cumsum([0] + [int(np.prod(g)) for g in grids])
        items = []
        for k, digest in enumerate(digests):
            grid = tuple(int(x) for x in grids[k])
            outputs = {
                "pixel_values_videos": pixel_values[bounds[k] : bounds[k + 1]],
                "video_grid_thw": grids[k : k + 1],
            }
            items.append(_Loaded(grid, int(np.prod(grid)) // self.spec.merge_size**2, digest, outputs=outputs))
        return items


def _rgb_frames(value: np.ndarray) -> np.ndarray:
    if value.ndim != 4 or value.shape[3] != 3 or value.dtype != np.uint8:
        raise SFTRenderError(f"video arrays must be (T, H, W, 3) uint8, got {value.shape} {value.dtype}")
    return value


def _pixel_hash(rgb: np.ndarray) -> str:
    hasher = hashlib.sha256(f"rgb{tuple(rgb.shape)}".encode())
    hasher.update(np.ascontiguousarray(rgb).tobytes())
    return hasher.hexdigest()


def _spec_of(image_processor) -> VisionSpec:
    """``VisionSpec`` of a loaded Qwen2-VL-family image processor."""
    size = getattr(image_processor, "size", None)

    def size_get(key):
        if size is None:
            return None
        return size.get(key) if isinstance(size, Mapping) else getattr(size, key, None)

    default = VisionSpec()
    return VisionSpec(
        patch_size=int(getattr(image_processor, "patch_size", None) or default.patch_size),
        merge_size=int(getattr(image_processor, "merge_size", None) or default.merge_size),
        temporal_patch_size=int(getattr(image_processor, "temporal_patch_size", None) or default.temporal_patch_size),
        min_pixels=int(getattr(image_processor, "min_pixels", None) or size_get("shortest_edge") or default.min_pixels),
        max_pixels=int(getattr(image_processor, "max_pixels", None) or size_get("longest_edge") or default.max_pixels),
        processor_class=type(image_processor).__name__,
    )
