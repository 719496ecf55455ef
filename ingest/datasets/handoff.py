"""``ClusterHandoff``: the driver keeps making an epoch's rows while the Ray cluster and the actors start, and hands
the rest of the epoch over to them at a unit chosen once the cluster is up.

On a new cluster the start (``ray.init``, Ray Data's cluster actors, workers loading the tokenizer) takes seconds in
which the actors make nothing; the driver, whose stages are already loaded, makes rows meanwhile. The rows must stay
in order, so the epoch is split at one read unit: the driver makes the units before it, the actors the units from
it on. The split is chosen when ``ray.init`` returns: the driver's position plus the units it would make in the time
the rest of the start is expected to take (the last handoff's wait for the actors' first block, else as long as
``ray.init`` took). A small epoch may end in the driver before the split is chosen: no actor starts for it; nor
does one where ``driver_keeps`` gives a reason once the cluster is up (the actors would be slower than the driver).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator

import pyarrow as pa

from ingest.datasets.pools import ensure_ray_soon

logger = logging.getLogger(__name__)


class _Done:
    """The actors' blocks are over."""


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class ClusterHandoff:
    """Starts the cluster in a background thread and, at the chosen unit, the actors' read of the units from it on
    (``read(first_unit)`` yields their blocks in order). ``first_unit``: the unit the driver is making now, always its
    own. The driver asks ``claim(i)`` before making each later unit ``i``: False means the actors make it and every
    unit after it (``blocks()``). ``close()`` stops the background work."""

    # blocks the actors may have made ahead of the consumer beyond Ray Data's own buffers
    QUEUE_BLOCKS = 4

    def __init__(
        self,
        read: Callable[[int], Iterator[pa.Table]],
        num_units: int,
        first_unit: int,
        expected_start_s: float | None = None,
        driver_keeps: Callable[[], str | None] | None = None,
    ):
        self._read, self.num_units = read, num_units
        self._driver_keeps = driver_keeps
        self._lock = threading.Lock()
        self._claimed = first_unit + 1  # units [0, _claimed) are the driver's: first_unit is the one it makes now
        self._claimed_at_start = first_unit
        self._split: int | None = None
        self._error: BaseException | None = None
        self._expected_start_s = expected_start_s
        self._queue: queue.Queue = queue.Queue(maxsize=self.QUEUE_BLOCKS)
        self._closed = threading.Event()
        self._started = time.perf_counter()
        self._cluster = ensure_ray_soon()
        self.actors_start_s: float | None = None  # from building the actors' dataset to its first block
        self._thread = threading.Thread(target=self._run, name="ingest-cluster-handoff", daemon=True)
        self._thread.start()

    @property
    def split(self) -> int | None:
        """The first unit the actors make; None until chosen."""
        return self._split

    def claim(self, unit: int) -> bool:
        """True when the driver makes ``unit`` (it is before the split, or the split is not chosen yet); raises why
        the cluster did not start, so an epoch never ends in the driver without saying so."""
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._split is not None and unit >= self._split:
                return False
            self._claimed = max(self._claimed, unit + 1)
            return True

    def blocks(self) -> Iterator[pa.Table]:
        """The actors' blocks from the split on, in order; raises what the actors' read raised."""
        while True:
            item = self._queue.get()
            if isinstance(item, _Done):
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item

    def close(self) -> None:
        self._closed.set()

    def _choose_split(self) -> int:
        """Called once the cluster is up: ``elapsed`` is how long joining or starting it took."""
        reason = self._driver_keeps() if self._driver_keeps is not None else None
        with self._lock:
            if reason is not None:
                self._split = self.num_units
                logger.info("the driver makes all %d read units (%s)", self.num_units, reason)
                return self._split
            elapsed = time.perf_counter() - self._started
            rate = (self._claimed - self._claimed_at_start) / elapsed if elapsed > 0 else 0.0
            expected = self._expected_start_s if self._expected_start_s is not None else elapsed
            self._split = min(self.num_units, self._claimed + math.ceil(rate * expected))
            logger.info(
                "cluster ready after %.1f s; the driver makes read units up to %d of %d, the actors the rest",
                elapsed,
                self._split,
                self.num_units,
            )
            return self._split

    def _put(self, item) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            self._cluster.result()
            split = self._choose_split()
            if self._closed.is_set() or split >= self.num_units:
                self._put(_Done())
                return
            built = time.perf_counter()
            blocks = self._read(split)
            try:
                for block in blocks:
                    if self.actors_start_s is None:
                        self.actors_start_s = time.perf_counter() - built
                    if not self._put(block):
                        return
            finally:
                blocks.close()
            self._put(_Done())
        except BaseException as error:  # handed to the consumer's thread, raised there
            with self._lock:
                if self._split is None:  # the cluster did not start: no actor will make any unit
                    self._error = error
            self._put(_Failed(error))  # the actors' errors come after the rows before them, as without a handoff
