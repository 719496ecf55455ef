"""Pipeline behaviour: order, seeded shuffle, Arrow-native blocks, in-stream filter accounting, the read fused into the
tokenizer actors, the actors' Arrow memory pool and imports."""

from __future__ import annotations

import pyarrow as pa
import pytest
import ray

from ingest import DataConfig, build_dataset
from ingest.blocks import FILE_COLUMN, ROW_COLUMN
from ingest.stats import RunLedger
from tests.support.batches import collect

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


def test_read_runs_inside_the_tokenizer_actors(ray_session, variety_files, model_dir):
    # the first-batch latency depends on this fusion: no separate read worker starts before the first batch
    ds = build_dataset(variety_files, model_dir, BASE)
    ds.take_batch(8)
    assert "ReadParquetUnits->MapBatches(TokenizeActor)" in ds.stats(), ds.stats()


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


def test_an_actor_module_imports_its_stage_only():
    """Unpickling a decode / vision actor class imports ``actors.vision``: with the packages' lazy exports that pulls
    in neither the tokenizer's Jinja nor the pipeline or SFT modules; the public names still resolve."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
