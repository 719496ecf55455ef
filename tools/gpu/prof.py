"""On the GPU machine, in-process: VisionStage on cuda over bench vision's blocks, this commit's code against the
previous upload/resize (per-image transfer, F.interpolate), copy-back (into pageable memory) and upload (from
pageable memory), the Triton resize (and whether its blocks equal the CPU stage's), a breakdown, and torch.profiler's
top ops."""

import glob
import json
import math
import os
import sys
import time
import warnings

import numpy as np
import torch

sys.path.insert(0, os.getcwd())
import ingest.media.pixels as P  # noqa: E402
from ingest.config import DataConfig  # noqa: E402
from ingest.stages.vision import VisionStage  # noqa: E402
from ingest.tokenizer.offline import build_offline_model_dir  # noqa: E402
from tools.vision_bench import decoded_blocks, image_count  # noqa: E402

DEV = os.environ.get("PROF_DEVICE", "cuda")
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
model = str(build_offline_model_dir())
files = sorted(glob.glob(sys.argv[1] + "/*.parquet"))
blocks = decoded_blocks(files, model)
images = sum(image_count(b) for b in blocks)
res = {"images": images, "blocks": len(blocks)}


def rate(stage, reps=3):
    stage(blocks[0])
    sync()
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        for b in blocks:
            stage(b)
        sync()
        best = min(best, time.perf_counter() - t)
    return round(images / best, 1)


def old_device_images(images, device):
    out = []
    for image in images:
        if isinstance(image, np.ndarray):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                out.append(torch.from_numpy(np.ascontiguousarray(image)).to(device).permute(2, 0, 1))
        else:
            out.append(image.to(device))
    return out


def old_resize(images, height, width, native_uint8=None):
    from torch.nn.functional import interpolate

    if tuple(images.shape[-2:]) == (height, width):
        return images
    if native_uint8 if native_uint8 is not None else images.device.type == "cpu":
        return interpolate(images, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    resized = images.float()
    for size in ([resized.shape[-2], width], [height, width]):
        if list(resized.shape[-2:]) != size:
            resized = interpolate(resized, size=size, mode="bicubic", align_corners=False, antialias=True)
            resized = resized.clamp_(min=0, max=255).round_()
    return resized.to(torch.uint8)


new_up, new_rs = P.device_images, P.resize_bicubic
# the float path; the Triton one below
stage = VisionStage(model, DataConfig(vision_device=DEV, vision_device_resize="torch"))
res["new"] = rate(stage)
P.device_images = old_device_images
res["old_upload_new_resize"] = rate(stage)
P.resize_bicubic = old_resize
res["old"] = rate(stage)
P.device_images, P.resize_bicubic = new_up, new_rs


def contiguous_resize(images, height, width, native_uint8=None):
    return new_rs(images.contiguous(), height, width, native_uint8)


P.resize_bicubic = contiguous_resize
res["new_contiguous_input"] = rate(stage)
P.resize_bicubic = new_rs
# copy-back: pinned DEVICE_PATCHES (this code) against pageable buffers (the previous code)
import ingest.memory as M  # noqa: E402

res["copy_back_pinned"] = bool(torch.from_numpy(P.DEVICE_PATCHES.take(16)).is_pinned())
pinned_pool = P.DEVICE_PATCHES
P.DEVICE_PATCHES = M.ReusedBuffers()
res["pageable_copy_back"] = rate(stage)
P.DEVICE_PATCHES = pinned_pool
res["new_again"] = rate(stage)
# the Triton resize (vision_device_resize: triton): a block in two kernels, the CPU kernel's bytes
triton_stage = (
    VisionStage(model, DataConfig(vision_device=DEV, vision_device_resize="triton")) if DEV == "cuda" else None
)
if triton_stage is not None:
    res["triton"] = rate(triton_stage)
    res["triton_equal_bytes"] = all(
        triton_stage(b).equals(VisionStage(model, DataConfig(vision_device="cpu"))(b)) for b in blocks[:2]
    )
# the upload: through the pinned staging buffer (this code) against straight from the block (pageable, before)
staged_upload = P.upload
P.upload = lambda buffer, device: torch.from_numpy(buffer).to(device)
res["pageable_upload"] = rate(stage)
P.upload = staged_upload
# breakdown of the new code: patches() alone (synced), and its download
orig = P.ImagePixels.patches
acc = {"patches": 0.0, "download": 0.0}


def timed(self, *a, **k):
    t = time.perf_counter()
    r = orig(self, *a, **k)
    sync()
    acc["patches"] += time.perf_counter() - t
    t = time.perf_counter()
    r[0].cpu()
    acc["download"] += time.perf_counter() - t
    return r


P.ImagePixels.patches = timed
t = time.perf_counter()
for b in blocks:
    stage(b)
sync()
res["breakdown_s"] = {"stage_total": round(time.perf_counter() - t, 3), **{k: round(v, 3) for k, v in acc.items()}}
P.ImagePixels.patches = orig
torch.set_num_threads(1)
res["cpu_1_thread"] = rate(VisionStage(model, DataConfig(vision_device="cpu")), reps=1)
print(json.dumps(res), flush=True)
if DEV == "cuda":
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for b in blocks[:3]:
            stage(b)
        sync()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=40))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for b in blocks[:3]:
            triton_stage(b)
        sync()
    print("triton resize:")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=40))
