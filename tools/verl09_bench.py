"""``python -m ingest bench verl09``: verl 0.9.1 (``RLHFDataset`` + ``StatefulDataLoader``) against this pipeline's
``row_format: verl-0.9`` rows on the same data, both cold, in one run: ours as verl's trainer gets it
(``VerlDataLoader``) and as ``build_dataset`` + ``iter_torch_batches``. ``--row-format verl-0.7``: verl 0.7.1
against ``verl-0.7`` rows, the same way.

Each side runs in a new process: verl in its oracle environment (transformers 5.9), ours with nothing started before
the clock (``build_dataset`` starts the local Ray: a brand-new session, as a first run meets it). Clocks start where
the dataset is built (verl: ``RLHFDataset(...)``, tokenizer and processor loads included on both sides) and stop at
the last batch. Peak memory is the largest sum of PSS over the process and all its descendants (DataLoader workers;
Ray's GCS, raylet, workers, whose PSS holds the object store pages they map), sampled every 0.2 s from
``/proc/<pid>/smaps_rollup``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tools.bench import BATCH_SIZE, BENCH_CONFIG, geo3k_files, gsm8k_files
from tools.session import cache_dir, machine

ROW_FORMAT = "verl-0.9"  # the default; any format of RAW_PROMPT_FORMATS, each against its oracle
SAMPLE_EVERY_S = 0.2
# PSS is read every tenth sample: a smaps_rollup read walks the page tables of a process's whole mapping (a Ray worker
# maps the object store), and at every sample it took most of a core from the 2-core VM being measured
PSS_EVERY = 10
MIB = 1 << 20


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class TreePss(threading.Thread):
    """The largest PSS sum over ``pid`` and its descendants until ``stop()``; and each descendant's CPU seconds as
    last seen, by its Ray title (``cpu_by_title``), read from outside so that the measured process pays nothing."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self._halt = pid, 0, threading.Event()
        self._cpu: dict[int, tuple[str, float]] = {}  # pid -> (title, CPU seconds)

    def run(self) -> None:
        import psutil

        sample = 0
        while not self._halt.is_set():
            try:
                children = psutil.Process(self.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                return
            if sample % PSS_EVERY == 0:
                self.peak = max(self.peak, _pss(self.pid) + sum(_pss(p.pid) for p in children))
            sample += 1
            for process in children:
                try:
                    title, times = _title(process.cmdline()), process.cpu_times()
                except psutil.Error:
                    continue
                seen = self._cpu.get(process.pid)
                # a worker back in the pool, or one exiting (no command line left): named by what it ran
                if title in ("IDLE", "?") and seen is not None:
                    title = seen[0]
                self._cpu[process.pid] = (title, times.user + times.system)
            self._halt.wait(SAMPLE_EVERY_S)

    def stop(self) -> float:
        self._halt.set()
        self.join()
        return round(self.peak / MIB, 1)

    def cpu_by_title(self) -> dict[str, float]:
        """CPU seconds of the descendants by title: a Ray process's class (``ray::MediaStore.make_unit`` ->
        ``MediaStore``; ``IDLE``: a worker that never ran anything), else the Python script's or program's name
        (``monitor.py``, ``raylet``)."""
        totals: dict[str, float] = {}
        for title, seconds in self._cpu.values():
            totals[title] = totals.get(title, 0.0) + seconds
        return {title: round(seconds, 2) for title, seconds in sorted(totals.items())}


def _title(cmdline: list[str]) -> str:
    if cmdline and cmdline[0].startswith("ray::"):
        name = " ".join(cmdline)[len("ray::") :].split()[0]  # Class.method, or Ray Data's MapWorker(ops).method
        return name[: name.rindex(")") + 1] if "(" in name else name.split(".")[0]
    scripts = [os.path.basename(arg) for arg in cmdline[1:] if arg.endswith(".py")]
    if scripts:  # Ray's monitors, a worker not yet titled
        return scripts[0]
    return os.path.basename(cmdline[0]) if cmdline else "?"


def _measured(command: list[str], env: dict, cwd: str) -> dict:
    """Run ``command`` with its tree's peak PSS and its descendants' CPU by title sampled; what it printed last, where
    that is a JSON object."""
    with subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        sampler = TreePss(proc.pid)
        sampler.start()
        stdout, stderr = proc.communicate()
        peak = sampler.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"{command[:4]} failed ({proc.returncode}):\n{stderr[-4000:]}")
    last = (stdout.strip().splitlines() or [""])[-1]
    measured = json.loads(last) if last.startswith("{") else {}
    return {**measured, "peak_pss_mib": peak, "descendants_cpu_s": sampler.cpu_by_title()}


def run_ours_cold(
    files: list[str], model: str, config: dict, processor: str | None, loader: str, row_format: str = ROW_FORMAT
) -> dict:
    """In this (new) process, the clock from the first call to the last batch. ``loader``: ``VerlDataLoader`` (what
    verl's trainer iterates: its first batch is made in the driver) or ``iter_torch_batches`` (``build_dataset`` +
    Ray Data's iterator: every batch from the actors)."""
    from tools.cold import run_loader

    return run_loader(files, model, {**config, "row_format": row_format}, processor, loader)


def _ours(
    files: list[str], model: str, config: dict, processor: str | None, work: Path, loader: str, row_format: str
) -> dict:
    spec = {"files": files, "model": model, "config": config, "processor": processor, "loader": loader}
    spec["row_format"] = row_format
    env = {**os.environ, "RAY_ADDRESS": "local"}  # a new session, never a cluster left running on the machine
    return _measured([sys.executable, "-m", __name__, json.dumps(spec)], env, str(work))


def _verl(files: list[str], model: str, config: dict, processor: str | None, work: Path, row_format: str) -> dict:
    from tools.oracle import RUNNER, oracle_available, oracle_environment

    if not oracle_available(row_format):
        raise RuntimeError(f"the {row_format} oracle is not installed (run `make oracle`)")
    out = work / "verl09-out.pkl"
    spec = {
        "files": files,
        "tokenizer": model,
        "processor": processor,
        "config": {**config, "cache_dir": str(work / "verl-cache")},
        "out": str(out),
        "batch_size": BATCH_SIZE,
        "num_workers": 2,
        "stateful": True,
    }
    # a new HF datasets cache per run (cold: verl's filter runs again); its release first on PYTHONPATH
    env = oracle_environment(row_format, work / f"verl-{time.time_ns()}")
    measured = _measured([sys.executable, str(RUNNER), "bench", json.dumps(spec)], env, str(work))
    import pickle

    with open(out, "rb") as f:
        return {**pickle.load(f), **measured}


def bench_verl09(
    text_rows: int = 200_000, image_rows: int = 5_000, work_dir: str | None = None, row_format: str = ROW_FORMAT
) -> dict:
    """Text (gsm8k-shaped, 1% overlong) and image (geo3k-shaped) rows, filter on, batch 64: verl 0.9.1 (or the
    oracle of ``row_format``), then ours in that format."""
    from ingest.tokenizer.offline import build_offline_model_dir

    model = str(build_offline_model_dir())
    work = cache_dir(work_dir)
    result = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "sizes": []}
    result["row_format"] = row_format
    cases = []
    if text_rows:
        cases.append(("text", text_rows, gsm8k_files(work, text_rows), None, BENCH_CONFIG))
    if image_rows:
        cases.append(
            ("images", image_rows, geo3k_files(work, image_rows), model, {**BENCH_CONFIG, "truncation": "left"})
        )
    for kind, rows, files, processor, config in cases:
        verl = _verl(files, model, config, processor, work, row_format)
        entry = {"kind": kind, "rows": rows, "verl": verl}
        loaders = (
            ("ours", "VerlDataLoader"),
            ("ours_new_dataset", "VerlDataLoader+len"),  # len() first, as verl's trainer: the epoch count on the clock
            ("ours_iter_torch_batches", "iter_torch_batches"),
        )
        for name, loader in loaders:
            ours = _ours(files, model, config, processor, work, loader, row_format)
            assert verl["rows"] == ours["rows"], f"row counts differ: verl {verl['rows']}, {name} {ours['rows']}"
            suffix = name.removeprefix("ours")
            entry[name] = ours
            entry[f"first_batch_sooner_x{suffix}"] = round(
                verl["time_to_first_batch_s"] / ours["time_to_first_batch_s"], 1
            )
            entry[f"ratio_rows_per_s{suffix}"] = round(ours["rows_per_s"] / verl["rows_per_s"], 2)
            entry[f"peak_pss_ratio{suffix}"] = round(ours["peak_pss_mib"] / verl["peak_pss_mib"], 2)
        result["sizes"].append(entry)
        print(json.dumps(entry), flush=True)
    return result


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    measured = run_ours_cold(
        spec["files"], spec["model"], spec["config"], spec["processor"], spec["loader"], spec["row_format"]
    )
    print(json.dumps(measured))
