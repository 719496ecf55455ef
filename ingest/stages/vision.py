"""The vision stage (CPU or GPU).

RGB pixels -> the image processor's ``pixel_values`` / ``image_grid_thw`` with torch ops on ``device``
(``ingest.media.pixels`` for Qwen2-VL processors: resize, rescale + normalize, patchify; transformers for any other).
Videos: fetch_video's bicubic resize on ``device`` (that is ``multi_modal_data["video"]``), then the video processor's
``pixel_values_videos`` / ``video_grid_thw``. One processor call per batch and modality; outputs are split back per
row by the grids, which must equal the ones the tokenize stage derived from headers (they decided how many pad tokens
``input_ids`` holds).
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import pyarrow as pa

from ingest.accounting import BatchCounts, StageResult, processed_row
from ingest.blocks import (
    DEFERRED_JPEG_COLUMN,
    DEFERRED_VIDEO_COLUMN,
    IMAGE_GRIDS_COLUMN,
    MULTI_MODAL_DATA,
    MULTI_MODAL_DATA_TYPE,
    MULTI_MODAL_INPUTS,
    MULTI_MODAL_INPUTS_TYPE,
    PIXELS_STRUCT,
    PROMPT_TOKENS_COLUMN,
    TENSOR_STRUCT,
    VIDEO_FRAMES_COLUMN,
    VIDEO_GRIDS_COLUMN,
    VIDEO_METADATA_STRUCT,
    contiguous,
    deferred_values,
    drop_internal_columns,
    pixel_rows_array,
    rgb_arrays,
    tensor_from_record,
    tensor_record,
    tensor_rows_array,
    with_rgb,
)
from ingest.config import DataConfig, StageContext
from ingest.media.device import limit_torch_threads, resize_kernel, resolve_device
from ingest.media.image import decode_jpegs
from ingest.media.pixels import ProcessorPixels, host_array
from ingest.media.video import decode_video_file, resize_frames, video_file_decoder
from ingest.stages.bad_rows import BadRows

logger = logging.getLogger(__name__)


def _places(per_row: list) -> list[tuple[int, int]]:
    """(row, item) of every non-null item of per-row lists."""
    return [(i, j) for i, items in enumerate(per_row) for j, item in enumerate(items or ()) if item is not None]


def _renumbered(places: list[tuple[int, int]], items: list, kept: list[int]) -> tuple[list[tuple[int, int]], list]:
    """``places`` and their ``items`` for the rows in ``kept`` only, rows renumbered to their position there."""
    new_index = {old: new for new, old in enumerate(kept)}
    pairs = [((new_index[i], j), item) for (i, j), item in zip(places, items, strict=True) if i in new_index]
    return [place for place, _ in pairs], [item for _, item in pairs]


class VisionStage:
    """``multi_modal_data`` pixels -> ``multi_modal_inputs`` (pixel_values, image_grid_thw) on ``device``."""

    def __init__(self, processor_path: str, config: DataConfig | None = None, context: StageContext | None = None):
        config, context = config or DataConfig(), context or StageContext()
        limit_torch_threads()
        # for rows with media the decode stage left to this one (vision_decode_jpeg_on_device,
        # vision_decode_video_on_device): bad ones are located, quarantined or raised here, the good ones counted out
        self.files, self.on_bad_row = list(context.files), config.on_bad_row
        self.image_key, self.video_key = config.image_key, config.video_key
        self.keep_provenance = context.keep_provenance
        self.device = resolve_device(config.vision_device)  # "auto": cuda when Ray gave this actor a GPU, else cpu
        self.video_decoder = config.vision_video_decoder
        if self.video_decoder != "auto":  # an explicit decoder that does not load fails here, once
            video_file_decoder(self.device, self.video_decoder)
        self.processor_path = processor_path
        # Qwen2-VL processors: our torch ops (no transformers import); any other: transformers' image processor
        self.pixel_values = ProcessorPixels(processor_path, self.device)
        self.pixels = self.pixel_values.pixels
        self.resize_kernel = resize_kernel(config.vision_device_resize, self.device)
        if self.pixels is not None:  # first-call set-up (the torch import, a kernel's compile) here
            self._warm_up(config.vision_device_resize)
        if self.pixels is None:  # loaded at start-up, not on the first block
            self.pixel_values.image_processor  # noqa: B018
        self._video_processor = None  # loaded on the first video
        self.return_multi_modal_inputs = config.return_multi_modal_inputs

    def _warm_up(self, device_resize: str) -> None:
        """Resize one tiny image with the chosen kernel. Where "auto" chose Triton and its kernels do not build or
        run on this device (a GPU its compiler does not target, say), fall back to torch's, saying why, once."""
        tiny = [np.zeros((28, 28, 3), dtype=np.uint8)]
        try:
            self.pixels.patches(tiny, self.device, kernel=self.resize_kernel)
        except Exception as exc:
            if device_resize != "auto" or self.resize_kernel == "torch":
                raise
            logger.warning(
                "vision_device_resize: auto: the Triton resize failed on %s (%s: %s); this actor resizes with "
                "torch's float kernels instead (within 2 levels of the CPU kernel, not its bytes)",
                self.device,
                type(exc).__name__,
                str(exc)[:300],
            )
            self.resize_kernel = "torch"
            self.pixels.patches(tiny, self.device, kernel="torch")

    @property
    def image_processor(self):
        """transformers' image processor for this path (loaded on first use where our kernels serve the images)."""
        return self.pixel_values.image_processor

    @property
    def video_processor(self):
        if self._video_processor is None:
            from transformers import AutoVideoProcessor

            self._video_processor = AutoVideoProcessor.from_pretrained(self.processor_path)
            if hasattr(self._video_processor, "cap_pixels_per_frame"):
                # transformers 4.x behaviour (what verl 0.5.0 runs with): no extra per-frame pixel cap
                self._video_processor.cap_pixels_per_frame = False
        return self._video_processor

    def video_pixel_values(self, videos: list) -> tuple[np.ndarray, np.ndarray]:
        # the frames are fetch_video's sample already (verl passes do_sample_frames=False; Qwen3-VL's default samples);
        # verl hands the processor fetch_video's float frames, so a second resize (Qwen3-VL's 32-pixel factor) is not
        # rounded to bytes
        videos = [video.float() for video in videos]
        out = self.video_processor(videos=videos, return_tensors="pt", device=self.device, do_sample_frames=False)
        return out["pixel_values_videos"].float().cpu().numpy(), out["video_grid_thw"].cpu().numpy().astype(np.int64)

    def __call__(self, table: pa.Table) -> pa.Table:
        return self.process(table).table

    def process(self, table: pa.Table) -> StageResult:
        """The block with ``multi_modal_inputs``, plus the counts and quarantine records of the rows whose JPEGs
        this stage decoded (the decode stage counted all others)."""
        if MULTI_MODAL_DATA not in table.column_names:
            return StageResult(table, BatchCounts())
        result = StageResult(table, BatchCounts())
        on_device: dict[int, object] = {}
        video_frames: dict[tuple, object] = {}
        if DEFERRED_JPEG_COLUMN in table.column_names or DEFERRED_VIDEO_COLUMN in table.column_names:
            result, on_device, video_frames = self._decodedeferred_values(table)
        inputs = self._with_inputs(result.table, on_device, video_frames)
        result.table = drop_internal_columns(inputs, self.keep_provenance)
        return result

    def _with_inputs(
        self, table: pa.Table, on_device: dict[int, object], video_frames: dict[tuple, object]
    ) -> pa.Table:
        n = table.num_rows
        images = rgb_arrays(table.column(MULTI_MODAL_DATA))
        inputs: list[dict] = [{} for _ in range(n)]
        image_inputs = None
        if any(images):
            image_inputs = self._image_inputs(images, table.column(IMAGE_GRIDS_COLUMN), on_device)
        videos, metadata = [None] * n, [None] * n
        for i, row in enumerate(table.column(VIDEO_FRAMES_COLUMN).to_pylist()):
            if row is not None:  # frames decoded by the decode stage, or here (video_frames: deferred files)
                metadata[i] = [self._with_reader(v["metadata"], (i, j) in video_frames) for j, v in enumerate(row)]
                videos[i] = [
                    resize_frames(
                        video_frames[i, j] if (i, j) in video_frames else tensor_from_record(v["frames"]),
                        v["height"],
                        v["width"],
                        self.device,
                    )
                    for j, v in enumerate(row)
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
            [
                contiguous(table.column(MULTI_MODAL_DATA)),
                pa.array(video_records, type=pa.list_(TENSOR_STRUCT)),
                pa.array(metadata, type=pa.list_(VIDEO_METADATA_STRUCT)),
            ],
            fields=list(MULTI_MODAL_DATA_TYPE),
        )
        table = table.set_column(table.column_names.index(MULTI_MODAL_DATA), MULTI_MODAL_DATA, data)
        table = table.drop_columns([IMAGE_GRIDS_COLUMN, VIDEO_GRIDS_COLUMN, VIDEO_FRAMES_COLUMN])
        if not self.return_multi_modal_inputs:
            return table
        index = table.column_names.index(MULTI_MODAL_DATA) + 1
        return table.add_column(index, MULTI_MODAL_INPUTS, self._inputs_column(image_inputs, inputs))

    def _with_reader(self, metadata: dict, decoded_here: bool) -> dict:
        """A file's metadata names the reader that decoded it (the decode stage's PyAV, or this stage's decoder)."""
        if not metadata["from_file"]:
            return metadata
        return {**metadata, "video_backend": self._video_reader if decoded_here else "pyav"}

    @functools.cached_property
    def _video_reader(self) -> str:
        return video_file_decoder(self.device, self.video_decoder)

    def _decodedeferred_values(self, table: pa.Table) -> tuple[StageResult, dict[int, object], dict[tuple, object]]:
        """Decode the media the decode stage left encoded. JPEGs: one batched call on ``device`` (nvJPEG through
        torchvision on cuda; PIL on the CPU, the decode stage's decoder). Video files: ``decode_video_file`` with
        ``vision_video_decoder`` (by default torchcodec on cuda where it loads, else PyAV). A row with a JPEG that
        neither the device decoder nor PIL decodes, or a video that does not decode, is a bad row: ``BadRowError``
        naming file and row (``on_bad_row: raise``) or a quarantine record. The JPEGs' RGB goes into
        ``multi_modal_data`` (a copy to the host); the device tensors, by their position among the batch's images,
        feed the pixel ops without a second upload; the videos' frames stay on the device for the resize, keyed (row,
        video). Returns the table without the deferred columns (and without the bad rows), the counts of the rows that
        had deferred media, and the two sets of tensors."""
        jpegs = deferred_values(table, DEFERRED_JPEG_COLUMN)
        videos = deferred_values(table, DEFERRED_VIDEO_COLUMN)
        table = table.drop_columns(
            [c for c in (DEFERRED_JPEG_COLUMN, DEFERRED_VIDEO_COLUMN) if c in table.column_names]
        )
        jpeg_places = _places(jpegs)
        video_places = _places(videos)
        if not jpeg_places and not video_places:
            return StageResult(table, BatchCounts()), {}, {}
        decoded = decode_jpegs([jpegs[i][j] for i, j in jpeg_places], self.device) if jpeg_places else []
        frames = [self._decode_video(videos[i][j]) for i, j in video_places]
        bad = BadRows(self.files, table)
        for places, items, what, column in (
            (jpeg_places, decoded, "image", self.image_key),
            (video_places, frames, "video", self.video_key),
        ):
            for (i, _), item in zip(places, items, strict=True):
                if isinstance(item, Exception) and i not in bad:
                    bad.add(i, f"bad {what}: {type(item).__name__}: {item}", column)
        bad.raise_first(self.on_bad_row)
        rows = sorted({i for i, _ in jpeg_places + video_places if i not in bad})
        tokens = table.column(PROMPT_TOKENS_COLUMN).to_numpy()
        counts = BatchCounts(rows_out=len(rows), quarantined=len(bad), prompt_tokens=int(tokens[rows].sum()))
        quarantine = bad.quarantine(processed_row)
        if bad:
            kept = bad.kept()
            table = table.take(kept)
            jpeg_places, decoded = _renumbered(jpeg_places, decoded, kept)
            video_places, frames = _renumbered(video_places, frames, kept)
        images = contiguous(table.column(MULTI_MODAL_DATA))
        offsets, first = images.offsets.to_pylist(), images.offsets[0].as_py()
        positions = [offsets[i] + j - first for i, j in jpeg_places]
        host = {
            p: image if isinstance(image, np.ndarray) else image.permute(1, 2, 0).cpu().numpy()
            for p, image in zip(positions, decoded, strict=True)
        }
        if host:
            table = table.set_column(
                table.column_names.index(MULTI_MODAL_DATA), MULTI_MODAL_DATA, with_rgb(images, host)
            )
        on_device = dict(zip(positions, decoded, strict=True))
        return StageResult(table, counts, quarantine), on_device, dict(zip(video_places, frames, strict=True))

    def _decode_video(self, deferred: dict):
        """A deferred video's sampled frames, (T, 3, H, W) uint8 on ``device``, or the exception that stopped them."""
        try:
            return decode_video_file(deferred["data"], deferred["indices"], self.device, self.video_decoder)
        except Exception as exc:
            return exc

    def _image_inputs(
        self, images: list, expected_grids: pa.ChunkedArray, on_device: dict | None = None
    ) -> tuple[pa.Array, pa.Array]:
        """One pixel call over every image of the batch -> per-row ``pixel_values`` / ``image_grid_thw`` records
        (uint8 patches for the consumer to normalize where our torch ops serve the processor, see ``PIXELS_STRUCT``).
        ``on_device``: (3, H, W) tensors already on ``device`` (on the CPU, (H, W, 3) arrays) for some images, by
        position in the batch."""
        flat = [image for row in images if row for image in row]
        for position, tensor in (on_device or {}).items():
            flat[position] = tensor
        if self.pixels is not None:
            patches, grids = self.pixels.patches(flat, self.device, kernel=self.resize_kernel)
            pixel_values, norm = host_array(patches), self.pixels.norm
        else:
            flat = [np.asarray(im.permute(1, 2, 0).cpu()) if not isinstance(im, np.ndarray) else im for im in flat]
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
        videos = [
            pa.array([row.get(k) for row in inputs], type=TENSOR_STRUCT) for k in MULTI_MODAL_INPUTS_TYPE.names[2:]
        ]
        if image_inputs is None:
            image_inputs = (pa.nulls(n, PIXELS_STRUCT), pa.nulls(n, TENSOR_STRUCT))
        children = [*image_inputs, *videos]
        has_any = np.zeros(n, dtype=bool)
        for child in children:
            has_any |= child.is_valid().to_numpy(zero_copy_only=False)
        return pa.StructArray.from_arrays(children, fields=list(MULTI_MODAL_INPUTS_TYPE), mask=pa.array(~has_any))

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
