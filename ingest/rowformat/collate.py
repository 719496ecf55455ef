"""``VerlCollate``: ``iter_torch_batches`` output equal to verl 0.5.0 ``collate_fn`` over the same rows."""

from __future__ import annotations

import copy
import json
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from ray.data.collate_fn import ArrowBatchCollateFn
from ray.data.extensions import ArrowTensorType, ArrowTensorTypeV2, ArrowVariableShapedTensorType

from ingest.blocks import (
    COMPACT_TEXT_COLUMNS,
    MAX_LENGTH_COLUMN,
    MULTI_MODAL_DATA,
    PAD_ID_COLUMN,
    RAW_PROMPT_OF_COLUMN,
    STRUCT_IMAGE_BYTES_COLUMN,
    contiguous,
    image_from_array,
    rgb_arrays,
    tensor_from_record,
    tensor_rows,
)
from ingest.config import RAW_PROMPT_FORMATS, resolve_row_format
from ingest.media.video import video_metadata
from ingest.rowformat.raw_prompt import fill_images, fill_struct_images
from ingest.rowformat.text import TENSOR_COLUMNS, pad_flat

_TENSOR_TYPES = (ArrowTensorType, ArrowTensorTypeV2, ArrowVariableShapedTensorType)

# verl's row keys that get defaults when ``extra_info`` lacks them (and the column was not stored, see writer).
ROW_DEFAULTS = {"index": 0, "tools_kwargs": {}, "interaction_kwargs": {}}


def _is_tensor_column(column: pa.ChunkedArray) -> bool:
    return isinstance(column.type, _TENSOR_TYPES)


def object_array(values: list, *, one_dimensional: bool = False) -> np.ndarray:
    """verl 0.5.0's ``np.array(values, dtype=object)`` (equal-length lists become 2-D), or always 1-D."""
    if one_dimensional:
        return np.fromiter(values, dtype=object, count=len(values))
    return np.array(values, dtype=object)


def compact_text_tensors(batch: pa.Table) -> dict[str, np.ndarray]:
    """The padded ``input_ids`` / ``attention_mask`` / ``position_ids`` of a compact text batch (see ``rowformat``)."""
    if not batch.num_rows:
        return {name: np.zeros((0, 0), dtype=np.int64) for name in TENSOR_COLUMNS}
    ids = batch.column("raw_prompt_ids").combine_chunks()
    max_length = pc.min_max(batch.column(MAX_LENGTH_COLUMN)).as_py()
    pad = pc.min_max(batch.column(PAD_ID_COLUMN)).as_py()
    if max_length["min"] != max_length["max"] or pad["min"] != pad["max"]:
        raise ValueError("a batch mixes rows built with different max_prompt_length or pad token")
    lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False)
    flat = pc.list_flatten(ids).to_numpy(zero_copy_only=False)
    tensors = pad_flat(flat, lengths, int(max_length["min"]), int(pad["min"]))
    return dict(zip(TENSOR_COLUMNS, tensors, strict=True))


def _video_from_record(record: dict) -> np.ndarray:
    return tensor_from_record(record).astype(np.float32)  # fetch_video's float frames (whole numbers, carried as uint8)


def _images(column: pa.Array) -> list[list | None]:
    """PIL RGB images per row (one copy of the pixels, from the block's buffer), with their saved ``info``."""
    infos = pc.list_flatten(column).field("info").to_pylist() if len(column) else []
    rows, k = [], 0
    for row in rgb_arrays(column):
        if row is None:
            rows.append(None)
            continue
        rows.append([image_from_array(rgb, infos[k + j]) for j, rgb in enumerate(row)])
        k += len(row)
    return rows


def _media_data(column: pa.ChunkedArray, row_format: str = "verl-0.5") -> list[dict]:
    """``{"image": [PIL RGB], "video": [(T, 3, H, W) float32]}`` per row, rebuilt at the consumer (modalities the row
    has; ``{}`` for a row without media). verl 0.6 leaves out a modality whose list is empty and pairs each video with
    fetch_video's metadata: ``(frames, metadata)``. Chunk by chunk: a batch spanning blocks would otherwise copy its
    pixels once more before PIL copies them."""
    return [row for chunk in column.chunks for row in _media_data_chunk(chunk, row_format == "verl-0.5")]


def _media_data_chunk(column: pa.Array, verl_05: bool) -> list[dict]:
    names = [column.type.field(i).name for i in range(column.type.num_fields)]
    images = _images(column.field("image")) if "image" in names else [None] * len(column)
    videos = column.field("video").to_pylist() if "video" in names else [None] * len(column)
    metadata = column.field("video_metadata").to_pylist() if "video_metadata" in names else [None] * len(column)
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    out = []
    for i in range(len(column)):
        row = {}
        if valid[i] and images[i] is not None and (verl_05 or images[i]):
            row["image"] = images[i]
        if valid[i] and videos[i] is not None and (verl_05 or videos[i]):
            frames = [_video_from_record(r) for r in videos[i]]
            pairs = zip(frames, map(video_metadata, metadata[i] or ()), strict=True)
            row["video"] = frames if verl_05 else list(pairs)
        out.append(row)
    return out


def _media_inputs(column: pa.ChunkedArray, device) -> list[dict]:
    """The processor's tensors per row as torch tensors (on ``device``): one copy of the block's bytes each, or for
    uint8 patches (``PIXELS_STRUCT``) the processor's float32 ``pixel_values`` built from them on ``device``."""
    import torch

    out: list[dict] = []
    for chunk in column.chunks:  # chunk by chunk: combining them would copy every pixel once more
        rows: list[dict] = [{} for _ in range(len(chunk))]
        valid = chunk.is_valid().to_numpy(zero_copy_only=False)
        for k in range(chunk.type.num_fields):
            field = chunk.field(k)
            name = chunk.type.field(k).name
            norms = _pixel_norms(field)
            for i, array in enumerate(tensor_rows(field, copy=norms is None)):
                if array is None or not valid[i]:
                    continue
                if norms is not None and norms[i] is not None:
                    rows[i][name] = _finish_pixels(array, *norms[i], device)
                else:
                    tensor = torch.from_numpy(array)
                    rows[i][name] = tensor.to(device) if device is not None else tensor
        out.extend(rows)
    return out


def _pixel_norms(field: pa.Array) -> list[tuple | None] | None:
    """(temporal_patch_size, mean, std) per row of a ``PIXELS_STRUCT`` field (None: final values); None otherwise."""
    if "temporal_patch_size" not in {field.type.field(i).name for i in range(field.type.num_fields)}:
        return None
    temporal = pc.struct_field(field, "temporal_patch_size").to_pylist()
    mean = pc.struct_field(field, "mean").to_pylist()
    std = pc.struct_field(field, "std").to_pylist()
    return [None if t is None else (t, m, s) for t, m, s in zip(temporal, mean, std, strict=True)]


def _finish_pixels(patches: np.ndarray, temporal_patch_size: int, mean: list, std: list, device):
    """uint8 patches (a read-only view of the block) -> float32 ``pixel_values``, on ``device`` when given (the
    uint8 bytes move there, not the eight times larger floats)."""
    import torch

    from ingest.media.pixels import normalize_patches

    if device is not None:
        with warnings.catch_warnings():  # only read
            warnings.simplefilter("ignore", UserWarning)
            patches = torch.from_numpy(patches).to(device)
    return normalize_patches(patches, tuple(mean), tuple(std), temporal_patch_size)


class VerlCollate(ArrowBatchCollateFn):
    """Collate rows of ``build_dataset`` into verl's batch dict.

    Tensor columns (``input_ids``, ``attention_mask``, ``position_ids``) become stacked ``torch.Tensor``\\ s (on
    ``device`` when given); every other column a numpy object array of the Python values verl holds (dicts, lists,
    None for missing struct fields). ``one_dimensional=True`` gives later verl's always-1-D object arrays instead of
    0.5.0's ``np.array(values, dtype=object)`` (which makes equal-length lists 2-D). Keys come in verl's order:
    tensors first, then the rest in row order.

    ``row_format`` (``DataConfig.row_format``, ``auto`` included): whose ``collate_fn`` to reproduce. ``verl-0.6``
    collates with ``np.fromiter`` (always 1-D) and gives every row an ``extra_info`` dict (``{}`` where it is missing or
    null). ``verl-0.7`` / ``verl-0.9`` do too, on their ``raw_prompt`` rows: ``dummy_tensor`` (uint8 zeros, (B, 1)) is
    the one tensor, ``raw_prompt`` holds RGB PIL images in its image items (or, for image structs read without an HF
    ``Image()`` feature, their bytes, path and the image as ``Image.open`` gives it), and the prompt column holds the
    same objects.
    """

    def __init__(self, device: str | None = None, one_dimensional: bool = False, row_format: str = "verl-0.5"):
        super().__init__()
        row_format = resolve_row_format(row_format)
        self.device = device
        self.row_format = row_format
        self.one_dimensional = one_dimensional or row_format != "verl-0.5"

    def __call__(self, batch: pa.Table) -> dict:
        if self.row_format in RAW_PROMPT_FORMATS:
            return self._raw_prompt_batch(batch)
        import torch

        tensors, others = {}, {}
        if PAD_ID_COLUMN in batch.column_names:
            for name, array in compact_text_tensors(batch).items():
                tensor = torch.from_numpy(array)
                tensors[name] = tensor.to(self.device) if self.device is not None else tensor
        for name in batch.column_names:
            column = batch.column(name)
            if name in COMPACT_TEXT_COLUMNS:
                continue
            if _is_tensor_column(column):
                array = contiguous(column).to_numpy()
                # Arrow buffers are read-only; verl's tensors are writable, so copy those that are not
                array = np.ascontiguousarray(array)
                tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
                tensors[name] = tensor.to(self.device) if self.device is not None else tensor
            elif name == "multi_modal_data":
                media = _media_data(column, self.row_format)
                others[name] = object_array(media, one_dimensional=self.one_dimensional)
            elif name == "multi_modal_inputs":
                others[name] = object_array(_media_inputs(column, self.device), one_dimensional=self.one_dimensional)
            else:
                values = column.to_pylist()
                if name == "raw_prompt" and pa.types.is_string(column.type):
                    values = [json.loads(v) for v in values]  # processor path: split messages kept as JSON
                others[name] = object_array(values, one_dimensional=self.one_dimensional)
        return {**tensors, **self._row_defaults(others, batch.num_rows)}

    def _row_defaults(self, others: dict, rows: int) -> dict:
        if self.row_format != "verl-0.5" and rows:
            others = _extra_info_as_verl_06(others, rows)
        for key, default in ROW_DEFAULTS.items():
            if key not in others and rows:
                values = [copy.copy(default) for _ in range(rows)]
                others[key] = object_array(values, one_dimensional=self.one_dimensional)
        return others

    def _raw_prompt_batch(self, batch: pa.Table) -> dict:
        """verl 0.9.1's ``collate_fn`` over its ``__getitem__`` rows (``rowformat.raw_prompt``)."""
        import torch

        rows = batch.num_rows
        raw_prompt = filled_raw_prompt(batch)
        prompt_key = batch.column(RAW_PROMPT_OF_COLUMN)[0].as_py() if rows else None
        others = {}
        for name in batch.column_names:
            if name in (MULTI_MODAL_DATA, RAW_PROMPT_OF_COLUMN, STRUCT_IMAGE_BYTES_COLUMN):
                continue
            # verl keeps the prompt column: the very list it turned into raw_prompt
            values = raw_prompt if name in (prompt_key, "raw_prompt") else batch.column(name).to_pylist()
            others[name] = object_array(values, one_dimensional=True)
        dummy = torch.zeros((rows, 1), dtype=torch.uint8)  # verl's placeholder so DataProto.batch is not empty
        return {
            "dummy_tensor": dummy.to(self.device) if self.device is not None else dummy,
            **self._row_defaults(others, rows),
        }


def filled_raw_prompt(batch: pa.Table) -> list[list[dict]]:
    """The ``raw_prompt`` messages of a verl 0.7 / 0.9 block as verl's rows hold them: the decoded images as RGB PIL
    images in their items, plain image structs opened as verl opens them."""
    column = batch.column("raw_prompt")
    if pa.types.is_string(column.type):
        raw_prompt = [json.loads(value) for value in column.to_pylist()]
    else:
        raw_prompt = column.to_pylist()
    if MULTI_MODAL_DATA in batch.column_names:  # decoded images, in item order
        images = [row for chunk in batch.column(MULTI_MODAL_DATA).chunks for row in _images(chunk)]
        for messages, row_images in zip(raw_prompt, images, strict=True):
            if row_images:
                fill_images(messages, iter(row_images))
    if STRUCT_IMAGE_BYTES_COLUMN in batch.column_names:  # plain image structs: opened here, as verl opens them
        for messages, encoded in zip(raw_prompt, batch.column(STRUCT_IMAGE_BYTES_COLUMN).to_pylist(), strict=True):
            if encoded:
                fill_struct_images(messages, iter(encoded))
    return raw_prompt


def _extra_info_as_verl_06(others: dict, rows: int) -> dict:
    """verl 0.6 sets ``extra_info`` to ``{}`` on a row where it is missing or null, before it reads ``index`` /
    ``tools_kwargs`` / ``interaction_kwargs`` from it: such a row has ``{}`` kwargs, not the struct column's
    all-null fields. A missing column comes after the prompt keys, before those three."""
    if "extra_info" not in others:
        empty = np.fromiter(({} for _ in range(rows)), dtype=object, count=rows)
        names = list(others)
        at = min((names.index(key) for key in ROW_DEFAULTS if key in others), default=len(names))
        return {**dict(list(others.items())[:at]), "extra_info": empty, **dict(list(others.items())[at:])}
    extra_info = others["extra_info"]
    for i in [i for i, value in enumerate(extra_info) if value is None]:
        extra_info[i] = {}
        for key in ("tools_kwargs", "interaction_kwargs"):
            if key in others:
                others[key][i] = {}
    return others
