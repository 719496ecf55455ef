"""``made_in_order``: the driver's read units made on threads, handed out in order."""

import threading
import time

import pytest

from ingest.datasets.local import made_in_order


def _worker():
    """Yields two outputs per item, the later items faster (so on threads they finish first)."""

    def work(item: int):
        time.sleep(0.02 * (5 - item))
        yield (item, "a", threading.current_thread().name)
        yield (item, "b", threading.current_thread().name)

    return work


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_outputs_come_in_item_order_whatever_finishes_first(threads):
    outputs = list(made_in_order(_worker, range(5), threads, "made"))
    assert [(i, part) for i, part, _ in outputs] == [(i, part) for i in range(5) for part in "ab"]
    names = {name for _, _, name in outputs}
    if threads == 1:
        assert names == {threading.current_thread().name}
    else:
        assert all(name.startswith("made") for name in names) and len(names) > 1


def test_each_thread_builds_its_own_worker_once():
    built = []

    def new_worker():
        built.append(threading.current_thread().name)

        def work(item: int) -> list[int]:
            time.sleep(0.005)  # each item takes a while: the second thread gets items even on a loaded machine
            return [item]

        return work

    assert list(made_in_order(new_worker, range(20), 2, "made")) == list(range(20))
    assert len(built) == len(set(built)) == 2


def test_an_items_error_comes_after_its_earlier_outputs_and_later_items_are_not_started():
    drawn = []

    def items():
        for i in range(100):
            drawn.append(i)
            yield i

    def new_worker():
        def work(item):
            yield item
            if item == 3:
                raise ValueError("bad unit 3")
            yield item

        return work

    out = []
    with pytest.raises(ValueError, match="bad unit 3"):
        for value in made_in_order(new_worker, items(), 2, "made"):
            out.append(value)
    assert out == [0, 0, 1, 1, 2, 2, 3]
    assert max(drawn) <= 4  # at most `threads` items ahead of the one that failed


def test_items_are_drawn_only_as_outputs_are_handed_out():
    """With 2 threads the third item is drawn only after the first one's outputs are handed out: the stream's
    handoff decides at that draw from the rows it has seen."""
    handed, seen_at_draw = [], []

    def items():
        for i in range(4):
            seen_at_draw.append(len(handed))
            yield i

    for value in made_in_order(lambda: lambda item: [item], items(), 2, "made"):
        handed.append(value)
    assert seen_at_draw == [0, 0, 1, 2]


def test_ahead_lets_the_other_threads_go_on_past_a_slow_item():
    """With ``ahead`` above ``threads`` a slow oldest item holds up one thread, not the rest: the later items are made
    while it runs (with ``ahead == threads`` the second thread would wait after one item); outputs stay in order."""
    finished = []
    release = threading.Event()

    def new_worker():
        def work(item):
            if item == 0:
                assert release.wait(5)
            finished.append(item)
            if len(finished) == 5:
                release.set()
            yield item

        return work

    assert list(made_in_order(new_worker, range(8), 2, "made", ahead=6)) == list(range(8))
    assert finished[:5] == [1, 2, 3, 4, 5] and finished[5] == 0
