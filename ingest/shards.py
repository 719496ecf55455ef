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
Plain JSON. The fingerprint (``resumable.epoch_fingerprint``: files, row groups, read unit sizes, seed, shuffle) refuses
other data; batch size and pool sizes are not in it: positions count rows, and rows do not depend on either.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ingest.datasets.plan import InputPlan
from ingest.rebatch import ReadPosition
from ingest.resumable import ResumableBatches

SHARD_STATE_VERSION = 1


def _rule_share(shard: int, num_shards: int, num_units: int) -> range:
    """The units shard ``shard`` of ``num_shards`` reads of an epoch nothing was read from: ``i % num_shards``."""
    return range(shard, num_units, num_shards)


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
            units = [[unit, 0] for unit in _rule_share(int(state["shard"]), int(state["num_shards"]), num_units)]
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


@dataclass(eq=False)
class PromptShard(ResumableBatches):
    """Shard ``shard`` of ``num_shards``: an iterable of collated verl batches over its share of each epoch's read
    units, one epoch per ``iter()``, resumable (also under another shard count, through ``reshard_states``).

    Other arguments as ``PromptStream``'s (``ResumableBatches``'s). Each consumer (a rollout actor, a trainer rank)
    makes its own ``PromptShard``; the shards share nothing at run time, so they may run at different speeds, in
    different processes."""

    KIND = "shard"

    shard: int = field(default=0, kw_only=True)
    num_shards: int = field(default=1, kw_only=True)

    def __post_init__(self) -> None:
        if not 0 <= self.shard < self.num_shards:
            raise ValueError(f"need 0 <= shard < num_shards, got shard {self.shard} of {self.num_shards}")
        super().__post_init__()
        self._units: list[int] | None = None  # this shard's units of the epoch, in order; None: the rule's share
        self._num_units: int | None = None

    # --- state: the position in this shard's units ----------------------------------------------------------------

    def _units_left(self) -> list[int]:
        """This shard's units not done yet (the one the position is in included), in order."""
        return [unit for unit in self._units or () if unit >= self._position.unit]

    def state_dict(self) -> dict:
        return {
            "version": SHARD_STATE_VERSION,
            "kind": "shard",
            "shard": self.shard,
            "num_shards": self.num_shards,
            "epoch": self.epoch,
            "seed": self.config.seed,
            "rows": self._position.rows,
            "batches": self._position.batches,
            "num_units": self._num_units,
            "units": None if self._units is None else [[u, self._position.skip(u)] for u in self._units_left()],
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
        self._check_seed(state)
        self.epoch = int(state["epoch"])
        queue = None if state.get("units") is None else [(int(u), int(skip)) for u, skip in state["units"]]
        self._units = None if queue is None else [unit for unit, _ in queue]
        self._position = ReadPosition(
            queue[0][0] if queue else 0,
            dict(queue or ()),
            rows=int(state["rows"]),
            batches=int(state["batches"]),
        )
        self._num_units = None if state.get("num_units") is None else int(state["num_units"])
        self._fingerprint = state.get("fingerprint")

    def set_epoch(self, epoch: int) -> None:
        """Start this shard's share of ``epoch`` from its beginning."""
        super().set_epoch(epoch)
        self._units = None

    def _plan(self) -> InputPlan:
        plan = super()._plan()
        if self._units is None:
            self._units = list(_rule_share(self.shard, self.num_shards, len(plan.units)))
        if any(not 0 <= u < len(plan.units) for u in self._units):
            raise ValueError(f"shard state names read units beyond the epoch's {len(plan.units)}")
        self._num_units = len(plan.units)
        return plan

    # --- iteration ------------------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict]:
        plan = self._plan()
        if units := self._units_left():
            yield from self._batches(self._read(plan, [plan.units[u] for u in units]), plan)
        self.set_epoch(self.epoch + 1)
