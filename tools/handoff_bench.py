"""``python -m ingest bench handoff``: verl 0.9.1's agent loop on its own loader's rows against the same agent loop on
handed-off media (``data.media_handoff``), on the same geo3k-shaped prompts, both cold, in one run.

Each side runs in a new process in the verl 0.9.1 oracle environment, the clock started before Ray: every batch is
repeated ``rollout.n`` times and split over agent-loop workers (Ray actors, a stand-in LLM server returning fixed
tokens), up to the generate call and the training inputs, as verl's manager drives them. Stock: verl's
``RLHFDataset`` + ``StatefulDataLoader`` and ``AgentLoopWorker``. Hand-off: ``VerlDataLoader`` with
``media_handoff`` and ``IngestAgentLoopWorker``.

Figures (tools/oracle/agent_loop.py, ``bench_side``): the multimodal work's CPU (stock: qwen-vl-utils, the
continuous-token builder and the training inputs in the workers; hand-off: the same seams, which resolve the
payload, plus what the pipeline spends beyond making the same rows without the hand-off, from a third run of ours
that makes only the rows), the workers' whole ``generate_sequences`` CPU, wall time, and the controller's peak RSS
(the process that holds the batches; its tree's peak PSS beside it). The pipeline's CPU is the controller's plus that
of every Ray process but the agent-loop workers and Ray's daemons (``NOT_PIPELINE``), each read from this process
(``TreePss``), so that the measured side pays nothing for it.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
from pathlib import Path

from tools.bench import geo3k_files
from tools.session import cache_dir, cached_files, machine
from tools.verl09_bench import _measured

ROW_FORMAT = "verl-0.9"
PROMPT_LENGTH = 4096


def mixed_file_sets(work: Path, rows: int) -> list[list[str]]:
    """The mixed workload's data sets (each of one schema, as a user's data set is): half the prompts geo3k-shaped in
    an HF ``Image()`` column, three tenths the same in plain ``{bytes, path}`` structs, the rest frame-list videos
    beside an image. Images of every PIL mode verl meets, JPEG and PNG, 28 px to over 2,000 px; every fifth image
    prompt has two; every fourth video prompt two videos."""
    from tools.samples import MIXED_KINDS, write_geo3k_parquet, write_geo3k_struct_parquet, write_video_parquet

    image, struct = rows // 2, rows * 3 // 10
    video = rows - image - struct
    return [
        cached_files(work, f"mixed-image-{image}", lambda out: write_geo3k_parquet(out, image, kinds=MIXED_KINDS)),
        cached_files(
            work,
            f"mixed-struct-{struct}",
            lambda out: write_geo3k_struct_parquet(out, struct, seed=1, kinds=MIXED_KINDS),
        ),
        cached_files(
            work,
            f"mixed-video-{video}",
            lambda out: write_video_parquet(out, video, kind="frames", with_images=True, seed=2, row_group_size=32),
        ),
    ]


def _side(
    check: str, file_sets: list[list[str]], model: str, work: Path, n: int, batch_size: int, workers: int, path: str
) -> dict:
    from tools.oracle import RUNNER, oracle_environment

    out = work / f"{check}-{time.time_ns()}.pkl"
    spec = {
        "file_sets": file_sets,
        "path": path,
        "model": model,
        "out": str(out),
        "check": check,
        "n": n,
        "batch_size": batch_size,
        "workers": workers,
        "prompt_length": PROMPT_LENGTH,
    }
    env = oracle_environment(ROW_FORMAT, work / f"verl-{time.time_ns()}")
    env["RAY_ADDRESS"] = "local"  # a new session, never a cluster left running on the machine
    measured = _measured([sys.executable, str(RUNNER), "agent_loop", json.dumps(spec)], env, str(work))
    with open(out, "rb") as f:
        result = pickle.load(f)
    out.unlink()
    return {**result, "tree_peak_pss_mib": measured["peak_pss_mib"], "descendants_cpu_s": measured["descendants_cpu_s"]}


# descendants that are not the pipeline's: the agent-loop workers, Ray's own daemons (there on every side for the
# agent loop's Ray, whatever feeds it)
NOT_PIPELINE = frozenset(
    ("BenchWorker", "BenchWorkerTQ", "DashboardAgent", "RuntimeEnvAgent", "raylet", "gcs_server")
    + ("monitor.py", "log_monitor.py", "dashboard.py")
    + ("TransferQueueController", "SimpleStorageUnit")  # the v1 trainer's, whatever feeds it
)


def _pipeline_cpu(side: dict) -> float:
    """The pipeline's CPU: the controller's (which may make the rows itself) and every Ray process's but the
    agent-loop workers' and Ray's daemons': actors of the pipeline (the media store, actor pools, Ray Data's own) and
    the idle workers Ray starts."""
    processes = side["descendants_cpu_s"]
    return side["controller_cpu_s"] + sum(s for title, s in processes.items() if title not in NOT_PIPELINE)


def _ratios(stock: dict, ours: dict, rows: dict) -> dict:
    # the pipeline's share: what it spent beyond making the same rows without the hand-off (the controller's
    # driving of the workers counted in, so the share is, if anything, too large)
    pipeline = _pipeline_cpu(ours) - _pipeline_cpu(rows)
    ours_media = ours["rollout_media_cpu_s"] + pipeline
    return {
        "media_cpu_s": {
            "stock": stock["rollout_media_cpu_s"],
            "hand_off": round(ours_media, 2),
            "hand_off_pipeline": round(pipeline, 2),
            "hand_off_rollout": ours["rollout_media_cpu_s"],
        },
        "media_cpu_ratio": round(stock["rollout_media_cpu_s"] / ours_media, 2),
        "resolve_ms_per_sample": round(1000 * ours["rollout_media_cpu_s"] / ours["samples"], 3),
        "step_cpu_ratio": round(stock["step_cpu_s"] / ours["step_cpu_s"], 2),
        "wall_ratio": round(stock["wall_s"] / ours["wall_s"], 2),
        "controller_rss_ratio": round(ours["controller_peak_rss_mib"] / stock["controller_peak_rss_mib"], 2),
    }


def bench_handoff(
    rows: int = 2000,
    n: int = 8,
    batch_size: int = 128,
    workers: int = 2,
    runs: int = 1,
    work_dir: str | None = None,
    workload: str = "geo3k",
    paths: tuple[str, ...] = ("legacy",),
) -> dict:
    """``runs`` runs, each of both sides (stock first, then the hand-off, then the rows alone) per agent-loop path
    (``legacy``, ``v1``), on ``rows`` prompts of ``workload`` (``geo3k``, or ``mixed``: ``mixed_file_sets``)."""
    from ingest.tokenizer.offline import build_offline_model_dir
    from tools.oracle import oracle_available
    from tools.samples import rollout_model_dir

    if not oracle_available(ROW_FORMAT):
        raise RuntimeError(f"the {ROW_FORMAT} oracle is not installed (run `make oracle`)")
    work = cache_dir(work_dir)
    file_sets = [geo3k_files(work, rows)] if workload == "geo3k" else mixed_file_sets(work, rows)
    model = rollout_model_dir(work / "rollout-model", build_offline_model_dir())
    result = {
        "machine": machine(),
        "commit": os.popen("git rev-parse --short HEAD").read().strip(),
        "workload": workload,
        "rows": rows,
        "n": n,
        "batch_size": batch_size,
        "workers": workers,
        "runs": [],
    }
    for _ in range(runs):
        sides = {}
        for path in paths:
            sides["stock"] = _side("bench_stock", file_sets, model, work, n, batch_size, workers, path)
            sides["hand_off"] = _side("bench_handoff", file_sets, model, work, n, batch_size, workers, path)
            if "rows" not in sides:  # no agent loop: the same for each path
                sides["rows"] = _side("bench_rows", file_sets, model, work, n, batch_size, workers, path)
            ratios = _ratios(sides["stock"], sides["hand_off"], sides["rows"])
            result["runs"].append({"path": path, **sides, **ratios})
            print(json.dumps({"path": path, **ratios}), file=sys.stderr, flush=True)  # each run as it ends
    return result
