"""Run the pipeline on a multi-node ``ray.cluster_utils.Cluster`` and remove worker nodes while it streams.

Run as a script (``python -m tests.support.node_loss SPEC_JSON``): the test session already holds a local Ray, and a
driver joins one cluster per process. It prints one ``RESULT {...}`` line: per-row digests of a reference pass on
the whole cluster and of the pass that lost nodes, and what the loss hit. The spec's ``mode`` picks the consumer:
``build_dataset`` + ``iter_torch_batches`` (default), ``run`` (``run_pipeline``), ``refs`` (``iter_batch_refs`` to
rollout actors), ``state`` (``PromptStream`` state taken after the loss, resumed in a new stream) or ``handoff``
(``VerlDataLoader`` with ``media_handoff``, each row's payload resolved).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.cluster_utils import Cluster

from tests.support.cluster import CURRENT_CLUSTER, FAST_NODE_DEATH, free_port

MB = 1024 * 1024
STORE = 100 * MB  # small stores: blocks spill and move between nodes as they would on a loaded cluster
# how long a loss waits for the pipeline's actors to hold a worker's CPU (on a loaded machine the driver can still be
# making the first batches alone when the loss is due)
BUSY_WAIT_S = 30


def start_cluster(workers: int, head_cpus: int) -> Cluster:
    previous = CURRENT_CLUSTER.read_text() if CURRENT_CLUSTER.exists() else None
    head = {
        "num_cpus": head_cpus,
        "gcs_server_port": free_port(),
        "include_dashboard": False,
        # the agent's default port is held by the test session's own Ray
        "dashboard_agent_listen_port": free_port(),
        "object_store_memory": STORE,
        "_system_config": FAST_NODE_DEATH,
    }
    cluster = Cluster(initialize_head=True, head_node_args=head)
    # Cluster records its head as "the" local cluster, which a plain ray.init() elsewhere would then join: put back
    # what was there
    if previous is None:
        CURRENT_CLUSTER.unlink(missing_ok=True)
    else:
        CURRENT_CLUSTER.write_text(previous)
    for _ in range(workers):
        cluster.add_node(num_cpus=1, object_store_memory=STORE)
    cluster.wait_for_nodes()
    return cluster


def busy_cpus(node_id: str) -> float:
    """CPUs held on a node (by the pipeline's actors)."""
    from ray._private.state import state

    total = next(n["Resources"].get("CPU", 0) for n in ray.nodes() if n["NodeID"] == node_id)
    available = state.available_resources_per_node().get(node_id, {}).get("CPU", 0)
    return total - available


def digest(batch: dict, i: int) -> str:
    """One row of a collated batch as a hash of its contents (equal rows, equal digests): tensors and arrays by dtype,
    shape and bytes, images by mode, size and pixels, containers item by item."""
    h = hashlib.sha1()
    for key in sorted(batch):
        h.update(key.encode())
        _feed(h, batch[key][i])
    return h.hexdigest()


def _feed(h, value: Any) -> None:
    if hasattr(value, "numpy") and not isinstance(value, np.ndarray):  # a torch tensor
        value = value.numpy()
    if isinstance(value, np.ndarray) and value.dtype != object:
        h.update(f"{value.dtype}{value.shape}".encode() + np.ascontiguousarray(value).tobytes())
    elif isinstance(value, np.ndarray):
        for item in value.tolist() if value.ndim == 0 else list(value):
            _feed(h, item)
    elif isinstance(value, dict):
        for key in sorted(value):
            h.update(repr(key).encode())
            _feed(h, value[key])
    elif isinstance(value, (list, tuple)):
        h.update(f"[{len(value)}".encode())
        for item in value:
            _feed(h, item)
    elif hasattr(value, "tobytes") and hasattr(value, "mode"):  # a PIL image
        h.update(f"{value.mode}{value.size}".encode() + value.tobytes())
    else:
        h.update(repr(value).encode())


def rows(ds, batch_size: int, on_batch=None) -> list[list]:
    from ingest import VerlCollate

    out: list[list] = []
    for n, batch in enumerate(ds.iter_torch_batches(batch_size=batch_size, collate_fn=VerlCollate())):
        out += [[int(batch["index"][i]), digest(batch, i)] for i in range(len(batch["index"]))]
        if on_batch is not None:
            on_batch(n + 1)
    return out


class NodeLoss:
    """After ``after`` batches, remove ``remove`` worker nodes (the busiest first), then add ``add_back`` fresh ones."""

    def __init__(self, cluster: Cluster, after: int, remove: int, add_back: int, ledger: str | None = None):
        self.cluster, self.after, self.remove, self.add_back = cluster, after, remove, add_back
        self.ledger = ledger  # "first": remove the ledger's worker node first; "spare": keep it
        self.report: dict[str, Any] = {}

    def __call__(self, batches: int, ledger_id: str | None = None, first: set[str] | None = None) -> None:
        """``first``: node ids to remove before the busiest (e.g. the nodes holding some batch refs' objects)."""
        if batches != self.after:
            return
        deadline = time.monotonic() + BUSY_WAIT_S
        while time.monotonic() < deadline and not any(busy_cpus(n.node_id) for n in self.cluster.worker_nodes):
            time.sleep(0.2)
        ledger = ledger_node(ledger_id) if ledger_id else None
        ranks = {
            "first": lambda n: n.node_id != ledger,
            "spare": lambda n: n.node_id == ledger,
            "given": lambda n: n.node_id not in first,
        }
        rank = ranks["given"] if first else ranks.get(self.ledger)
        nodes = sorted(self.cluster.worker_nodes, key=lambda n: (rank(n) if rank else 0, -busy_cpus(n.node_id)))
        gone = nodes[: self.remove]
        self.report["busy_cpus"] = {n.node_id[:8]: busy_cpus(n.node_id) for n in nodes}
        self.report["busy_cpus_removed"] = sum(busy_cpus(n.node_id) for n in gone)
        self.report["removed_ids"] = [n.node_id for n in gone]
        self.report["ledger_node"] = ledger
        self.report["ledger_node_removed"] = ledger in {n.node_id for n in gone}
        for node in gone:
            self.cluster.remove_node(node, allow_graceful=False)
        self.report["removed"] = len(gone)
        for _ in range(self.add_back):
            self.cluster.add_node(num_cpus=1, object_store_memory=STORE)
        self.report["added"] = self.add_back


def ledger_node(actor_id: str) -> str | None:
    """The node of a (``RunLedger``) actor, from the GCS's actor table."""
    from ray._private.state import actors

    return actors(actor_id)["Address"]["NodeID"]


def main(spec: dict) -> dict:
    """Every case of ``spec["cases"]`` (or ``spec`` itself, one case) on one cluster, in order: before each case the
    cluster gets its ``workers`` back and waits for the last case's pipeline to let go of their CPUs. A case's
    reference pass is made once per ``reference_key`` and shared by the cases that name the same key. Returns
    ``{case name: result}``; a case that raised gives ``{"error": traceback}`` and the next case still runs."""
    cases = spec.get("cases", [{"name": "case", **spec}])
    workers = spec.get("workers", 3)
    cluster = start_cluster(workers, spec.get("head_cpus", 0))
    try:
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
        hog = occupy_driver_node(spec["busy_driver_node"]) if spec.get("busy_driver_node") else None  # noqa: F841
        references: dict[str, tuple[dict, float]] = {}
        results = {}
        for case in cases:
            restore_workers(cluster, workers)
            try:
                results[case["name"]] = run_case(cluster, case, references)
            except Exception:
                import traceback

                results[case["name"]] = {"error": traceback.format_exc()[-4000:]}
        return results
    finally:
        ray.shutdown()
        cluster.shutdown()


def run_case(cluster: Cluster, case: dict, references: dict[str, tuple[dict, float]]) -> dict:
    """One case: its reference pass on the whole cluster (or the one an earlier case made under the same
    ``reference_key``), then the pass that loses nodes."""
    result: dict[str, Any] = {"driver_node": ray.get_runtime_context().get_node_id()}
    modes = {"run": run_with_loss, "refs": refs_with_loss, "state": state_with_loss, "handoff": handoff_with_loss}
    run = modes.get(case.get("mode"), stream_with_loss)
    if case.get("reference", True):
        key = case.get("reference_key") or case["name"]
        if key not in references:
            started = time.perf_counter()
            references[key] = run(case, None), time.perf_counter() - started
            restore_workers(cluster, len(cluster.worker_nodes))
        result["reference"], result["reference_s"] = references[key]
    after, remove, add_back = case.get("after", 2), case.get("remove", 2), case.get("add_back", 1)
    loss = NodeLoss(cluster, after, remove, add_back, case.get("ledger"))
    started = time.perf_counter()
    result["loss"] = run(case, loss)
    result["loss_s"] = time.perf_counter() - started
    result["loss"]["nodes"] = loss.report
    return result


def restore_workers(cluster: Cluster, workers: int, timeout: float = 60) -> None:
    """Add 1-CPU workers until the cluster has ``workers``, then wait (up to ``timeout``) until no worker's CPU is
    held: the last pass's pipeline is shut down, so the next one starts its actors on an idle cluster."""
    import gc

    for _ in range(workers - len(cluster.worker_nodes)):
        cluster.add_node(num_cpus=1, object_store_memory=STORE)
    cluster.wait_for_nodes()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gc.collect()  # a finished pass's iterators (and so its pipeline) can hang in reference cycles
        if not any(busy_cpus(n.node_id) for n in cluster.worker_nodes):
            return
        time.sleep(0.5)


def stream_with_loss(spec: dict, loss: NodeLoss | None) -> dict:
    """``build_dataset`` + ``iter_torch_batches(collate_fn=VerlCollate())``: (index, digest) of every row in order."""
    from ingest import build_dataset

    ds = build_dataset(spec["files"], spec["model"], spec["config"], spec.get("processor"))
    return {"rows": rows(ds, spec.get("batch_size", 16), loss)}


@ray.remote(num_cpus=0)
class Rollout:
    """A rollout actor's stand-in: takes one batch (a ref Ray resolves before the call) and returns (index, digest)
    of each row, as a rollout would read it (``batch_to_torch``)."""

    def generate(self, batch: dict) -> list[list]:
        from ingest.feed import batch_to_torch

        batch = batch_to_torch(batch)
        return [[int(batch["index"][i]), digest(batch, i)] for i in range(len(batch["index"]))]


def refs_with_loss(spec: dict, loss: NodeLoss | None) -> dict:
    """``iter_batch_refs`` feeding ``Rollout`` actors (pinned to the driver's node, which never goes), round robin.

    With a loss: the first ``after`` batches are handed out and their calls awaited (consumed); the next ``hold``
    refs are taken from the iterator but held back, and the nodes that store their objects (the producer's) go
    first, with the busiest others up to ``remove``. Then the held refs and the rest are handed out. Each call's
    rows, or its error (type and message), in the order of the refs."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ingest import build_dataset
    from ingest.feed import iter_batch_refs

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actors = [Rollout.options(scheduling_strategy=here).remote() for _ in range(spec.get("actors", 3))]
    ds = build_dataset(spec["files"], spec["model"], spec["config"], spec.get("processor"))
    after, hold = spec.get("after", 2), spec.get("hold", 2)
    calls: list = []
    held: list = []
    report: dict[str, Any] = {}

    earlier = producer_attempts()  # an earlier pass's producer, not this one's

    def hand(ref) -> None:
        calls.append(actors[len(calls) % len(actors)].generate.remote(ref))

    for n, ref in enumerate(iter_batch_refs(ds, spec.get("batch_size", 16), prefetch=spec.get("prefetch", 2))):
        if loss is None or n < after:
            hand(ref)
            if loss is not None and n + 1 == after:
                ray.wait(calls, num_returns=len(calls))  # the first batches are consumed before the loss
            continue
        if len(held) < hold and not report:
            held.append(ref)
            if len(held) < hold:
                continue
            # where the held batches live: a stored object's node, or none for one kept in the driver's memory
            where = ray.experimental.get_object_locations(held)
            stored = {node for ref in held for node in where[ref]["node_ids"]}
            report["held_sizes"] = [where[ref]["object_size"] for ref in held]
            report["held_nodes"] = sorted(stored)
            loss(after, first=stored)
            report["held_only_on_removed_nodes"] = bool(stored) and stored <= set(loss.report["removed_ids"])
            for ref in held:
                hand(ref)
            continue
        hand(ref)
    out: list[dict] = []
    for call in calls:
        try:
            out.append({"rows": ray.get(call)})
        except Exception as exc:
            out.append({"error": type(exc).__name__, "message": str(exc)[:2000]})
    attempts = {task: n for task, n in producer_attempts().items() if task not in earlier}
    return {"calls": out, "producer_attempts": sorted(attempts.values()), **report}


def handoff_with_loss(spec: dict, loss: NodeLoss | None) -> dict:
    """``VerlDataLoader`` with ``media_handoff`` (its media store on the driver's node, which never goes; the vision
    work on the workers): (index, digest) of every row in order, the row with its media URIs (fresh keys each pass)
    replaced by the payload each resolves to, fetched as a rollout worker fetches it while the batch is held. With a
    loss: two workers go once ``after`` batches are out, so payloads made by actors on them are held (and one batch
    handed out) when their nodes go."""
    from ingest.rollout_media import media_items, prompt_media_key
    from ingest.verl import VerlDataLoader
    from ingest.verl.rollout_media import fetch_payloads

    config = {**spec["config"], "media_handoff": True}
    loader = VerlDataLoader(spec["files"], spec["model"], config, spec.get("batch_size", 8), spec["model"])
    out: list[list] = []
    for n, batch in enumerate(loader, 1):
        found = [prompt_media_key(messages) for messages in batch["raw_prompt"]]
        keys = [key for key in found if key is not None]
        payloads = dict(zip(keys, fetch_payloads(keys[0][0], [k for _, k in keys]), strict=True)) if keys else {}
        for i in range(len(batch["index"])):
            messages = batch["raw_prompt"][i]
            for item in media_items(messages):
                item[item["type"]] = "handed off"
            payload = {k: v for k, v in payloads[found[i]].items() if k != "made_by"} if found[i] else None
            row = {**{k: v[i] for k, v in batch.items() if k != "raw_prompt"}, "raw_prompt": messages}
            out.append([int(batch["index"][i]), digest({**{k: [v] for k, v in row.items()}, "payload": [payload]}, 0)])
        if loss is not None:
            loss(n)
    return {"rows": out}


def producer_attempts() -> dict[str, int]:
    """Task id -> attempts seen of each ``iter_batch_refs`` producer task, from the GCS's task events (an attempt
    after the first is Ray running the task again)."""
    from ray._private.state import state

    events = state._get_all_task_events()
    producers = {e.task_id for e in events if e.task_info.name.endswith("_produce_batches")}
    attempts: dict[str, int] = {}
    for event in events:
        if event.task_id in producers:
            task = event.task_id.hex()
            attempts[task] = max(attempts.get(task, 0), event.attempt_number + 1)
    return attempts


def state_with_loss(spec: dict, loss: NodeLoss | None) -> dict:
    """``PromptStream``: without a loss, one uninterrupted epoch's rows. With one: ``after`` batches, the loss, more
    batches up to ``state_at``, then ``state_dict()`` (through JSON, as a checkpoint would keep it); the stream is
    closed and a new ``PromptStream`` on the cluster that is left loads the state and reads the rest."""
    from ingest import PromptStream

    def stream() -> PromptStream:
        return PromptStream(spec["files"], spec["model"], spec["config"], spec.get("batch_size", 16))

    def of(batch: dict) -> list[list]:
        return [[int(batch["index"][i]), digest(batch, i)] for i in range(len(batch["index"]))]

    if loss is None:
        return {"rows": [row for batch in stream() for row in of(batch)]}
    first = stream()
    batches = iter(first)
    before: list[list] = []
    for n, batch in enumerate(batches, 1):
        before += of(batch)
        loss(n)
        if n == spec["state_at"]:
            break
    state = json.loads(json.dumps(first.state_dict()))
    batches.close()  # the consumer stops: its pipeline is shut down
    del batches, first
    resumed = stream()
    resumed.load_state_dict(state)
    rest = [row for batch in resumed for row in of(batch)]
    return {"before": before, "rest": rest, "state": state}


def run_with_loss(spec: dict, loss: NodeLoss | None) -> dict:
    """``run_pipeline`` (the run's ledger, summary and quarantine file), with nodes removed once its ledger has
    counted ``watch_rows`` rows in (the run's own loop consumes the dataset, so the loss is triggered from a thread
    that reads the ledger). A run that raises gives ``{"error": ...}``."""
    import threading

    import pyarrow.parquet as pq
    from ray._private.state import actors

    from ingest.run import run_pipeline

    stop = threading.Event()
    earlier = {a for a, v in actors().items() if v["ActorClassName"] == "RunLedger"}  # the reference run's

    def watch() -> None:
        # run_pipeline holds the ledger's handle; this thread reads its counts and removes nodes once `watch_rows`
        # rows have been counted in (the stages report each batch as they go)
        try:
            while not stop.is_set():
                handle = run_ledger_handle(earlier)
                if handle is not None and ray.get(handle.get.remote())["rows_in"] >= spec["watch_rows"]:
                    loss(loss.after, handle._actor_id.hex())
                    return
                time.sleep(0.1)
        except Exception:  # the test reads it (a thread's exception is otherwise only printed)
            import traceback

            loss.report["watch_error"] = traceback.format_exc()[-3000:]

    thread = threading.Thread(target=watch, daemon=True)
    if loss is not None:
        thread.start()
    out = spec["output"] + ("/loss" if loss else "/reference")
    try:
        summary = run_pipeline(spec["files"], spec["model"], spec["config"], output=out, batch_size=spec["batch_size"])
    except Exception as exc:
        from ingest.errors import find_ingest_error

        found = find_ingest_error(exc)
        error = {"type": type(found).__name__, "message": str(found)} if found else None
        return {"error": f"{type(exc).__name__}: {exc}"[:4000], "ingest_error": error, "nodes": loss.report}
    finally:
        stop.set()
        if loss is not None:
            thread.join(timeout=60)
    parts = sorted(str(p) for p in Path(out).glob("part-*.parquet"))
    indices = [int(x["index"]) for p in parts for x in pq.read_table(p, columns=["extra_info"])[0].to_pylist()]
    quarantine = pq.read_table(f"{out}/quarantine.parquet") if summary.quarantine_file else None
    return {
        "summary": summary.to_dict(),
        "indices": indices,
        "quarantine_rows": 0 if quarantine is None else sum(quarantine.column("rows").to_pylist()),
    }


def run_ledger_handle(skip: set[str]):
    """The handle of the ledger ``run_pipeline`` made (not one of ``skip``), found among this process's objects:
    the run keeps it local."""
    import gc

    from ray.actor import ActorHandle

    for obj in gc.get_objects():
        if isinstance(obj, ActorHandle) and "RunLedger" in str(obj._ray_actor_creation_function_descriptor):
            if obj._actor_id.hex() not in skip:
                return obj
    return None


@ray.remote
class Hog:
    """Holds CPUs of a node, as a trainer's processes on the driver's node would."""

    def ping(self) -> bool:
        return True


def occupy_driver_node(cpus: float) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    hog = Hog.options(num_cpus=cpus, scheduling_strategy=here).remote()
    ray.get(hog.ping.remote())
    return hog


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
