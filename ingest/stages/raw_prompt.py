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
from ingest.config import DataConfig, StageContext
from ingest.errors import BadRowError, redact
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
from ingest.stages.tokenize import PromptTokenizeStage
from ingest.tokenizer.chat import ChatTokenizer


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
        n = table.num_rows
        if cfg.prompt_key not in table.column_names:
            raise self._error(table, 0, f"no prompt column (columns: {', '.join(table.column_names)})")
        media_columns = [c for c in (cfg.image_key, cfg.video_key) if c in table.column_names]
        prompts = table.column(cfg.prompt_key).to_pylist()
        images = table.column(cfg.image_key).to_pylist() if cfg.image_key in media_columns else [None] * n
        videos = table.column(cfg.video_key).to_pylist() if cfg.video_key in media_columns else [None] * n
        with_audio = self.dialect.audio and cfg.audio_key in table.column_names
        audios = table.column(cfg.audio_key).to_pylist() if with_audio else [None] * n
        measure = cfg.filter_overlong_prompts
        measure_media = measure and self.dialect.filter_expands_media
        bad: dict[int, BadRowError] = {}
        messages_out: list = [None] * n
        texts: list[str] = [""] * n
        to_decode: list[list[bytes] | None] = [None] * n
        struct_bytes: list[list[bytes] | None] = [None] * n  # the encoded images of plain-struct items
        plain = self.files_without_image_feature
        file_of_row = table.column(FILE_COLUMN).to_numpy() if plain and FILE_COLUMN in table.column_names else None
        media_tokens = np.zeros(n, dtype=np.int64)  # what the media add to the text ids (grids expanded)
        for i, messages in enumerate(prompts):
            problem = validate_messages(messages)
            if problem is not None:
                bad[i] = self._error(table, i, problem)
                continue
            row_images, row_videos = images[i] or [], videos[i] or []
            if audios[i]:  # verl 0.9.1 makes audio items of them (or asserts, without placeholders)
                bad[i] = self._error(table, i, "audio: audio prompts are not built by this pipeline", cfg.audio_key)
                continue
            if (row_images or row_videos) and self.vision is None:
                bad[i] = self._error(table, i, "an image or video prompt needs a processor (verl asserts one)")
                continue
            images_decoded = file_of_row is None or int(file_of_row[i]) not in plain
            problem = None if images_decoded else next(filter(None, map(struct_image_problem, row_images)), None)
            if problem is not None:
                bad[i] = self._error(table, i, problem, cfg.image_key)
                continue
            try:
                messages, decode = raw_prompt_messages(messages, row_images, row_videos, images_decoded, self.dialect)
                messages_out[i] = messages
                if measure:  # with the tool schemas, as verl's filter renders it
                    texts[i] = self.tokenizer.render(messages, **self.filter_template_kwargs)
            except Exception as exc:
                bad[i] = self._error(table, i, f"chat messages failed: {type(exc).__name__}: {exc}")
                continue
            try:
                encoded = [read_image_bytes(value, cfg.storage_options) for value in row_images]
                to_decode[i] = [encoded[k] for k in decode] if self.vision is not None else None
                if not images_decoded:  # verl opens these at __getitem__; a file cut short fails its filter's decode
                    struct_bytes[i] = [image["bytes"] for image in row_images if isinstance(image, Mapping)]
                    for data in struct_bytes[i]:
                        image_size(data)
                        check_complete(data)
                if measure_media:
                    media_tokens[i] = sum(self._image_tokens(*image_size(data)) - 1 for data in encoded)
            except Exception as exc:
                reason = redact(f"bad image: {type(exc).__name__}: {exc}", self._secrets)
                bad[i] = self._error(table, i, reason, cfg.image_key)
                continue
            if measure_media and row_videos:
                try:
                    patch = cfg.image_patch_size or self.vision.patch_size  # what verl 0.9 hands qwen-vl-utils
                    plans = [probe_video(value, cfg.storage_options, patch) for value in row_videos]
                    grids = [video_grid(p.nframes, p.height, p.width, self.vision) for p in plans]
                    if self.vision.timestamps_videos:  # one pad per temporal patch stays in the text
                        texts[i] = timestamped_video_text(texts[i], grids, [p.metadata for p in plans], self.vision)
                        media_tokens[i] += sum(grid_tokens(g, self.vision) - g[0] for g in grids)
                    else:
                        media_tokens[i] += sum(grid_tokens(g, self.vision) - 1 for g in grids)
                except Exception as exc:
                    reason = redact(f"bad video: {type(exc).__name__}: {exc}", self._secrets)
                    bad[i] = self._error(table, i, reason, cfg.video_key)

        lengths = media_tokens
        if measure:
            # a text prompt's length decides only whether it is kept: one known short is kept unencoded
            ids = self._ids_unless_short(texts)
            lengths += np.fromiter(map(len, ids), dtype=np.int64, count=n)
        if bad and cfg.on_bad_row == "raise":
            raise bad[min(bad)]
        valid = np.ones(n, dtype=bool)
        valid[list(bad)] = False
        keep = valid & (lengths <= cfg.max_prompt_length) if measure else valid
        counts, quarantine, kept = self._account(table, bad, valid, keep, lengths)
        if self.vision is None:  # text rows carry no ids here, and not every prompt was encoded
            counts.prompt_tokens = 0
        if self.count_only:  # verl 0.9 rows' videos stay sources: the decode stage gets no video plans
            return StageResult(self._counted(table, kept, to_decode, lengths, None), counts, quarantine)
        if len(kept) != n:
            table = table.drop_columns(media_columns).take(kept)
        rows = self._raw_rows(
            table,
            [messages_out[i] for i in kept],
            [to_decode[i] for i in kept],
            [struct_bytes[i] for i in kept],
            bool(media_columns),
            lengths[kept],
        )
        return StageResult(rows, counts, quarantine)

    def _image_tokens(self, width: int, height: int) -> int:
        """An image's expanded token count: qwen-vl-utils' resize (verl 0.9's ``process_vision_info``), then the
        processor's grid."""
        patch = self.config.image_patch_size or self.vision.patch_size
        width, height = fetch_image_size(width, height, patch)
        return grid_tokens(image_grid(width, height, self.vision), self.vision)

    def _raw_rows(
        self, table: pa.Table, messages: list, to_decode: list, struct_bytes: list, as_json: bool, prompt_tokens
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
            columns["raw_prompt"] = pa.array([json.dumps(m, ensure_ascii=False) for m in messages], pa.string())
        else:
            columns["raw_prompt"] = columns[cfg.prompt_key]
        columns[cfg.prompt_key] = pa.nulls(table.num_rows)  # the same objects as raw_prompt, in verl's key order
        columns[RAW_PROMPT_OF_COLUMN] = pa.array([cfg.prompt_key] * table.num_rows, pa.string())
        if self.vision is not None:
            columns[MEDIA_BYTES_COLUMN] = pa.array(to_decode, type=pa.list_(pa.large_binary()))
            columns[STRUCT_IMAGE_BYTES_COLUMN] = pa.array(struct_bytes, type=pa.list_(pa.large_binary()))
            columns[PROMPT_TOKENS_COLUMN] = pa.array(np.asarray(prompt_tokens, dtype=np.int64))
        columns.update(extra_info_columns(table))
        return pa.table(columns)
