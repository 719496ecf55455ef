"""PromptStream: epochs reproducible from (seed, epoch), exact resume in-process and after a killed consumer."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import torch

from ingest import PromptStream
from ingest.config import DataConfig
from ingest.datasets.plan import plan_input
from ingest.resumable import epoch_fingerprint
from ingest.stats import RunLedger
from tests.support.tiers import first_fast, slow

CONFIG = {"truncation": "left", "shuffle": True, "seed": 11, "read_rows_per_task": 30}
BATCH = 16


def _signature(batches) -> list[tuple[list[int], int]]:
    return [([int(i) for i in b["index"]], int(b["input_ids"].sum())) for b in batches]


@pytest.fixture(scope="module")
def full_epoch(ray_session, variety_files, model_dir):
    return list(PromptStream(variety_files, model_dir, CONFIG, BATCH))


def test_epochs_differ_and_are_reproducible(ray_session, variety_files, model_dir, full_epoch):
    stream = PromptStream(variety_files, model_dir, CONFIG, BATCH)
    first = _signature(stream)
    assert first == _signature(full_epoch)
    assert stream.state_dict()["epoch"] == 1 and stream.state_dict()["position"] == {"unit": 0, "rows": 0}
    second = _signature(stream)
    assert second != first
    assert sorted(i for b, _ in second for i in b) == sorted(i for b, _ in first for i in b)
    again = PromptStream(variety_files, model_dir, CONFIG, BATCH)
    again.set_epoch(1)
    assert _signature(again) == second


@pytest.mark.parametrize("consumed", [1, 7])
def test_resume_yields_exactly_the_rest(ray_session, variety_files, model_dir, full_epoch, consumed):
    stream = PromptStream(variety_files, model_dir, CONFIG, BATCH)
    head = []
    for batch in stream:
        head.append(batch)
        if len(head) == consumed:
            break
    state = json.loads(json.dumps(stream.state_dict()))
    assert state["batches"] == consumed
    assert state["position"]["unit"] > 0 if consumed > 2 else state["position"]["rows"] == 16 * consumed

    ledger = RunLedger.remote()
    resumed = PromptStream(variety_files, model_dir, CONFIG, BATCH, ledger=ledger)
    resumed.load_state_dict(state)
    tail = list(resumed)
    assert _signature(head + tail) == _signature(full_epoch)
    for ours, theirs in zip(head + tail, full_epoch, strict=True):
        assert torch.equal(ours["input_ids"], theirs["input_ids"])
        assert torch.equal(ours["position_ids"], theirs["position_ids"])
    # whole consumed units are not read again (read units are single row groups of 20 or 25 rows here)
    rows_in = ray.get(ledger.get.remote())["rows_in"]
    assert rows_in == 210 if state["position"]["unit"] == 0 else rows_in <= 210 - 20 * state["position"]["unit"]


def test_state_refuses_other_data(ray_session, variety_files, model_dir, full_epoch):
    stream = PromptStream(variety_files, model_dir, CONFIG, BATCH)
    next(iter(stream))
    state = stream.state_dict()
    other = PromptStream(variety_files[:2], model_dir, CONFIG, BATCH)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="other data"):
        next(iter(other))
    with pytest.raises(ValueError, match="seed"):
        PromptStream(variety_files, model_dir, {**CONFIG, "seed": 12}, BATCH).load_state_dict(state)


def _fingerprint_with_batch_size(stream: PromptStream) -> str:
    """The fingerprint ``PromptStream`` states held before the batch size left it: files, their row counts, the
    epoch's number of read units, batch size, seed and shuffle."""
    plan = plan_input(stream.files, stream.config, epoch=stream.epoch)
    identity = {
        "files": plan.files,
        "rows": [info.num_rows for info in plan.infos],
        "units": len(plan.units),
        "batch_size": stream.batch_size,
        "seed": stream.config.seed,
        "shuffle": stream.config.shuffle,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def test_states_saved_with_the_batch_size_in_the_fingerprint_still_load(
    ray_session, variety_files, model_dir, full_epoch
):
    """A state of the earlier fingerprint resumes exactly with its own batch size, and is refused with another (as
    it was: it cannot tell one batch size from another)."""
    stream = PromptStream(variety_files, model_dir, CONFIG, BATCH)
    head = []
    for batch in stream:
        head.append(batch)
        if len(head) == 3:
            break
    state = {**stream.state_dict(), "fingerprint": _fingerprint_with_batch_size(stream)}
    resumed = PromptStream(variety_files, model_dir, CONFIG, BATCH)
    resumed.load_state_dict(state)
    assert _signature(head + list(resumed)) == _signature(full_epoch)
    other = PromptStream(variety_files, model_dir, CONFIG, BATCH // 2)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="other data"):
        next(iter(other))


def test_the_fingerprint_holds_what_makes_the_units_and_nothing_that_varies_by_epoch(variety_files):
    """Epochs cut their first unit into small ones (``read_first_unit_rows``), so their numbers of units differ: not
    in the fingerprint. The unit size is, and for media rows the vision batch size, which caps it."""
    config = DataConfig.from_any({**CONFIG, "read_first_unit_rows": 10})
    plans = [plan_input(variety_files, config, epoch=epoch) for epoch in (0, 2)]
    assert len(plans[0].units) != len(plans[1].units)
    assert len({epoch_fingerprint(plan, config, False) for plan in plans}) == 1
    other_units = DataConfig.from_any({**CONFIG, "read_first_unit_rows": 10, "read_rows_per_task": 60})
    assert epoch_fingerprint(plans[0], other_units, False) != epoch_fingerprint(plans[0], config, False)
    small_images = DataConfig.from_any({**CONFIG, "read_first_unit_rows": 10, "vision_batch_size": 4})
    assert epoch_fingerprint(plans[0], small_images, True) != epoch_fingerprint(plans[0], config, True)
    assert epoch_fingerprint(plans[0], small_images, False) == epoch_fingerprint(plans[0], config, False)


def test_a_stream_goes_on_into_an_epoch_with_another_number_of_units(ray_session, variety_files, model_dir):
    """The fingerprint a stream took in one epoch holds in an epoch whose first unit is cut into more units."""
    config = {**CONFIG, "read_first_unit_rows": 10}
    stream = PromptStream(variety_files, model_dir, config, BATCH)
    for epoch in (0, 2):  # 10 units, then 11 (see above)
        stream.set_epoch(epoch)
        batches = iter(stream)
        assert len(next(batches)["index"]) == BATCH
        batches.close()


@slow
def test_killed_consumer_resumes_without_loss_or_repeats(ray_session, variety_files, model_dir, full_epoch, tmp_path):
    worker = Path(__file__).parent / "support" / "resume_worker.py"
    spec = {
        "files": variety_files,
        "tokenizer": model_dir,
        "config": CONFIG,
        "batch_size": BATCH,
        "out": str(tmp_path / "batches.jsonl"),
        "state": str(tmp_path / "state.json"),
        "kill_after": 4,
    }
    root = str(Path(__file__).resolve().parents[1])
    env = {"PYTHONPATH": root, "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    first = subprocess.run([sys.executable, str(worker), json.dumps(spec)], env=env, cwd=root, timeout=300)
    assert first.returncode == -9, "the consumer should have died by SIGKILL"
    assert sum(1 for _ in open(spec["out"])) == 4
    second = subprocess.run(
        [sys.executable, str(worker), json.dumps({**spec, "resume": True, "kill_after": None})],
        env=env,
        cwd=root,
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    seen = [json.loads(line) for line in open(spec["out"])]
    assert [(r["index"], r["ids"]) for r in seen] == _signature(full_epoch)


_DRIVER_FIRST = """
import pickle, sys
import ray
from ingest import PromptStream, VerlCollate, build_dataset

files, model, processor, config, out = pickle.loads(bytes.fromhex(sys.argv[1]))
collate = VerlCollate(row_format=config["row_format"])
stream = iter(PromptStream(files, model, config, 16, processor, collate_fn=collate))
first = next(stream)
cluster_before_first = ray.is_initialized()
batches = [first, *stream]
reference = build_dataset(files, model, config, processor).iter_torch_batches(batch_size=16, collate_fn=collate)
with open(out, "wb") as f:
    pickle.dump((cluster_before_first, batches, list(reference)), f)
"""


@pytest.mark.parametrize("row_format,media", first_fast([("verl-0.5", False), ("verl-0.5", True), ("verl-0.9", True)]))
def test_first_batch_is_made_in_the_driver_before_ray_starts(
    variety_files, geo3k_files, model_dir, tmp_path, row_format, media
):
    """A new process: the stream's first batch comes before any Ray cluster exists (the driver ran the read and the
    stages), and the epoch's batches equal ``build_dataset``'s, key for key (text rows; image rows through the vision
    stage; verl 0.9 image rows)."""
    import os
    import pickle

    from tests.support.compare import assert_same_batches

    files, processor = (geo3k_files, model_dir) if media else (variety_files, None)
    config = {"truncation": "left", "shuffle": False, "row_format": row_format}
    spec = pickle.dumps((files, model_dir, processor, config, str(tmp_path / "out.pkl"))).hex()
    env = {**os.environ, "RAY_ADDRESS": "local"}
    subprocess.run([sys.executable, "-c", _DRIVER_FIRST, spec], check=True, env=env, timeout=600, capture_output=True)
    with open(tmp_path / "out.pkl", "rb") as f:
        cluster_before_first, batches, reference = pickle.load(f)
    assert not cluster_before_first
    assert_same_batches(batches, reference)
