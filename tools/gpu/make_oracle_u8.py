"""Here: verl's pixel_values for CONFIGS[0] as uint8 levels (inverting the normalize), one frame per patch."""

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from ingest.media.pixels import ImagePixels  # noqa: E402
from ingest.tokenizer.offline import build_offline_model_dir  # noqa: E402
from tests.test_parity_multimodal import BATCH, CONFIGS  # noqa: E402
from tools.gpu.fingerprint import levels  # noqa: E402
from tools.oracle import run_verl  # noqa: E402

here = ROOT / ".gpu"
model = str(build_offline_model_dir())
files = sorted(str(p) for p in (here / "geo3k").glob("*.parquet"))
configs = [{**CONFIGS[0], "cache_dir": "/tmp/verl-cache2"}]
run = run_verl("rows", files, model, None, configs=configs, batch_size=BATCH, processor=model)["runs"][0]


pixels = ImagePixels.from_dir(model)
arrays = [levels(mi["pixel_values"], pixels) for b in run["batches"] for mi in b["multi_modal_inputs"]]
np.savez_compressed(here / "oracle_u8.npz", *arrays)
print(len(arrays), sum(a.size for a in arrays))
