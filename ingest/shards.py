"""``PromptShard``: consumer k of N reads its own share of an epoch's read units, with a state that resumes under a
different number of consumers (elastic resume).

``Dataset.streaming_split`` hands blocks to whichever shard asks first, so which rows a consumer got is not a
function of (N, k) and cannot be rebuilt from a position. Here the share is deterministic instead: the epoch's read
units (``plan_input``: seeded order, seeded row order inside each unit, the same for every consumer) are dealt round
robin, unit ``i`` to shard ``i % N``, and each shard runs its own ``build_dataset`` over its units only. A shard's
state is its queue of units still to read, each with the number of its kept rows already handed out (``skip``):
exactly what is left, whatever the number of tokenizer actors (rows keep their order through the pools).

Resuming with M consumers: ``merge_shard_states`` joins the N shard states into the epoch's remaining units
(sorted by their place in the epoch's order), ``split_shard_state`` deals them round robin over M shards (a partly
read unit travels whole with its ``skip``). Kept: the set of rows (each not yet consumed row exactly once), and
order per old shard (every queue stays sorted by unit order, so a new shard reads each old shard's rows in the order
that shard would have). Not kept: which consumer gets a row, hence the global interleaving across consumers. With
M == N each shard can also load its own state unmerged and continue exactly where it stopped.

Shard state (``PromptShard.state_dict()``): ``{"version", "kind": "shard", "shard", "num_shards", "epoch", "seed",
"rows", "batches", "num_units", "units", "fingerprint"}``; ``units`` is ``[[unit, skip], ...]`` or ``None`` for the
untouched share ``i % num_shards == shard`` of the epoch. Merged state: ``kind`` ``"merged"``, no shard fields.
Plain JSON. The fingerprint (files, row groups, unit size, seed, shuffle) refuses other data; batch size and pool
sizes are not in it: positions count rows, and rows do not depend on either.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from ingest.config import DataConfig
from ingest.datasets.plan import FilesArg, InputPlan, plan_input
from ingest.read.units import UnitIndex
from ingest.resumable import ResumableBatches

SHARD_STATE_VERSION = 1


def _fingerprint(plan: InputPlan, config: DataConfig, multimodal: bool) -> str:
    """What decides the epoch's units and their row order, and nothing that varies by epoch (the units' order and
    the first unit's split do, and states of two epochs are merged)."""
    identity = {
        "files": plan.files,
        "row_groups": [list(info.row_group_rows) for info in plan.infos],
        "rows_per_task": config.read_rows_per_task,
        "first_unit_rows": config.read_first_unit_rows,
        "multimodal": multimodal,
        "seed": config.seed,
        "shuffle": config.shuffle,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def _rule_share(shard: int, num_shards: int, num_units: int) -> list[list[int]]:
    return [[unit, 0] for unit in range(shard, num_units, num_shards)]


def _check(state: Mapping[str, Any], kind: str) -> None:
    if state.get("version") != SHARD_STATE_VERSION:
        raise ValueError(f"unsupported shard state version {state.get('version')!r}")
    if state.get("kind") != kind:
        raise ValueError(f"expected a {kind!r} shard state, got {state.get('kind')!r}")


def merge_shard_states(states: Sequence[Mapping[str, Any]]) -> dict:
    """One state of what the N shards of a run have not consumed yet, independent of N (pass every shard's
    ``state_dict()``; a missing shard would lose its rows, so it is refused).

    Shards may stand at an epoch boundary: a shard that finished epoch e and has not read from e + 1 counts as done
    with e. A shard that has read from e + 1 while another is still in e is refused (its rows of e + 1 would have to
    be kept apart from the rest of e): save between batches of one epoch, as verl's trainer does."""
    if not states:
        raise ValueError("no shard states to merge")
    for state in states:
        _check(state, "shard")
    num_shards = {int(s["num_shards"]) for s in states}
    if len(num_shards) != 1 or sorted(int(s["shard"]) for s in states) != list(range(max(num_shards))):
        raise ValueError(
            f"need the states of all shards 0..{max(num_shards) - 1} of one run, exactly once each; got shards "
            f"{sorted(int(s['shard']) for s in states)} of {sorted(num_shards)}"
        )
    for key in ("seed", "fingerprint"):
        values = {s[key] for s in states if s.get(key) is not None}
        if len(values) > 1:
            raise ValueError(f"shard states of different runs ({key} differs: {sorted(map(str, values))})")
    seed = states[0]["seed"]
    fingerprint = next((s["fingerprint"] for s in states if s.get("fingerprint")), None)
    num_units = next((int(s["num_units"]) for s in states if s.get("num_units") is not None), None)
    epoch = min(int(s["epoch"]) for s in states)
    remaining: list[list[int]] = []
    rows = 0
    untouched = True  # every shard's share of ``epoch`` unread: the merged epoch is whole
    for state in sorted(states, key=lambda s: int(s["shard"])):
        if int(state["epoch"]) == epoch + 1 and state.get("units") is None:
            continue  # finished ``epoch``, nothing read from the next one
        if int(state["epoch"]) != epoch:
            raise ValueError(
                f"shard {state['shard']} has read from epoch {state['epoch']} while another shard is in epoch "
                f"{epoch}; save while all shards are in one epoch"
            )
        rows += int(state["rows"])
        if state.get("units") is None:
            if num_units is None:
                continue
            units = _rule_share(int(state["shard"]), int(state["num_shards"]), num_units)
        else:
            units = [[int(u), int(skip)] for u, skip in state["units"]]
            untouched = untouched and int(state["rows"]) == 0 and all(skip == 0 for _, skip in units)
        remaining.extend(units)
    whole = untouched and (num_units is None or len(remaining) == num_units)
    if not whole and not remaining:  # the epoch is all read: the next one, untouched
        epoch, whole, rows = epoch + 1, True, 0
    if whole:
        units_out = None
    else:
        units_out = sorted(remaining)
        if len({u for u, _ in units_out}) != len(units_out):
            raise ValueError("shard states share read units: they are not the shards of one run")
    return {
        "version": SHARD_STATE_VERSION,
        "kind": "merged",
        "epoch": epoch,
        "seed": seed,
        "rows": rows,
        "num_units": num_units,
        "units": units_out,
        "fingerprint": fingerprint,
    }


def split_shard_state(state: Mapping[str, Any], num_shards: int) -> list[dict]:
    """The states of ``num_shards`` new shards over what ``state`` (``merge_shard_states``) has left: its units in
    epoch order dealt round robin (a partly read unit goes whole, with its ``skip``), so each new queue keeps every
    old shard's order. Give state k to ``PromptShard(..., shard=k, num_shards=num_shards)``."""
    _check(state, "merged")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    units = state.get("units")
    return [
        {
            "version": SHARD_STATE_VERSION,
            "kind": "shard",
            "shard": k,
            "num_shards": num_shards,
            "epoch": int(state["epoch"]),
            "seed": state["seed"],
            "rows": 0,
            "batches": 0,
            "num_units": state.get("num_units"),
            "units": None if units is None else [list(pair) for pair in units[k::num_shards]],
            "fingerprint": state.get("fingerprint"),
        }
        for k in range(num_shards)
    ]


def reshard_states(states: Sequence[Mapping[str, Any]], num_shards: int) -> list[dict]:
    """``split_shard_state(merge_shard_states(states), num_shards)``: N shard states -> M."""
    return split_shard_state(merge_shard_states(states), num_shards)


class PromptShard(ResumableBatches):
    """Shard ``shard`` of ``num_shards``: an iterable of collated verl batches over its share of each epoch's read
    units, one epoch per ``iter()``, resumable (also under another shard count, through ``reshard_states``).

    Arguments as ``PromptStream``'s. Each consumer (a rollout actor, a trainer rank) makes its own ``PromptShard``;
    the shards share nothing at run time, so they may run at different speeds, in different processes."""

    def __init__(
        self,
        files: FilesArg,
        tokenizer: str | os.PathLike | None,
        config: DataConfig | Mapping[str, Any] | None,
        batch_size: int,
        processor: str | os.PathLike | None = None,
        *,
        shard: int = 0,
        num_shards: int = 1,
        collate_fn=None,
        drop_last: bool = False,
        ledger=None,
    ):
        if not 0 <= shard < num_shards:
            raise ValueError(f"need 0 <= shard < num_shards, got shard {shard} of {num_shards}")
        super().__init__(
            files, tokenizer, config, batch_size, processor, collate_fn=collate_fn, drop_last=drop_last, ledger=ledger
        )
        self.shard, self.num_shards = shard, num_shards
        self._queue: list[list[int]] | None = None  # [unit, kept rows of it already handed out]; None: the rule
        self._rows = 0  # rows handed out in this epoch
        self._batches = 0
        self._num_units: int | None = None
        self._fingerprint: str | None = None

    # --- state ----------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "version": SHARD_STATE_VERSION,
            "kind": "shard",
            "shard": self.shard,
            "num_shards": self.num_shards,
            "epoch": self.epoch,
            "seed": self.config.seed,
            "rows": self._rows,
            "batches": self._batches,
            "num_units": self._num_units,
            "units": None if self._queue is None else [list(pair) for pair in self._queue],
            "fingerprint": self._fingerprint,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A shard state of this shard (same ``shard`` / ``num_shards``), or a merged state, whose share for this
        shard is taken (``split_shard_state``: every consumer may load the same merged state)."""
        if state.get("kind") == "merged":
            state = split_shard_state(state, self.num_shards)[self.shard]
        _check(state, "shard")
        if (int(state["shard"]), int(state["num_shards"])) != (self.shard, self.num_shards):
            raise ValueError(
                f"state of shard {state['shard']} of {state['num_shards']} given to shard {self.shard} of "
                f"{self.num_shards}; reshard_states(states, {self.num_shards}) deals a run's states anew"
            )
        if state["seed"] != self.config.seed:
            raise ValueError(f"state was saved with seed {state['seed']}, this shard has seed {self.config.seed}")
        self.epoch = int(state["epoch"])
        self._rows, self._batches = int(state["rows"]), int(state["batches"])
        units = state.get("units")
        self._queue = None if units is None else [[int(u), int(skip)] for u, skip in units]
        self._num_units = None if state.get("num_units") is None else int(state["num_units"])
        self._fingerprint = state.get("fingerprint")

    def set_epoch(self, epoch: int) -> None:
        """Start this shard's share of ``epoch`` from its beginning."""
        self.epoch, self._queue, self._rows, self._batches = int(epoch), None, 0, 0

    def _plan(self) -> InputPlan:
        multimodal = self.processor is not None
        plan = plan_input(self.files, self.config, epoch=self.epoch, multimodal=multimodal)
        fingerprint = _fingerprint(plan, self.config, multimodal)
        if self._fingerprint is not None and self._fingerprint != fingerprint:
            raise ValueError(
                "shard state belongs to other data or settings (files, row groups, read unit size, seed or shuffle "
                "changed); start fresh shards or restore the original inputs"
            )
        if self._queue is None:
            self._queue = _rule_share(self.shard, self.num_shards, len(plan.units))
        if any(not 0 <= u < len(plan.units) for u, _ in self._queue):
            raise ValueError(f"shard state names read units beyond the epoch's {len(plan.units)}")
        self._fingerprint, self._num_units = fingerprint, len(plan.units)
        return plan

    # --- iteration ------------------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict]:
        plan = self._plan()
        if self._queue:
            yield from self._batched(self._blocks(plan), UnitIndex(plan.units))
        self.set_epoch(self.epoch + 1)

    def _blocks(self, plan: InputPlan) -> Iterator[pa.Table]:
        return self._read(plan, [plan.units[u] for u, _ in self._queue])

    def _batched(self, blocks: Iterator[pa.Table], unit_of: UnitIndex) -> Iterator[dict]:
        # rows of a partly read unit come again in the same order (seeded), so its first ``skip`` are the ones
        # handed out before; a merged queue may hold several such units
        skip_left = {u: skip for u, skip in self._queue if skip}
        pending: list[tuple[pa.Table, np.ndarray]] = []
        pending_rows = 0
        for block in blocks:
            units = unit_of.of_block(block)
            if skip_left:
                keep = np.ones(block.num_rows, dtype=bool)
                for u in [u for u in skip_left if u in units]:
                    where = np.flatnonzero(units == u)[: skip_left[u]]
                    keep[where] = False
                    skip_left[u] -= len(where)
                    if not skip_left[u]:
                        del skip_left[u]
                block, units = block.filter(pa.array(keep)), units[keep]
            if not block.num_rows:
                continue
            pending.append((block, units))
            pending_rows += block.num_rows
            while pending_rows >= self.batch_size:
                table = pa.concat_tables([t for t, _ in pending])
                all_units = np.concatenate([u for _, u in pending])
                cut = self.batch_size
                pending = [(table.slice(cut), all_units[cut:])]
                pending_rows -= cut
                yield self._emit(table.slice(0, cut), all_units[:cut])
        if pending_rows and not self.drop_last:
            yield self._emit(pa.concat_tables([t for t, _ in pending]), np.concatenate([u for _, u in pending]))

    def _emit(self, table: pa.Table, units: np.ndarray) -> dict:
        # state first: a generator resumes after ``yield`` only when the next batch is asked for
        last = int(units[-1])
        at = next(i for i, (u, _) in enumerate(self._queue) if u == last)
        # units before the last one's place are done (rows come in queue order); the last one may go on
        self._queue = self._queue[at:]
        self._queue[0] = [last, self._queue[0][1] + int((units == last).sum())]
        self._rows += table.num_rows
        self._batches += 1
        return self._collate(table)
