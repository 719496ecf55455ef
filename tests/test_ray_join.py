"""Joining Ray: a cluster address that does not answer (recorded by an earlier `ray start` whose cluster died, or
RAY_ADDRESS pointing nowhere) fails at once with one error naming it and the way out, where a plain ``ray.init()``
would retry for ~10 minutes; a live recorded cluster is still joined and no recorded address still starts a local one.

Each test points Ray's recorded-address lookup (``ray_current_cluster`` under ``RAY_TMPDIR``) at a directory of its
own, so the machine's real record and the test session's Ray are never touched."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ingest.datasets.pools import RayJoinError, check_ray_address, ray_address_to_join
from ingest.errors import IngestError
from tests.support.cluster import ROOT, cluster_env
from tests.support.tiers import slow

LIMIT_S = 30  # the promise: an error within this, never a hang (timed inside the process: Python's own start-up
# under a loaded test machine is not the wait being promised away)
HANG_S = 120  # a subprocess still running by then is the old ~10-minute wait

ENSURE_RAY = """
import json, time
import ray
from ingest.datasets.pools import ensure_ray
started = time.monotonic()
try:
    ensure_ray()
except ConnectionError as exc:
    print(json.dumps({"error": str(exc), "type": type(exc).__name__, "s": time.monotonic() - started}))
else:
    print(json.dumps({"joined": ray.get_runtime_context().gcs_address, "s": time.monotonic() - started}))
"""


@pytest.fixture
def ray_tmpdir() -> Iterator[Path]:
    """A RAY_TMPDIR of the test's own. Short, under /tmp: a local Ray started there puts its Unix sockets below it,
    and their paths must stay under the 107-byte limit."""
    path = Path(tempfile.mkdtemp(prefix="rayjoin-", dir="/tmp"))
    (path / "ray").mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def record(ray_tmpdir: Path, address: str) -> Path:
    """What `ray start` leaves behind for a later plain ``ray.init()`` to join."""
    path = ray_tmpdir / "ray" / "ray_current_cluster"
    path.write_text(address)
    return path


def run_ensure_ray(ray_tmpdir: Path, **env: str) -> dict:
    """``ensure_ray()`` in a new process with only this test's recorded address: what it printed."""
    proc = subprocess.run(
        [sys.executable, "-c", ENSURE_RAY],
        env=cluster_env(RAY_TMPDIR=str(ray_tmpdir), **env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_recorded_dead_address_fails_fast(ray_tmpdir):
    port = closed_port()
    recorded = record(ray_tmpdir, f"127.0.0.1:{port}")
    result = run_ensure_ray(ray_tmpdir)
    assert result["type"] == "RayJoinError" and result["s"] < LIMIT_S, result
    message = result["error"]
    assert f"127.0.0.1:{port}" in message and str(recorded) in message
    assert "`ray stop`" in message and "RAY_ADDRESS=local" in message and "RAY_ADDRESS=<host>:<port>" in message
    assert "\n" not in message


def test_ray_address_to_closed_port_fails_fast(ray_tmpdir):
    port = closed_port()
    result = run_ensure_ray(ray_tmpdir, RAY_ADDRESS=f"127.0.0.1:{port}")
    assert result["type"] == "RayJoinError" and result["s"] < LIMIT_S, result
    message = result["error"]
    assert f"RAY_ADDRESS=127.0.0.1:{port}" in message and "RAY_ADDRESS=local" in message
    assert "connection refused" in message


STREAM = """
import json, sys
from ingest import PromptStream
files, model = json.loads(sys.argv[1])
made = 0
try:
    for batch in PromptStream(files, model, {"shuffle": False}, 16):
        made += 1
except ConnectionError as exc:
    print(json.dumps({"error": str(exc), "type": type(exc).__name__, "batches": made}))
"""


def test_prompt_stream_to_a_dead_address_raises_after_its_first_batches(ray_tmpdir, variety_files, model_dir):
    """The stream's cluster starts in a background thread while the driver makes rows: a dead address still raises
    ``RayJoinError`` to the consumer (after the batches of the driver's first read unit, made before any cluster), not
    an epoch quietly made in the driver."""
    port = closed_port()
    proc = subprocess.run(
        [sys.executable, "-c", STREAM, json.dumps([variety_files, model_dir])],
        env=cluster_env(RAY_TMPDIR=str(ray_tmpdir), RAY_ADDRESS=f"127.0.0.1:{port}"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["type"] == "RayJoinError" and f"RAY_ADDRESS=127.0.0.1:{port}" in result["error"], result
    assert result["batches"] >= 1


@slow
def test_a_process_exiting_while_its_cluster_starts_lets_the_start_finish(ray_tmpdir):
    """A small epoch can end in the driver before its cluster is up; the process then exits while ``ray.init`` runs
    in the starter thread. Ray's exit handler shutting the cluster down beside that start could make the process abort
    in gRPC ("Illegal header value", SIGABRT); the start is let finish first."""
    code = "from ingest.datasets.pools import ensure_ray_soon; ensure_ray_soon(); print('exiting', flush=True)"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=cluster_env(RAY_TMPDIR=str(ray_tmpdir), RAY_ADDRESS="local"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "exiting", proc.stderr[-3000:]
    assert "Started a local Ray instance" in proc.stderr, proc.stderr[-3000:]  # the start ran to its end


def test_silent_listener_fails_within_the_probe_timeout(ray_tmpdir, monkeypatch):
    """A head that accepts connections but never answers (frozen, or its port taken by a silent program): the TCP
    connect succeeds, the GCS request times out."""
    from ray._private.services import get_node_ip_address

    with socket.socket() as server:
        server.bind((get_node_ip_address(), 0))  # the address ray.init (and so the probe) dials for a loopback one
        server.listen(8)
        accepted: list[socket.socket] = []
        threading.Thread(target=lambda: accepted.append(server.accept()[0]), daemon=True).start()
        address = "{}:{}".format(*server.getsockname()[:2])
        monkeypatch.setenv("RAY_TMPDIR", str(ray_tmpdir))
        monkeypatch.setenv("RAY_ADDRESS", address)
        started = time.monotonic()
        with pytest.raises(RayJoinError, match="no answer within 2 s") as caught:
            check_ray_address(timeout_s=2)
        assert time.monotonic() - started < 10
        for conn in accepted:
            conn.close()
    assert address in str(caught.value)
    assert isinstance(caught.value, IngestError) and isinstance(caught.value, ConnectionError)


def test_ray_address_local_skips_the_recorded_address(ray_tmpdir, monkeypatch):
    """The documented way out: RAY_ADDRESS=local starts a new cluster whatever is recorded, so nothing is probed."""
    record(ray_tmpdir, f"127.0.0.1:{closed_port()}")
    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmpdir))
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert ray_address_to_join() is None
    check_ray_address()  # no error
    monkeypatch.delenv("RAY_ADDRESS")
    assert ray_address_to_join()[1] == str(ray_tmpdir / "ray" / "ray_current_cluster")


def test_cli_run_prints_the_error_and_exits_nonzero(ray_tmpdir, variety_files, model_dir):
    port = closed_port()
    record(ray_tmpdir, f"127.0.0.1:{port}")
    proc = subprocess.run(
        [sys.executable, "-m", "ingest", "run", "--files", *variety_files, "--tokenizer", model_dir],
        env=cluster_env(RAY_TMPDIR=str(ray_tmpdir)),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ingest: error:")]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0] and "`ray stop`" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "INGEST_SUMMARY" not in proc.stdout


def test_recorded_live_cluster_is_joined(ray_session, ray_tmpdir):
    """The probe lets a live cluster through: a new process joins the test session's Ray found as the recorded one."""
    gcs_address = ray_session.get_runtime_context().gcs_address
    record(ray_tmpdir, gcs_address)
    result = run_ensure_ray(ray_tmpdir)
    assert result.get("joined") == gcs_address, result


@slow
def test_nothing_recorded_starts_a_local_cluster(ray_session, ray_tmpdir):
    result = run_ensure_ray(ray_tmpdir)
    assert "joined" in result and result["joined"] != ray_session.get_runtime_context().gcs_address, result
    assert not (ray_tmpdir / "ray" / "ray_current_cluster").exists()  # ray.init records nothing: nothing left behind
