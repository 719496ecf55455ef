"""``build_dataset``: Parquet (local, S3, HDFS) -> read units -> tokenizer actor pool (-> decode -> vision pools)
-> verl rows."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import ray

from ingest.config import DataConfig
from ingest.datasets.plan import FilesArg, InputPlan, check_model_path, check_row_format, plan_input
from ingest.datasets.pools import actor_kwargs, map_on_pool, read_units_into_pool


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
) -> ray.data.Dataset:
    """A Ray Dataset of verl rows (``RLHFDataset.__getitem__`` of the ``row_format`` release; 0.5.0 by default).

    ``files``: a path, directory, glob or list of them, local or ``s3://`` / ``hdfs://`` / ``webhdfs://``.
    ``tokenizer`` / ``processor``: a local directory or hub name, loaded once per actor (``None`` for the tokenizer
    means the embedded offline Qwen2-VL tokenizer). ``config``: ``DataConfig``, dict or a verl ``data:`` DictConfig.
    With ``shuffle`` off rows come in input order (minus filtered rows); with it on, in a seeded order that
    depends only on (seed, epoch). ``ledger``: a ``RunLedger`` actor that receives per-batch counts.
    ``plan``: read only these units (resume); ``keep_provenance``: keep the ``_ingest_file`` / ``_ingest_row`` columns.
    """
    cfg = DataConfig.from_any(config)
    check_model_path(tokenizer)
    if processor is not None:
        check_model_path(processor, "processor")
    plan = plan or plan_input(files, cfg, epoch=epoch, multimodal=processor is not None)
    check_row_format(cfg, processor, plan)
    from actors import DecodeActor, TokenizeActor, VisionActor

    context = plan.context(ledger, keep_provenance)
    models = actor_kwargs(cfg, context, tokenizer=tokenizer, processor=processor)
    ds = read_units_into_pool(plan, cfg, context, TokenizeActor, models, epoch=epoch)
    if processor is None:
        return ds
    # a stage whose pool size is 0 runs in the actors of the stage before it (media_steps): fewer processes and
    # object-store copies of the pixels, for small machines
    media = actor_kwargs(cfg, context, processor=processor)
    if cfg.decode_pool_max_size > 0:
        ds = map_on_pool(ds, cfg, "decode", DecodeActor, media)
    if cfg.row_format == "verl-0.9" or cfg.vision_pool_max_size == 0:  # verl 0.9 rows: the rollout processes media
        return ds
    return map_on_pool(ds, cfg, "vision", VisionActor, media)
