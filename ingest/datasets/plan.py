"""What the driver plans before any data is read: the files (expanded, footers inspected), the read units in order
(seeded shuffle), the model paths checked; and the read source for those units. Shared by the RL and SFT builders."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from ingest.config import DataConfig, StageContext
from ingest.errors import ModelLoadError, SourceError
from ingest.read.files import FileInfo, expand_files, inspect_files, printable_path, reads_as_pil_images, unify_schemas
from ingest.read.units import (
    ParquetUnitsDatasource,
    ReadUnit,
    drawn_units,
    plan_units,
    shuffle_units,
    split_first_unit,
)

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

    def context(self, ledger=None, keep_provenance: bool = False, image_key: str = "images") -> StageContext:
        """The ``StageContext`` of a run over these files (named as errors name them: secrets redacted), whose image
        column is ``image_key``."""
        plain = frozenset(
            i
            for i, info in enumerate(self.infos)
            if image_key in info.schema.names and not reads_as_pil_images(info.schema, image_key)
        )
        return StageContext(tuple(printable_path(p) for p in self.files), ledger, keep_provenance, plain)


def drawn_rows(total: int, cfg: DataConfig):
    """The rows ``cfg.max_samples`` keeps of ``total`` (indices into every file's rows in order), as verl 0.9.1's
    ``RLHFDataset`` draws them from its loaded table: with ``max_samples_seed``
    ``numpy.random.default_rng(seed).choice(total, max_samples, replace=False)``, else the first ``max_samples``;
    None where it keeps every row."""
    import numpy as np

    if not 0 < cfg.max_samples < total:
        return None
    if cfg.max_samples_seed is None:
        return np.arange(cfg.max_samples)
    return np.random.default_rng(cfg.max_samples_seed).choice(total, size=cfg.max_samples, replace=False)


def plan_input(files: FilesArg, cfg: DataConfig, *, epoch: int = 0, multimodal: bool = False) -> InputPlan:
    paths = expand_files(files, cfg.storage_options)
    infos = inspect_files(paths, cfg.storage_options)
    for info in infos:
        if cfg.prompt_key not in info.schema.names:
            raise SourceError(
                f"no prompt column {cfg.prompt_key!r} (columns: {', '.join(info.schema.names)}); set data.prompt_key",
                file=printable_path(info.path),
                column=cfg.prompt_key,
            )
    rows_per_task = cfg.read_rows_per_task
    if multimodal:  # decode / vision take one unit's block per call and emit it when done: keep image units small
        rows_per_task = min(rows_per_task, 4 * cfg.vision_batch_size)
    units = plan_units(infos, rows_per_task)
    drawn = drawn_rows(sum(info.num_rows for info in infos), cfg)
    if drawn is not None:
        units = drawn_units(units, drawn, [info.num_rows for info in infos])
    if cfg.shuffle:
        units = shuffle_units(units, cfg.seed, epoch)
    return InputPlan(paths, infos, split_first_unit(units, cfg.read_first_unit_rows))


_MODEL_FILES = {
    "tokenizer": ("tokenizer_config.json", "tokenizer.json"),
    "processor": ("preprocessor_config.json", "processor_config.json"),
}


def check_model_path(name_or_path: str | os.PathLike | None, what: str = "tokenizer") -> None:
    """Fail on the driver, naming the path, when a local model directory is missing (hub names load in actors)."""
    from ingest.tokenizer.offline import EMBEDDED_NAME

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


# the processors whose rows each row format builds (verl's Qwen-VL rope branch: Qwen2-VL and Qwen2.5-VL; verl 0.6 adds
# Qwen3-VL)
_QWEN2_VL_PROCESSORS = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor")
_ROPE_PROCESSORS = {"verl-0.5": _QWEN2_VL_PROCESSORS, "verl-0.6": (*_QWEN2_VL_PROCESSORS, "Qwen3VLProcessor")}


def check_row_format(cfg: DataConfig, processor: str | os.PathLike | None) -> None:
    """A processor family that ``cfg.row_format`` does not build: one error naming both, before any data is read (a
    processor given by hub name is checked in the actors, where it loads)."""
    if processor is None:
        return
    from ingest.media.geometry import processor_class
    from ingest.tokenizer.offline import resolve_model_path

    path = resolve_model_path(processor)
    family = processor_class(path) if os.path.isdir(path) else None
    built = _ROPE_PROCESSORS.get(cfg.row_format)
    if family is not None and built is not None and family not in built:
        raise ValueError(
            f"row_format {cfg.row_format} builds the rows of the Qwen-VL processors {', '.join(built)}; "
            f"the processor {processor} is a {family} (verl-0.7 / verl-0.9 rows carry the media for any processor)"
        )


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
