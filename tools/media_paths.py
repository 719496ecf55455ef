"""``python -m tools.media_paths``: each hand-made media path against the code without it, end to end on its own
workload, both sides interleaved in fresh processes (docs/design.md, "Hand-made media paths").

Paths and workloads (geo3k-shaped rows from ``tools.samples``, the ``bench mm`` data):

- ``reencode``: the PNG image data inflated once and handed to PIL as stored blocks (``stored_png``) against PIL
  inflating the file itself; PIL decodes either way. Workload: the decode stage over the rows' images.
- ``spng``: libspng for 8-bit RGB / RGBA PNGs against PIL on the same stored data. Workload: the decode stage.
- ``deflate``: libdeflate inflating (and checking CRCs) against zlib doing the same, libspng and PIL as they are.
  Workload: the decode stage.
- ``stack``: all three against PIL on the file (what the decode stage would be without any of them).
- ``count``: ``png_decodes`` (a sound PNG's verdict without unfiltering it) against decoding it. Workload: an epoch's
  count, read + prompt stage + the decode stage's count in one thread (``DriverUnits(count_only=True)``).
- ``resize``: ``_resize.c`` against torch's uint8 kernel. Workload: a CPU vision actor's life, the stage's start
  (where the torch side imports torch) and its blocks, torch on one thread (a 1-CPU actor's).
- ``resize-loaded``: the same in a process that has imported torch already, with torch's own thread count (the
  driver, whose collate imports torch, when it keeps the epoch): the vision stage's blocks only.
- ``normalize``: ``_resize.c``'s normalize against the numpy fallback. Workload: the consumer's collate of the vision
  stage's blocks.

Every run is a new process (``--one``) that measures its own CPU time (``time.process_time``: robust to a machine
shared with other work) and wall time for the workload alone, a few passes over the rows, with the set-up outside the
clock. The sides of a comparison run in turn, their order rotating round by round; the summary gives each side's
median and range and the time the path saves, per round, for the whole run, its first pass and each later pass.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types

# path -> (workload, variant with the path, variant without it)
COMPARISONS = {
    "reencode": ("decode", "stored-pil", "file-pil"),
    "spng": ("decode", "all", "stored-pil"),
    "deflate": ("decode", "all", "zlib"),
    "stack": ("decode", "all", "file-pil"),
    "count": ("count", "all", "no-png-decodes"),
    "resize": ("vision", "c", "torch"),
    "resize-loaded": ("vision-loaded", "c", "torch"),
    "normalize": ("collate", "c", "numpy"),
}


def zlib_as_deflate() -> types.ModuleType:
    """A stand-in for the ``deflate`` package with zlib underneath: the same calls and the same verdicts (an exact
    output size, the Adler-32 checked, trailing input ignored, as ``libdeflate_zlib_decompress`` does)."""
    import zlib

    class DeflateError(Exception):
        pass

    def zlib_decompress(data, size: int) -> bytes:
        inflater = zlib.decompressobj()
        try:
            raw = inflater.decompress(data, size)
        except zlib.error as error:
            raise DeflateError(str(error)) from error
        if not inflater.eof or len(raw) != size:
            raise DeflateError("the stream does not end at the given size")
        return raw

    module = types.ModuleType("deflate")
    module.DeflateError, module.zlib_decompress = DeflateError, zlib_decompress
    module.crc32, module.adler32 = zlib.crc32, zlib.adler32
    return module


def apply_variant(variant: str) -> None:
    """Switch the product's paths as ``variant`` says, in this process."""
    from ingest.media import image, pixels

    if variant in ("stored-pil", "file-pil"):  # no libspng: PIL decodes what libspng would
        image._spng_rgb = lambda data: None
    if variant == "file-pil":  # no inflate of ours: PIL gets the file itself
        image._inflated_png = lambda data: None
    if variant == "zlib":
        sys.modules["deflate"] = zlib_as_deflate()
    if variant == "no-png-decodes":
        image._sound_png_decodes = lambda *args: False
    if variant in ("torch", "numpy"):
        pixels._resize = None


def _prompt_blocks(files: list[str], model: str, config, context) -> list:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ingest.blocks import FILE_COLUMN, ROW_COLUMN
    from ingest.stages.prompt import prompt_stage
    from tools.bench import BATCH_SIZE

    table = pa.concat_tables([pq.read_table(f) for f in files])
    table = table.append_column(FILE_COLUMN, pa.array([0] * table.num_rows, pa.int32()))
    table = table.append_column(ROW_COLUMN, pa.array(range(table.num_rows), pa.int64()))
    stage = prompt_stage(config, context, model, model)
    return [stage(table.slice(s, BATCH_SIZE)).table for s in range(0, table.num_rows, BATCH_SIZE)]


def run_one(workload: str, variant: str, files: list[str], model: str, passes: int) -> dict:
    """One measured process: ``passes`` passes of ``workload`` with ``variant``'s paths, each pass's CPU and wall
    seconds. The vision stage is made inside the first pass (its start is where the torch side imports torch)."""
    from ingest.config import DataConfig, StageContext
    from ingest.stages.decode import DecodeStage
    from tools.bench import BENCH_CONFIG

    one_pool = {"truncation": "left", "decode_pool_max_size": 0, "vision_pool_max_size": 0, "vision_device": "cpu"}
    config = DataConfig.from_any({**BENCH_CONFIG, **one_pool})
    context = StageContext(files=tuple(files))
    apply_variant(variant)
    if workload == "count":
        from ingest.datasets.local import DriverUnits
        from ingest.datasets.plan import plan_input

        plan = plan_input(files, config)
        units = DriverUnits(plan, config, plan.context(None, False, config.image_key), model, model, count_only=True)

        def one_pass() -> int:
            return sum(block.num_rows for unit in plan.units for block in units(unit))
    else:
        blocks = _prompt_blocks(files, model, config, context)
        decode = DecodeStage(config, context)
        if workload == "decode":

            def one_pass() -> int:
                return sum(decode(block).table.num_rows for block in blocks)
        else:
            blocks = [decode(block).table for block in blocks]
            from ingest.stages.vision import VisionStage

            if workload == "vision-loaded":
                import torch  # noqa: F401 - imported before, as the driver's collate has

                vision = VisionStage(model, config, context)

                def one_pass() -> int:
                    return sum(vision.process(block).table.num_rows for block in blocks)
            elif workload == "vision":
                assert "torch" not in sys.modules, "the set-up imported torch: the C side would pay for it"
                stages: list = []

                def one_pass() -> int:
                    if not stages:
                        stages.append(VisionStage(model, config, context))
                    return sum(stages[0].process(block).table.num_rows for block in blocks)
            else:
                from ingest.rowformat.collate import VerlCollate

                vision = VisionStage(model, config, context)
                blocks = [vision.process(block).table for block in blocks]
                collate = VerlCollate()
                import torch  # noqa: F401 - the collate's import either way, outside the clock

                def one_pass() -> int:
                    return sum(len(collate(block)["input_ids"]) for block in blocks)

    cpu, wall = [], []
    for _ in range(passes):
        started = time.process_time(), time.perf_counter()
        rows = one_pass()
        cpu.append(time.process_time() - started[0])
        wall.append(time.perf_counter() - started[1])
    return {"workload": workload, "variant": variant, "rows": rows, "cpu_s": cpu, "wall_s": wall}


def _spawn(workload: str, variant: str, files: list[str], model: str, passes: int) -> dict:
    # one core's worth of threads, as a 1-CPU actor gets from Ray (the driver: torch's own choice); tokenizers' pool
    # off, as in the actors
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if workload == "vision-loaded":
        env.pop("OMP_NUM_THREADS")
    command = [sys.executable, "-m", "tools.media_paths", "--one", workload, variant, "--model", model]
    command += ["--passes", str(passes), "--files", *files]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _spread(values: list[float], digits: int = 3) -> list[float]:
    """[median, min, max]."""
    return [round(statistics.median(values), digits), round(min(values), digits), round(max(values), digits)]


def measure(paths: list[str], rows: int, rounds: int, passes: int = 3, work_dir: str | None = None) -> dict:
    """Every path in ``paths``: ``rounds`` runs of each side, interleaved (each round runs every variant its
    workloads need, in an order rotated round by round), and the CPU and wall time each path saves: over a run's
    ``passes`` passes, in its first pass (a process's start: the vision stage's torch import) and per later pass."""
    from ingest.tokenizer.offline import build_offline_model_dir
    from tools.bench import geo3k_files
    from tools.session import cache_dir, machine

    files = [str(f) for f in geo3k_files(cache_dir(work_dir), rows)]
    model = str(build_offline_model_dir())
    needed: dict[str, list[str]] = {}
    for path in paths:
        workload, with_path, without = COMPARISONS[path]
        variants = needed.setdefault(workload, [])
        variants += [v for v in (with_path, without) if v not in variants]
    runs: dict[tuple[str, str], list[dict]] = {}
    for k in range(rounds):
        for workload, variants in needed.items():
            shift = k % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                result = _spawn(workload, variant, files, model, passes)
                runs.setdefault((workload, variant), []).append(result)
                print(json.dumps(result), file=sys.stderr)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    summary = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit,
        "rows": rows,
        "rounds": rounds,
        "passes": passes,
        "note": "seconds and saved fractions as [median, min, max] over rounds; saved: 1 - with / without, per round; "
        "all: a run's passes, first: its first pass, later: per pass after the first",
        "paths": {},
    }
    for path in paths:
        workload, with_path, without = COMPARISONS[path]
        a, b = runs[(workload, with_path)], runs[(workload, without)]
        entry = {"workload": workload, "with": with_path, "without": without}
        parts = {"all": lambda t: sum(t), "first": lambda t: t[0], "later": lambda t: sum(t[1:]) / max(1, len(t) - 1)}
        for key in ("cpu_s", "wall_s"):
            for part, of in parts.items():
                if part == "later" and passes < 2:
                    continue
                with_times, without_times = [of(r[key]) for r in a], [of(r[key]) for r in b]
                saved = [1 - x / y for x, y in zip(with_times, without_times, strict=True)]  # per round
                entry[f"{key} {part}"] = {
                    "with": _spread(with_times),
                    "without": _spread(without_times),
                    "saved": _spread(saved),
                }
        summary["paths"][path] = entry
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.media_paths", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", metavar="PATH", help=f"of {', '.join(COMPARISONS)} (default: all)")
    parser.add_argument("--rows", type=int, default=500, help="geo3k-shaped rows (about 1.2 images each)")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each side")
    parser.add_argument("--passes", type=int, default=3, help="passes over the rows in each run")
    parser.add_argument("--work-dir", default=None, help="the sample-data cache (tools.session.cache_dir)")
    parser.add_argument("--one", nargs=2, metavar=("WORKLOAD", "VARIANT"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--files", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = set(args.paths) - set(COMPARISONS)
    if unknown:
        parser.error(f"unknown paths {sorted(unknown)}; known: {', '.join(COMPARISONS)}")
    if args.one:
        print(json.dumps(run_one(*args.one, args.files, args.model, args.passes)))
        return 0
    summary = measure(args.paths or list(COMPARISONS), args.rows, args.rounds, args.passes, args.work_dir)
    paths = summary.pop("paths")
    print(json.dumps(summary))
    for path, entry in paths.items():
        print(json.dumps({"path": path, **entry}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
