"""Arrow's memory pool in the pipeline's actor processes (``DataConfig.arrow_memory_pool``).

Every Parquet read and every Arrow-built column of a stage (the decoded pixels of a block, say) allocates from
Arrow's default pool. Arrow's Linux wheels default to mimalloc, which takes fresh memory as transparent huge pages;
on the 2-core VM of ``docs/benchmarks.md`` first touches of those cost more than mimalloc saves: read + tokenize +
decode of ``bench mm``'s 1,000 rows took 4.2-5.0 s of CPU in a new process against 3.2-4.1 s with the system
allocator (glibc malloc, whose freed pages the next block reuses).
"""

from __future__ import annotations

import pyarrow as pa

_POOLS = {"system": pa.system_memory_pool, "mimalloc": pa.mimalloc_memory_pool, "jemalloc": pa.jemalloc_memory_pool}
ARROW_MEMORY_POOLS = (*_POOLS, "default")
DEFAULT_ARROW_MEMORY_POOL = "system"


def use_arrow_memory_pool(name: str = DEFAULT_ARROW_MEMORY_POOL) -> None:
    """Make ``name`` (``system``, ``mimalloc``, ``jemalloc``) Arrow's default memory pool in this process;
    ``default`` leaves Arrow's choice. Buffers allocated before keep their own pool."""
    if name != "default":
        pa.set_memory_pool(_POOLS[name]())
