"""The actor pools of a pipeline, as Ray Data ``map_batches`` calls: the read fused into the first pool, then the
decode and vision pools. Every actor is built with the run's ``DataConfig`` and ``StageContext`` and the model paths
(loaded in the actor, never pickled from the driver)."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import sys
import threading
import time
from concurrent.futures import Future
from typing import Literal

import ray

from ingest.config import DataConfig, StageContext
from ingest.datasets.plan import InputPlan, units_source
from ingest.errors import IngestError

# How long a cluster address gets to answer before the run gives up on it. A live GCS answers in milliseconds;
# ray.init itself would retry a dead one for ~10 minutes (20 connection attempts of ~40 s each in Ray 2.60).
RAY_JOIN_TIMEOUT_S = 5.0
# How long a process that is exiting waits for a cluster start still under way in the starter thread
RAY_START_EXIT_WAIT_S = 60.0
# ensure_ray runs in the background starter thread (ensure_ray_soon) as well as in the caller's
_RAY_START = threading.Lock()
_starting: Future | None = None


class RayJoinError(IngestError, ConnectionError):
    """The Ray cluster this process would join does not answer at its address. Also a ``ConnectionError``, the type
    ``ray.init`` raises when it finally gives up, so code that catches Ray's error catches this one."""


def ensure_ray() -> None:
    """Join the cluster this process runs in (a Ray job sets RAY_ADDRESS), else start a local one without the
    dashboard: Ray Data's own start would bring it (nine more processes, ~200 MiB on a new local cluster).

    The address ``ray.init`` would join (``RAY_ADDRESS``, else the one an earlier ``ray start`` recorded) is probed
    first: one that does not answer raises ``RayJoinError`` within ``RAY_JOIN_TIMEOUT_S``."""
    _join_or_start(probe=True)


def _join_or_start(probe: bool) -> None:
    with _RAY_START:
        if not ray.is_initialized():
            if probe:
                check_ray_address()
            ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=True)


def ensure_ray_soon() -> Future:
    """``ensure_ray`` in a background thread; the future is done once the cluster is joined or started (or holds
    the error). The address to join is probed here first, so a dead one raises ``RayJoinError`` in the caller. The
    thread stays, blocked, for the life of the process: the processes of a local cluster get a kill signal when the
    thread that started them ends (Linux's parent-death signal is per thread)."""
    global _starting
    with _RAY_START:
        if ray.is_initialized():
            done: Future = Future()
            done.set_result(None)
            return done
        check_ray_address()
        if _starting is None or _starting.done():
            _starting = Future()
            if threading.current_thread() is threading.main_thread():
                _exit_on_sigterm()
            threading.Thread(target=_start_and_stay, args=(_starting,), name="ingest-ray-start", daemon=True).start()
            atexit.register(_finish_start, _starting)
        return _starting


def _finish_start(started: Future) -> None:
    """At exit, before Ray's own exit handler (registered earlier, so run later) shuts the cluster down: let a start
    still under way finish first. A process whose work ended before its cluster was up (a small epoch made in the
    driver) otherwise shuts Ray down while ``ray.init`` runs in the other thread, and aborts in gRPC."""
    try:
        started.result(timeout=RAY_START_EXIT_WAIT_S)
    except BaseException:  # a failed start has nothing to shut down; an exit is no place to raise
        pass


def _start_and_stay(started: Future) -> None:
    quiet = _NotMainThreadWarning()
    logging.getLogger(ray.init.__module__).addFilter(quiet)  # this thread is not the main one on purpose
    try:
        _join_or_start(probe=False)  # ensure_ray_soon probed the address before starting this thread
    except BaseException as error:
        started.set_exception(error)
        return
    finally:
        logging.getLogger(ray.init.__module__).removeFilter(quiet)
    started.set_result(None)
    threading.Event().wait()


def _exit_on_sigterm() -> None:
    """What ``ray.init`` does in the main thread and cannot do in another: SIGTERM exits through ``sys.exit``, so
    atexit's ``ray.shutdown`` stops the local cluster. Only where nobody set a handler."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))


class _NotMainThreadWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


def ray_address_to_join() -> tuple[str, str] | None:
    """(address, where it came from) of the cluster a plain ``ray.init()`` would join; None when it would start a
    local cluster or dial something this probe does not speak to (a ``scheme://`` client address other than
    ``ray://``, ``auto`` with nothing recorded: Ray answers those quickly by itself)."""
    from ray._common.utils import get_ray_address_file

    env = os.environ.get("RAY_ADDRESS", "").strip()
    if env and env != "auto":
        return None if env == "local" else (env, "RAY_ADDRESS")
    recorded_in = get_ray_address_file(None)  # Ray's own lookup: ray_current_cluster under RAY_TMPDIR / TMPDIR / /tmp
    try:
        recorded = open(recorded_in).read().strip()
    except OSError:
        return None
    return (recorded, recorded_in) if recorded else None


def new_local_cluster_resources() -> dict[str, float] | None:
    """The CPUs of the local cluster ``ensure_ray`` would start, known before starting it: the cores this process may
    run on (the cluster's processes inherit that set, whatever number Ray counts). None where Ray is up already or a
    cluster would be joined (its CPUs are known once joined)."""
    if ray.is_initialized() or os.environ.get("RAY_ADDRESS", "").strip() not in ("", "local"):
        return None
    if not os.environ.get("RAY_ADDRESS") and ray_address_to_join() is not None:  # a cluster an earlier `ray start` left
        return None
    return {"CPU": float(process_cores())}


def process_cores() -> int:
    """The cores this process may run on (its affinity where the platform has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_ray_address(timeout_s: float = RAY_JOIN_TIMEOUT_S) -> None:
    """Raise ``RayJoinError`` naming the address and the ways out when the cluster ``ray.init()`` would join does not
    answer within ``timeout_s``; return at once when there is nothing to probe."""
    target = ray_address_to_join()
    if target is None:
        return
    address, source = target
    client = address.startswith("ray://")
    if "://" in address and not client:
        return
    bare = address.removeprefix("ray://")
    host, _, port = bare.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        return  # not host:port: ray.init rejects it at once with its own message
    if not client and host in ("localhost", "127.0.0.1", "::1"):
        host = ray.util.get_node_ip_address()  # what ray.init dials for a loopback head
    dialled = f"{host}:{port}"
    failure = _probe(host, int(port), timeout_s, gcs=not client)
    if failure is None:
        return
    shown = address if dialled in (address, bare) else f"{address} (dialled as {dialled})"
    if source == "RAY_ADDRESS":
        where = f"RAY_ADDRESS={address}"
        way_out = (
            "Set RAY_ADDRESS to a running cluster's head (<host>:<port>), RAY_ADDRESS=local to start a new local "
            "cluster, or unset it to use the cluster `ray start` recorded on this machine."
        )
    else:
        where = f"recorded in {source} by an earlier `ray start`"
        way_out = (
            "Run `ray stop` (or delete that file) to forget it, set RAY_ADDRESS=local to start a new local cluster, "
            "or set RAY_ADDRESS=<host>:<port> to join a running one."
        )
    raise RayJoinError(f"no Ray cluster answers at {shown} ({where}): {failure}. {way_out}")


def _probe(host: str, port: int, timeout_s: float, *, gcs: bool) -> str | None:
    """None when ``host:port`` accepts a connection (and, with ``gcs``, answers a GCS request) within ``timeout_s``;
    else what went wrong, in words. The request is the first one ``ray.init`` sends (GetClusterId); a head that
    refuses it for want of a token has answered all the same. So a frozen head or another program on a reused port
    fails here too, not only a closed port."""
    deadline = time.monotonic() + timeout_s
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()  # a plain answer for a closed port
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except OSError as exc:
        return (exc.strerror or str(exc)).lower()
    if not gcs:
        return None
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return None  # a TLS head needs Ray's own credentials to ask: the TCP answer is all there is
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:  # a Ray without these modules: the TCP answer is all there is
        return None
    channel = grpc.insecure_channel(f"{host}:{port}")
    try:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=max(0.1, deadline - time.monotonic()))
    except grpc.RpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"no answer within {timeout_s:g} s"
        if code == grpc.StatusCode.UNAVAILABLE:
            return f"unavailable ({exc.details()})"
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return "something answers on that port, but it is not a Ray GCS"
        # anything else (e.g. a token the head refuses) is the GCS answering: ray.init reports it properly
    finally:
        channel.close()
    return None


def actor_kwargs(cfg: DataConfig, context: StageContext, **models: str | os.PathLike | None) -> dict:
    """An actor's constructor arguments: the config, the context and the model paths (as strings)."""
    return {"config": cfg, "context": context, **{k: None if v is None else os.fspath(v) for k, v in models.items()}}


def _read_cpus(num_cpus: float) -> dict:
    """The read tasks' CPUs as this Ray takes them: by name (Ray 2.5x on), else in ``ray_remote_args`` (Ray 2.48 puts
    an unknown ``num_cpus`` among the datasource's arguments, leaving its read tasks a whole CPU each: then they do
    not fuse into the pool, and on a small cluster the actors can take every CPU before a read task gets one)."""
    import inspect

    if "num_cpus" in inspect.signature(ray.data.read_datasource).parameters:
        return {"num_cpus": num_cpus}
    return {"ray_remote_args": {"num_cpus": num_cpus}}


def read_units_into_pool(
    plan: InputPlan, cfg: DataConfig, context: StageContext, actor, constructor_kwargs: dict, *, epoch: int
) -> ray.data.Dataset:
    """Read ``plan``'s units straight into a pool of ``actor`` (the tokenizer pool's size and CPUs).

    Same CPUs as the actors, no task cap and whole blocks (``batch_size=None``; the actor slices by
    ``tokenizer_batch_size``): Ray Data then fuses the read into the actor pool, so each actor reads its unit and
    processes it in the same process. No read worker has to start (and import Ray Data) before the first batch, and
    raw rows skip the object store.
    """
    ensure_ray()
    source = units_source(plan, cfg, epoch, context.ledger)
    blocks = max(1, len(plan.units))
    ds = ray.data.read_datasource(source, override_num_blocks=blocks, **_read_cpus(cfg.tokenizer_num_cpus))
    ds.context.execution_options.preserve_order = True
    # Our stages raise IngestError naming file/row/column; let it reach the consumer as itself, not wrapped in
    # Ray's UserCodeException (whose cause chain does not survive the trip back to the driver).
    ds.context.raise_original_map_exception = True
    return ds.map_batches(
        actor,
        fn_constructor_kwargs=constructor_kwargs,
        batch_size=None,
        batch_format="pyarrow",
        zero_copy_batch=True,
        compute=ray.data.ActorPoolStrategy(
            min_size=cfg.tokenizer_pool_min_size, max_size=cfg.pool_max_size("tokenizer")
        ),
        num_cpus=cfg.tokenizer_num_cpus,
    )


def map_on_pool(
    ds: ray.data.Dataset, cfg: DataConfig, pool: Literal["decode", "vision"], actor, constructor_kwargs: dict
) -> ray.data.Dataset:
    """``actor`` on the decode or vision pool (its size and CPUs from ``cfg``); the vision pool holds GPU actors when
    ``vision_num_gpus`` > 0 (fractional allowed)."""
    gpu = {"num_gpus": cfg.vision_num_gpus} if pool == "vision" and cfg.vision_num_gpus else {}
    return ds.map_batches(
        actor,
        fn_constructor_kwargs=constructor_kwargs,
        # CPU: one whole block per call, so the output block stays one Arrow chunk (docs/design.md). Ray Data needs a
        # fixed batch size for GPU actors: there the output block has one chunk per call, and slicing it later
        # combines (copies) them.
        batch_size=cfg.vision_batch_size if gpu else None,
        batch_format="pyarrow",
        zero_copy_batch=True,
        compute=ray.data.ActorPoolStrategy(
            min_size=getattr(cfg, f"{pool}_pool_min_size"), max_size=cfg.pool_max_size(pool)
        ),
        num_cpus=getattr(cfg, f"{pool}_num_cpus"),
        **gpu,
    )
