"""The media stages an actor runs on one block, in order (decode, then vision), each counted and quarantined as in
its own actor. Which actors run which stage is ``media_steps``: a pool of size 0 puts its stage in the actors of the
stage before it (fewer processes and object-store copies of the pixels, for small machines)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Literal

import pyarrow as pa

from ingest.accounting import BatchCounts, batch_key, report_counts
from ingest.config import DataConfig, StageContext
from ingest.stages.decode import DecodeStage
from ingest.stages.vision import VisionStage
from ingest.tokenizer.offline import resolve_model_path

Pool = Literal["tokenizer", "decode", "vision"]


def media_steps(config: DataConfig, pool: Pool) -> tuple[bool, bool]:
    """(decode, vision): the media stages the actors of ``pool`` run on the processor path. A stage whose pool size
    is 0 (``decode_pool_max_size`` / ``vision_pool_max_size``) runs in the actors of the stage before it. verl 0.9
    rows have no vision stage (the rollout processes the media) unless ``media_handoff`` makes the rollout's media
    in it (``stages.rollout_media``)."""
    if config.raw_prompt_rows and not config.media_handoff:
        return pool == "decode" or (pool == "tokenizer" and config.pool_max_size("decode") == 0), False
    decode_pool, vision_pool = config.pool_max_size("decode") > 0, config.pool_max_size("vision") > 0
    if pool == "tokenizer":
        return not decode_pool, not decode_pool and not vision_pool
    if pool == "decode":
        return True, not vision_pool
    return False, True


def media_stages(
    config: DataConfig,
    context: StageContext,
    processor: str | None,
    pool: Pool,
    *,
    adopt: Callable[[list, list], None] | None = None,
) -> Callable[[pa.Table], pa.Table] | None:
    """One block through the media stages the actors of ``pool`` run (``media_steps``), in order; None where they
    run none (the text path, or pools that hand media on). Each stage counts and quarantines as in its own actor.
    ``adopt``: where the rollout-media stage's payloads go (``RolloutMediaStage``)."""
    if processor is None:
        return None
    decode, vision = media_steps(config, pool)
    steps: list[Callable[[pa.Table], pa.Table]] = []
    if decode:
        steps.append(partial(counted_block, DecodeStage(config, context), ledger=context.ledger, stage="decode"))
    if vision and config.raw_prompt_rows:  # media_handoff: each prompt's rollout media, made once
        from ingest.stages.rollout_media import RolloutMediaStage

        stage = RolloutMediaStage(resolve_model_path(processor), config, context, adopt)
        steps.append(partial(counted_block, stage.process, ledger=context.ledger, stage="vision"))
    elif vision:
        stage = VisionStage(resolve_model_path(processor), config, context)
        # counts only for rows whose media it decoded (vision_decode_*_on_device): the decode stage counted the rest
        steps.append(partial(counted_block, stage.process, ledger=context.ledger, stage="vision", skip_empty=True))
    return partial(_in_order, steps) if steps else None


def _in_order(steps: Sequence[Callable[[pa.Table], pa.Table]], table: pa.Table) -> pa.Table:
    for step in steps:
        table = step(table)
    return table


def counted_block(process, table: pa.Table, ledger, stage: str, skip_empty: bool = False) -> pa.Table:
    """``process`` (a stage's call giving a ``StageResult``) over one block; its counts go to ``ledger`` once per
    block, keyed by ``stage`` and the block's first row (``skip_empty``: not when there is nothing to count)."""
    result = process(table)
    if table.num_rows and not (skip_empty and result.counts == BatchCounts() and not result.quarantine):
        key = batch_key(table)
        report_counts(ledger, result.counts, result.quarantine, None if key is None else (stage, *key))
    return result.table
