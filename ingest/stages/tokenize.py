"""Prompt tokenization: chat template, one batched encode, truncation, left padding, position ids, overlong filter.

One encode per prompt gives everything verl computes with three (the filter's ``apply_chat_template(tokenize=True)``,
``__getitem__``'s ``tokenizer(raw_prompt)`` and ``tokenizer.encode(raw_prompt)``): on the text path they are the
same ids. On the processor path the unexpanded ids are ``raw_prompt_ids`` and ``input_ids`` repeats each image pad
id as many times as the image's grid asks (what the processor's string expansion + tokenization yields, because pad
tokens are special tokens); the grid comes from the image header and the processor geometry, so the overlong filter
runs before any pixel work and nothing is processed twice. Overlong rows are dropped here, in-stream.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import pyarrow as pa

from ingest.accounting import BatchCounts, StageResult, row_error
from ingest.blocks import (
    FILE_COLUMN,
    GRIDS_TYPE,
    IMAGE_GRIDS_COLUMN,
    MAX_LENGTH_COLUMN,
    MEDIA_BYTES_COLUMN,
    PAD_ID_COLUMN,
    PROMPT_TOKENS_COLUMN,
    PROVENANCE_COLUMNS,
    ROW_COLUMN,
    VIDEO_GRIDS_COLUMN,
    VIDEO_PLAN_STRUCT,
    VIDEO_PLANS_COLUMN,
    provenance_rows,
)
from ingest.config import DataConfig, StageContext
from ingest.errors import BadRowError, redact, secret_values
from ingest.media.geometry import (
    IMAGE_PAD,
    VIDEO_PAD,
    VISION_START,
    VisionSpec,
    fetch_image_size,
    grid_tokens,
    image_grid,
    timestamped_video_text,
    video_grid,
)
from ingest.media.image import image_size, read_image_bytes
from ingest.media.video import PATCH_SIZE, VideoPlan, probe_video
from ingest.rowformat.messages import build_messages, validate_messages
from ingest.rowformat.rope import rope_position_ids, with_text_positions
from ingest.rowformat.text import extra_info_columns, flatten_ids, list_column, pad_flat, tensor_column, truncate
from ingest.stages.bad_rows import BadRows
from ingest.stages.invalid_values import invalid_value_rows, readable_row
from ingest.tokenizer.chat import ChatTokenizer


@dataclass(slots=True)
class PromptRow:
    """One prompt through the tokenize stage: what its checks, template, media headers and encode made of it. A bad
    row keeps what was made before it went bad (it is dropped before its columns are built)."""

    text: str = ""  # the rendered chat template (verl's full_prompts)
    messages: list | None = None  # the messages rendered (verl's raw_prompt)
    media_bytes: list[bytes] | None = None  # encoded images; None where verl has no image key (no column, or null)
    image_grids: list[tuple[int, int, int]] = field(default_factory=list)
    video_plans: list[VideoPlan] | None = None  # None where verl has no video key
    video_grids: list[tuple[int, int, int]] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # the template's ids (raw_prompt_ids before truncation)
    # the ids the processor tokenizes before pad expansion, and the grids their video pads expand by: ``ids`` and
    # ``video_grids`` but for Qwen3-VL videos (``PromptTokenizeStage._timestamp_videos``)
    model_ids: list[int] = field(default_factory=list)
    video_token_grids: list[tuple[int, int, int]] = field(default_factory=list)


class PromptTokenizeStage:
    """Arrow batch of raw rows (with provenance columns) -> Arrow batch of verl rows.

    ``vision``: the processor geometry on the processor path (None on the text path). Bad rows are quarantined
    (``on_bad_row="quarantine"``, default) or raise ``BadRowError`` (``"raise"``). ``truncation="error"`` on an
    overlong prompt always raises, as in verl. ``count_only``: the same decisions and counts, but the output keeps
    only the kept rows' provenance (an epoch's row count), and a text prompt known to be short enough without
    encoding it is not encoded (``ChatTokenizer.known_short``).
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
        context = context or StageContext()
        self.tokenizer = tokenizer
        self.config = config
        self.count_only = count_only
        self.files = list(context.files)
        self.vision = vision
        self.keep_provenance = context.keep_provenance
        self.context = context
        self._secrets = secret_values(config.storage_options)  # kept out of quarantine reasons and errors
        # verl 0.6 and later pass these to apply_chat_template; 0.5.0 does not read them
        self.template_kwargs = config.apply_chat_template_kwargs if config.row_format != "verl-0.5" else {}
        # verl 0.6 and later: the tools' schemas, given to the template where the overlong filter measures a prompt
        self.filter_tools = config.tool_schemas if config.row_format != "verl-0.5" else None
        self.filter_template_kwargs = {
            **self.template_kwargs,
            **({"tools": self.filter_tools} if self.filter_tools else {}),
        }
        if tokenizer.pad_token_id is None:
            raise BadRowError(f"tokenizer {tokenizer.path!r} has neither a pad nor an eos token")
        if vision is not None:
            ids = [tokenizer.token_id(t) for t in (IMAGE_PAD, VIDEO_PAD, VISION_START)]
            self.image_pad_id, self.video_pad_id, self.vision_start_id = ids
        # verl 0.6 hands qwen-vl-utils data.image_patch_size (default 14) for videos; 0.5.0 leaves qwen-vl-utils' 14
        self.video_patch_size = PATCH_SIZE
        if config.row_format == "verl-0.6":
            self.video_patch_size = config.image_patch_size or PATCH_SIZE
        # Qwen3-VL's processor writes each video's frames out with a timestamp before each one (verl 0.6's ids)
        self.timestamps_videos = vision is not None and vision.timestamps_videos

    def _error(self, table: pa.Table, i: int, reason: str) -> BadRowError:
        """The error a whole batch raises at row ``i`` (no prompt column, an overlong prompt under
        ``truncation='error'``): it names the prompt column."""
        return row_error(self.files, table, i, reason, self.config.prompt_key)

    def __call__(self, table: pa.Table) -> StageResult:
        invalid = invalid_value_rows(self.files, table)
        if not invalid:
            return self._process(table)
        # rows Python cannot read are bad rows; the others go on as usual
        invalid.raise_first(self.config.on_bad_row)
        result = self._process(table.take(pa.array(invalid.kept(), pa.int64())))
        records = invalid.quarantine(readable_row)
        position = {table.column(ROW_COLUMN)[i].as_py(): i for i in range(table.num_rows)}
        result.quarantine = sorted(result.quarantine + records, key=lambda r: position[r["row"]])
        result.counts.rows_in += len(invalid)
        result.counts.quarantined += len(invalid)
        return result

    def _process(self, table: pa.Table) -> StageResult:
        cfg = self.config
        if cfg.prompt_key not in table.column_names:
            raise self._error(table, 0, f"no prompt column (columns: {', '.join(table.column_names)})")
        has_media = cfg.image_key in table.column_names or cfg.video_key in table.column_names
        bad = BadRows(self.files, table, cfg.prompt_key)
        rows = self._prompt_rows(table, has_media, bad)
        self._encode(rows, bad)
        lengths = self._expanded_lengths(rows, bad)
        if self.vision is not None and not cfg.filter_overlong_prompts and cfg.truncation != "error":
            self._check_truncation_keeps_media(rows, lengths, bad)
        bad.raise_first(cfg.on_bad_row)
        valid = bad.good()
        keep = self._kept_by_length(table, rows, lengths, valid)
        counts, quarantine, kept = self._account(table, bad, valid, keep, lengths)
        if self.count_only:
            media_bytes, video_plans = [r.media_bytes for r in rows], [r.video_plans for r in rows]
            return StageResult(self._counted(table, kept, media_bytes, lengths, video_plans), counts, quarantine)
        if len(kept) != table.num_rows:
            # take only what the output keeps: the nested prompt / media columns are the costly ones to copy
            unused = {cfg.image_key, cfg.video_key} if self.vision is not None else set()
            if has_media or not cfg.return_raw_chat:
                unused.add(cfg.prompt_key)
            table = table.drop_columns([c for c in table.column_names if c in unused]).take(kept)
        return StageResult(self._rows(table, [rows[i] for i in kept], has_media, lengths[kept]), counts, quarantine)

    def _prompt_rows(self, table: pa.Table, has_media: bool, bad: BadRows) -> list[PromptRow]:
        """Every row's ``PromptRow`` up to its ids: messages, template, media headers (a bad row's as far as it got)."""
        cfg = self.config
        prompts = table.column(cfg.prompt_key).to_pylist()
        images = self._media_column(table, cfg.image_key)
        videos = self._media_column(table, cfg.video_key)
        files = table.column(FILE_COLUMN).to_numpy() if FILE_COLUMN in table.column_names else None
        plain = self.context.plain_struct_rows(files, table.num_rows)
        turned = self.context.images_turned(plain, plain_structs_turned=cfg.row_format == "verl-0.5")
        fetch = cfg.fetches_plain_struct_images
        return [
            self._prompt_row(
                i,
                messages,
                None if images is None else images[i],
                None if videos is None else videos[i],
                has_media,
                bad,
                turned[i],
                fetch if plain[i] else None,
            )
            for i, messages in enumerate(prompts)
        ]

    def _prompt_row(
        self,
        i: int,
        messages,
        images: list | None,
        videos: list | None,
        has_media: bool,
        bad: BadRows,
        images_turned: bool,
        images_fetched: int | None,
    ) -> PromptRow:
        """Row ``i``'s messages, rendered template and media headers; where one fails the row goes into ``bad``.
        ``images_turned``: verl gets its images turned by their EXIF Orientation (``StageContext.images_turned``);
        ``images_fetched``: resized by ``fetch_image`` with this patch size (``fetches_plain_struct_images``)."""
        row = PromptRow()
        problem = validate_messages(messages)
        if problem is not None:
            bad.add(i, problem)
            return row
        try:
            messages = build_messages(messages, has_media_column=has_media)
            row.text = self.tokenizer.render(messages, **self.template_kwargs)
            row.messages = messages
        except Exception as exc:
            bad.add(i, f"chat template failed: {type(exc).__name__}: {exc}")
            return row
        media = (
            (
                "image",
                images,
                partial(self._read_images, turned=images_turned, fetched=images_fetched),
                self.config.image_key,
            ),
        )
        media += (("video", videos, self._probe_videos, self.config.video_key),)
        for kind, values, read, column in media:
            if values is None:
                continue
            try:
                read(row, values)
            except Exception as exc:
                bad.add(i, redact(f"bad {kind}: {type(exc).__name__}: {exc}", self._secrets), column)
                return row
        return row

    def _read_images(self, row: PromptRow, images: list, *, turned: bool, fetched: int | None) -> None:
        """The row's encoded images and their grids, from the image headers (no pixel work); ``turned``: sized as
        turned by their EXIF Orientation; ``fetched``: as resized by ``fetch_image`` with that patch size."""
        row.media_bytes = []
        for value in images:
            data = read_image_bytes(value, self.config.storage_options)
            width, height = image_size(data, turned=turned)
            if fetched is not None:
                width, height = fetch_image_size(width, height, fetched)
            row.media_bytes.append(data)
            row.image_grids.append(image_grid(width, height, self.vision))

    def _probe_videos(self, row: PromptRow, videos: list) -> None:
        """The row's video plans (the frames to sample) and their grids, from the container headers."""
        row.video_plans = [probe_video(value, self.config.storage_options, self.video_patch_size) for value in videos]
        row.video_grids = [video_grid(p.nframes, p.height, p.width, self.vision) for p in row.video_plans]

    def _encode(self, rows: list[PromptRow], bad: BadRows) -> None:
        """Every row's ids, in one batched encode, and the ids the processor tokenizes (``_timestamp_videos``)."""
        texts = [row.text for row in rows]
        if self.count_only and not self.filter_tools:  # only the filter's decision is needed, not the ids
            ids = self._ids_unless_short(texts)
        else:
            ids = self.tokenizer.encode_batch(texts)
        for row, row_ids in zip(rows, ids, strict=True):
            row.ids = row.model_ids = row_ids
            row.video_token_grids = row.video_grids
        if self.timestamps_videos:
            self._timestamp_videos([row for i, row in enumerate(rows) if row.video_plans and i not in bad])

    def _timestamp_videos(self, rows: list[PromptRow]) -> None:
        """The ids and video grids of Qwen3-VL video rows as its processor tokenizes them.

        A Qwen3-VL video is written out per temporal patch (``<t seconds>``, vision start, one pad, vision end; its
        processor's text), so its pads expand by (1, h, w) grids, one per temporal patch: verl 0.6's Qwen3-VL rope
        index splits the grids the same way."""
        if not rows:
            return
        written = []
        for row in rows:
            metadata = [p.metadata for p in row.video_plans]
            written.append(timestamped_video_text(row.text, row.video_grids, metadata, self.vision))
            row.video_token_grids = [(1, h, w) for t, h, w in row.video_grids for _ in range(t)]
        for row, row_ids in zip(rows, self.tokenizer.encode_batch(written), strict=True):
            row.model_ids = row_ids

    def _ids_unless_short(self, texts: list[str]) -> list[list[int]]:
        """The ids of every text prompt but those known to be at most ``max_prompt_length`` ids without encoding them
        (``ChatTokenizer.known_short``), which get none: the overlong filter keeps them either way. On the processor
        path every prompt is encoded (the media add tokens)."""
        short = [False] * len(texts)
        if self.vision is None:
            short = self.tokenizer.known_short(texts, self.config.max_prompt_length)
        rows = [i for i, known in enumerate(short) if not known]
        ids: list[list[int]] = [[] for _ in texts]
        for i, row_ids in zip(rows, self.tokenizer.encode_batch([texts[i] for i in rows]), strict=True):
            ids[i] = row_ids
        return ids

    def _expanded_lengths(self, rows: list[PromptRow], bad: BadRows) -> np.ndarray:
        """Each prompt's length in model ids with every image / video pad expanded by its grid. On the processor
        path a row whose pads do not match its media goes into ``bad``; a bad row counts its ids alone."""
        if self.vision is None:
            return np.fromiter((len(row.model_ids) for row in rows), dtype=np.int64, count=len(rows))
        lengths = np.zeros(len(rows), dtype=np.int64)
        for i, row in enumerate(rows):
            if i in bad:
                lengths[i] = len(row.model_ids)
                continue
            mismatch = self._placeholder_mismatch(row)
            if mismatch is not None:
                bad.add(i, *mismatch)
                continue
            pads = row.image_grids + row.video_token_grids
            lengths[i] = len(row.model_ids) + sum(grid_tokens(g, self.vision) - 1 for g in pads)
        return lengths

    def _placeholder_mismatch(self, row: PromptRow) -> tuple[str, str] | None:
        """(reason, column) where the prompt's image or video pads are not one per image or video, else None."""
        placeholders = row.ids.count(self.image_pad_id)
        if placeholders != len(row.image_grids):
            return f"{placeholders} <image> placeholders for {len(row.image_grids)} images", self.config.image_key
        placeholders = row.ids.count(self.video_pad_id)
        if placeholders != len(row.video_grids):
            return f"{placeholders} <video> placeholders for {len(row.video_grids)} videos", self.config.video_key
        return None

    def _check_truncation_keeps_media(self, rows: list[PromptRow], lengths: np.ndarray, bad: BadRows) -> None:
        """Overlong media prompts whose truncation would cut into their media tokens go into ``bad``. A row bad
        already keeps its reason: its media may be only partly read, so its pads cannot be expanded."""
        max_len, truncation = self.config.max_prompt_length, self.config.truncation
        for i in np.flatnonzero(lengths > max_len).tolist():
            if i in bad:
                continue
            row = rows[i]
            if self._truncation_cuts_media(row.model_ids, row.image_grids, row.video_token_grids):
                column = self.config.image_key if row.image_grids else self.config.video_key
                reason = (
                    f"truncation={truncation!r} to max_prompt_length={max_len} cuts into the image / video "
                    f"tokens of a {lengths[i]}-token prompt: its ids would not match its pixels "
                    "(raise max_prompt_length or set data.filter_overlong_prompts=true)"
                )
                bad.add(i, reason, column)

    def _kept_by_length(
        self, table: pa.Table, rows: list[PromptRow], lengths: np.ndarray, valid: np.ndarray
    ) -> np.ndarray:
        """The valid rows the overlong filter keeps (all of them with the filter off). With ``truncation='error'``
        a kept overlong prompt raises, as in verl."""
        cfg = self.config
        max_len = cfg.max_prompt_length
        if cfg.filter_overlong_prompts:  # verl's filter measures the prompt with the tool schemas, if any
            keep = valid & (lengths + self._tool_tokens(rows, valid) <= max_len)
        else:
            keep = valid
        if cfg.truncation == "error":
            over = np.flatnonzero(keep & (lengths > max_len))
            if over.size:
                i = int(over[0])
                raise self._error(
                    table,
                    i,
                    f"prompt is {lengths[i]} tokens, longer than max_prompt_length={max_len} with "
                    "truncation='error' (set data.truncation to left/right/middle or "
                    "data.filter_overlong_prompts=true)",
                )
        return keep

    def _account(
        self, table: pa.Table, bad: BadRows, valid: np.ndarray, keep: np.ndarray, lengths: np.ndarray
    ) -> tuple[BatchCounts, list, np.ndarray]:
        """A batch's counts, quarantine records and kept row positions. On the processor path the decode stage counts
        the rows out and their tokens (it may still drop a row)."""
        counts = BatchCounts(rows_in=table.num_rows, quarantined=len(bad), filtered_overlong=int((valid & ~keep).sum()))
        kept = np.flatnonzero(keep)
        if self.vision is None:
            counts.rows_out = len(kept)
            counts.prompt_tokens = int(lengths[kept].sum())
        return counts, bad.quarantine(), kept

    def _counted(
        self, table: pa.Table, kept: np.ndarray, media_bytes: list, prompt_tokens: np.ndarray, video_plans: list | None
    ) -> pa.Table:
        """``count_only``'s output: the kept rows' provenance; on the processor path also what the decode stage needs
        to find bad media (the encoded images, the video plans unless None, the prompt tokens), not the rows' model
        inputs."""
        rows = provenance_rows(table, kept)
        if self.vision is None:
            return rows
        media = [media_bytes[i] for i in kept]
        rows = rows.append_column(MEDIA_BYTES_COLUMN, pa.array(media, pa.list_(pa.large_binary())))
        if video_plans is not None:
            plans = [None if video_plans[i] is None else [v.as_record() for v in video_plans[i]] for i in kept]
            rows = rows.append_column(VIDEO_PLANS_COLUMN, pa.array(plans, type=pa.list_(VIDEO_PLAN_STRUCT)))
        return rows.append_column(PROMPT_TOKENS_COLUMN, pa.array(prompt_tokens[kept]))

    def _media_column(self, table: pa.Table, name: str) -> list | None:
        return table.column(name).to_pylist() if self.vision and name in table.column_names else None

    def _tool_tokens(self, rows: list[PromptRow], valid: np.ndarray) -> np.ndarray:
        """What the tool schemas (``tool_config_path``) add to each valid prompt where verl's filter measures it: the
        prompt rendered with ``tools=`` and encoded, less its ids without them. Zeros without tools."""
        extra = np.zeros(len(rows), dtype=np.int64)
        if not self.filter_tools:
            return extra
        positions = np.flatnonzero(valid).tolist()
        texts = [self.tokenizer.render(rows[i].messages, **self.filter_template_kwargs) for i in positions]
        for i, with_tools in zip(positions, self.tokenizer.encode_batch(texts), strict=True):
            extra[i] = len(with_tools) - len(rows[i].ids)
        return extra

    def _truncation_cuts_media(self, row_ids: list[int], image_grids: list, video_grids: list) -> bool:
        """Whether truncating this (overlong) prompt removes any of its media tokens: the vision start marker or a
        pad token of an image or video. verl truncates such a prompt all the same and then fails in its rope index
        (or, with only a start marker cut, pairs ids and pixels wrongly); here the row is a bad row."""
        media = {self.image_pad_id, self.video_pad_id, self.vision_start_id}
        full = self._expand(row_ids, image_grids, video_grids)
        kept = truncate(full, self.config.max_prompt_length, self.config.truncation)
        return sum(t in media for t in kept) != sum(t in media for t in full)

    def _expand(self, row_ids: list[int], image_grids: list, video_grids: list) -> list[int]:
        """Each image / video pad token repeated as many times as its grid asks (the processor's expansion)."""
        if not image_grids and not video_grids:
            return row_ids
        pending = {self.image_pad_id: iter(image_grids), self.video_pad_id: iter(video_grids)}
        out: list[int] = []
        for token in row_ids:
            grids = pending.get(token)
            if grids is None:
                out.append(token)
            else:
                out.extend([token] * grid_tokens(next(grids), self.vision))
        return out

    def _rows(self, table: pa.Table, rows: list[PromptRow], has_media: bool, prompt_tokens: np.ndarray) -> pa.Table:
        """The verl rows of the kept prompts: ``table`` holds exactly those rows, ``rows`` their ``PromptRow``s."""
        cfg = self.config
        keep_provenance = self.keep_provenance or self.vision is not None
        # on the processor path the decode stage still needs the provenance (it names the file and row of bad media)
        drop = {cfg.prompt_key} | (set() if keep_provenance else set(PROVENANCE_COLUMNS))
        if self.vision is not None:
            drop |= {cfg.image_key, cfg.video_key}
        columns = {name: table.column(name) for name in table.column_names if name not in drop}
        if self.vision is not None:
            columns[MEDIA_BYTES_COLUMN] = pa.array([r.media_bytes for r in rows], type=pa.list_(pa.large_binary()))
            columns[IMAGE_GRIDS_COLUMN] = pa.array([r.image_grids for r in rows], type=GRIDS_TYPE)
            plans = [None if r.video_plans is None else [v.as_record() for v in r.video_plans] for r in rows]
            columns[VIDEO_PLANS_COLUMN] = pa.array(plans, type=pa.list_(VIDEO_PLAN_STRUCT))
            columns[VIDEO_GRIDS_COLUMN] = pa.array([r.video_grids for r in rows], type=GRIDS_TYPE)
            columns[PROMPT_TOKENS_COLUMN] = pa.array(np.asarray(prompt_tokens, dtype=np.int64))
        columns.update(self._id_tensors(rows))
        columns["raw_prompt_ids"] = list_column([truncate(r.ids, cfg.max_prompt_length, cfg.truncation) for r in rows])
        if cfg.return_raw_chat:
            if has_media:  # content lists after the <image> split: JSON keeps their exact keys (no null fields)
                messages = [json.dumps(r.messages, ensure_ascii=False) for r in rows]
                columns["raw_prompt"] = pa.array(messages, pa.string())
            else:
                columns["raw_prompt"] = table.column(cfg.prompt_key)
        if cfg.return_full_prompt:
            columns["full_prompts"] = pa.array([r.text for r in rows], type=pa.string())
        columns.update(extra_info_columns(table))
        return pa.table(columns)

    def _id_tensors(self, rows: list[PromptRow]) -> dict[str, pa.Array]:
        """The rows' id tensors. Text rows are compact (the collate pads them, ``rowformat.COMPACT_TEXT_COLUMNS``):
        only the length and pad id to pad with. Media rows: ``input_ids`` with the pads expanded, truncated and left
        padded, their attention mask and position ids (Qwen2-VL's rope index where the processor is one)."""
        cfg = self.config
        if self.vision is None:
            n = len(rows)
            return {
                MAX_LENGTH_COLUMN: pa.array(np.full(n, cfg.max_prompt_length, dtype=np.int32)),
                PAD_ID_COLUMN: pa.array(np.full(n, self.tokenizer.pad_token_id, dtype=np.int64)),
            }
        expanded = [
            truncate(
                self._expand(r.model_ids, r.image_grids, r.video_token_grids), cfg.max_prompt_length, cfg.truncation
            )
            for r in rows
        ]
        flat, lengths = flatten_ids(expanded)
        input_ids, attention_mask, position_ids = pad_flat(
            flat, lengths, cfg.max_prompt_length, self.tokenizer.pad_token_id
        )
        if self.vision.is_qwen2_vl:
            position_ids = self._rope_positions(input_ids, attention_mask, rows)
            if cfg.row_format == "verl-0.6":
                position_ids = with_text_positions(position_ids, attention_mask)
        return {
            "input_ids": tensor_column(input_ids),
            "attention_mask": tensor_column(attention_mask),
            "position_ids": tensor_column(position_ids),
        }

    def _rope_positions(self, input_ids: np.ndarray, attention_mask: np.ndarray, rows: list[PromptRow]) -> np.ndarray:
        """(B, 3, M) Qwen2-VL rope position ids, row by row (verl's ``get_rope_index``)."""
        if not len(input_ids):
            return np.zeros((0, 3, input_ids.shape[1]), dtype=np.int64)
        return np.stack(
            [
                rope_position_ids(
                    input_ids[i],
                    attention_mask[i],
                    rows[i].image_grids,
                    rows[i].video_token_grids,
                    image_token_id=self.image_pad_id,
                    video_token_id=self.video_pad_id,
                    vision_start_token_id=self.vision_start_id,
                    merge_size=self.vision.merge_size,
                )
                for i in range(len(input_ids))
            ]
        )
