"""Multimodal stages after tokenization: decode (CPU) and vision preprocessing (CPU or GPU).

Decode: encoded image bytes -> RGB pixels, once (PIL ``convert("RGB")``, as verl). The pixels travel as plain Arrow
structs (width, height, rgb bytes) and become ``multi_modal_data["image"]`` PIL images at the consumer. Videos: the
sampled frames (PyAV for files, PIL + fetch_image's resize for frame lists) as uint8 arrays.

Vision: RGB pixels -> the image processor's ``pixel_values`` / ``image_grid_thw`` with torch ops on ``device``
(``ingest.pixels`` for Qwen2-VL processors: resize, rescale + normalize, patchify; transformers for any other).
Videos: fetch_video's bicubic resize on ``device`` (that is ``multi_modal_data["video"]``), then the video processor's
``pixel_values_videos`` / ``video_grid_thw``. One processor call per batch and modality; outputs are split back per
row by the grids, which must equal the ones the tokenize stage derived from headers (they decided how many pad tokens
``input_ids`` holds).
"""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa

from ingest.pixels import ImagePixels
from ingest.video import decode_video_frames, resize_frames
from ingest.vision import (
    IMAGE_GRIDS_COLUMN,
    IMAGE_STRUCT,
    MEDIA_BYTES_COLUMN,
    PIXELS_STRUCT,
    TENSOR_STRUCT,
    VIDEO_GRIDS_COLUMN,
    VIDEO_PLANS_COLUMN,
    contiguous,
    decode_rgb,
    image_rows_array,
    pixel_rows_array,
    rgb_arrays,
    tensor_from_record,
    tensor_record,
    tensor_rows_array,
)

MULTI_MODAL_DATA = "multi_modal_data"
MULTI_MODAL_INPUTS = "multi_modal_inputs"
VIDEO_FRAMES_COLUMN = "_media_video_frames"  # decoded, sampled frames before the final resize
_FRAMES_STRUCT = pa.struct([("frames", TENSOR_STRUCT), ("height", pa.int64()), ("width", pa.int64())])
_DATA_TYPE = pa.struct([("image", pa.list_(IMAGE_STRUCT)), ("video", pa.list_(TENSOR_STRUCT))])
_INPUTS_TYPE = pa.struct(
    [
        ("pixel_values", PIXELS_STRUCT),
        ("image_grid_thw", TENSOR_STRUCT),
        ("pixel_values_videos", TENSOR_STRUCT),
        ("video_grid_thw", TENSOR_STRUCT),
    ]
)


class DecodeStage:
    """Encoded images -> RGB pixels (``_media_image_bytes`` -> ``multi_modal_data``); video plans -> sampled frames."""

    def __call__(self, table: pa.Table) -> pa.Table:
        if MEDIA_BYTES_COLUMN not in table.column_names:
            return table
        encoded = table.column(MEDIA_BYTES_COLUMN).to_pylist()
        images = image_rows_array([None if row is None else [decode_rgb(b) for b in row] for row in encoded])
        plans = table.column(VIDEO_PLANS_COLUMN).to_pylist()
        frames = [
            None
            if row is None
            else [
                {"frames": tensor_record(decode_video_frames(p)), "height": p["height"], "width": p["width"]}
                for p in row
            ]
            for row in plans
        ]
        index = table.column_names.index(MEDIA_BYTES_COLUMN)
        table = table.set_column(index, MULTI_MODAL_DATA, images)
        index = table.column_names.index(VIDEO_PLANS_COLUMN)
        return table.set_column(index, VIDEO_FRAMES_COLUMN, pa.array(frames, type=pa.list_(_FRAMES_STRUCT)))


def limit_torch_threads() -> None:
    """Hold torch's CPU thread pool to the actor's CPU share. Ray sets ``OMP_NUM_THREADS`` per task and actor (1
    for a fractional CPU) and torch follows it when first imported there; in a worker that imported torch earlier (a
    cluster started with ``RAY_preload_python_modules`` naming torch) the pool spans every core, and its OpenMP
    threads spin-wait on the cores the other stages' actors need (+2 s of CPU per 1,000 rows in ``bench mm``)."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        if torch.get_num_threads() != int(threads):
            torch.set_num_threads(int(threads))


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class VisionStage:
    """``multi_modal_data`` pixels -> ``multi_modal_inputs`` (pixel_values, image_grid_thw) on ``device``."""

    def __init__(self, processor_path: str, device: str = "cpu", return_multi_modal_inputs: bool = True):
        limit_torch_threads()
        self.device = resolve_device(device)
        self.processor_path = processor_path
        # Qwen2-VL processors: our torch ops (no transformers import); any other: transformers' image processor
        self.pixels = ImagePixels.from_dir(processor_path)
        if self.pixels is not None:  # the torch import and first-call set-up here, not in the first batch
            self.pixels([np.zeros((28, 28, 3), dtype=np.uint8)], self.device)
        self._image_processor = None if self.pixels is not None else self._load_image_processor()
        self._video_processor = None  # loaded on the first video
        self.return_multi_modal_inputs = return_multi_modal_inputs

    @classmethod
    def of_image_processor(cls, image_processor, device: str = "cpu") -> VisionStage:
        """A stage that runs an already loaded transformers image processor (images only)."""
        stage = cls.__new__(cls)
        stage.device = resolve_device(device)
        stage.processor_path = None
        stage.pixels = None
        stage._image_processor = image_processor
        stage._video_processor = None
        stage.return_multi_modal_inputs = True
        return stage

    def _load_image_processor(self):
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(self.processor_path)

    @property
    def image_processor(self):
        """transformers' image processor for this path (loaded on first use where the torch ops serve the images)."""
        if self._image_processor is None:
            self._image_processor = self._load_image_processor()
        return self._image_processor

    @property
    def video_processor(self):
        if self._video_processor is None:
            from transformers import AutoVideoProcessor

            self._video_processor = AutoVideoProcessor.from_pretrained(self.processor_path)
            if hasattr(self._video_processor, "cap_pixels_per_frame"):
                # transformers 4.x behaviour (what verl 0.5.0 runs with): no extra per-frame pixel cap
                self._video_processor.cap_pixels_per_frame = False
        return self._video_processor

    def pixel_values(self, images: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        if self.pixels is not None:
            return self.pixels(images, self.device)
        import torch

        tensors = [torch.from_numpy(np.array(rgb)).permute(2, 0, 1) for rgb in images]  # writable copies
        out = self.image_processor(images=tensors, return_tensors="pt", device=self.device)
        return out["pixel_values"].float().cpu().numpy(), out["image_grid_thw"].cpu().numpy().astype(np.int64)

    def video_pixel_values(self, videos: list) -> tuple[np.ndarray, np.ndarray]:
        out = self.video_processor(videos=videos, return_tensors="pt", device=self.device)
        return out["pixel_values_videos"].float().cpu().numpy(), out["video_grid_thw"].cpu().numpy().astype(np.int64)

    def __call__(self, table: pa.Table) -> pa.Table:
        if MULTI_MODAL_DATA not in table.column_names:
            return table
        n = table.num_rows
        images = rgb_arrays(table.column(MULTI_MODAL_DATA))
        inputs: list[dict] = [{} for _ in range(n)]
        image_inputs = None
        if any(images):
            image_inputs = self._image_inputs(images, table.column(IMAGE_GRIDS_COLUMN))
        videos = [None] * n
        for i, row in enumerate(table.column(VIDEO_FRAMES_COLUMN).to_pylist()):
            if row is not None:
                videos[i] = [
                    resize_frames(tensor_from_record(v["frames"]), v["height"], v["width"], self.device) for v in row
                ]
        if any(videos) and self.return_multi_modal_inputs:
            self._split(
                videos,
                self.video_pixel_values,
                table.column(VIDEO_GRIDS_COLUMN),
                inputs,
                "pixel_values_videos",
                "video",
            )
        video_records = [None if row is None else [tensor_record(v.cpu().numpy()) for v in row] for row in videos]
        data = pa.StructArray.from_arrays(
            [contiguous(table.column(MULTI_MODAL_DATA)), pa.array(video_records, type=pa.list_(TENSOR_STRUCT))],
            fields=list(_DATA_TYPE),
        )
        table = table.set_column(table.column_names.index(MULTI_MODAL_DATA), MULTI_MODAL_DATA, data)
        table = table.drop_columns([IMAGE_GRIDS_COLUMN, VIDEO_GRIDS_COLUMN, VIDEO_FRAMES_COLUMN])
        if not self.return_multi_modal_inputs:
            return table
        index = table.column_names.index(MULTI_MODAL_DATA) + 1
        return table.add_column(index, MULTI_MODAL_INPUTS, self._inputs_column(image_inputs, inputs))

    def _image_inputs(self, images: list, expected_grids: pa.ChunkedArray) -> tuple[pa.Array, pa.Array]:
        """One pixel call over every image of the batch -> per-row ``pixel_values`` / ``image_grid_thw`` records
        (uint8 patches for the consumer to normalize where our torch ops serve the processor, see ``PIXELS_STRUCT``)."""
        flat = [image for row in images if row for image in row]
        if self.pixels is not None:
            patches, grids = self.pixels.patches(flat, self.device)
            pixel_values, norm = patches.cpu().numpy(), self.pixels.norm
        else:
            (pixel_values, grids), norm = self.pixel_values(flat), None
        expected = [g for row in expected_grids.to_pylist() for g in row]
        if grids.tolist() != expected:
            raise RuntimeError(f"image grids {grids.tolist()} differ from the tokenizer's {expected}")
        per_row = np.array([len(row) if row else 0 for row in images], dtype=np.int64)
        valid = per_row > 0
        patch_ends = np.concatenate([[0], np.cumsum(grids.prod(axis=1))])  # after each image
        image_ends = np.concatenate([[0], np.cumsum(per_row)])  # after each row
        patches_per_row = patch_ends[image_ends[1:]] - patch_ends[image_ends[:-1]]
        temporal = self.pixels.spec.temporal_patch_size if self.pixels is not None else 0
        return (
            pixel_rows_array(pixel_values, patches_per_row, valid, norm, temporal),
            tensor_rows_array(grids, per_row, valid),
        )

    @staticmethod
    def _inputs_column(image_inputs: tuple | None, inputs: list[dict]) -> pa.StructArray:
        """``multi_modal_inputs``: the image records (zero-copy) beside the video records; null for rows without."""
        n = len(inputs)
        videos = [pa.array([row.get(k) for row in inputs], type=TENSOR_STRUCT) for k in _INPUTS_TYPE.names[2:]]
        if image_inputs is None:
            image_inputs = (pa.nulls(n, PIXELS_STRUCT), pa.nulls(n, TENSOR_STRUCT))
        children = [*image_inputs, *videos]
        has_any = np.zeros(n, dtype=bool)
        for child in children:
            has_any |= child.is_valid().to_numpy(zero_copy_only=False)
        return pa.StructArray.from_arrays(children, fields=list(_INPUTS_TYPE), mask=pa.array(~has_any))

    @staticmethod
    def _split(per_row: list, process, expected_grids: pa.ChunkedArray, inputs: list, values_key: str, kind: str):
        """One processor call over every item of the batch; results split back per row by the grids."""
        flat = [item for items in per_row if items for item in items]
        pixel_values, grids = process(flat)
        expected = [g for row in expected_grids.to_pylist() for g in row]
        if grids.tolist() != expected:
            raise RuntimeError(f"{kind} grids {grids.tolist()} differ from the tokenizer's {expected}")
        patches = np.cumsum([0] + [int(np.prod(g)) for g in grids])
        k = 0
        for i, items in enumerate(per_row):
            if items:
                inputs[i][values_key] = tensor_record(pixel_values[patches[k] : patches[k + len(items)]])
                inputs[i][f"{kind}_grid_thw"] = tensor_record(grids[k : k + len(items)])
                k += len(items)
