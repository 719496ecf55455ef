"""``ResumableBatches``: what ``PromptStream`` and ``PromptShard`` share: their arguments, the read of a set of
read units through ``build_dataset`` (rows keep their provenance, so each batch's units are known), the re-batching
with its ``ReadPosition`` (``ingest.rebatch``), the collate of a batch without the provenance columns, and the state
policy: the seed check and the fingerprint a loaded state must match. Each subclass keeps its own state format.

The fingerprint policy: a state must match what decides the epoch's read units and the order of rows inside each
(files, row groups, unit sizes, seed, shuffle), since its position names units and counts their rows. Batch size is
in neither class's fingerprint: a position counts rows, not batches, so a state resumes exactly (the same rows next,
in the same order) under another batch size.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pyarrow as pa

from ingest.blocks import FILE_COLUMN, MEDIA_KEY_COLUMN, ROW_COLUMN
from ingest.config import DataConfig
from ingest.datasets.plan import FilesArg, InputPlan, plan_input
from ingest.datasets.rl import build_dataset
from ingest.read.units import ReadUnit, UnitIndex
from ingest.rebatch import ReadPosition, rebatch
from ingest.rowformat.collate import VerlCollate


def _digest(identity: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def _unit_identity(plan: InputPlan, config: DataConfig, multimodal: bool) -> dict[str, Any]:
    identity = {
        "files": plan.files,
        "row_groups": [list(info.row_group_rows) for info in plan.infos],
        "rows_per_task": config.read_rows_per_task,
        "first_unit_rows": config.read_first_unit_rows,
        "multimodal": multimodal,
        "seed": config.seed,
        "shuffle": config.shuffle,
    }
    if config.max_samples > 0:  # the rows drawn (only then, so that earlier states keep their fingerprints)
        identity.update(max_samples=config.max_samples, max_samples_seed=config.max_samples_seed)
    return identity


def epoch_fingerprint(plan: InputPlan, config: DataConfig, multimodal: bool) -> str:
    """What decides the epoch's read units and their row order, and nothing that varies by epoch (the units' order
    and the first unit's split do: a state saved at an epoch's end resumes in the next, and shard states of two
    epochs are merged)."""
    # no batch size: a position counts rows, not batches, so a state resumes exactly under any batch size
    identity = _unit_identity(plan, config, multimodal)
    if multimodal:  # ``plan_input`` caps multimodal units at 4 * vision_batch_size rows
        identity["vision_batch_size"] = config.vision_batch_size
    return _digest(identity)


def earlier_fingerprints(plan: InputPlan, config: DataConfig, multimodal: bool, batch_size: int) -> set[str]:
    """The fingerprints earlier releases saved for this data and these settings, so that their states still load:
    ``PromptShard``'s had no ``vision_batch_size``; ``PromptStream``'s held the batch size and the epoch's number of
    units (such a state resumes with its own batch size only, as it did)."""
    stream = {
        "files": plan.files,
        "rows": [info.num_rows for info in plan.infos],
        "units": len(plan.units),
        "batch_size": batch_size,
        "seed": config.seed,
        "shuffle": config.shuffle,
    }
    return {_digest(_unit_identity(plan, config, multimodal)), _digest(stream)}


@dataclass(eq=False)
class ResumableBatches:
    """Collated batches of ``batch_size`` rows over ``files`` (``build_dataset``'s ``tokenizer``, ``config``,
    ``processor``); ``collate_fn`` defaults to ``VerlCollate`` of the config's row format; ``drop_last`` drops a final
    short batch; ``ledger``: a ``RunLedger`` actor that receives the counts. A dataclass, so that each subclass's
    constructor is this one's arguments plus its own fields, typed."""

    # what errors call a state of this class
    KIND: ClassVar[str] = "stream"

    files: FilesArg
    tokenizer: str | os.PathLike | None
    config: DataConfig | Mapping[str, Any] | None
    batch_size: int
    processor: str | os.PathLike | None = None
    collate_fn: Callable | None = field(default=None, kw_only=True)
    drop_last: bool = field(default=False, kw_only=True)
    ledger: Any = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        self.config = DataConfig.from_any(self.config)
        self.collate_fn = self.collate_fn or VerlCollate(row_format=self.config.row_format)
        self.epoch = 0
        self._position = ReadPosition()
        self._fingerprint: str | None = None  # of the data and settings the position belongs to; None: not known yet
        self._held_media = None  # media_handoff: the store of the rollout's media and the batches holding them

    # --- state ----------------------------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (its order depends only on (seed, epoch))."""
        self.epoch, self._position = int(epoch), ReadPosition()

    def _check_seed(self, state: Mapping[str, Any]) -> None:
        if state["seed"] != self.config.seed:
            raise ValueError(f"state was saved with seed {state['seed']}, this {self.KIND} has seed {self.config.seed}")

    def _plan(self) -> InputPlan:
        """The epoch's plan; a loaded state saved over other data or settings is refused here (its fingerprint)."""
        multimodal = self.processor is not None
        plan = plan_input(self.files, self.config, epoch=self.epoch, multimodal=multimodal)
        fingerprint = epoch_fingerprint(plan, self.config, multimodal)
        known = self._fingerprint
        if known not in (None, fingerprint) and known not in earlier_fingerprints(
            plan, self.config, multimodal, self.batch_size
        ):
            raise ValueError(
                f"{self.KIND} state belongs to other data or settings (files, row groups, read unit size, seed or "
                f"shuffle changed); start a fresh {self.KIND} or restore the original inputs"
            )
        self._fingerprint = fingerprint
        return plan

    # --- iteration ------------------------------------------------------------------------------------------------

    def _read(self, plan: InputPlan, units: Sequence[ReadUnit]) -> Iterator[pa.Table]:
        """The blocks of ``units`` (in their order) made by the actors, with their provenance columns."""
        media_store = self._begin_media_read(plan, units) if self.config.media_handoff else None
        ds = build_dataset(
            plan.files,
            self.tokenizer,
            self.config,
            self.processor,
            epoch=self.epoch,
            plan=InputPlan(plan.files, plan.infos, list(units)),
            ledger=self.ledger,
            keep_provenance=True,
            media_store=media_store,
        )
        blocks = iter(ds.iter_batches(batch_size=None, batch_format="pyarrow"))
        yield from blocks if media_store is None else self._held_media_blocks(blocks)

    def _begin_media_read(self, plan: InputPlan, units: Sequence[ReadUnit]) -> str:
        """``media_handoff``: a new read of ``units`` in this loader's ``HeldMedia``: its store's name."""
        from ingest.datasets.pools import ensure_ray
        from ingest.rollout_media import HeldMedia

        ensure_ray()
        if self._held_media is None:
            ahead, held = self.config.media_handoff_ahead or self.batch_size, self.config.media_handoff_held or 0
            self._held_media = HeldMedia(ahead, held)
        return self._held_media.begin(plan.context().files, units)

    def _held_media_blocks(self, blocks: Iterator[pa.Table]) -> Iterator[pa.Table]:
        """``blocks`` as the loader takes them, each one's media keys told to the read's store (and, while the loader
        waits for one, which units' blocks may pass the store's window)."""
        while True:
            with self._held_media.waiting_for_block():
                block = next(blocks, None)
            if block is None:
                return
            last = None if block.num_rows == 0 else (block[FILE_COLUMN][-1].as_py(), block[ROW_COLUMN][-1].as_py())
            self._held_media.delivered(block.column(MEDIA_KEY_COLUMN).to_pylist(), last)
            yield block

    @property
    def held_media(self):
        """With ``media_handoff``: the ``HeldMedia`` of the rollout's media this loader made (None before its first
        read)."""
        return self._held_media

    def _batches(self, blocks: Iterator[pa.Table], plan: InputPlan) -> Iterator[dict]:
        """The collated batches of ``blocks`` (the rest of the position's units, in order), moving the position."""
        unit_of, skips = UnitIndex(plan.units), self._position.skips
        for table, units in rebatch(blocks, unit_of, skips, self.batch_size, self.drop_last):
            # state first: a generator resumes after ``yield`` only when the next batch is asked for
            self._position.advance(units)
            if MEDIA_KEY_COLUMN in table.column_names:
                self._held_media.handed_out(table.column(MEDIA_KEY_COLUMN).to_pylist())
            internal = [c for c in (FILE_COLUMN, ROW_COLUMN, MEDIA_KEY_COLUMN) if c in table.column_names]
            yield self.collate_fn(table.drop_columns(internal))
