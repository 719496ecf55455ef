"""The pools' layout chosen from the cluster when the config leaves the pool sizes unset: text rows one tokenizer
actor per CPU but one; media rows one pool on small CPU-only clusters, separate pools on larger ones or with GPU
vision actors; the user's sizes always; the choice and its reason in the run's log and summary. Checked on real local
clusters of different sizes (``ray start``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from ingest import build_dataset
from ingest.config import DataConfig
from ingest.datasets.layout import (
    ONE_POOL_MAX_CPUS,
    SEPARATE_POOL_SIZE,
    TEXT_ROWS_PER_ACTOR,
    choose_layout,
    driver_keeps_epoch,
    fit_to_input,
)
from ingest.demo import write_gsm8k_parquet
from tests.support.cluster import ROOT, cluster_env, free_port, ingest_run_on, start_head, stop_cluster
from tests.support.tiers import slow

# joins the cluster at RAY_ADDRESS; per config: the pipeline's operators and the run's summary
RUN_CONFIGS = """
import json, sys
import ray
from ingest import build_dataset
from ingest.run import run_pipeline

args = json.loads(sys.argv[1])
ray.init(include_dashboard=False)
out = []
for config in args["configs"]:
    files, processor = (args["text_files"], None) if config.pop("text_rows", False) else (args["files"], args["model"])
    ds = build_dataset(files, args["model"], config, processor=processor)
    ops = list(ds._logical_plan.dag.post_order_iter())[1:]
    summary = run_pipeline(files, args["model"], config, processor=processor, batch_size=16)
    out.append({"operators": [op.name.removeprefix("MapBatches(")[:-1] for op in ops],
                "tokenizer_pool_max_size": ops[0].compute.max_size, "layout": summary.layout,
                "accounted": summary.accounted, "rows_out": summary.rows_out})
print("RESULT " + json.dumps(out))
"""


def result_line(stdout: str):
    """The script's ``RESULT {json}`` line (Ray's own log lines may come after it on stdout)."""
    return json.loads(next(line for line in reversed(stdout.splitlines()) if line.startswith("RESULT "))[7:])


THREE_POOLS = ["TokenizeActor", "DecodeActor", "VisionActor"]


def test_choice_by_cluster_shape():
    unset = DataConfig()
    for cpus in (1, 2, ONE_POOL_MAX_CPUS):
        layout = choose_layout(unset, {"CPU": cpus})
        assert (layout.name, layout.decode_pool_max_size, layout.vision_pool_max_size) == ("one-pool", 0, 0)
        assert f"{cpus} CPUs" in layout.reason
    layout = choose_layout(unset, {"CPU": ONE_POOL_MAX_CPUS + 1, "GPU": 1})
    assert (layout.name, layout.decode_pool_max_size, layout.vision_pool_max_size) == ("separate", 2, 2)
    gpu = choose_layout(DataConfig(vision_num_gpus=0.5), {"CPU": 2, "GPU": 1})  # GPU actors cannot join a CPU pool
    assert gpu.name == "separate" and "vision_num_gpus" in gpu.reason
    # a CPU-only run on a cluster that has GPUs is laid out by its CPUs
    assert choose_layout(unset, {"CPU": 2, "GPU": 8}).name == "one-pool"


def test_text_rows_get_one_tokenizer_actor_per_cpu_but_the_consumers():
    for cpus, size in ((1, 1), (2, 1), (4, 3), (16, 15)):
        layout = choose_layout(DataConfig(), {"CPU": cpus}, media=False)
        assert (layout.name, layout.tokenizer_pool_max_size) == ("text", size)
        assert layout.apply(DataConfig()).tokenizer_pool_max_size == size
    assert choose_layout(DataConfig(tokenizer_pool_min_size=2), {"CPU": 2}, media=False).tokenizer_pool_max_size == 2
    explicit = choose_layout(DataConfig(tokenizer_pool_max_size=4), {"CPU": 2}, media=False)
    assert (explicit.name, explicit.tokenizer_pool_max_size) == ("config", 4)
    # media rows keep two tokenizer actors unless set
    assert choose_layout(DataConfig(), {"CPU": 16}).tokenizer_pool_max_size == SEPARATE_POOL_SIZE
    assert choose_layout(DataConfig(tokenizer_pool_max_size=3), {"CPU": 2}).tokenizer_pool_max_size == 3


def test_no_pool_is_larger_than_its_input_can_keep_busy():
    """An actor takes whole read units: at most one per unit; text rows one per ``TEXT_ROWS_PER_ACTOR`` rows (a
    further actor's start costs more than its share of a smaller input). The user's sizes and min sizes stay."""
    text = choose_layout(DataConfig(), {"CPU": 16}, media=False)
    small = fit_to_input(text, DataConfig(), units=9, rows=2_000, media=False)
    assert small.tokenizer_pool_max_size == 1 and small.reason.endswith("2,000 rows (one actor per 8,192): at most 1")
    assert small.reason.startswith(text.reason)  # the cluster's layout, then the input's cap
    assert (
        fit_to_input(text, DataConfig(), units=9, rows=3 * TEXT_ROWS_PER_ACTOR, media=False).tokenizer_pool_max_size
        == 3
    )
    assert fit_to_input(text, DataConfig(), units=4, rows=10**6, media=False).tokenizer_pool_max_size == 4
    assert fit_to_input(text, DataConfig(), units=200, rows=10**6, media=False) == text  # 15 actors have work
    at_least = DataConfig(tokenizer_pool_min_size=2)
    assert fit_to_input(choose_layout(at_least, {"CPU": 16}, media=False), at_least, units=1, rows=10, media=False
                        ).tokenizer_pool_max_size == 2  # fmt: skip
    explicit = choose_layout(DataConfig(tokenizer_pool_max_size=6), {"CPU": 16}, media=False)
    assert fit_to_input(explicit, DataConfig(tokenizer_pool_max_size=6), units=1, rows=10, media=False) == explicit
    # media rows: by read units only (an image row costs far more than a text row); a stage in the actors before it
    # (size 0) stays there
    separate = choose_layout(DataConfig(), {"CPU": 16})
    media = fit_to_input(separate, DataConfig(), units=1, rows=30, media=True)
    assert (media.tokenizer_pool_max_size, media.decode_pool_max_size, media.vision_pool_max_size) == (1, 1, 1)
    assert fit_to_input(separate, DataConfig(), units=6, rows=30, media=True) == separate
    one_pool = fit_to_input(choose_layout(DataConfig(), {"CPU": 4}), DataConfig(), units=1, rows=30, media=True)
    assert (one_pool.tokenizer_pool_max_size, one_pool.decode_pool_max_size, one_pool.vision_pool_max_size) == (1, 0, 0)


def test_the_driver_keeps_an_epoch_only_where_the_actors_would_be_slower():
    for cpus in (1, 2):
        assert "the driver alone" in driver_keeps_epoch(DataConfig(), {"CPU": cpus}, media=False)
        assert "the driver's two threads" in driver_keeps_epoch(DataConfig(), {"CPU": cpus}, media=True)
    assert driver_keeps_epoch(DataConfig(), {"CPU": 4}, media=False) is None
    assert driver_keeps_epoch(DataConfig(), {"CPU": 4}, media=True) is None  # one-pool there, but not measured faster
    # the user's sizes
    assert driver_keeps_epoch(DataConfig(tokenizer_pool_max_size=1), {"CPU": 2}, media=False) is None
    assert driver_keeps_epoch(DataConfig(tokenizer_pool_min_size=2), {"CPU": 2}, media=False) is None
    assert driver_keeps_epoch(DataConfig(vision_pool_max_size=1), {"CPU": 2}, media=True) is None
    assert driver_keeps_epoch(DataConfig(decode_pool_max_size=0), {"CPU": 2}, media=True) is None


# a PromptStream over text or media rows on a new local cluster of args["cpus"] CPUs started before it (as in a
# trainer), or with no cluster before it on args["machine_cpus"] of this machine's cores: what the stream and its
# handoff logged, whether Ray runs afterwards and a digest of every batch (ids, and the pixels of media rows)
STREAM_ON_CLUSTER = """
import hashlib, json, logging, os, sys
import ray
from ingest.stream import PromptStream

args = json.loads(sys.argv[1])
if args.get("cpus"):
    ray.init(address="local", num_cpus=args["cpus"], include_dashboard=False, log_to_driver=False)
else:
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args["machine_cpus"]])
logged = []
handler = logging.Handler()
handler.emit = lambda record: logged.append(record.getMessage())
for name in ("ingest.datasets.handoff", "ingest.stream"):
    logging.getLogger(name).addHandler(handler)
    logging.getLogger(name).setLevel(logging.INFO)
config = {"shuffle": False, "read_rows_per_task": args["unit_rows"], "max_prompt_length": 1024,
          "filter_overlong_prompts": True}
digest, rows = hashlib.sha256(), 0
for batch in PromptStream(args["files"], args["model"], config, 16, args["processor"]):
    digest.update(batch["input_ids"].numpy().tobytes())
    for inputs in batch.get("multi_modal_inputs", []):
        digest.update(inputs["pixel_values"].numpy().tobytes())
    rows += len(batch["input_ids"])
result = {"logged": logged, "digest": digest.hexdigest(), "rows": rows, "ray": ray.is_initialized()}
print("RESULT " + json.dumps(result))
"""


@slow
@pytest.mark.parametrize("rows", ["text", "media"])
def test_a_two_cpu_cluster_leaves_the_epoch_to_the_driver_with_the_same_batches(rows, model_dir, tmp_path):
    """On 2 CPUs (text: one tokenizer actor; media: the one pool) the driver makes every unit and no actor starts;
    on 4 the actors take over after the driver's first units; on 2 cores with no cluster yet none starts at all.
    The batches are the same either way."""
    if rows == "text":
        files = [str(f) for f in write_gsm8k_parquet(tmp_path / "data", 1200, row_group_size=100, long_every=7)]
        processor, total, unit_rows = None, 1200, 100
    else:
        from tools.samples import write_geo3k_parquet

        files = [str(f) for f in write_geo3k_parquet(tmp_path / "data", 160, num_files=1, row_group_size=8)]
        processor, total, unit_rows = model_dir, 160, 8
    runs = {}
    for name, machine in {"2": {"cpus": 2}, "4": {"cpus": 4}, "none": {"machine_cpus": 2}}.items():
        spec = json.dumps(
            {**machine, "files": files, "model": model_dir, "processor": processor, "unit_rows": unit_rows}
        )
        proc = subprocess.run(
            [sys.executable, "-c", STREAM_ON_CLUSTER, spec],
            cwd=ROOT,
            env={**os.environ, "RAY_ADDRESS": "local"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = result_line(proc.stdout)
    assert any("the driver makes all" in m and f"{rows} rows" in m for m in runs["2"]["logged"]), runs["2"]["logged"]
    assert any("the actors the rest" in m for m in runs["4"]["logged"]), runs["4"]["logged"]
    assert any("no Ray cluster started" in m for m in runs["none"]["logged"]), runs["none"]["logged"]
    assert not runs["none"]["ray"] and runs["2"]["ray"]
    assert runs["2"]["digest"] == runs["4"]["digest"] == runs["none"]["digest"]
    assert 0 < runs["2"]["rows"] <= total and (rows == "media" or runs["2"]["rows"] < total)  # text: long ones dropped


def test_sizes_in_the_config_win():
    both = choose_layout(DataConfig(decode_pool_max_size=3, vision_pool_max_size=0), {"CPU": 64})
    assert (both.name, both.decode_pool_max_size, both.vision_pool_max_size) == ("config", 3, 0)
    one = choose_layout(DataConfig(decode_pool_max_size=0), {"CPU": 2})  # the other keeps the separate size
    assert (one.decode_pool_max_size, one.vision_pool_max_size) == (0, SEPARATE_POOL_SIZE)
    assert one.apply(DataConfig(decode_pool_max_size=0)).vision_pool_max_size == SEPARATE_POOL_SIZE


def test_the_session_cluster_gets_one_pool(ray_session, geo3k_files, model_dir):
    """The test session's cluster (4 logical CPUs): decode and vision run in the tokenizer actors."""
    ds = build_dataset(geo3k_files, model_dir, {"shuffle": False}, processor=model_dir)
    operators = [op.name.removeprefix("MapBatches(")[:-1] for op in ds._logical_plan.dag.post_order_iter()][1:]
    assert operators == ["TokenizeActor"]


def _on_cluster(
    port: int, env: dict, files: list[str], model: str, configs: list[dict], text_files: list[str] = ()
) -> list[dict]:
    args = json.dumps({"files": files, "text_files": list(text_files), "model": model, "configs": configs})
    proc = subprocess.run(
        [sys.executable, "-c", RUN_CONFIGS, args],
        env={**env, "RAY_ADDRESS": f"127.0.0.1:{port}"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return result_line(proc.stdout)


@slow
def test_small_cluster_one_pool_in_log_and_summary_and_explicit_sizes_win(
    geo3k_files, variety_files, model_dir, tmp_path
):
    port, env = free_port(), cluster_env(RAY_AUTH_MODE="disabled")
    start_head(port, env, "--num-cpus=2")
    try:
        config = tmp_path / "run.yaml"
        config.write_text(yaml.safe_dump({"data": {"shuffle": False}}))
        summary_path = tmp_path / "summary.json"
        cli = ingest_run_on(
            port, env, str(config), "--files", *geo3k_files, "--tokenizer", model_dir, "--processor", model_dir,
            "--summary-json", str(summary_path),
        )  # fmt: skip
        assert cli.returncode == 0, cli.stderr[-3000:]
        logged = [line for line in cli.stderr.splitlines() if "media layout:" in line]
        assert len(logged) == 1 and "one-pool (2 CPUs <= 4" in logged[0], cli.stderr[-3000:]
        assert "pool layout        one-pool" in cli.stdout
        assert "CPU image resize   the C resize" in cli.stdout
        summary = json.loads(summary_path.read_text())
        assert summary["layout"].startswith("one-pool (2 CPUs") and summary["accounted"]
        assert summary["image_resize"].startswith("the C resize")
        text = _on_cluster(port, env, geo3k_files, model_dir, [{"text_rows": True}], variety_files)[0]
        assert text["tokenizer_pool_max_size"] == 1 and text["layout"].startswith("text (2 CPUs: up to 1 ")
        explicit = _on_cluster(
            port, env, geo3k_files, model_dir, [{"decode_pool_max_size": 1, "vision_pool_max_size": 1}]
        )
        assert explicit[0]["operators"] == THREE_POOLS
        assert explicit[0]["layout"] == "config (pool sizes set in the config)"
        assert explicit[0]["rows_out"] == summary["rows_out"] and explicit[0]["accounted"]
    finally:
        stop_cluster(port)


@slow
def test_larger_cluster_and_gpu_vision_get_separate_pools(geo3k_files, variety_files, model_dir):
    port, env = free_port(), cluster_env(RAY_AUTH_MODE="disabled")
    start_head(port, env, "--num-cpus=8", "--num-gpus=1")  # logical: layout and scheduling only, kernels on the CPU
    try:
        gpu = {"vision_num_gpus": 0.5, "vision_device": "cpu", "vision_batch_size": 8}
        text = [{"text_rows": True}, {"text_rows": True, "tokenizer_pool_max_size": 2}]
        default, on_gpu, text_default, text_set = _on_cluster(
            port, env, geo3k_files, model_dir, [{}, gpu, *text], variety_files
        )
    finally:
        stop_cluster(port)
    # 8 CPUs: up to 7 tokenizer actors, and one for the 210 rows here (``fit_to_input``)
    assert text_default["layout"].startswith("text (8 CPUs: up to 7") and "210 rows" in text_default["layout"]
    assert text_default["tokenizer_pool_max_size"] == 1
    assert text_set["tokenizer_pool_max_size"] == 2 and text_set["layout"] == "config (pool size set in the config)"
    assert text_default["rows_out"] == text_set["rows_out"] > 0 and text_default["accounted"]
    assert default["tokenizer_pool_max_size"] == 2
    assert default["operators"] == THREE_POOLS and default["layout"].startswith("separate (8 CPUs > 4")
    assert on_gpu["operators"] == THREE_POOLS and "vision_num_gpus 0.5" in on_gpu["layout"]
    assert default["rows_out"] == on_gpu["rows_out"] > 0 and default["accounted"] and on_gpu["accounted"]


@pytest.mark.parametrize("row_format", ["verl-0.9"])
def test_verl09_rows_one_pool_has_no_vision_stage(ray_session, geo3k_files, model_dir, row_format):
    """verl 0.9 rows have no vision stage; on the session's cluster their decode runs in the tokenizer actors."""
    ds = build_dataset(geo3k_files, model_dir, {"row_format": row_format}, processor=model_dir)
    operators = [op.name.removeprefix("MapBatches(")[:-1] for op in ds._logical_plan.dag.post_order_iter()][1:]
    assert operators == ["TokenizeActor"]
