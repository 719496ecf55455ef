"""Real Ray clusters on loopback for the cluster tests, started and stopped without touching any other Ray.

``ray stop`` (and ``AutoscalingCluster.start`` / ``shutdown``, which call ``ray stop --force``) kill every Ray process
on the machine, including the test session's own cluster. These helpers start a head on a port of its own and stop
exactly the processes that belong to it: every Ray process of a cluster (GCS, raylets, agents, workers, the
autoscaler) carries the GCS address in its command line.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # `python` / `ray` of this environment in jobs too
    env.update(extra)
    return env


# Ray system settings for the test clusters: a removed node is declared dead after 3 missed 1 s health checks, not
# Ray's default 5 x 3 s. Recovery is the same; the tests spend less time waiting for it.
FAST_NODE_DEATH = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}

# `ray start` records its cluster here and a later plain `ray.init()` on this machine joins it; put back what was there
CURRENT_CLUSTER = Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()) / "ray" / "ray_current_cluster"
_previous_current: dict[int, str | None] = {}


def start_head(port: int, env: dict, *args: str) -> None:
    _previous_current[port] = CURRENT_CLUSTER.read_text() if CURRENT_CLUSTER.exists() else None
    cmd = [str(BIN / "ray"), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", *args]
    if not any(a.startswith("--dashboard-agent-listen-port") for a in args):
        # the agent's HTTP port defaults to 52365 on every node: the test session's own Ray already holds it, and an
        # agent without its HTTP server never registers, so `ray job submit` answers "No available agent" forever
        cmd.append(f"--dashboard-agent-listen-port={free_port()}")
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=120)


def ingest_run_on(port: int, env: dict, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m ingest run ARGS`` joining the cluster at ``port``, as a user's run would; its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "ingest", "run", *args],
        env={**env, "RAY_ADDRESS": f"127.0.0.1:{port}"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def stop_cluster(port: int, timeout: float = 20) -> None:
    """Stop every process whose command line names the GCS at ``port`` (this cluster's, nobody else's)."""
    marker = f":{port}"

    def members() -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            cmdline = " ".join(proc.info["cmdline"] or [])
            ours = marker in cmdline or f"--gcs_server_port={port}" in cmdline  # gcs_server takes its port alone
            if ours and ("ray" in cmdline or "gcs_server" in cmdline) and proc.pid != os.getpid():
                found.append(proc)
        return found

    if port in _previous_current:
        previous = _previous_current.pop(port)
        if previous is None:
            CURRENT_CLUSTER.unlink(missing_ok=True)
        else:
            CURRENT_CLUSTER.write_text(previous)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        procs = members()
        for proc in procs:
            try:
                proc.send_signal(sig)
            except psutil.Error:
                pass
        deadline = time.time() + timeout
        while procs and time.time() < deadline:
            procs = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            time.sleep(0.5)
        if not procs:
            return


def start_autoscaling_cluster(port: int, head_resources: dict, worker_node_types: dict, **config) -> dict:
    """What ``ray.cluster_utils.AutoscalingCluster.start`` does (Ray's fake multi-node provider: worker "nodes" are
    local raylets the autoscaler launches and removes), minus its ``ray stop --force``. The class itself cannot be used
    here: it reads ``fake_multi_node/example.yaml``, which the Ray 2.60 wheel does not ship, and it kills every Ray
    process on the machine. The base config below is that example's."""
    from ray._private import services

    cluster_config = {
        "cluster_name": f"fake_multinode_{port}",
        "max_workers": 8,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            # the provider's nodes join the GCS at <node ip>:6379 unless told otherwise; this head has its own port
            "gcs_address": f"{services.get_node_ip_address()}:{port}",
        },
        "available_node_types": {
            **worker_node_types,
            "ray.head.default": {"resources": dict(head_resources), "node_config": {}, "max_workers": 0},
        },
        "head_node_type": "ray.head.default",
        "auth": {},
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 0.1,
        "docker": {},
        **{key: [] for key in ("initialization_commands", "setup_commands", "head_setup_commands")},
        **{key: [] for key in ("worker_setup_commands", "head_start_ray_commands", "worker_start_ray_commands")},
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        **config,
    }
    fd, config_path = tempfile.mkstemp(suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(cluster_config, f)
    head = dict(head_resources)
    args = [f"--autoscaling-config={config_path}", f"--num-cpus={head.pop('CPU', 0)}"]
    if "GPU" in head:
        args.append(f"--num-gpus={head.pop('GPU')}")
    if head:
        args.append(f"--resources={json.dumps(head)}")
    health = {f"RAY_{key}": str(value) for key, value in FAST_NODE_DEATH.items()}  # for the nodes it removes
    env = cluster_env(AUTOSCALER_UPDATE_INTERVAL_S="1", RAY_FAKE_CLUSTER="1", RAY_AUTH_MODE="disabled", **health)
    start_head(port, env, *args, "--dashboard-host=127.0.0.1", f"--dashboard-port={free_port()}")
    return env
