"""Blocks -> batches of a fixed number of rows, and the read position each batch leaves: the one re-batcher of
``PromptStream`` and ``PromptShard``.

A consumer reads its read units (named by their place in the epoch's unit order) in ascending order, and a unit's
rows always come in the same seeded order. So where it stands is the unit it is reading and, for each partly read
unit, how many of its kept rows were already handed out: rebuilt from there, the same units give the same rows, and
dropping each unit's first ``skip`` rows leaves exactly the rows not handed out yet, in order, whatever the batch
size.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from ingest.read.units import UnitIndex


@dataclass
class ReadPosition:
    """How far a consumer has read its units of an epoch.

    ``unit``: the unit the last handed-out row came from (every unit before it is done; 0 before any batch).
    ``skips``: kept rows already handed out per partly read unit, that unit and later ones (a merged shard state
    may hold several). ``rows`` / ``batches``: handed out in this epoch (a ``PromptStream`` state keeps no rows)."""

    unit: int = 0
    skips: dict[int, int] = field(default_factory=dict)
    rows: int = 0
    batches: int = 0

    def skip(self, unit: int) -> int:
        """Kept rows of ``unit`` already handed out."""
        return self.skips.get(unit, 0)

    def advance(self, units: np.ndarray) -> None:
        """A batch was handed out; ``units``: the unit of each of its rows, in order."""
        last = int(units[-1])
        in_last = self.skip(last) + int((units == last).sum())
        # units are read in ascending order: those before the batch's last one are done, the last one may go on
        self.skips = {unit: skip for unit, skip in self.skips.items() if unit > last}
        self.skips[last] = in_last
        self.unit = last
        self.rows += len(units)
        self.batches += 1


def rebatch(
    blocks: Iterable[pa.Table], unit_of: UnitIndex, skips: Mapping[int, int], batch_size: int, drop_last: bool
) -> Iterator[tuple[pa.Table, np.ndarray]]:
    """Batches of ``batch_size`` rows of ``blocks`` (a short last one unless ``drop_last``), each with the unit of
    each of its rows (``unit_of``: the blocks carry the provenance columns). The first ``skips[u]`` rows of unit
    ``u`` are dropped: a partly read unit's rows come again in the same order, so those are the ones handed out."""
    skip_left = {unit: skip for unit, skip in skips.items() if skip}
    pending: list[tuple[pa.Table, np.ndarray]] = []
    pending_rows = 0
    for block in blocks:
        units = unit_of.of_block(block)
        if skip_left:
            block, units = _drop_handed_out(block, units, skip_left)
        if not block.num_rows:
            continue
        pending.append((block, units))
        pending_rows += block.num_rows
        while pending_rows >= batch_size:
            table = pa.concat_tables([t for t, _ in pending])
            all_units = np.concatenate([u for _, u in pending])
            pending = [(table.slice(batch_size), all_units[batch_size:])]
            pending_rows -= batch_size
            yield table.slice(0, batch_size), all_units[:batch_size]
    if pending_rows and not drop_last:
        yield pa.concat_tables([t for t, _ in pending]), np.concatenate([u for _, u in pending])


def _drop_handed_out(block: pa.Table, units: np.ndarray, skip_left: dict[int, int]) -> tuple[pa.Table, np.ndarray]:
    """``block`` without the rows of ``skip_left``'s units still to drop (counted down, and removed at 0)."""
    keep = np.ones(block.num_rows, dtype=bool)
    for unit in [u for u in skip_left if u in units]:
        where = np.flatnonzero(units == unit)[: skip_left[unit]]
        keep[where] = False
        skip_left[unit] -= len(where)
        if not skip_left[unit]:
            del skip_left[unit]
    return block.filter(pa.array(keep)), units[keep]
