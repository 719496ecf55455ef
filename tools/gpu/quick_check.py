"""On the GPU machine: the vision stage on cuda against the CPU one over two of bench vision's blocks (uint8 patches
within the device resize's 2 levels of the CPU kernel's: on bench vision's images they differ in ~0.6% of values,
by 1-2 levels, where gpu_check's parity images came out equal), with the upload and copy-back buffers pinned. A fast
check before a bench."""

import glob
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.getcwd())
import ingest.media.pixels as P  # noqa: E402
from ingest.blocks import tensor_from_record  # noqa: E402
from ingest.config import DataConfig
from ingest.stages.vision import VisionStage  # noqa: E402
from ingest.tokenizer.offline import build_offline_model_dir  # noqa: E402
from tools.vision_bench import decoded_blocks  # noqa: E402

model = str(build_offline_model_dir())
blocks = decoded_blocks(sorted(glob.glob(sys.argv[1] + "/*.parquet"))[:2], model)
cpu, cuda = (
    VisionStage(model, DataConfig(vision_device="cpu")),
    VisionStage(model, DataConfig(vision_device=os.environ.get("CHECK_DEVICE", "cuda"))),
)
for block in blocks:
    for a, b in zip(  # noqa: B905 (equal lengths: one block each)
        cpu(block).column("multi_modal_inputs").to_pylist(), cuda(block).column("multi_modal_inputs").to_pylist()
    ):
        grid_a, grid_b = tensor_from_record(a["image_grid_thw"]), tensor_from_record(b["image_grid_thw"])
        assert np.array_equal(grid_a, grid_b)
        levels = np.abs(tensor_from_record(a["pixel_values"]).astype(np.int16) - tensor_from_record(b["pixel_values"]))
        assert levels.max() <= 2, levels.max()
pinned = [torch.from_numpy(b).is_pinned() for pool in (P.UPLOAD_STAGING, P.DEVICE_PATCHES) for b in pool._buffers]
print("quick check: cuda within 2 levels of cpu on", len(blocks), "blocks; pinned buffers", pinned, flush=True)
assert pinned and all(pinned)
