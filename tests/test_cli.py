"""The CLI end to end in a subprocess (its own local Ray): summary, accounting, Parquet output read back."""

from __future__ import annotations

import json
import subprocess
import sys

import yaml

from ingest import build_dataset
from tests.support.batches import collect
from tests.support.compare import assert_same_batches


def _run(*args, timeout=600):
    proc = subprocess.run(
        [sys.executable, "-m", "ingest", "run", *args], capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_run_writes_rows_and_summary(ray_session, variety_files, model_dir, tmp_path):
    config = tmp_path / "verl.yaml"
    data = {"train_files": variety_files, "truncation": "left", "shuffle": False, "max_prompt_length": 1024}
    config.write_text(yaml.safe_dump({"data": data, "actor_rollout_ref": {"model": {"path": model_dir}}}))
    out, summary_path = tmp_path / "out", tmp_path / "summary.json"
    proc = _run(str(config), "--output", str(out), "--summary-json", str(summary_path))

    summary = json.loads(summary_path.read_text())
    assert summary["rows_in"] == 210 and summary["files"] == 3
    assert summary["rows_in"] == summary["rows_out"] + summary["filtered_overlong"] + summary["quarantined"]
    assert summary["filtered_overlong"] == 9 and summary["accounted"] is True
    assert summary["time_to_first_batch_s"] > 0 and summary["tokens_per_s"] > 0
    line = [x for x in proc.stdout.splitlines() if x.startswith("INGEST_SUMMARY ")][-1]
    assert json.loads(line.split(" ", 1)[1]) == summary
    assert "rows out" in proc.stdout

    import ray

    # tokenize once, train many: the written rows collate to the same verl batches as a direct run
    written = collect(ray.data.read_parquet(str(out)))
    direct = collect(build_dataset(variety_files, model_dir, {"truncation": "left", "shuffle": False}))
    assert_same_batches(written, direct)
