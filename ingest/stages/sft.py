"""SFT stages: conversations -> shifted, truncated (optionally packed) training rows; image pixels.

``SFTRenderStage`` (the render actor; the Parquet read is fused into it): per row, the conversation (a ``messages``
column, or ``prompt`` + ``completion``), optional ``tools`` / images / videos columns -> ``build_training_sample``
with a renderer that reads image sizes from headers only (pad counts from the processor geometry, no pixel work) ->
``shift_and_truncate`` at ``sft_max_length`` -> optional in-order ``pack`` within the batch -> Arrow rows. Bad
conversations are quarantined or raise, as on the RL path; the encoded image bytes and their grids travel on to:

``SFTVisionStage`` (the vision actor, CPU or GPU): decode (PIL ``convert("RGB")``) and the RL path's
``VisionStage.pixel_values`` (one processor call per batch) -> ``pixel_values`` / ``image_grid_thw`` tensor records,
with the grids checked against the header-derived ones that decided the pad counts.

Rows are plain Arrow: ``list<int64>`` ids, ``list<bool>`` mask, ``list<int8>`` token types, tensors as
``{dtype, shape, data}`` structs (``ingest.media.geometry.tensor_record``). No pickled Python objects in blocks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from itertools import chain
from typing import Any

import numpy as np
import pyarrow as pa

from ingest.accounting import BatchCounts, StageResult, row_location
from ingest.blocks import TENSOR_STRUCT, tensor_record
from ingest.config import DataConfig, StageContext
from ingest.errors import BadRowError
from ingest.media.device import limit_torch_threads, resolve_device
from ingest.media.image import decode_rgb, read_image_bytes
from ingest.media.pixels import ProcessorPixels
from ingest.rowformat.messages import split_media_placeholders
from ingest.sft.data import RenderedConversation, SFTRenderError, TrainingSequence
from ingest.sft.sample import build_training_sample, conversation_problem
from ingest.sft.sequence import pack, shift_and_truncate
from ingest.stages.bad_rows import BadRows

TOOLS_COLUMN = "tools"
IMAGE_BYTES_COLUMN = "_sft_image_bytes"  # encoded images of the row, in stream order (for the vision stage)
IMAGE_GRIDS_COLUMN = "_sft_image_grids"  # their header-derived grids (decided the pad counts; checked there)
IMAGE_SOURCES_COLUMN = "_sft_image_sources"  # the file and row each image came from (packing mixes samples)
SOURCE_STRUCT = pa.struct([("file", pa.string()), ("row", pa.int64())])
PLACEHOLDER_STRUCT = pa.struct([("offset", pa.int64()), ("length", pa.int64())])
GRIDS_TYPE = pa.list_(pa.list_(pa.int64(), 3))
_ENCODED, _GRID, _SOURCE = "_encoded", "_grid", "_source"  # a deferred image: encoded bytes, grid, (file, row)
_MEDIA_MARKER = re.compile("<image>|<video>")
NO_TARGET_POLICIES = ("drop", "keep")  # a sample whose window holds no trained target


class DeferredPixels:
    """A renderer wrapper that tokenizes without image pixel work.

    It renders with ``process_media=False`` (image sizes from the headers, pad counts from the processor geometry)
    and gives each image item ``{"_encoded": bytes, "_grid": (t, h, w)}`` as its outputs, so the item travels
    through ``build_training_sample``, ``shift_and_truncate`` (dropped past the cut) and ``pack`` like a processed
    one; the vision stage turns it into pixels. Videos are processed by the renderer (the video processor decides
    their grids).
    """

    def __init__(self, renderer):
        self.renderer = renderer
        self.tokenizer = renderer.tokenizer
        self.source: tuple[str | None, int | None] = (None, None)  # (file, row) of the conversation being rendered
        self.tells_sampled = renderer.tells_sampled
        self.stop_token_id = renderer.stop_token_id

    def render(self, messages, *, tools=None, images=None, videos=None, process_media=True) -> RenderedConversation:
        rendered = self.renderer.render(messages, tools=tools, images=images, videos=videos, process_media=False)
        media = []
        for item in rendered.media:
            if item.outputs is None:
                if item.data is None:  # a decoded image (PIL / array): cannot come from Parquet
                    raise SFTRenderError("images must be encoded (bytes, an HF Image() struct or a path)")
                item = replace(item, outputs={_ENCODED: item.data, _GRID: tuple(item.grid), _SOURCE: self.source})
            media.append(item)
        return replace(rendered, media=media)


_ARGUMENTS_PATH = ("tool_calls", "function", "arguments")


def plain(value: Any, path: tuple[str, ...] = ()) -> Any:
    """An Arrow struct value as the dict a Python source would hold: Arrow gives every row every struct field, so
    fields missing from a row read back as None; they are dropped (recursively).

    Tool-call arguments are kept as stored (prime-rl's rule: they are an opaque JSON payload, where
    ``{"reasoning_effort": null}`` is data and renders as ``null``). A struct column cannot tell a stored null from
    a filled one, so arguments whose keys differ between rows carry the other rows' keys as nulls: store them as
    JSON strings (OpenAI's own shape), which are passed to the template untouched.
    """
    if isinstance(value, dict):
        if path[-3:] == _ARGUMENTS_PATH:
            return value
        return {k: plain(v, (*path, k)) if isinstance(v, dict | list) else v for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [plain(v, path) if isinstance(v, dict | list) else v for v in value]
    return value


def _as_messages(value: Any, role: str) -> Any:
    """prompt / completion value -> message list: a list as is, a plain string as one ``role`` message."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return plain(value)


def _json_or_value(value: Any, what: str) -> Any:
    """JSON-string columns (messages, tools) are parsed; struct / list columns are taken as stored."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as exc:
            raise SFTRenderError(f"{what} is a string that is not JSON: {exc}") from None
    return plain(value)


def _split_media_markers(messages: list) -> None:
    """verl's ``<image>`` / ``<video>`` markers in string content -> typed content parts (rows with media only)."""
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) and _MEDIA_MARKER.search(content):
            split_media_placeholders([message])


class SFTRenderStage:
    """Arrow batch of raw rows (with provenance columns) -> Arrow batch of SFT rows + counts + quarantine records.

    ``renderer``: from ``create_renderer`` (with a processor for images / videos). ``media``: emit the media columns
    (the processor path; the vision stage follows). ``role_to_mask`` / ``content_sft_roles``: as
    ``build_training_sample``. ``no_target``: ``drop`` (prime-rl's rule) or ``keep`` a sample whose window holds no
    trained target. Counts: ``rows_out`` = samples emitted (a packed row holds several), ``filtered_overlong`` =
    samples cut to no inputs at all, ``dropped_no_target`` = samples dropped with no trained target,
    ``prompt_tokens`` = inputs emitted.
    """

    def __init__(
        self,
        renderer,
        config: DataConfig,
        context: StageContext | None = None,
        *,
        media: bool = False,
        role_to_mask: Callable[[Mapping[str, Any]], bool] | None = None,
        content_sft_roles: Collection[str] | None = None,
        no_target: str = "drop",
    ):
        if no_target not in NO_TARGET_POLICIES:
            raise ValueError(f"no_target must be one of {', '.join(NO_TARGET_POLICIES)}, got {no_target!r}")
        if not renderer.tells_sampled and role_to_mask is None:
            raise ValueError(
                f"{type(renderer).__name__} (the chat template is not ChatML) cannot tell sampled tokens: "
                "pass role_to_mask to build_sft_dataset"
            )
        self.renderer = DeferredPixels(renderer) if media else renderer
        self.config = config
        self.files = list((context or StageContext()).files)
        self.media = media
        self.role_to_mask = role_to_mask
        self.content_sft_roles = frozenset(content_sft_roles) if content_sft_roles else None
        self.no_target = no_target
        budget = config.sft_pack_token_budget
        limits = [x for x in (config.sft_max_length, budget if budget > 0 else None) if x is not None]
        self.max_length = min(limits) if limits else None

    def _columns(self, table: pa.Table) -> dict[str, list | None]:
        cfg = self.config
        names = set(table.column_names)
        keys = {
            "messages": cfg.sft_messages_key,
            "prompt": cfg.prompt_key,
            "completion": cfg.sft_completion_key,
            "tools": TOOLS_COLUMN,
            "images": cfg.image_key,
            "videos": cfg.video_key,
        }
        # Map values (tool-call arguments stored as map<string, ...>) as dicts, which is what they held; Arrow's
        # default, a list of (key, value) pairs, renders as a JSON list. A duplicated key keeps its last value, as
        # json.loads does.
        return {
            k: table.column(name).to_pylist(maps_as_pydicts="lossy") if name in names else None
            for k, name in keys.items()
        }

    def _conversation(self, cols: dict, i: int) -> tuple[Any, str]:
        """(messages, the column they came from): ``messages`` when set, else prompt + completion."""
        cfg = self.config
        if cols["messages"] is not None and cols["messages"][i] is not None:
            return _json_or_value(cols["messages"][i], "messages"), cfg.sft_messages_key
        if cols["prompt"] is not None and cols["completion"] is not None:
            prompt, completion = cols["prompt"][i], cols["completion"][i]
            if prompt is None or completion is None:
                missing = cfg.prompt_key if prompt is None else cfg.sft_completion_key
                raise SFTRenderError(f"{missing} is null")
            prompt, completion = _as_messages(prompt, "user"), _as_messages(completion, "assistant")
            if not isinstance(prompt, list) or not isinstance(completion, list):
                raise SFTRenderError(
                    f"prompt and completion must be message lists or strings, got {type(prompt).__name__} and "
                    f"{type(completion).__name__}"
                )
            return prompt + completion, cfg.prompt_key
        return None, cfg.sft_messages_key

    def __call__(self, table: pa.Table) -> StageResult:
        cfg = self.config
        n = table.num_rows
        cols = self._columns(table)
        bad = BadRows(self.files, table)
        sequences: list[TrainingSequence] = []
        filtered = no_target = 0
        for i in range(n):
            conversation_column = cfg.sft_messages_key if cols["messages"] is not None else cfg.prompt_key
            step = conversation_column  # the column being read when something fails
            try:
                messages, conversation_column = self._conversation(cols, i)
                step = conversation_column
                problem = conversation_problem(messages)
                if problem is not None:
                    raise SFTRenderError(problem)
                tools = images = videos = None
                if cols["tools"] is not None and cols["tools"][i] is not None:
                    step = TOOLS_COLUMN
                    tools = _json_or_value(cols["tools"][i], "tools")
                if cols["images"] is not None and cols["images"][i] is not None:
                    step = cfg.image_key
                    images = [read_image_bytes(v, cfg.storage_options) for v in plain(cols["images"][i])]
                if cols["videos"] is not None and cols["videos"][i] is not None:
                    step = cfg.video_key
                    videos = [
                        [read_image_bytes(f, cfg.storage_options) for f in v] if isinstance(v, list) else v
                        for v in plain(cols["videos"][i])
                    ]
            except Exception as exc:
                reason = str(exc) if isinstance(exc, SFTRenderError) else f"bad value: {type(exc).__name__}: {exc}"
                bad.add(i, reason, step)
                continue
            if images is not None or videos is not None:
                _split_media_markers(messages)
            if images is not None and isinstance(self.renderer, DeferredPixels):
                self.renderer.source = row_location(self.files, table, i)  # named by the vision stage if it fails
            try:
                sample = build_training_sample(
                    self.renderer,
                    messages,
                    role_to_mask=self.role_to_mask,
                    tools=tools,
                    images=images,
                    videos=videos,
                    content_sft_roles=self.content_sft_roles,
                )
            except SFTRenderError as exc:
                bad.add(i, str(exc), _blame(str(exc), conversation_column, cfg))
                continue
            sequence = shift_and_truncate(sample, self.max_length)
            if not sequence.inputs:
                filtered += 1
                continue
            # prime-rl drops a sample with no trained target in its window (its loss would divide by zero); counted
            # apart so that the summary says why the sample went
            if self.no_target == "drop" and not any(sequence.loss_mask):
                no_target += 1
                continue
            sequences.append(sequence)
        bad.raise_first(cfg.on_bad_row)
        counts = BatchCounts(
            rows_in=n,
            rows_out=len(sequences),
            filtered_overlong=filtered,
            quarantined=len(bad),
            prompt_tokens=sum(len(s.inputs) for s in sequences),
            dropped_no_target=no_target,
        )
        budget = cfg.sft_pack_token_budget
        rows = pack(sequences, budget) if budget > 0 else sequences
        return StageResult(self.rows_table(rows), counts, bad.quarantine())

    def rows_table(self, rows: Sequence[TrainingSequence]) -> pa.Table:
        columns = {
            "input_ids": list_array([r.inputs for r in rows], pa.int64()),
            "target_ids": list_array([r.targets for r in rows], pa.int64()),
            "loss_mask": list_array([r.loss_mask for r in rows], pa.bool_()),
        }
        if self.media:
            columns["mm_token_type_ids"] = list_array([r.mm_token_type_ids for r in rows], pa.int8())
        columns["seq_lens"] = list_array([r.seq_lens for r in rows], pa.int64())
        if not self.media:
            return pa.table(columns)
        images = [(r.multi_modal_data or {}).get("image") for r in rows]
        videos = [(r.multi_modal_data or {}).get("video") for r in rows]
        columns["image_placeholders"] = pa.array(
            [None if d is None else [tuple(p) for p in d.placeholders] for d in images], pa.list_(PLACEHOLDER_STRUCT)
        )
        columns["image_hashes"] = pa.array([None if d is None else d.hashes for d in images], pa.list_(pa.string()))
        columns[IMAGE_BYTES_COLUMN] = pa.array(
            [None if d is None else [it[_ENCODED] for it in d.items] for d in images], pa.list_(pa.large_binary())
        )
        columns[IMAGE_GRIDS_COLUMN] = pa.array(
            [None if d is None else [list(it[_GRID]) for it in d.items] for d in images], GRIDS_TYPE
        )
        columns[IMAGE_SOURCES_COLUMN] = pa.array(
            [None if d is None else [it[_SOURCE] for it in d.items] for d in images], pa.list_(SOURCE_STRUCT)
        )
        columns["video_placeholders"] = pa.array(
            [None if d is None else [tuple(p) for p in d.placeholders] for d in videos], pa.list_(PLACEHOLDER_STRUCT)
        )
        columns["video_hashes"] = pa.array([None if d is None else d.hashes for d in videos], pa.list_(pa.string()))
        for key, grid_key in (("pixel_values_videos", "video_grid_thw"),):
            values, grids = [], []
            for d in videos:
                if d is None:
                    values.append(None)
                    grids.append(None)
                else:
                    values.append(tensor_record(np.concatenate([it[key] for it in d.items])))
                    grids.append(tensor_record(np.concatenate([it[grid_key] for it in d.items])))
            columns[key] = pa.array(values, TENSOR_STRUCT)
            columns[grid_key] = pa.array(grids, TENSOR_STRUCT)
        columns["dropped_media"] = pa.array([r.dropped_media for r in rows], pa.int64())
        return pa.table(columns)


def _blame(reason: str, conversation_column: str, cfg: DataConfig) -> str:
    """The column a render error points at: images / videos when the reason is about them, else the conversation."""
    lowered = reason.lower()
    if "image" in lowered:
        return cfg.image_key
    if "video" in lowered:
        return cfg.video_key
    return conversation_column


def list_array(lists: Sequence[Sequence | None], value_type: pa.DataType) -> pa.Array:
    """A list column from flat values + offsets (None entries are null lists)."""
    n = len(lists)
    lengths = np.fromiter((0 if x is None else len(x) for x in lists), dtype=np.int64, count=n)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    dtype = value_type.to_pandas_dtype()
    flat = np.fromiter(chain.from_iterable(x for x in lists if x is not None), dtype=dtype, count=int(lengths.sum()))
    nulls = np.fromiter((x is None for x in lists), dtype=bool, count=n)
    mask = pa.array(nulls) if nulls.any() else None
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=value_type), mask=mask)


class SFTVisionStage:
    """Encoded images of each row -> ``pixel_values`` (patches, dim) float32 and ``image_grid_thw`` (n, 3) int64
    tensor records, through the RL path's ``ProcessorPixels`` on ``vision_device`` (one processor call per batch)."""

    def __init__(self, processor_path: str, config: DataConfig | None = None):
        config = config or DataConfig()
        limit_torch_threads()
        self.pixel_values = ProcessorPixels(processor_path, resolve_device(config.vision_device))
        self.image_key = config.image_key

    def _decode(self, data: bytes, source: dict | None) -> np.ndarray:
        """RGB pixels; an image whose data do not decode (its structure was checked when rendering) is one
        ``BadRowError`` naming the sample's file and row, in both policies: its sample shares a packed row with
        others, and the render stage has counted it out already."""
        try:
            return decode_rgb(data)[0]
        except Exception as exc:
            source = source or {}
            reason = f"bad image: {type(exc).__name__}: {exc}"
            raise BadRowError(reason, file=source.get("file"), row=source.get("row"), column=self.image_key) from None

    def __call__(self, table: pa.Table) -> pa.Table:
        if IMAGE_BYTES_COLUMN not in table.column_names:
            return table
        n = table.num_rows
        encoded = table.column(IMAGE_BYTES_COLUMN).to_pylist()
        expected = table.column(IMAGE_GRIDS_COLUMN).to_pylist()
        sources = None
        if IMAGE_SOURCES_COLUMN in table.column_names:
            sources = table.column(IMAGE_SOURCES_COLUMN).to_pylist()
            table = table.drop_columns([IMAGE_SOURCES_COLUMN])
        values: list[dict | None] = [None] * n
        grids: list[dict | None] = [None] * n
        flat = [
            self._decode(data, sources[i][k] if sources and sources[i] else None)
            for i, row in enumerate(encoded)
            if row
            for k, data in enumerate(row)
        ]
        if flat:
            pixel_values, got = self.pixel_values(flat)
            want = [g for row in expected if row for g in row]
            if got.tolist() != want:
                raise RuntimeError(f"image grids {got.tolist()} differ from the header-derived {want}")
            patches = np.cumsum([0] + [int(np.prod(g)) for g in want])
            k = 0
            for i, row in enumerate(encoded):
                if row:
                    values[i] = tensor_record(pixel_values[patches[k] : patches[k + len(row)]])
                    grids[i] = tensor_record(got[k : k + len(row)])
                    k += len(row)
        table = table.set_column(
            table.column_names.index(IMAGE_BYTES_COLUMN), "pixel_values", pa.array(values, TENSOR_STRUCT)
        )
        return table.set_column(
            table.column_names.index(IMAGE_GRIDS_COLUMN), "image_grid_thw", pa.array(grids, TENSOR_STRUCT)
        )
