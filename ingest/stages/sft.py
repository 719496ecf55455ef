"""The SFT stage: conversations -> shifted, truncated (optionally packed) training rows.

``SFTRenderStage`` (the render actor; the Parquet read is fused into it): per row, the conversation (a ``messages``
column, or ``prompt`` + ``completion``), optional ``tools`` / images / ``message_loss_mask`` columns -> renderers'
own ``build_training_sample`` (``ingest.sft.engine``; a multimodal renderer decodes and processes the row's images
itself) -> ``shift_and_truncate`` at ``sft_max_length`` -> optional in-order ``pack`` within the batch -> Arrow rows.
Conversations that fail the pipeline's checks or that renderers refuses are quarantined or raise, as on the RL path.

Rows are plain Arrow: ``list<int64>`` ids, ``list<bool>`` mask, ``list<int8>`` token types, tensors as
``{dtype, shape, data}`` structs (``ingest.media.geometry.tensor_record``). No pickled Python objects in blocks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from itertools import chain
from typing import Any

import numpy as np
import pyarrow as pa

from ingest.accounting import BatchCounts, StageResult
from ingest.blocks import TENSOR_STRUCT, tensor_record
from ingest.config import DataConfig, StageContext
from ingest.media.image import read_image_bytes
from ingest.rowformat.messages import split_media_placeholders
from ingest.sft.conversation import SFTRenderError, conversation_problem
from ingest.sft.data import TrainingSequence
from ingest.sft.engine import attach_media
from ingest.sft.sequence import pack, shift_and_truncate
from ingest.stages.bad_rows import BadRows

TOOLS_COLUMN = "tools"
MESSAGE_LOSS_MASK_COLUMN = "message_loss_mask"  # renderers' message_loss_mask, one 0/1 per message
PLACEHOLDER_STRUCT = pa.struct([("offset", pa.int64()), ("length", pa.int64())])
_MEDIA_MARKER = re.compile("<image>|<video>")
NO_TARGET_POLICIES = ("drop", "keep")  # a sample whose window holds no trained target
# per modality: the processor outputs each media item holds (renderers' mm_items), concatenated per row
MEDIA_TENSORS = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}
# errors of the process, not of a row: they raise in both policies
_NOT_ROW_ERRORS = (ImportError, MemoryError)


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

    ``build``: renderers' ``build_training_sample`` with one renderer and the caller's keyword arguments
    (``ingest.sft.engine.SampleBuilder``; any callable ``(messages, *, tools, message_loss_mask)`` returning
    renderers' sample; media parts hold their values). ``media``: the renderer is multimodal (emit the media
    columns; a text renderer refuses rows with media). ``no_target``: ``drop`` (prime-rl's rule) or ``keep`` a
    sample whose window holds no trained target. Counts: ``rows_out`` = samples emitted (a packed row holds
    several), ``filtered_overlong`` = samples cut to no inputs at all, ``dropped_no_target`` = samples dropped with
    no trained target, ``prompt_tokens`` = inputs emitted.
    """

    def __init__(
        self,
        build,
        config: DataConfig,
        context: StageContext | None = None,
        *,
        media: bool = False,
        no_target: str = "drop",
    ):
        if no_target not in NO_TARGET_POLICIES:
            raise ValueError(f"no_target must be one of {', '.join(NO_TARGET_POLICIES)}, got {no_target!r}")
        self.build = build
        self.config = config
        self.files = list((context or StageContext()).files)
        self.media = media
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
            "message_loss_mask": MESSAGE_LOSS_MASK_COLUMN,
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

    def _inputs(self, cols: dict, i: int) -> tuple[str, dict]:
        """(the conversation's column, renderers' arguments for row ``i``); raises ``SFTRenderError`` (or a value's
        own error) naming what is wrong, with ``self.step`` the column being read."""
        cfg = self.config
        self.step = cfg.sft_messages_key if cols["messages"] is not None else cfg.prompt_key
        messages, column = self._conversation(cols, i)
        self.step = column
        problem = conversation_problem(messages)
        if problem is not None:
            raise SFTRenderError(problem)
        tools = loss_mask = None
        if cols["tools"] is not None and cols["tools"][i] is not None:
            self.step = TOOLS_COLUMN
            tools = _json_or_value(cols["tools"][i], "tools")
        if cols["message_loss_mask"] is not None and cols["message_loss_mask"][i] is not None:
            loss_mask = cols["message_loss_mask"][i]
        media = {}
        for modality, column_key in (("image", cfg.image_key), ("video", cfg.video_key)):
            values = cols[f"{modality}s"][i] if cols[f"{modality}s"] is not None else None
            if not values:
                continue
            self.step = column_key
            if not self.media:
                raise SFTRenderError(f"the renderer is text-only: it cannot take the row's {modality}s")
            media[modality] = [  # encoded images; a video as its encoded frames (or as stored)
                [read_image_bytes(f, cfg.storage_options) for f in v] if isinstance(v, list)
                else read_image_bytes(v, cfg.storage_options) if modality == "image" else v
                for v in plain(values)
            ]  # fmt: skip
        if media:
            _split_media_markers(messages)
            try:
                messages = attach_media(messages, media)
            except ValueError as exc:
                raise SFTRenderError(str(exc)) from None
        self.step = column
        return column, {"messages": messages, "tools": tools, "message_loss_mask": loss_mask}

    def __call__(self, table: pa.Table) -> StageResult:
        cfg = self.config
        n = table.num_rows
        cols = self._columns(table)
        bad = BadRows(self.files, table)
        sequences: list[TrainingSequence] = []
        filtered = no_target = 0
        for i in range(n):
            try:
                column, arguments = self._inputs(cols, i)
            except Exception as exc:
                reason = str(exc) if isinstance(exc, SFTRenderError) else f"bad value: {type(exc).__name__}: {exc}"
                bad.add(i, reason, self.step)
                continue
            messages = arguments.pop("messages")
            try:
                sample = self.build(messages, **arguments)
            except _NOT_ROW_ERRORS:
                raise
            except Exception as exc:  # renderers refused the conversation: its own reason
                reason = f"renderers: {type(exc).__name__}: {exc}"
                bad.add(i, reason, _blame(reason, column, cfg))
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
        for modality, (values_key, grid_key) in MEDIA_TENSORS.items():
            data = [(r.multi_modal_data or {}).get(modality) for r in rows]
            columns[f"{modality}_placeholders"] = pa.array(
                [None if d is None else [tuple(p) for p in d.placeholders] for d in data],
                pa.list_(PLACEHOLDER_STRUCT),
            )
            columns[f"{modality}_hashes"] = pa.array(
                [None if d is None else d.hashes for d in data], pa.list_(pa.string())
            )
            for key in (values_key, grid_key):
                columns[key] = pa.array(
                    [None if d is None else tensor_record(np.concatenate([it[key] for it in d.items])) for d in data],
                    TENSOR_STRUCT,
                )
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
