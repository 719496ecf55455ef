"""``data.media_handoff``: each prompt's rollout media made once by the pipeline's vision actors and handed to verl's
agent loop through the object store. Against verl 0.9.1's and 0.7.1's own ``AgentLoopWorker`` (each in its oracle
environment, on CPU, a stand-in server returning fixed tokens): what the agent loop hands the trainer and what the
server receives are equal, sample by sample, and the hand-off worker runs neither qwen-vl-utils nor the processor."""

from __future__ import annotations

import pickle
import time

import numpy as np
import pytest
import torch

from ingest.config import DataConfig
from ingest.rollout_media import (
    HELD_BATCHES,
    HeldMedia,
    decode_payload,
    encode_payload,
    encoded_patches,
    handle_items,
    media_uri,
    parse_media_uri,
)
from ingest.rollout_media_kernels import kernels_serve_installed_transformers
from ingest.verl.rollout_media import (
    batch_raw_prompts,
    fetch_payload,
    fetch_payloads,
    handed_off,
    prefetch,
    sample_media,
)
from tests.support.tiers import first_in_matrix, matrix, slow
from tools.oracle import oracle_available, run_verl
from tools.samples import rollout_model_dir

N = 3  # rollout.n


def test_media_items_become_uris_of_one_prompt():
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": object()},
                {"type": "text", "text": "and"},
                {"type": "video", "video": "a.mp4", "fps": 2.0},
                {"type": "image", "image": 1},
            ],
        },
    ]
    handle_items(messages, "store", "key")
    items = messages[1]["content"]
    assert items[0] == {"type": "image", "image": media_uri("store", "key", "image", 0)}
    assert items[1] == {"type": "text", "text": "and"}
    assert items[2] == {"type": "video", "video": "ingest-media://store/key/video/0"}
    assert parse_media_uri(items[3]["image"]) == ("store", "key", "image", 1)
    assert parse_media_uri("/data/a.png") is None and parse_media_uri(None) is None


def test_each_sample_gets_its_own_media_lists_taken_for_the_payloads_only_while_unchanged():
    first, second, tools_image = object(), object(), object()
    payload = {"images": [first, second], "videos": None, "audios": None}
    images, videos, _ = sample_media(payload)
    assert videos is None and handed_off(images, None) is payload
    other, _, _ = sample_media(payload)
    assert other is not images and handed_off(other, None) is payload
    images.append(tools_image)  # verl's tool loop appends a tool's images to the list it was given
    assert handed_off(images, None) is None and payload["images"] == [first, second]
    assert handed_off([first, second], None) is None  # media not handed off (verl's own lists)
    assert handed_off(other, []) is None  # and no other kind of media beside them
    assert type(pickle.loads(pickle.dumps(other))) is list  # to the LLM server as a plain list


def test_a_payload_travels_as_plain_data_and_comes_back_equal():
    """The store holds payloads as plain data (numpy arrays Ray moves without pickling them; no torch or PIL there);
    the rollout gets the same tensors, dtypes, images and tuples back, a tensor met twice stored once."""
    from PIL import Image

    image = Image.new("RGB", (30, 20), (9, 80, 200))
    pixel_values = torch.rand(4, 1176)
    payload = {
        "images": [image],
        "videos": [(torch.zeros(2, 3, 4, 4, dtype=torch.uint8), {"fps": 2.0, "frames_indices": [0, 5]})],
        "prompt_ids": [1, 2, 3],
        "prompt_inputs": {"pixel_values": pixel_values},
        "training_inputs": {"pixel_values": pixel_values, "image_grid_thw": torch.tensor([[1, 2, 2]])},
        "other": range(3),  # anything else: pickled
    }
    encoded = encode_payload(payload)

    def leaves(value):
        if isinstance(value, dict):
            return [leaf for item in value.values() for leaf in leaves(item)]
        return [leaf for item in value for leaf in leaves(item)] if isinstance(value, list) else [value]

    assert all(leaf is None or isinstance(leaf, (str, int, float, np.ndarray)) for leaf in leaves(encoded))
    stored = pickle.loads(pickle.dumps(encoded))  # as Ray moves it: the shared array once
    assert stored["prompt_inputs"]["pixel_values"] is stored["training_inputs"]["pixel_values"]
    back = decode_payload(stored)
    assert back["prompt_ids"] == [1, 2, 3] and back["other"] == range(3)
    assert np.array_equal(np.asarray(back["images"][0]), np.asarray(image)) and back["images"][0].mode == "RGB"
    frames, metadata = back["videos"][0]
    assert torch.equal(frames, payload["videos"][0][0]) and metadata == payload["videos"][0][1]
    for name, tensor in payload["training_inputs"].items():
        returned = back["training_inputs"][name]
        assert returned.dtype == tensor.dtype and torch.equal(returned, tensor)
    assert back["prompt_inputs"]["pixel_values"] is back["training_inputs"]["pixel_values"]
    # the kernels' pixel_values: uint8 patches, normalized at the rollout as the processor normalizes
    patches = np.random.default_rng(0).integers(0, 256, (6, 3, 14, 14), dtype=np.uint8)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    encoded = pickle.loads(pickle.dumps({"pixel_values": encoded_patches(patches, mean, std, 2)}))
    values = decode_payload(encoded)["pixel_values"]
    expected = torch.from_numpy(patches).float().repeat_interleave(2, 0).view(6, 2, 3, 196).transpose(1, 2)
    expected = (expected - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    assert values.dtype == torch.float32 and torch.equal(values, expected.reshape(6, -1))


def test_the_kernels_make_image_prompts_under_transformers_5_only(model_dir, tmp_path, monkeypatch):
    """transformers 4.57's Qwen-VL processors (verl 0.7.1's own environment) give no ``mm_token_type_ids``, which the
    kernels make: there verl's functions make the payloads, as that release's processor does."""
    import importlib.metadata

    from ingest.rollout_media_kernels import KernelMediaMaker

    model = rollout_model_dir(tmp_path / "model", model_dir)
    assert kernels_serve_installed_transformers()  # this environment's transformers 5
    assert KernelMediaMaker.for_model(model, {}) is not None
    installed = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: "4.57.1" if name == "transformers" else installed(name)
    )
    assert not kernels_serve_installed_transformers()
    assert KernelMediaMaker.for_model(model, {}) is None


def test_media_handoff_is_for_the_agent_loops_rows():
    for row_format in ("verl-0.5", "verl-0.6"):
        with pytest.raises(ValueError, match="verl-0.7 / verl-0.9 rows"):
            DataConfig(media_handoff=True, row_format=row_format)
    assert DataConfig(media_handoff=True, row_format="verl-0.9").media_handoff
    assert DataConfig(media_handoff=True, row_format="verl-0.7").media_handoff


def _adopt(store, keys: list[str], first_row: int = 0):
    """A block with one prompt per key: the store's reply (ready once adopted)."""
    import ray

    entries = [(k, 0, first_row + i) for i, k in enumerate(keys)]
    return store.adopt_many.remote(entries, [ray.put([encode_payload({"key": k}) for k in keys])])


def test_a_batch_holds_its_media_until_two_later_batches_are_handed_out(ray_session):
    import ray

    held = HeldMedia(ahead=100)
    held.begin(["f.parquet"])
    batches = []
    for step in range(HELD_BATCHES + 2):
        key = f"k{step}"
        ray.get(_adopt(held.store, [key], 10 * step))
        held.delivered([key, None])  # None: a text row
        held.handed_out([None, key])
        batches.append(key)
        assert held.stats()["held"] == min(step + 1, HELD_BATCHES)
    assert fetch_payload(held.name, batches[-1]) == {"key": batches[-1]}
    (_, _, file, row) = held.lookup(batches[-1])
    assert (file, row) == ("f.parquet", 10 * (HELD_BATCHES + 1))
    with pytest.raises(
        LookupError, match=r"no such prompt media in the store \(released after its step; f\.parquet: row 0\)"
    ):
        fetch_payload(held.name, batches[0])
    with pytest.raises(LookupError, match=r"no such prompt media in the store \(from another run\)"):
        fetch_payload(held.name, "never-made")


def test_single_prompt_batches_hold_their_media_for_the_held_rows(ray_session):
    """verl's v1 trainers fetch one prompt per batch, then submit a step's prompts at once: with ``held`` rows, a
    batch's media stay until that many later rows were handed out, not only two batches."""
    import ray

    held = HeldMedia(ahead=100, held=3)
    held.begin(["f.parquet"])
    keys = [f"s{step}" for step in range(6)]
    for step, key in enumerate(keys):
        ray.get(_adopt(held.store, [key], step))
        held.delivered([key])
        held.handed_out([key])
        assert held.stats()["held"] == min(step + 1, 3)
    assert [held.lookup(key) is not None for key in keys] == [False, False, False, True, True, True]


def _handed_off_epoch(loader) -> tuple[list[str], list]:
    """Each row's raw prompt (its store and media key blanked) and its payload, fetched while its batch is held."""
    import json

    from ingest.rollout_media import prompt_media_key

    rows, payloads = [], []
    for batch in loader:
        for messages in batch["raw_prompt"]:
            found = prompt_media_key(messages)
            text = json.dumps(list(messages), sort_keys=True)
            rows.append(text if found is None else text.replace(found[0], "<store>").replace(found[1], "<key>"))
            payloads.append(None if found is None else fetch_payload(*found))
    return rows, payloads


def test_where_the_driver_would_make_the_rows_the_media_store_makes_them_with_the_same_media(
    ray_session, geo3k_files, model_dir, tmp_path, monkeypatch
):
    """Where the driver would make an epoch's rows (two CPUs), the read's media store makes them, rows and media,
    and owns the payloads: no actor pool, no copy. The rows and payloads equal the vision actors'; the window holds
    the store back as it holds them; a read stopped part way ends at once."""
    from ingest.stream import PromptStream
    from ingest.verl import VerlDataLoader
    from tools.oracle.agent_loop import _difference

    model = rollout_model_dir(tmp_path / "model", model_dir)
    window, unit = 8, 12  # 4 read units of 12 rows
    data = {"row_format": "verl-0.9", "shuffle": False, "read_rows_per_task": unit}
    data.update(media_handoff=True, media_handoff_ahead=window)

    def loader() -> VerlDataLoader:
        return VerlDataLoader(geo3k_files, model, data, 8, model, drop_last=False)

    by_actors = loader()
    rows, payloads = _handed_off_epoch(by_actors)
    assert by_actors.held_media.stats()["units_made"] == 0  # 4 logical CPUs: the actors made them
    monkeypatch.setattr(PromptStream, "_driver_keeps_epoch", lambda self: "the test's two CPUs")
    by_store = loader()
    assert _handed_off_epoch(by_store)[0] == rows
    store_rows, store_payloads = _handed_off_epoch(by_store)  # the next epoch: a store of its own
    assert store_rows == rows and len(rows) == 48 and by_store.held_media.stats()["units_made"] == 4
    for ours, theirs in zip(store_payloads, payloads, strict=True):
        assert (ours is None) == (theirs is None) and (ours is None or _difference(ours, theirs) is None)
    stalled_loader = loader()
    stalled = iter(stalled_loader)
    next(stalled)  # the first batch taken: unit 0's block; the store makes unit 1 (12 prompts > the window: none
    time.sleep(3)  # were ahead), then holds unit 2 back
    stats = stalled_loader.held_media.stats()
    assert stats["units_made"] == 2 and stats["ahead"] == unit, stats
    started = time.perf_counter()
    stalled.close()
    assert time.perf_counter() - started < 10


def test_a_prompt_whose_media_verl_refuses_is_quarantined_and_the_rest_handed_off(ray_session, model_dir, tmp_path):
    """An image of aspect ratio 250:1 decodes, but verl's agent loop refuses it (qwen-vl-utils' ``smart_resize``):
    its row becomes a quarantine record naming file, row and that reason; the file's other rows are handed off and
    the counts add up (rows in = out + filtered + quarantined)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray
    from PIL import Image

    from ingest.stats import RunLedger
    from ingest.verl import VerlDataLoader
    from tools.samples import geo3k_rows, geo3k_schema

    rows = geo3k_rows(6, kinds=("png", "jpeg"), multi_every=0)
    wide = io.BytesIO()
    Image.new("RGB", (5000, 20), (200, 120, 40)).save(wide, format="PNG")
    rows[2]["images"] = [{"bytes": wide.getvalue(), "path": None}]
    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=geo3k_schema()), path, row_group_size=3)
    model = rollout_model_dir(tmp_path / "model", model_dir)
    data = {"row_format": "verl-0.9", "shuffle": False, "media_handoff": True, "filter_overlong_prompts": False}
    ledger = RunLedger.remote()
    loader = VerlDataLoader([str(path)], model, data, 2, model, drop_last=False, ledger=ledger)
    handed, payloads = _handed_off_epoch(loader)
    assert len(handed) == 5 and all(payload is not None for payload in payloads)
    counts, records = ray.get(ledger.get.remote()), ray.get(ledger.quarantine.remote())
    assert counts["rows_in"] == 6 and counts["quarantined"] == 1 and counts["rows_out"] == 5
    assert counts["rows_in"] == counts["rows_out"] + counts["filtered_overlong"] + counts["quarantined"]
    (record,) = records
    assert record["file"].endswith("data.parquet") and record["row"] == 2, record
    assert "absolute aspect ratio must be smaller than 200" in record["reason"], record


class _PayloadOwner:
    """Owns what it puts: once it is killed, its objects are lost, as a lost node's are."""

    def put(self, value) -> list:
        import ray

        return [ray.put(value)]  # in a list, so the caller gets the ref, not the value


class _FixedStore:
    """A media store standing in with given entries (``MediaStore.lookup_many``'s replies)."""

    def __init__(self, entries: dict):
        self.entries = entries

    def lookup_many(self, keys: list[str]) -> list:
        return [self.entries.get(key) for key in keys]


def test_a_payload_lost_from_the_object_store_names_its_file_and_row_alone(ray_session):
    """A batch fetch that finds one payload lost (its owner gone, as with a lost node) fails with that prompt's file
    and row, not the whole batch's."""
    import ray

    from ingest.rollout_media import NAMESPACE

    owner = ray.remote(_PayloadOwner).options(num_cpus=0).remote()
    (lost,) = ray.get(owner.put.remote([encode_payload({"key": "lost-b"})]))
    kept = ray.put([encode_payload({"key": "lost-a"}), encode_payload({"key": "lost-c"})])  # one object, two prompts
    entries = {
        "lost-a": ([kept], 0, "f.parquet", 5),
        "lost-b": ([lost], 0, "f.parquet", 6),
        "lost-c": ([kept], 1, "g.parquet", 7),
    }
    name = "ingest-media-lost-test"
    store = ray.remote(_FixedStore).options(name=name, namespace=NAMESPACE, num_cpus=0).remote(entries)
    ray.kill(owner)
    with pytest.raises(RuntimeError, match=r"lost from the object store; rows: f\.parquet: row 6 \("):
        fetch_payloads(name, list(entries))
    assert [p["key"] for p in fetch_payloads(name, ["lost-a", "lost-c"])] == ["lost-a", "lost-c"]  # the others
    ray.kill(store)


class _CountingStore(_FixedStore):
    """``_FixedStore`` that counts its lookups."""

    def __init__(self, entries: dict):
        super().__init__(entries)
        self.lookups: list[list[str]] = []

    def lookup_many(self, keys: list[str]) -> list:
        self.lookups.append(list(keys))
        return super().lookup_many(keys)

    def asked(self) -> list[list[str]]:
        return self.lookups

    def released_rows(self, keys: list[str]) -> list:
        return [None] * len(keys)  # none released: a key it lacks is from another run


def test_a_v1_workers_batch_is_fetched_in_one_lookup_before_its_prompts_sessions(ray_session):
    """verl's v1 worker gets a step's prompts as one ``TensorDict`` (its legacy worker a ``DataProto``) and starts each
    prompt's sessions in the background: the batch's payloads come in one lookup, and each session finds its own in
    this process's cache. (Before, the v1 batch was not recognised: one lookup per prompt, each a call on the store.)"""
    import ray
    import torch
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    from ingest.rollout_media import NAMESPACE

    name, keys = "ingest-media-v1-batch-test", [f"v1-{i}" for i in range(3)]
    kept = ray.put([encode_payload({"key": key, "images": [], "videos": None}) for key in keys])
    entries = {key: ([kept], i, "f.parquet", i) for i, key in enumerate(keys)}
    store = ray.remote(_CountingStore).options(name=name, namespace=NAMESPACE, num_cpus=0).remote(entries)
    messages = [
        [{"role": "user", "content": [{"type": "image", "image": media_uri(name, k, "image", 0)}]}] for k in keys
    ]
    batch = TensorDict({"input_ids": torch.zeros(3, 2)}, batch_size=[3])
    batch["raw_prompt"] = NonTensorStack(*(NonTensorData(m) for m in messages))

    class Proto:  # the legacy worker's DataProto: its non-tensor columns
        non_tensor_batch = {"raw_prompt": np.array(messages + [None], dtype=object)[:3]}

    assert list(batch_raw_prompts(batch)) == messages == list(batch_raw_prompts(Proto()))
    assert batch_raw_prompts(TensorDict({}, batch_size=[0])) is None
    prefetch(batch_raw_prompts(batch))
    assert [fetch_payload(name, key)["key"] for key in keys] == keys
    assert ray.get(store.asked.remote()) == [keys]  # one lookup, the sessions served from the cache
    gone = batch_raw_prompts(batch)[:1] + [[{"role": "user", "content": [{"type": "image", "image": media_uri(
        name, "v1-gone", "image", 0)}]}]]  # fmt: skip
    prefetch(gone)  # a payload the store no longer has fails its own prompt, not the batch's prefetch
    with pytest.raises(LookupError, match="v1-gone"):
        fetch_payload(name, "v1-gone")
    ray.kill(store)


def test_the_store_holds_the_media_made_ahead_of_the_loader_to_its_window(ray_session):
    """Made ahead of the loader: at most ``ahead`` prompts; a block beyond waits (so does the vision actor that made
    it) until the loader takes rows, or until the loader has waited for a block (the one it needs may be behind)."""
    import ray

    held = HeldMedia(ahead=4)
    held.begin(["f.parquet"])
    ray.get([_adopt(held.store, ["a0", "a1"]), _adopt(held.store, ["b0", "b1"])])
    later = _adopt(held.store, ["c0", "c1"])
    assert not ray.wait([later], timeout=1.0)[0]
    held.delivered(["a0"])
    assert not ray.wait([later], timeout=0.5)[0]  # 3 ahead + 2: not yet
    held.delivered(["a1", None])
    ray.get(later, timeout=10)
    assert held.stats()["ahead"] == 4
    stuck = _adopt(held.store, ["e0", "e1"])
    assert not ray.wait([stuck], timeout=0.5)[0]
    with held.waiting_for_block():  # the loader waits for a block for longer than LOADER_WAIT_S
        ray.get(stuck, timeout=10)
    held.delivered(["b0", "b1"])  # it came: the window holds again
    assert held.stats()["ahead"] == 4
    assert not ray.wait([_adopt(held.store, ["f0"])], timeout=0.5)[0]
    assert held.stats()["peak_ahead"] == 6


def test_rows_a_resumed_read_drops_and_a_stopped_reads_rows_are_released(ray_session):
    import ray

    held = HeldMedia(ahead=100)
    held.begin(["f.parquet"])
    ray.get(_adopt(held.store, ["s0", "s1", "k0", "k1"]))
    held.delivered(["s0", "s1", "k0", "k1"])
    held.handed_out(["k0"])  # s0, s1 were handed out before the state was saved: dropped by the resumed read
    assert held.lookup("s0") is None and held.lookup("s1") is None and held.lookup("k1") is not None
    first = held.store
    held.begin(["f.parquet"])  # a new read: k1 was taken, never handed out
    held.stats()  # the release sent to the first store is done (a store runs its calls in any order)
    assert ray.get(first.lookup.remote("k1")) is None and ray.get(first.lookup.remote("k0")) is not None
    for step in range(HELD_BATCHES):
        ray.get(_adopt(held.store, [f"n{step}"]))
        held.delivered([f"n{step}"])
        held.handed_out([f"n{step}"])
    # the first read's batch is released: its store is gone (ray.kill ends it soon, not before its next call)
    with pytest.raises(ray.exceptions.RayActorError):
        for _ in range(100):
            ray.get(first.lookup.remote("k0"), timeout=30)
            time.sleep(0.1)


def _same_arrays(ours: list, theirs: list) -> bool:
    return len(ours) == len(theirs) and all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))


# per release: (family, media, batches, batch size, rollout.n, agent loop); the videos with an image beside them in
# every row; the tool loop renders its prompt with a tool schema
# images through the tool loop, where about half the prompts call a tool that returns one more image on the first
# turn (tools/oracle/image_tool.py) and the rest answer at once
TOOL_IMAGE = "images + tool image"
HANDOFF_CASES = {
    "verl-0.9": [
        ("qwen2-vl", "images", 2, 8, N, "single_turn_agent"),
        ("qwen2.5-vl", "frame lists", 1, 4, 2, "single_turn_agent"),
        ("qwen3-vl", "video files", 1, 4, 2, "single_turn_agent"),
        ("qwen2-vl", TOOL_IMAGE, 1, 4, 2, "tool_agent"),
    ],
    "verl-0.7": [
        ("qwen2-vl", "images", 2, 8, N, "single_turn_agent"),
        ("qwen3-vl", "frame lists", 1, 4, 2, "single_turn_agent"),
        ("qwen2-vl", "images", 1, 4, 2, "tool_agent"),
    ],
}


def _handoff_cases(row_format: str, root, geo3k_files: list, model_dir: str) -> list[dict]:
    """``compare_cases``' cases of ``HANDOFF_CASES[row_format]``, their models and video files written under
    ``root``."""
    from tools.samples import qwen3_vl_model_dir, qwen25_vl_model_dir, write_video_parquet

    processors = {"qwen2-vl": lambda out: model_dir, "qwen2.5-vl": qwen25_vl_model_dir, "qwen3-vl": qwen3_vl_model_dir}
    cases = []
    for family, media, batches, size, n, agent in HANDOFF_CASES[row_format]:
        where = root / f"{family}-{media.replace(' ', '-')}-{agent}"
        model = rollout_model_dir(where / "model", processors[family](where / "processor"), family)
        files = [str(f) for f in geo3k_files]
        if not media.startswith("images"):
            kind = "frames" if media == "frame lists" else "file"
            files = [str(f) for f in write_video_parquet(where / "data", size * batches, kind=kind, with_images=True)]
        spec = {"files": files, "model": model, "n": n, "batch_size": size, "batches": batches, "prompt_length": 8192}
        data = {"row_format": row_format, "max_prompt_length": 8192}  # every row kept: the batch sizes below
        case = (family, media, n, size * batches, agent)
        cases.append({**spec, "data": data, "agent": agent, "tool_image": media == TOOL_IMAGE, "case": case})
    return cases


LEGACY_COMPARISON = "test_handed_off_media_give_verls_agent_loop_inputs"
V1_COMPARISON = "test_handed_off_media_give_verls_v1_agent_loop_inputs"
V1_STEPS = "test_verls_v1_async_steps_on_handed_off_media_a_released_payload_and_a_resume"


def _verl09_check(item: pytest.Item) -> str | None:
    """The check of the verl 0.9.1 oracle's agent-loop run that test ``item`` reads, if any."""
    checks = {
        V1_COMPARISON: "compare",  # on the legacy comparison's batches
        V1_STEPS: "compare",  # in its Ray session and TransferQueue
        "test_the_kernels_make_verls_payloads": "payloads",
        "test_handed_off_media_live_for_their_steps_and_are_made_again_on_resume": "lifetime",
        "test_the_store_stays_within_the_window_over_a_long_run_with_stalls": "bound",
    }
    name = getattr(item, "originalname", item.name)
    if name == LEGACY_COMPARISON:
        return "compare" if item.callspec.params["row_format"] == "verl-0.9" else None
    return checks.get(name)


def _compare_spec(root, geo3k_files: list, model_dir: str, items: list[pytest.Item]) -> dict:
    """The comparison's cases the selected ``items`` read: each through the legacy worker where its test is selected,
    and through the v1 worker too where that case's v1 test is (on the same batches)."""
    names = [(getattr(item, "originalname", item.name), item) for item in items if _verl09_check(item) == "compare"]
    legacy = any(name == LEGACY_COMPARISON for name, _ in names)
    v1 = {item.callspec.params["case"] for name, item in names if name == V1_COMPARISON}
    cases = _handoff_cases("verl-0.9", root, geo3k_files, model_dir)
    spec = {
        "check": "compare",
        "cases": [
            {**case, "index": index, "legacy": legacy, "v1": index in v1}
            for index, case in enumerate(cases)
            if legacy or index in v1
        ],
    }
    if any(name == V1_STEPS for name, _ in names):
        spec["v1_steps"] = _v1_steps_spec(root / "v1-steps", geo3k_files, cases[0]["model"])
    return spec


def _v1_steps_spec(root, geo3k_files: list, model: str) -> dict:
    """``agent_loop_tq.v1_steps``: Qwen2-VL image prompts, steps of 4, ``rollout.n`` 2, through verl's v1 trainer."""
    from ingest.verl.dataset import CUSTOM_CLS

    files = [str(f) for f in geo3k_files]
    data = {
        "train_files": files,
        "val_files": files,
        "train_batch_size": 4,
        "val_batch_size": None,
        "max_prompt_length": 8192,
        "shuffle": False,
        "dataloader_num_workers": 0,
        "validation_shuffle": False,
        "cache_dir": str(root / "cache"),
        "row_format": "verl-0.9",
        "custom_cls": dict(CUSTOM_CLS),
        "sampler": None,
    }
    return {
        "model": model,
        "n": 2,
        "prompt_length": 8192,
        "checkpoint_dir": str(root / "checkpoints"),
        "trainer_data": data,
    }


@pytest.fixture(scope="module")
def verl09_checks(geo3k_files, model_dir, tmp_path_factory, request) -> dict:
    """The verl 0.9.1 oracle's agent-loop checks of this module (the comparisons, the lifetime, the bound) in one
    process, each in a Ray session of its own: verl, transformers and torch are imported once. Each test reads its
    part (``specs`` and ``results`` by check)."""
    if not oracle_available("verl-0.9"):
        pytest.skip("the verl-0.9 oracle is not installed (make oracle)")
    root = tmp_path_factory.mktemp("verl-0.9-agent-loop")
    specs = {
        "compare": lambda: _compare_spec(root / "compare", geo3k_files, model_dir, request.session.items),
        "payloads": lambda: _payloads_spec(root / "payloads", geo3k_files, model_dir),
        "lifetime": lambda: _lifetime_spec(root / "lifetime", model_dir),
        "bound": lambda: _bound_spec(root / "bound", model_dir),
    }
    # only the checks of the tests selected (the CI matrix runs the comparisons alone)
    wanted = {check for item in request.session.items if (check := _verl09_check(item))}
    specs = {check: spec() for check, spec in specs.items() if check in wanted}
    result = run_verl(
        "agent_loop", [], model_dir, None, row_format="verl-0.9", timeout=3000, check="several", checks=specs
    )
    return {"specs": specs, "results": result}


@slow
@matrix
@pytest.mark.parametrize("row_format", list(HANDOFF_CASES))
def test_handed_off_media_give_verls_agent_loop_inputs(geo3k_files, model_dir, tmp_path, row_format, request):
    """Images (Qwen2-VL) and videos beside images (Qwen2.5-VL, Qwen3-VL; frame lists and MPEG-4 files), each
    prompt ``rollout.n`` times, through the release's own worker and through ours; images through the tool loop
    too."""
    if row_format == "verl-0.9":
        checks = request.getfixturevalue("verl09_checks")
        cases, result = checks["specs"]["compare"]["cases"], checks["results"]["compare"]
    else:
        if not oracle_available(row_format):
            pytest.skip(f"the {row_format} oracle is not installed (make oracle)")
        cases = _handoff_cases(row_format, tmp_path, geo3k_files, model_dir)
        result = run_verl("agent_loop", [], model_dir, None, row_format=row_format, timeout=1500, cases=cases)
    for case, outcome in zip(cases, result["cases"], strict=True):
        family, media, n, prompts, agent = case["case"]
        assert len(outcome["expected"]) == case["batches"], case["case"]
        for expected, handed in zip(outcome["expected"], outcome["handed_off"], strict=True):
            assert expected["tensors"].keys() == handed["tensors"].keys()
            for name, tensor in expected["tensors"].items():
                assert torch.equal(tensor, handed["tensors"][name]), (case["case"], name)
            assert len(expected["multi_modal_inputs"]) == case["batch_size"] * n
            for ours, theirs in zip(handed["multi_modal_inputs"], expected["multi_modal_inputs"], strict=True):
                kind = "pixel_values" if media.startswith("images") else "pixel_values_videos"
                assert ours.keys() == theirs.keys() and kind in theirs, (case["case"], theirs.keys())
                for name, tensor in theirs.items():
                    assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), (case["case"], name)
        # the server gets the same prompt ids, images and video frames (a batch's samples finish in any order)
        order = lambda request: request["prompt_ids"]  # noqa: E731
        stock, ours = sorted(outcome["stock_requests"], key=order), sorted(outcome["handoff_requests"], key=order)
        _same_requests(stock, ours, case["case"])
        counts = outcome["handoff_counts"]
        _no_media_made_again(counts, case["case"], ours)
        # image prompts: made by the pipeline's kernels (under transformers 5: 4.57's processors give no
        # mm_token_type_ids); with videos: by verl's functions in the vision actors
        maker = "kernels" if media.startswith("images") and kernels_serve_installed_transformers() else "verl"
        assert counts["made_by"][maker] > 0 and sum(counts["made_by"].values()) == counts["made_by"][maker], counts
        raw_prompt = outcome["last_raw_prompt"][0]
        items = [item for message in raw_prompt for item in message["content"] if item["type"] in ("image", "video")]
        assert items and all(parse_media_uri(item[item["type"]]) for item in items)


def _same_requests(theirs: list[dict], ours: list[dict], case: tuple) -> None:
    """The server got the same prompt ids, images and video frames from both sides (each side's requests in prompt
    ids' order: a batch's samples finish in any order); a tool's image in each sample's second turn."""
    family, media, n, prompts, agent = case
    assert len(theirs) == len(ours) == prompts * n + _tool_turns(ours, case)
    for expected, got in zip(theirs, ours, strict=True):
        assert expected["prompt_ids"] == got["prompt_ids"]
        assert _same_arrays(got["images"], expected["images"]) and expected["images"]
        assert _same_arrays(got["videos"], expected["videos"])
        assert bool(expected["videos"]) == (not media.startswith("images"))
    if media == TOOL_IMAGE:  # some sessions called the tool, some did not
        assert 0 < _tool_turns(ours, case) < prompts * n


def _tool_turns(requests: list[dict], case: tuple) -> int:
    """The requests of sessions' second turns: those whose last image is the tool's."""
    if case[1] != TOOL_IMAGE:
        return 0
    from tools.oracle.image_tool import cropped_figure

    tool_image = np.asarray(cropped_figure())
    return sum(np.array_equal(request["images"][-1], tool_image) for request in requests)


def _no_media_made_again(counts: dict, case: tuple, requests: list[dict]) -> None:
    """No sample made its prompt's media again: no qwen-vl-utils call, and the processor only where verl renders: a
    tool loop's prompt with its tool schemas, once per sample (its training inputs are the payload's). Where a tool
    added an image, verl makes the trajectory's training inputs itself."""
    family, media, n, prompts, agent = case
    renders = prompts * n if agent == "tool_agent" else 0
    # a tool's turn: rendered twice (verl's builder takes the suffix of a full render past the prefix's), and the
    # trajectory's training inputs
    renders += 3 * _tool_turns(requests, case)
    assert counts["process_vision_info"] == 0 and counts["processor"] == renders, (case, counts)


def _same_sample(ours: dict, theirs: dict, where) -> None:
    for name, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert ours[name].dtype == value.dtype and torch.equal(ours[name], value), (where, name)
        elif isinstance(value, dict):
            assert ours[name].keys() == value.keys(), (where, name, value.keys())
            for key, tensor in value.items():
                assert ours[name][key].dtype == tensor.dtype and torch.equal(ours[name][key], tensor), (where, key)
        else:
            assert ours[name] == value, (where, name)


@slow
@pytest.mark.parametrize(
    "case",
    first_in_matrix(
        range(len(HANDOFF_CASES["verl-0.9"])), ids=[" ".join(map(str, c)) for c in HANDOFF_CASES["verl-0.9"]]
    ),
)
def test_handed_off_media_give_verls_v1_agent_loop_inputs(verl09_checks, case):
    """verl 0.9's default trainer (``trainer.use_v1``): its ``AgentLoopWorkerTQ`` runs one prompt's ``rollout.n``
    sessions in one worker and puts each sample into TransferQueue (a real one). verl's own v1 trainer code builds
    and registers the batches; stock (``RLHFDataset``) and hand-off (``IngestAgentLoopWorkerTQ``) put the same
    prompt ids, responses, masks, position ids and ``multi_modal_inputs``, sample by sample, and the server gets the
    same prompt ids, images and video frames; no hand-off sample makes its prompt's media again."""
    specs = verl09_checks["specs"]["compare"]["cases"]
    position = [spec["index"] for spec in specs].index(case)
    spec, result = specs[position], verl09_checks["results"]["compare"]["cases"][position]["v1"]
    family, media, n, prompts, agent = spec["case"]
    stock, handoff = result["stock"], result["handoff"]
    assert len(stock["samples"]) == len(handoff["samples"]) == spec["batches"]
    for step, (theirs, ours) in enumerate(zip(stock["samples"], handoff["samples"], strict=True)):
        assert len(theirs) == len(ours) == spec["batch_size"] * n
        for k, (mine, expected) in enumerate(zip(ours, theirs, strict=True)):
            kind = "pixel_values" if media.startswith("images") else "pixel_values_videos"
            assert kind in expected["multi_modal_inputs"], (spec["case"], expected["multi_modal_inputs"].keys())
            _same_sample(mine, expected, (spec["case"], step, k))
    order = lambda request: request["prompt_ids"]  # noqa: E731
    _same_requests(sorted(stock["requests"], key=order), sorted(handoff["requests"], key=order), spec["case"])
    counts = handoff["counts"]
    _no_media_made_again(counts, spec["case"], handoff["requests"])
    maker = "kernels" if media.startswith("images") and kernels_serve_installed_transformers() else "verl"
    assert counts["made_by"][maker] > 0 and sum(counts["made_by"].values()) == counts["made_by"][maker], counts
    items = [
        item
        for message in handoff["last_raw_prompt"][0]
        for item in message["content"]
        if item["type"] in ("image", "video")
    ]
    assert items and all(parse_media_uri(item[item["type"]]) for item in items)


@slow
def test_verls_v1_async_steps_on_handed_off_media_a_released_payload_and_a_resume(verl09_checks):
    """verl 0.9's v1 async trainer fetches one prompt at a time and submits a step's prompts at once, with steps in
    flight together: the handed-off media stay held for them (not for two single-prompt batches), and each sample
    equals the stock one. A payload released while TransferQueue holds its prompt fails that prompt alone: verl tags
    it ``failure`` and logs our error naming its file and row, and the step's other prompts finish. A loader resumed
    from ``data.pt`` (verl's own lines) hands off the next step's media anew: its samples equal the stock step's."""
    spec = verl09_checks["specs"]["compare"]["v1_steps"]
    result = verl09_checks["results"]["compare"]["v1_steps"]
    stock, handoff = result["stock"], result["handoff"]
    n, size = spec["n"], spec["trainer_data"]["train_batch_size"]
    assert handoff["held_rows"] == size * 3  # two steps and verl's one warm-up step
    for statuses in stock["statuses"] + handoff["statuses"]:
        assert set(statuses.values()) == {"finished"}, statuses
    assert len(stock["samples"]) == len(handoff["samples"]) == 3  # the third: the resumed loader's
    for step, (theirs, ours) in enumerate(zip(stock["samples"], handoff["samples"], strict=True)):
        assert len(theirs) == len(ours) == size * n
        for k, (mine, expected) in enumerate(zip(ours, theirs, strict=True)):
            assert "pixel_values" in expected["multi_modal_inputs"]
            _same_sample(mine, expected, ("v1 steps", step, k))
    assert handoff["counts"]["process_vision_info"] == 0 and handoff["counts"]["processor"] == 0
    fault = handoff["fault"]
    others = [status for uid, status in fault["statuses"].items() if uid != fault["uid"]]
    assert fault["statuses"][fault["uid"]] == "failure" and others == ["finished"] * (size - 1)
    reason = f"released after its step; {fault['file']}: row {fault['row']}"
    assert any(reason in message for message in handoff["errors"]), handoff["errors"]


def test_main_ppo_sets_the_handoff_manager_of_the_chosen_trainer(monkeypatch):
    import importlib

    from omegaconf import OmegaConf

    from ingest.verl import main_ppo
    from ingest.verl.main_ppo import HANDOFF_MANAGERS, V1_AGENT_LOOP_MODULE, use_handoff_manager

    def config(handoff: bool, use_v1: bool, manager: str | None = None):
        agent = {"num_workers": 8, **({"agent_loop_manager_class": manager} if manager else {})}
        return OmegaConf.create(
            {
                "data": {"media_handoff": handoff},
                "trainer": {"use_v1": use_v1},
                "actor_rollout_ref": {"rollout": {"agent": agent}},
            }
        )

    # the v1 manager's module imports TransferQueue: where it is missing, an error that says so, not verl's "class
    # not found in module"
    def missing_transfer_queue(name: str):
        assert name == V1_AGENT_LOOP_MODULE
        raise ModuleNotFoundError("No module named 'transfer_queue'", name="transfer_queue")

    monkeypatch.setattr(importlib, "import_module", missing_transfer_queue)
    with pytest.raises(ImportError, match="No module named 'transfer_queue'.*TransferQueue.*trainer.use_v1=false"):
        use_handoff_manager(config(True, True))
    monkeypatch.setattr(main_ppo, "check_v1_agent_loop", lambda: None)  # an environment where it imports
    for use_v1 in (False, True):
        chosen = config(True, use_v1)
        assert use_handoff_manager(chosen) == HANDOFF_MANAGERS[use_v1]
        assert chosen.actor_rollout_ref.rollout.agent.agent_loop_manager_class == HANDOFF_MANAGERS[use_v1]
    off = config(False, False)
    assert use_handoff_manager(off) is None and "agent_loop_manager_class" not in off.actor_rollout_ref.rollout.agent
    with pytest.raises(ValueError, match="agent_loop_manager_class is my.Manager"):
        use_handoff_manager(config(True, False, "my.Manager"))


def _payloads_spec(root, geo3k_files: list, model_dir: str) -> dict:
    """``payloads``' spec: Qwen2-VL (as saved, and with a pixel budget its processor resizes the fetched images to),
    Qwen2.5-VL and Qwen3-VL model folders; the geo3k files, and the same as plain structs."""
    import json
    import shutil
    from pathlib import Path

    import pyarrow.parquet as pq

    from tools.samples import qwen3_vl_model_dir, qwen25_vl_model_dir

    qwen2 = rollout_model_dir(root / "qwen2-vl", model_dir)
    resizing = root / "qwen2-vl-256-tokens"
    shutil.copytree(qwen2, resizing)
    size = {"longest_edge": 256 * 28 * 28, "shortest_edge": 56 * 56}
    for name, section in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        if (resizing / name).is_file():
            saved = json.loads((resizing / name).read_text())
            (saved[section] if section else saved)["size"] = size
            (resizing / name).write_text(json.dumps(saved))
    models = [
        qwen2,
        str(resizing),
        rollout_model_dir(root / "qwen2.5-vl", qwen25_vl_model_dir(root / "qwen2.5-vl-processor"), "qwen2.5-vl"),
        rollout_model_dir(root / "qwen3-vl", qwen3_vl_model_dir(root / "qwen3-vl-processor"), "qwen3-vl"),
    ]
    # the same rows as plain {bytes, path} structs (no Image() feature): verl 0.9 items of the image as opened
    plain = []
    for path in geo3k_files:
        target = root / "plain" / Path(path).name
        target.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pq.read_table(path).replace_schema_metadata(None), target, row_group_size=12)
        plain.append(str(target))
    return {"check": "payloads", "files": [*map(str, geo3k_files), *plain], "models": models}


@slow
def test_the_kernels_make_verls_payloads(verl09_checks):
    """Every geo3k prompt our loader hands verl (every image kind; from an HF ``Image()`` column, and as plain
    ``{bytes, path}`` structs, whose items keep the struct's keys and the image as opened: L, P, RGBA), through verl
    0.9.1's own media functions and through the pipeline's kernels (no verl, transformers or torch): the same
    images, prompt ids, processor outputs and training inputs, key by key and bit by bit, for Qwen2-VL (its fetched
    images kept, and resized by a smaller pixel budget), Qwen2.5-VL and Qwen3-VL; a prompt verl refuses, the kernels
    refuse too."""
    result = verl09_checks["results"]["payloads"]
    assert result["prompts"] >= 80
    for model, counts in result["models"].items():
        assert counts["differences"] == [], model
        assert counts["left_to_verl"] == 0 and counts["equal"] + counts["refused"] == result["prompts"], counts


def _lifetime_spec(root, model_dir: str) -> dict:
    from tools.samples import write_geo3k_parquet

    files = [str(f) for f in write_geo3k_parquet(root / "data", 96, num_files=2, row_group_size=12)]
    model = rollout_model_dir(root / "model", model_dir)
    return {"check": "lifetime", "files": files, "model": model, "batch_size": 8, "data": {"row_format": "verl-0.9"}}


@slow
def test_handed_off_media_live_for_their_steps_and_are_made_again_on_resume(verl09_checks):
    """One loader over 96 prompts in batches of 8: each batch's media are held until the second batch after it is
    handed out, then released; a loader resumed from a ``state_dict`` makes the next batch's media again (new keys,
    the same payloads); once a loader's store is gone, fetching from it says so."""
    result = verl09_checks["results"]["lifetime"]
    assert result["rows"] == 96
    assert all(result["released"]) and all(result["last_held"]) and len(result["last_held"]) == HELD_BATCHES * 8
    # once the epoch is made, the store holds the last two batches' media and nothing else
    assert result["sizes"][-1] == HELD_BATCHES * 8, result["sizes"]
    resume = result["resume"]
    assert resume["index"][0] == resume["index"][1]
    assert not set(resume["keys"][0]) & set(resume["keys"][1])  # made again, not the saved run's objects
    for again, fresh in zip(*resume["payloads"], strict=True):
        assert again["prompt_ids"] == fresh["prompt_ids"] and torch.equal(again["pixel_values"], fresh["pixel_values"])
    gone = result["store_gone"]
    assert gone["before"] == "fetched" and gone["after"].startswith("LookupError") and "store is gone" in gone["after"]


def test_with_media_handoff_the_decode_stage_leaves_counting_rows_out_to_the_rollout_media_stage(
    geo3k_files, model_dir
):
    """The rollout-media stage after decode can still find a row bad, so it counts the rows out (each count only
    grows): the decode stage counts none and keeps the columns that stage counts and locates rows with."""
    from actors.tokenize import TokenizeActor
    from ingest.blocks import FILE_COLUMN, PROMPT_TOKENS_COLUMN
    from ingest.config import StageContext
    from ingest.datasets.plan import plan_input
    from ingest.read.files import unify_schemas
    from ingest.read.units import read_unit
    from ingest.stages.decode import DecodeStage

    config = DataConfig(row_format="verl-0.9", max_prompt_length=4096)
    plan = plan_input(geo3k_files, config, multimodal=True)
    schema = unify_schemas(plan.infos)
    tokenize = TokenizeActor(config, StageContext(geo3k_files), model_dir, model_dir)
    unit = plan.units[0]
    table = next(iter(tokenize(read_unit(unit, plan.files[unit.file_index], schema, {}, None))))
    handing_off = DecodeStage(DataConfig(row_format="verl-0.9", media_handoff=True))(table)
    assert handing_off.counts.rows_out == 0 and handing_off.counts.prompt_tokens == 0
    assert {PROMPT_TOKENS_COLUMN, FILE_COLUMN} <= set(handing_off.table.column_names)
    plain = DecodeStage(DataConfig(row_format="verl-0.9"))(table)
    assert plain.counts.rows_out == table.num_rows > 0 and PROMPT_TOKENS_COLUMN not in plain.table.column_names


# five times what the store may hold (1,152): without the window a stall would make far more than the bound
BOUND_PROMPTS = 6_000


BOUND_BATCH, BOUND_UNIT, BOUND_POOL = 128, 128, 2  # batch size, rows per read task, vision actors


def _bound_spec(root, model_dir: str) -> dict:
    from tools.samples import write_geo3k_parquet

    files = write_geo3k_parquet(
        root / "data", BOUND_PROMPTS, num_files=2, row_group_size=BOUND_UNIT, kinds=("tiny",), multi_every=0
    )
    data = {"row_format": "verl-0.9", "read_rows_per_task": BOUND_UNIT, "vision_pool_max_size": BOUND_POOL}
    return {
        "check": "bound",
        "files": [str(f) for f in files],
        "model": rollout_model_dir(root / "model", model_dir),
        "batch_size": BOUND_BATCH,
        "n": 8,
        "data": data,
        "stall_at": [2, 20, 40],
    }


@slow
def test_the_store_stays_within_the_window_over_a_long_run_with_stalls(verl09_checks):
    """6,000 prompts (small images: the store's count, not the pixels, is under test) in 47 batches of 128, each
    prompt resolved ``rollout.n = 8`` times by a stand-in rollout worker; three times the loader stops taking
    batches until the pipeline has settled. Made ahead of the loader: the window, or while the loader waits for a
    block, what the vision actors finish meanwhile (a task's blocks, two here). The store never holds more than that
    plus the two handed-out batches and the rows the loader took; without the window the pipeline would make the
    whole epoch's media ahead of a stalled trainer."""
    result = verl09_checks["results"]["bound"]
    batch, unit, pool = BOUND_BATCH, BOUND_UNIT, BOUND_POOL
    assert result["rows"] == BOUND_PROMPTS and result["samples"] == 8 * BOUND_PROMPTS
    window = batch  # media_handoff_ahead's default: one batch
    ahead = window + 2 * pool * unit
    bound = (HELD_BATCHES + 2) * batch + ahead  # 1,152 prompts of 6,000
    assert len(result["stalls"]) == 3
    for stall in result["stalls"]:
        # the pipeline ran ahead while the loader stalled, and stopped at the window
        assert window // 2 <= stall["ahead"] <= window + pool * unit, stall
        assert stall["held"] <= bound, (stall, bound)
    end = result["end"]
    assert end["peak_held"] <= bound and end["peak_ahead"] <= ahead, end
    assert end["held"] == batch + (BOUND_PROMPTS % batch or batch)  # the last two batches
    assert result["rollout_cpu_s"] / result["samples"] < 0.001  # a sample's media: under 1 ms of the rollout's CPU
