"""Pipeline behaviour: order, seeded shuffle, Arrow-native blocks, in-stream filter accounting, read units, config."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from ingest import DataConfig, VerlCollate, build_dataset
from ingest.blocks import FILE_COLUMN, ROW_COLUMN
from ingest.read.files import inspect_files
from ingest.read.units import plan_units, read_unit, split_first_unit
from ingest.stats import RunLedger
from tests.conftest import collect

BASE = {"truncation": "left", "shuffle": False}
OVERLONG = {i for i in range(210) if i % 23 == 22}  # variety_files: every 23rd prompt is overlong


def _indices(batches):
    return [int(i) for b in batches for i in b["index"]]


def test_input_order_minus_filtered_and_counts(ray_session, variety_files, model_dir):
    ledger = RunLedger.remote()
    batches = collect(build_dataset(variety_files, model_dir, BASE, ledger=ledger))
    assert _indices(batches) == [i for i in range(210) if i not in OVERLONG]
    counts = ray.get(ledger.get.remote())
    assert counts["rows_in"] == 210 and counts["filtered_overlong"] == len(OVERLONG)
    assert counts["rows_in"] == counts["rows_out"] + counts["filtered_overlong"] + counts["quarantined"]


def test_filter_off_keeps_everything(ray_session, variety_files, model_dir):
    batches = collect(build_dataset(variety_files, model_dir, {**BASE, "filter_overlong_prompts": False}))
    assert _indices(batches) == list(range(210))


def test_seeded_shuffle_is_reproducible(ray_session, variety_files, model_dir):
    def order(seed, epoch=0):
        cfg = {**BASE, "shuffle": True, "seed": seed, "read_rows_per_task": 50}
        return _indices(collect(build_dataset(variety_files, model_dir, cfg, epoch=epoch)))

    first = order(7)
    assert first == order(7)
    assert first != order(8) and first != order(7, epoch=1)
    assert sorted(first) == [i for i in range(210) if i not in OVERLONG]
    assert first != sorted(first)


def test_blocks_are_arrow_native(ray_session, variety_files, model_dir):
    from ray.data.extensions import ArrowPythonObjectType

    ds = build_dataset(variety_files, model_dir, {**BASE, "return_raw_chat": True, "return_full_prompt": True})
    batch = ds.take_batch(8, batch_format="pyarrow")
    assert not any(isinstance(f.type, ArrowPythonObjectType) for f in batch.schema), batch.schema
    assert pa.types.is_list(batch.schema.field("raw_prompt_ids").type)
    assert FILE_COLUMN not in batch.column_names and ROW_COLUMN not in batch.column_names

    # text blocks are compact: ids once, unpadded; the collate pads them (rowformat.COMPACT_TEXT_COLUMNS)
    assert not {"input_ids", "attention_mask", "position_ids"} & set(batch.column_names)
    assert batch.nbytes / batch.num_rows < 4096, batch.nbytes / batch.num_rows  # padded int64 x3 would be 24 KiB


def test_pad_flat_matches_verls_padding_and_positions():
    from ingest.rowformat.text import flatten_ids, pad_flat

    rows = [[5, 6, 7], [], [1, 2, 3, 4, 5, 6], [9]]
    input_ids, mask, positions = pad_flat(*flatten_ids(rows), 6, 0)
    for ids, row, row_mask, row_positions in zip(rows, input_ids, mask, positions, strict=True):
        expected_mask = [0] * (6 - len(ids)) + [1] * len(ids)
        assert row.tolist() == [0] * (6 - len(ids)) + ids and row_mask.tolist() == expected_mask
        # verl's compute_position_id_with_mask
        assert row_positions.tolist() == np.clip(np.cumsum(expected_mask) - 1, 0, None).tolist()
    assert input_ids.dtype == mask.dtype == positions.dtype == np.int64


def test_read_runs_inside_the_tokenizer_actors(ray_session, variety_files, model_dir):
    # the first-batch latency depends on this fusion: no separate read worker starts before the first batch
    ds = build_dataset(variety_files, model_dir, BASE)
    ds.take_batch(8)
    assert "ReadParquetUnits->MapBatches(TokenizeActor)" in ds.stats(), ds.stats()


def test_units_split_a_big_row_group_exactly(tmp_path):
    table = pa.table({"prompt": [[{"role": "user", "content": str(i)}] for i in range(5000)], "i": range(5000)})
    pq.write_table(table, tmp_path / "big.parquet", row_group_size=5000)
    pq.write_table(table.slice(0, 900), tmp_path / "small.parquet", row_group_size=300)
    infos = inspect_files([str(tmp_path / "big.parquet"), str(tmp_path / "small.parquet")])
    units = plan_units(infos, rows_per_task=1000)
    assert [u.num_rows for u in units] == [1000] * 5 + [900]
    schema = infos[0].schema
    rows = [
        (t.column(FILE_COLUMN)[k].as_py(), t.column(ROW_COLUMN)[k].as_py(), t.column("i")[k].as_py())
        for u in units
        for t in [read_unit(u, infos[u.file_index].path, schema, {}, None)]
        for k in range(t.num_rows)
    ]
    assert [(f, r) for f, r, _ in rows] == [(0, r) for r in range(5000)] + [(1, r) for r in range(900)]
    assert all(r == i for _, r, i in rows)
    # two small units cut off the first in read order (the first batch waits for both), the rest read exactly once
    ramped = split_first_unit(units, 128)
    assert [u.num_rows for u in ramped] == [128, 128, 744] + [1000] * 4 + [900]
    rows = [
        t.column(ROW_COLUMN)[k].as_py()
        for u in ramped[:3]
        for t in [read_unit(u, infos[u.file_index].path, schema, {}, None)]
        for k in range(t.num_rows)
    ]
    assert rows == list(range(1000))
    assert split_first_unit(units, 0) == units and split_first_unit(units, 5000) == units
    assert [u.num_rows for u in split_first_unit(units, 600)] == [600, 400] + [1000] * 4 + [900]


def test_config_accepts_dict_dictconfig_and_verl_keys():
    from omegaconf import OmegaConf

    verl_data = OmegaConf.create(
        {
            "train_files": "~/data/gsm8k/train.parquet",
            "prompt_key": "prompt",
            "max_prompt_length": 512,
            "max_response_length": 1024,
            "train_batch_size": 1024,
            "truncation": "left",
            "filter_overlong_prompts": True,
            "return_raw_chat": "${data.flag}" if False else True,
            "custom_cls": {"path": None, "name": None},
        }
    )
    cfg = DataConfig.from_any(verl_data)
    assert (cfg.max_prompt_length, cfg.truncation, cfg.return_raw_chat) == (512, "left", True)
    assert DataConfig.from_any({"max_prompt_length": 64}).max_prompt_length == 64
    defaults = DataConfig()
    assert (defaults.truncation, defaults.max_prompt_length, defaults.filter_overlong_prompts) == ("error", 1024, True)
    assert (defaults.image_key, defaults.video_key, defaults.return_multi_modal_inputs) == ("images", "videos", True)
    with pytest.raises(ValueError, match="truncation"):
        DataConfig.from_any({"truncation": "sideways"})
    assert DataConfig(decode_pool_max_size=0).decode_pool_max_size == 0  # no decode pool: tokenizer actors decode
    assert DataConfig(vision_pool_max_size=0).vision_pool_max_size == 0  # no vision pool: the actors before it
    with pytest.raises(ValueError, match="tokenizer_pool_min_size"):
        DataConfig(tokenizer_pool_max_size=0)
    for pool in ("decode", "vision"):
        with pytest.raises(ValueError, match=f"{pool}_pool_min_size"):
            DataConfig(**{f"{pool}_pool_max_size": -1})
    with pytest.raises(ValueError, match="need a vision pool"):
        DataConfig(vision_pool_max_size=0, vision_num_gpus=0.5)
    assert DataConfig(vision_decode_video_on_device=True, vision_video_decoder="torchcodec").vision_video_decoder
    with pytest.raises(ValueError, match="vision_video_decoder must be one of"):
        DataConfig(vision_decode_video_on_device=True, vision_video_decoder="decord")
    with pytest.raises(ValueError, match="only decodes video files with vision_decode_video_on_device: true"):
        DataConfig(vision_video_decoder="pyav")


def test_collate_defaults_and_one_dimensional_arrays():
    table = pa.table({"raw_prompt_ids": [[1, 2], [3, 4]], "data_source": ["a", "b"]})
    verl_style = VerlCollate()(table)
    assert verl_style["raw_prompt_ids"].shape == (2, 2)  # verl 0.5.0: np.array(values, dtype=object)
    flat = VerlCollate(one_dimensional=True)(table)
    assert flat["raw_prompt_ids"].shape == (2,) and flat["raw_prompt_ids"][0] == [1, 2]
    assert list(verl_style["index"]) == [0, 0] and list(verl_style["tools_kwargs"]) == [{}, {}]
    assert verl_style["tools_kwargs"][0] is not verl_style["tools_kwargs"][1]
    assert isinstance(verl_style["data_source"], np.ndarray) and verl_style["data_source"].dtype == object


_IMPORT_PROBE = """
import sys
import actors.vision
heavy = [m for m in ("jinja2", "ingest.datasets.rl", "ingest.sft", "actors.sft", "actors.tokenize") if m in sys.modules]
import actors, ingest
assert ingest.build_dataset.__module__ == "ingest.datasets.rl"
assert actors.TokenizeActor.__name__ == "TokenizeActor"
try:
    ingest.no_such_name
    heavy.append("no AttributeError")
except AttributeError:
    pass
print(heavy)
"""


@ray.remote(max_calls=1)  # a new worker process each call: the pool setting is per process
def _arrow_pool_in_a_new_actor(actor: str, config: DataConfig, model_dir: str) -> tuple[str, str]:
    import pyarrow as pa

    from actors import DecodeActor, TokenizeActor
    from ingest.config import StageContext

    before = pa.default_memory_pool().backend_name
    if actor == "tokenize":
        TokenizeActor(config, StageContext(), model_dir, model_dir)
    else:
        DecodeActor(config, StageContext(), model_dir)
    return before, pa.default_memory_pool().backend_name


@pytest.mark.parametrize("actor", ["tokenize", "decode"])
def test_actors_set_the_configured_arrow_memory_pool(ray_session, model_dir, actor):
    """``arrow_memory_pool``: the system allocator by default in the actors' processes (Arrow's wheels default to
    mimalloc, slower here: ingest/memory.py); ``default`` leaves Arrow's choice."""
    runs = [
        _arrow_pool_in_a_new_actor.remote(actor, DataConfig(**kw), model_dir)
        for kw in ({}, {"arrow_memory_pool": "jemalloc"}, {"arrow_memory_pool": "default"})
    ]
    (arrow_default, system), (_, jemalloc), (_, untouched) = ray.get(runs)
    assert (system, jemalloc, untouched) == ("system", "jemalloc", arrow_default)
    with pytest.raises(ValueError, match="arrow_memory_pool"):
        DataConfig(arrow_memory_pool="tcmalloc")


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


def test_consumer_pixel_values_reuse_only_buffers_nothing_holds(monkeypatch):
    """The float32 ``pixel_values`` built on the CPU (the collate, per image row) come from ``PIXEL_VALUES``: a row
    the caller still holds is never written again, a dropped row's buffer is reused (the smallest that fits), and
    each row's tensor owns just its bytes (pickling or saving it carries no other row's)."""
    import pickle

    import torch

    import ingest.media.pixels
    from ingest.media.pixels import normalize_patches
    from ingest.memory import ReusedBuffers

    pool = ReusedBuffers(keep=192, slack=1.0)  # this test's own: other tests' free buffers could fit better
    monkeypatch.setattr(ingest.media.pixels, "PIXEL_VALUES", pool)
    rng = np.random.default_rng(1)
    mean, std = (122.7, 116.7, 104.1), (68.5, 66.6, 70.3)
    rows = [rng.integers(0, 256, (n, 3, 14, 14), dtype=np.uint8) for n in (40, 10, 25)]
    held = [normalize_patches(r, mean, std, 2) for r in rows]
    expected = [h.clone() for h in held]
    for h, r in zip(held, rows, strict=True):
        assert h.shape == (len(r), 3 * 2 * 14 * 14) and h.untyped_storage().nbytes() == h.numel() * 4
        assert len(pickle.dumps(h)) < h.numel() * 4 + 4096
    addresses = {h.data_ptr() for h in held}
    others = [normalize_patches(r, mean, std, 2) for r in rows]  # all three held: new buffers
    assert not addresses & {o.data_ptr() for o in others}
    assert all(torch.equal(h, e) for h, e in zip(held, expected, strict=True))
    large, small = held[0].data_ptr(), held[1].data_ptr()
    del held, others
    again = normalize_patches(rows[1], mean, std, 2)  # 10 patches: the smallest free buffer that fits
    assert again.data_ptr() == small and torch.equal(again, expected[1])
    assert normalize_patches(rows[0], mean, std, 2).data_ptr() == large
    assert any(b.ctypes.data == small for b in pool._buffers)


def test_consumer_normalize_is_bit_equal_across_its_chunks():
    """The CPU normalize goes a few hundred patches at a time (``_NORMALIZE_CHUNK``), normalizing each once and
    copying it into both frames: bit-equal to (x - mean) / std in float32 over the repeated frames, at and around
    the chunk boundaries."""
    from ingest.media.pixels import _NORMALIZE_CHUNK, normalize_patches

    rng = np.random.default_rng(2)
    mean, std = (122.7, 116.7, 104.1), (68.5, 66.6, 70.3)
    step = _NORMALIZE_CHUNK // (3 * 14 * 14)
    for n in (1, step - 1, step, step + 1, 3 * step + 5):
        patches = rng.integers(0, 256, (n, 3, 14, 14), dtype=np.uint8)
        frames = np.repeat(patches.reshape(n, 3, 1, 196).astype(np.float32), 2, axis=2)
        expected = (frames - np.float32(mean).reshape(1, 3, 1, 1)) / np.float32(std).reshape(1, 3, 1, 1)
        got = normalize_patches(patches, mean, std, 2).numpy()
        assert got.shape == (n, 3 * 2 * 196) and got.tobytes() == expected.reshape(n, -1).tobytes(), n


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


def test_an_actor_module_imports_its_stage_only():
    """Unpickling a decode / vision actor class imports ``actors.vision``: with the packages' lazy exports that pulls
    in neither the tokenizer's Jinja nor the pipeline or SFT modules; the public names still resolve."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
