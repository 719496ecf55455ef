"""Ray Data ingestion for RL and SFT post-training: Parquet -> actor pools -> verl 0.5.0 rows."""

from ingest.collate import VerlCollate
from ingest.config import DataConfig
from ingest.errors import BadRowError, IngestError, ModelLoadError, SourceError
from ingest.pipeline import build_dataset

__all__ = [
    "BadRowError",
    "DataConfig",
    "IngestError",
    "ModelLoadError",
    "SourceError",
    "VerlCollate",
    "build_dataset",
]
