"""``PromptStream``: collated verl batches with exact, cheap resume (what verl's ``StatefulDataLoader`` gives).

Ray Data has no iterator state (ray-project/ray#48224), so the stream keeps its own. The order of rows is a pure
function of (files, config, seed, epoch): read units in a seeded order, rows in a seeded order inside each unit,
``preserve_order`` downstream. Every row carries its provenance (file, row) to the driver, so after each batch the
stream knows which unit the last row came from and how many kept rows of that unit it has handed out. That pair is
the position. Resuming rebuilds the dataset from that unit on (units before it are never read again), drops the
unit's rows already handed out, and batches from there: the batches are exactly those an uninterrupted epoch would
have yielded next.

State (``state_dict()``): ``{"version", "epoch", "seed", "batches", "position": {"unit", "rows"}, "fingerprint"}``,
plain JSON. The fingerprint (files, their row counts, read units, batch size, seed) makes a state refuse to load
into a stream over other data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa

from ingest.config import DataConfig
from ingest.datasets.handoff import ClusterHandoff
from ingest.datasets.local import DriverUnits, driver_can_start, made_in_order
from ingest.datasets.plan import FilesArg, InputPlan, plan_input
from ingest.memory import return_freed_heap
from ingest.read.units import UnitIndex
from ingest.resumable import ResumableBatches

logger = logging.getLogger(__name__)

STATE_VERSION = 1


class PromptStream(ResumableBatches):
    """Iterable of collated verl batches over ``files``, one epoch per ``iter()``, resumable mid-epoch.

    ``tokenizer``, ``config`` and ``processor`` are what ``build_dataset`` takes; ``collate_fn`` defaults to
    ``VerlCollate()``. Iterating yields the rest of the current epoch, then moves the state to the next epoch
    (position 0), so ``for epoch in ...: for batch in stream: ...`` walks epochs. ``drop_last`` drops a final short
    batch, as ``DataLoader(drop_last=True)`` does. ``ledger``: a ``RunLedger`` actor that receives the counts.
    ``driver_first_batch``: each (re)started epoch's first batch is made in this process before Ray starts, and the
    next ones while the cluster and the actors start; the actors make the rest (``datasets.local``,
    ``datasets.handoff``; not where the vision stage runs on GPU actors). Rows are made on two threads here, and
    on a cluster where the actors would be slower than the driver (text rows: one tokenizer actor; media rows: two
    CPUs) the driver makes the whole epoch: on a new local cluster, known before starting it, no cluster starts.
    """

    # threads making units in the driver: one encodes, decodes or resizes (no GIL) while the other runs Python
    DRIVER_THREADS = 2

    def __init__(
        self,
        files: FilesArg,
        tokenizer: str | os.PathLike | None,
        config: DataConfig | Mapping[str, Any] | None,
        batch_size: int,
        processor: str | os.PathLike | None = None,
        *,
        collate_fn=None,
        drop_last: bool = False,
        ledger=None,
        driver_first_batch: bool = True,
    ):
        super().__init__(
            files, tokenizer, config, batch_size, processor, collate_fn=collate_fn, drop_last=drop_last, ledger=ledger
        )
        self.driver_first_batch = driver_first_batch
        self._unit = 0  # position: order index of the unit the next row comes from ...
        self._rows = 0  # ... and how many of its kept rows were already yielded
        self._batches = 0  # batches yielded in this epoch
        self._fingerprint: str | None = None
        self._actors_start_s: float | None = None  # the last handoff's wait for the actors' first block

    # --- state ----------------------------------------------------------------------------------------------------

    def _plan(self) -> InputPlan:
        plan = plan_input(self.files, self.config, epoch=self.epoch, multimodal=self.processor is not None)
        identity = {
            "files": plan.files,
            "rows": [info.num_rows for info in plan.infos],
            "units": len(plan.units),
            "batch_size": self.batch_size,
            "seed": self.config.seed,
            "shuffle": self.config.shuffle,
        }
        fingerprint = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
        if self._fingerprint is not None and self._fingerprint != fingerprint:
            raise ValueError(
                "PromptStream state belongs to other data or settings (files, row counts, read units, batch size "
                "or seed changed); start a fresh stream or restore the original inputs"
            )
        self._fingerprint = fingerprint
        return plan

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "seed": self.config.seed,
            "batches": self._batches,
            "position": {"unit": self._unit, "rows": self._rows},
            "fingerprint": self._fingerprint,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported PromptStream state version {state.get('version')!r}")
        if state["seed"] != self.config.seed:
            raise ValueError(f"state was saved with seed {state['seed']}, this stream has seed {self.config.seed}")
        self.epoch = int(state["epoch"])
        self._batches = int(state["batches"])
        self._unit = int(state["position"]["unit"])
        self._rows = int(state["position"]["rows"])
        self._fingerprint = state.get("fingerprint")

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (its order depends only on (seed, epoch))."""
        self.epoch, self._unit, self._rows, self._batches = int(epoch), 0, 0, 0

    # --- iteration ------------------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict]:
        plan = self._plan()
        unit_of = UnitIndex(plan.units)
        if plan.units[self._unit :]:
            yield from self._batched(self._blocks(plan), unit_of)
        self.set_epoch(self.epoch + 1)

    def _blocks(self, plan: InputPlan) -> Iterator[pa.Table]:
        """The epoch's blocks from the position on: made in this process where the stages are light
        (``datasets.local``), the first batch before any cluster, worker or actor starts; then, while the cluster
        starts beside it, the driver goes on until the unit where the actors take over (``datasets.handoff``)."""
        units = plan.units[self._unit :]
        if not (self.driver_first_batch and driver_can_start(self.config, self.processor)):
            yield from self._read(plan, units)
            return
        skip = self._rows  # kept rows of the first unit handed out before (re)starting: made again, then dropped
        handoff: ClusterHandoff | None = None
        made = 0  # rows the driver has made
        actors_from = len(units)  # the first unit the actors make
        keeps = self._driver_keeps_epoch_without_cluster()
        if keeps is not None:  # no handoff, so no cluster: the epoch never needs one
            logger.info("the driver makes all %d read units (%s; no Ray cluster started)", len(units), keeps)

        def claimed() -> Iterator:
            """The units the driver makes, each claimed from the handoff as its thread starts it."""
            nonlocal handoff, actors_from
            for local, unit in enumerate(units):
                if keeps is None and made >= skip + self.batch_size:  # the rows to skip and one batch are made
                    if handoff is None:
                        handoff = ClusterHandoff(
                            lambda first: self._read(plan, units[first:]),
                            len(units),
                            local,
                            self._actors_start_s,
                            self._driver_keeps_epoch,
                        )
                    if not handoff.claim(local):
                        actors_from = local
                        return
                yield unit

        def new_driver() -> DriverUnits:
            context = plan.context(self.ledger, True, self.config.image_key)
            return DriverUnits(plan, self.config, context, self.tokenizer, self.processor, epoch=self.epoch)

        try:
            for block in made_in_order(new_driver, claimed(), self.DRIVER_THREADS, "ingest-driver"):
                made += block.num_rows
                yield block
            # the driver's stages and tokenizer (~100 MiB) are gone with its threads: the actors make the rest
            return_freed_heap()
            if actors_from < len(units):
                yield from handoff.blocks()
                self._actors_start_s = handoff.actors_start_s
        finally:
            if handoff is not None:
                handoff.close()

    def _driver_keeps_epoch_without_cluster(self) -> str | None:
        """Why the driver makes this whole epoch without starting the local cluster it would start, else None: the
        reason it would give once that cluster is up (``_driver_keeps_epoch``) is known before starting it."""
        from ingest.datasets.layout import driver_keeps_epoch
        from ingest.datasets.pools import new_local_cluster_resources

        resources, media = new_local_cluster_resources(), self.processor is not None
        return None if resources is None else driver_keeps_epoch(self.config, resources, media=media)

    def _driver_keeps_epoch(self) -> str | None:
        """Asked once the cluster is up: why the driver makes the rest of this epoch itself, else None."""
        import ray

        from ingest.datasets.layout import driver_keeps_epoch

        return driver_keeps_epoch(self.config, ray.cluster_resources(), media=self.processor is not None)

    def _batched(self, blocks: Iterator[pa.Table], unit_of: UnitIndex) -> Iterator[dict]:
        skip = self._rows  # kept rows of the first unit that were yielded before the restart
        pending: list[pa.Table] = []
        pending_rows = 0
        for block in blocks:
            if skip:
                dropped = min(skip, block.num_rows)
                block, skip = block.slice(dropped), skip - dropped
            if not block.num_rows:
                continue
            pending.append(block)
            pending_rows += block.num_rows
            while pending_rows >= self.batch_size:
                table = pa.concat_tables(pending)
                batch, rest = table.slice(0, self.batch_size), table.slice(self.batch_size)
                pending, pending_rows = [rest], rest.num_rows
                yield self._emit(batch, unit_of)
        if pending_rows and not self.drop_last:
            yield self._emit(pa.concat_tables(pending), unit_of)

    def _emit(self, table: pa.Table, unit_of: UnitIndex) -> dict:
        units = unit_of.of_block(table)
        last = int(units[-1])
        in_last = int((units == last).sum())
        # state first: a generator resumes after ``yield`` only when the next batch is asked for
        self._rows = self._rows + in_last if last == self._unit else in_last
        self._unit = last
        self._batches += 1
        return self._collate(table)
