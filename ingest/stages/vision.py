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

import logging
import os
import sys
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np
import pyarrow as pa

from ingest.accounting import (
    PROVENANCE_COLUMNS,
    BatchCounts,
    StageResult,
    batch_key,
    quarantine_record,
    report_counts,
    row_error,
)
from ingest.config import DEVICE_RESIZES
from ingest.errors import BadRowError
from ingest.offline import resolve_model_path
from ingest.pixels import ImagePixels, host_array
from ingest.video import decode_video_file, decode_video_frames, resize_frames, video_file_decoder
from ingest.vision import (
    DEFERRED_JPEG_COLUMN,
    DEFERRED_VIDEO_COLUMN,
    IMAGE_GRIDS_COLUMN,
    IMAGE_STRUCT,
    MEDIA_BYTES_COLUMN,
    PIXELS_STRUCT,
    PROMPT_TOKENS_COLUMN,
    TENSOR_STRUCT,
    VIDEO_GRIDS_COLUMN,
    VIDEO_PLANS_COLUMN,
    contiguous,
    decode_rgb,
    deferrable_jpeg,
    image_rows_array,
    pixel_rows_array,
    rgb_arrays,
    tensor_from_record,
    tensor_record,
    tensor_rows_array,
    with_rgb,
)

logger = logging.getLogger(__name__)
MULTI_MODAL_DATA = "multi_modal_data"
MULTI_MODAL_INPUTS = "multi_modal_inputs"
_TENSOR_COLUMNS = ("input_ids", "attention_mask", "position_ids", "raw_prompt_ids")
VIDEO_FRAMES_COLUMN = "_media_video_frames"  # decoded, sampled frames before the final resize
_FRAMES_STRUCT = pa.struct([("frames", TENSOR_STRUCT), ("height", pa.int64()), ("width", pa.int64())])
# a video file left to the vision stage (vision_decode_video_on_device): its bytes and the frames to take
_DEFERRED_VIDEO_STRUCT = pa.struct([("data", pa.large_binary()), ("indices", pa.list_(pa.int64()))])
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
    """Encoded images -> RGB pixels (``_media_image_bytes`` -> ``multi_modal_data``); video plans -> sampled frames.

    Media whose header read fine but whose data do not decode (a truncated or corrupt file) make a bad row here:
    quarantined (the row leaves the block) or, with ``on_bad_row="raise"``, one ``BadRowError`` naming file, row and
    column. The provenance columns locate the row; they are dropped here unless ``keep_provenance``. On the processor
    path this is the last stage that drops rows, so it counts ``rows_out`` and their ``prompt_tokens`` (the tokenize
    stage counts rows in, filtered and quarantined): every count only grows, as Prometheus counters must.
    """

    def __init__(
        self,
        files: Sequence[str] = (),
        on_bad_row: str = "raise",
        image_key: str = "images",
        video_key: str = "videos",
        keep_provenance: bool = False,
        defer_jpeg: bool = False,
        defer_video: bool = False,
    ):
        self.files = list(files)
        self.on_bad_row = on_bad_row
        self.image_key, self.video_key = image_key, video_key
        self.keep_provenance = keep_provenance
        self.defer_jpeg = defer_jpeg  # leave device-decodable JPEGs encoded for the vision stage (deferrable_jpeg)
        self.defer_video = defer_video  # leave video files encoded for the vision stage (decode_video_file)

    @classmethod
    def from_config(cls, config: dict, files: Sequence[str], keep_provenance: bool = False) -> DecodeStage:
        keys = ("on_bad_row", "image_key", "video_key")
        options = {k: config[k] for k in keys if k in config}
        return cls(
            files,
            keep_provenance=keep_provenance,
            defer_jpeg=bool(config.get("vision_decode_jpeg_on_device", False)),
            defer_video=bool(config.get("vision_decode_video_on_device", False)),
            **options,
        )

    @property
    def defers(self) -> bool:
        """Whether some media may be left encoded for the vision stage (which then locates and counts their rows)."""
        return self.defer_jpeg or self.defer_video

    def _decode(self, data: bytes) -> tuple[np.ndarray, dict, bytes | None]:
        """(RGB pixels, PIL info, None), or for a JPEG left to the vision stage ((H, W, 0) size, info, its bytes)."""
        if self.defer_jpeg:
            header = deferrable_jpeg(data)
            if header is not None:
                return (*header, data)
        return (*decode_rgb(data), None)

    def __call__(self, table: pa.Table) -> StageResult:
        if MEDIA_BYTES_COLUMN not in table.column_names:  # not a block of the tokenize stage's processor path
            return StageResult(self._drop_internal(table), BatchCounts())
        encoded = table.column(MEDIA_BYTES_COLUMN).to_pylist()
        plans = table.column(VIDEO_PLANS_COLUMN).to_pylist()
        images: list = [None] * table.num_rows
        frames: list = [None] * table.num_rows
        bad: dict[int, BadRowError] = {}
        for i in range(table.num_rows):
            try:
                images[i] = None if encoded[i] is None else [self._decode(data) for data in encoded[i]]
            except Exception as exc:
                bad[i] = self._error(table, i, f"bad image: {type(exc).__name__}: {exc}", self.image_key)
                continue
            try:
                frames[i] = None if plans[i] is None else [self._frames(plan) for plan in plans[i]]
            except Exception as exc:
                bad[i] = self._error(table, i, f"bad video: {type(exc).__name__}: {exc}", self.video_key)
        if bad and self.on_bad_row == "raise":
            raise bad[min(bad)]
        kept = [i for i in range(table.num_rows) if i not in bad]
        # rows with media left to the vision stage can still turn out bad there: that stage counts them
        counted = [i for i in kept if not _has_deferred(images[i], frames[i])]
        tokens = table.column(PROMPT_TOKENS_COLUMN).to_numpy()
        counts = BatchCounts(rows_out=len(counted), quarantined=len(bad), prompt_tokens=int(tokens[counted].sum()))
        quarantine = [quarantine_record(err, _row_dict(table, i)) for i, err in sorted(bad.items())]
        if bad:
            for name in (MEDIA_BYTES_COLUMN, VIDEO_PLANS_COLUMN):  # consumed: not worth copying in the take
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
            table = table.append_column(DEFERRED_VIDEO_COLUMN, pa.array(deferred, pa.list_(_DEFERRED_VIDEO_STRUCT)))
        index = table.column_names.index(VIDEO_PLANS_COLUMN)
        table = table.set_column(index, VIDEO_FRAMES_COLUMN, pa.array(frames, type=pa.list_(_FRAMES_STRUCT)))
        return StageResult(self._drop_internal(table), counts, quarantine)

    def _frames(self, plan: dict) -> dict:
        """One video's ``VIDEO_FRAMES_COLUMN`` record; with ``defer_video`` a file's frames are null and its bytes and
        frame indices go under ``deferred`` (for ``DEFERRED_VIDEO_COLUMN``)."""
        if self.defer_video and plan["is_file"]:
            deferred = {"data": plan["data"][0], "indices": plan["indices"]}
            return {"frames": None, "height": plan["height"], "width": plan["width"], "deferred": deferred}
        record = _sampled_frames(plan)
        return {**record, "deferred": None} if self.defer_video else record

    def _error(self, table: pa.Table, i: int, reason: str, column: str) -> BadRowError:
        return row_error(self.files, table, i, reason, column)

    def _drop_internal(self, table: pa.Table) -> pa.Table:
        if self.defers:  # the vision stage locates, counts and then drops them (drop_internal_columns)
            return table
        return drop_internal_columns(table, self.keep_provenance)


def _has_deferred(images: list | None, videos: list | None) -> bool:
    """Whether a row has a JPEG or a video file left encoded for the vision stage."""
    return any(jpeg is not None for *_, jpeg in images or ()) or any(v.get("deferred") for v in videos or ())


def drop_internal_columns(table: pa.Table, keep_provenance: bool) -> pa.Table:
    """The table without the row's token count and (unless ``keep_provenance``) its provenance columns."""
    drop = [PROMPT_TOKENS_COLUMN] + ([] if keep_provenance else list(PROVENANCE_COLUMNS))
    return table.drop_columns([name for name in drop if name in table.column_names])


def _deferred(table: pa.Table, name: str) -> list:
    """A deferred-media column's values per row (all None where the block has no such column)."""
    return table.column(name).to_pylist() if name in table.column_names else [None] * table.num_rows


def _places(per_row: list) -> list[tuple[int, int]]:
    """(row, item) of every non-null item of per-row lists."""
    return [(i, j) for i, items in enumerate(per_row) for j, item in enumerate(items or ()) if item is not None]


def _renumbered(places: list[tuple[int, int]], items: list, kept: list[int]) -> tuple[list[tuple[int, int]], list]:
    """``places`` and their ``items`` for the rows in ``kept`` only, rows renumbered to their position there."""
    new_index = {old: new for new, old in enumerate(kept)}
    pairs = [((new_index[i], j), item) for (i, j), item in zip(places, items, strict=True) if i in new_index]
    return [place for place, _ in pairs], [item for _, item in pairs]


def _row_dict(table: pa.Table, i: int) -> dict | None:
    """What a quarantine record can show of a row after the tokenize stage: its plain columns."""
    names = [n for n in table.column_names if not n.startswith("_") and n not in _TENSOR_COLUMNS]
    names = [n for n in names if n not in (MULTI_MODAL_DATA, MULTI_MODAL_INPUTS)]
    try:
        return table.select(names).slice(i, 1).to_pylist()[0]
    except Exception:
        return None


def _sampled_frames(plan: dict) -> dict:
    return {"frames": tensor_record(decode_video_frames(plan)), "height": plan["height"], "width": plan["width"]}


def decode_block(stage: DecodeStage, table: pa.Table, ledger=None) -> pa.Table:
    """``stage`` over one block, its counts reported to ``ledger`` once per block (keyed by the block's first row)."""
    return counted_block(stage, table, ledger, "decode")


def vision_block(stage: VisionStage, table: pa.Table, ledger=None) -> pa.Table:
    """``stage`` over one block; counts only for rows whose media it decoded (``vision_decode_*_on_device``)."""
    return counted_block(stage.process, table, ledger, "vision", skip_empty=True)


def media_stages(
    config: dict,
    files: Sequence[str],
    keep_provenance: bool = False,
    ledger=None,
    *,
    decode: bool = False,
    vision: dict | None = None,
) -> Callable[[pa.Table], pa.Table]:
    """One block through the media stages an actor runs, in order: ``decode``, then with ``vision`` (the vision
    actor's settings: ``processor``, ``device``, ``return_multi_modal_inputs``) the vision stage. The decode and
    vision actors run theirs; a pool of size 0 (``decode_pool_max_size`` / ``vision_pool_max_size``) puts its stage
    in the actors of the stage before it. Each stage counts and quarantines as in its own actor."""
    steps: list[Callable[[pa.Table], pa.Table]] = []
    if decode:
        steps.append(partial(decode_block, DecodeStage.from_config(config, files, keep_provenance), ledger=ledger))
    if vision is not None:
        stage = VisionStage.from_config(
            resolve_model_path(vision["processor"]),
            vision.get("device", "cpu"),
            vision.get("return_multi_modal_inputs", True),
            config,
            files,
            keep_provenance,
        )
        steps.append(partial(vision_block, stage, ledger=ledger))
    return partial(_in_order, steps)


def _in_order(steps: Sequence[Callable[[pa.Table], pa.Table]], table: pa.Table) -> pa.Table:
    for step in steps:
        table = step(table)
    return table


def counted_block(process, table: pa.Table, ledger, stage: str, skip_empty: bool = False) -> pa.Table:
    """``process`` (a stage's call giving a ``StageResult``) over one block; its counts go to ``ledger`` once per
    block, keyed by ``stage`` and the block's first row (``skip_empty``: not when there is nothing to count)."""
    result = process(table)
    if table.num_rows and not (skip_empty and result.counts == BatchCounts() and not result.quarantine):
        key = batch_key(table)
        report_counts(ledger, result.counts, result.quarantine, None if key is None else (stage, *key))
    return result.table


def limit_torch_threads() -> None:
    """Hold torch's CPU thread pool to the actor's CPU share. Ray sets ``OMP_NUM_THREADS`` per task and actor (1
    for a fractional CPU) and torch follows it when first imported there; in a worker that imported torch earlier (a
    cluster started with ``RAY_preload_python_modules`` naming torch) the pool spans every core, and its OpenMP
    threads spin-wait on the cores the other stages' actors need (+2 s of CPU per 1,000 rows in ``bench mm``).
    Where torch is not imported yet this leaves it so (the CPU image path may never need it)."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if "torch" in sys.modules and threads.isdigit() and int(threads) > 0:
        import torch

        if torch.get_num_threads() != int(threads):
            torch.set_num_threads(int(threads))


def decode_jpegs(jpegs: list[bytes], device: str) -> list:
    """JPEG bytes -> (3, H, W) uint8 RGB tensors on ``device``: one batched ``torchvision.io.decode_jpeg`` call
    (nvJPEG on cuda). Where the device decoder refuses an image, PIL decodes it on the CPU (then uploaded); where
    PIL fails too, that image's entry is the exception (the caller makes its row a bad row). On the CPU, PIL's
    (H, W, 3) arrays (``decode_rgb``, the decode stage's decoder: the same pixels, and no torch import)."""
    if device == "cpu":
        return [_pil_jpeg(jpeg) for jpeg in jpegs]
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    data = [torch.frombuffer(bytearray(jpeg), dtype=torch.uint8) for jpeg in jpegs]
    try:
        return list(decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
    except RuntimeError:  # one image the device decoder cannot take fails the batch: decode one by one
        out = []
        for jpeg, tensor in zip(jpegs, data, strict=True):
            try:
                out.append(decode_jpeg(tensor, mode=ImageReadMode.RGB, device=device))
            except RuntimeError:
                rgb = _pil_jpeg(jpeg)
                if not isinstance(rgb, Exception):
                    rgb = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1).to(device)
                out.append(rgb)
        return out


def _pil_jpeg(jpeg: bytes):
    """PIL's (H, W, 3) RGB of a JPEG (the decode stage's decoder), or the exception that stopped it."""
    try:
        return decode_rgb(jpeg)[0]
    except Exception as exc:
        return exc


def resolve_device(device: str) -> str:
    """``auto``: cuda where this process can use a GPU, else cpu. In a Ray actor that Ray gave no GPU the answer is
    cpu without importing torch (seconds of an actor's start-up that the CPU image path never needs); elsewhere
    torch's answer."""
    if device != "auto":
        return device
    if _ray_actor_gpu_ids() == []:
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _ray_actor_gpu_ids() -> list[str] | None:
    """The GPU ids Ray assigned to the current actor; None outside a Ray actor."""
    if "ray" not in sys.modules:
        return None
    import ray

    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    if context.get_actor_id() is None:
        return None
    return list(context.get_accelerator_ids().get("GPU", []))


def resize_kernel(device_resize: str, device: str) -> str:
    """The image resize ``ImagePixels.patches`` runs for ``vision_device_resize`` on ``device``: "triton" on CUDA
    (and on the CPU under ``TRITON_INTERPRET=1``, the tests' way to run it), else "torch" (on the CPU: the C uint8
    kernel, whose bytes the Triton kernels reproduce). "auto": "triton" on CUDA where triton imports, else "torch";
    on the CPU it imports nothing (a CPU vision actor never imports torch or triton)."""
    if device_resize not in DEVICE_RESIZES:
        raise ValueError(f"vision_device_resize must be one of {DEVICE_RESIZES}, got {device_resize!r}")
    if device_resize == "torch":
        return "torch"
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.startswith("cuda") or (device_resize == "triton" and interpreted):
        from ingest.triton_resize import triton_available

        why = triton_available()
        if why and device_resize == "triton":
            raise RuntimeError(f"vision_device_resize: triton, but triton does not import here ({why})")
        return "torch" if why else "triton"
    return "torch"


class VisionStage:
    """``multi_modal_data`` pixels -> ``multi_modal_inputs`` (pixel_values, image_grid_thw) on ``device``."""

    def __init__(
        self,
        processor_path: str,
        device: str = "cpu",
        return_multi_modal_inputs: bool = True,
        *,
        files: Sequence[str] = (),
        on_bad_row: str = "raise",
        image_key: str = "images",
        video_key: str = "videos",
        keep_provenance: bool = False,
        video_decoder: str = "auto",
        device_resize: str = "auto",
    ):
        limit_torch_threads()
        # for rows with media the decode stage left to this one (vision_decode_jpeg_on_device,
        # vision_decode_video_on_device): bad ones are located, quarantined or raised here, the good ones counted out
        self.files, self.on_bad_row = list(files), on_bad_row
        self.image_key, self.video_key = image_key, video_key
        self.keep_provenance = keep_provenance
        self.device = resolve_device(device)
        self.video_decoder = video_decoder
        if video_decoder != "auto":  # an explicit decoder that does not load fails here, once
            video_file_decoder(self.device, video_decoder)
        self.processor_path = processor_path
        # Qwen2-VL processors: our torch ops (no transformers import); any other: transformers' image processor
        self.pixels = ImagePixels.from_dir(processor_path)
        self.resize_kernel = resize_kernel(device_resize, self.device)
        if self.pixels is not None:  # first-call set-up (the torch import, a kernel's compile) here
            self._warm_up(device_resize)
        self._image_processor = None if self.pixels is not None else self._load_image_processor()
        self._video_processor = None  # loaded on the first video
        self.return_multi_modal_inputs = return_multi_modal_inputs

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

    @classmethod
    def from_config(
        cls,
        processor_path: str,
        device: str,
        return_multi_modal_inputs: bool,
        config: dict,
        files: Sequence[str],
        keep_provenance: bool = False,
    ) -> VisionStage:
        options = {k: config[k] for k in ("on_bad_row", "image_key", "video_key") if k in config}
        if "vision_video_decoder" in config:
            options["video_decoder"] = config["vision_video_decoder"]
        if "vision_device_resize" in config:
            options["device_resize"] = config["vision_device_resize"]
        return cls(
            processor_path, device, return_multi_modal_inputs, files=files, keep_provenance=keep_provenance, **options
        )

    @classmethod
    def of_image_processor(cls, image_processor, device: str = "cpu") -> VisionStage:
        """A stage that runs an already loaded transformers image processor (images only)."""
        stage = cls.__new__(cls)
        stage.files, stage.on_bad_row, stage.keep_provenance = [], "raise", False
        stage.image_key, stage.video_key = "images", "videos"
        stage.device = resolve_device(device)
        stage.video_decoder, stage.resize_kernel = "auto", "torch"
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
            result, on_device, video_frames = self._decode_deferred(table)
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
        videos = [None] * n
        for i, row in enumerate(table.column(VIDEO_FRAMES_COLUMN).to_pylist()):
            if row is not None:  # frames decoded by the decode stage, or here (video_frames: deferred files)
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
            [contiguous(table.column(MULTI_MODAL_DATA)), pa.array(video_records, type=pa.list_(TENSOR_STRUCT))],
            fields=list(_DATA_TYPE),
        )
        table = table.set_column(table.column_names.index(MULTI_MODAL_DATA), MULTI_MODAL_DATA, data)
        table = table.drop_columns([IMAGE_GRIDS_COLUMN, VIDEO_GRIDS_COLUMN, VIDEO_FRAMES_COLUMN])
        if not self.return_multi_modal_inputs:
            return table
        index = table.column_names.index(MULTI_MODAL_DATA) + 1
        return table.add_column(index, MULTI_MODAL_INPUTS, self._inputs_column(image_inputs, inputs))

    def _decode_deferred(self, table: pa.Table) -> tuple[StageResult, dict[int, object], dict[tuple, object]]:
        """Decode the media the decode stage left encoded. JPEGs: one batched call on ``device`` (nvJPEG through
        torchvision on cuda; PIL on the CPU, the decode stage's decoder). Video files: ``decode_video_file`` with
        ``vision_video_decoder`` (by default torchcodec on cuda where it loads, else PyAV). A row with a JPEG that
        neither the device decoder nor PIL decodes, or a video that does not decode, is a bad row: ``BadRowError``
        naming file and row (``on_bad_row: raise``) or a quarantine record. The JPEGs' RGB goes into
        ``multi_modal_data`` (a copy to the host); the device tensors, by their position among the batch's images,
        feed the pixel ops without a second upload; the videos' frames stay on the device for the resize, keyed (row,
        video). Returns the table without the deferred columns (and without the bad rows), the counts of the rows that
        had deferred media, and the two sets of tensors."""
        jpegs = _deferred(table, DEFERRED_JPEG_COLUMN)
        videos = _deferred(table, DEFERRED_VIDEO_COLUMN)
        table = table.drop_columns(
            [c for c in (DEFERRED_JPEG_COLUMN, DEFERRED_VIDEO_COLUMN) if c in table.column_names]
        )
        jpeg_places = _places(jpegs)
        video_places = _places(videos)
        if not jpeg_places and not video_places:
            return StageResult(table, BatchCounts()), {}, {}
        decoded = decode_jpegs([jpegs[i][j] for i, j in jpeg_places], self.device) if jpeg_places else []
        frames = [self._decode_video(videos[i][j]) for i, j in video_places]
        bad: dict[int, BadRowError] = {}
        for places, items, what, column in (
            (jpeg_places, decoded, "image", self.image_key),
            (video_places, frames, "video", self.video_key),
        ):
            for (i, _), item in zip(places, items, strict=True):
                if isinstance(item, Exception) and i not in bad:
                    reason = f"bad {what}: {type(item).__name__}: {item}"
                    bad[i] = row_error(self.files, table, i, reason, column)
        if bad and self.on_bad_row == "raise":
            raise bad[min(bad)]
        rows = sorted({i for i, _ in jpeg_places + video_places} - bad.keys())
        tokens = table.column(PROMPT_TOKENS_COLUMN).to_numpy()
        counts = BatchCounts(rows_out=len(rows), quarantined=len(bad), prompt_tokens=int(tokens[rows].sum()))
        quarantine = [quarantine_record(err, _row_dict(table, i)) for i, err in sorted(bad.items())]
        if bad:
            kept = [i for i in range(table.num_rows) if i not in bad]
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
