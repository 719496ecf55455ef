"""Memory (``ingest/memory.py``): ``ReusedBuffers`` never hands out a buffer still held, gives private small-page
memory, and the blocks' packed pixels and the vision stage's patches reuse buffers through it; the actors keep freed
heap for the next block."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest


def test_reused_buffers_never_hand_out_a_buffer_still_held():
    """``ReusedBuffers``: a buffer comes back only once nothing refers to it (Arrow's wrapper, numpy or torch views
    all count); held ones are never handed out again, and a larger request replaces a free smaller one."""
    import torch

    from ingest.memory import ReusedBuffers

    pool = ReusedBuffers(keep=2)
    first = pool.take(1000)
    wrapped = pa.py_buffer(first)
    del first
    second = pool.take(1000)
    tensor = torch.from_numpy(second)
    del second
    third = pool.take(1000)  # both kept buffers are held (Arrow, torch): a new one, not kept
    assert not np.shares_memory(third, np.frombuffer(wrapped, np.uint8)) and not np.shares_memory(third, tensor.numpy())
    del tensor, third
    again = pool.take(800)  # the torch-held one is free again
    assert np.shares_memory(again, pool._buffers[1]) and not np.shares_memory(again, np.frombuffer(wrapped, np.uint8))
    del again, wrapped
    bigger = pool.take(5000)
    assert bigger.size == 5000 and any(np.shares_memory(bigger, b) for b in pool._buffers)
    sizes = []
    sized = ReusedBuffers(allocate=lambda n: sizes.append(n) or np.empty(n, dtype=np.uint8))
    assert sized.take(1000).size == 1000 and sizes == [1250]  # new buffers come from ``allocate``, with slack


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_reused_buffers_are_private_small_page_memory():
    """A new ``ReusedBuffers`` buffer is private anonymous memory advised against transparent huge pages (``nh`` in
    its mapping's VmFlags), where numpy advises huge pages for its own arrays of 4 MB or more."""
    from ingest.memory import ReusedBuffers

    buffer = ReusedBuffers().take(8 << 20)
    buffer[::4096] = 1
    address = buffer.__array_interface__["data"][0]
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms offset dev inode [path]
            start, end = (int(x, 16) for x in head.split("-"))
            mapping = line if start <= address < end else None
        elif mapping and line.startswith("VmFlags:"):
            flags = line.split()[1:]
            break
    assert mapping is not None and mapping.split()[1].endswith("p"), mapping  # private, not shared memory
    assert "nh" in flags and "hg" not in flags


_FREED_HEAP_PROBE = """
import ctypes
from ingest.memory import keep_freed_heap
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]
libc.mallinfo2.restype = MallInfo2
assert keep_freed_heap()
chunks = [libc.malloc(20 << 20) for _ in range(8)]
for chunk in chunks:
    ctypes.memset(chunk, 1, 20 << 20)
for chunk in reversed(chunks):
    libc.free(chunk)
info = libc.mallinfo2()
print(info.hblkhd >> 20, info.fordblks >> 20)
"""


def test_actor_processes_keep_freed_heap_for_the_next_block():
    """With the system pool the actors have glibc serve blocks up to 32 MB from the heap and keep what is freed
    (``keep_freed_heap``): 8 x 20 MB freed stay in the heap for the next block, not mapped and unmapped each time."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FREED_HEAP_PROBE], capture_output=True, text=True, check=True)
    mapped_mb, free_in_heap_mb = (int(v) for v in out.stdout.split())
    assert mapped_mb == 0 and free_in_heap_mb >= 160, out.stdout


_RETURN_HEAP_PROBE = """
import gc
from ingest.memory import keep_freed_heap, return_freed_heap
def rss_mb():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) >> 10
keep_freed_heap()  # as in an actor: without a trim, freed heap stays in the process
held = [bytes(1000) + bytes([i % 256]) for i in range(200_000)]  # 200 MB of allocations glibc serves from the heap
before = rss_mb()
del held
gc.collect()
kept = rss_mb()
assert return_freed_heap()
print(before, kept, rss_mb())
"""


def test_freed_heap_goes_back_to_the_kernel_when_asked():
    """What a stream does once the driver's first-batch tokenizer is gone: the heap pages it freed leave the process."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _RETURN_HEAP_PROBE], capture_output=True, text=True, check=True)
    before, kept, after = (int(v) for v in out.stdout.split())
    assert kept > before - 50 and after < kept - 150, out.stdout


def test_block_buffers_are_reused_once_the_block_is_gone(model_dir):
    """The decode stage's packed pixels and the vision stage's uint8 patches reuse the last block's buffer once that
    block is dropped (Ray has stored it), and never overwrite a block that is still held."""

    from ingest.blocks import PACKED_PIXELS, image_rows_array, rgb_arrays
    from ingest.media.pixels import PATCHES, ImagePixels

    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (56 + 14 * k, 84, 3), dtype=np.uint8) for k in range(4)]
    rows = [[(images[0], {}), (images[1], {})], None, [(images[2], {}), (images[3], {})]]

    def pixel_buffer(array: pa.Array) -> int:
        address = array.values.field("rgb").buffers()[2].address
        assert any(b.ctypes.data <= address < b.ctypes.data + b.size for b in PACKED_PIXELS._buffers)
        return address

    held = image_rows_array(rows)
    other = image_rows_array(rows[::-1])
    assert pixel_buffer(held) != pixel_buffer(other)
    assert all(np.array_equal(a, b) for a, b in zip(rgb_arrays(held)[0] + rgb_arrays(held)[2], images, strict=True))
    address = pixel_buffer(other)
    del other
    assert pixel_buffer(image_rows_array(rows)) == address

    pixels = ImagePixels.from_dir(model_dir)
    kept = np.asarray(pixels.patches(images)[0])  # numpy from ingest.media._resize, else a torch tensor: its memory
    expected = kept.copy()
    later = np.asarray(pixels.patches(images[::-1])[0])
    assert kept.ctypes.data != later.ctypes.data and np.array_equal(kept, expected)
    address = later.ctypes.data
    assert any(b.ctypes.data == address for b in PATCHES._buffers)
    del later
    assert np.asarray(pixels.patches(images)[0]).ctypes.data == address


def test_pooled_image_rows_for_the_scale_bench(tmp_path):
    """``bench scale --images``'s data (``write_geo3k_pool_parquet``): geo3k rows in files of ``rows_per_file`` with
    the HF schema, one image a row and two every 5th, every 7th row's by path, all drawn from a pool of distinct
    images; ``grain`` keeps ``make_image``'s pixel sizes and modes with fewer encoded bytes."""
    import io
    import random

    import pyarrow.parquet as pq
    from PIL import Image

    from tools.samples import IMAGE_KINDS, encode_image, geo3k_schema, make_image, write_geo3k_pool_parquet

    data = write_geo3k_pool_parquet(tmp_path, 23, pool_size=6, rows_per_file=10, row_group_size=4)
    assert [pq.ParquetFile(f).metadata.num_rows for f in data["files"]] == [10, 10, 3]
    assert [pq.ParquetFile(f).metadata.num_row_groups for f in data["files"]] == [3, 3, 1]
    table = pa.concat_tables(pq.read_table(f) for f in data["files"])
    assert table.schema.names == geo3k_schema().names and table.schema.metadata == geo3k_schema().metadata
    rows = table.to_pylist()
    assert [r["extra_info"]["index"] for r in rows] == list(range(23))
    assert [len(r["images"]) for r in rows] == [2 if i % 5 == 4 else 1 for i in range(23)]
    assert all(r["prompt"][0]["content"].count("<image>") == len(r["images"]) for r in rows)
    by_path = [img for i, r in enumerate(rows) for img in r["images"] if i % 7 == 3]
    embedded = [img for i, r in enumerate(rows) for img in r["images"] if i % 7 != 3]
    assert all(img["bytes"] is None and Path(img["path"]).is_file() for img in by_path)
    assert all(img["bytes"] and img["path"] is None for img in embedded)
    encoded = {img["bytes"] for img in embedded} | {Path(img["path"]).read_bytes() for img in by_path}
    assert len(encoded) == 6  # the pool, reused: 27 images in all
    assert (data["rows"], data["images"], data["images_by_path"]) == (23, 27, len(by_path))
    assert data["bytes_on_disk"] == sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    assert {Image.open(io.BytesIO(b)).mode for b in encoded} == {"RGB", "L", "P", "RGBA"}

    for kind in IMAGE_KINDS:
        (fine, fmt), (coarse, _) = make_image(kind, random.Random(1)), make_image(kind, random.Random(1), grain=8)
        assert (coarse.size, coarse.mode) == (fine.size, fine.mode)
        if kind != "tiny":
            assert len(encode_image(coarse, fmt)) < len(encode_image(fine, fmt)) / 2
