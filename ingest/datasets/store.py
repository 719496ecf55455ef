"""What the object store did during a run: bytes spilled to disk and restored, and the time that took.

Ray keeps these totals per raylet, cumulative since the cluster started, and any raylet answers for the whole cluster
(``FormatGlobalMemoryInfo``, the request behind ``ray memory --stats-only`` and Ray Data's own spill line). Ray has no
public call for them, so this module asks a raylet over gRPC with Ray's generated stubs (with the cluster's auth
token, as Ray's own clients send it), and a run reports the difference of two readings: everything the cluster
spilled meanwhile, other jobs included. A cluster that does not answer (another Ray, a refused token) gives None, and
the summary says the figures are unknown.
"""

from __future__ import annotations

import dataclasses

import ray

READ_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class StoreTotals:
    """Object spilling and restoring over a span of time, the whole cluster (seconds: the spill workers' IO time)."""

    spilled_bytes: int = 0
    spilled_objects: int = 0
    spill_s: float = 0.0
    restored_bytes: int = 0
    restored_objects: int = 0
    restore_s: float = 0.0

    def since(self, earlier: StoreTotals) -> StoreTotals:
        now, then = dataclasses.astuple(self), dataclasses.astuple(earlier)
        return StoreTotals(*(a - b for a, b in zip(now, then, strict=True)))

    def describe(self) -> str:
        if not self.spilled_bytes and not self.restored_bytes:
            return "nothing spilled to disk"
        return (
            f"spilled {self.spilled_bytes / 1e6:,.1f} MB ({self.spilled_objects:,} objects) in {self.spill_s:.1f} s, "
            f"restored {self.restored_bytes / 1e6:,.1f} MB in {self.restore_s:.1f} s"
        )


def store_totals(timeout_s: float = READ_TIMEOUT_S) -> StoreTotals | None:
    """The cluster's totals so far, asked of this process's own raylet; None when they cannot be read."""
    try:
        import grpc
        from ray.core.generated import node_manager_pb2, node_manager_pb2_grpc
    except ImportError:
        return None
    here = ray.get_runtime_context().get_node_id()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    node = next((n for n in nodes if n.get("NodeID") == here), nodes[0] if nodes else None)
    if node is None:
        return None
    channel = grpc.insecure_channel(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}")
    try:
        stub = node_manager_pb2_grpc.NodeManagerServiceStub(channel)
        request = node_manager_pb2.FormatGlobalMemoryInfoRequest(include_memory_info=False)
        stats = stub.FormatGlobalMemoryInfo(request, timeout=timeout_s, metadata=_auth_metadata()).store_stats
    except grpc.RpcError:
        return None
    finally:
        channel.close()
    return StoreTotals(
        spilled_bytes=stats.spilled_bytes_total,
        spilled_objects=stats.spilled_objects_total,
        spill_s=stats.spill_time_total_s,
        restored_bytes=stats.restored_bytes_total,
        restored_objects=stats.restored_objects_total,
        restore_s=stats.restore_time_total_s,
    )


def _auth_metadata() -> tuple[tuple[str, str], ...]:
    """The token header Ray's own gRPC clients add (Ray 2.60 turns token auth on for local clusters); none without."""
    try:
        from ray._raylet import AuthenticationTokenLoader

        loader = AuthenticationTokenLoader.instance()
        return tuple(loader.get_token_for_http_header().items()) if loader.has_token() else ()
    except (ImportError, AttributeError):  # a Ray without token auth
        return ()
