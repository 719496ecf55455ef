"""Feeding trainers and rollout workers: object refs, streaming splits, DataProto, devices."""

from __future__ import annotations

import io
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
import ray
import torch
from PIL import Image
from ray import cloudpickle
from ray.data.collate_fn import NumpyBatchCollateFn

from ingest import VerlCollate, build_dataset, iter_batch_refs
from ingest.demo import write_gsm8k_parquet
from ingest.feed import ProducerStalledError, batch_to_numpy, batch_to_torch, split_for_rollout
from tests.support.batches import collect
from tests.support.compare import assert_same, assert_same_batches
from tests.support.tiers import slow
from tools.oracle import oracle_available, run_verl_dataproto
from tools.samples import write_geo3k_parquet

# Classes below (rollout actors, a counting collate) travel to Ray workers by value, not by module name.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

TEXT_ROWS = 200  # 200 % 3 == 2: equal=True splits must drop exactly 2 rows
TEXT_CONFIG = {"shuffle": False, "max_prompt_length": 256, "truncation": "error"}
MM_ROWS = 16
MM_CONFIG = {"shuffle": False, "max_prompt_length": 4096, "truncation": "left", "return_raw_chat": True}
BATCH = 16


@pytest.fixture(scope="module")
def text_files(tmp_path_factory):
    return write_gsm8k_parquet(tmp_path_factory.mktemp("feed-text"), TEXT_ROWS, num_files=2, row_group_size=25)


@pytest.fixture(scope="module")
def text_ds(ray_session, text_files, model_dir):
    """The tokenized rows, materialized once (the feeding tests below do not need to re-run the tokenizer)."""
    return build_dataset(text_files, model_dir, TEXT_CONFIG).materialize()


@pytest.fixture(scope="module")
def text_batches(text_ds):
    return collect(text_ds, BATCH)


@pytest.fixture(scope="module")
def mm_files(tmp_path_factory):
    return write_geo3k_parquet(tmp_path_factory.mktemp("feed-geo3k"), MM_ROWS, row_group_size=8)


@pytest.fixture(scope="module")
def mm_ds(ray_session, mm_files, model_dir):
    return build_dataset(mm_files, model_dir, MM_CONFIG, processor=model_dir).materialize()


@pytest.fixture(scope="module")
def mm_batches(mm_ds):
    return collect(mm_ds, 8)


def _in_object_store(address: int) -> bool:
    """Whether ``address`` lies in this process's mapping of Ray's shared-memory object store (plasma)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            low, high = (int(x, 16) for x in parts[0].split("-"))
            if low <= address < high:
                return len(parts) > 5 and "plasma" in parts[5]
    return False


@ray.remote(num_cpus=0)
class Rollout:
    """A stand-in rollout worker: records the prompts (``index``) it was given."""

    def __init__(self):
        self.seen = []

    def generate(self, batch):  # called with an ObjectRef: Ray resolves it before the method runs
        self.seen.extend(int(i) for i in batch["index"])
        return len(batch["index"])

    def consume(self, shard, batch_size):  # pull model: iterate a streaming_split shard here
        for batch in shard.iter_torch_batches(batch_size=batch_size, collate_fn=VerlCollate()):
            assert isinstance(batch["input_ids"], torch.Tensor)
            self.seen.extend(int(i) for i in batch["index"])
        return len(self.seen)

    def inspect(self, batch):
        """How the resolved argument's payload is held in this process."""
        out = {}
        for key, value in batch.items():
            if isinstance(value, np.ndarray) and value.dtype != object:
                store = _in_object_store(value.ctypes.data)
                out[key] = ("numpy", value.flags.writeable, value.flags.owndata, store)
            elif isinstance(value, torch.Tensor):
                out[key] = ("torch", None, None, _in_object_store(value.data_ptr()))
            else:
                out[key] = (type(value).__name__, str(value.dtype), None, None)
        if "multi_modal_inputs" in batch:
            pixels = batch["multi_modal_inputs"][0]["pixel_values"]
            out["pixel_values"] = (type(pixels).__name__, pixels.flags.writeable, _in_object_store(pixels.ctypes.data))
            image = batch["multi_modal_data"][0]["image"][0]
            out["image"] = (type(image).__name__, image.mode)
        converted = batch_to_torch(batch)
        out["as_torch"] = {k: type(v).__name__ for k, v in converted.items()}
        out["as_torch_shares_memory"] = (
            isinstance(batch["input_ids"], np.ndarray)
            and converted["input_ids"].data_ptr() == batch["input_ids"].ctypes.data
        )
        return out

    def indices(self):
        return self.seen


@ray.remote(num_cpus=0)
class Counter:
    def __init__(self):
        self.count = 0

    def incr(self):
        self.count += 1

    def value(self):
        return self.count


class CountingCollate(VerlCollate):
    """``VerlCollate`` that reports every batch it builds to a named ``Counter`` actor."""

    def __init__(self, counter_name: str):
        super().__init__()
        self.counter_name = counter_name

    def __call__(self, batch):
        ray.get(ray.get_actor(self.counter_name).incr.remote())
        return super().__call__(batch)


def _round_robin(refs, actors):
    calls = [actors[i % len(actors)].generate.remote(ref) for i, ref in enumerate(refs)]
    return sum(ray.get(calls))


# --- push model: iter_batch_refs ----------------------------------------------------------------------------------


@slow
def test_refs_from_the_live_pipeline_hold_verl_batches_in_order(ray_session, text_files, model_dir, text_batches):
    """The producer task runs the whole pipeline (not materialized): same batches, same order, as the driver's."""
    ds = build_dataset(text_files, model_dir, TEXT_CONFIG)
    refs = list(iter_batch_refs(ds, BATCH, tensors="torch"))
    assert all(isinstance(r, ray.ObjectRef) for r in refs)
    assert_same_batches([ray.get(r) for r in refs], text_batches)


def test_numpy_refs_round_trip_to_the_collated_batch(ray_session, text_ds, text_batches):
    refs = list(iter_batch_refs(text_ds, BATCH))  # default tensors="numpy"
    stored = [ray.get(r) for r in refs]
    assert isinstance(stored[0]["input_ids"], np.ndarray) and stored[0]["input_ids"].dtype == np.int64
    assert_same_batches([batch_to_torch(b, copy=True) for b in stored], text_batches)
    # a DataIterator works as the source too (here the single shard of a streaming split)
    shard_refs = iter_batch_refs(split_for_rollout(text_ds, 1)[0], BATCH)
    assert_same_batches([batch_to_torch(ray.get(r)) for r in shard_refs], text_batches)
    # drop_last: 200 rows in batches of 16 -> 12 full batches
    assert [len(b["index"]) for b in map(ray.get, iter_batch_refs(text_ds, BATCH, drop_last=True))] == [BATCH] * 12


@slow
def test_rollout_actor_reads_numpy_payloads_zero_copy(ray_session, text_ds):
    actor = Rollout.remote()
    numpy_ref = next(iter(iter_batch_refs(text_ds, BATCH)))
    seen = ray.get(actor.inspect.remote(numpy_ref))
    for key in ("input_ids", "attention_mask", "position_ids"):
        kind, writeable, owndata, in_store = seen[key]
        assert kind == "numpy" and not writeable and not owndata and in_store, (key, seen[key])  # a store view
    assert seen["raw_prompt_ids"][0] == "ndarray" and seen["index"][1] == "object"
    assert seen["as_torch"]["input_ids"] == "Tensor" and seen["as_torch"]["raw_prompt_ids"] == "ndarray"
    assert seen["as_torch_shares_memory"]  # batch_to_torch wraps the store's buffer, no copy

    torch_ref = next(iter(iter_batch_refs(text_ds, BATCH, tensors="torch")))
    seen = ray.get(actor.inspect.remote(torch_ref))
    # Ray 2.60 (RAY_ENABLE_ZERO_COPY_TORCH_TENSORS unset) unpickles torch tensors into private process memory
    assert seen["input_ids"] == ("torch", None, None, False)


def test_prefetch_bounds_the_batches_made_ahead(ray_session, text_ds):
    counter = Counter.options(name="feed-test-counter").remote()
    ray.get(counter.value.remote())
    refs = iter_batch_refs(text_ds, 8, collate_fn=CountingCollate("feed-test-counter"), prefetch=2)
    next(refs)
    time.sleep(3)  # unbounded, the producer would collate all 25 batches of the materialized rows by now
    made = ray.get(counter.value.remote())
    assert 1 <= made <= 1 + 2 + 2, made  # the taken batch, 2 waiting refs, and the iterator's own collate-ahead
    rest = list(refs)
    assert 1 + len(rest) == 25 and ray.get(counter.value.remote()) == 25


def _cpus_settle(timeout=30.0, quiet_s=3):
    """Available CPUs once unchanged for ``quiet_s`` one-second reads (actor pools of earlier datasets shut down
    asynchronously, one actor at a time: a single unchanged read can fall between two of them)."""
    deadline, last, unchanged = time.monotonic() + timeout, None, 0
    while time.monotonic() < deadline:
        now = ray.available_resources().get("CPU", 0.0)
        unchanged = unchanged + 1 if now == last else 0
        if unchanged >= quiet_s:
            return now
        last = now
        time.sleep(1.0)
    return last


def _cpus_reach(value, timeout=20.0):
    """Available CPUs once they equal ``value`` (the resource view lags task starts and ends), else the last seen."""
    deadline = time.monotonic() + timeout
    while (now := ray.available_resources().get("CPU", 0.0)) != pytest.approx(value) and time.monotonic() < deadline:
        time.sleep(0.1)
    return now


def test_closing_the_iterator_early_cancels_the_producer(ray_session, text_ds):
    counter = Counter.options(name="feed-test-close-counter").remote()
    idle = _cpus_settle()
    refs = iter_batch_refs(text_ds, 8, collate_fn=CountingCollate("feed-test-close-counter"), prefetch=1)
    first = next(refs)
    assert _cpus_reach(idle - 0.5) == pytest.approx(idle - 0.5)  # the producer, paused by backpressure
    refs.close()
    assert _cpus_reach(idle) == pytest.approx(idle)  # its CPU is back
    time.sleep(2.0)
    assert ray.get(counter.value.remote()) < 25  # cancelled, not run to the end once nobody reads its refs
    assert len(ray.get(first)["index"]) == 8  # refs already handed out stay valid


class PidCollate(VerlCollate):
    """``VerlCollate`` that adds the collating process's pid (the producer task's) to each batch."""

    def __call__(self, batch):
        import os

        return {**super().__call__(batch), "producer_pid": np.array([os.getpid()])}


def _gone(pid: int, timeout: float = 30.0) -> bool:
    """Whether process ``pid`` has ended (or is a zombie) within ``timeout``."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_a_producer_stopped_early_leaves_no_process_for_ray_to_reuse(ray_session, text_ds):
    """Ray's plain cancel raises KeyboardInterrupt wherever the producer's main thread is, which can leave a lock held
    (a logging handler's, between its acquire and its try), and Ray runs its next task in that process: a later
    producer's threads then waited on that lock for ever. Closing the iterator early ends the producer's process."""
    refs = iter_batch_refs(text_ds, 8, collate_fn=PidCollate(), prefetch=1)
    pid = int(ray.get(next(refs))["producer_pid"][0])
    refs.close()
    assert _gone(pid), f"the producer's process {pid} is still there for Ray to reuse"


class PlainCollate(NumpyBatchCollateFn):
    def __call__(self, batch):
        return dict(batch)


def _stall_in_the_last_block(batch: dict) -> dict:
    if batch["id"][0] >= 48:
        time.sleep(60)
    return batch


def test_a_stalled_producer_ends_in_an_error_naming_it(ray_session):
    """A producer that makes no batch within ``stall_timeout_s`` is stopped, and the consumer gets an error naming
    its task, process and node instead of waiting for ever; the batches made before it are handed out."""
    ds = ray.data.range(64, override_num_blocks=4).map_batches(_stall_in_the_last_block, batch_size=16)
    ds.context.execution_options.preserve_order = True
    handed_out = []
    with pytest.raises(
        ProducerStalledError, match=r"producer task \w+ \(pid \d+ on [\d.]+\) made no batch in 10 s"
    ) as stalled:
        for ref in iter_batch_refs(ds, 16, collate_fn=PlainCollate(), stall_timeout_s=10):
            handed_out.extend(ray.get(ref)["id"])
    assert handed_out and handed_out == list(
        range(len(handed_out))
    )  # in order, the stalled block's rows not among them
    assert len(handed_out) <= 48 and f"after {len(handed_out) // 16} batches" in str(stalled.value)


@slow
def test_push_round_robin_to_three_actors_covers_every_prompt_once(ray_session, text_ds):
    actors = [Rollout.remote() for _ in range(3)]
    assert _round_robin(iter_batch_refs(text_ds, BATCH), actors) == TEXT_ROWS
    per_actor = [ray.get(a.indices.remote()) for a in actors]
    assert all(per_actor), "every actor got batches"
    union = [i for seen in per_actor for i in seen]
    assert sorted(union) == list(range(TEXT_ROWS))  # nothing lost, nothing repeated


def test_bad_arguments_are_rejected(ray_session, text_ds):
    with pytest.raises(ValueError, match="prefetch"):
        next(iter_batch_refs(text_ds, BATCH, prefetch=0))
    with pytest.raises(ValueError, match="tensors"):
        next(iter_batch_refs(text_ds, BATCH, tensors="jax"))
    with pytest.raises(ValueError, match="CPU"):
        next(iter_batch_refs(text_ds, BATCH, collate_fn=VerlCollate(device="cuda")))


# --- pull model: streaming_split shards iterated inside the actors -------------------------------------------------


@slow
def test_pull_three_actors_equal_false_cover_every_prompt_once(ray_session, text_files, model_dir):
    # The live pipeline, executed by the split coordinator. Shards get whole blocks (one per read unit), so units
    # of 25 rows give all 3 actors work; with 2 units of 100 rows one actor would get none (no row lost either way).
    ds = build_dataset(text_files, model_dir, {**TEXT_CONFIG, "read_rows_per_task": 25})
    actors = [Rollout.remote() for _ in range(3)]
    shards = split_for_rollout(ds, 3)
    counts = ray.get([a.consume.remote(s, BATCH) for a, s in zip(actors, shards, strict=True)])
    union = [i for a in actors for i in ray.get(a.indices.remote())]
    assert sum(counts) == TEXT_ROWS and all(counts)
    assert sorted(union) == list(range(TEXT_ROWS))


@slow
def test_pull_equal_true_drops_the_remainder_and_nothing_else(ray_session, text_ds):
    actors = [Rollout.remote() for _ in range(3)]
    shards = split_for_rollout(text_ds, 3, equal=True)
    counts = ray.get([a.consume.remote(s, BATCH) for a, s in zip(actors, shards, strict=True)])
    union = [i for a in actors for i in ray.get(a.indices.remote())]
    assert counts == [TEXT_ROWS // 3] * 3
    assert len(set(union)) == len(union) and set(union) <= set(range(TEXT_ROWS))
    assert TEXT_ROWS - len(union) == TEXT_ROWS % 3  # the documented loss: num_rows % n rows per epoch


# --- multimodal batches: devices, refs, verl's DataProto ----------------------------------------------------------


def _source_images(mm_files):
    rows = pq.read_table(mm_files[0], columns=["images"])["images"].to_pylist()
    opened = [[Image.open(io.BytesIO(im["bytes"]) if im["bytes"] else im["path"]) for im in row] for row in rows]
    return [[im.convert("RGB") for im in row] for row in opened]


def test_multimodal_batches_rebuild_pil_images_and_tensors(mm_batches, mm_files):
    assert sum(len(b["index"]) for b in mm_batches) == MM_ROWS  # nothing filtered at 4096
    source = _source_images(mm_files)
    batch = mm_batches[0]
    assert batch["position_ids"].shape == (8, 3, MM_CONFIG["max_prompt_length"])
    for row, (data, inputs) in enumerate(zip(batch["multi_modal_data"], batch["multi_modal_inputs"], strict=True)):
        images = data["image"]
        assert all(isinstance(im, Image.Image) and im.mode == "RGB" for im in images)
        assert [np.asarray(im).tobytes() for im in images] == [np.asarray(im).tobytes() for im in source[row]]
        assert isinstance(inputs["pixel_values"], torch.Tensor) and inputs["pixel_values"].dtype == torch.float32
        assert inputs["image_grid_thw"].shape == (len(images), 3)


def test_collate_device_moves_tensors_and_multi_modal_inputs(mm_ds, mm_batches):
    """``meta`` is a real torch device on any machine: every tensor must land there, PIL images stay PIL."""
    moved = collect(mm_ds, 8, device="meta")
    for batch, ref in zip(moved, mm_batches, strict=True):
        for key in ("input_ids", "attention_mask", "position_ids"):
            assert batch[key].device.type == "meta" and batch[key].shape == ref[key].shape
        for inputs in batch["multi_modal_inputs"]:
            assert {t.device.type for t in inputs.values()} == {"meta"}
        assert all(isinstance(im, Image.Image) for d in batch["multi_modal_data"] for im in d["image"])
    assert_same_batches(collect(mm_ds, 8, device="cpu"), mm_batches)


@pytest.mark.gpu
def test_collate_cuda_device(mm_ds, mm_batches):
    moved = collect(mm_ds, 8, device="cuda")
    for batch, ref in zip(moved, mm_batches, strict=True):
        assert batch["input_ids"].is_cuda and torch.equal(batch["input_ids"].cpu(), ref["input_ids"])
        for inputs, ref_inputs in zip(batch["multi_modal_inputs"], ref["multi_modal_inputs"], strict=True):
            assert inputs["pixel_values"].is_cuda
            assert torch.equal(inputs["pixel_values"].cpu(), ref_inputs["pixel_values"])


def test_multimodal_numpy_refs_keep_pixels_zero_copy(ray_session, mm_ds, mm_batches):
    ref = next(iter(iter_batch_refs(mm_ds, 8)))
    seen = ray.get(Rollout.remote().inspect.remote(ref))
    assert seen["input_ids"] == ("numpy", False, False, True) and seen["position_ids"] == ("numpy", False, False, True)
    assert seen["pixel_values"] == ("ndarray", False, True)  # nested in an object array, still a read-only store view
    assert seen["image"] == ("Image", "RGB")  # PIL images are pickled: rebuilt (copied) on every read
    assert seen["as_torch"]["multi_modal_inputs"] == "ndarray"
    assert_same(batch_to_torch(ray.get(ref), copy=True), mm_batches[0])


def test_batch_to_numpy_shares_memory_and_rejects_device_tensors(mm_batches):
    batch = mm_batches[0]
    as_numpy = batch_to_numpy(batch)
    assert as_numpy["input_ids"].ctypes.data == batch["input_ids"].data_ptr()
    pixels = batch["multi_modal_inputs"][0]["pixel_values"]
    assert as_numpy["multi_modal_inputs"][0]["pixel_values"].ctypes.data == pixels.data_ptr()
    assert batch["multi_modal_inputs"][0]["pixel_values"] is pixels  # the input batch is not modified
    with pytest.raises(ValueError, match="CPU"):
        batch_to_numpy({"input_ids": batch["input_ids"].to("meta")})


@pytest.mark.skipif(not oracle_available(), reason="verl 0.5.0 oracle not installed (make oracle)")
def test_verl_dataproto_takes_our_batches_and_pops_for_generation(ray_session, mm_ds, mm_batches, text_batches):
    """verl 0.5.0's own ``from_single_dict`` + ``RayPPOTrainer.fit`` pop lines, in the oracle environment, on: two
    multimodal batches from ``iter_torch_batches(collate_fn=VerlCollate())``, one read back from a numpy ref and
    turned back by ``batch_to_torch``, and a text batch."""
    from_ref = batch_to_torch(ray.get(next(iter(iter_batch_refs(mm_ds, 8)))), copy=True)
    inputs = [*mm_batches, from_ref, text_batches[0]]
    result = run_verl_dataproto(inputs, repeat=2)
    assert "DataProto.from_single_dict(batch_dict)" in result["code"] and "batch.pop(" in result["code"]
    mm_pops = ["raw_prompt_ids", "multi_modal_data", "raw_prompt", "tools_kwargs", "interaction_kwargs", "index"]
    text_pops = ["raw_prompt_ids", "tools_kwargs", "interaction_kwargs", "index"]
    for ours, got in zip(inputs, result["batches"], strict=True):
        size = len(ours["index"])
        tensor_keys, non_tensor_keys = got["pop_keys"]
        assert tensor_keys == ["input_ids", "attention_mask", "position_ids"]
        assert non_tensor_keys == (mm_pops if "multi_modal_data" in ours else text_pops)
        assert got["len"] == size and got["repeated_len"] == 2 * size
        assert list(got["repeated_index"]) == [i for i in ours["index"] for _ in range(2)]  # interleaved
        assert sorted(got["gen"]["tensors"]) == sorted(tensor_keys)
        for key in tensor_keys:
            assert_same(got["gen"]["tensors"][key], ours[key], key)
        for key in non_tensor_keys:
            assert_same(got["gen"]["non_tensors"][key], ours[key], key)
        assert not got["rest"]["tensors"]
        rest = set(ours) - set(tensor_keys) - set(non_tensor_keys)
        assert set(got["rest"]["non_tensors"]) == rest
    mm = result["batches"][0]
    assert mm["gen"]["tensors"]["position_ids"].shape == (8, 3, MM_CONFIG["max_prompt_length"])
    assert isinstance(mm["gen"]["non_tensors"]["multi_modal_data"][0]["image"][0], Image.Image)
    assert "multi_modal_inputs" in mm["rest"]["non_tensors"]  # stays with the batch for the actor's log-prob pass
