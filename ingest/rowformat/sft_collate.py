"""``SFTCollate`` and ``PrimeRLCollate``: rows of ``build_sft_dataset`` -> torch tensors per batch (padded samples;
prime-rl's packed micro batches)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
from ray.data.collate_fn import ArrowBatchCollateFn

from ingest.blocks import contiguous, tensor_from_record

MEDIA_TENSOR_COLUMNS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


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


class PrimeRLCollate(ArrowBatchCollateFn):
    """``iter_torch_batches(batch_size=1, collate_fn=PrimeRLCollate(seq_len))``: one packed row -> the micro batch
    prime-rl's SFT trainer reads (its ``CatDataset`` pack finalized and ``cat_collate``d).

    ``input_ids`` / ``target_ids`` / ``position_ids`` (1, T) long and ``loss_mask`` (1, T) bool, right-padded to
    ``seq_len`` (None: no padding) with 0, 0, ``range(pad)`` and False; ``seq_lens`` (K,) long, the packed samples
    with the padding added to the last one (how prime-rl's varlen attention sees it); ``mm_kwargs``: the row's
    ``pixel_values`` / ``image_grid_thw`` (and video ones) or None; ``mm_token_type_ids`` (1, T) long, 0 on text
    members and padding, or None when the row has no media. Rows are packed with ``sft_pack_token_budget`` (=
    prime-rl's ``seq_len * micro_batch_size``); packing stays within one render-actor batch, where prime-rl's packs
    run across the whole stream.
    """

    def __init__(self, seq_len: int | None = None, device: str | None = None):
        super().__init__()
        self.seq_len = seq_len
        self.device = device

    def __call__(self, batch: pa.Table) -> dict:
        import torch

        if batch.num_rows != 1:
            raise ValueError(f"prime-rl's micro batch is one packed row: use batch_size=1, got {batch.num_rows} rows")
        ids = _flat(batch.column("input_ids"))[0].astype(np.int64)
        seq_lens = _flat(batch.column("seq_lens"))[0].astype(np.int64)
        n = len(ids)
        pad = 0 if self.seq_len is None else self.seq_len - n
        if pad < 0:
            raise ValueError(f"a row of {n} tokens does not fit seq_len={self.seq_len}")
        positions = np.arange(n, dtype=np.int64) - np.repeat(np.cumsum(seq_lens) - seq_lens, seq_lens)
        if pad:
            seq_lens = seq_lens.copy()
            seq_lens[-1] += pad

        def row(values: np.ndarray, fill, dtype, tail: np.ndarray | None = None) -> torch.Tensor:
            out = np.concatenate([values.astype(dtype), tail if tail is not None else np.full(pad, fill, dtype)])
            return torch.from_numpy(out).unsqueeze(0)

        out: dict[str, Any] = {
            "input_ids": row(ids, 0, np.int64),
            "position_ids": row(positions, 0, np.int64, np.arange(pad, dtype=np.int64)),
            "loss_mask": row(_flat(batch.column("loss_mask"))[0], False, np.bool_),
            "target_ids": row(_flat(batch.column("target_ids"))[0], 0, np.int64),
            "seq_lens": torch.from_numpy(seq_lens),
            "mm_kwargs": None,
            "mm_token_type_ids": None,
        }
        media = {}
        for key in MEDIA_TENSOR_COLUMNS:
            if key in batch.column_names and (record := batch.column(key)[0].as_py()) is not None:
                media[key] = torch.from_numpy(tensor_from_record(record))
        if media:
            out["mm_kwargs"] = media
            # prime-rl's packs carry mm_token_type_ids only once a member has media: a row whose images were all
            # cut off by the sequence limit has all-zero types here, and None there
            out["mm_token_type_ids"] = row(_flat(batch.column("mm_token_type_ids"))[0], 0, np.int64)
        if self.device is not None:
            for key, value in out.items():
                if isinstance(value, torch.Tensor):
                    out[key] = value.to(self.device)
                elif value is not None:
                    out[key] = {name: tensor.to(self.device) for name, tensor in value.items()}
        return out
