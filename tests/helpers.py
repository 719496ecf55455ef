"""Deep, type-strict comparison of verl batches (tensors, numpy object arrays, nested Python values)."""

from __future__ import annotations

import contextlib
import os

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
    assert sum(len(b["input_ids"]) for b in ours) == sum(len(b["input_ids"]) for b in theirs), "row counts differ"
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        assert_same(a, b, f"batch{i}")


@contextlib.contextmanager
def moto_s3():
    """A real S3 endpoint (moto server) on loopback for the block; yields its URL."""
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def write_media_rows(path, rows: list[tuple[str, list]], column: str = "images") -> str:
    """Parquet of (user prompt, media) rows, the media in ``column``, ``extra_info.index`` numbering them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(
        [
            {"prompt": [{"role": "user", "content": text}], column: media, "extra_info": {"index": i}}
            for i, (text, media) in enumerate(rows)
        ]
    )
    pq.write_table(table, path)
    return str(path)
