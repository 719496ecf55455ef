"""What every benchmark shares: one local-Ray start, the machine it ran on, and one sample-data cache.

The local Ray is always a new one (``address="local"``): a cluster someone left running with ``ray start`` on the
machine is never joined, so each benchmark starts from the same state.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

CACHE_ENV = "INGEST_BENCH_DIR"


def machine() -> str:
    """One line naming the machine: host, cores, memory, processor."""
    import psutil

    memory = round(psutil.virtual_memory().total / 2**30)
    return f"{platform.node()} {os.cpu_count()} cores, {memory} GiB, {platform.processor() or platform.machine()}"


def start_local_ray(num_cpus: int | None = None, preload_modules: tuple[str, ...] = ()) -> dict:
    """A new local Ray (``num_cpus``: every core by default) without dashboard, progress bars or worker logs on the
    driver; ``preload_modules``: every worker imports these when it starts (a raylet setting). Returns the machine,
    the date and the ``ray.init`` time, the header of every benchmark's result."""
    import ray

    started = time.perf_counter()
    system_config = {"preload_python_modules": list(preload_modules)} if preload_modules else None
    ray.init(
        address="local",
        num_cpus=num_cpus or os.cpu_count(),
        include_dashboard=False,
        logging_level="WARNING",
        log_to_driver=False,
        _system_config=system_config,
    )
    ray.data.DataContext.get_current().enable_progress_bars = False
    return {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "ray_init_s": round(time.perf_counter() - started, 2),
    }


def cache_dir(work_dir: str | os.PathLike | None = None) -> Path:
    """The sample-data cache: ``work_dir``, else ``$INGEST_BENCH_DIR``, else ``ingest-bench`` in the temp directory."""
    path = Path(work_dir or os.environ.get(CACHE_ENV) or Path(tempfile.gettempdir()) / "ingest-bench")
    path.mkdir(parents=True, exist_ok=True)
    return path


def cached_files(work_dir: Path, name: str, write: Callable[[Path], list[str]]) -> list[str]:
    """The Parquet files of data set ``name`` in the cache, written by ``write(directory)`` the first time. A data
    set counts as written once its ``done`` marker is there (a run stopped half-way writes it again)."""
    out = work_dir / name
    if (out / "done").exists():
        return sorted(str(p) for p in out.glob("*.parquet"))
    files = write(out)
    (out / "done").write_text("")
    return sorted(str(p) for p in files)
