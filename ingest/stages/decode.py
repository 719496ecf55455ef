"""The decode stage (CPU): encoded image bytes -> RGB pixels, once (PIL ``convert("RGB")``, as verl). The pixels
travel as plain Arrow structs (width, height, rgb bytes) and become ``multi_modal_data["image"]`` PIL images at the
consumer. Videos: the sampled frames (PyAV for files, PIL + fetch_image's resize for frame lists) as uint8 arrays.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ingest.accounting import BatchCounts, StageResult, processed_row
from ingest.blocks import (
    DEFERRED_JPEG_COLUMN,
    DEFERRED_VIDEO_COLUMN,
    DEFERRED_VIDEO_STRUCT,
    FILE_COLUMN,
    FRAMES_STRUCT,
    MEDIA_BYTES_COLUMN,
    MULTI_MODAL_DATA,
    PROMPT_TOKENS_COLUMN,
    VIDEO_FRAMES_COLUMN,
    VIDEO_PLANS_COLUMN,
    drop_internal_columns,
    image_rows_array,
    provenance_rows,
    tensor_record,
)
from ingest.config import DataConfig, StageContext
from ingest.media.image import decode_fetched, decode_rgb, deferrable_jpeg
from ingest.media.video import decode_video_frames
from ingest.stages.bad_rows import BadRows


class DecodeStage:
    """Encoded images -> RGB pixels (``_media_image_bytes`` -> ``multi_modal_data``); video plans -> sampled frames.

    Media whose header read fine but whose data do not decode (a truncated or corrupt file) make a bad row here:
    quarantined (the row leaves the block) or, with ``on_bad_row="raise"``, one ``BadRowError`` naming file, row and
    column. The provenance columns locate the row; they are dropped here unless ``keep_provenance``. On the processor
    path this is the last stage that drops rows, so it counts ``rows_out`` and their ``prompt_tokens`` (the tokenize
    stage counts rows in, filtered and quarantined): every count only grows, as Prometheus counters must.
    ``count_only``: the same decoding, decisions and counts, but the output is the kept rows' provenance (an epoch's
    row count), not their pixels; JPEGs are decoded here, not deferred.
    """

    def __init__(
        self, config: DataConfig | None = None, context: StageContext | None = None, *, count_only: bool = False
    ):
        config, context = config or DataConfig(), context or StageContext()
        self.count_only = count_only
        self.files = list(context.files)
        self.on_bad_row = config.on_bad_row
        self.image_key, self.video_key = config.image_key, config.video_key
        self.keep_provenance = context.keep_provenance
        self.context = context
        self.plain_structs_turned = config.row_format == "verl-0.5"  # (StageContext.images_turned)
        self.fetch = config.fetches_plain_struct_images
        # leave device-decodable JPEGs (deferrable_jpeg) / video files (decode_video_file) encoded for the vision stage
        # a count decodes JPEGs with PIL, as the vision stage does any its device refuses
        self.defer_jpeg = config.vision_decode_jpeg_on_device and not count_only
        self.defer_video = config.vision_decode_video_on_device
        # media_handoff: the rollout-media stage after this one can still find a row bad, so it counts the rows out
        self.hands_off = config.media_handoff and not count_only
        if count_only and self.defer_video:  # only the device's decoder says which of them decode
            raise ValueError("videos decoded on a device (vision_decode_video_on_device) are counted where decoded")

    @property
    def defers(self) -> bool:
        """Whether some media may be left encoded for the vision stage (which then locates and counts their rows)."""
        return self.defer_jpeg or self.defer_video

    def _decode(self, data: bytes, turned: bool, fetched: int | None) -> tuple[np.ndarray, dict, bytes | None]:
        """(RGB pixels, PIL info, None), or for a JPEG left to the vision stage ((H, W, 0) size, info, its bytes);
        ``turned``: as HF datasets turns it by its EXIF Orientation; ``fetched``: as ``fetch_image`` resizes it with
        that patch size (``DataConfig.fetches_plain_struct_images``)."""
        if fetched is not None:
            return (*decode_fetched(data, fetched, pixels=not self.count_only), None)
        if self.defer_jpeg:
            header = deferrable_jpeg(data, turned=turned)
            if header is not None:
                return (*header, data)
        return (*decode_rgb(data, pixels=not self.count_only, turned=turned), None)

    def __call__(self, table: pa.Table) -> StageResult:
        if MEDIA_BYTES_COLUMN not in table.column_names:  # not a block of the tokenize stage's processor path
            return StageResult(self._drop_internal(table), BatchCounts())
        encoded = table.column(MEDIA_BYTES_COLUMN).to_pylist()
        has_plans = VIDEO_PLANS_COLUMN in table.column_names  # not on verl 0.9 rows: their videos stay sources
        plans = table.column(VIDEO_PLANS_COLUMN).to_pylist() if has_plans else [None] * table.num_rows
        images: list = [None] * table.num_rows
        frames: list = [None] * table.num_rows
        bad = BadRows(self.files, table)
        files = table.column(FILE_COLUMN).to_numpy() if FILE_COLUMN in table.column_names else None
        plain = self.context.plain_struct_rows(files, table.num_rows)
        turned = self.context.images_turned(plain, plain_structs_turned=self.plain_structs_turned)
        for i in range(table.num_rows):
            fetched = self.fetch if plain[i] else None
            try:
                images[i] = (
                    None if encoded[i] is None else [self._decode(data, turned[i], fetched) for data in encoded[i]]
                )
            except Exception as exc:
                bad.add(i, f"bad image: {type(exc).__name__}: {exc}", self.image_key)
                continue
            try:
                frames[i] = None if plans[i] is None else [self._frames(plan) for plan in plans[i]]
            except Exception as exc:
                bad.add(i, f"bad video: {type(exc).__name__}: {exc}", self.video_key)
        bad.raise_first(self.on_bad_row)
        kept = bad.kept()
        # rows with media left to the vision stage can still turn out bad there: that stage counts them
        counted = [] if self.hands_off else [i for i in kept if not _hasdeferred_values(images[i], frames[i])]
        tokens = table.column(PROMPT_TOKENS_COLUMN).to_numpy()
        counts = BatchCounts(rows_out=len(counted), quarantined=len(bad), prompt_tokens=int(tokens[counted].sum()))
        quarantine = bad.quarantine(processed_row)
        if self.count_only:
            return StageResult(provenance_rows(table, kept), counts, quarantine)
        if bad:
            for name in (MEDIA_BYTES_COLUMN, VIDEO_PLANS_COLUMN)[: 1 + has_plans]:  # consumed: not worth copying
                table = table.set_column(table.column_names.index(name), name, pa.nulls(table.num_rows))
            table = table.take(kept)
            images, frames = [images[i] for i in kept], [frames[i] for i in kept]
        index = table.column_names.index(MEDIA_BYTES_COLUMN)
        pixels = [None if row is None else [(rgb, info) for rgb, info, _ in row] for row in images]
        table = table.set_column(index, MULTI_MODAL_DATA, image_rows_array(pixels))
        if self.defer_jpeg:
            deferred = [None if row is None else [jpeg for *_, jpeg in row] for row in images]
            table = table.append_column(DEFERRED_JPEG_COLUMN, pa.array(deferred, pa.list_(pa.large_binary())))
        if self.defer_video:
            deferred = [None if row is None else [video.pop("deferred") for video in row] for row in frames]
            table = table.append_column(DEFERRED_VIDEO_COLUMN, pa.array(deferred, pa.list_(DEFERRED_VIDEO_STRUCT)))
        if has_plans:
            index = table.column_names.index(VIDEO_PLANS_COLUMN)
            table = table.set_column(index, VIDEO_FRAMES_COLUMN, pa.array(frames, type=pa.list_(FRAMES_STRUCT)))
        return StageResult(self._drop_internal(table), counts, quarantine)

    def _frames(self, plan: dict) -> dict:
        """One video's ``VIDEO_FRAMES_COLUMN`` record; with ``defer_video`` a file's frames are null and its bytes and
        frame indices go under ``deferred`` (for ``DEFERRED_VIDEO_COLUMN``)."""
        if self.defer_video and plan["is_file"]:
            deferred = {"data": plan["data"][0], "indices": plan["indices"]}
            return {**_frame_fields(plan), "frames": None, "deferred": deferred}
        record = _sampled_frames(plan)
        return {**record, "deferred": None} if self.defer_video else record

    def _drop_internal(self, table: pa.Table) -> pa.Table:
        if self.defers or self.hands_off:  # the next stage locates, counts and then drops them (drop_internal_columns)
            return table
        return drop_internal_columns(table, self.keep_provenance)


def _hasdeferred_values(images: list | None, videos: list | None) -> bool:
    """Whether a row has a JPEG or a video file left encoded for the vision stage."""
    return any(jpeg is not None for *_, jpeg in images or ()) or any(v.get("deferred") for v in videos or ())


def _frame_fields(plan: dict) -> dict:
    return {"height": plan["height"], "width": plan["width"], "metadata": plan["metadata"]}


def _sampled_frames(plan: dict) -> dict:
    return {**_frame_fields(plan), "frames": tensor_record(decode_video_frames(plan))}
