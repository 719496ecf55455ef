"""``ClusterHandoff``: the split between the driver's units and the actors' is chosen once, never moves under the
driver, the actors' blocks come in order (or their error), and a closed handoff stops its background work."""

from __future__ import annotations

import threading
import time

import pyarrow as pa
import pytest

from ingest.datasets.handoff import ClusterHandoff


def _blocks_from(first: int, num_units: int, log: list) -> object:
    log.append(first)
    for unit in range(first, num_units):
        yield pa.table({"unit": [unit]})


def _wait_for_split(handoff: ClusterHandoff) -> int:
    deadline = time.monotonic() + 30
    while handoff.split is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert handoff.split is not None
    return handoff.split


def test_the_driver_and_the_actors_share_the_units_in_order(ray_session):
    """Nothing expected of the start (a running cluster): the actors take over after the units the driver claimed,
    and driver units + actors' units are every unit once, in order."""
    reads: list[int] = []
    handoff = ClusterHandoff(lambda first: _blocks_from(first, 10, reads), 10, first_unit=2, expected_start_s=0.0)
    made = []
    unit = 2
    while handoff.claim(unit):
        made.append(unit)
        unit += 1
        time.sleep(0.05)  # a driver that is slower than the split's choice
    split = _wait_for_split(handoff)
    actors = [block["unit"][0].as_py() for block in handoff.blocks()]
    handoff.close()
    assert made == list(range(2, split)) and actors == list(range(split, 10))
    assert reads == [split]
    assert handoff.actors_start_s is not None


def test_a_split_past_the_end_leaves_every_unit_to_the_driver(ray_session):
    """A long expected start and a fast driver: the driver makes all units; the actors' read never starts."""
    reads: list[int] = []
    handoff = ClusterHandoff(lambda first: _blocks_from(first, 50, reads), 50, first_unit=0, expected_start_s=3600.0)
    assert _wait_for_split(handoff) == 50
    assert all(handoff.claim(unit) for unit in range(3, 50))
    assert list(handoff.blocks()) == [] and reads == []
    handoff.close()


def test_a_reason_to_keep_the_epoch_leaves_every_unit_to_the_driver(ray_session):
    """A running cluster and nothing expected of its start, but ``driver_keeps`` gives a reason (the actors would be
    slower): the split is the end, asked once the cluster is up; the actors' read never starts."""
    reads: list[int] = []
    asked = []
    handoff = ClusterHandoff(
        lambda first: _blocks_from(first, 20, reads), 20, 0, 0.0, lambda: asked.append(1) or "one actor"
    )
    assert _wait_for_split(handoff) == 20 and asked == [1]
    assert all(handoff.claim(unit) for unit in range(1, 20))
    assert list(handoff.blocks()) == [] and reads == []
    handoff.close()


def test_the_actors_error_reaches_the_consumer_after_the_rows_before_it(ray_session):
    """An error in the actors' read comes out of ``blocks()`` after their earlier blocks, not at the driver's next
    ``claim`` (which would put it before rows that precede it)."""

    def failing(first: int):
        yield pa.table({"unit": [first]})
        raise ValueError("bad unit")

    handoff = ClusterHandoff(failing, 5, first_unit=0, expected_start_s=0.0)
    split = _wait_for_split(handoff)
    time.sleep(0.5)  # the read has failed by now
    assert not handoff.claim(split)
    blocks = handoff.blocks()
    assert next(blocks)["unit"][0].as_py() == split
    with pytest.raises(ValueError, match="bad unit"):
        next(blocks)
    handoff.close()


def test_close_stops_the_actors_read(ray_session):
    """A consumer that stops early: the background thread leaves the read (closing it) instead of waiting forever
    on a full queue."""
    closed = threading.Event()

    def endless(first: int):
        try:
            unit = first
            while True:
                yield pa.table({"unit": [unit]})
                unit += 1
        finally:
            closed.set()

    handoff = ClusterHandoff(endless, 10**9, first_unit=0, expected_start_s=0.0)
    _wait_for_split(handoff)
    next(handoff.blocks())
    handoff.close()
    assert closed.wait(10)
