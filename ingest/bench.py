"""``python -m ingest bench text``: verl 0.5.0 (RLHFDataset + DataLoader) vs this pipeline on the same data, one run.

Both read the same generated gsm8k-shaped Parquet, with the same tokenizer and ``data`` config (max_prompt_length
1024, overlong filter on, 1% overlong prompts), batch size 64. verl: ``DataLoader(num_workers=2)`` in a subprocess
(the oracle environment). Ours: ``build_dataset`` + ``iter_torch_batches(collate_fn=VerlCollate())`` on a local Ray
started before the clock (Ray start-up is reported apart: a cluster outlives one epoch). Time to first batch counts
from dataset construction (verl: from ``RLHFDataset(...)``, tokenizer load included on both sides).
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

BENCH_CONFIG = {"max_prompt_length": 1024, "filter_overlong_prompts": True, "truncation": "error", "shuffle": False}
BATCH_SIZE = 64


def _data(work_dir: Path, rows: int) -> list[str]:
    from ingest.sample import write_gsm8k_parquet

    out = work_dir / f"gsm8k-{rows}"
    existing = sorted(str(p) for p in out.glob("*.parquet"))
    if existing:
        return existing
    return write_gsm8k_parquet(out, rows, num_files=max(1, rows // 50_000), row_group_size=1000, long_every=100)


def run_ours(files: list[str], tokenizer: str, config: dict | None = None, processor: str | None = None) -> dict:
    import torch  # noqa: F401  (a trainer has torch loaded; verl's side imports it before its clock too)

    from ingest import VerlCollate, build_dataset

    started = time.perf_counter()
    ds = build_dataset(files, tokenizer, {**BENCH_CONFIG, **(config or {})}, processor=processor)
    first, rows = None, 0
    for batch in ds.iter_torch_batches(batch_size=BATCH_SIZE, collate_fn=VerlCollate()):
        if first is None:
            first = time.perf_counter() - started
        rows += len(batch["input_ids"])
    seconds = time.perf_counter() - started
    return {"rows": rows, "seconds": seconds, "time_to_first_batch_s": first, "rows_per_s": rows / seconds}


def _start_ray() -> dict:
    import ray

    t = time.perf_counter()
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    return {
        "machine": f"{platform.node()} {os.cpu_count()} cores, {platform.processor() or platform.machine()}",
        "date": time.strftime("%Y-%m-%d"),
        "ray_init_s": round(time.perf_counter() - t, 2),
        "sizes": [],
    }


def _work_dir(work_dir: str | None) -> Path:
    work = Path(work_dir or Path(tempfile.gettempdir()) / "ingest-bench")
    work.mkdir(parents=True, exist_ok=True)
    return work


def _compare(files: list[str], model: str, config: dict, processor: str | None, work: Path, skip_verl: bool) -> dict:
    """Ours, then verl 0.5.0, on the same files: rows/s of both and their ratio."""
    from ingest.oracle import run_verl

    entry: dict = {"ours": run_ours(files, model, config, processor=processor)}
    if not skip_verl:
        cfg = {**config, "cache_dir": str(work / "verl-cache")}
        verl = run_verl("bench", files, model, cfg, batch_size=BATCH_SIZE, num_workers=2, processor=processor)
        entry["verl"] = verl
        entry["ratio_rows_per_s"] = round(entry["ours"]["rows_per_s"] / verl["rows_per_s"], 2)
        assert verl["rows"] == entry["ours"]["rows"], f"row counts differ: verl {verl['rows']}, ours {entry['ours']}"
    return entry


def bench_mm(rows=(1000,), work_dir: str | None = None, skip_verl: bool = False, config: dict | None = None) -> dict:
    """geo3k-shaped rows (one or two 28..900 px images each, 8 image kinds), processor path, filter on."""
    import ray

    from ingest.offline import build_offline_model_dir
    from ingest.sample import write_geo3k_parquet

    model = str(build_offline_model_dir())
    work = _work_dir(work_dir)
    result = _start_ray()
    mm_config = {**BENCH_CONFIG, "truncation": "left", **(config or {})}
    for n in rows:
        out = work / f"geo3k-{n}"
        files = sorted(str(p) for p in out.glob("*.parquet")) or write_geo3k_parquet(out, n, row_group_size=100)
        images = sum(len(x) for f in files for x in pq.read_table(f, columns=["images"])["images"].to_pylist())
        entry = {"rows": n, "images": images, **_compare(files, model, mm_config, model, work, skip_verl)}
        result["sizes"].append(entry)
        print(entry, flush=True)
    ray.shutdown()
    return result


def bench_text(rows=(20_000, 200_000), work_dir: str | None = None, skip_verl: bool = False) -> dict:
    import ray

    from ingest.offline import build_offline_model_dir

    tokenizer = str(build_offline_model_dir())
    work = _work_dir(work_dir)
    result = _start_ray()
    for n in rows:
        entry = {"rows": n, **_compare(_data(work, n), tokenizer, BENCH_CONFIG, None, work, skip_verl)}
        result["sizes"].append(entry)
        print(entry, flush=True)
    ray.shutdown()
    return result
