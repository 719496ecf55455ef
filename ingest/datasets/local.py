"""The first rows of an epoch, made in the driver: the same read and stages as the tokenizer (and decode) actors, run
in this process, so the first batch needs no Ray cluster, worker process or actor to start.

On a new cluster those cost seconds (Ray's start, Ray Data's cluster actors, a worker importing the stages and
loading the tokenizer) before the first unit is even read; a driver that already imported the stages makes one batch
in a fraction of that. ``PromptStream`` takes the first batch from here and the rest from ``build_dataset`` over the
units after these. Media rows run every media stage here on the CPU, as the one-pool layout's tokenizer actors do
(the first read unit is small: ``read_first_unit_rows``); not where the vision stage runs on GPU actors, whose
kernels differ from the CPU's by rounding.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import pyarrow as pa

from ingest.config import DataConfig, StageContext
from ingest.datasets.plan import InputPlan, units_source
from ingest.read.units import ReadUnit

U = TypeVar("U")
T = TypeVar("T")
_NONE_LEFT = object()  # made_in_order: no item left to draw


def driver_can_start(config: DataConfig, processor: str | os.PathLike | None) -> bool:
    """Whether the driver makes the first batch: text rows, verl 0.9 rows (no vision stage), and media rows whose
    vision stage runs on the CPU."""
    if config.media_handoff:  # the rollout's media go to a store actor: Ray must be up
        return False
    if processor is None or config.raw_prompt_rows:
        return True
    return config.vision_num_gpus == 0 and config.vision_device in ("auto", "cpu")


class DriverUnits:
    """Reads and runs single read units in this process, blocks exactly as the tokenizer (+ media) actors give
    them; counts and quarantine go to ``context.ledger`` as from the actors. ``count_only``: the blocks keep the
    rows an epoch yields as their provenance, not their model inputs: the prompt stage's decisions made without the
    ids it does not need, and for media rows the decode stage's (a row is only known good once its media decode; no
    vision stage runs, which drops no row whose media decoded). JPEGs left to a device decoder are decoded here by
    PIL, as the vision stage does with any its device refuses; videos left to a device decoder
    (``vision_decode_video_on_device``) are counted where they are decoded, not here. ``adopt``: where the
    rollout-media stage's payloads go (``media_handoff``: the read's media store makes the units with its own)."""

    def __init__(
        self,
        plan: InputPlan,
        config: DataConfig,
        context: StageContext,
        tokenizer: str | os.PathLike | None,
        processor: str | os.PathLike | None = None,
        *,
        epoch: int = 0,
        count_only: bool = False,
        adopt: Callable[[list, list], None] | None = None,
    ):
        from ingest.stages.decode import DecodeStage
        from ingest.stages.media import counted_block, media_stages
        from ingest.stages.prompt import prompt_stage

        if not (count_only or adopt is not None or driver_can_start(config, processor)):
            raise ValueError("the driver does not make rows whose vision stage runs on GPU actors")
        self.plan, self.config, self.context, self.epoch = plan, config, context, epoch
        self.media: Callable[[pa.Table], pa.Table] | None
        if count_only and processor is not None:
            decode = DecodeStage(config, context, count_only=True)
            self.media = functools.partial(counted_block, decode, ledger=context.ledger, stage="decode")
        else:
            # every media stage in this process, on the CPU even where the driver sees a GPU: a CPU actor's ("auto"
            # on a CPU actor is the CPU); verl 0.9 rows have only the decode stage, none for text rows
            one_pool = dataclasses.replace(config, decode_pool_max_size=0, vision_pool_max_size=0, vision_device="cpu")
            self.media = media_stages(one_pool, context, processor, "tokenizer", adopt=adopt)
        self.stage = prompt_stage(config, context, tokenizer, processor, count_only=count_only)

    def __call__(self, unit: ReadUnit) -> Iterator[pa.Table]:
        from ingest.stats import stage_unit

        # a unit that cannot be read is quarantined (or raises) as in the actors
        one = InputPlan(self.plan.files, self.plan.infos, [unit])
        source = units_source(one, self.config, self.epoch, self.context.ledger)
        for read in source.get_read_tasks(1):
            for table in read():
                for block in stage_unit(self.stage, table, self.config.tokenizer_batch_size, self.context.ledger):
                    yield self.media(block) if self.media is not None else block


def made_in_order(
    new_worker: Callable[[], Callable[[U], Iterable[T]]],
    items: Iterable[U],
    threads: int,
    name: str,
    ahead: int | None = None,
) -> Iterator[T]:
    """What ``worker(item)`` yields for each of ``items``, in item order, made on ``threads`` threads named ``name``
    with a worker each (``new_worker()``: its own stages), at most ``ahead`` (default ``threads``) items ahead of the
    consumer: an item is drawn from ``items`` once the outputs of all but ``ahead - 1`` items before it are handed
    out. A larger ``ahead`` keeps every thread busy while an older item is slower, for outputs small enough to wait.
    An item's error raises after what it yielded before it; items not started by then never are. On one thread
    everything runs in the caller's, each output as soon as it is made.

    The tokenizer's batch encode and the image decoders release the GIL, so a second thread makes one unit while the
    first holds the GIL for the Python parts of another (or the caller collates a batch)."""
    if threads <= 1:
        worker = new_worker()
        for item in items:
            yield from worker(item)
        return
    local = threading.local()

    def made(item: U) -> tuple[list[T], Exception | None]:
        if not hasattr(local, "worker"):
            local.worker = new_worker()
        outputs: list[T] = []
        try:
            outputs.extend(local.worker(item))
        except Exception as error:  # raised in the caller's thread, after the outputs before it
            return outputs, error
        return outputs, None

    pending: collections.deque = collections.deque()
    pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
    ahead = max(ahead or threads, threads)
    try:
        remaining = iter(items)
        while True:
            if len(pending) == ahead:  # the next item is drawn once the oldest one's outputs are handed out
                yield from _outputs(pending.popleft().result())
            item = next(remaining, _NONE_LEFT)
            if item is _NONE_LEFT:
                break
            pending.append(pool.submit(made, item))
        while pending:
            yield from _outputs(pending.popleft().result())
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown()  # the threads end and their workers (stages, tokenizer) with them


def _outputs(made: tuple[list[T], Exception | None]) -> Iterator[T]:
    outputs, error = made
    yield from outputs
    if error is not None:
        raise error
