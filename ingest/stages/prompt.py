"""The prompt stage of the configured row format, built the one way the tokenizer actors and the driver's first
batch (``datasets.local``) both use: tokenizer and processor geometry loaded from their paths."""

from __future__ import annotations

from ingest.config import DataConfig, StageContext
from ingest.media.geometry import VisionSpec
from ingest.stages.raw_prompt import RawPromptStage
from ingest.stages.tokenize import PromptTokenizeStage
from ingest.tokenizer.chat import ChatTokenizer
from ingest.tokenizer.offline import resolve_model_path


def prompt_stage(
    config: DataConfig,
    context: StageContext,
    tokenizer: str | None,
    processor: str | None = None,
    *,
    count_only: bool = False,
) -> PromptTokenizeStage:
    """``RawPromptStage`` for verl 0.9 rows, else ``PromptTokenizeStage``; ``processor``: its geometry (None: text);
    ``count_only``: the stage's decisions without its rows (``PromptTokenizeStage``)."""
    vision = VisionSpec.from_dir(resolve_model_path(processor)) if processor else None
    chat = ChatTokenizer(tokenizer, trust_remote_code=config.trust_remote_code)
    stage = RawPromptStage if config.raw_prompt_rows else PromptTokenizeStage
    return stage(chat, config, context, vision, count_only=count_only)
