"""The actor pools of a pipeline, as Ray Data ``map_batches`` calls: the read fused into the first pool, then the
decode and vision pools. Every actor is built with the run's ``DataConfig`` and ``StageContext`` and the model paths
(loaded in the actor, never pickled from the driver)."""

from __future__ import annotations

import os
from typing import Literal

import ray

from ingest.config import DataConfig, StageContext
from ingest.datasets.plan import InputPlan, units_source


def ensure_ray() -> None:
    """Join the cluster this process runs in (a Ray job sets RAY_ADDRESS), else start a local one without the
    dashboard: Ray Data's own start would bring it (nine more processes, ~200 MiB on a new local cluster)."""
    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=True)


def actor_kwargs(cfg: DataConfig, context: StageContext, **models: str | os.PathLike | None) -> dict:
    """An actor's constructor arguments: the config, the context and the model paths (as strings)."""
    return {"config": cfg, "context": context, **{k: None if v is None else os.fspath(v) for k, v in models.items()}}


def read_units_into_pool(
    plan: InputPlan, cfg: DataConfig, context: StageContext, actor, constructor_kwargs: dict, *, epoch: int
) -> ray.data.Dataset:
    """Read ``plan``'s units straight into a pool of ``actor`` (the tokenizer pool's size and CPUs).

    Same CPUs as the actors, no task cap and whole blocks (``batch_size=None``; the actor slices by
    ``tokenizer_batch_size``): Ray Data then fuses the read into the actor pool, so each actor reads its unit and
    processes it in the same process. No read worker has to start (and import Ray Data) before the first batch, and
    raw rows skip the object store.
    """
    ensure_ray()
    source = units_source(plan, cfg, epoch, context.ledger)
    ds = ray.data.read_datasource(source, override_num_blocks=max(1, len(plan.units)), num_cpus=cfg.tokenizer_num_cpus)
    ds.context.execution_options.preserve_order = True
    # Our stages raise IngestError naming file/row/column; let it reach the consumer as itself, not wrapped in
    # Ray's UserCodeException (whose cause chain does not survive the trip back to the driver).
    ds.context.raise_original_map_exception = True
    return ds.map_batches(
        actor,
        fn_constructor_kwargs=constructor_kwargs,
        batch_size=None,
        batch_format="pyarrow",
        zero_copy_batch=True,
        compute=ray.data.ActorPoolStrategy(min_size=cfg.tokenizer_pool_min_size, max_size=cfg.tokenizer_pool_max_size),
        num_cpus=cfg.tokenizer_num_cpus,
    )


def map_on_pool(
    ds: ray.data.Dataset, cfg: DataConfig, pool: Literal["decode", "vision"], actor, constructor_kwargs: dict
) -> ray.data.Dataset:
    """``actor`` on the decode or vision pool (its size and CPUs from ``cfg``); the vision pool holds GPU actors when
    ``vision_num_gpus`` > 0 (fractional allowed)."""
    gpu = {"num_gpus": cfg.vision_num_gpus} if pool == "vision" and cfg.vision_num_gpus else {}
    return ds.map_batches(
        actor,
        fn_constructor_kwargs=constructor_kwargs,
        # CPU: one whole block per call, so the output block stays one Arrow chunk (docs/design.md). Ray Data needs a
        # fixed batch size for GPU actors: there the output block has one chunk per call, and slicing it later
        # combines (copies) them.
        batch_size=cfg.vision_batch_size if gpu else None,
        batch_format="pyarrow",
        zero_copy_batch=True,
        compute=ray.data.ActorPoolStrategy(
            min_size=getattr(cfg, f"{pool}_pool_min_size"), max_size=getattr(cfg, f"{pool}_pool_max_size")
        ),
        num_cpus=getattr(cfg, f"{pool}_num_cpus"),
        **gpu,
    )
