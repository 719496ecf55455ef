"""The checks ``build_sft_dataset`` runs on its arguments before any data is read."""

from __future__ import annotations

import os
from typing import Any

from ingest.config import DataConfig
from ingest.datasets.plan import check_model_path
from ingest.stages.sft import NO_TARGET_POLICIES


def check_sft_config(cfg: DataConfig) -> None:
    if cfg.sft_max_length is not None and int(cfg.sft_max_length) < 1:
        raise ValueError(f"sft_max_length must be >= 1 or null, got {cfg.sft_max_length}")
    if int(cfg.sft_pack_token_budget) < 0:
        raise ValueError(f"sft_pack_token_budget must be >= 0 (0: no packing), got {cfg.sft_pack_token_budget}")


def check_no_target(no_target: str) -> None:
    """On the driver, before any actor starts (the render stage checks it again where it runs)."""
    if no_target not in NO_TARGET_POLICIES:
        raise ValueError(f"no_target must be one of {', '.join(NO_TARGET_POLICIES)}, got {no_target!r}")


def check_model_paths(tokenizer: Any, processor: Any) -> None:
    """Local model directories that are missing fail here, naming the path (objects are not paths: not checked)."""
    for model, what in ((tokenizer, "tokenizer"), (processor, "processor")):
        if model is None or isinstance(model, str | os.PathLike):
            check_model_path(model, what)
