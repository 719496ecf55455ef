"""Feeding rollout workers: object refs of collated batches (push) and streaming-split shards (pull).

Push (``iter_batch_refs``): a Ray streaming-generator task iterates the dataset, collates each batch with
``VerlCollate()`` and yields it; every yield becomes one object in the object store, owned by the caller. The driver
only ever holds refs (the batches never pass through its memory) and hands them to rollout actors as arguments; Ray
resolves a top-level ``ObjectRef`` argument before the method runs. The task pauses while ``prefetch`` yielded refs
have not been taken from the iterator (Ray's generator backpressure), so production runs ahead of the consumer by a
bounded amount.

Zero copy (measured on Ray 2.60, see docs/feeding.md): numpy arrays are stored out of band and a reader on the same
node gets a read-only view into the shared-memory object store (``flags.writeable`` and ``flags.owndata`` false).
torch tensors go through torch's own pickle reducer and are copied on every read unless the writer runs with
``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1``. Numpy object arrays (``raw_prompt_ids``, dicts, PIL images) are pickled
in band and rebuilt on every read; numpy arrays nested inside them stay out of band. Hence the default
``tensors="numpy"``: ``batch_to_numpy`` turns the batch's tensors (and the tensors inside ``multi_modal_inputs``)
into numpy arrays sharing their memory before the batch is stored, and ``batch_to_torch`` turns them back on the
reader, still without a copy.

Pull (``split_for_rollout``): ``Dataset.streaming_split(n)`` shards, each iterated inside one rollout actor with
``iter_torch_batches(collate_fn=VerlCollate())``.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import ray

TENSOR_FORMATS = ("numpy", "torch")
# Keys whose per-row values are dicts of tensors (the processor's outputs).
_TENSOR_DICT_KEYS = ("multi_modal_inputs",)


def _tensor_dict_map(value, fn):
    return {k: fn(v) for k, v in value.items()} if isinstance(value, dict) else value


def _object_array_map(array: np.ndarray, fn) -> np.ndarray:
    out = np.empty(array.shape, dtype=object)
    for idx in np.ndindex(array.shape):
        out[idx] = _tensor_dict_map(array[idx], fn)
    return out


def batch_to_numpy(batch: dict[str, Any]) -> dict[str, Any]:
    """verl batch with every CPU ``torch.Tensor`` as a numpy array sharing its memory (no copy).

    Top-level tensors (``input_ids``, ``attention_mask``, ``position_ids``) and the tensors inside the per-row
    ``multi_modal_inputs`` dicts are converted; object arrays and everything else are kept. Numpy arrays are what
    Ray's object store serves zero-copy. Tensors on another device raise (collate on the CPU for refs).
    """
    import torch

    def to_numpy(value):
        if isinstance(value, torch.Tensor):
            if value.device.type != "cpu":
                raise ValueError(f"batch tensors must be on the CPU to be stored, got {value.device}")
            return value.detach().numpy()
        return value

    out = {}
    for key, value in batch.items():
        if key in _TENSOR_DICT_KEYS and isinstance(value, np.ndarray) and value.dtype == object:
            out[key] = _object_array_map(value, to_numpy)
        else:
            out[key] = to_numpy(value)
    return out


def batch_to_torch(batch: dict[str, Any], *, device: str | None = None, copy: bool = False) -> dict[str, Any]:
    """The inverse of ``batch_to_numpy``: numeric numpy arrays -> ``torch.Tensor`` (``multi_modal_inputs`` too).

    Without ``copy`` (and ``device``) the tensors share the arrays' memory: for a batch read from the object store
    that memory is the store's read-only shared buffer, so the tensors must not be written to in place (torch does
    not track read-only memory; ``copy=True`` gives private, writable tensors). ``device`` moves them (a copy).
    Object arrays stay numpy, as verl's ``DataProto.from_single_dict`` expects.
    """
    import torch

    def to_torch(value):
        if isinstance(value, np.ndarray) and value.dtype != object:
            if copy:
                value = value.copy()
            with warnings.catch_warnings():  # "The given NumPy array is not writable": read-only by contract
                warnings.simplefilter("ignore", UserWarning)
                tensor = torch.from_numpy(value)
            return tensor.to(device) if device is not None else tensor
        return value

    out = {}
    for key, value in batch.items():
        if key in _TENSOR_DICT_KEYS and isinstance(value, np.ndarray) and value.dtype == object:
            out[key] = _object_array_map(value, to_torch)
        else:
            out[key] = to_torch(value)
    return out


# How long iter_batch_refs waits for the producer's next batch before it gives up on it (stall_timeout_s's default)
STALL_TIMEOUT_S = 900.0


class ProducerStalledError(TimeoutError):
    """``iter_batch_refs``' producer task made no batch within ``stall_timeout_s``: the message names the task, its
    process and node, and where its threads' stacks were written."""


@ray.remote
def _produce_batches(source, batch_size: int, collate_fn, drop_last: bool, tensors: str, stall_timeout_s):
    """Streaming generator: first where it runs (pid, node), then one yielded (stored) object per collated batch.

    With ``stall_timeout_s``, a batch that takes over half of it to make gets the process's threads' stacks written
    to its stderr (the worker's log), again each half: a stalled producer has said where it waits by the time the
    consumer gives up on it. The clock stops while a yield waits for the consumer (a slow trainer is no stall)."""
    import faulthandler
    import os

    yield {"pid": os.getpid(), "node_ip": ray.util.get_node_ip_address()}
    watch, every_s = stall_timeout_s is not None, (stall_timeout_s or 0) / 2
    batches = source.iter_torch_batches(batch_size=batch_size, collate_fn=collate_fn, drop_last=drop_last, device="cpu")
    try:
        if watch:
            faulthandler.dump_traceback_later(every_s, repeat=True)
        for batch in batches:
            out = batch_to_numpy(batch) if tensors == "numpy" else batch
            if watch:
                faulthandler.cancel_dump_traceback_later()
            yield out
            if watch:
                faulthandler.dump_traceback_later(every_s, repeat=True)
    finally:
        if watch:
            faulthandler.cancel_dump_traceback_later()


def iter_batch_refs(
    ds,
    batch_size: int,
    *,
    collate_fn=None,
    prefetch: int = 2,
    drop_last: bool = False,
    tensors: str = "numpy",
    num_cpus: float = 0.5,
    stall_timeout_s: float | None = STALL_TIMEOUT_S,
) -> Iterator[ray.ObjectRef]:
    """``ray.ObjectRef``\\ s, each holding one collated verl batch of ``ds``, in the dataset's order.

    ``ds``: a ``ray.data.Dataset`` or ``DataIterator`` (e.g. one ``streaming_split`` shard). ``collate_fn``:
    default ``VerlCollate()`` (it must leave tensors on the CPU). A producer task (``num_cpus``) runs the pipeline
    and collation ahead of the consumer; it pauses while ``prefetch`` refs are waiting to be taken from this
    iterator. ``tensors="numpy"`` (default) stores tensors as numpy arrays, which readers on the node get as
    read-only zero-copy views (``batch_to_torch`` turns them back into tensors without a copy);
    ``tensors="torch"`` stores ``VerlCollate``'s output as is (Ray 2.60 copies torch tensors on every read).

    Hand each ref to a rollout actor as a top-level argument (``actor.generate.remote(ref)``): Ray resolves it
    before the method runs. A pipeline error (e.g. ``BadRowError``) is stored in place of the next batch and raised
    where that ref is resolved. Closing the iterator early stops the producer. Where the producer makes no batch
    within ``stall_timeout_s`` (None: wait for ever), it is stopped and ``ProducerStalledError`` names it.
    """
    from ingest.rowformat.collate import VerlCollate

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if prefetch < 1:
        raise ValueError(f"prefetch must be >= 1, got {prefetch}")
    if tensors not in TENSOR_FORMATS:
        raise ValueError(f"tensors must be one of {TENSOR_FORMATS}, got {tensors!r}")
    if stall_timeout_s is not None and stall_timeout_s <= 0:
        raise ValueError(f"stall_timeout_s must be > 0 or None, got {stall_timeout_s}")
    collate_fn = collate_fn if collate_fn is not None else VerlCollate()
    device = getattr(collate_fn, "device", None)
    if device is not None and str(device) != "cpu":
        raise ValueError(f"collate_fn moves tensors to {device!r}: batches for refs are collated on the CPU")
    producer = _produce_batches.options(num_cpus=num_cpus, _generator_backpressure_num_objects=prefetch)
    generator = producer.remote(ds, batch_size, collate_fn, drop_last, tensors, stall_timeout_s)
    finished = False
    try:
        where = ray.get(_next_ref(generator, stall_timeout_s, None, 0))
        for batches in itertools.count():
            ref = _next_ref(generator, stall_timeout_s, where, batches)
            if ref is None:
                break
            yield ref
        finished = True
    finally:
        # Stopped by killing its process (force): Ray's plain cancel raises KeyboardInterrupt at whatever line the
        # producer's main thread runs, which can leave a lock held (a logging handler's, between its acquire and its
        # try), and Ray reuses that worker: a later producer's threads then wait on that lock for ever.
        if not finished:
            ray.cancel(generator, force=True)


def _next_ref(generator, timeout_s: float | None, where: dict | None, batches: int) -> ray.ObjectRef | None:
    """The producer's next ref (None at its end), or ``ProducerStalledError`` after ``timeout_s`` without one."""
    # fetch_local=False: the batch stays where the producer stored it (the rollout workers fetch it, not this node)
    ready, _ = ray.wait([generator], timeout=timeout_s, fetch_local=False)
    if not ready:
        task = generator.completed().task_id().hex()
        process = f"pid {where['pid']} on {where['node_ip']}" if where else "it did not start"
        raise ProducerStalledError(
            f"iter_batch_refs: its producer task {task} ({process}) made no batch in {timeout_s:g} s after {batches} "
            "batches, and is stopped; its threads' stacks are in that worker's log (python-core-worker-*.err / "
            "worker-*.err of that pid). Raise stall_timeout_s where a batch may take longer."
        )
    try:
        return next(generator)
    except StopIteration:
        return None


def split_for_rollout(ds, n: int, *, equal: bool = False, locality_hints: list[str] | None = None) -> list:
    """``n`` disjoint ``DataIterator`` shards of ``ds`` (``Dataset.streaming_split``) for n rollout actors.

    Pass shard ``i`` to actor ``i``, which iterates it with ``iter_torch_batches(batch_size=...,
    collate_fn=VerlCollate())`` (or ``iter_batch_refs(shard, ...)``). All n shards must be iterated at the same
    time: they pull from one execution, and each new pass over them (an epoch) starts when every shard has asked
    for its first batch. ``equal=False`` (default) delivers every row exactly once, with shard sizes differing by
    up to a block; ``equal=True`` gives every shard the same number of rows by dropping the last
    ``num_rows % n`` rows of the epoch. ``locality_hints``: node ids of the n consumers.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return ds.streaming_split(n, equal=equal, locality_hints=locality_hints)
