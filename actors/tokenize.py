"""The tokenization actor: loads the tokenizer once, then runs ``PromptTokenizeStage`` per batch."""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from ingest.config import DataConfig
from ingest.models import ChatTokenizer
from ingest.stages.tokenize import PromptTokenizeStage
from ingest.stats import report_counts


class TokenizeActor:
    def __init__(self, tokenizer: str, config: dict, files: Sequence[str], ledger=None, keep_provenance=False):
        cfg = DataConfig(**config)
        self.stage = PromptTokenizeStage(
            ChatTokenizer(tokenizer, trust_remote_code=cfg.trust_remote_code), cfg, files, keep_provenance
        )
        self.ledger = ledger

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows, counts = self.stage(batch)
        report_counts(self.ledger, counts)
        return rows
