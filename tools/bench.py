"""``python -m ingest bench text``: verl 0.5.0 (RLHFDataset + DataLoader) vs this pipeline on the same data, one run.

Both read the same generated gsm8k-shaped Parquet, with the same tokenizer and ``data`` config (max_prompt_length
1024, overlong filter on, 1% overlong prompts), batch size 64. verl: ``DataLoader(num_workers=2)`` in a subprocess
(the oracle environment). Ours: ``build_dataset`` + ``iter_torch_batches(collate_fn=VerlCollate())`` on a local Ray
started before the clock (Ray start-up is reported apart: a cluster outlives one epoch). Time to first batch counts
from dataset construction (verl: from ``RLHFDataset(...)``, tokenizer load included on both sides).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import pyarrow.parquet as pq

from tools.session import cache_dir, cached_files, start_local_ray

BENCH_CONFIG = {"max_prompt_length": 1024, "filter_overlong_prompts": True, "truncation": "error", "shuffle": False}
BATCH_SIZE = 64
# Image prompts on 2 cores, three layouts, each measured in one run against one verl run (in this order by default):
# ``one_pool``: decode and vision in the tokenizer actors (``decode_pool_max_size`` and ``vision_pool_max_size`` 0),
# two of them, one per core, each taking whole units through every stage; ``decode_in_tokenizer``: one tokenizer actor
# that decodes, one vision actor; ``decode_pool``: three pools (the layout of clusters above 4 CPUs), one actor each
# (its 1..2 per pool would start up to six processes on the 2 cores).
MM_LAYOUTS = {
    "one_pool": {
        "tokenizer_pool_min_size": 2,
        "tokenizer_pool_max_size": 2,
        "decode_pool_max_size": 0,
        "vision_pool_max_size": 0,
    },
    "decode_in_tokenizer": {"tokenizer_pool_max_size": 1, "decode_pool_max_size": 0, "vision_pool_max_size": 1},
    "decode_pool": {"tokenizer_pool_max_size": 1, "decode_pool_max_size": 1, "vision_pool_max_size": 1},
}


def gsm8k_files(work_dir: Path, rows: int) -> list[str]:
    """gsm8k-shaped rows (1% overlong, 50k rows per file, 1000-row row groups) from the sample-data cache."""
    from ingest.demo import write_gsm8k_parquet

    def write(out: Path) -> list[str]:
        return write_gsm8k_parquet(out, rows, num_files=max(1, rows // 50_000), row_group_size=1000, long_every=100)

    return cached_files(work_dir, f"gsm8k-{rows}", write)


def geo3k_files(work_dir: Path, rows: int) -> list[str]:
    """geo3k-shaped image rows (100-row row groups) from the sample-data cache."""
    from tools.samples import write_geo3k_parquet

    return cached_files(work_dir, f"geo3k-{rows}", lambda out: write_geo3k_parquet(out, rows, row_group_size=100))


def run_ours(files: list[str], tokenizer: str, config: dict | None = None, processor: str | None = None) -> dict:
    """Ours in this process (``tools/cold.py``'s ``run_loader`` through ``iter_torch_batches``)."""
    from tools.cold import run_loader

    return run_loader(files, tokenizer, config or {}, processor, "iter_torch_batches")


def _start_ray(preload_modules: tuple[str, ...] = ()) -> dict:
    """A new local Ray, settled, with Ray Data's cluster-wide actors created (``_start_ray_data``)."""
    result = start_local_ray(preload_modules=preload_modules)
    return {**result, "settle_s": _settle(), "ray_data_cluster_start_s": _start_ray_data(), "sizes": []}


class _Identity:
    def __call__(self, batch):
        return batch


def _start_ray_data() -> float:
    """Run a one-row actor-pool dataset through ``iter_torch_batches``, as a trainer consumes one: the first dataset
    on a new cluster creates Ray Data's cluster-wide detached actors (stats, autoscaling coordinator, actor-location
    tracker), and the first iteration in a process sets up Ray Data's driver-side iterator (imports, threads); a
    trainer that has run any dataset (verl validates before training) has both, and neither clock should carry that
    one-off cost. No code of this project runs here. Returns its time (reported with the results)."""
    import ray

    t = time.perf_counter()
    pool = ray.data.ActorPoolStrategy(min_size=1, max_size=1)
    ds = ray.data.range(1, override_num_blocks=1).map_batches(_Identity, compute=pool, num_cpus=0.5)
    for _ in ds.iter_torch_batches(batch_size=1):
        pass
    seconds = round(time.perf_counter() - t, 2)
    _settle()
    return seconds


# ``bench mm --warm-workers``: what the prestarted workers import, so only our actors' own set-up is on the clock (Ray
# Data's actor wrapper and the issue-detector config its pickled context brings in, beyond ``import ray.data``)
WARM_WORKER_MODULES = (
    "ray.data",
    "ray.data._internal.execution.operators.actor_pool_map_operator",
    "ray.data._internal.issue_detection.issue_detector_configuration",
    "torch",
    "PIL.Image",
)


def _prestart_workers(count: int, keep_alive_s: int = 300) -> None:
    """Have the raylet start ``count`` idle Python workers for this job (each imports ``WARM_WORKER_MODULES`` when
    Ray was started with them), which the next actors take instead of starting processes. A diagnostic of how much
    of a run is worker start-up, not a pipeline feature: Ray has no public API for it, this calls the raylet's
    ``PrestartWorkers`` RPC (Ray 2.60), which starts at most one worker per CPU per call."""
    import grpc
    import ray
    from ray._private.authentication.grpc_authentication_client_interceptor import (
        _get_authentication_metadata_tuple,
    )
    from ray.core.generated import node_manager_pb2, node_manager_pb2_grpc

    node = ray._private.worker.global_worker.node
    with grpc.insecure_channel(f"{node.node_ip_address}:{node.node_manager_port}") as channel:
        raylet = node_manager_pb2_grpc.NodeManagerServiceStub(channel)
        per_call = max(1, int(ray.cluster_resources().get("CPU", 1)))
        for start in range(0, count, per_call):
            request = node_manager_pb2.PrestartWorkersRequest(
                language=0,  # Python
                job_id=bytes.fromhex(ray.get_runtime_context().get_job_id()),
                keep_alive_duration_secs=keep_alive_s,
                num_workers=min(per_call, count - start),
            )
            request.runtime_env_info.serialized_runtime_env = "{}"  # the job's (empty) runtime env: actors match it
            raylet.PrestartWorkers(request, timeout=30, metadata=_get_authentication_metadata_tuple())
            _settle()  # the next call's cap counts idle CPUs: let these workers finish their imports first


def _settle(quiet_percent: float = 25.0, longest_s: float = 30.0) -> float:
    """Wait until the machine is quiet after ``ray.init`` (its node agents keep starting for seconds after it
    returns): a trainer's cluster has been up long before its first batch, so neither side's clock includes that."""
    import psutil

    t = time.perf_counter()
    while time.perf_counter() - t < longest_s and psutil.cpu_percent(interval=1.0) > quiet_percent:
        pass
    return round(time.perf_counter() - t, 1)


def _compare(
    files: list[str],
    model: str,
    config: dict,
    processor: str | None,
    work: Path,
    skip_verl: bool,
    layouts: dict[str, dict] | None = None,
    warm_workers: bool = False,
) -> dict:
    """Ours (warm, each layout), ours cold (``tools/cold.py``), the bare ceilings (text: every core, one process),
    then verl 0.5.0, on the same files: rows/s of each, the ratios to verl. ``layouts``: name -> our pool settings,
    each run in turn, in that order (``default`` and ``decode_pool``: ``ours`` / ``ratio_rows_per_s``; the others:
    ``ours_<name>`` / ``ratio_<name>``; ``order`` lists them). ``warm_workers``: one prestarted worker per actor of
    the layout waits for it (``_prestart_workers``)."""
    from tools.oracle import run_verl

    layouts = layouts or {"default": {}}
    plain = ("ours", "ratio_rows_per_s")
    keys = [plain if name in ("default", "decode_pool") else (f"ours_{name}", f"ratio_{name}") for name in layouts]
    entry: dict = {"order": list(layouts)}
    for (ours_key, _), pools in zip(keys, layouts.values(), strict=True):
        if warm_workers:
            _prestart_workers(sum(pools.get(f"{pool}_pool_max_size", 1) for pool in ("tokenizer", "decode", "vision")))
        _settle()  # each clock starts on a quiet machine (the previous run's processes and cache writes wind down)
        entry[ours_key] = run_ours(files, model, {**config, **pools}, processor=processor)
    # cold: a new process and Ray session, the default pools, nothing warmed (the first run a user meets)
    from tools.cold import run_cold, steady_rows_per_s

    _settle()
    entry["ours_cold"] = run_cold(files, model, config, processor)
    _settle()  # the same with Ray started right before the clock (the README's order): Ray Data's start on it
    entry["ours_cold_ray_started"] = run_cold(files, model, config, processor, loader="iter_torch_batches+ray")
    _settle()  # the same through the loader verl's trainer iterates: its first batch made in the driver
    entry["ours_cold_verl_loader"] = run_cold(files, model, config, processor, loader="VerlDataLoader")
    _settle()  # the same after len() on a new dataset (verl's trainer calls it first): the epoch's count on the clock
    entry["ours_cold_verl_loader_new_dataset"] = run_cold(files, model, config, processor, loader="VerlDataLoader+len")
    if processor is None:  # the bare ceiling on the same rows: render + batch encode on every core, no Ray
        from tools.scaling import _ceiling

        _settle()
        ceiling = entry["ceiling"] = _ceiling(files, model, os.cpu_count() or 1)
        for key in ("ours", "ours_cold", "ours_cold_ray_started", "ours_cold_verl_loader"):
            share = steady_rows_per_s(entry[key]) / ceiling["rows_per_s"]
            entry[f"steady_share_of_ceiling{key.removeprefix('ours')}"] = round(share, 3)
        # the same work in one process (the tokenizer's own threads on every core): what a loader that keeps the
        # epoch in one process, as the driver does on 2 CPUs, can reach at best
        _settle()
        one = entry["ceiling_one_process"] = _ceiling(files, model, 1)
        share = steady_rows_per_s(entry["ours_cold_verl_loader"]) / one["rows_per_s"]
        entry["steady_share_of_one_process_ceiling_cold_verl_loader"] = round(share, 3)
    if not skip_verl:
        _settle()
        cfg = {**config, "cache_dir": str(work / "verl-cache")}
        verl = run_verl("bench", files, model, cfg, batch_size=BATCH_SIZE, num_workers=2, processor=processor)
        entry["verl"] = verl
        for ours_key, ratio_key in keys:
            ours = entry[ours_key]
            assert verl["rows"] == ours["rows"], f"row counts differ: verl {verl['rows']}, {ours_key} {ours['rows']}"
            entry[ratio_key] = round(ours["rows_per_s"] / verl["rows_per_s"], 2)
        entry["ratio_cold"] = round(entry["ours_cold"]["rows_per_s"] / verl["rows_per_s"], 2)
        for loader in ("ray_started", "verl_loader", "verl_loader_new_dataset"):
            entry[f"ratio_cold_{loader}"] = round(entry[f"ours_cold_{loader}"]["rows_per_s"] / verl["rows_per_s"], 2)
    return entry


def bench_mm(
    rows=(1000,),
    work_dir: str | None = None,
    skip_verl: bool = False,
    config: dict | None = None,
    warm_workers: bool = False,
    layouts: Sequence[str] = tuple(MM_LAYOUTS),
) -> dict:
    """geo3k-shaped rows (one or two 28..900 px images each, 8 image kinds), processor path, filter on.
    The ``MM_LAYOUTS`` named in ``layouts``, in that order (``ours``: the decode pool; the others ``ours_<name>``),
    then verl, in one run. Order matters: the first of our runs in a new Ray session writes to object-store pages
    and grows the driver's heap for the first time (docs/benchmarks.md). ``warm_workers``: our actors start in
    prestarted workers that imported Ray Data and torch before the clock (a diagnostic: how much of our time is
    process start-up)."""
    import ray

    from ingest.tokenizer.offline import build_offline_model_dir

    unknown = [name for name in layouts if name not in MM_LAYOUTS]
    if unknown:
        raise ValueError(f"unknown layouts {unknown}: choose from {list(MM_LAYOUTS)}")
    chosen = {name: MM_LAYOUTS[name] for name in layouts}
    model = str(build_offline_model_dir())
    work = cache_dir(work_dir)
    result = _start_ray(WARM_WORKER_MODULES if warm_workers else ())
    result["warm_workers"] = warm_workers
    mm_config = {**BENCH_CONFIG, "truncation": "left", **(config or {})}
    for n in rows:
        files = geo3k_files(work, n)
        images = sum(len(x) for f in files for x in pq.read_table(f, columns=["images"])["images"].to_pylist())
        compared = _compare(files, model, mm_config, model, work, skip_verl, chosen, warm_workers)
        entry = {"rows": n, "images": images, **compared}
        result["sizes"].append(entry)
        print(entry, flush=True)
    ray.shutdown()
    return result


def bench_text(rows=(20_000, 200_000), work_dir: str | None = None, skip_verl: bool = False) -> dict:
    import ray

    from ingest.tokenizer.offline import build_offline_model_dir

    tokenizer = str(build_offline_model_dir())
    work = cache_dir(work_dir)
    result = _start_ray()
    for n in rows:
        entry = {"rows": n, **_compare(gsm8k_files(work, n), tokenizer, BENCH_CONFIG, None, work, skip_verl)}
        result["sizes"].append(entry)
        print(entry, flush=True)
    ray.shutdown()
    return result


# --- python -m ingest bench refs: feeding rollout actors by object ref vs by value ------------------------------------


def _rss() -> dict:
    """The driver's resident memory from /proc: total and anonymous (heap) bytes (shared-memory pages apart)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


class _MemorySampler:
    """Peak driver RSS (total, anon) while a block runs, sampled every 10 ms on a thread."""

    def __enter__(self):
        import threading

        self.base = _rss()
        self.peak = dict(self.base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.01):
            for key, value in _rss().items():
                self.peak[key] = max(self.peak.get(key, 0), value)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def result(self) -> dict:
        mib = 1 << 20
        return {
            "driver_rss_base_mib": round(self.base["VmRSS"] / mib, 1),
            "driver_rss_peak_mib": round(self.peak["VmRSS"] / mib, 1),
            "driver_rss_growth_mib": round((self.peak["VmRSS"] - self.base["VmRSS"]) / mib, 1),
            "driver_anon_growth_mib": round((self.peak["RssAnon"] - self.base["RssAnon"]) / mib, 1),
            "driver_shmem_peak_mib": round(self.peak.get("RssShmem", 0) / mib, 1),
        }


def _feed(batches, actors, in_flight: int) -> tuple[dict, dict]:
    """Round-robin ``batches`` (refs or dicts) to ``actors``, at most ``in_flight`` calls outstanding per actor."""
    import collections

    import ray

    pending = [collections.deque() for _ in actors]
    rows = count = 0
    started = time.perf_counter()
    with _MemorySampler() as memory:
        for i, batch in enumerate(batches):
            k = i % len(actors)
            if len(pending[k]) >= in_flight:
                rows += ray.get(pending[k].popleft())
            pending[k].append(actors[k].generate.remote(batch))
            count += 1
        for queue in pending:
            rows += sum(ray.get(list(queue)))
    seconds = time.perf_counter() - started
    feed = {"batches": count, "rows": rows, "seconds": round(seconds, 3), "batches_per_s": round(count / seconds, 1)}
    return feed, memory.result()


def _rollout_actor_class():
    import ray

    @ray.remote(num_cpus=0)
    class RolloutStandIn:
        """Reads what a rollout worker reads: the id tensors as torch (no copy for numpy refs), every prompt's
        ``raw_prompt_ids``; returns the row count."""

        def generate(self, batch) -> int:
            from ingest.feed import batch_to_torch

            batch = batch_to_torch(batch)
            tokens = int(batch["attention_mask"].sum()) + int(batch["input_ids"][:, -1].sum())
            assert tokens > 0 and sum(len(ids) for ids in batch["raw_prompt_ids"]) > 0
            return len(batch["index"])

    return RolloutStandIn


def bench_refs(
    rows: int = 20_000, work_dir: str | None = None, batch_size: int = BATCH_SIZE, actors: int = 3, repeats: int = 3
) -> dict:
    """Batches/s delivered to ``actors`` rollout actors and the driver's memory: object refs vs by value.

    Text rows (gsm8k-shaped, 1% overlong and filtered), the embedded tokenizer, max_prompt_length 1024, batch 64.
    ``materialized``: the tokenized rows are materialized first, so the figures are the feeding path alone;
    ``live``: the pipeline runs while feeding. Modes: ``by_value`` (the driver iterates
    ``iter_torch_batches(collate_fn=VerlCollate())`` and passes each dict to ``actor.generate.remote(batch)``),
    ``refs_numpy`` / ``refs_torch`` (``iter_batch_refs(ds, batch_size, tensors=...)``, the ref as the argument).
    Every mode keeps at most 2 calls in flight per actor. One unrecorded warm-up pass per mode, then ``repeats``
    rounds (modes interleaved); the summary gives the median and best batches/s and the largest driver RSS growth.
    """
    import ray

    from ingest import VerlCollate, build_dataset, iter_batch_refs
    from ingest.tokenizer.offline import build_offline_model_dir

    tokenizer = str(build_offline_model_dir())
    work = cache_dir(work_dir)
    result = {**start_local_ray(), "load_average_1m_at_start": round(os.getloadavg()[0], 2), "sizes": []}
    files = gsm8k_files(work, rows)
    pool = [_rollout_actor_class().remote() for _ in range(actors)]
    ray.get([a.__ray_ready__.remote() for a in pool])
    modes = {
        "by_value": lambda ds: ds.iter_torch_batches(batch_size=batch_size, collate_fn=VerlCollate()),
        "refs_numpy": lambda ds: iter_batch_refs(ds, batch_size, tensors="numpy"),
        "refs_torch": lambda ds: iter_batch_refs(ds, batch_size, tensors="torch"),
    }
    t = time.perf_counter()
    materialized = build_dataset(files, tokenizer, BENCH_CONFIG).materialize()
    result.update(rows=materialized.count(), actors=actors, batch_size=batch_size)
    result["materialize_s"] = round(time.perf_counter() - t, 2)
    for batches_of in modes.values():  # warm-up, not recorded: worker processes start, imports happen
        _feed(batches_of(materialized), pool, in_flight=2)
    for source in ("materialized", "live"):
        for repeat in range(repeats):
            for mode, batches_of in modes.items():
                ds = materialized if source == "materialized" else build_dataset(files, tokenizer, BENCH_CONFIG)
                feed, memory = _feed(batches_of(ds), pool, in_flight=2)
                assert feed["rows"] == result["rows"], (mode, feed, result["rows"])
                entry = {"source": source, "mode": mode, "repeat": repeat, **feed, **memory}
                entry["load_average_1m"] = round(os.getloadavg()[0], 2)
                result["sizes"].append(entry)
                print(entry, flush=True)
    result["summary"] = {}
    for source in ("materialized", "live"):
        for mode in modes:
            runs = [e for e in result["sizes"] if e["source"] == source and e["mode"] == mode]
            rates = sorted(e["batches_per_s"] for e in runs)
            result["summary"][f"{source}/{mode}"] = {
                "batches_per_s_median": rates[len(rates) // 2],
                "batches_per_s_best": rates[-1],
                "driver_rss_growth_mib_max": max(e["driver_rss_growth_mib"] for e in runs),
                "driver_anon_growth_mib_max": max(e["driver_anon_growth_mib"] for e in runs),
            }
    ray.shutdown()
    return result
