"""``python -m ingest bench vision``: images/s of the vision pool alone, a 2-core CPU pool against a GPU actor.

The issue's GPU target compares the vision pool on a GPU with the 2-core CPU pool. Both get the same blocks: geo3k
rows (``bench mm``'s data) tokenized and decoded in this process beforehand, put in the object store. Each pool is a
set of Ray actors hosting ``VisionStage`` (the vision pool's code), warmed up with one block each; then every block
goes through the pool round-robin (at most two calls in flight per actor) and the output blocks are written to the
object store, as Ray Data's pool writes them; ``passes`` > 1 sends the blocks that many times (a GPU pool gets through
1,000 rows in a fraction of a second, too short to time alone). Clock: from the first submit to the last output;
start-up is not on it.

- ``cpu``: 2 actors x 1 CPU on ``device="cpu"`` (torch on one thread each: the 2-core CPU pool),
- ``cuda``: 1 actor x 1 GPU on ``device="cuda"`` (skipped without a CUDA device); ``cuda+jpeg``: the same with
  ``vision_decode_jpeg_on_device`` (its blocks keep the JPEGs encoded, so the actor decodes them with nvJPEG);
  ``cuda x2`` / ``cuda x4``: 2 actors x 0.5 GPU (the CPU pool's 2 host cores) / 4 actors x 0.25 GPU sharing the
  device (fractional GPUs: one actor's host-side work, launching kernels and Arrow in and out, overlaps the others');
  ``--device-resize auto torch``: those GPU pools again with torch's float resize (``vision_device_resize``;
  ``auto``, the default, is the Triton resize where triton runs).
"""

from __future__ import annotations

import time

import pyarrow as pa

from ingest.config import DataConfig, StageContext

CPU_POOL = {"actors": 2, "num_cpus": 1, "num_gpus": 0, "device": "cpu"}
GPU_POOL = {"actors": 1, "num_cpus": 1, "num_gpus": 1, "device": "cuda"}
SHARED_GPU_ACTORS = (2, 4)  # the default ``cuda xK`` pools


def shared_gpu_pool(actors: int) -> dict:
    """``actors`` vision actors on one GPU, each with 1 CPU and ``1 / actors`` of the GPU (in Ray's 1e-4 units)."""
    return {"actors": actors, "num_cpus": 1, "num_gpus": (10_000 // actors) / 10_000, "device": "cuda"}


def decoded_blocks(files: list[str], model: str, defer_jpeg: bool = False) -> list[pa.Table]:
    """The decode stage's output blocks for ``files`` (read units of ``bench mm``'s layout), in this process."""
    from actors.tokenize import TokenizeActor
    from ingest.config import DataConfig
    from ingest.datasets.plan import plan_input
    from ingest.read.files import unify_schemas
    from ingest.read.units import read_unit
    from ingest.stages.decode import DecodeStage
    from tools.bench import BENCH_CONFIG

    cfg = DataConfig.from_any({**BENCH_CONFIG, "truncation": "left"})
    plan = plan_input(files, cfg, multimodal=True)
    schema = unify_schemas(plan.infos)
    tokenize = TokenizeActor(cfg, StageContext(files), model, model)
    decode = DecodeStage(DataConfig(vision_decode_jpeg_on_device=defer_jpeg))
    blocks = []
    for unit in plan.units:
        for table in tokenize(read_unit(unit, plan.files[unit.file_index], schema, {}, None)):
            blocks.append(decode(table).table)
    return blocks


def image_count(block: pa.Table) -> int:
    import pyarrow.compute as pc

    return int(pc.sum(pc.list_value_length(block.column("multi_modal_data")).fill_null(0)).as_py() or 0)


def _vision_actor(num_cpus: float, num_gpus: float):
    import ray

    @ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)
    class VisionBenchActor:
        def __init__(self, processor: str, device: str, device_resize: str = "auto"):
            from ingest.stages.vision import VisionStage

            self.stage = VisionStage(processor, DataConfig(vision_device=device, vision_device_resize=device_resize))

        def run(self, block: pa.Table) -> pa.Table:
            return self.stage(block)

    return VisionBenchActor


def time_pool(
    blocks: list,
    model: str,
    actors: int,
    num_cpus: float,
    num_gpus: float,
    device: str,
    passes: int = 1,
    actor_class=None,
    actor_args: tuple = (),
) -> dict:
    """Seconds of ``actors`` vision actors over ``blocks`` (object refs) ``passes`` times, after one warm-up block
    per actor. ``actor_class``: another Ray actor class with the same ``run``
    (``tools/gpu/ab_upload.py``), built
    with (model, device, *actor_args)."""
    import ray

    if actor_class is not None:
        cls = actor_class.options(num_cpus=num_cpus, num_gpus=num_gpus)
    else:
        cls = _vision_actor(num_cpus, num_gpus)
    pool = [cls.remote(model, device, *actor_args) for _ in range(actors)]
    ray.get([actor.run.remote(blocks[k % len(blocks)]) for k, actor in enumerate(pool)])  # warm-up
    started = time.perf_counter()
    pending: list = []
    for k, block in enumerate(blocks * passes):
        if len(pending) >= 2 * actors:
            done, pending = ray.wait(pending, num_returns=1)
        pending.append(pool[k % actors].run.remote(block))
    ray.wait(pending, num_returns=len(pending))
    seconds = time.perf_counter() - started
    for actor in pool:
        ray.kill(actor)
    return {"seconds": round(seconds, 3), "actors": actors, "num_gpus": num_gpus, "device": device, "passes": passes}


def bench_vision(
    rows: int = 1000,
    work_dir: str | None = None,
    gpu: bool | None = None,
    passes: int = 1,
    gpu_actors: tuple[int, ...] = SHARED_GPU_ACTORS,
    device_resizes: tuple[str, ...] = ("auto",),
) -> dict:
    """The CPU pool, then (with a CUDA device, or ``gpu=True``) the GPU actor with and without device JPEG decode,
    and ``gpu_actors`` actors sharing the GPU; every pool goes over the blocks ``passes`` times. ``device_resizes``:
    the GPU pools' image resize (``vision_device_resize``); for each one after the first, the GPU actor and the
    shared pools again, named with it ("cuda triton x8")."""
    import ray
    import torch

    from ingest.tokenizer.offline import build_offline_model_dir
    from tools.bench import geo3k_files
    from tools.session import cache_dir, start_local_ray

    model = str(build_offline_model_dir())
    files = geo3k_files(cache_dir(work_dir), rows)
    gpu = torch.cuda.is_available() if gpu is None else gpu
    runs = [("cpu", CPU_POOL, False, "auto")]  # on the CPU: the uint8 kernel, whatever the setting
    if gpu:
        first, *others = device_resizes
        runs += [("cuda", GPU_POOL, False, first), ("cuda+jpeg", GPU_POOL, True, first)]
        runs += [(f"cuda x{k}", shared_gpu_pool(k), False, first) for k in gpu_actors]
        for kernel in others:
            runs += [(f"cuda {kernel}", GPU_POOL, False, kernel)]
            runs += [(f"cuda {kernel} x{k}", shared_gpu_pool(k), False, kernel) for k in gpu_actors]
    result = {
        **start_local_ray(),
        "gpu": torch.cuda.get_device_name(0) if gpu else None,
        "rows": rows,
        "pools": {},
    }
    inputs: dict[bool, tuple[list, int]] = {}  # defer_jpeg -> (block refs, images): cpu and cuda share theirs
    try:
        for name, pool, defer, kernel in runs:
            if defer not in inputs:
                blocks = decoded_blocks(files, model, defer_jpeg=defer)
                inputs[defer] = [ray.put(b) for b in blocks], sum(image_count(b) for b in blocks)
                del blocks
            refs, images = inputs[defer]
            timing = time_pool(refs, model, **pool, passes=passes, actor_args=(kernel,))
            processed = images * passes
            per_s = round(processed / timing["seconds"], 1)
            result["pools"][name] = {**timing, "images": processed, "images_per_s": per_s}
            print(name, result["pools"][name], flush=True)
    finally:
        ray.shutdown()
    cpu = result["pools"]["cpu"]["images_per_s"]
    for name in result["pools"]:
        if name != "cpu":
            result[f"ratio_{name}_vs_cpu"] = round(result["pools"][name]["images_per_s"] / cpu, 2)
    if not gpu:
        result["note"] = "no CUDA device here: the CPU pool only (run on a GPU machine for the GPU figures)"
    return result
