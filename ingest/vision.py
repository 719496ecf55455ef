"""Vision logic shared by the multimodal stages: the processor's geometry, image decoding, Qwen2-VL rope positions.

Nothing here imports transformers: the tokenize stage needs only the processor's numbers (patch / merge size, pixel
budget) to know how many pad tokens each image expands to, so it reads them from the saved JSON.
"""

from __future__ import annotations

import io
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from ingest.memory import ReusedBuffers

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_START = "<|vision_start|>"

# Columns the tokenize stage adds for the decode and vision stages (defined here, not in the tokenize stage, so that
# the decode and vision actors import neither the tokenizer's modules nor jinja2)
MEDIA_BYTES_COLUMN = "_media_image_bytes"  # encoded images, for the decode stage (null: the row has no images)
IMAGE_GRIDS_COLUMN = "_media_image_grids"  # grids computed by the tokenize stage, checked by the vision stage
VIDEO_PLANS_COLUMN = "_media_videos"  # VideoPlan records, for the decode stage (null: the row has no videos)
VIDEO_GRIDS_COLUMN = "_media_video_grids"
# the row's prompt_tokens count (expanded, before truncation): counted by the decode stage (it may still drop the row)
PROMPT_TOKENS_COLUMN = "_media_prompt_tokens"
# JPEGs the decode stage left encoded for the vision stage to decode on its device (vision_decode_jpeg_on_device):
# per row, one entry per image (null: decoded already); their multi_modal_data records have size and info, no pixels
DEFERRED_JPEG_COLUMN = "_media_deferred_jpeg"
# video files the decode stage left encoded for the vision stage (vision_decode_video_on_device)
DEFERRED_VIDEO_COLUMN = "_media_deferred_videos"

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PACKED_PIXELS = ReusedBuffers()  # a block's decoded RGB pixels (``_packed_binary``)


def image_processor_config(path: str | Path) -> dict:
    """The saved image processor config of a model directory (``preprocessor_config.json``, else the
    ``image_processor`` section of ``processor_config.json``; ``{}`` when neither is there)."""
    path = Path(path)
    if (path / "preprocessor_config.json").is_file():
        return json.loads((path / "preprocessor_config.json").read_text())
    if (path / "processor_config.json").is_file():
        return json.loads((path / "processor_config.json").read_text()).get("image_processor", {})
    return {}


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

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dir(cls, path: str | Path) -> VisionSpec:
        path = Path(path)
        config = image_processor_config(path)
        size = config.get("size") or {}
        video: dict = {}
        if (path / "video_preprocessor_config.json").is_file():
            video = json.loads((path / "video_preprocessor_config.json").read_text())
        video_size = video.get("size") or {}
        return cls(
            patch_size=int(config.get("patch_size", 14)),
            merge_size=int(config.get("merge_size", 2)),
            temporal_patch_size=int(config.get("temporal_patch_size", 2)),
            min_pixels=int(config.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
            max_pixels=int(config.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280),
            processor_class=str(config.get("image_processor_type", "Qwen2VLImageProcessor")),
            video_min_pixels=int(video.get("min_pixels") or video_size.get("shortest_edge") or 128 * 28 * 28),
            video_max_pixels=int(video.get("max_pixels") or video_size.get("longest_edge") or 768 * 28 * 28),
        )

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
    h, w = smart_resize(height, width, spec.factor, spec.video_min_pixels, spec.video_max_pixels)
    return -(-nframes // spec.temporal_patch_size), h // spec.patch_size, w // spec.patch_size


def grid_tokens(grid: tuple[int, int, int], spec: VisionSpec) -> int:
    """How many pad tokens one image or video expands to in ``input_ids``."""
    return int(np.prod(grid)) // (spec.merge_size**2)


# --- image values as they appear in Parquet -------------------------------------------------------------------------


def image_source(value) -> tuple[bytes | None, str | None]:
    """(encoded bytes, path) of one image value: an HF ``Image()`` struct ``{bytes, path}``, raw bytes or a path."""
    if isinstance(value, dict):
        return value.get("bytes"), value.get("path")
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value), None
    if isinstance(value, str):
        return None, value
    raise ValueError(f"unsupported image value of type {type(value).__name__}")


def read_image_bytes(value, storage_options: dict | None = None) -> bytes:
    data, path = image_source(value)
    if data:
        return data
    if not path:
        raise ValueError("image has neither bytes nor a path")
    from ingest.sources import filesystem_for, protocol_of

    if protocol_of(path) == "file":
        with open(path.removeprefix("file://"), "rb") as f:
            return f.read()
    with filesystem_for(path, storage_options).open(path, "rb") as f:
        return f.read()


def _complete_jpeg(data: bytes) -> bool | None:
    """None when ``data`` is not a JPEG; else whether it ends with its end-of-image marker (trailing zeros allowed)."""
    if data[:2] != b"\xff\xd8":
        return None
    return data.rstrip(b"\x00")[-2:] == b"\xff\xd9"


def check_complete(data: bytes) -> None:
    """Raise ``OSError`` for an image file cut short, without decoding pixels: a PNG's chunks are read to ``IEND``
    with their CRCs checked (PIL ``verify``; stricter than decoding in one case: a PNG missing only ``IEND``), a JPEG
    must end with its end-of-image marker. For stages that hand images on encoded to a stage without per-row
    quarantine (the SFT vision actor). Other formats pass."""
    from PIL import Image

    if data[:8] == _PNG_SIGNATURE:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    elif _complete_jpeg(data) is False:
        raise OSError("truncated JPEG file (no end-of-image marker)")


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the header only (no pixel decode)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
    if width < 1 or height < 1:
        raise ValueError(f"image has zero size ({width}x{height})")
    return width, height


def decode_rgb(data: bytes) -> tuple[np.ndarray, dict]:
    """Decode and convert to RGB exactly as verl does (``PIL.Image.convert("RGB")``): (H, W, 3) uint8 + PIL info."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        stored = stored_png(data) if image.format == "PNG" else None
        if stored is None:  # not a PNG, or one whose data is not sound: PIL accepts or rejects it, as verl's would
            return _pil_rgb(image)
        # libspng only on data that inflated soundly: it accepts some corrupt streams that PIL rejects
        if image.mode in ("RGB", "RGBA") and plain_png(data):  # gray and palette PNGs: libspng is no faster
            rgb = _spng_rgb(stored)
            if rgb is not None:  # PIL's header gave the info: nothing after the image data adds to it
                return rgb, dict(image.info)
        with Image.open(io.BytesIO(stored)) as restored:  # the same chunks around the data: same pixels and info
            return _pil_rgb(restored)


def _pil_rgb(image) -> tuple[np.ndarray, dict]:
    # for an RGB image convert("RGB") is a copy (same pixels, same info): skip it (a fifth of decode's CPU here)
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    return np.asarray(rgb), dict(rgb.info)  # asarray loads the pixels first, as convert does


def stored_png(data: bytes) -> bytes | None:
    """``data``, a PNG, with its image data inflated by libdeflate (``deflate``; about twice zlib's speed on the
    bench's images) and stored back uncompressed: one ``IDAT`` chunk holding stored deflate blocks, every other chunk
    as it was. A PNG decoder (libspng, PIL) then copies the data and only unfilters it: the same pixels (PNG is
    lossless) for ~40% less CPU than inflating with zlib. None, and the decoder gets ``data`` itself (and accepts or
    rejects it as it would), where ``deflate`` is missing, the image is interlaced, an ``IDAT`` chunk's CRC is wrong,
    or the data does not inflate (checksum included) to exactly the size the header gives."""
    try:
        import deflate
    except ImportError:
        return None
    if data[:8] != _PNG_SIGNATURE or data[12:16] != b"IHDR" or len(data) < 33 or data[28] != 0:
        return None
    width, height, depth, color = struct.unpack_from(">IIBB", data, 16)
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}.get(color)
    if channels is None:
        return None
    size = height * (1 + (width * channels * depth + 7) // 8)  # each row: its filter byte, then the samples
    view, position, pieces, first, last = memoryview(data), 8, [], None, None
    while position + 12 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, position)
        end = position + 12 + length
        if kind == b"IDAT":
            if last not in (None, position) or end > len(data):  # other chunks between image data chunks; cut short
                return None
            if deflate.crc32(view[position + 4 : end - 4]) != int.from_bytes(view[end - 4 : end], "big"):
                return None
            pieces.append(view[position + 8 : end - 4])
            first, last = first or position, end
        elif kind == b"IEND" or end > len(data):
            break
        position = end
    if first is None:
        return None
    try:
        raw = deflate.zlib_decompress(b"".join(pieces), size)
    except deflate.DeflateError:
        return None
    if len(raw) != size:
        return None
    body = [b"IDAT\x78\x01"]  # zlib header: deflate, 32K window, no preset dictionary (0x7801 % 31 == 0)
    for start in range(0, size, 0xFFFF):  # stored blocks: final flag, then LEN and NLEN little-endian
        block = memoryview(raw)[start : start + 0xFFFF]
        body += [struct.pack("<BHH", start + 0xFFFF >= size, len(block), len(block) ^ 0xFFFF), block]
    body.append(struct.pack(">I", deflate.adler32(raw)))
    chunk = b"".join(body)
    length, crc = struct.pack(">I", len(chunk) - 4), struct.pack(">I", deflate.crc32(chunk))
    return b"".join([view[:first], length, chunk, crc, view[last:]])


def plain_png(data: bytes) -> bool:
    """An 8-bit RGB or RGBA PNG with nothing but image data from its first ``IDAT`` to ``IEND``: there libspng's RGB8
    output is PIL's ``convert("RGB")`` (lossless decode; alpha dropped, no gamma applied) and PIL's header parse has
    all of the image's ``info`` (PIL adds text and EXIF chunks found after the image data only while loading it)."""
    if data[:8] != _PNG_SIGNATURE or data[12:16] != b"IHDR" or len(data) < 33:
        return False
    if data[24] != 8 or data[25] not in (2, 6):  # bit depth 8; color type RGB or RGBA
        return False
    position, seen_data = 8, False
    while position + 8 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, position)
        if kind == b"IEND":
            return seen_data
        if kind == b"IDAT":
            seen_data = True
        elif seen_data:
            return False
        position += 12 + length
    return False  # cut short: PIL decides (and names the error)


def _spng_rgb(data: bytes) -> np.ndarray | None:
    """(H, W, 3) uint8 from libspng (pyspng): faster than PIL's PNG decoder and one copy fewer (no 4-byte pixels);
    None where pyspng is missing or refuses the file (an unknown critical chunk, say): PIL then decodes it, so what
    fails is what PIL fails."""
    try:
        import pyspng
    except ImportError:
        return None
    try:
        return pyspng.load(data, format="RGB")
    except Exception:
        return None


def deferrable_jpeg(data: bytes) -> tuple[np.ndarray, dict] | None:
    """For a JPEG a device decoder can take (baseline, YCbCr or grayscale, complete): an empty (H, W, 0) array (the
    size) and the PIL ``info`` that ``decode_rgb`` would give, from the header alone; None for anything else (PNG,
    progressive or CMYK JPEG, a file without its end marker: those decode on the CPU, where bad data is caught)."""
    from PIL import Image

    if not _complete_jpeg(data):
        return None
    with Image.open(io.BytesIO(data)) as image:
        if image.format != "JPEG" or image.mode not in ("RGB", "L") or image.info.get("progressive"):
            return None
        width, height = image.size
        return np.empty((height, width, 0), dtype=np.uint8), dict(image.info)


def _encode_info(value):
    """PIL ``info`` values as JSON that keeps tuples and bytes apart from lists and strings."""
    if isinstance(value, tuple):
        return {"__tuple__": [_encode_info(v) for v in value]}
    if isinstance(value, bytes):
        import base64

        return {"__bytes__": base64.b64encode(value).decode()}
    if isinstance(value, dict):
        return {"__dict__": {str(k): _encode_info(v) for k, v in value.items()}}
    if isinstance(value, list):
        return [_encode_info(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return {"__float__": float(value)} if hasattr(value, "__float__") else str(value)


def _decode_info(value):
    if isinstance(value, list):
        return [_decode_info(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(_decode_info(v) for v in value["__tuple__"])
        if "__bytes__" in value:
            import base64

            return base64.b64decode(value["__bytes__"])
        if "__dict__" in value:
            return {k: _decode_info(v) for k, v in value["__dict__"].items()}
        if "__float__" in value:
            from PIL.TiffImagePlugin import IFDRational

            return IFDRational(value["__float__"])
    return value


# --- Qwen2-VL rope positions (verl.models.transformers.qwen2_vl.get_rope_index, in numpy) ---------------------------


def rope_position_ids(
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    image_grids: list,
    video_grids: list,
    *,
    image_token_id: int,
    video_token_id: int,
    vision_start_token_id: int,
    merge_size: int,
) -> np.ndarray:
    """(3, M) int64 position ids for one row; pads get 1. Videos use 1.0 s per grid (second_per_grid_ts dropped)."""
    m = input_ids.shape[0]
    if not image_grids and not video_grids:
        position = np.cumsum(attention_mask) - 1
        position[attention_mask == 0] = 1
        return np.broadcast_to(position, (3, m)).astype(np.int64)
    positions = np.ones((3, m), dtype=np.int64)
    tokens = input_ids[attention_mask == 1]
    starts = np.flatnonzero(tokens == vision_start_token_id)
    following = tokens[starts + 1] if starts.size else np.array([], dtype=tokens.dtype)
    remain_images = int((following == image_token_id).sum())
    remain_videos = int((following == video_token_id).sum())
    token_list = tokens.tolist()
    parts: list[np.ndarray] = []
    st, image_index, video_index = 0, 0, 0
    for _ in range(remain_images + remain_videos):
        ed_image = token_list.index(image_token_id, st) if remain_images > 0 and image_token_id in token_list else None
        ed_video = token_list.index(video_token_id, st) if remain_videos > 0 and video_token_id in token_list else None
        ed_image = len(token_list) + 1 if ed_image is None else ed_image
        ed_video = len(token_list) + 1 if ed_video is None else ed_video
        if ed_image < ed_video:
            t, h, w = image_grids[image_index]
            second_per_grid = 0.0
            image_index, remain_images, ed = image_index + 1, remain_images - 1, ed_image
        else:
            t, h, w = video_grids[video_index]
            second_per_grid = 1.0
            video_index, remain_videos, ed = video_index + 1, remain_videos - 1, ed_video
        gt, gh, gw = int(t), int(h) // merge_size, int(w) // merge_size
        text_len = ed - st
        st_idx = int(parts[-1].max()) + 1 if parts else 0
        parts.append(np.broadcast_to(np.arange(text_len), (3, text_len)) + st_idx)
        t_index = (np.repeat(np.arange(gt), gh * gw) * second_per_grid * 2).astype(np.int64)
        h_index = np.tile(np.repeat(np.arange(gh), gw), gt)
        w_index = np.tile(np.arange(gw), gt * gh)
        parts.append(np.stack([t_index, h_index, w_index]) + text_len + st_idx)
        st = ed + gt * gh * gw
    if st < len(token_list):
        st_idx = int(parts[-1].max()) + 1 if parts else 0
        text_len = len(token_list) - st
        parts.append(np.broadcast_to(np.arange(text_len), (3, text_len)) + st_idx)
    positions[:, attention_mask == 1] = np.concatenate(parts, axis=1).reshape(3, -1)
    return positions


# --- tensors and images inside Arrow blocks (plain structs, no pickled objects) -------------------------------------

TENSOR_STRUCT = pa.struct([("dtype", pa.string()), ("shape", pa.list_(pa.int64())), ("data", pa.large_binary())])
# ``multi_modal_inputs.pixel_values`` of images: a tensor record, plus how to finish it where ``temporal_patch_size``
# is set: the data are uint8 patches (n, C, P, P) that ``pixels.normalize_patches`` turns into the processor's
# float32 ``pixel_values`` at the consumer (an eighth of the bytes through the object store). Null there: the data
# are the final float32 values (processors without our torch ops).
PIXELS_STRUCT = pa.struct(
    [
        *TENSOR_STRUCT,
        ("temporal_patch_size", pa.int32()),
        ("mean", pa.list_(pa.float32())),
        ("std", pa.list_(pa.float32())),
    ]
)
IMAGE_STRUCT = pa.struct(
    [("width", pa.int32()), ("height", pa.int32()), ("rgb", pa.large_binary()), ("info", pa.string())]
)


def tensor_record(array: np.ndarray) -> dict:
    array = np.ascontiguousarray(array)
    return {"dtype": array.dtype.str, "shape": list(array.shape), "data": array.tobytes()}


def tensor_from_record(record: dict) -> np.ndarray:
    array = np.frombuffer(record["data"], dtype=np.dtype(record["dtype"])).reshape(record["shape"])
    return array.copy()  # writable, like the processor's own tensors


def contiguous(column: pa.ChunkedArray) -> pa.Array:
    """The column as one array: its only chunk as is (``combine_chunks`` copies even a single chunk), else combined."""
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def _large_binary_layout(array: pa.Array) -> tuple[np.ndarray, pa.Buffer | None]:
    """(byte offsets of every value, the data buffer) of a ``large_binary`` array, slice offset applied: value i is
    ``buffer[starts[i]:starts[i + 1]]``, read in place."""
    starts = np.frombuffer(array.buffers()[1], dtype=np.int64)[array.offset : array.offset + len(array) + 1]
    return starts, array.buffers()[2]


def rgb_arrays(column: pa.ChunkedArray | pa.Array) -> list[list[np.ndarray] | None]:
    """The (H, W, 3) uint8 pixels of a ``list<IMAGE_STRUCT>`` column, per row (None for a null row), as read-only
    views of the block's buffer: no copy of the pixel bytes (``to_pylist`` would make two)."""
    import pyarrow.compute as pc

    lists = contiguous(column) if isinstance(column, pa.ChunkedArray) else column
    offsets = lists.offsets.to_numpy()
    items = lists.values  # not sliced: ``offsets`` index it directly
    widths = pc.struct_field(items, "width").to_numpy(zero_copy_only=False)
    heights = pc.struct_field(items, "height").to_numpy(zero_copy_only=False)
    starts, buffer = _large_binary_layout(pc.struct_field(items, "rgb"))
    data = np.frombuffer(buffer, dtype=np.uint8) if buffer is not None else np.zeros(0, np.uint8)
    valid = lists.is_valid().to_numpy(zero_copy_only=False)
    out: list[list[np.ndarray] | None] = []
    for row in range(len(lists)):
        if not valid[row]:
            out.append(None)
            continue
        out.append(
            [
                data[starts[j] : starts[j + 1]].reshape(int(heights[j]), int(widths[j]), 3)
                for j in range(offsets[row], offsets[row + 1])
            ]
        )
    return out


def tensor_rows_array(values: np.ndarray, lengths: np.ndarray, valid: np.ndarray) -> pa.StructArray:
    """``TENSOR_STRUCT`` records, row i holding the next ``lengths[i]`` items (first axis) of ``values``; null where
    not ``valid``. The data child wraps ``values``' memory (no copy; Ray copies once into the object store)."""
    values = np.ascontiguousarray(values)
    n = len(lengths)
    lengths = np.asarray(lengths, dtype=np.int64)
    row_bytes = int(np.prod(values.shape[1:], dtype=np.int64)) * values.itemsize
    byte_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths * row_bytes, out=byte_offsets[1:])
    validity = pa.array(valid, pa.bool_()).buffers()[1] if not valid.all() else None
    data = pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), n, [validity, pa.py_buffer(byte_offsets), pa.py_buffer(values.reshape(-1).view(np.uint8))]
    )
    shapes = np.column_stack([lengths, np.tile(np.array(values.shape[1:], np.int64), (n, 1))]).reshape(-1)
    shape = pa.ListArray.from_arrays(pa.array(np.arange(0, n * values.ndim + 1, values.ndim, dtype=np.int32)), shapes)
    dtype = pa.array([values.dtype.str] * n, pa.string())
    return pa.StructArray.from_arrays([dtype, shape, data], fields=list(TENSOR_STRUCT), mask=pa.array(~valid))


def pixel_rows_array(
    values: np.ndarray, lengths: np.ndarray, valid: np.ndarray, norm: tuple | None = None, temporal_patch_size: int = 0
) -> pa.StructArray:
    """``PIXELS_STRUCT`` records (see there): ``tensor_rows_array`` of ``values``, with ``norm`` = (mean, std) and
    ``temporal_patch_size`` on every valid row when ``values`` are uint8 patches still to normalize."""
    tensors = tensor_rows_array(values, lengths, valid)
    n = len(lengths)
    if norm is None:
        extra = [pa.nulls(n, pa.int32()), pa.nulls(n, pa.list_(pa.float32())), pa.nulls(n, pa.list_(pa.float32()))]
    else:
        offsets = pa.array(np.arange(0, 3 * n + 1, 3, dtype=np.int32))
        extra = [
            pa.array(np.full(n, temporal_patch_size, dtype=np.int32)),
            *(pa.ListArray.from_arrays(offsets, pa.array(np.tile(np.asarray(v, dtype=np.float32), n))) for v in norm),
        ]
    children = [tensors.field(i) for i in range(tensors.type.num_fields)] + extra
    return pa.StructArray.from_arrays(children, fields=list(PIXELS_STRUCT), mask=pa.array(~valid))


def tensor_rows(column: pa.Array, copy: bool = True) -> list[np.ndarray | None]:
    """The arrays of a ``TENSOR_STRUCT`` column (None for null rows), read from the buffer: one writable copy each
    (like the processor's own tensors), or read-only views of the block with ``copy=False``."""
    import pyarrow.compute as pc

    if not len(column) or column.null_count == len(column):
        return [None] * len(column)
    dtypes = pc.struct_field(column, "dtype").to_pylist()
    shapes = pc.struct_field(column, "shape").to_pylist()
    starts, buffer = _large_binary_layout(pc.struct_field(column, "data"))
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    out: list[np.ndarray | None] = []
    for i in range(len(column)):
        if not valid[i]:
            out.append(None)
            continue
        dtype = np.dtype(dtypes[i])
        count = int(starts[i + 1] - starts[i]) // dtype.itemsize
        array = np.frombuffer(buffer, dtype=dtype, count=count, offset=int(starts[i])) if count else np.zeros(0, dtype)
        array = array.reshape(shapes[i])
        out.append(array.copy() if copy else array)
    return out


def _packed_binary(arrays: list[np.ndarray]) -> pa.LargeBinaryArray:
    """A ``large_binary`` value per array (its bytes, C order), all copied once into one buffer."""
    pieces = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays]
    offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
    np.cumsum([piece.size for piece in pieces], out=offsets[1:])
    data = PACKED_PIXELS.take(int(offsets[-1]))  # the last block's buffer once Ray has stored that block
    for piece, start in zip(pieces, offsets[:-1].tolist(), strict=True):
        data[start : start + piece.size] = piece
    buffers = [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(pieces), buffers)


def image_rows_array(rows: list[list[tuple[np.ndarray, dict]] | None]) -> pa.ListArray:
    """``list<IMAGE_STRUCT>`` per row (null for None) from (H, W, 3) uint8 pixels and PIL ``info``: the pixels copied
    once, into one buffer (no per-image ``bytes`` objects)."""
    flat = [image for row in rows if row for image in row]
    rgb = _packed_binary([rgb for rgb, _ in flat])
    images = pa.StructArray.from_arrays(
        [
            pa.array([image.shape[1] for image, _ in flat], pa.int32()),
            pa.array([image.shape[0] for image, _ in flat], pa.int32()),
            rgb,
            pa.array([json.dumps(_encode_info(info or {})) for _, info in flat], pa.string()),
        ],
        fields=list(IMAGE_STRUCT),
    )
    counts = np.array([len(row) if row else 0 for row in rows], dtype=np.int32)
    list_offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(counts, out=list_offsets[1:])
    missing = pa.array([row is None for row in rows], pa.bool_())
    return pa.ListArray.from_arrays(pa.array(list_offsets), images, mask=missing)


def with_rgb(lists: pa.ListArray, filled: dict[int, np.ndarray]) -> pa.ListArray:
    """A ``list<IMAGE_STRUCT>`` column with the pixels of some images set: ``filled`` maps an image's position among
    the column's images (row order) to its (H, W, 3) uint8 RGB; the others keep theirs. Width, height and ``info``
    stay; the pixels are copied into one new buffer."""
    import pyarrow.compute as pc

    first = lists.offsets[0].as_py()
    count = lists.offsets[len(lists)].as_py() - first
    items = lists.values.slice(first, count)
    starts, buffer = _large_binary_layout(pc.struct_field(items, "rgb"))
    old = np.frombuffer(buffer, dtype=np.uint8) if buffer is not None else np.zeros(0, np.uint8)
    rgb = _packed_binary([filled[k] if k in filled else old[starts[k] : starts[k + 1]] for k in range(count)])
    fields = {name: pc.struct_field(items, name) for name in ("width", "height", "info")}
    children = [fields["width"], fields["height"], rgb, fields["info"]]
    struct = pa.StructArray.from_arrays(children, fields=list(IMAGE_STRUCT))
    list_offsets = pa.array(np.asarray(lists.offsets.to_numpy(), dtype=np.int32) - first)
    missing = pa.array(~lists.is_valid().to_numpy(zero_copy_only=False))
    return pa.ListArray.from_arrays(list_offsets, struct, mask=missing)


def image_from_array(rgb: np.ndarray, info_json: str | None = None):
    """A PIL RGB image of (H, W, 3) uint8 pixels (copied), with ``info`` as ``image_rows_array`` saved it."""
    from PIL import Image

    image = Image.fromarray(np.ascontiguousarray(rgb))
    if info_json:
        image.info.update(_decode_info(json.loads(info_json)))
    return image
