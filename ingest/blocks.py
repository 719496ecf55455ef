"""The block format: every internal column and struct that travels between stages in Arrow blocks, with its encoder
and decoder. Plain Arrow (no pickled Python objects): tensors as (dtype, shape, bytes) records, images as
(width, height, RGB bytes, PIL info as JSON).

Internal columns start with ``_``; the consumer (``VerlCollate``, ``SFTCollate``) never hands them to a trainer, and
the last stage that needs one drops it (``drop_internal_columns``).
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from ingest.memory import ReusedBuffers

# --- where a row came from (added by the read; quarantine records and errors name file and row) --------------------
FILE_COLUMN = "_ingest_file"  # index into the run's file list
ROW_COLUMN = "_ingest_row"  # 0-based row in that file
PROVENANCE_COLUMNS = (FILE_COLUMN, ROW_COLUMN)
# media_handoff: the key of the row's media in the read's MediaStore (null: a text row); the loader tells the store
# which rows it has taken and handed out (ingest/rollout_media.py)
MEDIA_KEY_COLUMN = "_ingest_media_key"

# --- text rows: each prompt's ids once, unpadded, plus two per-row numbers; ``VerlCollate`` pads per batch ---------
# (keeps the padding, three int64 (max_prompt_length,) arrays per row, out of the object store and the batching)
MAX_LENGTH_COLUMN = "_ingest_max_prompt_length"
PAD_ID_COLUMN = "_ingest_pad_token_id"
COMPACT_TEXT_COLUMNS = (MAX_LENGTH_COLUMN, PAD_ID_COLUMN)

# --- verl 0.9 rows: the prompt column's name (its values are the raw_prompt objects, which the consumer fills in) ---
RAW_PROMPT_OF_COLUMN = "_ingest_raw_prompt_of"
# per row, the encoded bytes of its image items built from plain ``{bytes, path}`` structs (no HF ``Image()`` feature),
# in item order, for the consumer to open as verl does (null: the row has none)
STRUCT_IMAGE_BYTES_COLUMN = "_ingest_struct_image_bytes"

# --- media rows: what the tokenize stage hands the decode and vision stages ----------------------------------------
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

# the row's verl keys that stay tensors (not shown in quarantine records)
TOKEN_COLUMNS = ("input_ids", "attention_mask", "position_ids", "raw_prompt_ids")
GRIDS_TYPE = pa.list_(pa.list_(pa.int64(), 3))  # (t, h, w) per image or video of a row
# fetch_video's ``video_metadata`` of one video (verl 0.6 hands ``(frames, metadata)`` to the rollout and the
# processor): a file's fps, sampled frame numbers, frame count in range and reader; a frame list's stand-in values
VIDEO_METADATA_STRUCT = pa.struct(
    [
        ("fps", pa.float64()),
        ("frames_indices", pa.list_(pa.int64())),
        ("total_num_frames", pa.float64()),
        ("from_file", pa.bool_()),
        ("video_backend", pa.string()),
    ]
)
# how the decode stage samples one video: a file's bytes (or a frame list's images) and the frames to take
VIDEO_PLAN_STRUCT = pa.struct(
    [
        ("is_file", pa.bool_()),
        ("data", pa.list_(pa.large_binary())),
        ("indices", pa.list_(pa.int64())),
        ("frame_width", pa.int64()),
        ("frame_height", pa.int64()),
        ("height", pa.int64()),
        ("width", pa.int64()),
        ("metadata", VIDEO_METADATA_STRUCT),
    ]
)

# --- tensors and images (plain structs, no pickled objects) ---------------------------------------------------------
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

MULTI_MODAL_DATA = "multi_modal_data"
MULTI_MODAL_INPUTS = "multi_modal_inputs"
VIDEO_FRAMES_COLUMN = "_media_video_frames"  # decoded, sampled frames before the final resize
FRAMES_STRUCT = pa.struct(
    [("frames", TENSOR_STRUCT), ("height", pa.int64()), ("width", pa.int64()), ("metadata", VIDEO_METADATA_STRUCT)]
)
# a video file left to the vision stage (vision_decode_video_on_device): its bytes and the frames to take
DEFERRED_VIDEO_STRUCT = pa.struct([("data", pa.large_binary()), ("indices", pa.list_(pa.int64()))])
MULTI_MODAL_DATA_TYPE = pa.struct(
    [
        ("image", pa.list_(IMAGE_STRUCT)),
        ("video", pa.list_(TENSOR_STRUCT)),
        ("video_metadata", pa.list_(VIDEO_METADATA_STRUCT)),  # one per video: verl 0.6's (frames, metadata) pairs
    ]
)
MULTI_MODAL_INPUTS_TYPE = pa.struct(
    [
        ("pixel_values", PIXELS_STRUCT),
        ("image_grid_thw", TENSOR_STRUCT),
        ("pixel_values_videos", TENSOR_STRUCT),
        ("video_grid_thw", TENSOR_STRUCT),
    ]
)

PACKED_PIXELS = ReusedBuffers()  # a block's decoded RGB pixels (``_packed_binary``)


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


def provenance_rows(table: pa.Table, rows) -> pa.Table:
    """The provenance columns of ``rows`` (positions): what a count keeps of a row (all of them, with the row count,
    where a table has none)."""
    names = [name for name in PROVENANCE_COLUMNS if name in table.column_names]
    return table.select(names).take(pa.array(rows, pa.int64()))


def drop_internal_columns(table: pa.Table, keep_provenance: bool) -> pa.Table:
    """The table without the row's token count and (unless ``keep_provenance``) its provenance columns."""
    drop = [PROMPT_TOKENS_COLUMN] + ([] if keep_provenance else list(PROVENANCE_COLUMNS))
    return table.drop_columns([name for name in drop if name in table.column_names])


def deferred_values(table: pa.Table, name: str) -> list:
    """A deferred-media column's values per row (all None where the block has no such column)."""
    return table.column(name).to_pylist() if name in table.column_names else [None] * table.num_rows
