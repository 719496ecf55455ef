"""How many rows an epoch yields (after the overlong filter and quarantine), counted once per data and settings.

``len()`` of a verl dataloader sets verl's total training steps, so it must never promise more batches than an
epoch gives: a Parquet footer counts rows before the filter and the bad-row policy, so the count here is the
pipeline's own, from one pass over the data with its stages (``DriverUnits(count_only=True)``): text rows through
the prompt stage's decisions without its rows (a prompt known short without encoding it is not encoded), media rows
through the prompt and decode stages (a corrupt image is only found by decoding it), no vision stage. Where no
cluster of several nodes is up, the count runs in this process without starting one (on a new cluster that start
alone takes seconds); on a multi-node cluster, or with videos decoded on a device (whose decoder alone says which of
them decode), it runs through the pipeline. The result is kept in ``cache_dir`` under a key of everything that
decides it: the files (paths, row groups, schema, local size and modification time), the row-shaping config and the
model paths.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from ingest.config import DataConfig
from ingest.datasets.plan import FilesArg, InputPlan, plan_input
from ingest.memory import return_freed_heap

logger = logging.getLogger(__name__)

CACHE_FILE = "ingest-epoch-rows.json"
COUNT_BATCH_ROWS = 4096
# the prompt stage holds the GIL for part of each media row: beyond a few threads each adds a decoded unit in memory,
# not speed
COUNT_THREADS = 4
# units a count's thread may run ahead of the oldest unfinished one: its outputs are provenance only, and a thread
# waiting on a slower unit's turn is a core idle
COUNT_AHEAD = 4
# text rows: the template render and the short-prompt check hold the GIL, the encode of the others does not
COUNT_TEXT_THREADS = 2
# config keys that change where or how fast rows are made, never which rows come out
_LAYOUT_KEYS = frozenset(
    {
        "storage_options",
        "shuffle",
        "seed",
        "cache_dir",
        "use_shm",
        "filter_overlong_prompts_workers",
        "arrow_memory_pool",
    }
)


def _file_identity(path: str) -> list:
    try:
        stat = os.stat(path.removeprefix("file://"))
        return [stat.st_size, stat.st_mtime_ns]
    except OSError:  # remote: its footer (row groups, schema) stands for it
        return []


def count_key(plan: InputPlan, tokenizer, config: DataConfig, processor=None) -> str:
    """The cache key of an epoch's row count: files (footers, local size and mtime), row-shaping config, models."""
    settings = {
        k: v
        for k, v in config.to_dict().items()
        if k not in _LAYOUT_KEYS and not k.endswith(("_pool_min_size", "_pool_max_size", "_num_cpus", "_num_gpus"))
    }
    if config.max_samples <= 0:  # every row: the keys of counts cached before the draw existed
        del settings["max_samples"], settings["max_samples_seed"]
    identity = {
        "files": [
            [info.path, list(info.row_group_rows), str(info.schema), _file_identity(info.path)] for info in plan.infos
        ],
        "config": settings,
        "models": [str(tokenizer), str(processor)],
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def _num_rows(table) -> int:
    return table.num_rows


def count_rows(files: FilesArg, tokenizer, config: DataConfig, processor=None, *, cache: bool = True) -> int:
    """Rows one epoch of ``build_dataset(files, tokenizer, config, processor)`` yields: from the cache, else counted
    with the stages' decisions only (in this process, else through the pipeline: see the module) and cached."""
    from ingest.stream import PromptStream

    path = Path(os.path.expanduser(config.cache_dir)) / CACHE_FILE
    plan = plan_input(files, config, multimodal=processor is not None)  # footers read once: key and count
    key = count_key(plan, tokenizer, config, processor)
    known = _read(path) if cache else {}
    if key in known:
        return int(known[key])
    if _on_several_nodes() or config.vision_decode_video_on_device:
        rows = sum(PromptStream(plan.files, tokenizer, config, COUNT_BATCH_ROWS, processor, collate_fn=_num_rows))
    else:
        rows = count_rows_here(plan, tokenizer, config, processor)
        return_freed_heap()  # what the count freed (its tokenizer, its batches) is not carried into the epoch
    logger.info("counted %d rows per epoch (cached in %s)", rows, path)
    if cache:
        _write(path, {**_read(path), key: rows})
    return rows


def count_rows_here(plan: InputPlan, tokenizer, config: DataConfig, processor=None) -> int:
    """The rows an epoch over ``plan`` yields, counted in this process: every read unit through the read and the
    stages that decide which rows come out (``DriverUnits(count_only=True)``). Units run on a thread per core (at
    most ``COUNT_THREADS`` for media rows, ``COUNT_TEXT_THREADS`` for text), each with its own stages: image decoding
    and the batch encode release the GIL. An error raises as the first unit in order that has one."""
    from ingest.datasets.local import DriverUnits, made_in_order
    from ingest.datasets.pools import process_cores

    context = plan.context(None, False, config.image_key)
    threads = min(len(plan.units), process_cores(), COUNT_THREADS if processor is not None else COUNT_TEXT_THREADS)
    blocks = made_in_order(
        lambda: DriverUnits(plan, config, context, tokenizer, processor, count_only=True),
        plan.units,
        threads,
        "ingest-count",
        ahead=COUNT_AHEAD * threads,
    )
    return sum(block.num_rows for block in blocks)


def _on_several_nodes() -> bool:
    """Whether this process is connected to a Ray cluster of more than one node (whose cores count faster)."""
    import ray

    return ray.is_initialized() and sum(1 for node in ray.nodes() if node.get("Alive")) > 1


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write(path: Path, counts: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(counts, indent=0, sort_keys=True))
    tmp.replace(path)  # atomic: concurrent trainers never read half a file
