"""Deep, type-strict comparison of verl batches (tensors, numpy object arrays, nested Python values)."""

from __future__ import annotations

import numpy as np
import torch


def assert_same(ours, theirs, path="batch"):
    assert type(ours) is type(theirs), f"{path}: type {type(ours).__name__} != {type(theirs).__name__}"
    if isinstance(theirs, torch.Tensor):
        assert ours.dtype == theirs.dtype, f"{path}: dtype {ours.dtype} != {theirs.dtype}"
        assert ours.shape == theirs.shape, f"{path}: shape {tuple(ours.shape)} != {tuple(theirs.shape)}"
        assert torch.equal(ours, theirs), f"{path}: values differ"
    elif isinstance(theirs, np.ndarray):
        assert ours.dtype == theirs.dtype, f"{path}: dtype {ours.dtype} != {theirs.dtype}"
        assert ours.shape == theirs.shape, f"{path}: shape {ours.shape} != {theirs.shape}"
        if theirs.dtype != object:  # numbers (video frames): compared whole, not element by element in Python
            assert np.array_equal(ours, theirs, equal_nan=theirs.dtype.kind in "fc"), f"{path}: values differ"
            return
        for idx in np.ndindex(theirs.shape):
            assert_same(ours[idx], theirs[idx], f"{path}{list(idx)}")
    elif isinstance(theirs, dict):
        assert list(ours) == list(theirs), f"{path}: keys {list(ours)} != {list(theirs)}"
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{path}.{key}")
    elif isinstance(theirs, list | tuple):
        assert len(ours) == len(theirs), f"{path}: length {len(ours)} != {len(theirs)}"
        for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
            assert_same(a, b, f"{path}[{i}]")
    else:
        assert ours == theirs, f"{path}: {ours!r} != {theirs!r}"


def assert_same_batches(ours: list, theirs: list):
    def rows(batches: list) -> int:  # every key has one entry per row; the first is a tensor in every verl release
        return sum(len(next(iter(b.values()))) for b in batches)

    assert rows(ours) == rows(theirs), f"row counts differ: {rows(ours)} != {rows(theirs)}"
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        assert_same(a, b, f"batch{i}")
