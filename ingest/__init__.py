"""Ray Data ingestion for RL and SFT post-training: Parquet -> actor pools -> verl 0.5.0 rows."""

from ingest.collate import VerlCollate
from ingest.config import DataConfig
from ingest.errors import BadRowError, IngestError, ModelLoadError, SourceError
from ingest.feed import iter_batch_refs
from ingest.pipeline import build_dataset
from ingest.sft.dataset import SFTCollate, build_sft_dataset
from ingest.stream import PromptStream

__all__ = [
    "BadRowError",
    "DataConfig",
    "IngestError",
    "ModelLoadError",
    "PromptStream",
    "SFTCollate",
    "SourceError",
    "VerlCollate",
    "build_dataset",
    "build_sft_dataset",
    "iter_batch_refs",
]
