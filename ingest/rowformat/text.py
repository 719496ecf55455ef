"""The verl 0.5.0 row format, built column-wise: truncation, left padding, position ids, index / kwargs columns.

Functions here take and return numpy / Arrow data for a whole batch at once; their results equal what verl's
``postprocess_data`` / ``compute_position_id_with_mask`` / ``__getitem__`` compute one row at a time.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

TENSOR_COLUMNS = ("input_ids", "attention_mask", "position_ids")


def truncate(ids: Sequence[int], max_length: int, mode: str) -> Sequence[int]:
    """verl's truncation of a token list longer than ``max_length`` (``error`` is the caller's business)."""
    if len(ids) <= max_length:
        return ids
    if mode == "left":
        return ids[-max_length:]
    if mode == "right":
        return ids[:max_length]
    if mode == "middle":
        left = max_length // 2
        return list(ids[:left]) + list(ids[-(max_length - left) :])
    raise ValueError(f"cannot truncate with mode {mode!r}")


def flatten_ids(id_lists: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(flat int64 values, int64 lengths) of a batch of token lists."""
    lengths = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
    flat = np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int64, count=int(lengths.sum()))
    return flat, lengths


def pad_flat(flat: np.ndarray, lengths: np.ndarray, max_length: int, pad_token_id: int) -> tuple[np.ndarray, ...]:
    """Left-padded ``(input_ids, attention_mask, position_ids)``, int64 (B, M), from flat ids + lengths.

    ``position_ids`` is verl's ``compute_position_id_with_mask`` (clip(cumsum(mask) - 1, 0)) in closed form: with left
    padding the first real token of a row sits at ``M - length``.
    """
    start = max_length - np.asarray(lengths, dtype=np.int64)
    columns = np.arange(max_length, dtype=np.int64)
    mask = columns[None, :] >= start[:, None]
    input_ids = np.full((len(start), max_length), pad_token_id, dtype=np.int64)
    input_ids[mask] = flat  # row-major order fills each row's tail in sequence
    position_ids = np.maximum(columns[None, :] - start[:, None], 0)
    return input_ids, mask.astype(np.int64), position_ids


def tensor_column(array: np.ndarray) -> pa.Array:
    """A fixed-shape tensor column (Ray's tensor extension) from a (B, ...) array."""
    from ray.data.extensions import ArrowTensorArray

    return ArrowTensorArray.from_numpy(np.ascontiguousarray(array))


def list_column(id_lists: Sequence[Sequence[int]]) -> pa.Array:
    """A ``list<int64>`` column built from flat values + offsets (no per-row Python objects in the block)."""
    flat, lengths = flatten_ids(id_lists)
    offsets = np.zeros(len(id_lists) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))


def extra_info_columns(table: pa.Table) -> dict[str, pa.Array]:
    """``index`` / ``tools_kwargs`` / ``interaction_kwargs`` from ``extra_info`` as verl reads them.

    verl: ``row["extra_info"].get(key, default)`` on the dict HF datasets builds, where a struct field that exists in
    the schema but not in the row is None (not the default). A field absent from the schema gives the default
    (0 / ``{}``). A row whose whole ``extra_info`` is null crashes verl 0.5.0; here it gets the defaults.
    """
    n = table.num_rows
    extra = table.column("extra_info").combine_chunks() if "extra_info" in table.column_names else None
    struct_type = extra.type if extra is not None and pa.types.is_struct(extra.type) else None
    out: dict[str, pa.Array] = {}
    for key, default in (("index", 0), ("tools_kwargs", {}), ("interaction_kwargs", {})):
        if struct_type is not None and struct_type.get_field_index(key) >= 0:
            child = pc.struct_field(extra, key)
            if extra.null_count:
                fill = pa.array([default] * n, type=child.type) if key == "index" else _empty_like(child.type, n)
                child = pc.if_else(extra.is_valid(), child, fill)
            out[key] = child
        elif key == "index":
            out[key] = pa.array(np.zeros(n, dtype=np.int64))
        else:
            out[key] = pa.array([{}] * n, type=pa.struct([]))
    return out


def _empty_like(type_: pa.DataType, n: int) -> pa.Array:
    """Rows standing for ``{}`` in a struct-typed kwargs column (every field null)."""
    if pa.types.is_struct(type_):
        return pa.array([{}] * n, type=type_)
    return pa.nulls(n, type_)
