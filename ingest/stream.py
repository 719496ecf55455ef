"""``PromptStream``: collated verl batches with exact, cheap resume (what verl's ``StatefulDataLoader`` gives).

Ray Data has no iterator state (ray-project/ray#48224), so the stream keeps its own. The order of rows is a pure
function of (files, config, seed, epoch): read units in a seeded order, rows in a seeded order inside each unit,
``preserve_order`` downstream. Every row carries its provenance (file, row) to the driver, so after each batch the
stream knows which unit the last row came from and how many kept rows of that unit it has handed out. That pair is
the position. Resuming rebuilds the dataset from that unit on (units before it are never read again), drops the
unit's rows already handed out, and batches from there: the rows are exactly those an uninterrupted epoch would have
yielded next (with the same batch size, so are the batches).

State (``state_dict()``): ``{"version", "epoch", "seed", "batches", "position": {"unit", "rows"}, "fingerprint"}``,
plain JSON. The fingerprint (``resumable.epoch_fingerprint``: files, row groups, read unit sizes, seed, shuffle)
makes a state refuse to load into a stream over other data; the batch size is not in it, so a state resumes exactly
under another batch size (states saved before kept it, and still load with their own).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from ingest.datasets.handoff import ClusterHandoff
from ingest.datasets.local import DriverUnits, driver_can_start, made_in_order
from ingest.datasets.plan import InputPlan
from ingest.memory import return_freed_heap
from ingest.rebatch import ReadPosition
from ingest.resumable import ResumableBatches

logger = logging.getLogger(__name__)

STATE_VERSION = 1


@dataclass(eq=False)
class PromptStream(ResumableBatches):
    """Iterable of collated verl batches over ``files``, one epoch per ``iter()``, resumable mid-epoch.

    Arguments: ``ResumableBatches``'s (``files``, ``tokenizer``, ``config``, ``batch_size``, ``processor``: as
    ``build_dataset`` takes them; ``collate_fn``, default ``VerlCollate()``; ``drop_last``; ``ledger``), and
    ``driver_first_batch``. Iterating yields the rest of the current epoch, then moves the state to the next epoch
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

    driver_first_batch: bool = field(default=True, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._actors_start_s: float | None = None  # the last handoff's wait for the actors' first block

    # --- state: the position is the unit the next row comes from and how many of its kept rows were yielded -------

    def state_dict(self) -> dict:
        position = self._position
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "seed": self.config.seed,
            "batches": position.batches,
            "position": {"unit": position.unit, "rows": position.skip(position.unit)},
            "fingerprint": self._fingerprint,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported PromptStream state version {state.get('version')!r}")
        self._check_seed(state)
        self.epoch = int(state["epoch"])
        unit, rows = int(state["position"]["unit"]), int(state["position"]["rows"])
        self._position = ReadPosition(unit, {unit: rows}, batches=int(state["batches"]))
        self._fingerprint = state.get("fingerprint")

    # --- iteration ------------------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict]:
        plan = self._plan()
        if plan.units[self._position.unit :]:
            yield from self._batches(self._blocks(plan), plan)
        self.set_epoch(self.epoch + 1)

    def _blocks(self, plan: InputPlan) -> Iterator[pa.Table]:
        """The epoch's blocks from the position on: made in this process where the stages are light
        (``datasets.local``), the first batch before any cluster, worker or actor starts; then, while the cluster
        starts beside it, the driver goes on until the unit where the actors take over (``datasets.handoff``)."""
        units = plan.units[self._position.unit :]
        if self.config.media_handoff and self.driver_first_batch:  # the store needs Ray up: it starts first
            from ingest.datasets.pools import ensure_ray

            ensure_ray()
            keeps = self._driver_keeps_epoch() if self.processor is not None else None
            yield from self._read(plan, units) if keeps is None else self._made_by_media_store(plan, units, keeps)
            return
        if not (self.driver_first_batch and driver_can_start(self.config, self.processor)):
            yield from self._read(plan, units)
            return
        # kept rows of the first unit handed out before (re)starting: made again, then dropped
        skip = self._position.skip(self._position.unit)
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

    def _made_by_media_store(self, plan: InputPlan, units, keeps: str) -> Iterator[pa.Table]:
        """``media_handoff`` where the driver would make the epoch (``keeps``: why): the read's store makes the units
        as the driver would, rows and media (``MediaStore.make_unit``), and owns the media: no actor pool, no copy of
        the media, and none of their bytes in this process."""
        import dataclasses

        import ray

        logger.info("the media store makes all %d read units (%s)", len(units), keeps)
        store_name = self._begin_media_read(plan, units)
        store = self._held_media.store
        context = dataclasses.replace(plan.context(self.ledger, True, self.config.image_key), media_store=store_name)
        tokenizer = None if self.tokenizer is None else str(self.tokenizer)
        driver_units = functools.partial(DriverUnits, plan, self.config, context, tokenizer, str(self.processor))
        ray.get(store.start_making.remote(functools.partial(driver_units, epoch=self.epoch)))

        def new_maker():
            return lambda unit: ray.get(store.make_unit.remote(unit))

        # two units asked for at a time: the store makes the next while the loader takes this one's blocks
        made = made_in_order(new_maker, units, self.DRIVER_THREADS, "ingest-media-units")
        try:
            yield from self._held_media_blocks(made)
        finally:  # stopped part way: a unit waiting for the window's room would hold up the threads' end
            store.stop_making.remote()
            made.close()

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
