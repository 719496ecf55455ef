"""Image rows through a cluster whose object store is far smaller than the pixels that flow through it: the run
completes with every row once, the spilling it caused is in its summary, and GPU-scheduled vision actors slower than
the decode pool do not deadlock the stream. A real ``ray start`` head with a 200 MB object store and one logical GPU
(the vision kernels run on the CPU here); the run is ``python -m ingest run`` joining it, as a user's would be.

CI runs a few hundred rows. The full-size check (5,000 rows) is the same test with more rows:
``INGEST_PRESSURE_ROWS=5000 .venv/bin/python -m pytest tests/test_object_store_pressure.py`` (figures in
docs/benchmarks.md).
"""

from __future__ import annotations

import io
import json
import os
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from tests.support.cluster import cluster_env, free_port, ingest_run_on, start_head, stop_cluster
from tests.support.tiers import slow

ROWS = int(os.environ.get("INGEST_PRESSURE_ROWS", "240"))
STORE_BYTES = 200_000_000
ROWS_PER_GROUP = 8  # a decoded block of 8 rows is ~15 MB of pixels and ~60 MB of pixel_values: several fit, not all
IMAGE_SIZE = (800, 600)  # 609 image tokens and ~7 MB of float32 pixel_values per image after the Qwen2-VL processor
DISTINCT_IMAGES = 12  # encoded once, reused: the test is about bytes in flight, not about image variety


def _large_image_rows(out_dir, rows: int) -> list[str]:
    """geo3k-shaped rows of large JPEGs, ``extra_info.index`` numbering them, 4 files of 8-row row groups."""
    from PIL import Image

    rng = np.random.default_rng(0)
    images = []
    for _ in range(DISTINCT_IMAGES):
        noise = rng.integers(0, 256, (IMAGE_SIZE[1], IMAGE_SIZE[0], 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(noise // 2 + 64).save(buffer, format="JPEG", quality=85)
        images.append(buffer.getvalue())
    pick = random.Random(0)
    table = pa.Table.from_pylist(
        [
            {
                "prompt": [{"role": "user", "content": f"<image>Describe figure {i}."}],
                "images": [{"bytes": pick.choice(images), "path": None}],
                "extra_info": {"index": i},
            }
            for i in range(rows)
        ]
    )
    files, per_file = [], -(-rows // 4)
    for k in range(4):
        path = out_dir / f"large-{k}.parquet"
        pq.write_table(table.slice(k * per_file, per_file), path, row_group_size=ROWS_PER_GROUP)
        files.append(str(path))
    return files


@slow
def test_small_object_store_spills_reports_it_and_loses_nothing(model_dir, tmp_path):
    files = _large_image_rows(tmp_path, ROWS)
    port, env = free_port(), cluster_env(RAY_AUTH_MODE="disabled")
    start_head(port, env, "--num-cpus=2", "--num-gpus=1", f"--object-store-memory={STORE_BYTES}")
    try:
        config = tmp_path / "run.yaml"
        data = {
            "shuffle": False,
            "max_prompt_length": 1024,
            # one GPU-scheduled vision actor (kernels on the CPU): slower than the two decode actors feeding it
            "vision_num_gpus": 1,
            "vision_pool_max_size": 1,
            "vision_device": "cpu",
            "decode_pool_max_size": 2,
        }
        config.write_text(yaml.safe_dump({"data": data}))
        summary_path, output = tmp_path / "summary.json", tmp_path / "out"
        cli = ingest_run_on(
            port, env, str(config), "--files", *files, "--tokenizer", model_dir, "--processor", model_dir,
            "--output", str(output), "--summary-json", str(summary_path), timeout=1800,
        )  # fmt: skip
        assert cli.returncode == 0, cli.stderr[-3000:]
    finally:
        stop_cluster(port)
    summary = json.loads(summary_path.read_text())
    assert (summary["rows_in"], summary["rows_out"], summary["quarantined"]) == (ROWS, ROWS, 0)
    written = pq.read_table(output, columns=["extra_info"]).column("extra_info").to_pylist()
    assert [row["index"] for row in written] == list(range(ROWS))  # every row once, in input order
    spill = summary["object_store"]
    assert spill["spilled_bytes"] > STORE_BYTES and spill["spilled_objects"] > 0 and spill["spill_s"] > 0
    assert "object store       spilled " in cli.stdout
    print(cli.stdout)  # the run's summary (time, spill), for the full-size check's record
