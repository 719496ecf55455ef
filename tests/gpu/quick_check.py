"""On the GPU machine: the vision stage on cuda against the CPU one over two of bench vision's blocks (patches
bit-equal, as gpu_check found), with the upload and copy-back buffers pinned. A fast check before a bench."""

import glob
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.getcwd())
import ingest.pixels as P  # noqa: E402
from ingest.offline import build_offline_model_dir  # noqa: E402
from ingest.stages.vision import VisionStage  # noqa: E402
from ingest.vision import tensor_from_record  # noqa: E402
from ingest.vision_bench import decoded_blocks  # noqa: E402

model = str(build_offline_model_dir())
blocks = decoded_blocks(sorted(glob.glob(sys.argv[1] + "/*.parquet"))[:2], model)
cpu, cuda = VisionStage(model, "cpu"), VisionStage(model, os.environ.get("CHECK_DEVICE", "cuda"))
for block in blocks:
    for a, b in zip(  # noqa: B905 (equal lengths: one block each)
        cpu(block).column("multi_modal_inputs").to_pylist(), cuda(block).column("multi_modal_inputs").to_pylist()
    ):
        for key in ("pixel_values", "image_grid_thw"):
            assert np.array_equal(tensor_from_record(a[key]), tensor_from_record(b[key])), key
pinned = [torch.from_numpy(b).is_pinned() for pool in (P.UPLOAD_STAGING, P.DEVICE_PATCHES) for b in pool._buffers]
print("quick check: cuda == cpu on", len(blocks), "blocks; pinned buffers", pinned, flush=True)
assert pinned and all(pinned)
