"""``build_sft_dataset``: Parquet conversations -> read units -> SFT render actor pool (renderers'
``build_training_sample`` per row) -> rows of shifted, truncated, optionally packed training samples; ``SFTCollate``
(``ingest.rowformat.sft_collate``) pads them into torch tensors per batch.

The read side is the RL pipeline's (``plan_input``, ``ParquetUnitsDatasource``, provenance columns, the read fused
into the actor pool); the stage is in ``ingest.stages.sft``. Beside this builder: its argument checks
(``sft_checks``), its planning (``sft_plan``) and the hand-over of model objects to the actors (``saved_models``).
See docs/sft.md.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Collection, Mapping
from typing import Any

import ray

from ingest.config import DataConfig
from ingest.datasets.plan import FilesArg, InputPlan
from ingest.datasets.pools import read_units_into_pool
from ingest.datasets.saved_models import is_processor_object, model_for_actors
from ingest.datasets.sft_checks import check_model_paths, check_no_target, check_sft_config
from ingest.datasets.sft_plan import plan_sft_input
from ingest.sft.engine import check_role_to_mask, import_renderers, renderer_config
from ingest.tokenizer.offline import resolve_model_path

__all__ = ["build_sft_dataset"]


def build_sft_dataset(
    files: FilesArg,
    tokenizer: Any = None,
    config: DataConfig | Mapping[str, Any] | None = None,
    processor: Any = None,
    *,
    renderer: Any = None,
    epoch: int = 0,
    ledger=None,
    plan: InputPlan | None = None,
    role_to_mask: Callable[[Mapping[str, Any]], bool] | None = None,
    content_sft_roles: Collection[str] | None = None,
    ensure_final_stop: bool = False,
    no_target: str = "drop",
) -> ray.data.Dataset:
    """A Ray Dataset of SFT training rows for the conversations in ``files``, each sample renderers' own
    ``build_training_sample(renderer, messages, tools=..., role_to_mask=..., content_sft_roles=...,
    ensure_final_stop=..., message_loss_mask=...)``.

    ``renderer``: what prime-rl passes: a renderers config (``Qwen3RendererConfig()``, ...) or a renderer made by
    ``renderers.create_renderer`` (its config is used), with the ``tokenizer`` (or ``processor``) it was made from;
    None: ``create_renderer(tokenizer)``'s own choice. Each actor builds the renderer once. A multimodal renderer
    loads its processor from the tokenizer's directory (renderers' rule): pass the processor directory (or object)
    as ``processor`` and the actors load the tokenizer from it.

    Input columns: ``messages`` (``sft_messages_key``: a message list, or its JSON string), else ``prompt`` +
    ``completion`` (message lists, or strings: one user / one assistant message); optional ``tools`` (list or JSON
    string), ``message_loss_mask`` (one 0/1 per message), ``images`` (values for ``{"type": "image"}`` parts, or for
    ``<image>`` markers in string content: HF ``Image()`` structs, bytes or paths) and ``videos``.

    Output rows (Arrow, no Python objects): ``input_ids``, ``target_ids`` (the next token), ``loss_mask`` (aligned
    with ``target_ids``), ``seq_lens`` (the samples in the row; one entry unless ``sft_pack_token_budget`` > 0)
    and, with a multimodal renderer, ``mm_token_type_ids`` (null for text rows), ``image_placeholders`` /
    ``image_hashes`` / ``pixel_values`` / ``image_grid_thw`` (renderers' own items), the same for videos, and
    ``dropped_media`` (items cut off by ``sft_max_length``). ``SFTCollate`` turns batches into padded torch tensors,
    ``PrimeRLCollate`` into prime-rl's SFT micro batches.

    ``tokenizer`` / ``processor``: a directory, hub name, None = the embedded Qwen2-VL tokenizer, or loaded
    transformers objects. Objects are never pickled to the actors: a tokenizer loaded from a local directory and
    unchanged since is passed as that directory; anything else is saved once to a temporary model directory the
    actors load (``actors.sft.SavedModel``). ``role_to_mask`` must pickle. ``no_target``: ``drop`` (default,
    prime-rl's rule) or ``keep`` samples whose window holds no trained target; dropped ones are counted as
    ``dropped_no_target``. ``ledger``: a ``RunLedger`` that receives per-batch counts (rows in = samples out +
    filtered + quarantined + dropped_no_target). Bad conversations (the pipeline's checks, or renderers refusing
    them) are quarantined (``on_bad_row: quarantine``) or raise ``BadRowError``, with file, row and reason.
    """
    renderers = import_renderers()
    cfg = DataConfig.from_any(config)
    check_sft_config(cfg)
    check_no_target(no_target)
    if processor is None and is_processor_object(tokenizer):
        processor = tokenizer
    model = processor if processor is not None else tokenizer
    check_model_paths(tokenizer, processor)
    # the renderer once on the driver: an unknown model or a tokenizer the renderer refuses fails here, in
    # renderers' words, before any actor starts
    driver_renderer = renderers.create_renderer(_loaded_tokenizer(model, cfg), renderer_config(renderer))
    check_role_to_mask(driver_renderer, role_to_mask)
    plan = plan or plan_sft_input(files, cfg, epoch=epoch, multimodal=renderers.is_multimodal(driver_renderer))
    from actors import SFTRenderActor

    context = plan.context(ledger)
    render = {
        "config": cfg,
        "context": context,
        "tokenizer": model_for_actors(model, "processor" if processor is not None else "tokenizer"),
        "renderer_config": driver_renderer.config,
        "role_to_mask": role_to_mask,
        "content_sft_roles": frozenset(content_sft_roles) if content_sft_roles else None,
        "ensure_final_stop": ensure_final_stop,
        "no_target": no_target,
    }
    # one read unit per call; the actor batches (and packs) by tokenizer_batch_size
    return read_units_into_pool(plan, cfg, context, SFTRenderActor, render, epoch=epoch)


def _loaded_tokenizer(model: Any, cfg: DataConfig) -> Any:
    """A transformers tokenizer for ``model`` (a path, hub name or None, loaded; a processor's own tokenizer)."""
    if model is None or isinstance(model, str | os.PathLike):
        path = resolve_model_path(model)
        stamp = os.path.getmtime(path) if os.path.isdir(path) else None
        return _tokenizer_at(path, stamp, cfg.trust_remote_code)
    return getattr(model, "tokenizer", None) if is_processor_object(model) else model


@functools.lru_cache(maxsize=4)
def _tokenizer_at(path: str, stamp: float | None, trust_remote_code: bool) -> Any:
    """The driver's tokenizer for its renderer check, loaded once per directory (and its modification time): a
    training loop builds a dataset per epoch from the same one. Only read here."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
