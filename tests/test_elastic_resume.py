"""PromptShard: N consumers save their shard states mid-epoch, M consumers resume; exactly the rows not consumed come
next (none twice, none lost), each old shard's order kept; a changed tokenizer pool size changes nothing."""

from __future__ import annotations

import json
from collections import Counter

import pyarrow.parquet as pq
import pytest

from ingest import PromptShard, PromptStream, merge_shard_states, reshard_states, split_shard_state
from ingest.config import DataConfig
from ingest.datasets.plan import plan_input
from ingest.read.units import UnitIndex
from tests.support.tiers import slow

CONFIG = {"truncation": "left", "shuffle": True, "seed": 11, "read_rows_per_task": 30}
BATCH = 8


@pytest.fixture(scope="module")
def reference(ray_session, variety_files, model_dir):
    """One uninterrupted epoch's rows (``index``, in order) and each row's place in the epoch's unit order."""
    order = [int(i) for batch in PromptStream(variety_files, model_dir, CONFIG, BATCH) for i in batch["index"]]
    unit_of = UnitIndex(plan_input(variety_files, DataConfig.from_any(CONFIG)).units)
    unit = {}
    for f, path in enumerate(variety_files):
        indices = pq.read_table(path, columns=["extra_info"]).column("extra_info").combine_chunks().field("index")
        unit.update({int(i): unit_of(f, row) for row, i in enumerate(indices.to_pylist())})
    assert len(order) == len(set(order)) and len(order) < len(unit)  # overlong rows filtered: skips count kept rows
    return order, unit


def _read(shard: PromptShard | PromptStream, batches: int | None = None) -> list[int]:
    """The ``index`` of the rows of ``batches`` batches (all the epoch's with None); the iterator is closed after."""
    rows: list[int] = []
    it = iter(shard)
    for n, batch in enumerate(it, 1):
        rows.extend(int(i) for i in batch["index"])
        if n == batches:
            break
    it.close()
    return rows


def _share(order: list[int], unit: dict[int, int], k: int, n: int) -> list[int]:
    """What shard k of n reads in an uninterrupted epoch: the epoch's order restricted to units i % n == k."""
    return [i for i in order if unit[i] % n == k]


def _consume(files, model_dir, n: int, counts: list[int], config=CONFIG) -> tuple[list[list[int]], list[dict]]:
    shards = [PromptShard(files, model_dir, config, BATCH, shard=k, num_shards=n) for k in range(n)]
    before = [_read(s, c) if c else [] for s, c in zip(shards, counts, strict=True)]
    return before, [json.loads(json.dumps(s.state_dict())) for s in shards]  # as saved in a checkpoint


@slow
@pytest.mark.parametrize("n,m,counts", [(2, 3, [3, 7]), (4, 2, [1, 4, 2, 0])])
def test_resume_with_another_shard_count_yields_exactly_the_rest(
    ray_session, variety_files, model_dir, reference, n, m, counts
):
    order, unit = reference
    before, states = _consume(variety_files, model_dir, n, counts)
    for k in range(n):  # each consumer read the head of its deterministic share, in the epoch's order
        assert before[k] == _share(order, unit, k, n)[: counts[k] * BATCH]
    if 0 in counts:  # a consumer that read nothing saves no unit list: merging takes its whole share
        assert states[counts.index(0)]["units"] is None

    new_states = reshard_states(states, m)
    after = []
    for k, state in enumerate(new_states):
        shard = PromptShard(variety_files, model_dir, CONFIG, BATCH, shard=k, num_shards=m)
        shard.load_state_dict(state)
        after.append(_read(shard))
        assert shard.state_dict()["epoch"] == 1

    consumed = [i for rows in before + after for i in rows]
    assert Counter(consumed) == Counter(order)  # every row of the epoch exactly once
    assert all(after), "every new consumer gets work"
    for rows in after:  # within a new consumer, each old shard's rows come in that shard's order
        for k in range(n):
            mine = [i for i in rows if unit[i] % n == k]
            share = _share(order, unit, k, n)
            assert [share.index(i) for i in mine] == sorted(share.index(i) for i in mine)
    # a merged state loads the same way into every new consumer (each takes its own share)
    merged = merge_shard_states(states)
    assert split_shard_state(merged, m) == new_states
    assert len(merged["units"]) < len({*unit.values()})  # wholly read units are not read again
    assert merged["rows"] == sum(len(rows) for rows in before)


def _batches_after(consumer: PromptShard | PromptStream, state: dict) -> list[list[int]]:
    """The ``index`` of the rows of each batch ``consumer`` yields for the rest of the epoch from ``state``."""
    consumer.load_state_dict(json.loads(json.dumps(state)))
    return [[int(i) for i in batch["index"]] for batch in consumer]


def test_both_classes_resume_a_state_exactly_under_another_batch_size(ray_session, variety_files, model_dir, reference):
    """One policy: a position counts rows, so the batch size is in neither fingerprint. A state saved with one batch
    size loads into a ``PromptStream`` or a ``PromptShard`` of another, and what comes next is exactly the rest of
    the rows, in batches of the new size."""
    order, unit = reference
    resumed_batch = 5
    stream = PromptStream(variety_files, model_dir, CONFIG, BATCH)
    head = _read(stream, 3)
    batches = _batches_after(PromptStream(variety_files, model_dir, CONFIG, resumed_batch), stream.state_dict())
    assert head + [i for batch in batches for i in batch] == order
    assert {len(batch) for batch in batches[:-1]} == {resumed_batch}
    before, states = _consume(variety_files, model_dir, 2, [3, 2])
    for k, state in enumerate(states):
        shard = PromptShard(variety_files, model_dir, CONFIG, resumed_batch, shard=k, num_shards=2)
        batches = _batches_after(shard, state)
        assert before[k] + [i for batch in batches for i in batch] == _share(order, unit, k, 2)
        assert {len(batch) for batch in batches[:-1]} == {resumed_batch}


@slow
@pytest.mark.filterwarnings("ignore:The minimum number of concurrent actors")  # a shard may have fewer units left
def test_same_shard_count_with_another_tokenizer_pool_continues_each_shard_exactly(
    ray_session, variety_files, model_dir, reference
):
    order, unit = reference
    counts = [2, 5, 1]
    one_actor = {**CONFIG, "tokenizer_pool_min_size": 1, "tokenizer_pool_max_size": 1}
    before, states = _consume(variety_files, model_dir, 3, counts, one_actor)
    three_actors = {**CONFIG, "tokenizer_pool_min_size": 3, "tokenizer_pool_max_size": 3}
    for k, state in enumerate(states):
        shard = PromptShard(variety_files, model_dir, three_actors, BATCH, shard=k, num_shards=3)
        shard.load_state_dict(state)
        assert before[k] + _read(shard) == _share(order, unit, k, 3)  # exactly what an uninterrupted shard reads


def test_states_of_other_data_or_missing_shards_are_refused(ray_session, variety_files, model_dir, reference):
    _, states = _consume(variety_files, model_dir, 2, [1, 0])
    with pytest.raises(ValueError, match="all shards"):
        merge_shard_states(states[:1])
    other = PromptShard(variety_files[:2], model_dir, CONFIG, BATCH, shard=0, num_shards=3)
    other.load_state_dict(merge_shard_states(states))
    with pytest.raises(ValueError, match="other data"):
        next(iter(other))
    with pytest.raises(ValueError, match="shard 0 of 2 given to shard 1 of 2"):
        PromptShard(variety_files, model_dir, CONFIG, BATCH, shard=1, num_shards=2).load_state_dict(states[0])
    with pytest.raises(ValueError, match="seed"):
        PromptShard(variety_files, model_dir, {**CONFIG, "seed": 12}, BATCH, num_shards=2).load_state_dict(states[0])


def test_states_at_an_epoch_boundary():
    """A consumer that finished the epoch (and read nothing of the next) merges as done; one that read from the next
    epoch while another is still in this one is refused; a reshard of a reshard keeps the same units."""
    base = {"version": 1, "kind": "shard", "num_shards": 2, "seed": 11, "batches": 0, "num_units": 6}
    done = {**base, "shard": 0, "epoch": 1, "rows": 0, "units": None, "fingerprint": "f"}
    busy = {**base, "shard": 1, "epoch": 0, "rows": 12, "units": [[3, 4], [5, 0]], "fingerprint": "f"}
    merged = merge_shard_states([done, busy])
    assert (merged["epoch"], merged["units"], merged["rows"]) == (0, [[3, 4], [5, 0]], 12)
    assert [s["units"] for s in split_shard_state(merged, 3)] == [[[3, 4]], [[5, 0]], []]
    assert merge_shard_states(split_shard_state(merged, 3))["units"] == merged["units"]
    ahead = {**done, "rows": 8, "units": [[0, 8], [2, 0], [4, 0]]}
    with pytest.raises(ValueError, match="one epoch"):
        merge_shard_states([ahead, busy])
    finished = merge_shard_states([done, {**done, "shard": 1}])
    assert (finished["epoch"], finished["units"]) == (1, None)
    with pytest.raises(ValueError, match="different runs"):
        merge_shard_states([done, {**busy, "fingerprint": "g"}])
