"""``build_sft_dataset``: Parquet conversations -> read units -> SFT render actor pool (-> vision actor pool) -> rows
of shifted, truncated, optionally packed training samples; ``SFTCollate`` pads them into torch tensors per batch.

The read side is the RL pipeline's (``plan_input``, ``ParquetUnitsDatasource``, provenance columns, the read fused
into the first actor pool); the stages are in ``ingest.stages.sft``. See docs/sft.md.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import ray
from ray.data.collate_fn import ArrowBatchCollateFn

from ingest.blocks import contiguous, tensor_from_record
from ingest.config import DataConfig
from ingest.datasets.plan import FilesArg, InputPlan, check_model_path, plan_input
from ingest.datasets.pools import actor_kwargs, map_on_pool, read_units_into_pool
from ingest.errors import SourceError
from ingest.read.files import _describe

MEDIA_TENSOR_COLUMNS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def check_sft_config(cfg: DataConfig) -> None:
    if cfg.sft_max_length is not None and int(cfg.sft_max_length) < 1:
        raise ValueError(f"sft_max_length must be >= 1 or null, got {cfg.sft_max_length}")
    if cfg.vision_pool_max_size == 0:
        raise ValueError("vision_pool_max_size: 0 (vision in the actors before it) is build_dataset's; SFT needs >= 1")
    if int(cfg.sft_pack_token_budget) < 0:
        raise ValueError(f"sft_pack_token_budget must be >= 0 (0: no packing), got {cfg.sft_pack_token_budget}")


def plan_sft_input(files: FilesArg, cfg: DataConfig, *, epoch: int = 0, multimodal: bool = False) -> InputPlan:
    """``plan_input`` for conversations: every file needs the messages column, or the prompt + completion columns."""
    try:
        return plan_input(files, dataclasses.replace(cfg, prompt_key=cfg.sft_messages_key), epoch=epoch,
                          multimodal=multimodal)  # fmt: skip
    except SourceError as exc:
        if exc.column != cfg.sft_messages_key:
            raise
    wanted = f"no {cfg.sft_messages_key!r} column and no {cfg.prompt_key!r} + {cfg.sft_completion_key!r} columns"
    try:
        plan = plan_input(files, cfg, epoch=epoch, multimodal=multimodal)
    except SourceError as exc:
        if exc.column != cfg.prompt_key:
            raise
        raise SourceError(f"{wanted} (set data.sft_messages_key)", file=exc.file, column=cfg.sft_messages_key) from None
    for info in plan.infos:
        if cfg.sft_completion_key not in info.schema.names:
            raise SourceError(
                f"{wanted} (columns: {', '.join(info.schema.names)})",
                file=_describe(info.path),
                column=cfg.sft_completion_key,
            )
    return plan


def build_sft_dataset(
    files: FilesArg,
    tokenizer: str | os.PathLike | None,
    config: DataConfig | Mapping[str, Any] | None = None,
    processor: str | os.PathLike | None = None,
    *,
    epoch: int = 0,
    ledger=None,
    plan: InputPlan | None = None,
    role_to_mask: Callable[[Mapping[str, Any]], bool] | None = None,
) -> ray.data.Dataset:
    """A Ray Dataset of SFT training rows for the conversations in ``files``.

    Input columns: ``messages`` (``sft_messages_key``: a message list, or its JSON string), else ``prompt`` +
    ``completion`` (message lists, or strings: one user / one assistant message); optional ``tools`` (list or JSON
    string), ``images`` (values for ``{"type": "image"}`` parts, or for ``<image>`` markers in string content:
    HF ``Image()`` structs, bytes or paths) and ``videos`` (frame lists).

    Output rows (Arrow, no Python objects): ``input_ids``, ``target_ids`` (the next token), ``loss_mask`` (aligned
    with ``target_ids``), ``seq_lens`` (the samples in the row; one entry unless ``sft_pack_token_budget`` > 0)
    and, with a ``processor``, ``mm_token_type_ids`` (null for text rows), ``image_placeholders`` /
    ``image_hashes`` / ``pixel_values`` / ``image_grid_thw``, the same for videos, and ``dropped_media`` (items cut
    off by ``sft_max_length``). ``SFTCollate`` turns batches into padded torch tensors.

    ``tokenizer`` / ``processor``: as ``build_dataset`` (a directory, hub name, None = the embedded Qwen2-VL
    tokenizer). ``role_to_mask``: the ``build_training_sample`` predicate (picklable; required for non-ChatML
    templates). ``ledger``: a ``RunLedger`` that receives per-batch counts (rows in = samples out + filtered +
    quarantined). Bad conversations are quarantined (``on_bad_row: quarantine``) or raise ``BadRowError``.
    """
    cfg = DataConfig.from_any(config)
    check_sft_config(cfg)
    check_model_path(tokenizer)
    if processor is not None:
        check_model_path(processor, "processor")
    plan = plan or plan_sft_input(files, cfg, epoch=epoch, multimodal=processor is not None)
    from actors import SFTRenderActor, SFTVisionActor

    context = plan.context(ledger)
    render = {**actor_kwargs(cfg, context, tokenizer=tokenizer, processor=processor), "role_to_mask": role_to_mask}
    # one read unit per call; the actor batches (and packs) by tokenizer_batch_size
    ds = read_units_into_pool(plan, cfg, context, SFTRenderActor, render, epoch=epoch)
    if processor is None:
        return ds
    return map_on_pool(ds, cfg, "vision", SFTVisionActor, actor_kwargs(cfg, context, processor=processor))


def _flat(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(flat values, per-row lengths, per-row validity) of a list column (slices and nulls handled)."""
    array = contiguous(column)
    valid = np.asarray(array.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    lengths = np.asarray(array.value_lengths().fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
    return array.flatten().to_numpy(zero_copy_only=False), lengths, valid


class SFTCollate(ArrowBatchCollateFn):
    """``iter_torch_batches(collate_fn=SFTCollate())``: rows of ``build_sft_dataset`` -> a dict of torch tensors.

    Right-padded to the batch's longest row (``pad_to``: a fixed length, an error when a row is longer;
    ``pad_to_multiple_of``: round up). ``input_ids`` (B, T) long padded with ``pad_token_id``; ``target_ids``
    padded with ``ignore_index``; ``loss_mask`` (B, T) bool, False on padding; ``attention_mask`` (B, T) long;
    ``position_ids`` (B, T) long, restarting at 0 for every packed sample (0 on padding); ``seq_lens`` (B, K) long,
    the samples per row, zero-padded. With a processor: ``mm_token_type_ids`` (B, T) long (0 for text rows),
    ``pixel_values`` / ``image_grid_thw`` (and the video ones) concatenated over the batch's rows in order, present
    when the batch has such media.
    """

    def __init__(
        self,
        pad_token_id: int = 0,
        ignore_index: int = -100,
        pad_to: int | None = None,
        pad_to_multiple_of: int | None = None,
        device: str | None = None,
    ):
        super().__init__()
        self.pad_token_id = pad_token_id
        self.ignore_index = ignore_index
        self.pad_to = pad_to
        self.pad_to_multiple_of = pad_to_multiple_of
        self.device = device

    def __call__(self, batch: pa.Table) -> dict:
        import torch

        ids, lengths, _ = _flat(batch.column("input_ids"))
        n = batch.num_rows
        width = int(lengths.max()) if n else 0
        if self.pad_to is not None:
            if width > self.pad_to:
                raise ValueError(f"a row of {width} tokens does not fit pad_to={self.pad_to}")
            width = self.pad_to
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        real = np.arange(width)[None, :] < lengths[:, None]

        def padded(values: np.ndarray, fill, dtype, where=real) -> np.ndarray:
            out = np.full((n, width), fill, dtype=dtype)
            out[where] = values
            return out

        seq_lens, members, _ = _flat(batch.column("seq_lens"))
        starts = np.cumsum(seq_lens) - seq_lens
        positions = np.arange(int(seq_lens.sum()), dtype=np.int64) - np.repeat(starts, seq_lens)
        seq_table = np.zeros((n, int(members.max()) if n else 0), dtype=np.int64)
        seq_table[np.arange(seq_table.shape[1])[None, :] < members[:, None]] = seq_lens
        out = {
            "input_ids": padded(ids, self.pad_token_id, np.int64),
            "target_ids": padded(_flat(batch.column("target_ids"))[0], self.ignore_index, np.int64),
            "loss_mask": padded(_flat(batch.column("loss_mask"))[0], False, np.bool_),
            "attention_mask": real.astype(np.int64),
            "position_ids": padded(positions, 0, np.int64),
            "seq_lens": seq_table,
        }
        if "mm_token_type_ids" in batch.column_names:
            types, _, valid = _flat(batch.column("mm_token_type_ids"))
            out["mm_token_type_ids"] = padded(types, 0, np.int64, real & valid[:, None])
        tensors = {k: torch.from_numpy(v) for k, v in out.items()}
        for key in MEDIA_TENSOR_COLUMNS:
            if key in batch.column_names:
                records = [r for r in batch.column(key).to_pylist() if r is not None]
                if records:
                    tensors[key] = torch.from_numpy(np.concatenate([tensor_from_record(r) for r in records]))
        if self.device is not None:
            tensors = {k: v.to(self.device) for k, v in tensors.items()}
        return tensors
