"""Ray actor classes used by ``map_batches``. Each hosts a stage from ``ingest.stages``; no pipeline logic here."""

from actors.tokenize import TokenizeActor

__all__ = ["TokenizeActor"]
