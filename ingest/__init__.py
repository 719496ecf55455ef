"""Ray Data ingestion for RL and SFT post-training: Parquet -> actor pools -> verl rows (0.5.0 by default)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ingest.arrow_numpy import check_arrow_numpy
from ingest.lazy import lazy_exports
from ingest.ray_version import check_ray

check_ray()  # an untested Ray fails here, in one line naming both versions, not deep inside Ray Data
check_arrow_numpy()  # so does a pyarrow that does not import beside the installed numpy

# Public names -> the module that defines them, imported on first use: an actor process unpickling its class (say
# ``actors.vision.DecodeActor``) then imports only its stage's modules, not the whole package (jinja2, the SFT
# renderers, the pipeline builder), which every actor of a run would otherwise pay for at start-up.
_EXPORTS = {
    "BadRowError": "ingest.errors",
    "DataConfig": "ingest.config",
    "IngestError": "ingest.errors",
    "ModelLoadError": "ingest.errors",
    "PromptShard": "ingest.shards",
    "PromptStream": "ingest.stream",
    "SFTCollate": "ingest.rowformat.sft_collate",
    "SourceError": "ingest.errors",
    "VerlCollate": "ingest.rowformat.collate",
    "build_dataset": "ingest.datasets.rl",
    "build_sft_dataset": "ingest.datasets.sft",
    "iter_batch_refs": "ingest.feed",
    "merge_shard_states": "ingest.shards",
    "reshard_states": "ingest.shards",
    "split_shard_state": "ingest.shards",
}

__all__ = [
    "BadRowError",
    "DataConfig",
    "IngestError",
    "ModelLoadError",
    "PromptShard",
    "PromptStream",
    "SFTCollate",
    "SourceError",
    "VerlCollate",
    "build_dataset",
    "build_sft_dataset",
    "iter_batch_refs",
    "merge_shard_states",
    "reshard_states",
    "split_shard_state",
]

if TYPE_CHECKING:
    from ingest.config import DataConfig
    from ingest.datasets.rl import build_dataset
    from ingest.datasets.sft import build_sft_dataset
    from ingest.errors import BadRowError, IngestError, ModelLoadError, SourceError
    from ingest.feed import iter_batch_refs
    from ingest.rowformat.collate import VerlCollate
    from ingest.rowformat.sft_collate import SFTCollate
    from ingest.shards import PromptShard, merge_shard_states, reshard_states, split_shard_state
    from ingest.stream import PromptStream


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
