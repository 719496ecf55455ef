"""``python -m ingest bench scaling``: rows/s against the number of tokenizer actors (1, 2, 4, ... up to the cores), on
text rows and on image rows (the one-pool layout: each tokenizer actor also decodes and runs the vision stage), beside
the bare ceiling: the same number of plain processes rendering the template and batch-encoding their share of the
rows, no Ray.

One Ray session, warm (Ray Data's cluster actors created first), each actor one CPU. Per count: rows/s over the whole
pass and in steady state (rows after the first batch over the time after it), and the share of linear scaling
(rows/s at n actors over n times rows/s at one).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor

from ingest.devtools.bench import BATCH_SIZE, BENCH_CONFIG, _start_ray, geo3k_files, gsm8k_files, run_ours
from ingest.devtools.session import cache_dir


def _pass(files: list[str], model: str, config: dict, processor: str | None) -> dict:
    """``bench.run_ours`` plus the steady state: rows after the first batch over the time after it."""
    result = run_ours(files, model, config, processor)
    steady = (result["rows"] - BATCH_SIZE) / (result["seconds"] - result["time_to_first_batch_s"])
    return {**{k: round(v, 2) for k, v in result.items()}, "steady_rows_per_s": round(steady, 1)}


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


def bench_scaling(
    text_rows: int = 200_000, image_rows: int = 2_000, counts: list[int] | None = None, work_dir: str | None = None
) -> dict:
    import ray

    from ingest.tokenizer.offline import build_offline_model_dir

    cores = os.cpu_count() or 1
    counts = [n for n in (counts or [1, 2, 4, 8, 16]) if n <= cores]
    model = str(build_offline_model_dir())
    work = cache_dir(work_dir)
    result = {**_start_ray(), "cores": cores, "text": [], "images": []}
    cases = []
    if text_rows:
        cases.append(("text", gsm8k_files(work, text_rows), None, {}))
    if image_rows:
        # small read units: at least four per actor at the largest count
        units = max(16, image_rows // (4 * max(counts)))
        one_pool = {
            "decode_pool_max_size": 0,
            "vision_pool_max_size": 0,
            "truncation": "left",
            "read_rows_per_task": units,
        }
        cases.append(("images", geo3k_files(work, image_rows), model, one_pool))
    for kind, files, processor, extra in cases:
        for n in counts:
            pools = {"tokenizer_pool_min_size": n, "tokenizer_pool_max_size": n, "tokenizer_num_cpus": 1}
            entry = {"actors": n, **_pass(files, model, {**BENCH_CONFIG, **extra, **pools}, processor)}
            if kind == "text":
                entry["ceiling"] = _ceiling(files, model, n)
                entry["share_of_ceiling"] = round(entry["steady_rows_per_s"] / entry["ceiling"]["rows_per_s"], 3)
            base = result[kind][0]["steady_rows_per_s"] if result[kind] else entry["steady_rows_per_s"]
            entry["share_of_linear"] = round(entry["steady_rows_per_s"] / (n * base), 3)
            result[kind].append(entry)
            print(kind, entry, flush=True)
    ray.shutdown()
    return result
