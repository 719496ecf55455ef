"""Losing worker nodes mid-epoch on a real multi-node Ray (``ray.cluster_utils.Cluster``: a head with no CPU, where
the driver runs, and three 1-CPU workers with 100 MB object stores, so the pipeline's actors and blocks live on the
workers). Two of the three workers (the busiest) are killed after the driver has taken its first batches, and one
fresh worker joins so the pools can run again.

What this proves, each against a reference pass on the whole cluster:
- text rows through ``build_dataset`` + ``iter_torch_batches(collate_fn=VerlCollate())``: every row exactly once, in
  input order, equal tensor for tensor. Nothing of ours does this: Ray restarts the lost actors, resubmits their
  tasks and reconstructs lost blocks from lineage, and the consumer sees the same stream;
- image rows through the tokenizer, decode and vision pools: the same, pixel values and all;
- ``run_pipeline``: the summary's counts (rows in = out + filtered + quarantined), the quarantine file and the
  written rows equal the reference run's. Retried batches report their counts again; the ledger counts each batch
  key once;
- ``iter_batch_refs`` feeding rollout actors (on the driver's node): every row once, in the order of the refs, equal
  to the reference, with the producer's node among the lost ones. Refs taken before the loss whose batches were
  stored only on that node still resolve: Ray runs the producer task again and it stores them anew (no error for
  the caller to handle);
- ``PromptStream`` state taken after the loss (batches before and after it consumed), loaded by a new stream on the
  nodes that are left: the rows before the state and after it make the reference epoch, none lost or twice, in
  order;
- ``run_pipeline``'s ledger (``RunLedger``) is pinned to the driver's node, busy or not, so losing workers never
  loses the counts; a ledger that is lost all the same (one a caller placed elsewhere) fails the run with
  ``LedgerLostError`` naming it, never a summary with wrong counts.

The cases run in a subprocess (``tests/support/node_loss.py``; the session's own local Ray holds this process), all on
one cluster that gets its three workers back between cases; the two ``run_pipeline`` cases share one reference pass.
Only the case that needs the driver's node busy (a head with a CPU, held) has a cluster of its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.cluster import ROOT, cluster_env
from tests.support.tiers import slow

TEXT_CONFIG = {
    "shuffle": False,
    # small read units and batches: many tasks in flight on every node when the nodes go
    "read_rows_per_task": 20,
    "tokenizer_batch_size": 20,
    "tokenizer_pool_max_size": 3,
}


def _run(spec: dict, timeout: int = 1200) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.node_loss", json.dumps(spec)],
        env=cluster_env(PYTHONPATH=str(ROOT), RAY_DATA_DISABLE_PROGRESS_BARS="1"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[0].removeprefix("RESULT "))


def _case(results: dict, name: str) -> dict:
    result = results[name]
    assert "error" not in result, result["error"]
    return result


def _lost_busy_nodes(result: dict) -> None:
    """The loss hit the pipeline: two workers went, holding some of its actors."""
    nodes = result["loss"]["nodes"]
    assert "watch_error" not in nodes, nodes["watch_error"]
    assert nodes["removed"] == 2 and nodes["busy_cpus_removed"] > 0, nodes


def _same_rows_after_loss(result: dict, n: int) -> None:
    """The loss hit the pipeline, and the stream still gave rows 0..n-1 once each, in input order, each equal to the
    reference pass's."""
    _lost_busy_nodes(result)
    reference, rows = result["reference"]["rows"], result["loss"]["rows"]
    assert [i for i, _ in reference] == list(range(n))
    assert [i for i, _ in rows] == list(range(n))
    assert rows == reference


@pytest.fixture(scope="module")
def text_with_bad_rows(tmp_path_factory) -> list[str]:
    """1,200 gsm8k rows over 3 files: every 23rd prompt overlong (filtered), every 50th an empty message list
    (quarantined)."""
    from ingest.demo import gsm8k_rows

    root = tmp_path_factory.mktemp("bad-rows")
    rows = gsm8k_rows(1200, long_every=23)
    for i in range(7, 1200, 50):
        rows[i]["prompt"] = []
    table = pa.Table.from_pylist(rows)
    paths = [str(root / f"train-{k}.parquet") for k in range(3)]
    for k, path in enumerate(paths):
        pq.write_table(table.slice(k * 400, 400), path, row_group_size=20)
    return paths


RUN_CONFIG = {**TEXT_CONFIG, "on_bad_row": "quarantine", "max_prompt_length": 256}
COUNTS = ("rows_in", "rows_out", "filtered_overlong", "quarantined", "prompt_tokens")


def _run_spec(files: list[str], model: str, out, **extra) -> dict:
    """``run_pipeline`` on ``files`` with two workers lost once the ledger has counted a batch in; the one worker left
    runs the rest (a node cannot be added from the watching thread)."""
    return {
        "mode": "run",
        "files": files,
        "model": model,
        "config": RUN_CONFIG,
        "batch_size": 16,
        "output": str(out),
        "watch_rows": 20,
        "add_back": 0,
        "reference_key": "run",
        **extra,
    }


@pytest.fixture(scope="module")
def losses(model_dir, text_with_bad_rows, tmp_path_factory) -> dict:
    """Every case on one cluster with a CPU-less head (the driver's), in one subprocess."""
    from ingest.demo import write_gsm8k_parquet
    from tools.samples import rollout_model_dir, write_geo3k_parquet

    root = tmp_path_factory.mktemp("node-loss")
    text = write_gsm8k_parquet(root / "text", 1200, num_files=3, row_group_size=20)
    images = write_geo3k_parquet(root / "images", 96, num_files=2, row_group_size=8)
    image_config = {
        "shuffle": False,
        "read_rows_per_task": 8,
        "tokenizer_batch_size": 8,
        "vision_batch_size": 4,
        "filter_overlong_prompts": False,
        "max_prompt_length": 4096,
    }
    cases = [
        {"name": "text", "files": text, "model": model_dir, "config": TEXT_CONFIG, "batch_size": 16, "after": 2},
        {
            "name": "images",
            "files": images,
            "model": model_dir,
            "processor": model_dir,
            "config": image_config,
            "batch_size": 8,
            "after": 2,
        },
        {
            "name": "refs",
            "mode": "refs",
            "files": text,
            "model": model_dir,
            "config": TEXT_CONFIG,
            "batch_size": 16,
            "after": 2,
            "hold": 2,
            "prefetch": 2,
        },
        {
            "name": "state",
            "mode": "state",
            "files": text,
            "model": model_dir,
            "config": {**TEXT_CONFIG, "shuffle": True, "seed": 5},
            "batch_size": 16,
            "after": 8,
            "state_at": 12,
        },
        {
            "name": "handoff",
            "mode": "handoff",
            "files": images,
            "model": rollout_model_dir(root / "rollout-model", model_dir),
            "config": {**image_config, "row_format": "verl-0.9"},
            "batch_size": 8,
            "after": 2,
        },
        # a ledger on a worker stays
        _run_spec(text_with_bad_rows, model_dir, root / "out-run", name="run", ledger="spare"),
    ]
    return _run({"cases": cases})


@pytest.fixture(scope="module")
def busy_driver_loss(model_dir, text_with_bad_rows, losses, tmp_path_factory) -> dict:
    """The ``run_pipeline`` case with the driver's node busy (its one CPU held), on a cluster of its own; its
    reference is the shared cluster's pass of the same run (the same files and config)."""
    out = tmp_path_factory.mktemp("node-loss-busy") / "out"
    spec = _run_spec(text_with_bad_rows, model_dir, out, name="busy", reference=False)
    result = _case(_run({**spec, "head_cpus": 1, "busy_driver_node": 1}), "busy")
    return {**result, "reference": _case(losses, "run")["reference"]}


@slow
def test_text_rows_exactly_once_in_order_after_losing_two_of_three_workers(losses):
    _same_rows_after_loss(_case(losses, "text"), 1200)  # each row equal, tensor for tensor


@slow
def test_image_rows_through_decode_and_vision_pools_survive_node_loss(losses):
    _same_rows_after_loss(_case(losses, "images"), 96)  # pixel values, grids and position ids included


@slow
def test_handed_off_media_survive_losing_the_vision_nodes(losses):
    """``media_handoff``: the vision actors' nodes go while their payloads are held and a batch is out; the store (on
    the loader's node) owns its copies, so every row and the payload its URIs resolve to equal the reference pass's,
    none lost or twice."""
    _same_rows_after_loss(_case(losses, "handoff"), 96)


@slow
def test_batch_refs_reach_rollout_actors_exactly_once_after_the_producers_node_is_lost(losses):
    """``iter_batch_refs`` hands 16-row batches to three rollout stand-ins (``num_cpus=0`` actors pinned to the
    driver's node, so the consumers survive and only the data path is hit). After two batches are consumed, two
    more refs are taken but held back; the node storing their batches (the producer task's: a 400 KB batch is kept
    in that node's store, not inlined into the driver) goes first, then the busiest other worker. The held refs are
    handed out after the loss: Ray has to make their batches again, and it does. The producer task is run again
    from the start of the epoch (the pipeline's actors it owned went with it); the refs it already yielded keep
    their places, so the consumer sees no seam."""
    result = _case(losses, "refs")
    reference, loss = result["reference"], result["loss"]
    _lost_busy_nodes(result)
    # the held batches lived on one node only, and that node went before they were read
    assert loss["held_nodes"] and loss["held_only_on_removed_nodes"], loss
    assert min(loss["held_sizes"]) > 100 * 1024  # stored objects, not values inlined into the driver
    # Ray ran the producer again: once, or twice when the retry started on the second node before that went too
    assert reference["producer_attempts"] == [1] and loss["producer_attempts"][0] in (2, 3), loss["producer_attempts"]
    errors = [call for call in loss["calls"] if "error" in call]
    assert not errors, errors[0]  # every ref resolved, the held ones included
    expected = [row for call in reference["calls"] for row in call["rows"]]
    got = [row for call in loss["calls"] for row in call["rows"]]
    assert [i for i, _ in expected] == list(range(1200))
    assert [i for i, _ in got] == list(range(1200))  # every row once, in the order of the refs
    assert got == expected  # and each row equal to the whole cluster's


@slow
def test_prompt_stream_state_taken_after_node_loss_resumes_exactly(losses):
    """A shuffled ``PromptStream`` epoch: 8 batches (the first ones made in the driver, then the actors'), two
    workers lost, 4 more batches, ``state_dict()``; the stream is closed and a new one on the cluster that is left
    loads the state and reads the rest. The rows before and after the state are the reference epoch (an
    uninterrupted stream on the whole cluster)."""
    result = _case(losses, "state")
    reference, loss = result["reference"]["rows"], result["loss"]
    _lost_busy_nodes(result)
    assert sorted(i for i, _ in reference) == list(range(1200))
    assert [i for i, _ in reference] != list(range(1200))  # shuffled: the state's position is not a row count
    assert loss["state"]["batches"] == 12 and len(loss["before"]) == 12 * 16
    assert loss["before"] + loss["rest"] == reference  # none lost, none twice, in order, each row equal


@slow
def test_run_summary_and_quarantine_exact_after_node_loss(losses):
    result = _case(losses, "run")
    reference, loss = result["reference"], result["loss"]
    assert "error" not in loss, loss
    _lost_busy_nodes(result)
    ref, got = reference["summary"], loss["summary"]
    assert ref["quarantined"] == 24 and ref["filtered_overlong"] > 0 and ref["accounted"]
    assert {k: got[k] for k in COUNTS} == {k: ref[k] for k in COUNTS}
    assert got["rows_in"] == got["rows_out"] + got["filtered_overlong"] + got["quarantined"] and got["accounted"]
    assert loss["indices"] == reference["indices"] and len(loss["indices"]) == got["rows_out"]
    assert loss["quarantine_rows"] == reference["quarantine_rows"] == 24  # one record per bad row, none twice


@slow
def test_the_runs_ledger_stays_on_the_drivers_node_and_the_run_finishes(busy_driver_loss):
    """``run_pipeline`` pins its ledger to the driver's node, even when that node is busy (its one CPU held, as a
    trainer's processes would hold it; unpinned, Ray then put the ledger on a worker): losing two workers leaves the
    counts whole."""
    result = busy_driver_loss
    reference, loss = result["reference"], result["loss"]
    assert "error" not in loss, loss
    assert loss["nodes"].get("removed") == 2, loss["nodes"]
    assert loss["nodes"]["ledger_node"] == result["driver_node"] and not loss["nodes"]["ledger_node_removed"]
    ref, got = reference["summary"], loss["summary"]
    assert {k: got[k] for k in COUNTS} == {k: ref[k] for k in COUNTS} and got["accounted"]
    assert loss["indices"] == reference["indices"]


def test_a_lost_ledger_is_a_clear_error(ray_session):
    """A ledger that died (one a caller placed on a node that went, or killed) fails the stage that reports to it with
    ``LedgerLostError``, never a run that goes on without its counts."""
    import ray

    from ingest.accounting import BatchCounts, LedgerLostError, report_counts
    from ingest.stats import RunLedger

    ledger = RunLedger.remote("lost")
    report_counts(ledger, BatchCounts(rows_in=3, rows_out=3), key=("a", 0))
    ray.kill(ledger)
    # ray.kill returns before the actor is gone; a call sent meanwhile may still land, so wait for its death first
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(ledger.get.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            break
        time.sleep(0.2)
    with pytest.raises(LedgerLostError, match="the run's ledger .* is lost"):
        report_counts(ledger, BatchCounts(rows_in=3, rows_out=3), key=("a", 1))
