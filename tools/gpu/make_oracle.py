"""On the CPU machine with the verl 0.5.0 oracle: the parity data of tests/test_parity_multimodal.py, written to
.gpu/geo3k, and the fingerprints of verl's rows for its three configs (.gpu/oracle_fp.pkl)."""

import pickle
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fingerprint import fingerprint  # noqa: E402

from ingest.tokenizer.offline import build_offline_model_dir  # noqa: E402
from tests.test_parity_multimodal import BATCH, CONFIGS  # noqa: E402
from tools.oracle import run_verl  # noqa: E402
from tools.samples import write_geo3k_parquet  # noqa: E402

here = ROOT / ".gpu"
model = str(build_offline_model_dir())
files = write_geo3k_parquet(here / "geo3k", 48, num_files=2, row_group_size=12)
configs = [{**c, "cache_dir": "/tmp/verl-cache"} for c in CONFIGS]
runs = run_verl("rows", files, model, None, configs=configs, batch_size=BATCH, processor=model)["runs"]
out = [
    {"config": c, "fingerprint": fingerprint(r["batches"]), "rows": sum(len(b["input_ids"]) for b in r["batches"])}
    for c, r in zip(CONFIGS, runs, strict=True)
]
with open(here / "oracle_fp.pkl", "wb") as f:
    pickle.dump(out, f)
print([o["rows"] for o in out], [len(o["fingerprint"]) for o in out])
