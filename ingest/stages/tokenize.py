"""Prompt tokenization: chat template, one batched encode, truncation, left padding, position ids, overlong filter.

One encode per prompt gives everything verl computes with three (the filter's ``apply_chat_template(tokenize=True)``,
``__getitem__``'s ``tokenizer(raw_prompt)`` and ``tokenizer.encode(raw_prompt)``): on the text path they are the
same ids. Overlong rows are dropped here, in-stream, from the lengths just computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from ingest.config import DataConfig
from ingest.errors import BadRowError
from ingest.messages import build_messages, validate_messages
from ingest.models import ChatTokenizer
from ingest.read import FILE_COLUMN, PROVENANCE_COLUMNS, ROW_COLUMN
from ingest.rowformat import (
    extra_info_columns,
    left_pad,
    list_column,
    tensor_column,
    text_position_ids,
    truncate,
)


@dataclass
class BatchCounts:
    rows_in: int = 0
    rows_out: int = 0
    filtered_overlong: int = 0
    quarantined: int = 0
    prompt_tokens: int = 0  # tokens of the kept prompts, before truncation

    def add(self, other: BatchCounts) -> None:
        for key, value in vars(other).items():
            setattr(self, key, getattr(self, key) + value)


class PromptTokenizeStage:
    """Arrow batch of raw rows (with provenance columns) -> Arrow batch of verl rows (text path)."""

    def __init__(self, tokenizer: ChatTokenizer, config: DataConfig, files: Sequence[str], keep_provenance=False):
        self.tokenizer = tokenizer
        self.config = config
        self.files = list(files)
        self.keep_provenance = keep_provenance
        if tokenizer.pad_token_id is None:
            raise BadRowError(f"tokenizer {tokenizer.path!r} has neither a pad nor an eos token")

    def _where(self, table: pa.Table, i: int) -> dict:
        return {
            "file": self.files[table.column(FILE_COLUMN)[i].as_py()],
            "row": table.column(ROW_COLUMN)[i].as_py(),
            "column": self.config.prompt_key,
        }

    def __call__(self, table: pa.Table) -> tuple[pa.Table, BatchCounts]:
        cfg = self.config
        if cfg.prompt_key not in table.column_names:
            raise BadRowError(f"no prompt column (columns: {', '.join(table.column_names)})", **self._where(table, 0))
        has_media = cfg.image_key in table.column_names or cfg.video_key in table.column_names
        prompts = table.column(cfg.prompt_key).to_pylist()
        texts = []
        for i, messages in enumerate(prompts):
            problem = validate_messages(messages)
            if problem is not None:
                raise BadRowError(problem, **self._where(table, i))
            try:
                texts.append(self.tokenizer.render(build_messages(messages, has_media_column=has_media)))
            except Exception as exc:
                raise BadRowError(
                    f"chat template failed: {type(exc).__name__}: {exc}", **self._where(table, i)
                ) from None
        ids = self.tokenizer.encode_batch(texts)
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        max_len = cfg.max_prompt_length

        keep = lengths <= max_len if cfg.filter_overlong_prompts else np.ones(len(ids), dtype=bool)
        if cfg.truncation == "error":
            over = np.flatnonzero(keep & (lengths > max_len))
            if over.size:
                i = int(over[0])
                raise BadRowError(
                    f"prompt is {lengths[i]} tokens, longer than max_prompt_length={max_len} with truncation='error' "
                    "(set data.truncation to left/right/middle or data.filter_overlong_prompts=true)",
                    **self._where(table, i),
                )
        counts = BatchCounts(rows_in=table.num_rows, filtered_overlong=int((~keep).sum()))
        if not keep.all():
            kept = np.flatnonzero(keep)
            table = table.take(kept)
            ids = [ids[i] for i in kept]
            texts = [texts[i] for i in kept]
            lengths = lengths[kept]
        counts.rows_out = table.num_rows
        counts.prompt_tokens = int(lengths.sum())
        return self._rows(table, ids, texts), counts

    def _rows(self, table: pa.Table, ids: list[list[int]], texts: list[str]) -> pa.Table:
        cfg = self.config
        truncated = [truncate(x, cfg.max_prompt_length, cfg.truncation) for x in ids]
        input_ids, attention_mask = left_pad(truncated, cfg.max_prompt_length, self.tokenizer.pad_token_id)
        position_ids = text_position_ids(attention_mask)

        drop = {cfg.prompt_key} | (set() if self.keep_provenance else set(PROVENANCE_COLUMNS))
        columns = {name: table.column(name) for name in table.column_names if name not in drop}
        columns["input_ids"] = tensor_column(input_ids)
        columns["attention_mask"] = tensor_column(attention_mask)
        columns["position_ids"] = tensor_column(position_ids)
        columns["raw_prompt_ids"] = list_column(truncated)
        if cfg.return_raw_chat:
            columns["raw_prompt"] = table.column(cfg.prompt_key)
        if cfg.return_full_prompt:
            columns["full_prompts"] = pa.array(texts, type=pa.string())
        columns.update(extra_info_columns(table))
        return pa.table(columns)
