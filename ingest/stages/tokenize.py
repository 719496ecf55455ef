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

import numpy as np
import pyarrow as pa

from ingest.accounting import BatchCounts, StageResult, input_row, quarantine_record, row_error
from ingest.blocks import (
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
from ingest.tokenizer.chat import ChatTokenizer


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

    def _error(self, table: pa.Table, i: int, reason: str, column: str | None = None) -> BadRowError:
        return row_error(self.files, table, i, reason, column or self.config.prompt_key)

    def __call__(self, table: pa.Table) -> StageResult:
        invalid = self._invalid_values(table)
        if not invalid:
            return self._process(table)
        # Rows holding bytes that are not valid UTF-8 in a string column (Parquet does not check): Python cannot
        # read them (verl's HF dataset raises UnicodeDecodeError), so they are bad rows; the others go on as usual.
        if self.config.on_bad_row == "raise":
            raise invalid[min(invalid)]
        valid = [i for i in range(table.num_rows) if i not in invalid]
        result = self._process(table.take(pa.array(valid, pa.int64())))
        records = [
            quarantine_record(err, input_row(table, i) or _lossy_row_dict(table, i)) for i, err in invalid.items()
        ]
        position = {table.column(ROW_COLUMN)[i].as_py(): i for i in range(table.num_rows)}
        result.quarantine = sorted(result.quarantine + records, key=lambda r: position[r["row"]])
        result.counts.rows_in += len(invalid)
        result.counts.quarantined += len(invalid)
        return result

    def _invalid_values(self, table: pa.Table) -> dict[int, BadRowError]:
        """Rows with values Arrow's full validation rejects (in practice: string bytes that are not UTF-8)."""
        try:
            table.validate(full=True)  # cheap next to tokenizing the batch
            return {}
        except pa.ArrowInvalid:
            pass
        bad: dict[int, BadRowError] = {}
        for name in table.column_names:
            column = table.column(name)
            try:
                column.validate(full=True)
                continue
            except pa.ArrowInvalid:
                pass
            for i in range(table.num_rows):
                if i in bad:
                    continue
                try:
                    column.take([i]).validate(full=True)  # take, not slice: a sliced list keeps all its children
                except pa.ArrowInvalid as exc:
                    what = "text that is not valid UTF-8" if "UTF8" in str(exc) else "an invalid value"
                    bad[i] = self._error(table, i, f"{what} ({exc})", name)
        return bad

    def _process(self, table: pa.Table) -> StageResult:
        cfg = self.config
        n = table.num_rows
        if cfg.prompt_key not in table.column_names:
            raise self._error(table, 0, f"no prompt column (columns: {', '.join(table.column_names)})")
        has_media = cfg.image_key in table.column_names or cfg.video_key in table.column_names
        prompts = table.column(cfg.prompt_key).to_pylist()
        images = self._media_column(table, cfg.image_key)
        videos = self._media_column(table, cfg.video_key)
        bad: dict[int, BadRowError] = {}
        texts: list[str] = [""] * n
        messages_out: list = [None] * n
        # None where verl has no such key in multi_modal_data (no column, or a null value)
        media_bytes: list[list[bytes] | None] = [None] * n
        grids: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
        video_plans: list[list[VideoPlan] | None] = [None] * n
        video_grids: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
        for i, messages in enumerate(prompts):
            problem = validate_messages(messages)
            if problem is not None:
                bad[i] = self._error(table, i, problem)
                continue
            try:
                messages = build_messages(messages, has_media_column=has_media)
                texts[i] = self.tokenizer.render(messages, **self.template_kwargs)
                messages_out[i] = messages
            except Exception as exc:
                bad[i] = self._error(table, i, f"chat template failed: {type(exc).__name__}: {exc}")
                continue
            if images is not None and images[i] is not None:
                try:
                    media_bytes[i] = []
                    for value in images[i]:
                        data = read_image_bytes(value, cfg.storage_options)
                        width, height = image_size(data)
                        media_bytes[i].append(data)
                        grids[i].append(image_grid(width, height, self.vision))
                except Exception as exc:
                    reason = redact(f"bad image: {type(exc).__name__}: {exc}", self._secrets)
                    bad[i] = self._error(table, i, reason, cfg.image_key)
                    continue
            if videos is not None and videos[i] is not None:
                try:
                    video_plans[i] = [
                        probe_video(value, cfg.storage_options, self.video_patch_size) for value in videos[i]
                    ]
                    video_grids[i] = [video_grid(p.nframes, p.height, p.width, self.vision) for p in video_plans[i]]
                except Exception as exc:
                    reason = redact(f"bad video: {type(exc).__name__}: {exc}", self._secrets)
                    bad[i] = self._error(table, i, reason, cfg.video_key)

        if self.count_only and not self.filter_tools:  # only the filter's decision is needed, not the ids
            ids = self._ids_unless_short(texts)
        else:
            ids = self.tokenizer.encode_batch(texts)
        model_ids, video_token_grids = self._timestamped_ids(texts, ids, video_plans, video_grids, bad)
        expanded_lengths = np.zeros(n, dtype=np.int64)
        for i, row_ids in enumerate(ids):
            extra = 0
            if self.vision is not None and i not in bad:
                placeholders = row_ids.count(self.image_pad_id)
                if placeholders != len(grids[i]):
                    bad[i] = self._error(
                        table, i, f"{placeholders} <image> placeholders for {len(grids[i])} images", cfg.image_key
                    )
                    continue
                placeholders = row_ids.count(self.video_pad_id)
                if placeholders != len(video_grids[i]):
                    reason = f"{placeholders} <video> placeholders for {len(video_grids[i])} videos"
                    bad[i] = self._error(table, i, reason, cfg.video_key)
                    continue
                extra = sum(grid_tokens(g, self.vision) - 1 for g in grids[i] + video_token_grids[i])
            expanded_lengths[i] = len(model_ids[i]) + extra

        max_len = cfg.max_prompt_length
        if self.vision is not None and not cfg.filter_overlong_prompts and cfg.truncation != "error":
            for i in np.flatnonzero(expanded_lengths > max_len).tolist():
                if self._truncation_cuts_media(model_ids[i], grids[i], video_token_grids[i]):
                    column = cfg.image_key if grids[i] else cfg.video_key
                    reason = (
                        f"truncation={cfg.truncation!r} to max_prompt_length={max_len} cuts into the image / video "
                        f"tokens of a {expanded_lengths[i]}-token prompt: its ids would not match its pixels "
                        "(raise max_prompt_length or set data.filter_overlong_prompts=true)"
                    )
                    bad[i] = self._error(table, i, reason, column)
        if bad and cfg.on_bad_row == "raise":
            raise bad[min(bad)]
        valid = np.ones(n, dtype=bool)
        valid[list(bad)] = False
        overlong = valid & (expanded_lengths > max_len)
        if cfg.filter_overlong_prompts:  # verl's filter measures the prompt with the tool schemas, if any
            measured = expanded_lengths + self._tool_tokens(messages_out, ids, valid)
            keep = valid & (measured <= max_len)
        else:
            keep = valid
        if cfg.truncation == "error":
            over = np.flatnonzero(keep & overlong)
            if over.size:
                i = int(over[0])
                raise self._error(
                    table,
                    i,
                    f"prompt is {expanded_lengths[i]} tokens, longer than max_prompt_length={max_len} with "
                    "truncation='error' (set data.truncation to left/right/middle or "
                    "data.filter_overlong_prompts=true)",
                )
        counts, quarantine, kept = self._account(table, bad, valid, keep, expanded_lengths)
        if self.count_only:
            rows = self._counted(table, kept, media_bytes, expanded_lengths, video_plans)
            return StageResult(rows, counts, quarantine)
        if len(kept) != n:
            # take only what the output keeps: the nested prompt / media columns are the costly ones to copy
            unused = {cfg.image_key, cfg.video_key} if self.vision is not None else set()
            if has_media or not cfg.return_raw_chat:
                unused.add(cfg.prompt_key)
            table = table.drop_columns([c for c in table.column_names if c in unused]).take(kept)
        rows = self._rows(
            table,
            [ids[i] for i in kept],
            [model_ids[i] for i in kept],
            [texts[i] for i in kept],
            [messages_out[i] for i in kept],
            [media_bytes[i] for i in kept],
            [grids[i] for i in kept],
            [video_plans[i] for i in kept],
            [video_grids[i] for i in kept],
            [video_token_grids[i] for i in kept],
            has_media,
            expanded_lengths[kept],
        )
        return StageResult(rows, counts, quarantine)

    def _timestamped_ids(
        self, texts: list[str], ids: list[list[int]], video_plans: list, video_grids: list, bad: dict
    ) -> tuple[list[list[int]], list[list[tuple[int, int, int]]]]:
        """The ids the processor tokenizes before pad expansion, and the grids their video pads expand by.

        Without Qwen3-VL videos these are ``ids`` and ``video_grids``. A Qwen3-VL video is written out per temporal
        patch (``<t seconds>``, vision start, one pad, vision end; its processor's text), so its pads expand by
        (1, h, w) grids, one per temporal patch: verl 0.6's Qwen3-VL rope index splits the grids the same way."""
        rows = [i for i, plans in enumerate(video_plans) if plans and i not in bad] if self.timestamps_videos else []
        if not rows:
            return ids, video_grids
        model_ids, token_grids = list(ids), list(video_grids)
        written = []
        for i in rows:
            metadata = [p.metadata for p in video_plans[i]]
            written.append(timestamped_video_text(texts[i], video_grids[i], metadata, self.vision))
            token_grids[i] = [(1, h, w) for t, h, w in video_grids[i] for _ in range(t)]
        for i, row_ids in zip(rows, self.tokenizer.encode_batch(written), strict=True):
            model_ids[i] = row_ids
        return model_ids, token_grids

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

    def _account(self, table: pa.Table, bad: dict, valid, keep, lengths) -> tuple[BatchCounts, list, np.ndarray]:
        """A batch's counts, quarantine records and kept row positions. On the processor path the decode stage counts
        the rows out and their tokens (it may still drop a row)."""
        counts = BatchCounts(rows_in=table.num_rows, quarantined=len(bad), filtered_overlong=int((valid & ~keep).sum()))
        quarantine = [quarantine_record(err, input_row(table, i)) for i, err in sorted(bad.items())]
        kept = np.flatnonzero(keep)
        if self.vision is None:
            counts.rows_out = len(kept)
            counts.prompt_tokens = int(lengths[kept].sum())
        return counts, quarantine, kept

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

    def _tool_tokens(self, messages: list, ids: list[list[int]], valid: np.ndarray) -> np.ndarray:
        """What the tool schemas (``tool_config_path``) add to each valid prompt where verl's filter measures it: the
        prompt rendered with ``tools=`` and encoded, less its ids without them. Zeros without tools."""
        extra = np.zeros(len(ids), dtype=np.int64)
        if not self.filter_tools:
            return extra
        rows = np.flatnonzero(valid).tolist()
        texts = [self.tokenizer.render(messages[i], **self.filter_template_kwargs) for i in rows]
        for i, with_tools in zip(rows, self.tokenizer.encode_batch(texts), strict=True):
            extra[i] = len(with_tools) - len(ids[i])
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

    def _rows(
        self,
        table,
        ids,
        model_ids,
        texts,
        messages,
        media_bytes,
        grids,
        video_plans,
        video_grids,
        video_token_grids,
        has_media,
        prompt_tokens,
    ) -> pa.Table:
        cfg = self.config
        raw_prompt_ids = [truncate(x, cfg.max_prompt_length, cfg.truncation) for x in ids]
        tensors: dict[str, pa.Array] = {}
        if self.vision is None:  # compact: the collate pads (rowformat.COMPACT_TEXT_COLUMNS)
            n = len(raw_prompt_ids)
            tensors[MAX_LENGTH_COLUMN] = pa.array(np.full(n, cfg.max_prompt_length, dtype=np.int32))
            tensors[PAD_ID_COLUMN] = pa.array(np.full(n, self.tokenizer.pad_token_id, dtype=np.int64))
        else:
            expanded = [
                truncate(self._expand(x, g, v), cfg.max_prompt_length, cfg.truncation)
                for x, g, v in zip(model_ids, grids, video_token_grids, strict=True)
            ]
            flat, lengths = flatten_ids(expanded)
            input_ids, attention_mask, position_ids = pad_flat(
                flat, lengths, cfg.max_prompt_length, self.tokenizer.pad_token_id
            )
            if self.vision.is_qwen2_vl:
                position_ids = self._rope_positions(input_ids, attention_mask, grids, video_token_grids)
                if cfg.row_format == "verl-0.6":
                    position_ids = with_text_positions(position_ids, attention_mask)
            tensors["input_ids"] = tensor_column(input_ids)
            tensors["attention_mask"] = tensor_column(attention_mask)
            tensors["position_ids"] = tensor_column(position_ids)

        # on the processor path the decode stage still needs the provenance (it names the file and row of bad media)
        keep_provenance = self.keep_provenance or self.vision is not None
        drop = {cfg.prompt_key} | (set() if keep_provenance else set(PROVENANCE_COLUMNS))
        if self.vision is not None:
            drop |= {cfg.image_key, cfg.video_key}
        columns = {name: table.column(name) for name in table.column_names if name not in drop}
        if self.vision is not None:
            columns[MEDIA_BYTES_COLUMN] = pa.array(media_bytes, type=pa.list_(pa.large_binary()))
            columns[IMAGE_GRIDS_COLUMN] = pa.array(grids, type=GRIDS_TYPE)
            plans = [None if p is None else [v.as_record() for v in p] for p in video_plans]
            columns[VIDEO_PLANS_COLUMN] = pa.array(plans, type=pa.list_(VIDEO_PLAN_STRUCT))
            columns[VIDEO_GRIDS_COLUMN] = pa.array(video_grids, type=GRIDS_TYPE)
            columns[PROMPT_TOKENS_COLUMN] = pa.array(np.asarray(prompt_tokens, dtype=np.int64))
        columns.update(tensors)
        columns["raw_prompt_ids"] = list_column(raw_prompt_ids)
        if cfg.return_raw_chat:
            if has_media:  # content lists after the <image> split: JSON keeps their exact keys (no null fields)
                columns["raw_prompt"] = pa.array([json.dumps(m, ensure_ascii=False) for m in messages], pa.string())
            else:
                columns["raw_prompt"] = table.column(cfg.prompt_key)
        if cfg.return_full_prompt:
            columns["full_prompts"] = pa.array(texts, type=pa.string())
        columns.update(extra_info_columns(table))
        return pa.table(columns)

    def _rope_positions(self, input_ids: np.ndarray, attention_mask: np.ndarray, grids, video_grids) -> np.ndarray:
        """(B, 3, M) Qwen2-VL rope position ids, row by row (verl's ``get_rope_index``)."""
        if not len(input_ids):
            return np.zeros((0, 3, input_ids.shape[1]), dtype=np.int64)
        return np.stack(
            [
                rope_position_ids(
                    input_ids[i],
                    attention_mask[i],
                    grids[i],
                    video_grids[i],
                    image_token_id=self.image_pad_id,
                    video_token_id=self.video_pad_id,
                    vision_start_token_id=self.vision_start_id,
                    merge_size=self.vision.merge_size,
                )
                for i in range(len(input_ids))
            ]
        )


def _text_as_binary(dtype: pa.DataType) -> pa.DataType:
    """``dtype`` with every string type replaced by the binary type of the same layout (a cast that never fails)."""
    if pa.types.is_string(dtype):
        return pa.binary()
    if pa.types.is_large_string(dtype):
        return pa.large_binary()
    if pa.types.is_list(dtype):
        return pa.list_(dtype.value_field.with_type(_text_as_binary(dtype.value_type)))
    if pa.types.is_large_list(dtype):
        return pa.large_list(dtype.value_field.with_type(_text_as_binary(dtype.value_type)))
    if pa.types.is_struct(dtype):
        return pa.struct([f.with_type(_text_as_binary(f.type)) for f in dtype])
    return dtype


def _decode_lossy(value):
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if isinstance(value, list):
        return [_decode_lossy(v) for v in value]
    if isinstance(value, dict):
        return {k: _decode_lossy(v) for k, v in value.items()}
    return value


def _lossy_row_dict(table: pa.Table, i: int) -> dict:
    """The row with invalid UTF-8 bytes shown as ``\\xNN`` escapes (columns that read cleanly are as they are)."""
    row = {}
    for name in table.column_names:
        if name in PROVENANCE_COLUMNS:
            continue
        value = table.column(name).slice(i, 1)
        try:
            row[name] = value.to_pylist()[0]
        except Exception:
            try:
                row[name] = _decode_lossy(value.cast(_text_as_binary(value.type)).to_pylist()[0])
            except Exception:
                row[name] = None
    return row
