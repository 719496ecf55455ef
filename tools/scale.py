"""``python -m ingest bench scale``: peak memory of a streaming pass over generated prompts, 100k and 1M text rows
(gsm8k-shaped) or, with ``--images``, 10k and 100k image rows (geo3k-shaped).

Each size runs in a fresh child process with its own local Ray (``address="local"``), so no size inherits the
other's driver heap, workers or object store. The child streams the dataset through ``build_dataset`` +
``iter_torch_batches(collate_fn=VerlCollate())`` (batch 256, the embedded offline Qwen2-VL tokenizer, default pools;
image rows: the same directory as the processor, ``processor=``, the default config's media layout) and a
background thread samples memory every 0.5 s:

- the processes of this Ray session: the driver and every process below it (``psutil.Process().children(
  recursive=True)``: gcs_server, raylet, the dashboard / runtime-env agents, every ``ray::`` worker). Other Ray
  sessions on the machine are not counted. Per process ``memory_full_info()``: RSS, USS (private pages) and PSS
  (shared pages split between the processes that map them, so the object store's ``/dev/shm`` pages and shared
  libraries count once in the sum);
- the object store: ``object_store_bytes_used`` of the raylet's store stats (the ``FormatGlobalMemoryInfo`` RPC
  behind ``ray._private.internal_api.memory_summary(stats_only=True)`` in Ray 2.60; ``ray.available_resources()``
  does not move with object store use: it is a logical resource).

"Peak memory" is the largest PSS sum over the run: every page the session holds, store included, counted once.
Also reported: peak USS sum + store bytes in use (the same thing counted another way), peak RSS sum (counts shared
pages once per process: an upper bound), the per-kind peaks (driver / raylet / gcs / workers / other), the idle
baseline after ``ray.init`` and rows/s.

The data is generated once per size into the sample-data cache, in a child process of its own (the generator's
memory never counts). Text: 50k rows per file, 1000-row row groups, 1% overlong. Images
(``write_geo3k_pool_parquet``): 5,000 rows per file, 1000-row row groups, one image per row and two in every 5th
(every 7th row's by path), drawn in turn from a pool of 1,500 distinct images encoded once (``make_image``'s 8 kinds
and pixel sizes, 28..900 px, noise in 8-pixel squares: ~10 KB an image, ~12 MiB on disk per 1,000 rows). Encoding
120k images one by one would dominate the run, and what is measured is memory over a long stream, not image
variety: every row still goes through read, decode, resize and collate. Each size's ``data`` entry gives the files,
rows and images per file and the bytes on disk.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tools.session import cache_dir, cached_files, machine, start_local_ray

ROWS_PER_FILE = 50_000
ROW_GROUP_SIZE = 1000
BATCH_SIZE = 256
SAMPLE_EVERY_S = 0.5
SCALE_CONFIG = {"max_prompt_length": 1024, "filter_overlong_prompts": True, "truncation": "error"}
IMAGE_ROWS_PER_FILE = 5000
IMAGE_POOL = 1500  # distinct encoded images, reused across the rows
IMAGE_GRAIN = 8  # make_image's noise in 8 x 8 squares: same pixels, ~20x fewer PNG bytes than per-pixel noise
MIB = 1024 * 1024
DATA_MANIFEST = "data.json"


def generate(work_dir: Path, rows: int) -> tuple[list[str], float | None, dict]:
    """gsm8k-shaped files (1% overlong, 50k rows per file, 1000-row row groups), generated once, in a child process
    (``write_gsm8k_parquet`` holds every row as a Python dict: its memory must not count for the pipeline).
    Returns the files, the generation time (None when they already existed) and the data's layout and bytes."""
    seconds: list[float] = []

    def write(out: Path) -> list[str]:
        started = time.perf_counter()
        cmd = [sys.executable, "-m", "ingest", "sample", str(out), "--rows", str(rows)]
        cmd += ["--files", str(max(1, rows // ROWS_PER_FILE)), "--long-every", "100"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        seconds.append(time.perf_counter() - started)
        return list(out.glob("*.parquet"))

    files = cached_files(work_dir, f"scale-gsm8k-{rows}", write)
    data = {
        "kind": "gsm8k text",
        "files": len(files),
        "rows_per_file": -(-rows // len(files)),
        "row_group_size": ROW_GROUP_SIZE,
        "bytes_on_disk": sum(os.path.getsize(f) for f in files),
    }
    return files, (seconds[0] if seconds else None), data


def write_images(out: Path, rows: int) -> dict:
    """The image rows of one size into ``out`` with their counts in ``out/data.json`` (``--write-images``)."""
    from tools.samples import write_geo3k_pool_parquet

    data = write_geo3k_pool_parquet(
        out,
        rows,
        pool_size=IMAGE_POOL,
        rows_per_file=IMAGE_ROWS_PER_FILE,
        row_group_size=ROW_GROUP_SIZE,
        grain=IMAGE_GRAIN,
    )
    files = len(data["files"])
    data = {"kind": "geo3k images", **data, "files": files, "images_per_file": round(data["images"] / files, 1)}
    (out / DATA_MANIFEST).write_text(json.dumps(data))
    return data


def generate_images(work_dir: Path, rows: int) -> tuple[list[str], float | None, dict]:
    """geo3k-shaped image rows (``write_images``), generated once, in a child process. Returns the files, the
    generation time (None when they already existed) and the data's counts and bytes on disk."""
    seconds: list[float] = []

    def write(out: Path) -> list[str]:
        started = time.perf_counter()
        cmd = [sys.executable, "-m", "tools.scale", "--write-images", str(out), "--rows", str(rows)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        seconds.append(time.perf_counter() - started)
        return list(out.glob("*.parquet"))

    files = cached_files(work_dir, f"scale-geo3k-{rows}", write)
    data = json.loads((Path(files[0]).parent / DATA_MANIFEST).read_text())
    return files, (seconds[0] if seconds else None), data


def _kind(proc) -> str:
    try:
        name = " ".join(proc.cmdline()[:2]) or proc.name()
    except Exception:
        return "other"
    if "gcs_server" in name:
        return "gcs"
    if "raylet" in name:
        return "raylet"
    if "ray::" in name or "default_worker.py" in name:
        return "workers"
    return "other"


class StoreStats:
    """Object store bytes in use on the local raylet (one cached gRPC stub; Ray 2.60 internals)."""

    def __init__(self):
        import ray
        from ray._private.grpc_utils import init_grpc_channel
        from ray._private.ray_constants import GRPC_CPP_MAX_MESSAGE_SIZE
        from ray.core.generated import node_manager_pb2, node_manager_pb2_grpc

        node = ray._private.worker.global_worker.node
        address = f"{node.node_ip_address}:{node.node_manager_port}"
        options = [("grpc.max_receive_message_length", GRPC_CPP_MAX_MESSAGE_SIZE)]
        self.stub = node_manager_pb2_grpc.NodeManagerServiceStub(init_grpc_channel(address, options=options))
        self.request = node_manager_pb2.FormatGlobalMemoryInfoRequest(include_memory_info=False)

    def __call__(self) -> dict:
        stats = self.stub.FormatGlobalMemoryInfo(self.request, timeout=10).store_stats
        return {
            "used": stats.object_store_bytes_used,
            "avail": stats.object_store_bytes_avail,
            "fallback": stats.object_store_bytes_fallback,
            "spilled": stats.spilled_bytes_total,
        }


class MemorySampler(threading.Thread):
    """Samples the session's memory every ``interval`` s until ``stop()``; ``progress()`` gives rows so far."""

    def __init__(self, progress=lambda: 0, interval: float = SAMPLE_EVERY_S):
        super().__init__(daemon=True)
        import psutil

        self.me = psutil.Process()
        self.progress, self.interval = progress, interval
        self.samples: list[dict] = []
        self.store = StoreStats()
        self._halt = threading.Event()
        self.started = time.perf_counter()

    def sample(self) -> dict:
        import psutil

        totals = {"rss": 0, "uss": 0, "pss": 0}
        kinds: dict[str, int] = {}
        procs = [self.me] + self.me.children(recursive=True)
        for proc in procs:
            try:
                info = proc.memory_full_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            totals["rss"] += info.rss
            totals["uss"] += info.uss
            totals["pss"] += info.pss
            kind = "driver" if proc.pid == self.me.pid else _kind(proc)
            kinds[kind] = kinds.get(kind, 0) + info.pss
        try:
            store = self.store()
        except Exception:  # the raylet is busy or gone: keep the process figures
            store = {"used": None, "avail": None, "fallback": None, "spilled": None}
        return {
            "t": round(time.perf_counter() - self.started, 2),
            "rows": self.progress(),
            "procs": len(procs),
            **totals,
            "store_used": store["used"],
            "store_spilled": store["spilled"],
            "pss_by_kind": kinds,
        }

    def run(self) -> None:
        while not self._halt.is_set():
            self.samples.append(self.sample())
            self._halt.wait(self.interval)

    def stop(self) -> list[dict]:
        self._halt.set()
        self.join()
        self.samples.append(self.sample())
        return self.samples


def summarize(samples: list[dict], baseline: dict) -> dict:
    def peak(key):
        return max(s[key] for s in samples if s[key] is not None)

    kinds = sorted({k for s in samples for k in s["pss_by_kind"]})
    peak_at = max(samples, key=lambda s: s["pss"])
    return {
        "peak_pss_mib": round(peak("pss") / MIB, 1),
        "peak_uss_plus_store_mib": round(max(s["uss"] + (s["store_used"] or 0) for s in samples) / MIB, 1),
        "peak_rss_mib": round(peak("rss") / MIB, 1),
        "peak_store_used_mib": round(peak("store_used") / MIB, 1),
        "store_spilled_mib": round((samples[-1]["store_spilled"] or 0) / MIB, 1),
        "peak_pss_by_kind_mib": {k: round(max(s["pss_by_kind"].get(k, 0) for s in samples) / MIB, 1) for k in kinds},
        "pss_by_kind_at_peak_mib": {k: round(v / MIB, 1) for k, v in peak_at["pss_by_kind"].items()},
        "peak_at_rows": peak_at["rows"],
        "baseline_pss_mib": round(baseline["pss"] / MIB, 1),
        "baseline_pss_by_kind_mib": {k: round(v / MIB, 1) for k, v in baseline["pss_by_kind"].items()},
        "max_procs": max(s["procs"] for s in samples),
        # PSS at each quarter of the run: what grows with the rows streamed
        "pss_mib_by_progress": {
            f"{q}%": round(
                max((s["pss"] for s in samples if s["rows"] <= samples[-1]["rows"] * q / 100), default=0) / MIB, 1
            )
            for q in (25, 50, 75, 100)
        },
    }


def measure(rows: int, work_dir: Path, images: bool = False) -> dict:
    """One size, in this process: generate (child process), start Ray, stream, sample. Call in a fresh process.
    ``images``: geo3k-shaped image rows, the model directory as the processor too."""
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    files, gen_s, data = (generate_images if images else generate)(work_dir, rows)
    data["bytes_on_disk_mib"] = round(data.pop("bytes_on_disk") / MIB, 1)
    import ray
    import torch  # noqa: F401  (a trainer has torch loaded)

    from ingest import VerlCollate, build_dataset
    from ingest.tokenizer.offline import build_offline_model_dir

    model = str(build_offline_model_dir())
    ray_init_s = start_local_ray()["ray_init_s"]
    consumed = [0]
    sampler = MemorySampler(lambda: consumed[0])
    time.sleep(2.0)  # let the idle session settle, then take its baseline
    baseline = sampler.sample()
    sampler.start()
    started = time.perf_counter()
    first = None
    ds = build_dataset(files, model, SCALE_CONFIG, processor=model if images else None)
    for batch in ds.iter_torch_batches(batch_size=BATCH_SIZE, collate_fn=VerlCollate()):
        if first is None:
            first = time.perf_counter() - started
        consumed[0] += len(batch["input_ids"])
    seconds = time.perf_counter() - started
    samples = sampler.stop()
    store_total = ray.cluster_resources().get("object_store_memory")
    ray.shutdown()
    return {
        "rows": rows,
        "rows_out": consumed[0],
        "files": len(files),
        "data": data,
        "generate_s": None if gen_s is None else round(gen_s, 1),
        "ray_init_s": ray_init_s,
        "seconds": round(seconds, 1),
        "time_to_first_batch_s": None if first is None else round(first, 2),
        "rows_per_s": round(consumed[0] / seconds, 1),
        "object_store_capacity_mib": None if store_total is None else round(store_total / MIB),
        "memory": summarize(samples, baseline),
        "samples": samples,
    }


def bench_scale(rows: list[int] | None = None, work_dir: str | None = None, images: bool = False) -> dict:
    """Each size in its own child process (``python -m tools.scale``), then the peak ratio of the last to
    the first. ``images``: geo3k-shaped image rows (default 10k and 100k rows), else gsm8k-shaped text (100k, 1M)."""
    rows = rows or ([10_000, 100_000] if images else [100_000, 1_000_000])
    work = cache_dir(work_dir)
    result: dict = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "data": "geo3k images" if images else "gsm8k text",
        "batch_size": BATCH_SIZE,
        "config": SCALE_CONFIG,
        "sizes": [],
    }
    for n in rows:
        out = work / f"scale-{'images-' if images else ''}{n}.json"
        load = os.getloadavg()[0]
        cmd = [sys.executable, "-m", "tools.scale", "--rows", str(n), "--out", str(out)]
        subprocess.run([*cmd, "--work-dir", str(work), *(["--images"] if images else [])], check=True)
        entry = json.loads(out.read_text())
        entry.pop("samples")  # kept in scale-N.json
        entry["load_1m_before"] = round(load, 2)
        entry["load_1m_after"] = round(os.getloadavg()[0], 2)
        entry["samples_file"] = str(out)
        result["sizes"].append(entry)
        print(json.dumps(entry), flush=True)
    if len(result["sizes"]) > 1:
        first, last = result["sizes"][0]["memory"], result["sizes"][-1]["memory"]
        result["peak_pss_ratio"] = round(last["peak_pss_mib"] / first["peak_pss_mib"], 3)
        result["peak_uss_plus_store_ratio"] = round(
            last["peak_uss_plus_store_mib"] / first["peak_uss_plus_store_mib"], 3
        )
        grow_first = first["peak_pss_mib"] - first["baseline_pss_mib"]
        grow_last = last["peak_pss_mib"] - last["baseline_pss_mib"]
        result["peak_growth_over_baseline_ratio"] = round(grow_last / grow_first, 3) if grow_first > 0 else None
        result["target_met"] = result["peak_pss_ratio"] <= 1.3
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.scale", description="one size of the scale benchmark")
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--out")
    parser.add_argument("--work-dir")
    parser.add_argument("--images", action="store_true", help="geo3k-shaped image rows, not text")
    parser.add_argument("--write-images", metavar="DIR", help="only write the image rows of --rows into DIR")
    args = parser.parse_args(argv)
    if args.write_images:
        write_images(Path(args.write_images), args.rows)
        return 0
    if not (args.out and args.work_dir):
        parser.error("--out and --work-dir are required to measure")
    result = measure(args.rows, Path(args.work_dir), images=args.images)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
