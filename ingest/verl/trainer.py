"""``ingest_trainer``: a verl trainer class whose dataloaders are ``VerlDataLoader``\\ s.

It replaces only where the dataloaders come from. verl's own dataloader code still runs, over ``IngestDataset``
stand-ins with our loaders' exact lengths, so its checks and its step arithmetic (``total_training_steps`` into the
actor and critic optimizer configs) are verl's code, not a copy; then the loaders take the place of verl's.

- ``RayPPOTrainer`` (verl 0.5, 0.6, 0.7, and 0.9's legacy trainer): its ``_create_dataloader`` gets the datasets verl's
  ``TaskRunner`` built; ``IngestDataset``\\ s when ``data.custom_cls`` selects it, else stand-ins made here.
- verl 0.9's v1 trainers (``PPOTrainer`` subclasses: ``sync``, ``colocate_async``, ``separate_async``): their
  ``_init_dataloader`` builds the datasets itself, through ``data.custom_cls``, which is pointed at
  ``IngestDataset`` for that call; verl may set ``gen_batch_size`` to 1 there (async modes fetch single prompts),
  and the train loader takes the batch size verl settled on, holding handed-off media for the steps in flight.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from ingest.rollout_media import HELD_BATCHES
from ingest.verl.dataset import CUSTOM_CLS, IngestDataset, data_mapping, select_ingest_dataset
from ingest.verl.loader import VerlDataLoader

logger = logging.getLogger(__name__)


def _stand_in(dataset: Any, files: Any, tokenizer: Any, processor: Any, data: Any, split: str) -> IngestDataset:
    """``dataset`` where it is an ``IngestDataset``, else one over ``files`` for verl's ``split`` ("train" / "val":
    its ``max_samples``)."""
    if isinstance(dataset, IngestDataset):
        return dataset
    if dataset is not None:
        logger.warning(
            "verl built its own %s before the trainer (a whole load and overlong-filter pass); "
            "data.custom_cls {path: %s, name: %s} skips it",
            type(dataset).__name__,
            CUSTOM_CLS["path"],
            CUSTOM_CLS["name"],
        )
    return IngestDataset(files, tokenizer, processor, data, max_samples=data.get(f"{split}_max_samples", -1))


def _loaders(
    train: IngestDataset, val: IngestDataset, data: Any, warmup_batches: float = 0
) -> tuple[VerlDataLoader, VerlDataLoader]:
    """verl's train loader (``gen_batch_size or train_batch_size``, last short batch dropped) and val loader
    (``val_batch_size``, None: every row in one batch; order ``validation_shuffle``). Where the train loader's
    batches are smaller than a step (verl's v1 trainers fetch single prompts, then submit a step's at once, and the
    async modes ``warmup_batches`` steps' more first), its handed-off media stay held for the steps in flight."""
    config = data_mapping(data)
    step = config["train_batch_size"]
    batch = config.get("gen_batch_size") or step
    held = step * (HELD_BATCHES + math.ceil(warmup_batches)) if batch < step else None
    val_shuffle = bool(config.get("validation_shuffle", True))
    return (
        train.loader(batch, drop_last=True, media_held=held),
        val.loader(config.get("val_batch_size"), drop_last=False, shuffle=val_shuffle),
    )


def _report(trainer: Any) -> None:
    logger.info(
        "%s: the train and val dataloaders are the ingest pipeline's (%d and %d batches per epoch)",
        type(trainer).__name__,
        len(trainer.train_dataloader),
        len(trainer.val_dataloader),
    )


def is_ingest_trainer(trainer_cls: type) -> bool:
    """Whether ``trainer_cls`` came from ``ingest_trainer`` (wrapping it twice would build the loaders twice)."""
    return getattr(trainer_cls, "_ingest_loaders", False)


def _is_v1(trainer_cls: type) -> bool:
    return hasattr(trainer_cls, "_init_dataloader") and not hasattr(trainer_cls, "_create_dataloader")


def ingest_trainer(trainer_cls: type) -> type:
    """``trainer_cls`` (verl's ``RayPPOTrainer``, or a verl 0.9 v1 ``PPOTrainer`` subclass) whose
    ``train_dataloader`` / ``val_dataloader`` are this pipeline's. Build it as verl builds the original; the model
    path is the tokenizer's ``name_or_path`` (verl loads tokenizer and processor from
    ``actor_rollout_ref.model.path``)."""
    if _is_v1(trainer_cls):
        return _named(_v1_trainer(trainer_cls), trainer_cls)

    class IngestPPOTrainer(trainer_cls):
        def _create_dataloader(self, train_dataset: Any, val_dataset: Any, collate_fn: Any, train_sampler: Any):
            from torch.utils.data import SequentialSampler

            data = self.config.data
            train = _stand_in(train_dataset, data.train_files, self.tokenizer, self.processor, data, "train")
            val = _stand_in(val_dataset, data.val_files, self.tokenizer, self.processor, data, "val")
            super()._create_dataloader(train, val, collate_fn or list, SequentialSampler(train))
            self.train_dataloader, self.val_dataloader = _loaders(train, val, data)
            _report(self)

    return _named(IngestPPOTrainer, trainer_cls)


def _v1_trainer(trainer_cls: type) -> type:
    class IngestPPOTrainer(trainer_cls):
        def _init_dataloader(self):
            select_ingest_dataset(self.config)
            data = self.config.data
            super()._init_dataloader()  # verl's own: IngestDataset stand-ins, its samplers, its step arithmetic
            warmup = self.config.trainer.v1.get(self.trainer_mode, {}).get("num_warmup_batches", 0) or 0
            self.train_dataloader, self.val_dataloader = _loaders(self.train_dataset, self.val_dataset, data, warmup)
            self.train_dataloader_it = None
            _report(self)

    return IngestPPOTrainer


def _named(cls: type, base: type) -> type:
    cls.__qualname__ = cls.__name__ = f"Ingest{base.__name__}"
    cls._ingest_loaders = True
    return cls
