"""``build_sft_dataset``: Parquet conversations -> read units -> SFT render actor pool (-> vision actor pool) -> rows
of shifted, truncated, optionally packed training samples; ``SFTCollate`` (``ingest.rowformat.sft_collate``) pads
them into torch tensors per batch.

The read side is the RL pipeline's (``plan_input``, ``ParquetUnitsDatasource``, provenance columns, the read fused
into the first actor pool); the stages are in ``ingest.stages.sft``. Beside this builder: its argument checks
(``sft_checks``), its planning (``sft_plan``) and the hand-over of model objects to the actors (``saved_models``).
See docs/sft.md.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import ray

from ingest.config import DataConfig
from ingest.datasets.plan import FilesArg, InputPlan
from ingest.datasets.pools import map_on_pool, read_units_into_pool
from ingest.datasets.saved_models import model_for_actors
from ingest.datasets.sft_checks import check_model_paths, check_no_target, check_sft_config
from ingest.datasets.sft_plan import plan_sft_input
from ingest.sft.tokenizers import is_processor_object

__all__ = ["build_sft_dataset"]


def build_sft_dataset(
    files: FilesArg,
    tokenizer: Any,
    config: DataConfig | Mapping[str, Any] | None = None,
    processor: Any = None,
    *,
    epoch: int = 0,
    ledger=None,
    plan: InputPlan | None = None,
    role_to_mask: Callable[[Mapping[str, Any]], bool] | None = None,
    content_sft_roles: Collection[str] | None = None,
    no_target: str = "drop",
) -> ray.data.Dataset:
    """A Ray Dataset of SFT training rows for the conversations in ``files``.

    Input columns: ``messages`` (``sft_messages_key``: a message list, or its JSON string), else ``prompt`` +
    ``completion`` (message lists, or strings: one user / one assistant message); optional ``tools`` (list or JSON
    string), ``images`` (values for ``{"type": "image"}`` parts, or for ``<image>`` markers in string content:
    HF ``Image()`` structs, bytes or paths) and ``videos`` (frame lists).

    Output rows (Arrow, no Python objects): ``input_ids``, ``target_ids`` (the next token), ``loss_mask`` (aligned
    with ``target_ids``), ``seq_lens`` (the samples in the row; one entry unless ``sft_pack_token_budget`` > 0)
    and, with a ``processor``, ``mm_token_type_ids`` (null for text rows), ``image_placeholders`` /
    ``image_hashes`` / ``pixel_values`` / ``image_grid_thw``, the same for videos, and ``dropped_media`` (items cut
    off by ``sft_max_length``). ``SFTCollate`` turns batches into padded torch tensors, ``PrimeRLCollate`` into
    prime-rl's SFT micro batches.

    ``tokenizer`` / ``processor``: as ``build_dataset`` (a directory, hub name, None = the embedded Qwen2-VL
    tokenizer), or loaded transformers objects (a tokenizer, fast or slow; a processor, which as ``tokenizer`` is
    also the processor unless one is given). Objects are never pickled to the actors: a tokenizer loaded from a local
    directory and unchanged since is passed as that directory; anything else is saved once to a temporary model
    directory the actors load (``actors.sft.SavedModel``). ``role_to_mask`` / ``content_sft_roles``: as
    ``build_training_sample`` (``role_to_mask`` picklable; required for non-ChatML templates). ``no_target``:
    ``drop`` (default, prime-rl's rule) or ``keep`` samples whose window holds no trained target; dropped ones are
    counted as ``dropped_no_target``. ``ledger``: a ``RunLedger`` that receives per-batch counts (rows in = samples
    out + filtered + quarantined + dropped_no_target). Bad conversations are quarantined (``on_bad_row:
    quarantine``) or raise ``BadRowError``.
    """
    cfg = DataConfig.from_any(config)
    check_sft_config(cfg)
    check_no_target(no_target)
    if processor is None and is_processor_object(tokenizer):
        processor = tokenizer  # create_renderer's reading of a processor given as the tokenizer
    check_model_paths(tokenizer, processor)
    plan = plan or plan_sft_input(files, cfg, epoch=epoch, multimodal=processor is not None)
    from actors import SFTRenderActor, SFTVisionActor

    tokenizer = model_for_actors(tokenizer, "tokenizer")
    processor = model_for_actors(processor, "processor")
    context = plan.context(ledger)
    render = {
        "config": cfg,
        "context": context,
        "tokenizer": tokenizer,
        "processor": processor,
        "role_to_mask": role_to_mask,
        "content_sft_roles": frozenset(content_sft_roles) if content_sft_roles else None,
        "no_target": no_target,
    }
    # one read unit per call; the actor batches (and packs) by tokenizer_batch_size
    ds = read_units_into_pool(plan, cfg, context, SFTRenderActor, render, epoch=epoch)
    if processor is None:
        return ds
    return map_on_pool(ds, cfg, "vision", SFTVisionActor, {"config": cfg, "context": context, "processor": processor})
