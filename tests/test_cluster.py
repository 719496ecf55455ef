"""On a cluster: `ray job submit` of the demo job to a real head on loopback (token auth on), the pipeline on Ray's
fake autoscaling multi-node cluster, and the Prometheus counters against the run summary."""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
import time
import urllib.request

import pyarrow.parquet as pq
import pytest
import ray

from ingest.run import run_pipeline
from ingest.stats import METRIC_NAMES
from tests.support.cluster import ROOT, cluster_env, free_port, start_head, stop_cluster
from tests.support.tiers import slow


def _submit(dashboard: int, submission: str, out, summary_path, env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            str(ROOT / "deploy" / "submit.sh"),
            f"--address=http://127.0.0.1:{dashboard}",
            "--submission-id",
            submission,
            "deploy/configs/text.yaml",
            "--",
            f"--output={out}",
            f"--summary-json={summary_path}",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _ray_job(verb: str, dashboard: int, submission: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ray", "job", verb, f"--address=http://127.0.0.1:{dashboard}", submission],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@slow
def test_demo_job_submitted_with_ray_job_submit(tmp_path):
    port, dashboard = free_port(), free_port()
    token = secrets.token_hex(16)
    env = cluster_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    out, summary_path = tmp_path / "rows", tmp_path / "summary.json"
    submission = f"ingest-test-{secrets.token_hex(4)}"
    start_head(port, env, "--num-cpus=2", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}")
    try:
        for _ in range(24):  # `ray start` returns before the dashboard's job agent is up (slow on a loaded machine)
            submit = _submit(dashboard, submission, out, summary_path, env)
            if "No available agent to submit job" not in submit.stderr + submit.stdout:
                break
            time.sleep(5)
        assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
        status = _ray_job("status", dashboard, submission, env)
        assert f"Job '{submission}' succeeded" in status.stdout, status.stdout + status.stderr
        logs = _ray_job("logs", dashboard, submission, env).stdout
        # without the token the job API refuses
        refused = _ray_job(
            "status", dashboard, submission, cluster_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="wrong" + token)
        )
        assert refused.returncode != 0
    finally:
        stop_cluster(port)
    summary = json.loads(summary_path.read_text())
    assert summary["rows_in"] == 20_000 and summary["rows_out"] == 19_800 and summary["accounted"]
    line = next(x for x in logs.splitlines() if x.startswith("INGEST_SUMMARY "))
    assert json.loads(line.removeprefix("INGEST_SUMMARY "))["rows_out"] == 19_800
    written = sum(pq.ParquetFile(p).metadata.num_rows for p in out.glob("*.parquet"))
    assert written == summary["rows_out"]
    assert token not in logs and token not in summary_path.read_text()


def _scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


@slow
def test_metrics_counters_match_the_summary(ray_session, variety_files, model_dir):
    summary = run_pipeline(variety_files, model_dir, {"truncation": "left", "shuffle": False})
    ports = {node["MetricsExportPort"] for node in ray.nodes() if node["Alive"]}
    expected = {
        "rows_in": summary.rows_in,
        "rows_out": summary.rows_out,
        "filtered_overlong": summary.filtered_overlong,
        "prompt_tokens": summary.prompt_tokens,
    }
    assert summary.filtered_overlong > 0
    seen: dict[str, float] = {}
    deadline = time.time() + 90  # workers report every 10 s (Ray's default; a shorter interval costs every test CPU)
    while time.time() < deadline:
        body = "".join(_scrape(p) for p in ports)
        for key in expected:
            pattern = rf'^ray_{METRIC_NAMES[key]}(?:_total)?{{[^}}]*run="{summary.run_id}"[^}}]*}} ([0-9.e+]+)$'
            values = [float(v) for v in re.findall(pattern, body, flags=re.M)]
            if values:
                seen[key] = sum(values)
        if seen == {k: float(v) for k, v in expected.items()}:
            break
        time.sleep(1)
    assert seen == {k: float(v) for k, v in expected.items()}


AUTOSCALE_SCRIPT = r"""
import json, sys, time
import ray
from ingest import build_dataset, VerlCollate

spec = json.loads(sys.argv[1])
ray.init(address=spec["address"], logging_level="ERROR", log_to_driver=False)
ray.data.DataContext.get_current().enable_progress_bars = False
config = {"shuffle": False, "filter_overlong_prompts": False, "max_prompt_length": 4096, "vision_num_gpus": 1,
          "vision_num_cpus": 0,  # GPU nodes have no CPU: the read, tokenize and decode actors need CPU nodes
          "vision_pool_min_size": 1, "vision_pool_max_size": 2, "vision_batch_size": 4,
          "tokenizer_pool_max_size": 1, "decode_pool_max_size": 1}
ds = build_dataset(spec["files"], spec["model"], config, processor=spec["model"])
indices, peak_vision, peak_nodes = [], 0, 1
for batch in ds.iter_torch_batches(batch_size=4, collate_fn=VerlCollate()):
    indices += [int(i) for i in batch["index"]]
    # the vision actors are the only GPU users: GPUs in use = vision pool size
    gpus_in_use = ray.cluster_resources().get("GPU", 0) - ray.available_resources().get("GPU", 0)
    peak_vision = max(peak_vision, int(gpus_in_use))
    peak_nodes = max(peak_nodes, sum(n["Alive"] for n in ray.nodes()))
print("RESULT " + json.dumps({"indices": indices, "peak_vision": peak_vision, "peak_nodes": peak_nodes}))
"""


# one driver polls the GCS until only the head and the 2 GPU nodes are alive (or 120 s pass)
SCALED_DOWN_SCRIPT = r"""
import sys, time
import ray

ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
deadline = time.time() + 120
while (alive := sum(n["Alive"] for n in ray.nodes())) != 3 and time.time() < deadline:
    time.sleep(1)
print("ALIVE", alive)
"""


@slow
def test_pipeline_on_an_autoscaling_cluster(model_dir, tmp_path):
    from tests.support.cluster import start_autoscaling_cluster
    from tools.samples import write_geo3k_parquet

    files = write_geo3k_parquet(tmp_path / "geo3k", 192, row_group_size=8)
    port = free_port()
    workers = {
        "cpu_node": {"resources": {"CPU": 2}, "node_config": {}, "min_workers": 0, "max_workers": 2},
        # A logical GPU and no CPU: each vision actor (num_gpus=1, num_cpus=0) needs one of these nodes. Ray Data
        # sizes an actor pool within the resources the cluster has now (the pool's budget), and its own resource
        # requests did not bring up a second GPU node within a run this short, so both GPU nodes come from
        # min_workers; the CPU nodes (read/tokenize/decode) are added on demand (the head has no CPU) and removed idle.
        "gpu_node": {"resources": {"CPU": 0, "GPU": 1}, "node_config": {}, "min_workers": 2, "max_workers": 2},
    }
    env = start_autoscaling_cluster(port, {"CPU": 0}, workers, idle_timeout_minutes=0.1)
    try:
        spec = {"address": f"127.0.0.1:{port}", "files": files, "model": model_dir}
        run = subprocess.run(
            [sys.executable, "-c", AUTOSCALE_SCRIPT, json.dumps(spec)],
            env={**env, "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, run.stderr[-4000:]
        result = json.loads(next(x for x in run.stdout.splitlines() if x.startswith("RESULT ")).removeprefix("RESULT "))
        assert result["peak_nodes"] >= 4, result  # head + 2 GPU workers + CPU worker(s) added for the read/tokenize
        assert result["peak_vision"] == 2, result  # the vision pool grew from 1 to its maximum
        assert result["indices"] == list(range(192))  # every row arrives, once, in order
        # idle CPU worker nodes are removed after the run (idle timeout 6 s); the 2 min_workers GPU nodes stay
        probe = subprocess.run(
            [sys.executable, "-c", SCALED_DOWN_SCRIPT, spec["address"]], env=env, capture_output=True, text=True
        )
        # the driver also prints the autoscaler's events: read only the marked line
        alive = int(next(x for x in probe.stdout.splitlines() if x.startswith("ALIVE ")).split()[1])
        assert alive == 3, f"{alive} nodes alive, expected the head and the 2 GPU nodes"
    finally:
        stop_cluster(port)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
