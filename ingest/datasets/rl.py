"""``build_dataset``: Parquet (local, S3, HDFS) -> read units -> tokenizer actor pool (-> decode -> vision pools)
-> verl rows."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

import ray

from ingest.config import DataConfig
from ingest.datasets.layout import Layout, choose_layout, fit_to_input
from ingest.datasets.plan import FilesArg, InputPlan, check_model_path, check_row_format, plan_input
from ingest.datasets.pools import actor_kwargs, ensure_ray, map_on_pool, read_units_into_pool

logger = logging.getLogger(__name__)


def build_dataset(
    files: FilesArg,
    tokenizer: str | os.PathLike | None,
    config: DataConfig | Mapping[str, Any] | None = None,
    processor: str | os.PathLike | None = None,
    *,
    epoch: int = 0,
    ledger=None,
    plan: InputPlan | None = None,
    keep_provenance: bool = False,
    media_store: str | None = None,
) -> ray.data.Dataset:
    """A Ray Dataset of verl rows (``RLHFDataset.__getitem__`` of the ``row_format`` release; 0.5.0 by default).

    ``files``: a path, directory, glob or list of them, local or ``s3://`` / ``hdfs://`` / ``webhdfs://``.
    ``tokenizer`` / ``processor``: a local directory or hub name, loaded once per actor (``None`` for the tokenizer
    means the embedded offline Qwen2-VL tokenizer). ``config``: ``DataConfig``, dict or a verl ``data:`` DictConfig.
    With ``shuffle`` off rows come in input order (minus filtered rows); with it on, in a seeded order that
    depends only on (seed, epoch). ``ledger``: a ``RunLedger`` actor that receives per-batch counts.
    ``plan``: read only these units (resume); ``keep_provenance``: keep the ``_ingest_file`` / ``_ingest_row`` columns.
    ``media_store``: with ``media_handoff``, the ``MediaStore`` actor that holds the rollout's media (the loaders make
    one and release each step's media).
    """
    cfg = DataConfig.from_any(config)
    check_model_path(tokenizer)
    if processor is not None:
        check_model_path(processor, "processor")
    plan = plan or plan_input(files, cfg, epoch=epoch, multimodal=processor is not None)
    check_row_format(cfg, processor)
    from actors import DecodeActor, TokenizeActor, VisionActor

    cfg = cluster_layout(cfg, media=processor is not None, plan=plan).apply(cfg)
    context = plan.context(ledger, keep_provenance, cfg.image_key)
    if cfg.media_handoff:
        if media_store is None:
            raise ValueError(
                "media_handoff: read these rows through VerlDataLoader or PromptStream, which hold each step's media "
                "in a store and release them after it"
            )
        context = dataclasses.replace(context, media_store=media_store)
    models = actor_kwargs(cfg, context, tokenizer=tokenizer, processor=processor)
    ds = read_units_into_pool(plan, cfg, context, TokenizeActor, models, epoch=epoch)
    if processor is None:
        return ds
    # a stage whose pool size is 0 runs in the actors of the stage before it (media_steps): fewer processes and
    # object-store copies of the pixels, for small machines
    media = actor_kwargs(cfg, context, processor=processor)
    if cfg.decode_pool_max_size > 0:
        ds = map_on_pool(ds, cfg, "decode", DecodeActor, media)
    if (cfg.raw_prompt_rows and not cfg.media_handoff) or cfg.vision_pool_max_size == 0:
        return ds  # verl 0.9 rows: the rollout processes the media (unless they are handed off)
    return map_on_pool(ds, cfg, "vision", VisionActor, media)


def cluster_layout(cfg: DataConfig, *, media: bool = True, plan: InputPlan | None = None) -> Layout:
    """The pools' layout for ``cfg`` (media rows or text rows) on the cluster this process joins, no pool larger than
    ``plan``'s input can keep busy (logged when chosen here)."""
    ensure_ray()
    layout = choose_layout(cfg, ray.cluster_resources(), media=media)
    if plan is not None:
        layout = fit_to_input(layout, cfg, units=len(plan.units), rows=plan.num_rows, media=media)
    if layout.name != "config":  # a choice made here, not the user's: say which and why
        logger.info("%s layout: %s", "media" if media else "text", layout.describe())
    return layout
