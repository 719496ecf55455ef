"""The verl 0.7 / 0.9 prompt stage: ``raw_prompt`` rows (``rowformat.raw_prompt``) and that release's overlong filter,
in-stream.

verl 0.9.1 measures every prompt before its first batch: the tokenizer's templated ids for text, the processor's
expanded ``input_ids`` for media prompts (every image decoded, resized by qwen-vl-utils and processed; every video
decoded; verl 0.7.1 measures a media prompt as its template writes it, each placeholder one token). Here one batched
encode gives the text ids and each image's grid comes from its header and the two resizes
(qwen-vl-utils', then the processor's), each video's from its container header: no pixel is touched to measure a
row. A text prompt known to encode to at most ``max_prompt_length`` ids without encoding it (at most that many
ASCII characters, or UTF-8 bytes of a text the normalizer leaves as it is: ``ChatTokenizer.known_short``) is not
encoded at all: the filter keeps it either way. With the filter off nothing is measured (verl 0.9 has no
truncation: an overlong prompt passes).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from ingest.accounting import StageResult
from ingest.blocks import (
    FILE_COLUMN,
    MEDIA_BYTES_COLUMN,
    PROMPT_TOKENS_COLUMN,
    PROVENANCE_COLUMNS,
    RAW_PROMPT_OF_COLUMN,
    STRUCT_IMAGE_BYTES_COLUMN,
)
from ingest.config import DataConfig, StageContext, datasets_turns_images
from ingest.errors import redact
from ingest.media.geometry import (
    VisionSpec,
    fetch_image_size,
    grid_tokens,
    image_grid,
    timestamped_video_text,
    video_grid,
)
from ingest.media.image import check_complete, image_size, read_image_bytes
from ingest.media.video import probe_video
from ingest.rowformat.messages import validate_messages
from ingest.rowformat.raw_prompt import RAW_PROMPT_DIALECTS, raw_prompt_messages, struct_image_problem
from ingest.rowformat.text import extra_info_columns
from ingest.stages.bad_rows import BadRows
from ingest.stages.tokenize import PromptTokenizeStage
from ingest.tokenizer.chat import ChatTokenizer


@dataclass(slots=True)
class RawPromptRow:
    """One prompt through the verl 0.9 prompt stage. A bad row keeps what was made before it went bad."""

    messages: list | None = None  # verl's raw_prompt messages
    text: str = ""  # what the overlong filter encodes (rendered with the tool schemas; only with the filter on)
    to_decode: list[bytes] | None = None  # the encoded images the decode stage decodes (processor path)
    struct_bytes: list[bytes] | None = None  # the encoded images of plain-struct items (the consumer opens them)
    media_tokens: int = 0  # what the media add to the text ids (grids expanded; only where the filter measures media)


class RawPromptStage(PromptTokenizeStage):
    """Arrow batch of raw rows (with provenance columns) -> Arrow batch of verl 0.7 / 0.9 rows (``raw_prompt``).

    Same construction, bad-row policy and accounting as ``PromptTokenizeStage``; on the processor path the images to
    decode go to the decode stage (``_media_image_bytes``), which counts the rows out. Rows of the files in
    ``context.files_without_image_feature`` get verl's items of plain image structs, their bytes in
    ``STRUCT_IMAGE_BYTES_COLUMN`` for the consumer to open.
    """

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        config: DataConfig,
        context: StageContext | None = None,
        vision: VisionSpec | None = None,
        *,
        count_only: bool = False,
    ):
        super().__init__(tokenizer, config, context, vision, count_only=count_only)
        self.files_without_image_feature = (context or StageContext()).files_without_image_feature
        self.dialect = RAW_PROMPT_DIALECTS[config.row_format]

    def _process(self, table: pa.Table) -> StageResult:
        cfg = self.config
        if cfg.prompt_key not in table.column_names:
            raise self._error(table, 0, f"no prompt column (columns: {', '.join(table.column_names)})")
        media_columns = [c for c in (cfg.image_key, cfg.video_key) if c in table.column_names]
        bad = BadRows(self.files, table, cfg.prompt_key)
        rows = self._raw_prompt_rows(table, media_columns, bad)
        lengths = self._measured_lengths(rows)
        bad.raise_first(cfg.on_bad_row)
        valid = bad.good()
        keep = valid & (lengths <= cfg.max_prompt_length) if cfg.filter_overlong_prompts else valid
        counts, quarantine, kept = self._account(table, bad, valid, keep, lengths)
        if self.vision is None:  # text rows carry no ids here, and not every prompt was encoded
            counts.prompt_tokens = 0
        if self.count_only:  # verl 0.9 rows' videos stay sources: the decode stage gets no video plans
            to_decode = [row.to_decode for row in rows]
            return StageResult(self._counted(table, kept, to_decode, lengths, None), counts, quarantine)
        if len(kept) != table.num_rows:
            table = table.drop_columns(media_columns).take(kept)
        rows = [rows[i] for i in kept]
        return StageResult(self._raw_rows(table, rows, bool(media_columns), lengths[kept]), counts, quarantine)

    def _raw_prompt_rows(self, table: pa.Table, media_columns: list[str], bad: BadRows) -> list[RawPromptRow]:
        """Every row's ``RawPromptRow``: messages, media reads and, with the overlong filter on, what it measures (a
        bad row's as far as it got)."""
        cfg = self.config
        n = table.num_rows
        prompts = table.column(cfg.prompt_key).to_pylist()
        images = table.column(cfg.image_key).to_pylist() if cfg.image_key in media_columns else [None] * n
        videos = table.column(cfg.video_key).to_pylist() if cfg.video_key in media_columns else [None] * n
        with_audio = self.dialect.audio and cfg.audio_key in table.column_names
        audios = table.column(cfg.audio_key).to_pylist() if with_audio else [None] * n
        plain = self.files_without_image_feature
        file_of_row = table.column(FILE_COLUMN).to_numpy() if plain and FILE_COLUMN in table.column_names else None
        rows = []
        for i, messages in enumerate(prompts):
            images_decoded = file_of_row is None or int(file_of_row[i]) not in plain
            row_images, row_videos = images[i] or [], videos[i] or []
            rows.append(self._raw_prompt_row(i, messages, row_images, row_videos, audios[i], images_decoded, bad))
        return rows

    def _raw_prompt_row(
        self, i: int, messages, images: list, videos: list, audio, images_decoded: bool, bad: BadRows
    ) -> RawPromptRow:
        """Row ``i``'s verl messages, encoded images and measure; where one fails the row goes into ``bad``.
        ``images_decoded``: its file's images are an HF Image feature (verl decodes them), not plain structs."""
        cfg = self.config
        row = RawPromptRow()
        problem = self._row_problem(messages, images, videos, audio, images_decoded)
        if problem is not None:
            bad.add(i, *problem)
            return row
        try:
            row.messages, decode = raw_prompt_messages(messages, images, videos, images_decoded, self.dialect)
            if cfg.filter_overlong_prompts:  # with the tool schemas, as verl's filter renders it
                row.text = self.tokenizer.render(row.messages, **self.filter_template_kwargs)
        except Exception as exc:
            bad.add(i, f"chat messages failed: {type(exc).__name__}: {exc}")
            return row
        try:
            self._read_images(row, images, decode, images_decoded)
        except Exception as exc:
            bad.add(i, redact(f"bad image: {type(exc).__name__}: {exc}", self._secrets), cfg.image_key)
            return row
        if self._measures_media and videos:
            try:
                self._measure_videos(row, videos)
            except Exception as exc:
                bad.add(i, redact(f"bad video: {type(exc).__name__}: {exc}", self._secrets), cfg.video_key)
        return row

    def _row_problem(
        self, messages, images: list, videos: list, audio, images_decoded: bool
    ) -> tuple[str, str | None] | None:
        """Why a row cannot be a verl 0.9 row whatever its media hold, and the column to name (None: the prompt's),
        else None."""
        cfg = self.config
        problem = validate_messages(messages)
        if problem is not None:
            return problem, None
        if audio:  # verl 0.9.1 makes audio items of them (or asserts, without placeholders)
            return "audio: audio prompts are not built by this pipeline", cfg.audio_key
        if (images or videos) and self.vision is None:
            return "an image or video prompt needs a processor (verl asserts one)", None
        problem = None if images_decoded else next(filter(None, map(struct_image_problem, images)), None)
        return None if problem is None else (problem, cfg.image_key)

    @property
    def _measures_media(self) -> bool:
        """Whether the overlong filter measures a media prompt with its media expanded (verl 0.9.1; 0.7.1 counts each
        placeholder as one token)."""
        return self.config.filter_overlong_prompts and self.dialect.filter_expands_media

    def _read_images(self, row: RawPromptRow, images: list, decode: list[int], images_decoded: bool) -> None:
        """The row's encoded images: those for the decode stage (``decode``: their positions), the plain structs'
        bytes (checked to decode, as verl's filter does) and, where the filter measures media, their tokens."""
        encoded = [read_image_bytes(value, self.config.storage_options) for value in images]
        row.to_decode = [encoded[k] for k in decode] if self.vision is not None else None
        if not images_decoded:  # verl opens these at __getitem__; a file cut short fails its filter's decode
            row.struct_bytes = [image["bytes"] for image in images if isinstance(image, Mapping)]
            for data in row.struct_bytes:
                image_size(data)
                check_complete(data)
        if self._measures_media:  # sized as verl gets them: an Image() column's turned by EXIF Orientation
            turned = images_decoded and datasets_turns_images()
            row.media_tokens = sum(self._image_tokens(*image_size(data, turned=turned)) - 1 for data in encoded)

    def _measure_videos(self, row: RawPromptRow, videos: list) -> None:
        """What the row's videos add to its measure, from their container headers (no frame decoded)."""
        patch = self.config.image_patch_size or self.vision.patch_size  # what verl 0.9 hands qwen-vl-utils
        plans = [probe_video(value, self.config.storage_options, patch) for value in videos]
        grids = [video_grid(p.nframes, p.height, p.width, self.vision) for p in plans]
        if self.vision.timestamps_videos:  # one pad per temporal patch stays in the text
            row.text = timestamped_video_text(row.text, grids, [p.metadata for p in plans], self.vision)
            row.media_tokens += sum(grid_tokens(g, self.vision) - g[0] for g in grids)
        else:
            row.media_tokens += sum(grid_tokens(g, self.vision) - 1 for g in grids)

    def _measured_lengths(self, rows: list[RawPromptRow]) -> np.ndarray:
        """What the overlong filter measures of each prompt: its media tokens, plus its text ids where the filter is
        on. A text prompt's length decides only whether it is kept: one known short is kept unencoded."""
        lengths = np.fromiter((row.media_tokens for row in rows), dtype=np.int64, count=len(rows))
        if self.config.filter_overlong_prompts:
            ids = self._ids_unless_short([row.text for row in rows])
            lengths += np.fromiter(map(len, ids), dtype=np.int64, count=len(rows))
        return lengths

    def _image_tokens(self, width: int, height: int) -> int:
        """An image's expanded token count: qwen-vl-utils' resize (verl 0.9's ``process_vision_info``), then the
        processor's grid."""
        patch = self.config.image_patch_size or self.vision.patch_size
        width, height = fetch_image_size(width, height, patch)
        return grid_tokens(image_grid(width, height, self.vision), self.vision)

    def _raw_rows(
        self, table: pa.Table, rows: list[RawPromptRow], as_json: bool, prompt_tokens: np.ndarray
    ) -> pa.Table:
        """verl 0.9's keys in its order: the Parquet columns without the media (and audio, where the dialect has it; the
        prompt column's values are the ``raw_prompt`` objects, filled in by the consumer), ``raw_prompt``, then
        ``extra_info``'s keys."""
        cfg = self.config
        keep_provenance = self.keep_provenance or self.vision is not None  # the decode stage names bad media's rows
        drop = {cfg.image_key, cfg.video_key} | (set() if keep_provenance else set(PROVENANCE_COLUMNS))
        if self.dialect.audio:
            drop.add(cfg.audio_key)
        columns = {name: table.column(name) for name in table.column_names if name not in drop}
        # where a dataset has media columns the messages are JSON (content items of any shape, no null fields);
        # else they stay the prompt column as read
        if as_json:
            messages = [json.dumps(row.messages, ensure_ascii=False) for row in rows]
            columns["raw_prompt"] = pa.array(messages, pa.string())
        else:
            columns["raw_prompt"] = columns[cfg.prompt_key]
        columns[cfg.prompt_key] = pa.nulls(table.num_rows)  # the same objects as raw_prompt, in verl's key order
        columns[RAW_PROMPT_OF_COLUMN] = pa.array([cfg.prompt_key] * table.num_rows, pa.string())
        if self.vision is not None:
            to_decode, struct_bytes = [row.to_decode for row in rows], [row.struct_bytes for row in rows]
            columns[MEDIA_BYTES_COLUMN] = pa.array(to_decode, type=pa.list_(pa.large_binary()))
            columns[STRUCT_IMAGE_BYTES_COLUMN] = pa.array(struct_bytes, type=pa.list_(pa.large_binary()))
            columns[PROMPT_TOKENS_COLUMN] = pa.array(np.asarray(prompt_tokens, dtype=np.int64))
        columns.update(extra_info_columns(table))
        return pa.table(columns)
