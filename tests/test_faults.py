"""Faults: a tokenizer actor killed mid-run (SIGKILL, like an OOM kill or a lost node) — every row still arrives
exactly once and the counts add up (Ray retries the unit on a restarted actor; the ledger counts each batch once)."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
import ray

from ingest import VerlCollate, build_dataset
from ingest.demo import write_gsm8k_parquet
from ingest.stats import RunLedger
from tests.support.tiers import slow


def _kill_one(marker: str, deadline: float) -> int | None:
    while time.time() < deadline:
        for proc in psutil.process_iter(["cmdline"]):
            if marker in " ".join(proc.info["cmdline"] or []):
                os.kill(proc.pid, signal.SIGKILL)
                return proc.pid
        time.sleep(0.05)
    return None


@slow
@pytest.mark.parametrize("actor", ["TokenizeActor"])
def test_killed_actor_loses_and_repeats_nothing(ray_session, model_dir, tmp_path, actor):
    files = write_gsm8k_parquet(tmp_path / "data", 6000, num_files=2, row_group_size=200, long_every=50)
    ledger = RunLedger.remote()
    config = {"truncation": "left", "shuffle": False, "read_rows_per_task": 200, "tokenizer_batch_size": 50}
    ds = build_dataset(files, model_dir, config, ledger=ledger)
    seen, killed = [], []
    for batch in ds.iter_torch_batches(batch_size=64, collate_fn=VerlCollate()):
        seen += [int(i) for i in batch["index"]]
        if not killed:  # kill an actor while the run is in full flow
            killed.append(_kill_one(actor, time.time() + 30))
            threading.Event().wait(0.1)
    assert killed[0] is not None, "no actor process found to kill"
    expected = [i for i in range(6000) if i % 50 != 49]  # every 50th prompt is overlong and filtered
    assert seen == expected  # each row once, in order
    counts = ray.get(ledger.get.remote())
    assert counts["rows_in"] == 6000 and counts["rows_out"] == len(expected)
    assert counts["rows_in"] == counts["rows_out"] + counts["filtered_overlong"] + counts["quarantined"]
