"""``build_dataset``: Parquet (local, S3, HDFS) -> read units -> tokenizer actor pool -> verl rows."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from ingest.config import DataConfig
from ingest.errors import ModelLoadError, SourceError
from ingest.read import ParquetUnitsDatasource, ReadUnit, plan_units, shuffle_units, split_first_unit
from ingest.sources import FileInfo, _describe, expand_files, inspect_files, unify_schemas

FilesArg = str | os.PathLike | Sequence[str | os.PathLike]


@dataclass
class InputPlan:
    """What the driver learned from the footers before any data is read."""

    files: list[str]
    infos: list[FileInfo]
    units: list[ReadUnit]

    @property
    def num_rows(self) -> int:
        return sum(u.num_rows for u in self.units)


def plan_input(files: FilesArg, cfg: DataConfig, *, epoch: int = 0, multimodal: bool = False) -> InputPlan:
    paths = expand_files(files, cfg.storage_options)
    infos = inspect_files(paths, cfg.storage_options)
    for info in infos:
        if cfg.prompt_key not in info.schema.names:
            raise SourceError(
                f"no prompt column {cfg.prompt_key!r} (columns: {', '.join(info.schema.names)}); set data.prompt_key",
                file=_describe(info.path),
                column=cfg.prompt_key,
            )
    rows_per_task = cfg.read_rows_per_task
    if multimodal:  # decode / vision take one unit's block per call and emit it when done: keep image units small
        rows_per_task = min(rows_per_task, 4 * cfg.vision_batch_size)
    units = plan_units(infos, rows_per_task)
    if cfg.shuffle:
        units = shuffle_units(units, cfg.seed, epoch)
    return InputPlan(paths, infos, split_first_unit(units, cfg.read_first_unit_rows))


_MODEL_FILES = {
    "tokenizer": ("tokenizer_config.json", "tokenizer.json"),
    "processor": ("preprocessor_config.json", "processor_config.json"),
}


def check_model_path(name_or_path: str | os.PathLike | None, what: str = "tokenizer") -> None:
    """Fail on the driver, naming the path, when a local model directory is missing (hub names load in actors)."""
    from ingest.offline import EMBEDDED_NAME

    if name_or_path is None or os.fspath(name_or_path) == EMBEDDED_NAME:
        return
    path = os.fspath(name_or_path)
    looks_local = os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1 or os.path.exists(path)
    if not looks_local:
        return
    local = os.path.expanduser(path)
    if not os.path.isdir(local):
        raise ModelLoadError(f"{what} directory not found: {path}")
    wanted = _MODEL_FILES[what]
    if not any(os.path.isfile(os.path.join(local, f)) for f in wanted):
        raise ModelLoadError(f"{what} directory has no {' or '.join(wanted)}: {path}")


def units_source(plan: InputPlan, cfg: DataConfig, epoch: int = 0, ledger=None) -> ParquetUnitsDatasource:
    """The read of ``plan``'s units in order (seeded row order when shuffling), with the bad-input policy."""
    return ParquetUnitsDatasource(
        plan.files,
        plan.units,
        unify_schemas(plan.infos),
        cfg.storage_options,
        shuffle_seed=cfg.seed if cfg.shuffle else None,
        epoch=epoch,
        on_bad_row=cfg.on_bad_row,
        ledger=ledger,
    )


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
    """A Ray Dataset of verl 0.5.0 rows (``RLHFDataset.__getitem__``) for ``files``.

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
    from actors import DecodeActor, TokenizeActor, VisionActor

    if processor is None:
        return read_units_into_pool(
            plan, cfg, TokenizeActor, tokenizer, None, epoch=epoch, ledger=ledger, keep_provenance=keep_provenance
        )
    # a stage whose pool size is 0 runs in the actors of the stage before it (DataConfig.decode_pool_max_size,
    # vision_pool_max_size): fewer processes and object-store copies of the pixels, for small machines
    decode_pool, vision_pool = cfg.decode_pool_max_size > 0, cfg.vision_pool_max_size > 0
    vision = _vision_kwargs(processor, cfg)
    tokenizer_steps, decode_steps = {"decode": not decode_pool}, {}
    if not vision_pool:
        (decode_steps if decode_pool else tokenizer_steps)["vision_stage"] = vision
    ds = read_units_into_pool(
        plan,
        cfg,
        TokenizeActor,
        tokenizer,
        processor,
        epoch=epoch,
        ledger=ledger,
        keep_provenance=keep_provenance,
        **tokenizer_steps,
    )
    located = {  # what the decode and vision stages need to name, count and quarantine bad media
        "config": cfg.to_dict(),
        "files": [_describe(p) for p in plan.files],
        "ledger": ledger,
        "keep_provenance": keep_provenance,
    }
    if decode_pool:
        ds = _map_on_decode_pool(ds, cfg, DecodeActor, {**located, **decode_steps})
    return map_on_vision_pool(ds, cfg, VisionActor, {**vision, **located}) if vision_pool else ds


def _map_on_decode_pool(ds: ray.data.Dataset, cfg: DataConfig, actor, constructor_kwargs: dict) -> ray.data.Dataset:
    return ds.map_batches(
        actor,
        fn_constructor_kwargs=constructor_kwargs,
        batch_size=None,  # one whole block per call: the output block stays one Arrow chunk (docs/design.md)
        batch_format="pyarrow",
        zero_copy_batch=True,
        compute=ray.data.ActorPoolStrategy(min_size=cfg.decode_pool_min_size, max_size=cfg.decode_pool_max_size),
        num_cpus=cfg.decode_num_cpus,
    )


def _vision_kwargs(processor: str | os.PathLike, cfg: DataConfig) -> dict:
    return {
        "processor": os.fspath(processor),
        "device": cfg.vision_device,  # "auto": cuda when Ray gave this actor a GPU, else cpu
        "return_multi_modal_inputs": cfg.return_multi_modal_inputs,
    }


def read_units_into_pool(
    plan: InputPlan, cfg: DataConfig, actor, tokenizer, processor, *, epoch: int, ledger, **actor_kwargs
) -> ray.data.Dataset:
    """Read ``plan``'s units straight into a pool of ``actor`` (the tokenizer pool's size and CPUs).

    The actor is built with ``tokenizer``, ``config``, ``files`` (as named in errors), ``processor``, ``ledger`` and
    ``actor_kwargs``; tokenizer and processor are loaded in the actor, never pickled from the driver.

    Same CPUs as the actors, no task cap and whole blocks (``batch_size=None``; the actor slices by
    ``tokenizer_batch_size``): Ray Data then fuses the read into the actor pool, so each actor reads its unit and
    processes it in the same process. No read worker has to start (and import Ray Data) before the first batch, and
    raw rows skip the object store.
    """
    source = units_source(plan, cfg, epoch, ledger)
    ds = ray.data.read_datasource(source, override_num_blocks=max(1, len(plan.units)), num_cpus=cfg.tokenizer_num_cpus)
    ds.context.execution_options.preserve_order = True
    # Our stages raise IngestError naming file/row/column; let it reach the consumer as itself, not wrapped in
    # Ray's UserCodeException (whose cause chain does not survive the trip back to the driver).
    ds.context.raise_original_map_exception = True
    constructor_kwargs = {
        "tokenizer": None if tokenizer is None else os.fspath(tokenizer),
        "config": cfg.to_dict(),
        "files": [_describe(p) for p in plan.files],
        "processor": None if processor is None else os.fspath(processor),
        "ledger": ledger,
        **actor_kwargs,
    }
    return ds.map_batches(
        actor,
        fn_constructor_kwargs=constructor_kwargs,
        batch_size=None,
        batch_format="pyarrow",
        zero_copy_batch=True,
        compute=ray.data.ActorPoolStrategy(min_size=cfg.tokenizer_pool_min_size, max_size=cfg.tokenizer_pool_max_size),
        num_cpus=cfg.tokenizer_num_cpus,
    )


def map_on_vision_pool(ds: ray.data.Dataset, cfg: DataConfig, actor, constructor_kwargs: dict) -> ray.data.Dataset:
    """``actor`` on the vision pool: CPU actors, or GPU actors when ``vision_num_gpus`` > 0 (fractional allowed)."""
    gpu = {"num_gpus": cfg.vision_num_gpus} if cfg.vision_num_gpus else {}
    return ds.map_batches(
        actor,
        fn_constructor_kwargs=constructor_kwargs,
        # CPU: one whole block per call, as decode. Ray Data needs a fixed batch size for GPU actors: there the
        # output block has one chunk per call, and slicing it later combines (copies) them.
        batch_size=cfg.vision_batch_size if gpu else None,
        batch_format="pyarrow",
        zero_copy_batch=True,
        compute=ray.data.ActorPoolStrategy(min_size=cfg.vision_pool_min_size, max_size=cfg.vision_pool_max_size),
        num_cpus=cfg.vision_num_cpus,
        **gpu,
    )
