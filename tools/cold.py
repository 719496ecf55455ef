"""Our side of ``bench text`` / ``bench mm`` as a first run meets it: a new process, nothing started before the
clock, the default pools (``build_dataset`` starts a brand-new local Ray and Ray Data's cluster actors on the clock).
Clock from ``build_dataset`` to the last batch of ``iter_torch_batches(collate_fn=VerlCollate())``; steady state is
the rows after the first batch over the time after it. ``loader="VerlDataLoader"``: the same through the loader verl's
trainer iterates (its first batch made in the driver before Ray starts), the clock from its construction;
``loader="VerlDataLoader+len"``: the same after ``len()`` on a new dataset (an empty ``cache_dir``), as verl's trainer
calls it before its first step: the epoch's count is on the clock. ``loader="iter_torch_batches+ray"``: the README's
order, ``ray.init()`` (a brand-new local Ray) right before the clock, then ``build_dataset`` + ``iter_torch_batches``:
nothing of Ray Data started or warmed, only the cluster's own start off the clock.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tools.bench import BATCH_SIZE


def steady_rows_per_s(result: dict) -> float:
    """Rows after the first batch over the time after it."""
    return (result["rows"] - BATCH_SIZE) / (result["seconds"] - result["time_to_first_batch_s"])


def run_loader(files: list[str], model: str, config: dict, processor: str | None, loader: str) -> dict:
    """In this process: ``BENCH_CONFIG`` + ``config`` through ``build_dataset`` + ``iter_torch_batches`` or through
    ``VerlDataLoader``, collated in the config's row format; the clock from the first call to the last batch."""
    import tempfile
    import time

    import torch  # noqa: F401  (a trainer has torch loaded; verl's side imports it before its clock too)

    from ingest import VerlCollate, build_dataset
    from ingest.verl import VerlDataLoader
    from tools.bench import BENCH_CONFIG

    config = {**BENCH_CONFIG, **config}
    collate = VerlCollate(row_format=config.get("row_format", "verl-0.5"))
    if loader == "VerlDataLoader+len":  # a new dataset: nothing counted before
        config["cache_dir"] = tempfile.mkdtemp(prefix="ingest-cold-count-")
    if loader == "iter_torch_batches+ray":
        from ingest.datasets.pools import ensure_ray

        ensure_ray()  # what build_dataset would start, started first: the clock begins as the call returns
    started = time.perf_counter()
    if loader.startswith("VerlDataLoader"):
        batches = VerlDataLoader(files, model, config, BATCH_SIZE, processor, drop_last=False, collate_fn=collate)
        if loader == "VerlDataLoader+len":
            len(batches)
    else:
        ds = build_dataset(files, model, config, processor=processor)
        batches = ds.iter_torch_batches(batch_size=BATCH_SIZE, collate_fn=collate)
    marks, rows = [], 0
    for batch in batches:
        if len(marks) < 2:
            marks.append(time.perf_counter() - started)
        rows += len(batch["dummy_tensor"] if "dummy_tensor" in batch else batch["input_ids"])  # verl 0.9: no ids
    seconds = time.perf_counter() - started
    return {
        "rows": rows,
        "seconds": seconds,
        "time_to_first_batch_s": marks[0],
        "time_to_second_batch_s": marks[-1],
        "rows_per_s": rows / seconds,
    }


def run_cold(
    files: list[str], model: str, config: dict, processor: str | None, loader: str = "iter_torch_batches"
) -> dict:
    """``run_loader`` in a new process on a new local Ray session (never a cluster left running on the machine)."""
    spec = json.dumps({"files": files, "model": model, "config": config, "processor": processor, "loader": loader})
    env = {**os.environ, "RAY_ADDRESS": "local"}
    proc = subprocess.run(
        [sys.executable, "-m", __name__, spec], env=env, capture_output=True, text=True, check=False, timeout=3600
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the cold run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    measured = run_loader(args["files"], args["model"], args["config"], args["processor"], args["loader"])
    measured = {k: round(v, 3) for k, v in measured.items()}
    print(json.dumps({**measured, "steady_rows_per_s": round(steady_rows_per_s(measured), 1)}))
