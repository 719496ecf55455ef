"""``ingest_trainer``: verl's ``RayPPOTrainer`` (0.5, 0.6, 0.9's legacy trainer) with ``VerlDataLoader``\\ s.

The subclass replaces only where the dataloaders come from. verl's own ``_create_dataloader`` still runs, over
stand-ins with our loaders' exact lengths, so its checks and its step arithmetic (``total_training_steps`` into the
actor and critic optimizer configs) are verl's code, not a copy; then the stand-ins give way to the loaders.
"""

from __future__ import annotations

from typing import Any

from ingest.verl.loader import VerlDataLoader


class _Rows:
    """A map-style stand-in with ``n`` rows: what verl's ``_create_dataloader`` sizes its loaders by."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        raise RuntimeError("the pipeline's VerlDataLoader yields the batches, not this stand-in")


def _container(data) -> dict:
    try:
        from omegaconf import OmegaConf

        return OmegaConf.to_container(data, resolve=True)
    except ValueError:
        return dict(data)


def _files(value) -> list[str]:
    return [value] if isinstance(value, str) else [str(v) for v in value]


def dataloaders(data, model_path: str, with_processor: bool) -> tuple[VerlDataLoader, VerlDataLoader]:
    """The train and val loaders of a verl ``data:`` config: ``row_format`` defaults to the installed verl's; the
    train batch is ``gen_batch_size or train_batch_size`` (last short batch dropped); the val batch is
    ``val_batch_size`` (None: all rows), its order ``validation_shuffle``."""
    config = _container(data)
    config.setdefault("row_format", "auto")
    processor = model_path if with_processor else None
    batch = config.get("gen_batch_size") or config["train_batch_size"]
    train = VerlDataLoader(_files(config["train_files"]), model_path, config, batch, processor)
    val_config = {**config, "shuffle": bool(config.get("validation_shuffle", True))}
    val_batch = config.get("val_batch_size")
    val = VerlDataLoader(_files(config["val_files"]), model_path, val_config, val_batch, processor, drop_last=False)
    return train, val


def ingest_trainer(trainer_cls: type) -> type:
    """``trainer_cls`` (verl's ``RayPPOTrainer``) whose ``train_dataloader`` / ``val_dataloader`` are this
    pipeline's. Build it as verl's ``TaskRunner`` builds ``RayPPOTrainer``; the model path is the tokenizer's
    ``name_or_path`` (verl loads tokenizer and processor from ``actor_rollout_ref.model.path``)."""

    class IngestPPOTrainer(trainer_cls):
        def _create_dataloader(self, train_dataset: Any, val_dataset: Any, collate_fn: Any, train_sampler: Any):
            from torch.utils.data import SequentialSampler

            model_path = self.tokenizer.name_or_path
            train, val = dataloaders(self.config.data, model_path, self.processor is not None)
            stand_in = _Rows(train.num_rows)
            super()._create_dataloader(stand_in, _Rows(val.num_rows), collate_fn or list, SequentialSampler(stand_in))
            self.train_dataloader, self.val_dataloader = train, val

    IngestPPOTrainer.__qualname__ = IngestPPOTrainer.__name__ = f"Ingest{trainer_cls.__name__}"
    return IngestPPOTrainer
