"""On the GPU machine: the shared GPU pool with the staged pinned upload (``ingest.media.pixels.upload``, the code)
against the pageable upload it replaced, alternating, several rounds, one Ray session: the A/B that one run each left
open (docs/benchmarks.md, 2026-11-26). Prints images/s per round and the medians. ``AB_ACTORS`` (default 16),
``AB_ROUNDS`` (3), ``AB_PASSES`` (20), ``AB_DEVICE`` (cuda; cpu for a dry run). Argument: bench vision's data dir."""

import glob
import json
import os
import statistics
import sys

import ray

sys.path.insert(0, os.getcwd())
from ingest.config import DataConfig
from ingest.tokenizer.offline import build_offline_model_dir  # noqa: E402
from tools.vision_bench import CPU_POOL, decoded_blocks, image_count, shared_gpu_pool, time_pool  # noqa: E402


@ray.remote
class Vision:
    def __init__(self, model: str, device: str, pageable: bool):
        import torch

        import ingest.media.pixels as P
        from ingest.stages.vision import VisionStage

        if pageable:  # the upload before fbc5e97: straight from the block's (pageable) memory
            P.upload = lambda buffer, dev: torch.from_numpy(buffer).to(dev)
        self.stage = VisionStage(
            model, DataConfig(vision_device=device, vision_device_resize="torch")
        )  # the A/B was of the float path

    def run(self, block):
        return self.stage(block)


def rate(refs, images, model, device, actors, pageable, passes):
    pool = shared_gpu_pool(actors) if device == "cuda" else {**CPU_POOL, "actors": actors}
    timing = time_pool(refs, model, **pool, passes=passes, actor_class=Vision, actor_args=(pageable,))
    return round(images * passes / timing["seconds"], 1)


device = os.environ.get("AB_DEVICE", "cuda")
actors, rounds = int(os.environ.get("AB_ACTORS", 16)), int(os.environ.get("AB_ROUNDS", 3))
passes = int(os.environ.get("AB_PASSES", 20))
model = str(build_offline_model_dir())
blocks = decoded_blocks(sorted(glob.glob(sys.argv[1] + "/*.parquet")), model)
ray.init(address="local", include_dashboard=False, logging_level="WARNING", log_to_driver=False)
refs, images = [ray.put(b) for b in blocks], sum(image_count(b) for b in blocks)
result = {"device": device, "actors": actors, "passes": passes, "staged": [], "pageable": []}
for r in range(rounds):
    for name in ("staged", "pageable") if r % 2 == 0 else ("pageable", "staged"):
        result[name].append(rate(refs, images, model, device, actors, name == "pageable", passes))
        print(r, name, result[name][-1], flush=True)
result["median"] = {k: statistics.median(result[k]) for k in ("staged", "pageable")}
print(json.dumps(result), flush=True)
ray.shutdown()
