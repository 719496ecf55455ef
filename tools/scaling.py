"""``python -m ingest bench scaling``: rows/s against the number of tokenizer actors (1, 2, 4, ... up to the cores) on
text rows, beside the bare ceiling (the same number of plain processes rendering the template and batch-encoding
their share of the rows, no Ray), and image rows/s of the media layouts on the machine's cores (and GPU).

One Ray session, warm (Ray Data's cluster actors created first). Each pass is consumed two ways: by the driver alone
(``iter_torch_batches`` with ``VerlCollate``, as a single trainer process) and by ``consumers`` stand-in
data-parallel workers, each iterating its ``streaming_split`` shard the same way (``ingest.feed.split_for_rollout``).
Per pass: rows/s over the whole pass and in steady state (rows after the first batch over the time after it), and
for text the share of linear scaling (steady rows/s at n actors over n times the rate at one).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor

from tools.bench import BATCH_SIZE, BENCH_CONFIG, _start_ray, geo3k_files, gsm8k_files, run_ours
from tools.cold import steady_rows_per_s
from tools.session import cache_dir


def _rounded(result: dict) -> dict:
    """A pass's figures rounded, with its steady state (``cold.steady_rows_per_s``)."""
    return {**{k: round(v, 2) for k, v in result.items()}, "steady_rows_per_s": round(steady_rows_per_s(result), 1)}


class ShardConsumer:
    """A stand-in data-parallel worker (a rollout or trainer rank): iterates its shard as verl batches."""

    def drain(self, shard) -> dict:
        from ingest import VerlCollate

        rows, first = 0, None
        for batch in shard.iter_torch_batches(batch_size=BATCH_SIZE, collate_fn=VerlCollate()):
            first = first or time.time()
            rows += len(batch["input_ids"])
        return {"rows": rows, "first": first, "end": time.time()}


def _split_pass(files: list[str], model: str, config: dict, processor: str | None, consumers: list) -> dict:
    """The pass with ``len(consumers)`` workers taking ``streaming_split`` shards (started before the clock, as a
    training job's workers are); the clock from ``build_dataset`` to the last worker's last batch."""
    import ray

    from ingest import build_dataset
    from ingest.feed import split_for_rollout

    started = time.time()
    ds = build_dataset(files, model, {**BENCH_CONFIG, **config}, processor=processor)
    shards = split_for_rollout(ds, len(consumers))
    done = ray.get([c.drain.remote(s) for c, s in zip(consumers, shards, strict=True)])
    rows, seconds = sum(d["rows"] for d in done), max(d["end"] for d in done) - started
    first = min(d["first"] for d in done if d["first"]) - started
    return _rounded({"rows": rows, "seconds": seconds, "time_to_first_batch_s": first, "rows_per_s": rows / seconds})


def _encode_share(args: tuple) -> tuple[int, float]:
    """One ceiling process: render + batch-encode its share of the prompts (``ChatTokenizer``, no Ray); the rows and
    the seconds of that work alone (reading and the tokenizer load before the clock)."""
    files, model, part, parts = args
    import pyarrow.parquet as pq

    from ingest.tokenizer.chat import ChatTokenizer

    chat = ChatTokenizer(model)
    prompts = [p for f in files for p in pq.read_table(f, columns=["prompt"])["prompt"].to_pylist()][part::parts]
    started, rows = time.perf_counter(), 0
    for start in range(0, len(prompts), 256):
        rows += len(chat.encode_batch([chat.render(m) for m in prompts[start : start + 256]]))
    return rows, time.perf_counter() - started


def _ceiling(files: list[str], model: str, processes: int) -> dict:
    """``processes`` at once, each on its share: all rows over the slowest one's render + encode time."""
    with ProcessPoolExecutor(processes) as pool:
        shares = list(pool.map(_encode_share, [(files, model, k, processes) for k in range(processes)]))
    rows, seconds = sum(r for r, _ in shares), max(s for _, s in shares)
    return {"rows": rows, "seconds": round(seconds, 2), "rows_per_s": round(rows / seconds, 1)}


def image_layouts(cpus: int, gpus: float) -> dict[str, dict]:
    """The media layouts compared: the one chosen from the cluster (``default``), one pool of tokenizer actors that
    also decode and run vision (one per CPU but the consumer's), three CPU pools splitting the CPUs, and (with a GPU)
    the same with the vision pool on GPU actors sharing it (``vision_num_gpus`` 1/4, four actors)."""
    third = max(1, (cpus - 1) // 3)
    layouts = {
        "default": {},
        "one_pool": {"tokenizer_pool_max_size": max(1, cpus - 1), "decode_pool_max_size": 0, "vision_pool_max_size": 0},
        "three_pools": {"tokenizer_pool_max_size": third, "decode_pool_max_size": third, "vision_pool_max_size": third},
    }
    if gpus >= 1:
        layouts["gpu_vision"] = {**layouts["three_pools"], "vision_pool_max_size": 4, "vision_num_gpus": 0.25}
    return layouts


def bench_scaling(
    text_rows: int = 200_000,
    image_rows: int = 2_000,
    counts: list[int] | None = None,
    work_dir: str | None = None,
    consumers: int = 4,
) -> dict:
    import ray

    from ingest.tokenizer.offline import build_offline_model_dir

    cores = os.cpu_count() or 1
    counts = [n for n in (counts or [1, 2, 4, 8, 16]) if n <= cores]
    model = str(build_offline_model_dir())
    work = cache_dir(work_dir)
    result = {**_start_ray(), "cores": cores, "consumers": consumers, "text": [], "images": []}
    workers = [ray.remote(num_cpus=0)(ShardConsumer).remote() for _ in range(consumers)]
    ray.get([w.__ray_ready__.remote() for w in workers])

    def passes(files: list[str], config: dict, processor: str | None) -> dict:
        return {
            "driver": _rounded(run_ours(files, model, config, processor)),
            "split": _split_pass(files, model, config, processor, workers),
        }

    if text_rows:
        files = gsm8k_files(work, text_rows)
        for n in counts:
            pools = {"tokenizer_pool_min_size": n, "tokenizer_pool_max_size": n, "tokenizer_num_cpus": 1}
            entry = {"actors": n, **passes(files, pools, None), "ceiling": _ceiling(files, model, n)}
            for mode in ("driver", "split"):
                rate = entry[mode]["steady_rows_per_s"]
                base = result["text"][0][mode]["steady_rows_per_s"] if result["text"] else rate
                entry[mode]["share_of_linear"] = round(rate / (n * base), 3)
                entry[mode]["share_of_ceiling"] = round(rate / entry["ceiling"]["rows_per_s"], 3)
            result["text"].append(entry)
            print("text", entry, flush=True)
    if image_rows:
        files = geo3k_files(work, image_rows)
        resources = ray.cluster_resources()
        # small read units: at least four per actor of the widest pool
        units = {"truncation": "left", "read_rows_per_task": max(16, image_rows // (4 * cores))}
        for name, layout in image_layouts(cores, resources.get("GPU", 0.0)).items():
            entry = {"layout": name, "config": layout, **passes(files, {**units, **layout}, model)}
            result["images"].append(entry)
            print("images", entry, flush=True)
    ray.shutdown()
    return result
